"""Lab 14 (low-communication training): DDP, local SGD, DiLoCo and streaming DiLoCo on the same
data and the same number of tokens, over this machine's loopback and over a link slowed on
purpose: bytes per step, time per step, and the held-out loss they reach.

Run:  ./run.sh 14      (alone: NPROC=2 ./run.sh labs/lab14_lowcomm.py; every rank is a replica)

The methods, each rank a replica training on its rows of each step's global batch (labs/
lab14_restart.py's task) with AdamW:
- DDP: every step, the gradients averaged over the replicas (one all-reduce of a flat buffer,
  what DDP's buckets send), then AdamW: one process's training on the global batch.
- local SGD (Stich 2019, arXiv:1805.09767; torchft's `LocalSGD`): each replica steps alone; every
  H steps the parameters are averaged.
- DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
  Models", arXiv:2311.08105; torchft's `DiLoCo`): H inner AdamW steps, then the pseudo-gradient
  (the round's starting parameters minus the replica's) is averaged over the replicas and an outer
  SGD step with Nesterov momentum (lr 0.7, momentum 0.9, the paper's) moves the starting parameters.
- streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping communication",
  arXiv:2501.18512): the model in F fragments, each synchronised every H steps at staggered times
  (one every H/F steps), its all-reduce started `tau` steps before the outer step needs it, so
  that it crosses the link while the replica keeps computing.
- DiLoCo with bf16 pseudo-gradients: the all-reduce in bfloat16 (half the bytes).

The slowed link (helpers/slow_link.py) delays every collective to bytes / bandwidth; the bandwidth
is set from this machine's speed, so that one all-reduce of the whole model takes LINK_STEPS
steps' compute: the same story on a fast and on a slow machine. The lighthouse and the Managers
of torchft run in this launch (labs/lab14_replicas.py's `in_one_launch`); the DiLoCo exercise is
checked against torchft's in labs/lab14_diloco.py.
"""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from helpers.comm_count import count_collectives, ring_bytes_sent
from helpers.dist import DistContext, distributed
from helpers.slow_link import slow_link
from labs.lab12_model import batch_at, corpus, split
from labs.lab14_replicas import in_one_launch, plain_state, load_plain_state
from labs.lab14_restart import Task, lm_loss, make_model, on_the_cpu, rank_batch, task_config, train_text

LINK_STEPS = 4.0                       # one whole-model all-reduce takes this many steps' compute
OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}   # DiLoCo's outer SGD (Douillard et al.)
METHODS = ("DDP", "local SGD", "DiLoCo", "streaming DiLoCo", "DiLoCo, bf16 pseudo-gradients")


class LowPrecisionManager:
    """A torchft Manager whose all-reduces travel in `dtype` (half the bytes in bf16) and land back
    in the caller's float32 tensor; everything else is the Manager's. Keeps the first tensor it
    sent, for the rounding error (`sample`)."""

    def __init__(self, manager, dtype: torch.dtype):
        self._manager, self._dtype, self.sample = manager, dtype, None

    def __getattr__(self, name):
        return getattr(self._manager, name)

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, **kwargs):
        if self.sample is None:
            self.sample = tensor.detach().clone()
        low = tensor.to(self._dtype)
        work = self._manager.allreduce(low, **kwargs)
        return _CopyBack(work, low, tensor)


class _CopyBack:
    def __init__(self, work, low: torch.Tensor, out: torch.Tensor):
        self._work, self._low, self._out = work, low, out

    def wait(self, timeout=None) -> bool:
        done = self._work.wait()
        self._out.copy_(self._low)
        return done

    def get_future(self):
        return self._work.get_future()


