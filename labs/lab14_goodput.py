"""Lab 14 (what failure costs): the goodput of a job that restarts from its last checkpoint, and of
one whose healthy replicas keep going, as formulas, a simulation and a published cluster.

A library of lab 14 (no run of its own): the notebook and labs/lab14_failures.py use it.

- Whole-job restart (notebook 12's way). Every `tau` seconds of training the job stalls `delta`
  seconds to write a checkpoint; a failure anywhere stops every rank, and after `restart` seconds
  (noticing, rescheduling, starting the processes, loading the checkpoint) the job continues from
  the last checkpoint: the work since then is done again. With failures arriving at random
  (exponentially, mean time between failures `mtbf`), Daly's expected wall-clock time
  (Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
  Future Generation Computer Systems 22(3)) gives the goodput, the share of wall-clock time whose
  work is kept:

      goodput = tau / (mtbf * exp(restart / mtbf) * (exp((tau + delta) / mtbf) - 1))

  Checkpoint often and writing costs; checkpoint rarely and failures cost. Young's interval
  sqrt(2 delta mtbf) (Young 1974, "A first order approximation to the optimum checkpoint interval",
  Communications of the ACM 17(9)) balances the two to first order; Daly's higher-order estimate
  corrects it when delta is not small against mtbf. `simulate_restart` plays the same job with
  drawn failures, the check that the formula says what the story says.
- Per-step fault tolerance (torchft): a failure takes one of `groups` replica groups out for
  `heal` seconds (restart it, rejoin, copy a peer's live state) while the others train on; the
  job loses that group's share of the time and the step in flight, and writes no checkpoints for
  these failures (it still needs rare ones for the whole job).
- A published cluster: Llama 3's pre-training (Dubey et al. 2024, "The Llama 3 Herd of Models",
  arXiv:2407.21783, section 3.3.4 and table 5) logged 419 unexpected interruptions in a 54-day
  snapshot on up to 16,384 H100 GPUs, about one every three hours.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

HOUR, DAY = 3600.0, 86400.0

# Dubey et al. 2024 (arXiv:2407.21783), section 3.3.4: a 54-day snapshot of Llama 3 405B's
# pre-training had 466 job interruptions, 47 planned and 419 unexpected, on up to 16,384 H100s.
LLAMA3 = {"gpus": 16_384, "days": 54, "unexpected_interruptions": 419, "planned_interruptions": 47}


def llama3_mtbf_s() -> float:
    """Mean time between unexpected interruptions of Llama 3's job, from the published counts."""
    return LLAMA3["days"] * DAY / LLAMA3["unexpected_interruptions"]


def per_gpu_mtbf_s() -> float:
    """The same failures charged to each GPU: a cluster of n GPUs fails n times as often."""
    return llama3_mtbf_s() * LLAMA3["gpus"]


# ============================================================================ whole-job restart
def _check(name: str, value: float, positive: bool = True) -> None:
    if not (value > 0 if positive else value >= 0) or math.isinf(value) or math.isnan(value):
        raise ValueError(f"{name} must be a {'positive' if positive else 'non-negative'} number of "
                         f"seconds, got {value!r}")


def restart_goodput(tau: float, delta: float, restart: float, mtbf: float) -> float:
    """Daly's expected goodput of checkpoint/restart: the share of wall-clock time kept, for a
    checkpoint every `tau` seconds of work costing `delta`, `restart` seconds to resume, failures
    with mean time `mtbf` (exponential)."""
    _check("tau", tau)
    _check("delta", delta, positive=False)
    _check("restart", restart, positive=False)
    _check("mtbf", mtbf)
    exponent = (tau + delta) / mtbf + restart / mtbf
    if exponent > 700:  # exp overflows: nothing is ever kept
        return 0.0
    return tau / (mtbf * math.exp(restart / mtbf) * math.expm1((tau + delta) / mtbf))


