"""Lab 08 (ZeRO by hand): data parallelism keeps every model state on every rank; ZeRO stages 1,
2 and 3 shard them. Built here from collectives, checked against one process, measured per rank.

Run:  ./run.sh 08      (this file alone: ./run.sh labs/lab08_zero.py; on 2 and then 4 of
                        4 ranks: NPROC=4 ./run.sh labs/lab08_zero.py --sizes 2,4)

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
arXiv:1910.02054. With Psi parameters and Adam, every data-parallel rank holds the parameters, the
gradients and the optimizer state (two moments). ZeRO shards them over the N ranks, one more
each stage:

  stage 0  nothing (DDP)        all-reduce the gradients; every rank updates everything
  stage 1  optimizer state      reduce-scatter the gradients, update your 1/N, all-gather the
                                parameters (the full gradients are still held until the step)
  stage 2  + gradients          the same collectives, but each unit's gradients are
                                reduce-scattered during backward and the full ones dropped at once
  stage 3  + parameters (FSDP)  all-gather a unit's parameters before its forward, drop them
                                after; gather them again for its backward; reduce-scatter its
                                gradients

A unit is one block of the model. Its parameters are one flat vector padded to a multiple of N;
rank r owns the contiguous slice [r S, (r+1) S), S = padded / N (FSDP's flat parameters and
DeepSpeed's partitions do the same). The model's parameters are views into that vector, so the
slice the optimizer updates is the model's own storage, not a copy.

Every rank trains the same model with each stage on its rows of each global batch, compares its
parameters with one process trained on the whole batch, and reports the bytes it held at the
optimizer step (parameters, gradients, optimizer state: each tensor storage counted once), the
collectives one step issued (counted at the process group, so anything issued from Python is
seen), for stage 2, how many bytes of full gradients were alive at once during backward, and,
for stage 3, how many gathered parameter bytes were alive at once.
"""
from __future__ import annotations

import contextlib
import copy
import math
import weakref
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from helpers import runs
from helpers.accounting import backend_released, held_bytes
from helpers.comm_count import count_collectives, summarize
from helpers.comm_bench import all_gather_single, reduce_scatter_single
from helpers.dist import DistContext, distributed, new_group
from helpers.model_states import model_state_bytes
from helpers.show import table
from helpers.tensors import divide
from labs.lab07_memory import make_blocks
# notebook 08's readings of these runs live in labs/lab08_readings.py (cells call them here)
from labs.lab08_readings import (  # noqa: F401
    PARTS, less_sent_verdict, memory_rows, one_unit_verdict, parity_verdict, peak_verdict,
    shards_verdict)

STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "DDP (stage 0)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
LR = 1e-3


# ============================================================================ model and data
# The model: notebook 07's stack of residual MLP blocks (x + W2 gelu(W1 x), x: (B, width)); each
# block is one ZeRO-3 unit.
make_model = make_blocks


def make_batches(steps: int, global_batch: int, width: int, seed: int = 1) -> list:
    """`steps` global batches (x, y), each (global_batch, width), from a fixed random teacher."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(width, width, generator=g) / width ** 0.5
    batches = []
    for _ in range(steps):
        x = torch.randn(global_batch, width, generator=g)
        batches.append((x, torch.tanh(x @ teacher)))
    return batches


def my_rows(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    rows = divide(t.shape[0], world_size, "the global batch over the data-parallel ranks")
    return t[rank * rows:(rank + 1) * rows]


def train_one_process(model: nn.Module, batches: list, lr: float = LR) -> list[torch.Tensor]:
    """The reference: plain Adam on whole global batches, in this process. Returns the parameters."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for x, y in batches:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


# ============================================================================ the paper's accounting
FP32_ADAM = dict(param_bytes=4, grad_bytes=4, state_bytes=8)          # what this lab holds
MIXED_PRECISION_ADAM = dict(param_bytes=2, grad_bytes=2, state_bytes=12)  # the paper: fp16 p and g,
# K = 12 bytes of fp32 master parameters, momentum and variance: 16 bytes per parameter in all


