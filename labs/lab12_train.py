"""Lab 12 (the composed run): the byte-level model trained with FSDP2 x tensor/sequence parallelism
x pipelining on one (pp, dp, tp) device mesh, checked against one process, with what each rank
holds and sends measured.

Run:  ./run.sh 12      (8 ranks: a 2 x 2 x 2 mesh; alone: NPROC=8 ./run.sh labs/lab12_train.py;
                        on 4 ranks the mesh is pp 2 x tp 2, on 2 ranks tp 2: labs/lab12_parallelize.py's
                        mesh_shape)

Each rank builds the model on the meta device, keeps its pipeline stage (`pipeline_stage`),
parallelises it (`parallelize`: tensor + sequence parallelism on mesh["tp"], FSDP2 on mesh["dp"]),
materialises its shards (`to_empty`, `init_weights`) and wraps the stage in a `PipelineStage`
driven by `Schedule1F1B` over mesh["pp"]. Each step: the dp replica's rows of the global batch go
through the pipeline in micro-batches (the last stage computes the loss, split over the vocabulary
under `loss_parallel()`), the gradients are clipped to the global norm (`clip_grad_norm_`), AdamW
steps. One process trains the same model on the same whole batches (`train_reference`); the first
steps' losses and the parameters after them are compared (tolerances below).

Measured on every rank: the peak of the materialisation against the whole model's bytes; the
parameters, gradients and optimizer state it holds and the activations a micro-batch keeps for its
backward, and the peak allocated during a step (labs/lab12_memory.py studies it); every collective
and point-to-point message of one step, by mesh dimension (helpers.traffic.TrafficMeter: DTensor's,
FSDP2's, the loss's, the clip's and the pipeline's alike); step times and tokens/s.
The held-out loss every few steps; at the end a sharded checkpoint (labs/lab12_checkpoint.py),
which one process reloads to sample text.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from helpers import pick
from helpers.accounting import held_bytes
from helpers.dist import DistContext, distributed, synchronize
from helpers.memory import SavedTensorBytes, peak_allocated
from helpers.tensors import divide
from helpers.traffic import TrafficMeter
from labs.lab12_checkpoint import checkpoint_report, one_process_model, save
from labs.lab12_model import (LMConfig, batch_at, build_model, canonical_name, corpus, default_config,
                              lm_loss, parameter_count, split, train_reference)
from labs.lab12_parallelize import (MESH_DIMS, clip_grad_norm_, make_mesh, mesh_shape, parallelize,
                                    pipeline_stage)

LAB_NPROC = 8          # ./run.sh 12 launches this lab on 8 ranks (NPROC, when set, wins)
# Against one process, float32: micro-batches, tensor-parallel shards and FSDP's reductions add in
# other orders (~1e-7 relative per op); AdamW's division by sqrt(v) magnifies that for weights
# whose gradients are tiny, so parameters drift apart by ~1e-5 in a few steps.
LOSS_RTOL = 1e-4
PARAM_ATOL = 1e-4
# bf16 parameters (MixedPrecisionPolicy): the losses agree to bf16's 8 bits of mantissa
BF16_LOSS_RTOL = 2e-2
CKPT_DIR = Path(__file__).resolve().parent.parent / "runs" / "lab12" / "train"   # the run's checkpoint


# ================================================================================= one rank's run
class Trainer:
    """One rank's part of the composed run: its stage of the model, parallelised and materialised,
    its optimizer and its pipeline schedule, on a (pp, dp, tp) mesh of every rank."""

    def __init__(self, ctx: DistContext, config: LMConfig, shape: tuple[int, int, int], *,
                 microbatches: int | None = None, loss_parallel: bool = True, bf16: bool = False,
                 activation_checkpointing: bool = False):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        self.ctx, self.config, self.shape = ctx, config, tuple(shape)
        self.pp, self.dp, self.tp = shape
        self.mesh = make_mesh(self.shape, ctx.device.type)
        self.pp_rank, self.dp_rank, self.tp_rank = (self.mesh[d].get_local_rank() for d in MESH_DIMS)
        self.is_first, self.is_last = self.pp_rank == 0, self.pp_rank == self.pp - 1
        self.pp_group = self.mesh["pp"].get_group()
        self.local_batch = divide(config.batch, self.dp, "the global batch over the dp replicas")
        self.microbatches = microbatches or (min(self.local_batch, 2 * self.pp) if self.pp > 1 else 1)
        divide(self.local_batch, self.microbatches, "a replica's rows over the micro-batches")
        self.loss_parallel = loss_parallel     # the context is harmless where the logits are plain
        self.bf16 = bf16
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None

        model = pipeline_stage(build_model(config), self.pp_rank, self.pp)
        self.model = parallelize(model, self.mesh, loss_parallel=loss_parallel, mp_policy=policy,
                                 activation_checkpointing=activation_checkpointing)
        self.materialised = materialise(self.model, ctx.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=0.0)
        self.schedule = None
        if self.pp > 1:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B

            stage = PipelineStage(self.model, self.pp_rank, self.pp, ctx.device, group=self.pp_group)
            # scale_grads: the sum over micro-batches divided by their number, the gradient of
            # the mean loss over the replica's rows (as one process computes it)
            self.schedule = Schedule1F1B(stage, n_microbatches=self.microbatches, loss_fn=lm_loss,
                                         scale_grads=True)
        self.held: dict[str, int] = {}

    # ------------------------------------------------------------------------------ the batches
    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """This dp replica's rows of a global batch, on this rank's device."""
        b = self.local_batch
        return t[self.dp_rank * b:(self.dp_rank + 1) * b].to(self.ctx.device)

    def loss_context(self):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    # ------------------------------------------------------------------------------- one step
    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """The replica's forward and backward on its rows; returns the mean loss of its rows on
        the last stage (None elsewhere). Gradients are left in .grad (averaged over dp by FSDP)."""
        xs, ys = self.rows(x), self.rows(y)
        with self.loss_context():
            if self.schedule is None:
                loss = lm_loss(self.model(xs), ys)
                loss.backward()
                return _plain(loss.detach())
            losses: list[torch.Tensor] = []
            if self.is_first:
                self.schedule.step(xs)
            elif self.is_last:
                self.schedule.step(target=ys, losses=losses)
            else:
                self.schedule.step()
        return torch.stack([_plain(loss.detach()) for loss in losses]).mean() if losses else None

    def step(self, x: torch.Tensor, y: torch.Tensor, *, keep_held: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
        """forward_backward, clip to the global norm, AdamW. Returns (this replica's loss on the
        last stage or None, the total gradient norm)."""
        loss = self.forward_backward(x, y)
        norm = clip_grad_norm_(self.model.parameters(), self.config.max_norm,
                               self.pp_group if self.pp > 1 else None)
        if keep_held:   # the gradients exist now, the optimizer state after the first step
            self.held = self.held_now()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, norm

    def global_loss(self, loss: torch.Tensor | None) -> float:
        """The global batch's mean loss on every rank: averaged over dp on the last stage, then
        summed over pp (the other stages contribute 0)."""
        value = loss.float().clone() if loss is not None else torch.zeros((), device=self.ctx.device)
        if loss is not None and self.dp > 1:
            dist.all_reduce(value, group=self.mesh["dp"].get_group())
            value /= self.dp
        if self.pp > 1:
            dist.all_reduce(value, group=self.pp_group)
        return value.item()

    def train_step(self, data: torch.Tensor, step: int, **kwargs) -> tuple[float, float]:
        """Step `step` of the run on its global batch: (global loss, gradient norm)."""
        x, y = batch_at(data, step, self.config.batch, self.config.seq)
        loss, norm = self.step(x, y, **kwargs)
        return self.global_loss(loss), norm.item()

    @torch.no_grad()
    def eval_loss(self, data: torch.Tensor, batches: int = 4) -> float:
        """Mean loss on `batches` fixed held-out batches (forward only), on every rank."""
        total = 0.0
        for i in range(batches):
            x, y = batch_at(data, i, self.config.batch, self.config.seq, seed=1)
            xs, ys = self.rows(x), self.rows(y)
            with self.loss_context():
                if self.schedule is None:
                    loss = _plain(lm_loss(self.model(xs), ys))
                else:
                    losses: list[torch.Tensor] = []
                    if self.is_first:
                        self.schedule.eval(xs)
                    elif self.is_last:
                        self.schedule.eval(target=ys, losses=losses)
                    else:
                        self.schedule.eval()
                    loss = torch.stack([_plain(v) for v in losses]).mean() if losses else None
            total += self.global_loss(loss)
        return total / batches

    # ------------------------------------------------------------------------- what it holds
    def full_params(self) -> dict[str, torch.Tensor]:
        """This stage's parameters, whole (all-gathered over dp and tp), by plain-model name."""
        return {canonical_name(name): _plain(p.detach()).float().cpu()
                for name, p in self.model.named_parameters()}

    def held_now(self) -> dict[str, int]:
        params = list(self.model.parameters())
        state = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return held_bytes({"parameters": params, "gradients": [p.grad for p in params],
                           "optimizer state": state})


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective over its mesh), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ====================================================================== materialising the model
def materialise(model: nn.Module, device: torch.device) -> dict:
    """`to_empty` + `init_weights` on this rank, with the peak memory it took (bytes above the
    level before): on the CPU from the allocations torch.profiler records, on a GPU from the
    allocator's peak. Returns {"peak": ..., "held": this rank's parameter bytes after}."""
    def run():
        model.to_empty(device=device)
        model.init_weights()

    peak = peak_allocated(run, device)
    return {"peak": peak, "held": held_bytes({"p": model.parameters()})["total"]}


