"""Lab 07 (swapping): train a model larger than your memory by swapping its parts between a CPU
store and the device, with gradient accumulation and 2 ranks.

Run:  ./run.sh 07      (or: ./run.sh labs/lab07_swapping.py)

Every rank gets a `BudgetDevice`: the GPU when there is one per rank, else the CPU with a counted
budget. The model's parameters alone do not fit in the budget. The parameters, gradients and
optimizer state live in a CPU store (the optimizer steps there, as in ZeRO-Offload, Ren et al. 2021,
arXiv:2101.06840); each part of the model is copied in, run, and dropped, in the forward pass and
again (recomputed) in the backward pass. Each rank splits its share of the global batch into
micro-batches (gradient accumulation); the gradients are averaged over ranks part by part. Every
rank checks its parameters against plain training on the whole batch in one process.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from helpers import runs
from helpers.dist import DistContext, distributed, synchronize
from helpers.tensors import divide, nbytes
from labs.lab07_memory import SavedTensorBytes, make_blocks, make_regression_data


# ---------------------------------------------------------------------------------------------
# Swapping parts of a model through a device with a memory budget
# ---------------------------------------------------------------------------------------------
class OutOfBudget(MemoryError):
    """Raised by BudgetDevice.allocate when a tensor would not fit in the budget."""


@dataclass
class BudgetDevice:
    """A device with a memory budget: every tensor placed on it is counted, and going over the
    budget raises OutOfBudget. On a GPU the allocator's own peak is measured too (`measured_peak`)."""

    device: torch.device
    budget_bytes: int
    resident: int = 0
    peak: int = 0
    bytes_copied_in: int = 0
    timeline: list[tuple[str, int]] = field(default_factory=list)  # (event, resident bytes after it)
    _baseline: int = 0  # GPU: bytes allocated before start_measuring()

    def allocate(self, size: int, what: str) -> None:
        if self.resident + size > self.budget_bytes:
            raise OutOfBudget(f"{what}: {self.resident} + {size} B resident would exceed the "
                              f"budget of {self.budget_bytes} B")
        self.resident += size
        self.peak = max(self.peak, self.resident)
        self.timeline.append((f"+ {what}", self.resident))

    def free(self, size: int, what: str) -> None:
        self.resident -= size
        self.timeline.append((f"- {what}", self.resident))

    def copy_in(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """A copy of `t` on the device (a real copy, also when the device is the CPU)."""
        self.allocate(t.nbytes, what)
        self.bytes_copied_in += t.nbytes
        return t.detach().to(self.device, copy=True)

    def start_measuring(self) -> None:
        if self.device.type == "cuda":
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)

    def measured_peak(self) -> int | None:
        """Allocator-measured peak above the baseline (GPU only; None on the CPU)."""
        if self.device.type != "cuda":
            return None
        synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self._baseline


