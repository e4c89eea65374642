"""Lab 07 (memory): count the bytes one training step needs (parameters, gradients, optimizer
state, activations), measure the peak during backward, and shrink it: activation checkpointing per
block (still linear in depth) and in sqrt(L) segments (sublinear, Chen et al. 2016), gradient
accumulation. Swapping a model through a small device: labs/lab07_swapping.py.

Run:  ./run.sh 07      (or: ./run.sh labs/lab07_memory.py; rank 0 prints the counts and the
                        checkpointing sweep; the numbers are the same on every rank)

Two ways to see memory: *counting* what autograd saves for backward (`SavedTensorBytes`, a
saved-tensors hook, helpers/memory.py: exact, and what the formulas talk about) and *measuring*
every allocation (`peak_memory`: torch.profiler with profile_memory=True on the CPU;
`torch.cuda.max_memory_allocated` does it on a GPU), which also sees the temporaries and the
recomputation during backward.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from helpers import runs
from helpers.dist import DistContext, distributed
from helpers.memory import SavedTensorBytes, allocations, event_start, memory_profile
from helpers.tensors import nbytes, seeded

# ---------------------------------------------------------------------------------------------
# A model made of blocks (the unit of checkpointing and of swapping)
# ---------------------------------------------------------------------------------------------
class Block(nn.Module):
    """Residual MLP block: x + W2 gelu(W1 x), x: (B, width)."""

    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def make_blocks(width: int, depth: int, seed: int = 0) -> nn.Sequential:
    with seeded(seed):
        return nn.Sequential(*[Block(width) for _ in range(depth)])


def make_regression_data(num_samples: int, width: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (N, width) and targets (N, width) from a fixed random teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, width, generator=g)
    teacher = torch.randn(width, width, generator=g) / width ** 0.5
    return x, torch.tanh(x @ teacher)


def run_blocks(model: nn.Sequential, x: torch.Tensor, use_checkpoint: bool = False,
               segments: int | None = None) -> torch.Tensor:
    """Forward through the blocks. `use_checkpoint`: each block keeps only its input and recomputes
    its insides during backward. `segments`: `checkpoint_sequential` cuts the L blocks into that
    many segments; each keeps its input and recomputes its blocks during backward (the last
    segment runs normally). Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost",
    arXiv:1604.06174: with sqrt(L) segments of sqrt(L) blocks the memory grows as sqrt(L).
    preserve_rng_state=False: the blocks draw no random numbers (no dropout), so there is no RNG
    state to replay; by default each checkpoint keeps a copy of it (5 KiB for the CPU's)."""
    if segments is not None:
        return checkpoint_sequential(model, segments, x, use_reentrant=False,
                                     preserve_rng_state=False)
    for block in model:
        x = (checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)
             if use_checkpoint else block(x))
    return x


# ---------------------------------------------------------------------------------------------
# Counting memory: parameters, gradients, optimizer state, activations
# ---------------------------------------------------------------------------------------------
MEMORY_PRECISIONS = ("fp32", "bf16 autocast", "bf16")


def count_training_memory(model: nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str,
                          use_checkpoint: bool = False) -> dict[str, int]:
    """Bytes of one Adam training step of a copy of `model` on the batch (x, y), counted by part.

    precision: "fp32"; "bf16 autocast" (fp32 parameters, matmuls in bf16: mixed precision);
    "bf16" (parameters, gradients and Adam state all in bf16). Activations are what autograd
    saves during the forward pass (SavedTensorBytes), the peak they reach before backward frees
    them; "weight copies (in activations)" is the part of them that are casts of the weights.
    """
    if precision not in MEMORY_PRECISIONS:
        raise ValueError(f"precision must be one of {MEMORY_PRECISIONS}, got {precision!r}")
    model = copy.deepcopy(model)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
        x = x.to(torch.bfloat16)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    autocast_on = precision == "bf16 autocast"
    with SavedTensorBytes(exclude=params) as saved:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast_on):
            out = run_blocks(model, x, use_checkpoint)
        loss = F.mse_loss(out.float(), y)
    loss.backward()
    opt.step()  # Adam creates its state (exp_avg, exp_avg_sq, step) on the first step
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    counts = {"parameters": nbytes(params), "gradients": nbytes(p.grad for p in params),
              "optimizer state": nbytes(state), "activations": saved.bytes}
    counts["total"] = sum(counts.values())
    counts["weight copies (in activations)"] = saved.weight_copy_bytes
    return counts