def young_interval(delta: float, mtbf: float) -> float:
    """Young's (1974) first-order optimum: checkpoint every sqrt(2 delta mtbf) seconds of work."""
    _check("delta", delta)
    _check("mtbf", mtbf)
    return math.sqrt(2 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's (2006) higher-order optimum (seconds of work between checkpoints): for delta < 2 mtbf,
    sqrt(2 delta M) (1 + sqrt(delta / 2M) / 3 + delta / 18M) - delta; otherwise M."""
    _check("delta", delta)
    _check("mtbf", mtbf)
    if delta >= 2 * mtbf:
        return mtbf
    x = delta / (2 * mtbf)
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - delta


def best_interval(delta: float, restart: float, mtbf: float, points: int = 400) -> float:
    """The tau that maximises `restart_goodput`, found by scanning (a check on the estimates)."""
    grid = [daly_interval(delta, mtbf) * 10 ** (k / points * 4 - 2) for k in range(points + 1)]
    return max(grid, key=lambda tau: restart_goodput(tau, delta, restart, mtbf))


def simulate_restart(tau: float, delta: float, restart: float, mtbf: float, work: float,
                     seed: int = 0) -> dict:
    """Play a job of `work` seconds of training with checkpoint/restart and exponential failures
    (a failure may strike while writing, training or restarting). Returns the wall-clock time,
    the goodput and the failures."""
    rng = random.Random(seed)
    wall, done, failures = 0.0, 0.0, 0
    next_failure = rng.expovariate(1 / mtbf)
    pending_restart = 0.0
    while done < work - 1e-9:
        segment = pending_restart + min(tau, work - done) + delta
        if wall + segment <= next_failure:
            wall += segment
            done += min(tau, work - done)
            pending_restart = 0.0
        else:  # lost: the segment since the last checkpoint; restart again
            wall = next_failure
            failures += 1
            next_failure = wall + rng.expovariate(1 / mtbf)
            pending_restart = restart
    return {"wall": wall, "goodput": work / wall, "failures": failures}


# ========================================================================= per-step tolerance
def ft_goodput(groups: int, heal: float, step: float, mtbf: float) -> float:
    """Expected goodput when each failure (mean time `mtbf` over the whole job) takes one of
    `groups` replica groups away for `heal` seconds and discards the step in flight: the share of
    time kept is 1 - (heal / groups + step) / mtbf (first order; 0 if that is negative)."""
    if groups < 1:
        raise ValueError(f"a job needs at least one replica group, got {groups}")
    _check("heal", heal, positive=False)
    _check("step", step, positive=False)
    _check("mtbf", mtbf)
    if groups == 1:  # nobody to carry on: the group is the job
        return max(0.0, 1 - (heal + step) / mtbf)
    return max(0.0, 1 - (heal / groups + step) / mtbf)


# ================================================================== the run's time, accounted
def account(timeline: dict) -> dict:
    """Split a measured run's wall-clock time (a timeline from labs/lab14_failures.py: seconds of
    `steps` kept, `recomputed` steps, `checkpoints`, `restarts`, `other`) into shares; goodput =
    time of the kept steps / wall."""
    wall = timeline["wall"]
    if not wall > 0:
        raise ValueError(f"a run's wall-clock time must be positive, got {wall!r}")
    parts = {k: timeline.get(k, 0.0) for k in ("kept", "recomputed", "checkpoints", "restarts")}
    parts["other"] = max(0.0, wall - sum(parts.values()))
    return {"wall": wall, "goodput": parts["kept"] / wall,
            "shares": {k: v / wall for k, v in parts.items()}, "seconds": parts}


def compare_goodput(restart: float, ft: float, noise: float) -> str:
    """The verdict of the side-by-side run: which kept more of its time, or "within the noise"
    when the two goodputs differ by less than `noise` (the spread of the run's own step times)."""
    if abs(restart - ft) <= noise:
        return f"within the noise: restart {restart:.2f}, torchft {ft:.2f} (noise {noise:.2f})"
    better = "torchft" if ft > restart else "whole-job restart"
    return f"{better} kept more of the run: restart {restart:.2f}, torchft {ft:.2f} (noise {noise:.2f})"


def compare_cost(restart_s: float, ft_s: float, noise: float) -> str:
    """The verdict on what one failure cost each way (seconds of the whole job): which lost less,
    or "within the noise" when they differ by less than `noise` (relative) of the larger."""
    if abs(restart_s - ft_s) <= noise * max(restart_s, ft_s):
        return (f"within the noise: the restart lost {restart_s:.1f} s, torchft {ft_s:.1f} s "
                f"(noise {noise:.0%})")
    less = "torchft" if ft_s < restart_s else "the whole-job restart"
    ratio = max(restart_s, ft_s) / max(min(restart_s, ft_s), 1e-9)
    return (f"{less} lost {ratio:.1f}x less to the failure: the restart {restart_s:.1f} s, torchft "
            f"{ft_s:.1f} s of the whole job (noise {noise:.0%})")


def goodput_from_costs(costs: dict[str, float], mtbf: float, overhead: dict[str, float] | None = None) -> dict[str, float]:
    """What measured per-failure costs (seconds of the whole job lost to one failure) mean for a long
    job with a failure every `mtbf` seconds: goodput = 1 - overhead - cost / mtbf, where `overhead`
    is a method's share of time spent on failures' insurance (the restart's checkpoints)."""
    _check("mtbf", mtbf)
    overhead = overhead or {}
    return {name: max(0.0, 1 - overhead.get(name, 0.0) - cost / mtbf) for name, cost in costs.items()}


def model_matches(measured: float, predicted: float, tolerance: float) -> bool:
    """Whether a measured goodput is within `tolerance` (absolute) of the model's prediction."""
    return abs(measured - predicted) <= tolerance


# ========================================================================= a cluster, modelled
@dataclass(frozen=True)
class Failures:
    """A cluster's failure story: failures per day, what a checkpoint and a restart cost, and a
    step's time. The costs are assumptions the notebook states, not published figures."""
    per_day: float
    delta: float       # seconds to write a checkpoint (training stalls)
    restart: float     # seconds from a failure to training again (whole job)
    heal: float        # seconds for one replica group to restart and heal from a peer
    step: float        # seconds per training step

    @property
    def mtbf(self) -> float:
        return DAY / self.per_day


def cluster_goodputs(f: Failures, groups: int) -> dict:
    """Goodput of restart at Daly's interval and of torchft with `groups` replica groups."""
    tau = daly_interval(f.delta, f.mtbf)
    return {"mtbf_h": f.mtbf / HOUR, "young_s": young_interval(f.delta, f.mtbf), "daly_s": tau,
            "restart": restart_goodput(tau, f.delta, f.restart, f.mtbf),
            "torchft": ft_goodput(groups, f.heal, f.step, f.mtbf)}