def split_parts(model: nn.Sequential, num_parts: int) -> list[nn.Sequential]:
    """Consecutive groups of blocks; the last group is as large or smaller."""
    blocks = list(model)
    size = -(-len(blocks) // num_parts)
    return [nn.Sequential(*blocks[i:i + size]) for i in range(0, len(blocks), size)]


class SwappedModel:
    """Trains `parts` (living on the CPU: parameters, .grad and the optimizer stay there) by copying
    one part at a time onto a BudgetDevice.

    Forward (no autograd graph): part i in, h_{i+1} = part_i(h_i), part i out; only the boundary
    activations h_i stay on the device. Backward, last part first: part i in, recompute part_i(h_i)
    with autograd, backward with dL/dh_{i+1}, add its gradients into the CPU .grad, part i out. So
    the device holds one part's weights and gradients, its activations and the boundaries.
    """

    def __init__(self, parts: list[nn.Module], device: BudgetDevice):
        self.parts, self.device = parts, device

    def _bring_in(self, i: int) -> dict[str, torch.Tensor]:
        # name -> device copy of part i's parameters (B, width shapes as in the part)
        return {name: self.device.copy_in(p, f"part {i} weights").requires_grad_(True)
                for name, p in self.parts[i].named_parameters()}

    def _evict(self, i: int, weights: dict[str, torch.Tensor]) -> None:
        self.device.free(nbytes(weights.values()), f"part {i} weights")

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_weight: float = 1.0,
                         loss_fn: Callable = F.mse_loss) -> float:
        """Add d(loss_weight * loss_fn(model(x), y))/dparams into the CPU parameters' .grad."""
        dev, n = self.device, len(self.parts)
        boundaries = [dev.copy_in(x, "input")]  # h_0 .. h_{n-1} on the device, (B, width) each
        with torch.no_grad():
            for i in range(n - 1):
                weights = self._bring_in(i)
                h = functional_call(self.parts[i], weights, (boundaries[-1],))
                dev.allocate(h.nbytes, f"boundary {i + 1}")
                boundaries.append(h)
                self._evict(i, weights)
        target = dev.copy_in(y, "target")
        grad_out, loss_value = None, 0.0
        for i in reversed(range(n)):
            weights = self._bring_in(i)
            h_in = boundaries[i].detach().requires_grad_(i > 0)
            with SavedTensorBytes(exclude=list(weights.values()) + [h_in, target]) as saved:
                out = functional_call(self.parts[i], weights, (h_in,))  # (B, width)
                if i == n - 1:
                    loss = loss_fn(out, target) * loss_weight
            # saved: what autograd keeps for this part's backward; out: alive until it has run
            activation_bytes = saved.bytes + (0 if out.untyped_storage().data_ptr() in saved.storages
                                              else out.nbytes)
            grad_bytes = nbytes(weights.values()) + (h_in.nbytes if i else 0)
            dev.allocate(activation_bytes, f"part {i} activations")
            dev.allocate(grad_bytes, f"part {i} gradients")
            if i == n - 1:
                loss.backward()
                loss_value = loss.item()
                dev.free(target.nbytes, "target")
            else:
                out.backward(grad_out)
                dev.free(grad_out.nbytes, f"gradient of boundary {i + 1}")
            dev.free(activation_bytes, f"part {i} activations")
            for name, p in self.parts[i].named_parameters():  # device -> CPU store, accumulating
                g = weights[name].grad.to("cpu")
                p.grad = g if p.grad is None else p.grad.add_(g)
            dev.free(grad_bytes - (h_in.nbytes if i else 0), f"part {i} gradients")
            grad_out = h_in.grad if i else None  # dL/dh_i stays on the device for part i-1
            dev.free(boundaries[i].nbytes, f"boundary {i}" if i else "input")
            self._evict(i, weights)
        return loss_value

    def average_gradients(self, world_size: int, group=None) -> None:
        """All-reduce the CPU .grad over ranks, one part at a time through the device."""
        for i, part in enumerate(self.parts):
            params = list(part.parameters())
            flat = self.device.copy_in(torch.cat([p.grad.flatten() for p in params]), f"part {i} all-reduce")
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat = flat.to("cpu") / world_size
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            self.device.free(flat.nbytes, f"part {i} all-reduce")


