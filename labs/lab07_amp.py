"""Lab 07 (AMP in practice): torch.amp.GradScaler with gradient clipping and in checkpoints.

Run:  ./run.sh 07      (or: ./run.sh labs/lab07_amp.py; every rank runs the same two
                        experiments, deterministic, and rank 0 prints them)

The documented order of one fp16 mixed-precision step with clipping (PyTorch's "Automatic Mixed
Precision examples", section "Gradient clipping"):

    with torch.autocast(device_type, dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()            # every .grad is S times too large
    scaler.unscale_(optimizer)               # divide them by S, in place (once per step)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)                   # skips the step if a gradient is inf/nan
    scaler.update()

Two experiments measure what goes wrong otherwise:
- `clipping_experiment`: clipping the *scaled* gradients compares S * |g| with max_norm, so every
  step is clipped to max_norm / S of the intended size (with SGD, training stalls);
- `resume_experiment`: a checkpoint without `scaler.state_dict()` restarts the scale at its
  initial value; if training had backed it off, the resumed run overflows and skips steps until
  it backs off again, and it no longer matches the uninterrupted run. With the scaler's state it
  matches bit for bit.
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import torch

from helpers import runs
from helpers.dist import DistContext, distributed
from labs.lab07_low_precision import make_autoencoder, make_signals, reconstruction_loss


def amp_step(model: torch.nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer,
             scaler: torch.amp.GradScaler, *, max_norm: float | None = None,
             unscale_first: bool = True) -> dict:
    """One fp16 autocast step of the autoencoder, in the documented order (module docstring).

    `unscale_first=False` is the classic mistake: clipping the still-scaled gradients. Returns the
    loss, the gradient norm clip_grad_norm_ saw (None without clipping) and whether the optimizer
    stepped (False when the scaler skipped the step on inf/nan)."""
    optimizer.zero_grad(set_to_none=True)
    loss = reconstruction_loss(model, batch, "fp16")
    scaler.scale(loss).backward()
    seen = None
    if max_norm is not None:
        if unscale_first:
            scaler.unscale_(optimizer)   # .grad now holds the true gradients
        seen = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()
    scale = scaler.get_scale()
    scaler.step(optimizer)               # unscales here unless unscale_ already did
    scaler.update()
    return {"loss": loss.item(), "norm_seen_by_clip": seen,
            "stepped": scaler.get_scale() >= scale}   # a skipped step backs the scale off


def _batches(steps: int, amplitude: float, batch_size: int = 64) -> list[torch.Tensor]:
    data = make_signals(8 * batch_size, amplitude=amplitude, seed=11)
    return [data[(k * batch_size) % len(data):][:batch_size] for k in range(steps)]


def clipping_experiment(steps: int, max_norm: float = 1.0, lr: float = 0.05) -> dict:
    """Train the autoencoder twice with SGD, fp16 autocast, GradScaler and clipping at `max_norm`:
    unscale_ then clip (right), and clip the scaled gradients (wrong). Returns per run the losses,
    the norms clip_grad_norm_ saw, and the scale."""
    out = {}
    for label, unscale_first in (("unscale_ then clip", True), ("clip scaled gradients", False)):
        model = make_autoencoder(seed=5)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=1000)
        records = [amp_step(model, batch, optimizer, scaler, max_norm=max_norm,
                            unscale_first=unscale_first) for batch in _batches(steps, 1.0)]
        out[label] = {"losses": [r["loss"] for r in records],
                      "norms": [r["norm_seen_by_clip"] for r in records],
                      "scale": scaler.get_scale()}
    return out


def checkpoint_bytes(model, optimizer, scaler=None) -> bytes:
    """What a training checkpoint holds: model and optimizer state and, if given, the scaler's."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if scaler is not None:
        state["scaler"] = scaler.state_dict()   # scale, growth factor/interval, growth tracker
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _fresh(lr: float):
    model = make_autoencoder(seed=5)
    return model, torch.optim.Adam(model.parameters(), lr=lr), torch.amp.GradScaler(
        "cpu", init_scale=2.0 ** 16, growth_interval=50)


def resume_experiment(steps: int, stop_at: int, amplitude: float = 100.0, lr: float = 1e-3) -> dict:
    """Train `steps` fp16 steps without a break; and stop at `stop_at`, save a checkpoint, load it
    into a new model/optimizer/scaler and continue, once with the scaler's state and once
    without it. Large signals (`amplitude`) make the scaler back off from 2^16 early on.

    Returns, per run, the scale before each step, which steps were skipped (inf/nan), and the
    largest parameter difference from the uninterrupted run at the end."""
    batches = _batches(steps, amplitude)
    model, optimizer, scaler = _fresh(lr)
    runs = {"uninterrupted": {"scales": [], "skipped": []}}
    saved = None
    for k, batch in enumerate(batches):
        if k == stop_at:
            saved = checkpoint_bytes(model, optimizer, scaler)
        runs["uninterrupted"]["scales"].append(scaler.get_scale())
        if not amp_step(model, batch, optimizer, scaler)["stepped"]:
            runs["uninterrupted"]["skipped"].append(k)
    reference = [p.detach().clone() for p in model.parameters()]
    for label, with_scaler in (("resumed with the scaler's state", True),
                               ("resumed without it", False)):
        state = torch.load(io.BytesIO(saved), map_location="cpu")
        model, optimizer, scaler = _fresh(lr)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if with_scaler:
            scaler.load_state_dict(state["scaler"])
        run = runs[label] = {"scales": [], "skipped": []}
        for k in range(stop_at, steps):
            run["scales"].append(scaler.get_scale())
            if not amp_step(model, batches[k], optimizer, scaler)["stepped"]:
                run["skipped"].append(k)
        run["max_param_diff"] = max((p.detach() - q).abs().max().item()
                                    for p, q in zip(model.parameters(), reference))
    runs["uninterrupted"]["max_param_diff"] = 0.0
    return {"stop_at": stop_at, "runs": runs}


@dataclass(frozen=True)
class Run(runs.Run):
    """Steps of the clipping experiment; steps of the resume experiment and where it stops."""
    clip_steps: int = 60
    resume_steps: int = 40
    stop_at: int = 20
    SMOKE = dict(clip_steps=20, resume_steps=24, stop_at=12)


def run(ctx: DistContext, cfg: Run) -> None:
    """Run both experiments (deterministic: every rank gets the same numbers), print on rank 0."""
    clip = clipping_experiment(steps=cfg.clip_steps)
    resume = resume_experiment(steps=cfg.resume_steps, stop_at=cfg.stop_at)
    for label, run in clip.items():
        norms = sorted(n for n in run["norms"] if n == n and n != float("inf"))
        ctx.print0(f"{label:24s}: loss {run['losses'][0]:.4g} -> {run['losses'][-1]:.4g}, median "
                   f"norm seen by clip_grad_norm_ {norms[len(norms) // 2]:.3g} (scale {run['scale']:g})")
    for label, run in resume["runs"].items():
        ctx.print0(f"{label:32s}: steps skipped {run['skipped']}, max |param - uninterrupted| "
                   f"{run['max_param_diff']:.2e}")
    ctx.report(clipping=clip, resume=resume)


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        run(ctx, cfg)


if __name__ == "__main__":
    main()