# model_state_bytes (helpers/model_states.py, imported above): the paper's Figure 1, per rank


def step_sent_bytes(num_params: float, world_size: int, stage: int, elem_bytes: int = 4) -> float:
    """Bytes each rank sends per step with ring collectives: 2(N-1)/N Psi elements for stages 0-2
    (all-reduce, or reduce-scatter + all-gather), 3(N-1)/N for stage 3 (two all-gathers and a
    reduce-scatter): the paper's 2 Psi and 3 Psi, 1.5x DDP's volume."""
    n = world_size
    return (3 if stage == 3 else 2) * (n - 1) / n * num_params * elem_bytes


# ============================================================================ measuring
def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


class Liveness:
    """Bytes of gathered (full) parameter buffers alive now, the most at once, and each change.
    A buffer counts from its creation until the garbage collector frees it (weakref.finalize:
    while any view of it lives, a saved tensor for instance, it stays alive and counted)."""

    def __init__(self):
        self.alive = self.peak = 0
        self.events: list[tuple[str, int]] = []

    def track(self, buffer: torch.Tensor, what: str) -> None:
        self._change(buffer.nbytes, f"gather {what}")
        weakref.finalize(buffer, self._change, -buffer.nbytes, f"free {what}")

    def _change(self, delta: int, what: str) -> None:
        self.alive += delta
        self.peak = max(self.peak, self.alive)
        self.events.append((what, self.alive))


