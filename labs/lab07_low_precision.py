"""Lab 07: low-precision training: dynamic loss scaling, fp32 vs bf16 vs fp16 training, and
data-parallel training whose gradients travel in bf16.

Run:  ./run.sh 07      (or: ./run.sh labs/lab07_low_precision.py)

Under torchrun every rank trains the same small autoencoder on its shard of each global batch,
three times: in fp32; with bf16 autocast and gradients all-reduced in fp32; with bf16 autocast and
gradients all-reduced in bf16 (half the bytes on the wire). Rank 0 prints the error the bf16
all-reduce adds, the final losses, and checks the fp32 run against one process on the whole batch.

The importable parts (used by notebooks/07_low_precision.ipynb): `LossScaler` (the exercise:
dynamic loss scaling as torch.amp.GradScaler does it), the training runs that compare fp32, bf16
and fp16, and the gradient-underflow measurements (Micikevicius et al. 2018, "Mixed Precision
Training", arXiv:1710.03740). Formats and autocast: labs/lab07_formats.py; GradScaler in practice
(clipping, checkpoints): labs/lab07_amp.py; memory: labs/lab07_memory.py, labs/lab07_swapping.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers import runs
from helpers.dist import DistContext, distributed
from helpers.tensors import divide, seeded


# ---------------------------------------------------------------------------------------------
# Dynamic loss scaling (the exercise)
# ---------------------------------------------------------------------------------------------
def to_float32(value: float) -> float:
    """`value` rounded to the nearest float32 (inf if it is beyond float32's range)."""
    return torch.tensor(value, dtype=torch.float64).to(torch.float32).item()


class LossScaler:
    """Dynamic loss scaling from scratch, making the same decisions as torch.amp.GradScaler.

    One iteration:  scaler.scale(loss).backward();  scaler.step(optimizer);  scaler.update()

    Why: fp16's smallest subnormal is 2^-24, and gradients at or below 2^-25 round to zero.
    Multiplying the loss by a large scale S multiplies every gradient by S (the chain rule is
    linear), lifting them into fp16's range. Before the optimizer uses them they are divided by S
    again. If S was too large, some gradient overflowed to inf (or became nan): that step is
    skipped and S shrinks. After `growth_interval` clean steps in a row S grows, so it keeps
    probing for the largest safe value.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        # State. Like GradScaler, the scale is a float32 number: keep it rounded with to_float32.
        self._scale = to_float32(init_scale)
        self._growth_tracker = 0      # clean (unskipped) iterations in a row since the last change
        self._found_inf: bool | None = None  # None: no step() since the last update()

    def get_scale(self) -> float:
        """The current scale S, a Python float (a float32 value)."""
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Return `loss * S` (same dtype and device as `loss`); call .backward() on the result."""
        ### BEGIN SOLUTION
        return loss * self._scale
        ### END SOLUTION

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale the gradients of `optimizer`'s parameters, then step it unless one is not finite.

        - For every parameter in optimizer.param_groups whose .grad is not None: multiply .grad in
          place by inv_scale = to_float32(1.0 / S) (GradScaler computes the inverse in float64, rounds
          it to float32, and multiplies; it unscales every gradient, even when it finds an inf).
        - If any of those gradients holds an inf or a nan (checked on the scaled gradients), do NOT
          call optimizer.step(): the step is skipped. Otherwise call optimizer.step().
        - Remember whether an inf/nan was found, for update(). With several optimizers, step() is
          called once for each before update(); each one skips on its own gradients, and update()
          backs off if any of them found an inf/nan.
        Returns True if optimizer.step() ran, False if the step was skipped.
        """
        ### BEGIN SOLUTION
        inv_scale = to_float32(1.0 / self._scale)
        found_inf = False
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if not bool(torch.isfinite(param.grad).all()):
                        found_inf = True
                    param.grad.mul_(inv_scale)
        self._found_inf = bool(self._found_inf) or found_inf
        if found_inf:
            return False
        optimizer.step()
        return True
        ### END SOLUTION

    def update(self) -> None:
        """Update S once per iteration, after step() (raise RuntimeError if no step() came first).

        - If a step since the last update found an inf/nan: S = to_float32(S * backoff_factor), and
          the count of clean iterations in a row restarts at 0.
        - Otherwise the count grows by 1; when it reaches growth_interval it restarts at 0 and
          S = to_float32(S * growth_factor), unless that is inf (S never grows past float32's range;
          the count still restarts).
        Then forget the inf/nan record, ready for the next iteration.
        """
        ### BEGIN SOLUTION
        if self._found_inf is None:
            raise RuntimeError("LossScaler.update() needs a step() since the last update()")
        if self._found_inf:
            self._scale = to_float32(self._scale * self.backoff_factor)
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                grown = to_float32(self._scale * self.growth_factor)
                if math.isfinite(grown):
                    self._scale = grown
                self._growth_tracker = 0
        self._found_inf = None
        ### END SOLUTION


def scaler_trace(scaler, *, steps: int, overflow_steps=(), nan_steps=(), seed: int = 0) -> dict:
    """Train a tiny linear model with `scaler` (LossScaler or torch.amp.GradScaler), planting an
    inf loss at `overflow_steps` and a nan loss at `nan_steps`.

    Returns, per step: the scale used, whether optimizer.step() ran (seen by a step hook on the
    optimizer, not by asking the scaler), and the parameters after the step. SGD with momentum, so
    a step that should have been skipped changes the momentum and every later parameter.
    """
    g = torch.Generator().manual_seed(seed)
    x, target = torch.randn(16, 4, generator=g), torch.randn(16, 3, generator=g)
    with seeded(seed):
        model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ran = []
    opt.register_step_post_hook(lambda *_: ran.append(True))
    scales, stepped, params = [], [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), target)
        if step in overflow_steps:
            loss = loss * math.inf
        if step in nan_steps:
            loss = loss * math.nan
        scales.append(scaler.get_scale())
        before = len(ran)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        stepped.append(len(ran) > before)
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]).clone())
    return {"scales": scales + [scaler.get_scale()], "stepped": stepped, "params": params}


# ---------------------------------------------------------------------------------------------
# Training in fp32, bf16 and fp16: a small autoencoder on low-amplitude signals
# ---------------------------------------------------------------------------------------------
SIGNAL_DIM, LATENT_DIM, HIDDEN_DIM = 128, 8, 64
PRECISIONS = ("fp32", "bf16", "fp16", "fp16 + loss scaling")


def make_signals(num_samples: int, amplitude: float = 0.01, seed: int = 0) -> torch.Tensor:
    """(num_samples, SIGNAL_DIM) signals on an 8-dim subspace, scaled to `amplitude`.

    Small signals mean small reconstruction errors and so small gradients: the regime where fp16
    gradients fall to 2^-25 or below and round to zero.
    """
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(LATENT_DIM, SIGNAL_DIM, generator=g) / LATENT_DIM ** 0.5
    return amplitude * torch.randn(num_samples, LATENT_DIM, generator=g) @ basis


def make_autoencoder(seed: int = 0) -> nn.Sequential:
    with seeded(seed):
        return nn.Sequential(nn.Linear(SIGNAL_DIM, HIDDEN_DIM), nn.GELU(),
                             nn.Linear(HIDDEN_DIM, HIDDEN_DIM), nn.GELU(),
                             nn.Linear(HIDDEN_DIM, SIGNAL_DIM))


def autocast_dtype(precision: str) -> torch.dtype | None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return {"fp32": None, "bf16": torch.bfloat16}.get(precision, torch.float16)


def reconstruction_loss(model: nn.Module, batch: torch.Tensor, precision: str) -> torch.Tensor:
    """Mean squared reconstruction error; the forward runs under autocast unless precision is fp32."""
    dtype = autocast_dtype(precision)
    with torch.autocast(batch.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = model(batch)  # (B, SIGNAL_DIM), in the autocast dtype
    return F.mse_loss(out.float(), batch)


def train_precision(precision: str, *, steps: int, batch_size: int = 256, lr: float = 1e-3,
                    seed: int = 0, device: torch.device | str = "cpu", scaler=None,
                    data: torch.Tensor | None = None) -> dict:
    """Train make_autoencoder(seed) with Adam in one precision; same data order for every run.

    For "fp16 + loss scaling" pass `scaler` (torch.amp.GradScaler or LossScaler); the default is a
    GradScaler with growth_interval=100. Returns losses (one per step), the fraction of gradient
    entries that were exactly zero at each step, the scale at each step, and the model.
    """
    device = torch.device(device)
    data = (make_signals(16 * batch_size) if data is None else data).to(device)
    model = make_autoencoder(seed).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    if precision == "fp16 + loss scaling" and scaler is None:
        scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 16, growth_interval=100)
    if precision != "fp16 + loss scaling":
        scaler = None
    losses, zero_fraction, scales = [], [], []
    for step in range(steps):
        rows = (torch.arange(batch_size, device=device) + step * batch_size) % data.shape[0]
        loss = reconstruction_loss(model, data[rows], precision)
        opt.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        zero_fraction.append((grads == 0).float().mean().item())
        losses.append(loss.item())
    return {"precision": precision, "losses": losses, "zero_fraction": zero_fraction,
            "scales": scales, "model": model}


def gradient_exponents(model: nn.Module, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """floor(log2|g|) of every nonzero gradient entry of an fp32 backward pass.

    "activations": gradients w.r.t. each layer's output, the tensors that flow backward (in fp16
    under fp16 autocast); "weights": parameter gradients. Zero entries are counted separately.
    """
    grads_of_activations = []
    h = batch
    for layer in model:  # a Sequential: keep every intermediate output's gradient
        h = layer(h)
        h.register_hook(grads_of_activations.append)
    model.zero_grad(set_to_none=True)
    F.mse_loss(h, batch).backward()
    out = {}
    for name, tensors in (("activations", grads_of_activations),
                          ("weights", [p.grad for p in model.parameters()])):
        g = torch.cat([t.detach().flatten() for t in tensors]).abs()
        out[name] = torch.floor(torch.log2(g[g > 0]))
        out[name + " zeros"] = int((g == 0).sum())
    model.zero_grad(set_to_none=True)
    return out


def zero_gradient_fraction(model: nn.Module, batch: torch.Tensor, precision: str,
                           loss_scale: float = 1.0) -> float:
    """Fraction of parameter-gradient entries that come out exactly zero (underflow) in one backward."""
    model.zero_grad(set_to_none=True)
    (reconstruction_loss(model, batch, precision) * loss_scale).backward()
    g = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return (g == 0).float().mean().item()


# ---------------------------------------------------------------------------------------------
# Data parallel with bf16 autocast: gradients all-reduced in fp32 or in bf16
# ---------------------------------------------------------------------------------------------
def all_reduce_mean(flat_grad: torch.Tensor, comm_dtype: torch.dtype, world_size: int,
                    group=None) -> torch.Tensor:
    """Average a flat fp32 gradient over ranks, sending it as `comm_dtype`; returns fp32."""
    buf = flat_grad.to(comm_dtype, copy=True)  # (numel,): a copy in the wire format
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return buf.float() / world_size


def train_data_parallel(precision: str, comm_dtype: torch.dtype, *, rank: int, world_size: int,
                        device: torch.device, steps: int, global_batch_size: int, lr: float = 1e-3,
                        group=None) -> dict:
    """DP training of the autoencoder: each rank takes its slice of every global batch.

    The gradients are flattened into one fp32 vector (numel,), averaged over ranks in `comm_dtype`
    and written back. Each step also all-reduces the same gradients in fp32, to measure the error
    the wire format adds (comm_error), and, under autocast, computes the fp32 gradient of the same
    batch, to compare with the error autocast itself adds (autocast_error). Both are relative
    2-norm errors of the averaged gradient. The loss is averaged over ranks.
    """
    local_batch_size = divide(global_batch_size, world_size, "the global batch over the ranks")
    data = make_signals(16 * global_batch_size).to(device)
    model = make_autoencoder().to(device)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=lr)
    losses, comm_errors, autocast_errors, bf16_exact = [], [], [], []
    for step in range(steps):
        rows = (torch.arange(global_batch_size, device=device) + step * global_batch_size) % data.shape[0]
        local_rows = rows[rank * local_batch_size:(rank + 1) * local_batch_size]
        batch = data[local_rows]  # (local_batch_size, SIGNAL_DIM)
        if precision != "fp32":  # reference gradient of the same batch in fp32, same parameters
            model.zero_grad(set_to_none=True)
            reconstruction_loss(model, batch, "fp32").backward()
            fp32_grad = torch.cat([p.grad.flatten() for p in params])
        model.zero_grad(set_to_none=True)
        loss = reconstruction_loss(model, batch, precision)
        loss.backward()
        local_grad = torch.cat([p.grad.flatten() for p in params])  # (numel,) fp32
        # share of entries that a cast to bf16 leaves unchanged (bf16 matmuls make bf16 values)
        bf16_exact.append((local_grad.bfloat16().float() == local_grad).float().mean().item())
        reduced = all_reduce_mean(local_grad, comm_dtype, world_size, group)
        exact = all_reduce_mean(local_grad, torch.float32, world_size, group)
        comm_errors.append(((reduced - exact).norm() / exact.norm()).item())
        if precision != "fp32":
            fp32_mean = all_reduce_mean(fp32_grad, torch.float32, world_size, group)
            autocast_errors.append(((exact - fp32_mean).norm() / fp32_mean.norm()).item())
        offset = 0
        for p in params:
            p.grad.copy_(reduced[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.SUM, group=group)
        losses.append(mean_loss.item() / world_size)
    return {"losses": losses, "comm_errors": comm_errors, "autocast_errors": autocast_errors,
            "bf16_exact_fraction": sum(bf16_exact) / len(bf16_exact),
            "bytes_per_all_reduce": local_grad.numel() * comm_dtype.itemsize,
            "params": torch.cat([p.detach().flatten() for p in params]).cpu()}


def single_process_reference(*, steps: int, global_batch_size: int, device: torch.device,
                             lr: float = 1e-3) -> torch.Tensor:
    """fp32 parameters after `steps` Adam steps on the whole global batch, in one process."""
    run = train_precision("fp32", steps=steps, batch_size=global_batch_size, lr=lr, device=device,
                          data=make_signals(16 * global_batch_size))
    return torch.cat([p.detach().flatten() for p in run["model"].parameters()]).cpu()


DP_RUNS = (("fp32", torch.float32), ("bf16", torch.float32), ("bf16", torch.bfloat16))


def run_lab(ctx: DistContext, steps: int, global_batch_size: int) -> dict:
    results = {}
    for precision, comm_dtype in DP_RUNS:
        label = f"{precision} compute, {str(comm_dtype).replace('torch.', '')} all-reduce"
        results[label] = train_data_parallel(
            precision, comm_dtype, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device,
            steps=steps, global_batch_size=global_batch_size)
    fp32_label = next(iter(results))
    reference = single_process_reference(steps=steps, global_batch_size=global_batch_size,
                                         device=ctx.device)
    return {"runs": results, "fp32_dp_vs_single_max_diff":
            (results[fp32_label]["params"] - reference).abs().max().item()}


@dataclass(frozen=True)
class Run(runs.Run):
    """The data-parallel trainings' steps and global batch; notebook 07's precision race (its
    steps) and the warm-up before its gradient histogram."""
    steps: int = 200
    global_batch: int = 256
    curve_steps: int = 300
    warm_steps: int = 150
    SMOKE = dict(steps=20, curve_steps=40, warm_steps=30)


def run(ctx: DistContext, cfg: Run) -> None:
    """Run the three DP trainings, print a summary (rank 0) and report the measurements."""
    steps, global_batch_size = cfg.steps, cfg.global_batch
    out = run_lab(ctx, steps, global_batch_size)
    runs = out["runs"]
    ctx.print0(f"{ctx.world_size} ranks on {ctx.device} ({ctx.backend}), {steps} steps, "
               f"global batch {global_batch_size}")
    for label, run in runs.items():
        line = (f"  {label:32s} final loss {run['losses'][-1]:.3e}, "
                f"{run['bytes_per_all_reduce']} B per all-reduce, "
                f"all-reduce error {sum(run['comm_errors']) / len(run['comm_errors']):.2e}")
        if run["autocast_errors"]:
            line += f", autocast error {sum(run['autocast_errors']) / len(run['autocast_errors']):.2e}"
        ctx.print0(line)
    ctx.print0(f"  fp32 DP vs one process on the whole batch: max |diff| = "
               f"{out['fp32_dp_vs_single_max_diff']:.2e}")
    ctx.report(steps=steps, global_batch_size=global_batch_size,
               fp32_dp_vs_single_max_diff=out["fp32_dp_vs_single_max_diff"],
               runs={label: {k: v for k, v in run.items() if k != "params"} for label, run in runs.items()},
               params_checksum={label: run["params"].double().sum().item() for label, run in runs.items()})


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        run(ctx, cfg)


if __name__ == "__main__":
    main()
