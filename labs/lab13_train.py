"""Lab 13 (the composed run): the grown-up model trained on the 5-D mesh, checked against one
process: losses, the first step's gradients, the parameters and the routers' biases after several
steps; calls and bytes of one step by mesh dimension.

Run:  ./run.sh 13      (alone: NPROC=8 ./run.sh labs/lab13_train.py --mesh dp_shard=2,cp=2,tp=2;
                        smoke mode and 4 ranks: dp_shard 2 x cp 2)

Each rank builds the model whole (it is small; notebook 12 showed the meta device), keeps its
pipeline stage, `parallelize`s it (labs/lab13_parallelize.py), and trains: its dp replica's rows of
every global batch, its cp rank's columns of each row (`cp_positions`: zig-zag), in 1F1B
micro-batches when there is a pipeline, AdamW, then every router's bias step on the load of the
whole batch. The loss of a rank is the mean over its tokens (plus the Switch loss); FSDP averages
the gradients over the ranks of the batch, whose token counts are equal, so the average is one
process's gradient of the whole batch's mean loss. No gradient clipping here (notebook 12's
homework is the global norm). One process trains the same model on the same whole batches
(`train_reference`); the tolerances below are float32's, as in lab 12.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers import runs
from helpers.dist import DistContext, distributed, synchronize
from helpers.runs import LOSS_RTOL, PARAM_ATOL
from helpers.tensors import divide
from labs.lab12_model import canonical_name
from labs.lab13_context import cp_positions, shard_sequence
from labs.lab13_experts import expert_slices
from labs.lab13_model import (MoEConfig, batch_at, build_model, check_model, corpus, default_config, lm_loss,
                              model_loss, split, train_reference)
from labs.lab13_parallelize import FLATTENED, layout_name, make_mesh, parallelize, parse_mesh, pipeline_stage

# Against one process in float32: the course's LOSS_RTOL and PARAM_ATOL (helpers/runs.py), and the
# first step's gradients, which no optimizer step has yet magnified, within GRAD_ATOL.
GRAD_ATOL = 1e-5


# ================================================================================ one rank's run
class Trainer:
    """One rank's part of a run on the mesh of `sizes` (pp, dp_replicate, dp_shard, cp, tp)."""

    def __init__(self, ctx: DistContext, config: MoEConfig, sizes: dict, *, design: str = "ring",
                 reshard_after_forward: bool | None = None, microbatches: int | None = None,
                 parallelize_fn=parallelize):
        self.ctx, self.config, self.sizes = ctx, config, {d: sizes.get(d, 1) for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
        self.mesh = make_mesh(ctx.device.type, **self.sizes)
        self.pp, self.tp = self.sizes["pp"], self.sizes["tp"]
        self.pp_rank = self.mesh["pp"].get_local_rank()
        self.dp_rank, dp = self.mesh["dp"].get_local_rank(), self.mesh["dp"].size()
        cp = self.mesh["cp"]
        self.positions = cp_positions(config.seq, cp.size(), cp.get_local_rank())
        self.local_batch = divide(config.batch, dp, "the global batch over the dp replicas")
        if self.pp > 1 and config.aux_coef:
            raise ValueError("the Switch loss is summed over the MoE layers of every stage: with a pipeline, "
                             "train with bias balancing alone (aux_coef=0)")
        model = build_model(config, ctx.device)
        if self.pp > 1:
            model = pipeline_stage(model, self.pp_rank, self.pp)
        self.model = parallelize_fn(model, self.mesh, reshard_after_forward=reshard_after_forward, design=design)
        self.model = self.model if self.model is not None else model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=0.0)
        self.data_group = self.mesh["dp_cp"].get_group()
        self.schedule = None
        if self.pp > 1:
            self.microbatches = microbatches or min(self.local_batch, 2 * self.pp)
            self.schedule = self._schedule()

    def _schedule(self):
        """1F1B over mesh["pp"], the stage's input and output shapes given (no shape inference:
        a stage's forward routes tokens, which a forward on empty tensors cannot)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        c, rows = self.config, divide(self.local_batch, self.microbatches, "a replica's rows over the micro-batches")
        t = len(self.positions)
        hidden_t = t // self.tp                     # between stages: split along the sequence over tp
        first, last = self.pp_rank == 0, self.pp_rank == self.pp - 1
        inputs = (torch.zeros(rows, t, dtype=torch.long, device=self.ctx.device) if first   # (a later
                  else torch.zeros(rows, hidden_t, c.dim, device=self.ctx.device, requires_grad=True))  # stage sends dx)
        outputs = (torch.zeros(rows, t, c.vocab, device=self.ctx.device, requires_grad=True) if last
                   else torch.zeros(rows, hidden_t, c.dim, device=self.ctx.device, requires_grad=True))
        stage = PipelineStage(self.model, self.pp_rank, self.pp, self.ctx.device, input_args=inputs,
                              output_args=outputs, group=self.mesh["pp"].get_group())
        return Schedule1F1B(stage, n_microbatches=self.microbatches, loss_fn=lm_loss, scale_grads=True)

    # ---------------------------------------------------------------------------------- a step
    def local_batch_of(self, step: int, data: torch.Tensor, seed: int = 0):
        """This rank's inputs and targets of step `step`: its replica's rows, its cp columns."""
        x, y = batch_at(data, step, self.config.batch, self.config.seq, seed=seed)
        rows = slice(self.dp_rank * self.local_batch, (self.dp_rank + 1) * self.local_batch)
        return (shard_sequence(t[rows], self.positions).to(self.ctx.device) for t in (x, y))

    def loss_context(self):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel() if self.tp > 1 and self.pp == 1 else contextlib.nullcontext()

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """The rank's forward and backward; returns its cross-entropy (last stage) or None."""
        with self.loss_context():
            if self.schedule is None:
                logits = self.model(x)
                loss = lm_loss(logits, y)
                total = model_loss(self.model, logits, y)
                total.backward()
                return _plain(loss.detach())
            losses: list[torch.Tensor] = []
            if self.pp_rank == 0:
                self.schedule.step(x)
            elif self.pp_rank == self.pp - 1:
                self.schedule.step(target=y, losses=losses)
            else:
                self.schedule.step()
            return torch.stack([_plain(v.detach()) for v in losses]).mean() if losses else None

    def step(self, data: torch.Tensor, step: int, *, after_backward=None) -> float:
        """One training step: forward, backward, AdamW, the bias step. Returns the global loss."""
        x, y = self.local_batch_of(step, data)
        loss = self.forward_backward(x, y)
        if after_backward is not None:
            after_backward(self)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.loads = self.model.update_biases()     # each MoE layer's load over the whole batch
        return self.global_loss(loss)

    def global_loss(self, loss: torch.Tensor | None) -> float:
        """The global batch's mean cross-entropy on every rank: the mean over the ranks of the
        batch on the last stage (equal token counts), then shared over pp."""
        value = loss.float().clone() if loss is not None else torch.zeros((), device=self.ctx.device)
        if loss is not None:                 # (the tp ranks hold the same loss: not in the group)
            dist.all_reduce(value, group=self.data_group)
            value /= dist.get_world_size(self.data_group)
        if self.pp > 1:
            dist.all_reduce(value, group=self.mesh["pp"].get_group())
        return value.item()

    # ------------------------------------------------------------------ against one process
    def local_pieces(self, tensors: dict[str, torch.Tensor], attr: str = "param") -> dict[str, float]:
        """max |this rank's piece - the same piece of `tensors`| per parameter (attr "param": the
        values, "grad": the gradients), the pieces found from each parameter's placements and, for
        the experts, the part of the layer's experts the module holds."""
        diffs = {}
        slices = self._module_slices()
        for name, p in self.model.named_parameters():
            name = canonical_name(name)
            t = p if attr == "param" else p.grad
            if t is None:
                diffs[name] = math.inf
                continue
            full = tensors[name].to(self.ctx.device)
            if name in slices:
                full = full[slices[name]]
            piece = _piece(t, full)
            diffs[name] = ((_local(t).float() - piece).abs().max().item() if _local(t).shape == piece.shape
                           else math.inf) if _local(t).numel() else 0.0
        return diffs

    def _module_slices(self) -> dict[str, tuple]:
        out = {}
        for key, block in self.model.layers.items():
            if block.moe is None:
                continue
            for part in ("experts", "shared_expert"):
                module = getattr(block.moe, part)
                if module is not None:
                    for w, index in expert_slices(module).items():
                        out[f"layers.{key}.moe.{part}.{w}"] = index
        return out

    def biases(self) -> dict[str, list[float]]:
        return {k: moe.router.bias.tolist() for k, moe in self.model.moe_layers().items()}


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _piece(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """The part of `full` that the DTensor `p` holds on this rank (all of it for a plain tensor)."""
    if not hasattr(p, "device_mesh"):
        return full.float()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(full.shape, p.device_mesh, p.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))].float()