# ---------------------------------------------------------------------------------------------
# Gradient accumulation
# ---------------------------------------------------------------------------------------------
def accumulate_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batches: int,
                         loss_fn: Callable = F.mse_loss) -> float:
    """Leave in .grad the gradient of the mean loss over the whole batch, computed in
    `micro_batches` pieces: each piece's mean loss is weighted by its share of the rows, so the sum
    of the pieces' gradients is the full batch's gradient. Returns the full batch's mean loss."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for xs, ys in zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches)):
        loss = loss_fn(model(xs), ys) * (xs.shape[0] / x.shape[0])
        loss.backward()  # adds into .grad
        total += loss.item()
    return total


# ---------------------------------------------------------------------------------------------
# Measuring the peak: every allocation, forward and backward (recomputation included)
# ---------------------------------------------------------------------------------------------
def peak_memory(forward: Callable[[], torch.Tensor]) -> dict[str, int]:
    """Run `loss = forward()` and `loss.backward()` on the CPU under torch.profiler
    (profile_memory=True) and replay its allocation events. Returns, in bytes above the level
    before the step: "after forward" (what the forward pass left allocated: mostly the saved
    activations), "peak forward" and "peak backward" (the highest level during each phase)."""
    from torch.profiler import record_function

    with memory_profile() as prof:
        loss = forward()
        with record_function("course::backward"):
            loss.backward()
        del loss
    backward_starts = event_start(prof, "course::backward")
    level, peaks, after_forward = 0, {"forward": 0, "backward": 0}, None
    for time_ns, size in allocations(prof):
        phase = "forward" if time_ns < backward_starts else "backward"
        if phase == "backward" and after_forward is None:
            after_forward = level
        level += size
        peaks[phase] = max(peaks[phase], level)
    return {"after forward": level if after_forward is None else after_forward,
            "peak forward": peaks["forward"], "peak backward": peaks["backward"]}


CHECKPOINT_MODES = ("none", "per block", "sqrt(L) segments")


def sqrt_segments(depth: int) -> int:
    """Segments for "sqrt(L) segments": round(sqrt(depth)) (Chen et al. 2016). With L a perfect
    square they divide the blocks evenly (checkpoint_sequential runs its last segment, the
    remainder, without checkpointing)."""
    return max(1, round(math.sqrt(depth)))


def checkpointing_peaks(depth: int, width: int, rows: int, mode: str) -> dict[str, int]:
    """peak_memory of one forward/backward of make_blocks(width, depth) on `rows` rows, with
    checkpointing `mode`. Gradients are allocated beforehand (a previous step's, zeroed in place),
    so the peaks are activations, recomputation and temporaries only."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"mode must be one of {CHECKPOINT_MODES}, got {mode!r}")
    model = make_blocks(width, depth)
    x, y = make_regression_data(rows, width)
    F.mse_loss(model(x), y).backward()
    model.zero_grad(set_to_none=False)
    segments = sqrt_segments(depth) if mode == "sqrt(L) segments" else None
    return peak_memory(lambda: F.mse_loss(
        run_blocks(model, x, use_checkpoint=mode == "per block", segments=segments), y))


def checkpointing_sweep(depths: list[int], width: int, rows: int) -> list[dict]:
    """checkpointing_peaks for every depth and mode; bytes also in units of one block input
    (rows x width floats), the unit the formulas count in."""
    unit = 4 * rows * width
    rows_out = []
    for depth in depths:
        for mode in CHECKPOINT_MODES:
            peaks = checkpointing_peaks(depth, width, rows, mode)
            rows_out.append({"depth": depth, "mode": mode, **peaks,
                             "peak backward / block input": peaks["peak backward"] / unit})
    return rows_out


@dataclass(frozen=True)
class Run(runs.Run):
    """The model whose Adam step is counted (8 blocks of width, a batch of rows); the depths,
    width and rows of the checkpointing sweep; notebook 07's gradient-accumulation model."""
    width: int = 512
    rows: int = 512
    depths: tuple[int, ...] = (4, 16, 64, 256)
    sweep_width: int = 64
    sweep_rows: int = 128
    accumulate_width: int = 256
    accumulate_rows: int = 256
    SMOKE = dict(width=128, rows=128, depths=(4, 16, 64), sweep_width=32, sweep_rows=32,
                 accumulate_width=64, accumulate_rows=64)


def run(ctx: DistContext, cfg: Run) -> None:
    """Count one Adam step's bytes and sweep checkpointing over depth; print on rank 0."""
    from helpers.show import format_table

    width, rows = cfg.width, cfg.rows
    model = make_blocks(width, 8)
    x, y = make_regression_data(rows, width)
    counts = {precision: count_training_memory(model, x, y, precision) for precision in MEMORY_PRECISIONS}
    ctx.print0(format_table([{"precision": p, **{k: v / 2**20 for k, v in c.items()}}
                             for p, c in counts.items()], floatfmt=".3g"))
    sweep = checkpointing_sweep(list(cfg.depths), cfg.sweep_width, cfg.sweep_rows)
    ctx.print0(format_table([{k: r[k] for k in ("depth", "mode", "peak backward / block input")}
                             for r in sweep], floatfmt=".1f"))
    ctx.report(counts=counts, checkpointing=sweep)


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        run(ctx, cfg)


if __name__ == "__main__":
    main()