def fragments(model: nn.Module, count: int) -> list[nn.Module]:
    """The model's parameters in `count` fragments of consecutive modules (the embedding and the
    first blocks, ..., the last blocks, the final norm and the output layer)."""
    parts = [model.tok_embeddings, *model.layers.values(), model.norm, model.output]
    size = -(-len(parts) // count)
    return [nn.ModuleList(parts[i * size:(i + 1) * size]) for i in range(count)]


def quantisation_error(x: torch.Tensor) -> dict:
    """Relative error (norm of the difference / norm) of x sent in bfloat16, and in int8 with one
    float32 scale per tensor (symmetric: x / max|x| * 127, rounded)."""
    norm = x.norm().item() or 1.0
    scale = x.abs().max().clamp_min(1e-30) / 127
    int8 = (x / scale).round().clamp(-127, 127).to(torch.int8)
    return {"bf16": (x.to(torch.bfloat16).float() - x).norm().item() / norm,
            "int8": (int8.float() * scale - x).norm().item() / norm,
            "bytes per element": {"fp32": 4, "bf16": 2, "int8": 1}}


# =========================================================================== one method's run
def train_method(ctx: DistContext, method: str, steps: int, sync_every: int, fragment_count: int,
                 delay: int, link_bytes_per_s: float | None, task: Task | None = None) -> dict:
    """Train `steps` steps with `method` (one of METHODS) from the common start, over the slowed
    link if `link_bytes_per_s` is given. Returns time, compute time, traffic and losses."""
    from torchft.local_sgd import DiLoCo, LocalSGD

    config, data = task_config(task), train_text()
    model, inner = make_model(config)
    manager, lighthouse, algorithm = None, None, None
    t_setup = time.perf_counter()
    if method != "DDP":
        manager, lighthouse = in_one_launch(ctx, lambda: plain_state(model, inner),
                                            lambda s: load_plain_state(model, inner, s))
        manager_time = time_manager(manager)
        if method == "local SGD":
            algorithm = LocalSGD(manager, model, inner, sync_every=sync_every)
        else:
            low = method.endswith("bf16 pseudo-gradients")
            used = LowPrecisionManager(manager, torch.bfloat16) if low else manager
            parts = fragments(model, fragment_count) if method == "streaming DiLoCo" else [model]
            outers = [torch.optim.SGD(p.parameters(), **OUTER) for p in parts]
            algorithm = DiLoCo(used, parts, inner, outers, sync_every=sync_every,
                               fragment_sync_delay=delay if method == "streaming DiLoCo" else 0)
    losses, compute, curve, step_times = [], [], [], []
    setup_s = time.perf_counter() - t_setup
    link = slow_link(link_bytes_per_s) if link_bytes_per_s else None
    ctx.barrier()
    try:
        with (algorithm or _nothing()), count_collectives() as log, (link or _nothing()) as used_link:
            start, len_before, bytes_by_step = time.perf_counter(), 0, []
            for step in range(steps):
                t0 = time.perf_counter()
                x, y = rank_batch(data, step, config, ctx.rank, ctx.world_size)
                loss = lm_loss(model(x), y)
                loss.backward()
                compute.append(time.perf_counter() - t0)
                if method == "DDP":
                    _average_gradients(model)
                inner.step()          # torchft's hooks run the syncs after the inner step
                inner.zero_grad()
                losses.append(loss.item())
                step_times.append(time.perf_counter() - t0)
                bytes_by_step.append(sum(c.nbytes for c in log[len_before:]))
                len_before = len(log)
                if (step + 1) % sync_every == 0:
                    t_eval = time.perf_counter()
                    curve.append([step + 1, held_out(global_model(model, algorithm), config)])
                    start += time.perf_counter() - t_eval     # evaluation is not training time
            wall = time.perf_counter() - start
    finally:
        t_end = time.perf_counter()
        if manager is not None:
            manager.shutdown(wait=False)
            ctx.barrier()             # every replica is done with the lighthouse
        if lighthouse is not None:
            lighthouse.shutdown()
    sent = sum(c.sent_bytes for c in log)
    out = {"wall": wall, "setup_s": setup_s, "teardown_s": time.perf_counter() - t_end, "step_s": wall / steps, "compute_s": statistics.median(compute),
           "compute_spread": relative_spread(compute), "step_times": step_times,
           "manager": dict(manager_time) if manager is not None else {},
           "calls": len(log), "sent_bytes": sent, "sent_per_step": sent / steps, "losses": losses,
           "link_waited_s": used_link.waited_s if link else 0.0, "curve": curve,
           "link_imposed_s": used_link.imposed_s if link else 0.0, "bytes_by_step": bytes_by_step,
           "held_out": curve[-1][1] if curve and curve[-1][0] == steps else held_out(model, config),
           "params": [p.detach().clone() for p in global_model(model, algorithm).parameters()]}
    if method.endswith("bf16 pseudo-gradients") and used.sample is not None:
        out["quantisation"] = quantisation_error(used.sample)
    return out


def time_manager(manager) -> dict:
    """Count and time the Manager's quorums and commit votes from here on (wraps the instance's
    methods); returns the live tally {"start_quorum calls": n, "start_quorum s": t, ...}."""
    tally: dict = {}
    for name in ("start_quorum", "should_commit"):
        original = getattr(manager, name)

        def timed(*args, _original=original, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                tally[f"{_name} calls"] = tally.get(f"{_name} calls", 0) + 1
                tally[f"{_name} s"] = tally.get(f"{_name} s", 0.0) + time.perf_counter() - t0
        setattr(manager, name, timed)
    return tally


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _average_gradients(model: nn.Module) -> None:
    """DDP's communication: every gradient in one flat buffer, averaged over the replicas."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def held_out(model: nn.Module, config, batches: int = 8) -> list[float]:
    """The loss of each of `batches` fixed held-out batches (the last tenth of the text)."""
    held = split(corpus())[1]
    with torch.no_grad():
        return [lm_loss(model(x), y).item() for x, y in
                (batch_at(held, i, config.batch, config.seq, seed=1) for i in range(batches))]


def global_model(model: nn.Module, algorithm) -> nn.Module:
    """The model to evaluate: for torchft's DiLoCo, a copy holding the global parameters (each
    fragment's last synchronised values, which streaming DiLoCo's replicas share even between
    syncs); otherwise the model itself."""
    fragments_ = getattr(algorithm, "_fragments", None)
    if not fragments_:
        return model
    values = {id(p): fragment.original_parameters[name] for fragment in fragments_
              for name, p in fragment._model_fragment.named_parameters()}
    copy_ = copy.deepcopy(model)
    with torch.no_grad():
        for p, q in zip(model.parameters(), copy_.parameters()):
            q.copy_(values[id(p)])
    return copy_


# ==================================================================================== verdicts
def relative_spread(values: list[float]) -> float:
    """(upper quartile - lower quartile) / median: how much the run's own times vary."""
    if len(values) < 4:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / q[1]


def time_verdict(name: str, seconds: float, baseline: str, baseline_s: float, noise: float) -> str:
    """"<name>'s step is k x faster than <baseline>'s", or "within the noise" when the ratio is
    within `noise` (relative) of 1."""
    ratio = baseline_s / seconds
    if abs(ratio - 1) <= noise:
        return f"{name} and {baseline} take the same time per step, within the noise ({ratio:.2f}x, noise {noise:.0%})"
    faster = ratio > 1
    return (f"{name}'s step is {ratio if faster else 1 / ratio:.2f}x {'faster' if faster else 'slower'} "
            f"than {baseline}'s (noise {noise:.0%})")


def loss_verdict(name: str, losses: list[float], baseline: str, baseline_losses: list[float]) -> str:
    """Held-out losses on the same batches, compared pairwise: "within the noise" when the mean
    difference is within two standard errors of the batch-by-batch differences."""
    diffs = [a - b for a, b in zip(losses, baseline_losses)]
    mean = statistics.mean(diffs)
    stderr = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
    if abs(mean) <= 2 * stderr:
        return (f"{name}'s held-out loss is {baseline}'s within the noise ({mean:+.3f} nats, "
                f"2 standard errors {2 * stderr:.3f})")
    return (f"{name}'s held-out loss is {'lower' if mean < 0 else 'higher'} than {baseline}'s by "
            f"{abs(mean):.3f} nats (2 standard errors {2 * stderr:.3f})")


# ======================================================================================= the lab
def link_for(ctx: DistContext, compute_s: float, model_bytes: int) -> float:
    """Bandwidth (bytes/s) at which one all-reduce of the model takes LINK_STEPS steps' compute on
    the slowest replica (the same on every rank)."""
    slowest = torch.tensor([compute_s])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return ring_bytes_sent("all_reduce", model_bytes, ctx.world_size) / (LINK_STEPS * slowest.item())


@dataclass(frozen=True)
class Run(Task):
    """Inner steps of every method, H (`sync_every`: inner steps between synchronisations), the
    streaming fragments and tau (`delay`: inner steps a fragment's all-reduce has to arrive)."""
    steps: int = 96
    sync_every: int = 8
    fragments: int = 2
    delay: int = 2
    SMOKE = dict(Task.SMOKE, steps=8, sync_every=4, delay=1)

    def __post_init__(self):
        if self.sync_every < 1 or self.steps % self.sync_every:
            raise ValueError(f"--steps must be a multiple of --sync-every, got {self.steps}, {self.sync_every}")
        if not 0 <= self.delay < self.sync_every // max(1, self.fragments) or self.fragments < 1:
            raise ValueError(f"--delay must lie below --sync-every / --fragments, got {self.delay}")


def run(ctx: DistContext, cfg: Run, methods=METHODS, slow_methods=None) -> dict:
    """Every method over loopback, then over the slowed link (`slow_methods`, default: the same);
    rank 0's view (the replicas agree after each method's last sync: checked, `spread`)."""
    steps, sync_every, fragment_count, delay = cfg.steps, cfg.sync_every, cfg.fragments, cfg.delay
    config = task_config(cfg)
    model_bytes = sum(p.numel() * 4 for p in make_model(config)[0].parameters())
    out = {"config": {"steps": steps, "sync_every": sync_every, "fragments": fragment_count,
                      "delay": delay, "replicas": ctx.world_size, "model_bytes": model_bytes,
                      "tokens": steps * config.batch * config.seq, **config.as_dict()},
           "fast": {}, "slow": {}}
    for method in methods:
        out["fast"][method] = train_method(ctx, method, steps, sync_every, fragment_count, delay, None, cfg)
    bandwidth = link_for(ctx, out["fast"]["DDP"]["compute_s"], model_bytes) if "DDP" in methods else 1e9
    out["link_bytes_per_s"] = bandwidth
    for method in methods if slow_methods is None else slow_methods:
        out["slow"][method] = train_method(ctx, method, steps, sync_every, fragment_count, delay, bandwidth, cfg)
    for runs in (out["fast"], out["slow"]):
        for result in runs.values():
            result["spread"] = _spread(result.pop("params"))
    return out


def _spread(params: list[torch.Tensor]) -> float:
    """Largest difference between this replica's parameters and replica 0's."""
    flat = torch.cat([p.reshape(-1) for p in params])
    first = flat.clone()
    dist.broadcast(first, src=0)
    diff = (flat - first).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def main(argv=None) -> None:
    from helpers.show import table

    cfg = Run.from_argv(argv)
    on_the_cpu()
    with distributed() as ctx:
        out = run(ctx, cfg)
        ctx.report(lowcomm=out)
        if ctx.rank == 0:
            for link in ("fast", "slow"):
                table([{"method": m, "KiB sent per step": r["sent_per_step"] / 1024,
                        "ms per step": 1e3 * r["step_s"], "held-out loss": statistics.mean(r["held_out"])}
                       for m, r in out[link].items()], title=f"{link} link")


if __name__ == "__main__":
    main()