# ================================================================ activations kept for backward
class MicrobatchActivations:
    """While active: what the first micro-batch's forward through this rank's stage keeps for its
    backward (hooks around the stage's forward start and stop a SavedTensorBytes that leaves the
    parameters out). `result()` adds how many micro-batches 1F1B keeps in flight on this stage,
    min(m, pp - stage): their product is the activations this rank holds at the peak of a step."""

    def __init__(self, trainer):
        self.trainer, self.counter, self.calls, self.handles = trainer, SavedTensorBytes(skip_parameters=True), 0, []

    @staticmethod
    def _real(args) -> bool:      # the schedule first runs the stage on fake tensors (shapes)
        from torch._subclasses.fake_tensor import is_fake

        return not any(isinstance(a, torch.Tensor) and (a.is_meta or is_fake(a)) for a in args)

    def _pre(self, module, args):
        if self._real(args):
            self.calls += 1
            if self.calls == 1:
                self.counter.__enter__()

    def _post(self, module, args, output):
        if self._real(args) and self.calls == 1:
            self.counter.__exit__(None, None, None)

    def __enter__(self):
        model = self.trainer.model
        self.handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def result(self) -> dict:
        t = self.trainer
        in_flight = min(t.microbatches, t.pp - t.pp_rank) if t.pp > 1 else 1
        return {"per_microbatch": self.counter.bytes, "in_flight": in_flight,
                "peak": self.counter.bytes * in_flight, "microbatch_rows": t.local_batch // t.microbatches}


# ======================================================================================== the run
def run(ctx: DistContext, *, steps: int | None = None, check_steps: int | None = None,
        eval_every: int | None = None, shape=None, bf16: bool = False, activation_checkpointing: bool = False,
        ckpt_dir: Path | None = CKPT_DIR, config: LMConfig | None = None, sample_bytes: int | None = None,
        eval_batches: int = 4) -> dict:
    """The composed run: `steps` steps, checked against one process over the first `check_steps`,
    the held-out loss every `eval_every` steps, what each rank holds and sends, timings; with
    `ckpt_dir`, a sharded checkpoint at the end, reloaded by rank 0 in one process (held-out loss
    and, with `sample_bytes`, a sample of text). Steps and sample size left out are ./run.sh 12's
    (`parse_args`' defaults), so `run(ctx)` is this lab's run (helpers/launch/run_labs.py)."""
    defaults = parse_args([])
    steps = defaults.steps if steps is None else steps
    check_steps = defaults.check_steps if check_steps is None else check_steps
    eval_every = defaults.eval_every if eval_every is None else eval_every
    sample_bytes = defaults.sample_bytes if sample_bytes is None else sample_bytes
    config = config or default_config()
    shape = tuple(shape or mesh_shape(ctx.world_size))
    train_data, held_out = split(corpus())
    trainer = Trainer(ctx, config, shape, bf16=bf16, activation_checkpointing=activation_checkpointing)
    reference = train_reference(config, check_steps, train_data, device=ctx.device)
    reference_params = {n: p.detach().float().cpu() for n, p in reference["model"].named_parameters()}
    out: dict = {"config": config.as_dict(), "shape": list(shape), "microbatches": trainer.microbatches,
                 "coordinate": {"pp": trainer.pp_rank, "dp": trainer.dp_rank, "tp": trainer.tp_rank},
                 "bf16": bf16, "activation_checkpointing": activation_checkpointing,
                 "parameters": parameter_count(config), "model_bytes": 4 * parameter_count(config),
                 "materialise": trainer.materialised, "reference_losses": reference["losses"],
                 "reference_grad_norms": reference["grad_norms"]}
    losses, norms, seconds, curve = [], [], [], []
    for step in range(steps):
        if eval_every and step % eval_every == 0:
            curve.append([step, trainer.eval_loss(held_out, eval_batches)])
        # measured on the way: the first step's activations, the second's
        # peak during the step and what it holds after, the last step's traffic (none of them is
        # timed: the hooks, the profiler and the dispatch mode cost time themselves)
        held_step = step == min(1, steps - 1)
        probe = MicrobatchActivations(trainer) if step == 0 else contextlib.nullcontext()
        traffic = TrafficMeter(trainer.mesh) if step == steps - 1 else contextlib.nullcontext()
        ctx.barrier()
        start = time.perf_counter()
        x, y = batch_at(train_data, step, config.batch, config.seq)
        with probe, traffic:
            result: list = []
            one_step = lambda: result.append(trainer.step(x, y, keep_held=held_step))  # noqa: E731
            if held_step:
                out["step_peak"] = peak_allocated(one_step, ctx.device)
            else:
                one_step()
            local_loss, norm = result[0]
        synchronize(ctx.device)
        seconds.append(time.perf_counter() - start)
        loss, norm = trainer.global_loss(local_loss), norm.item()   # shared for the report
        if step == 0:
            out["activations"] = probe.result()
        if step == steps - 1:
            out["traffic"] = traffic.summary()
        losses.append(loss)
        norms.append(norm)
        if step + 1 == check_steps:
            mine = trainer.full_params()
            out["max_param_diff"] = max((mine[n] - reference_params[n]).abs().max().item() for n in mine)
            out["stage_params"] = sorted(mine)
    curve.append([steps, trainer.eval_loss(held_out, eval_batches)])
    out.update(losses=losses, grad_norms=norms, step_seconds=seconds, held_out_curve=curve,
               held=trainer.held)
    ref = reference["losses"]
    out["max_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    timed = [t for i, t in enumerate(seconds) if i not in (0, 1, steps - 1)] or seconds
    out["step_s"] = statistics.median(timed)
    out["tokens_per_s"] = config.batch * config.seq / out["step_s"]
    if ckpt_dir is not None:
        folder = save(trainer, Path(ckpt_dir), steps)
        out["checkpoint"] = checkpoint_report(folder, ctx, trainer)
        if ctx.rank == 0:
            from labs.lab12_model import generate, held_out_loss

            model = one_process_model(folder, config)
            out["one_process_held_out"] = held_out_loss(model, held_out, config, eval_batches)
            if sample_bytes:
                out["sample"] = generate(model, "def ", sample_bytes, config)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=pick(150, 6))
    parser.add_argument("--check-steps", type=int, default=pick(5, 3))
    parser.add_argument("--eval-every", type=int, default=pick(25, 3))
    parser.add_argument("--mesh", default="", help="pp,dp,tp (default: from the world size)")
    parser.add_argument("--bf16", action="store_true", help="MixedPrecisionPolicy: bf16 parameters, fp32 reduction")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    parser.add_argument("--ckpt-dir", default="", help="default: runs/lab12/train")
    parser.add_argument("--sample-bytes", type=int, default=pick(200, 40))
    return parser.parse_args(argv)


def main(argv=None) -> None:
    """The run, reported under "train" ({"unsolved": ...} while an exercise is a stub: the
    notebook shows a notice for it), and rank 0's summary."""
    from helpers.notice import attempt
    from helpers.show import table

    args = parse_args(argv)
    shape = tuple(int(v) for v in args.mesh.split(",")) if args.mesh else None
    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else CKPT_DIR
    with distributed() as ctx:
        out = attempt(run, ctx, steps=args.steps, check_steps=args.check_steps, eval_every=args.eval_every,
                      shape=shape, bf16=args.bf16, activation_checkpointing=args.checkpointing,
                      ckpt_dir=ckpt_dir, sample_bytes=args.sample_bytes)
        ctx.report(train=out)
        if "unsolved" in out:
            return
        rtol = BF16_LOSS_RTOL if args.bf16 else LOSS_RTOL
        if ctx.rank == 0:
            s = out["shape"]
            print(f"{' x '.join(map(str, s))} (pp, dp, tp) mesh, {out['microbatches']} micro-batches "
                  f"per replica, {out['parameters']:,} parameters; loss {out['losses'][0]:.4f} -> "
                  f"{out['losses'][-1]:.4f}; held-out {out['held_out_curve'][0][1]:.4f} -> "
                  f"{out['held_out_curve'][-1][1]:.4f}", flush=True)
            print(f"vs one process over {args.check_steps} steps: max relative loss difference "
                  f"{out['max_loss_rel_diff']:.1e} (tolerance {rtol:g}), max |parameter difference| "
                  f"{out['max_param_diff']:.1e} (tolerance {PARAM_ATOL:g})", flush=True)
            print(f"step {1e3 * out['step_s']:.0f} ms (median), {out['tokens_per_s']:.0f} tokens/s; "
                  f"materialising took at most {out['materialise']['peak']:,} bytes on rank 0, the "
                  f"whole model is {out['model_bytes']:,}", flush=True)
            kinds = sorted({k for t in out["traffic"].values() for k in t["calls"]})
            table([{"dimension": dim, **{f"{k} calls": t["calls"].get(k, 0) for k in kinds},
                    "sent KiB": t["sent_bytes"] / 2**10} for dim, t in out["traffic"].items()],
                  title="rank 0: collectives and messages of one step, by mesh dimension")
            if "sample" in out:
                print(f"sample from one process that loaded the checkpoint: {out['sample']!r}", flush=True)
        bad = out["max_loss_rel_diff"] > rtol or (not args.bf16 and out["max_param_diff"] > PARAM_ATOL)
        if bad:
            raise RuntimeError(f"rank {ctx.rank}: the composed run differs from one process beyond the tolerances")

if __name__ == "__main__":
    main()
