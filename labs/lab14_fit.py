"""Lab 14 (where each fits): DDP/FSDP with whole-job restarts, HSDP + torchft, and DiLoCo (+ torchft),
compared by the share of a cluster's time that becomes kept training, as the link between the
replica groups slows and failures come more often.

A library of lab 14 (no run of its own): the notebook feeds it this run's measurements and a
large cluster's assumptions.

The model, per method (n replica groups; the link between groups carries `link_bytes_per_s`):
- the step: compute `compute_s`, and the all-reduce of the gradients (or pseudo-gradients)
  between the groups, 2 (n - 1) / n x `model_bytes` over the link (notebook 04's ring), assumed
  overlapped with the compute (the step takes the longer of the two: generous to DDP). DiLoCo
  sends it once every `sync_every` steps (streaming DiLoCo spreads it over the round, overlapped);
- the failures: DDP/FSDP restarts the whole job (lab14_goodput.restart_goodput at Daly's interval);
  torchft loses one group for `heal` seconds (lab14_goodput.ft_goodput);
- DiLoCo's tokens are worth `token_efficiency` of DDP's (1: the same loss after the same tokens;
  the notebook measures it on this run).

useful share = (compute_s / step_s) x goodput x token efficiency. The verdict (`best`) names the
method with the largest share, or says that the best two are within `margin` of each other.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from labs.lab14_goodput import Failures, daly_interval, ft_goodput, restart_goodput

METHODS = ("DDP/FSDP + restarts", "HSDP + torchft", "DiLoCo + torchft")


@dataclass(frozen=True)
class Setting:
    """A training job on n replica groups (every time in seconds, every size in bytes)."""
    model_bytes: float          # what one all-reduce of the gradients moves (its size)
    compute_s: float            # one step's compute on a group
    groups: int                 # replica groups (data centres, or racks)
    link_bytes_per_s: float     # between the groups
    failures: Failures          # how often, and what a checkpoint, a restart and a heal cost
    sync_every: int = 100       # DiLoCo's H
    token_efficiency: float = 1.0


def comm_s(s: Setting, per_step_fraction: float = 1.0) -> float:
    """Seconds of the between-groups all-reduce per step (ring), times `per_step_fraction`."""
    if s.groups < 2:
        return 0.0
    return 2 * (s.groups - 1) / s.groups * s.model_bytes / s.link_bytes_per_s * per_step_fraction


def useful_share(s: Setting) -> dict[str, float]:
    """Each method's share of the cluster's time that is kept, useful training."""
    f = s.failures
    sync_step = max(s.compute_s, comm_s(s))
    diloco_step = max(s.compute_s, comm_s(s, 1 / s.sync_every))
    tau = daly_interval(f.delta, f.mtbf)
    return {
        "DDP/FSDP + restarts": s.compute_s / sync_step * restart_goodput(tau, f.delta, f.restart, f.mtbf),
        "HSDP + torchft": s.compute_s / sync_step * ft_goodput(s.groups, f.heal, sync_step, f.mtbf),
        "DiLoCo + torchft": s.compute_s / diloco_step * ft_goodput(s.groups, f.heal, diloco_step, f.mtbf)
                            * s.token_efficiency,
    }


def best(shares: dict[str, float], margin: float = 0.05) -> str:
    """The method with the largest useful share; "A ~ B" when the runner-up is within `margin`
    (relative) of it."""
    ranked = sorted(shares, key=shares.get, reverse=True)
    first, second = ranked[0], ranked[1]
    if shares[first] <= 0:
        return "none: nothing is kept"
    if shares[second] >= (1 - margin) * shares[first]:
        return f"{first} ~ {second}"
    return first


def fit_table(base: Setting, links: dict[str, float], failures_per_day: list[float],
              margin: float = 0.05) -> list[dict]:
    """Rows of link speeds (name -> bytes/s), columns of failure rates: the best method in each."""
    rows = []
    for name, bandwidth in links.items():
        row = {"link between groups": name}
        for per_day in failures_per_day:
            s = replace(base, link_bytes_per_s=bandwidth, failures=replace(base.failures, per_day=per_day))
            row[f"{per_day:g} failures/day"] = best(useful_share(s), margin)
        rows.append(row)
    return rows


def token_efficiency(ddp_losses: list[float], diloco_loss: float, tokens_per_step: float) -> float:
    """DDP's tokens to reach DiLoCo's final loss over DiLoCo's tokens (same tokens per step),
    capped at 1: a small run's DiLoCo advantage is not extrapolated. `ddp_losses` are DDP's held-out
    losses after each of the run's steps (or a curve sampled at equal step intervals)."""
    steps = len(ddp_losses)
    reached = next((i + 1 for i, loss in enumerate(ddp_losses) if loss <= diloco_loss), None)
    if reached is None:
        return 1.0          # DDP never got as low within the run: DiLoCo is at least as good
    return min(1.0, reached * tokens_per_step / (steps * tokens_per_step))