def make_optimizer(params) -> torch.optim.Optimizer:
    """SGD with momentum: its update is linear in the gradient, so runs that sum the same gradient in
    a different order stay within float rounding of each other (Adam divides by sqrt(v), which
    magnifies rounding differences of near-zero gradients)."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train_swapped(model: nn.Sequential, batches: list[tuple[torch.Tensor, torch.Tensor]],
                  device: BudgetDevice, num_parts: int, micro_batches: int = 1,
                  rank: int = 0, world_size: int = 1, group=None) -> list[float]:
    """The optimizer runs on the CPU store; each (global) batch: this rank's rows, in micro-batches, swapped.

    With world_size > 1 each rank takes rows [rank * B/world_size, (rank + 1) * B/world_size) of
    every batch and the gradients are averaged over ranks. Returns the mean loss of each step
    (this rank's share). `model` is trained in place.
    """
    swapped = SwappedModel(split_parts(model, num_parts), device)
    opt = make_optimizer(model.parameters())
    losses = []
    for x, y in batches:
        rows = divide(x.shape[0], world_size, "the batch over the ranks")
        divide(rows, micro_batches, "a rank's share of the batch over the micro-batches")
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        opt.zero_grad(set_to_none=True)
        loss = sum(swapped.forward_backward(xs, ys, loss_weight=1.0 / micro_batches)
                   for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)))
        if world_size > 1:
            swapped.average_gradients(world_size, group)
        opt.step()
        losses.append(loss)
    return losses


def train_plain(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """The reference: ordinary training, whole batches, everything resident."""
    opt = make_optimizer(model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def model_bytes(model: nn.Module) -> int:
    return nbytes(model.parameters())


def swap_budget(model: nn.Sequential, num_parts: int, micro_batch_rows: int) -> int:
    """A budget for one part's weights and gradients, its activations (per block: its input (rows,
    width) and two (rows, 4 * width) tensors), the boundaries between parts and a few (rows, width)
    tensors (output, target, incoming gradient), plus 25%: under the model's size with several parts."""
    width = model[0].up.in_features
    part = split_parts(model, num_parts)[0]
    activations = 4 * micro_batch_rows * width * (9 * len(part) + num_parts + 4)
    return int(1.25 * (2 * model_bytes(part) + activations))


def lab_device(ctx_device: torch.device) -> torch.device:
    """The GPU of this rank when there is one, else the CPU (with a counted budget)."""
    return ctx_device if ctx_device.type == "cuda" else torch.device("cpu")


def run_lab(ctx: DistContext, *, width: int, depth: int, num_parts: int, global_batch_size: int,
            micro_batches: int, steps: int) -> dict:
    x, y = make_regression_data(global_batch_size * steps, width)
    batches = list(zip(x.split(global_batch_size), y.split(global_batch_size)))
    model = make_blocks(width, depth)
    reference = copy.deepcopy(model)
    local_micro_rows = global_batch_size // ctx.world_size // micro_batches
    budget = swap_budget(model, num_parts, local_micro_rows)
    device = BudgetDevice(lab_device(ctx.device), budget)
    device.start_measuring()
    losses = train_swapped(model, batches, device, num_parts, micro_batches,
                           rank=ctx.rank, world_size=ctx.world_size)
    reference_losses = train_plain(reference, batches)
    max_diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    return {"model_bytes": model_bytes(model), "budget_bytes": budget, "peak_bytes": device.peak,
            "measured_peak_bytes": device.measured_peak(), "bytes_copied_in": device.bytes_copied_in,
            "losses": losses, "reference_losses": reference_losses, "max_param_diff": max_diff,
            "swap_device": str(device.device)}


@dataclass(frozen=True)
class Run(runs.Run):
    """The model swapped in parts (depth blocks of width, in num_parts), the global batch, its
    micro-batches, and the steps."""
    width: int = 256
    depth: int = 8
    num_parts: int = 8
    global_batch_size: int = 64
    micro_batches: int = 2
    steps: int = 10
    SMOKE = dict(width=64, steps=3)


def run(ctx: DistContext, cfg: Run) -> None:
    """Train the swapped model on this rank's budget, print a summary and report the numbers."""
    config = cfg.values()
    out = run_lab(ctx, **config)
    ctx.print0(f"{ctx.world_size} ranks, device {out['swap_device']}: model parameters "
               f"{out['model_bytes'] / 2**20:.2f} MiB, budget {out['budget_bytes'] / 2**20:.2f} MiB")
    measured = out["measured_peak_bytes"]
    print(f"[rank {ctx.rank}] peak resident {out['peak_bytes'] / 2**20:.2f} MiB "
          f"({out['peak_bytes'] / out['budget_bytes']:.0%} of budget"
          + (f"; allocator measured {measured / 2**20:.2f} MiB" if measured is not None else "")
          + f"), copied in {out['bytes_copied_in'] / 2**20:.1f} MiB over {config['steps']} steps", flush=True)
    ctx.print0(f"max |param - plain training on the whole batch| = {out['max_param_diff']:.2e}; "
               f"final loss {out['reference_losses'][-1]:.4f}")
    ctx.report(config=config, **out)


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        run(ctx, cfg)


if __name__ == "__main__":
    main()