# ============================================================================ the stages
class FlatUnit:
    """One unit's parameters as one flat vector (numel elements, padded to a multiple of N);
    this rank owns elements [lo, hi)."""

    def __init__(self, index: int, module: nn.Module, world_size: int, rank: int):
        self.index, self.module = index, module
        named = list(module.named_parameters())
        self.names = [name for name, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.numel = sum(p.numel() for _, p in named)
        self.padded = math.ceil(self.numel / world_size) * world_size
        shard = self.padded // world_size
        self.lo, self.hi = rank * shard, (rank + 1) * shard
        self.ready = 0                                  # stage 2: gradients accumulated so far
        self.regathered: torch.Tensor | None = None     # stage 3: parameters gathered for backward

    def flatten(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        """The tensors (in parameter order) as one (padded,) vector, zeros in the padding."""
        parts = [t.reshape(-1) for t in tensors]
        pad = torch.zeros(self.padded - self.numel, dtype=parts[0].dtype, device=parts[0].device)
        return torch.cat(parts + [pad])

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each parameter as a view into `flat`, by name."""
        out, offset = {}, 0
        for name, shape in zip(self.names, self.shapes):
            numel = math.prod(shape)
            out[name] = flat[offset:offset + numel].view(shape)
            offset += numel
        return out


@dataclass(frozen=True)
class ParamSlice:
    """What ZeRO-3 keeps for backward instead of a piece of the gathered parameters: where it sat."""
    offset: int
    shape: torch.Size
    stride: tuple[int, ...]


class GatherParameters(torch.autograd.Function):
    """ZeRO-3's pair of collectives for one unit: all-gather its flat parameter from the shards in
    forward; reduce-scatter (average) the flat gradient back to the shards in backward."""

    @staticmethod
    def forward(ctx, shard, zero, unit):  # (S,) -> (padded,)
        ctx.zero, ctx.unit = zero, unit
        return zero.gather(unit, shard.detach(), "forward")

    @staticmethod
    def backward(ctx, grad_full):  # (padded,) -> (S,)
        zero, unit = ctx.zero, ctx.unit
        unit.regathered = None  # the unit's backward is done: drop the parameters gathered for it
        return zero.reduce_scatter_mean(unit, grad_full.contiguous()).clone(), None, None


class ZeroDataParallel:
    """`model` (an nn.Sequential whose children are the units) trained data-parallel over `group`
    with ZeRO `stage` 0-3. Use: zero_grad(); loss = f(zero(x)); loss.backward(); step()."""

    def __init__(self, model: nn.Sequential, stage: int, optimizer_cls=torch.optim.Adam,
                 group=None, **optimizer_kwargs):
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage}")
        self.model, self.stage, self.group = model, stage, group
        self.world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.liveness = Liveness()
        self.units = [FlatUnit(i, m, self.world_size, rank) for i, m in enumerate(model)]
        self.shards = [self._shard(unit) for unit in self.units]  # what this rank's optimizer updates
        self.optimizer = optimizer_cls(self.shards, **optimizer_kwargs)
        self.held_at_step: dict[str, int] = {}
        self.full_grad_peak = 0  # stage 2: most bytes of full gradients alive at once in backward

    def _shard(self, unit: FlatUnit) -> nn.Parameter:
        flat = unit.flatten(p.detach() for p in unit.module.parameters())  # (padded,)
        if self.stage == 3:
            shard = nn.Parameter(flat[unit.lo:unit.hi].clone())  # (S,): all this rank keeps
            for p in unit.module.parameters():
                p.data = torch.empty(0, device=p.device)  # the full parameters go
            return shard
        unit.flat = flat
        for name, view in unit.views(flat).items():  # the model's parameters live in `flat`
            owner, _, leaf = name.rpartition(".")
            setattr(unit.module.get_submodule(owner), leaf, nn.Parameter(view))
        lo, hi = (0, unit.padded) if self.stage == 0 else (unit.lo, unit.hi)
        shard = nn.Parameter(flat[lo:hi])  # a view: the optimizer updates the model's storage
        if self.stage <= 1:  # backward accumulates into views of one flat gradient buffer
            unit.flat_grad = torch.zeros_like(flat)
            for p, g in zip(unit.module.parameters(), unit.views(unit.flat_grad).values()):
                p.grad = g
            shard.grad = unit.flat_grad[lo:hi]
        else:  # stage 2: only this rank's slice of the gradient is kept
            shard.grad = torch.zeros(hi - lo, device=flat.device)
            for p in unit.module.parameters():
                p.register_post_accumulate_grad_hook(
                    lambda param, unit=unit, shard=shard: self._grad_ready(unit, shard))
        return shard

    # ---------------------------------------------------------------- collectives
    def reduce_scatter_mean(self, unit: FlatUnit, flat_grad: torch.Tensor) -> torch.Tensor:
        """Sum `flat_grad` (padded,) over the ranks into this rank's slice, in place (NCCL's
        in-place form: the output is the input's slice), divide by N; returns that (S,) view."""
        mine = flat_grad[unit.lo:unit.hi]
        # SUM then divide (not ReduceOp.AVG): AVG on gloo only exists in recent torch versions.
        reduce_scatter_single(mine, flat_grad, group=self.group)
        return mine.div_(self.world_size)

    def gather(self, unit: FlatUnit, shard: torch.Tensor, when: str) -> torch.Tensor:
        """ZeRO-3: every rank's (S,) shard into a new (padded,) buffer, tracked while it lives."""
        full = torch.empty(unit.padded, dtype=shard.dtype, device=shard.device)
        all_gather_single(full, shard, group=self.group)
        self.liveness.track(backend_released(full), f"unit {unit.index} ({when})")
        return full

    # ---------------------------------------------------------------- training
    def zero_grad(self) -> None:
        for unit, shard in zip(self.units, self.shards):
            if self.stage <= 1:
                unit.flat_grad.zero_()  # keep the buffer: backward accumulates into its views
            elif self.stage == 2:
                shard.grad.zero_()
            else:
                shard.grad = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.units:
            x = self._forward_zero3(unit, x) if self.stage == 3 else unit.module(x)
        return x

    def _forward_zero3(self, unit: FlatUnit, x: torch.Tensor) -> torch.Tensor:
        full = GatherParameters.apply(self.shards[unit.index], self, unit)  # (padded,)
        gathered = full.untyped_storage().data_ptr()

        def pack(t: torch.Tensor):  # autograd saves `t` for backward
            if t.untyped_storage().data_ptr() == gathered:  # a piece of the gathered parameters:
                return ParamSlice(t.storage_offset(), t.shape, t.stride())  # keep where, not what
            return t

        def unpack(saved):  # backward needs it back
            if not isinstance(saved, ParamSlice):
                return saved
            if unit.regathered is None:  # the unit's first use in backward: gather it again
                unit.regathered = self.gather(unit, self.shards[unit.index].detach(), "backward")
            return unit.regathered.as_strided(saved.shape, saved.stride, saved.offset)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return functional_call(unit.module, unit.views(full), (x,))
        # `full` is unreachable once this returns: the unit's parameters are freed

    def _grad_ready(self, unit: FlatUnit, shard: nn.Parameter) -> None:
        """Stage 2, a post-accumulate-grad hook: once all of the unit's gradients are in, reduce-
        scatter them and keep only this rank's slice; the full gradients go at once."""
        params = list(unit.module.parameters())
        unit.ready += 1
        if unit.ready < len(params):
            return
        unit.ready = 0
        alive = sum(p.grad.nbytes for p in self.model.parameters() if p.grad is not None)
        self.full_grad_peak = max(self.full_grad_peak, alive)
        bucket = unit.flatten(p.grad for p in params)  # (padded,), transient
        for p in params:
            p.grad = None
        shard.grad.add_(self.reduce_scatter_mean(unit, bucket))

    def step(self) -> None:
        for unit in self.units if self.stage <= 1 else ():
            if self.stage == 0:
                dist.all_reduce(unit.flat_grad, group=self.group)
                unit.flat_grad.div_(self.world_size)
            else:
                self.reduce_scatter_mean(unit, unit.flat_grad)
        self.optimizer.step()
        self.held_at_step = self.held_bytes()
        for unit in self.units if self.stage in (1, 2) else ():
            all_gather_single(unit.flat, unit.flat[unit.lo:unit.hi], group=self.group)  # in place

    # ---------------------------------------------------------------- inspecting
    def held_bytes(self) -> dict[str, int]:
        params = list(self.model.parameters()) + self.shards
        return held_bytes({"parameters": params, "gradients": [p.grad for p in params],
                           "optimizer state": optimizer_state_tensors(self.optimizer)})

    def full_parameters(self) -> list[torch.Tensor]:
        """Copies of the full parameters in model order (stage 3 gathers: call on every rank)."""
        if self.stage < 3:
            return [p.detach().clone() for p in self.model.parameters()]
        out = []
        for unit, shard in zip(self.units, self.shards):
            with torch.no_grad():
                full = self.gather(unit, shard.detach(), "inspection")
            out += [v.clone() for v in unit.views(full).values()]
        return out


# ============================================================================ the run
def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.cpu() - y.cpu()).abs().max().item() for x, y in zip(a, b))