# ====================================================================== collectives by dimension
def traffic_meter(mesh):
    """The course's traffic instrument (helpers.traffic.TrafficMeter) on `mesh`, told the
    flattened dimensions' groups by name (`.calls[dim][kind]`, `.bytes[dim][kind]`, `.sent[dim]`)."""
    from helpers.traffic import TrafficMeter

    return TrafficMeter(mesh, names={name: mesh[name].get_group() for name in FLATTENED})


# ========================================================================== the checked run
def reference_run(config: MoEConfig, steps: int, data: torch.Tensor, device="cpu") -> dict:
    """One process's run (`train_reference`): its losses, first gradients, parameters and biases,
    on the CPU."""
    run = train_reference(config, steps, data, device=device, keep_grads=True)
    model = run["model"]
    return {"losses": run["losses"], "grads": {n: g.cpu() for n, g in run["grads"].items()},
            "params": {n: p.detach().cpu() for n, p in model.named_parameters()},
            "biases": {k: m.router.bias.tolist() for k, m in model.moe_layers().items()}}


def shared_reference(ctx: DistContext, config: MoEConfig, steps: int, data: torch.Tensor) -> dict:
    """`reference_run` on rank 0, sent to every rank (the others would compute the same, sharing
    the same cores)."""
    box = [reference_run(config, steps, data, ctx.device) if ctx.rank == 0 else None]
    if ctx.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def check_run(ctx: DistContext, sizes: dict, *, config: MoEConfig | None = None, steps: int = 3,
              check_steps: int | None = None, design: str = "ring", reshard_after_forward: bool | None = None,
              parallelize_fn=parallelize, traffic_step: int | None = 1, reference: dict | None = None) -> dict:
    """`steps` steps on the mesh of `sizes`, the first `check_steps` (default: all) against one
    process: every step's global loss, the first step's gradients, the parameters and biases after
    the last checked step (max differences over this rank's pieces); one step's traffic by mesh
    dimension (labelled by `dimension_label`); each step's time and MoE load imbalance.
    `reference`: `reference_run`'s result when the caller has it (else rank 0 computes it)."""
    from labs.lab13_model import imbalance
    from labs.lab13_planner import relabel

    config = config or default_config()
    check_steps = min(check_steps or steps, steps)
    data, _ = split(corpus())
    trainer = Trainer(ctx, config, sizes, design=design, reshard_after_forward=reshard_after_forward,
                      parallelize_fn=parallelize_fn)
    reference = reference or shared_reference(ctx, config, check_steps, data)
    ref_params = reference["params"]
    out: dict = {"sizes": trainer.sizes, "layout": layout_name(trainer.sizes), "losses": [], "seconds": [],
                 "imbalance": [], "reference_losses": reference["losses"], "rank": ctx.rank,
                 "pp_rank": trainer.pp_rank, "check_steps": check_steps, "design": design}
    grads: dict = {}

    def keep_grads(t: Trainer) -> None:
        grads.update(t.local_pieces(reference["grads"], "grad"))
    for step in range(steps):
        meter = traffic_meter(trainer.mesh) if step == traffic_step else contextlib.nullcontext()
        ctx.barrier()
        start = time.perf_counter()
        with meter:
            loss = trainer.step(data, step, after_backward=keep_grads if step == 0 else None)
        synchronize(ctx.device)
        out["seconds"].append(time.perf_counter() - start)
        out["losses"].append(loss)
        out["imbalance"].append({k: imbalance(v) for k, v in trainer.loads.items()})
        if step == traffic_step:
            out["traffic"] = relabel(meter.summary(), trainer.sizes)
        if step + 1 == check_steps:
            out["param_diff"] = trainer.local_pieces(ref_params)
            ref_bias = {k: reference["biases"][k] for k in trainer.biases()}
            out["bias_diff"] = max((max(abs(a - b) for a, b in zip(mine, ref_bias[k]))
                                    for k, mine in trainer.biases().items()), default=0.0)
            out["bias_moved"] = max((max(abs(b) for b in v) for v in ref_bias.values()), default=0.0)
    out["grad_diff"] = grads
    checked = list(zip(out["losses"], reference["losses"]))
    out["max_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in checked)
    out["max_grad_diff"] = max(grads.values(), default=0.0)
    out["max_param_diff"] = max(out["param_diff"].values(), default=0.0)
    out["step_s"] = statistics.median(out["seconds"][1:] or out["seconds"])
    return out


def passed(report: dict) -> bool:
    """Within the tolerances of one process: losses, first gradients, parameters, biases."""
    return (report["max_loss_rel_diff"] <= LOSS_RTOL and report["max_grad_diff"] <= GRAD_ATOL
            and report["max_param_diff"] <= PARAM_ATOL and report["bias_diff"] <= 1e-9)


def agreement(reports: list[dict]) -> dict:
    """Every rank's `check_run` report against the tolerances: the worst differences over the
    ranks and whether each is within its tolerance."""
    worst = {"loss": max(r["max_loss_rel_diff"] for r in reports), "gradient": max(r["max_grad_diff"] for r in reports),
             "parameter": max(r["max_param_diff"] for r in reports), "bias": max(r["bias_diff"] for r in reports)}
    tolerance = {"loss": LOSS_RTOL, "gradient": GRAD_ATOL, "parameter": PARAM_ATOL, "bias": 1e-9}
    return {k: {"worst": v, "tolerance": tolerance[k], "within": v <= tolerance[k]} for k, v in worst.items()}


def agreement_sentence(a: dict, steps: int) -> str:
    """`agreement` in words."""
    parts = [f"{k} {v['worst']:.1e} (tolerance {v['tolerance']:g})" for k, v in a.items()]
    ok = all(v["within"] for v in a.values())
    return (f"against one process over {steps} steps, the worst over every rank: " + ", ".join(parts)
            + (": within every tolerance" if ok else f": BEYOND the tolerance for "
               + ", ".join(k for k, v in a.items() if not v["within"])))


def default_sizes(world_size: int) -> dict:
    """The composed run's mesh: dp_shard 2 x cp 2 x tp 2 on 8 ranks, dp_shard 2 x cp 2 on 4."""
    return {8: {"dp_shard": 2, "cp": 2, "tp": 2}, 4: {"dp_shard": 2, "cp": 2}, 2: {"cp": 2}}.get(
        world_size, {"dp_shard": world_size})


@dataclass(frozen=True)
class Run(runs.Run):
    """The composed run on `mesh` ("dp_shard=2,cp=2,tp=2"; empty: `default_sizes` of the ranks)
    for `steps` steps, the first ones checked against one process, with the model `model`
    (lab13_model.MODELS)."""
    model: str = "full"
    mesh: str = ""
    steps: int = 6
    ranks: int | None = 8
    SMOKE = dict(model="smoke", steps=3, ranks=4)
    TOUR = dict(model="smoke", steps=2, ranks=4)   # ./run.sh: a glimpse (every lab in minutes)

    def __post_init__(self):
        check_model(self.model)
        parse_mesh(self.mesh)


def run(ctx: DistContext, cfg: Run) -> dict:
    """The composed run on cfg's mesh (or {"unsolved": ...})."""
    from helpers.notice import attempt

    return attempt(check_run, ctx, parse_mesh(cfg.mesh) or default_sizes(ctx.world_size),
                   config=default_config(cfg.model), steps=cfg.steps)


def main(argv: list[str] | None = None) -> None:
    from helpers.show import table

    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        out = run(ctx, cfg)
        ctx.report(train=out)
        if "unsolved" in out:
            return
        if ctx.rank == 0:
            print(f"{out['layout']}: losses {[round(v, 4) for v in out['losses']]}, one process "
                  f"{[round(v, 4) for v in out['reference_losses']]}", flush=True)
            print(f"max differences: loss {out['max_loss_rel_diff']:.1e} (relative, tolerance {LOSS_RTOL:g}), first "
                  f"gradients {out['max_grad_diff']:.1e} ({GRAD_ATOL:g}), parameters {out['max_param_diff']:.1e} "
                  f"({PARAM_ATOL:g}), biases {out['bias_diff']:.1e}", flush=True)
            kinds = sorted({k for t in out["traffic"].values() for k in t["calls"]})
            table([{"dimension": d, **{f"{k} calls": t["calls"].get(k, 0) for k in kinds}, "sent KiB": t["sent_bytes"] / 2**10}
                   for d, t in out["traffic"].items()], title="rank 0: one step's collectives by mesh dimension")
        if not passed(out):
            raise RuntimeError(f"rank {ctx.rank}: the composed run differs from one process beyond the tolerances")


if __name__ == "__main__":
    main()