def spread_over_ranks(params: list[torch.Tensor], group=None) -> float:
    """Largest difference between this rank's parameters and the group's first rank's."""
    flat = torch.cat([p.reshape(-1) for p in params])
    first = flat.clone()
    dist.broadcast(first, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
    diff = (flat - first).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
    return diff.item()


def run_stage(stage: int, model: nn.Module, batches: list, reference: list[torch.Tensor],
              device: torch.device, group=None, keep_params: bool = False) -> dict:
    """Train a copy of `model` with ZeRO `stage`; count the last step's collectives. With
    `keep_params`, the trained full parameters come back too, under "params"."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    zero = ZeroDataParallel(copy.deepcopy(model).to(device), stage, torch.optim.Adam, group, lr=LR)
    for i, (x, y) in enumerate(batches):
        x, y = my_rows(x, rank, world_size).to(device), my_rows(y, rank, world_size).to(device)
        last = i == len(batches) - 1
        if last:  # watch the last step: the same collectives and buffers as every other one
            zero.liveness = Liveness()
        with count_collectives() if last else contextlib.nullcontext([]) as log:
            zero.zero_grad()
            F.mse_loss(zero(x), y).backward()
            zero.step()
    gathered_peak, gathered_events = zero.liveness.peak, list(zero.liveness.events)
    params = zero.full_parameters()
    num_params = sum(p.numel() for p in reference)
    return {"stage": stage, **({"params": params} if keep_params else {}),
            "name": STAGE_NAMES[stage], "world_size": world_size,
            "num_params": num_params, "padded_params": sum(u.padded for u in zero.units),
            "held": zero.held_at_step, "formula": model_state_bytes(num_params, world_size, stage),
            "collectives": summarize(log),
            "sent_formula": step_sent_bytes(num_params, world_size, stage),
            "max_diff_vs_one_process": max_diff(params, reference),
            "max_diff_across_ranks": spread_over_ranks(params, group),
            "unit_bytes": [u.padded * 4 for u in zero.units],
            "unit_grad_bytes": [u.numel * 4 for u in zero.units],
            "full_grad_peak": zero.full_grad_peak if stage == 2 else None,
            "gathered_peak": gathered_peak if stage == 3 else None,
            "gathered_events": gathered_events if stage == 3 else None}


@dataclass(frozen=True)
class Problem:
    """What every lab 08 run trains: `depth` blocks of `width`, Adam for `steps` steps on global
    batches of `global_batch` rows (divisible by 2, 3 and 4 ranks)."""
    width: int = 256
    depth: int = 8
    steps: int = 6
    global_batch: int = 96


PROBLEM_SMOKE = dict(width=32, depth=4, steps=3, global_batch=24)


@dataclass(frozen=True)
class Run(runs.Run, Problem):
    """The problem, and the group sizes every stage runs on (the first n ranks for each n;
    empty: all ranks), e.g. `--sizes 2,4` on 4 ranks."""
    sizes: tuple[int, ...] = ()
    SMOKE = PROBLEM_SMOKE


def problem(cfg: Problem) -> tuple[nn.Module, list, list[torch.Tensor], dict]:
    """The model, its batches, the parameters one process reaches after training on them, and
    the sizes (width, depth, steps, global_batch)."""
    shape = {k: getattr(cfg, k) for k in ("width", "depth", "steps", "global_batch")}
    model = make_model(shape["width"], shape["depth"])
    batches = make_batches(shape["steps"], shape["global_batch"], shape["width"])
    return model, batches, train_one_process(model, batches), shape


def run(ctx: DistContext, cfg: Run) -> dict[int, list[dict]]:
    """Every stage on the first n ranks, for each n in `cfg.sizes` (empty: all ranks); ranks
    outside a group wait for the next one. Returns and reports {n: one record per stage}."""
    sizes = list(cfg.sizes) or [ctx.world_size]
    if max(sizes) > ctx.world_size or min(sizes) < 1:
        raise ValueError(f"--sizes {sizes}: each must be between 1 and the {ctx.world_size} ranks")
    model, batches, reference, shape = problem(cfg)
    runs = {}
    for n in sizes:
        group = None if n == ctx.world_size else new_group(list(range(n)), name=f"first {n} ranks")
        if ctx.rank < n:
            runs[n] = [run_stage(stage, model, batches, reference, ctx.device, group)
                       for stage in STAGES]
    ctx.report(runs={str(n): stages for n, stages in runs.items()}, **shape)
    return runs


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        runs = run(ctx, cfg)
        for n, stages in runs.items() if ctx.rank == 0 else ():
            table(memory_rows(stages), floatfmt=".3g", title=f"ZeRO by hand on {n} ranks, "
                  f"{stages[0]['num_params']:,} parameters, Adam in fp32 (per rank)")


if __name__ == "__main__":
    main()
