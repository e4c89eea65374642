"""Lab 06 (schedules): pipeline schedules as data: written, validated, simulated, measured, drawn.

Run:  ./run.sh 06      (this lab prints, on rank 0, every schedule's simulated bubble and memory)

No processes and no tensors: a *schedule* says, for every stage of a pipeline, the order in which
it runs the forward ("F", i) and the backward ("B", i) of micro-batch i:

    gpipe_schedule(2, 3)        stage 0: F0 F1 F2 B0 B1 B2   stage 1: F0 F1 F2 B0 B1 B2
    one_f_one_b_schedule(2, 3)  stage 0: F0 F1 B0 F2 B1 B2   stage 1: F0 B0 F1 B1 F2 B2

GPipe: Huang et al. 2019, arXiv:1811.06965. 1F1B in its synchronous form (one flush per batch):
PipeDream-Flush, Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training",
arXiv:2006.09503, as used by Megatron-LM (Narayanan et al. 2021, arXiv:2104.04473).

`validate_schedule` checks a schedule before anything runs it, `simulate_schedule` replays it with
given action durations (communication free), `bubble_fraction` / `bubble_ratio` measure the idle
time of any timeline (simulated or measured) and `plot_gantt` draws it. The executor that runs a
schedule on real processes is in labs/lab06_pipeline.py.

Adding a schedule: write `def my_schedule(num_stages, num_microbatches) -> Schedule`, decorate it
with `@register_schedule("name")`, and `make_schedule("name", p, m)`, the simulator, the explorer
and `main` know it. A schedule that needs another kind of action (e.g. "W", the weight-gradient
half of a backward in zero-bubble schedules) adds its dependency rule to `DEPENDENCIES` and its
duration to the `durations` passed to `simulate_schedule`.

Exercise (homework): `one_f_one_b_schedule`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from helpers.notice import attempt, solved

Action = tuple[str, int]       # ("F", i) or ("B", i): forward / backward of micro-batch i
Schedule = list[list[Action]]  # schedule[stage] = that stage's actions, in the order it runs them
SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {}   # name -> schedule function


def register_schedule(name: str):
    """Decorator: make a schedule function available as make_schedule(name, p, m)."""
    def register(fn: Callable[[int, int], Schedule]) -> Callable[[int, int], Schedule]:
        SCHEDULES[name] = fn
        return fn
    return register


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](num_stages, num_microbatches)


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"need num_stages >= 1 and num_microbatches >= 1, "
                         f"got {num_stages} and {num_microbatches}")


# ----------------------------------------------------------------------------- schedules as data
@register_schedule("GPipe")
def gpipe_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe (fill-drain): every stage runs all forwards, then all backwards, in micro-batch order.

    Stage s holds the activations of all m micro-batches before its first backward.
    """
    _check_sizes(num_stages, num_microbatches)
    forwards = [("F", i) for i in range(num_microbatches)]
    backwards = [("B", i) for i in range(num_microbatches)]
    return [forwards + backwards for _ in range(num_stages)]


@register_schedule("1F1B")
def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (one forward, one backward): return schedule[stage] = list of ("F", i) / ("B", i).

    For p = num_stages, m = num_microbatches, stage s (0-based) runs:
      1. warm-up: the forwards of micro-batches 0 .. w-1, where w = min(p - s - 1, m);
      2. steady state: while forwards are left, one forward (next micro-batch) then one backward
         (oldest micro-batch not yet backwarded);
      3. cool-down: the remaining backwards, in micro-batch order.
    Forwards and backwards each go in increasing micro-batch order, as in GPipe, so consecutive
    stages send and receive in the same order. Example, p = 2, m = 3:
      stage 0: F0 F1 B0 F2 B1 B2        stage 1: F0 B0 F1 B1 F2 B2

    Tests check: the exact lists for small cases; `validate_schedule` accepts it for p = 1..4,
    m = 1..8; stage s never holds more than min(p - s, m) micro-batches' activations
    (`peak_in_flight`); with unit-time actions it finishes as early as GPipe.
    """
    _check_sizes(num_stages, num_microbatches)  # ValueError for p < 1 or m < 1
    ### BEGIN SOLUTION
    schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        actions: list[Action] = [("F", i) for i in range(warmup)]
        next_forward, next_backward = warmup, 0
        while next_forward < num_microbatches:
            actions += [("F", next_forward), ("B", next_backward)]
            next_forward += 1
            next_backward += 1
        actions += [("B", i) for i in range(next_backward, num_microbatches)]
        schedule.append(actions)
    return schedule
    ### END SOLUTION


# ------------------------------------------------------------- simulating and checking schedules
@dataclass(frozen=True)
class TimedAction:
    stage: int
    kind: str         # "F" or "B"
    microbatch: int
    start: float      # seconds (measured) or time units (simulated)
    end: float


class ScheduleDeadlock(ValueError):
    """Every stage that has work left waits for an action that can never run."""


# What (kind, stage, microbatch) must finish before an action of each kind can start: the chain
# rule across stages. kind -> f(stage, microbatch, num_stages) -> [(kind, stage, microbatch)].
DEPENDENCIES: dict[str, Callable[[int, int, int], list[tuple]]] = {
    # a forward needs the activation of the previous stage
    "F": lambda stage, mb, p: [("F", stage - 1, mb)] if stage > 0 else [],
    # a backward needs its own forward (saved activations) and dL/d(output) from the next stage
    "B": lambda stage, mb, p: [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < p - 1 else []),
}


def _dependencies(kind: str, stage: int, microbatch: int, num_stages: int) -> list[tuple]:
    return DEPENDENCIES[kind](stage, microbatch, num_stages)


def simulate_schedule(schedule: Schedule, forward_time: float = 1.0, backward_time: float = 1.0,
                      *, durations: dict[str, float] | None = None,
                      stage_durations: list[dict[str, float]] | None = None) -> list[list[TimedAction]]:
    """Replay `schedule`: each stage runs its actions in order, each as soon as its inputs exist.

    Pure function, no processes; communication takes no time. An action of kind k lasts
    `durations[k]` (default: F forward_time, B backward_time), on stage s `stage_durations[s][k]`
    where given (e.g. each stage's measured times: with equal stages the bubble is the formula's
    whatever the times, so only unequal stages can move it). Raises ScheduleDeadlock when some
    stage can never make progress (e.g. a backward listed before its own forward).
    """
    same = {"F": forward_time, "B": backward_time, **(durations or {})}
    per_stage = [{**same, **((stage_durations or [])[s] if s < len(stage_durations or []) else {})}
                 for s in range(len(schedule))]
    num_stages = len(schedule)
    finished: dict[tuple, float] = {}        # (kind, stage, microbatch) -> end time
    position = [0] * num_stages
    stage_free = [0.0] * num_stages
    timeline: list[list[TimedAction]] = [[] for _ in range(num_stages)]
    while any(position[s] < len(schedule[s]) for s in range(num_stages)):
        progressed = False
        for stage, actions in enumerate(schedule):
            while position[stage] < len(actions):
                kind, microbatch = actions[position[stage]]
                deps = _dependencies(kind, stage, microbatch, num_stages)
                if any(dep not in finished for dep in deps):
                    break
                start = max([stage_free[stage]] + [finished[dep] for dep in deps])
                end = start + per_stage[stage][kind]
                finished[(kind, stage, microbatch)] = end
                stage_free[stage] = end
                timeline[stage].append(TimedAction(stage, kind, microbatch, start, end))
                position[stage] += 1
                progressed = True
        if not progressed:
            stuck = "; ".join(f"stage {s} waits at {schedule[s][position[s]]}"
                              for s in range(num_stages) if position[s] < len(schedule[s]))
            raise ScheduleDeadlock(f"schedule deadlocks: {stuck}")
    return timeline


def validate_schedule(schedule: Schedule, num_microbatches: int, kinds: str = "FB") -> None:
    """Raise ValueError unless `schedule` can run without losing or hanging (the executor of
    labs/lab06_pipeline.py runs kinds "FB").

    Per stage: every micro-batch exactly once per kind, in the order of `kinds` (backward after
    forward). Across stages: neighbours run each kind in the same micro-batch order, because
    messages between two ranks are matched in the order they are posted; and the dependencies are
    satisfiable (`simulate_schedule` finishes).
    """
    if not schedule:
        raise ValueError("a schedule needs at least one stage")
    expected = sorted((kind, i) for kind in kinds for i in range(num_microbatches))
    for stage, actions in enumerate(schedule):
        for action in actions:
            if (not isinstance(action, tuple) or len(action) != 2 or action[0] not in kinds
                    or not isinstance(action[1], int)):
                raise ValueError(f"stage {stage}: {action!r} is not one of "
                                 f"{', '.join(repr((k, 'i')) for k in kinds)}")
        if sorted(actions) != expected:
            raise ValueError(f"stage {stage} must run {'/'.join(kinds)} of micro-batches "
                             f"0..{num_microbatches - 1} exactly once each; it runs {actions}")
        for i in range(num_microbatches):
            for before, after in zip(kinds, kinds[1:]):
                if actions.index((after, i)) < actions.index((before, i)):
                    raise ValueError(f"stage {stage} runs ('{after}', {i}) before ('{before}', {i})")
    for stage in range(len(schedule) - 1):
        for kind in kinds:
            here = [i for k, i in schedule[stage] if k == kind]
            there = [i for k, i in schedule[stage + 1] if k == kind]
            if here != there:
                raise ValueError(f"stages {stage} and {stage + 1} run {kind} in different "
                                 f"micro-batch orders ({here} vs {there}): their sends and "
                                 f"receives would not match")
    simulate_schedule(schedule, durations={k: 1.0 for k in kinds})  # raises ScheduleDeadlock


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per stage: the most micro-batches forwarded but not yet done with (activations held).

    A micro-batch's activations are held from its forward until the stage's last action on it
    (its backward; the weight-gradient action where a schedule splits the backward)."""
    peaks = []
    for actions in schedule:
        last = {mb: index for index, (_, mb) in enumerate(actions)}
        held = peak = 0
        for index, (kind, microbatch) in enumerate(actions):
            held += kind == "F"
            peak = max(peak, held)
            held -= last[microbatch] == index
        peaks.append(peak)
    return peaks


# ----------------------------------------------------------------------------------- the bubble
def bubble_formula(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of a fill-drain pipeline with equal stages: (p - 1) / (m + p - 1)
    (of the whole step, every stage counted; GPipe's accounting)."""
    _check_sizes(num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def bubble_ratio_formula(num_stages: int, num_microbatches: int) -> float:
    """Bubble time over ideal (compute) time, (p - 1) / m: the "bubble time fraction" of
    Megatron-LM (Narayanan et al. 2021, arXiv:2104.04473, sec. 2.2) and of the Ultra-Scale
    Playbook. Same bubble, other denominator: ratio = fraction / (1 - fraction)."""
    _check_sizes(num_stages, num_microbatches)
    return (num_stages - 1) / num_microbatches


def _busy_and_capacity(timeline: list[list[TimedAction]]) -> tuple[float, float]:
    actions = [a for stage in timeline for a in stage]
    if not actions:
        raise ValueError("empty timeline")
    span = max(a.end for a in actions) - min(a.start for a in actions)
    return sum(a.end - a.start for a in actions), len(timeline) * span


def bubble_fraction(timeline: list[list[TimedAction]]) -> float:
    """Idle fraction: 1 - (time spent computing) / (stages * span from first start to last end)."""
    busy, capacity = _busy_and_capacity(timeline)
    return 1.0 - busy / capacity if capacity > 0 else 0.0


def bubble_ratio(timeline: list[list[TimedAction]]) -> float:
    """Idle time over compute time, summed over stages: compare with (p - 1) / m."""
    busy, capacity = _busy_and_capacity(timeline)
    return (capacity - busy) / busy if busy > 0 else math.inf


def mean_durations(timeline: list[list[TimedAction]]) -> dict[str, float]:
    """Mean duration of each kind of action in a timeline (e.g. measured F and B times)."""
    spans: dict[str, list[float]] = {}
    for stage in timeline:
        for a in stage:
            spans.setdefault(a.kind, []).append(a.end - a.start)
    return {kind: sum(v) / len(v) for kind, v in spans.items()}


def stage_mean_durations(timeline: list[list[TimedAction]]) -> list[dict[str, float]]:
    """Per stage, the mean duration of each kind of action (each stage's measured F and B)."""
    return [mean_durations([stage]) for stage in timeline]


def makespan(timeline: list[list[TimedAction]]) -> float:
    actions = [a for stage in timeline for a in stage]
    return max(a.end for a in actions) - min(a.start for a in actions)


TREND_TOL = 0.02  # idle fractions closer than this are "about the same" (timing noise)


def bubble_conclusion(name: str, runs: dict[int, dict], num_stages: int, *, smoke: bool,
                      width: int, microbatch_size: int) -> list[str]:
    """What one schedule's measured bubbles say, each sentence chosen from the numbers.

    runs[m] = labs/lab06_pipeline.py's measure_schedule for m micro-batches (bubble,
    forward/backward_seconds, span_seconds, simulated_span_seconds). Compares the measured idle fraction at the smallest and
    the largest m with the formula's, and computing time per action with the time messages and
    waiting add per action on the critical path (the measured span minus the replay with free
    messages, over the 2(m + p - 1) actions of that path); says "not on this run" when the
    measured bubble did not fall with m as the formula does.
    """
    counts = sorted(runs)
    lo, hi = counts[0], counts[-1]
    first, last = runs[lo]["bubble"], runs[hi]["bubble"]
    f_lo, f_hi = bubble_formula(num_stages, lo), bubble_formula(num_stages, hi)
    trend = ("fell" if last < first - TREND_TOL else "rose" if last > first + TREND_TOL
             else "stayed about the same")
    r = runs[hi]
    compute_ms = 1e3 * (r["forward_seconds"] + r["backward_seconds"]) / 2  # one action, on average
    waiting_ms = max(0.0, 1e3 * (r["span_seconds"] - r["simulated_span_seconds"])
                     / (2 * (hi + num_stages - 1)))
    lines = [f"{name}: measured idle fraction {first:.2f} at m={lo} -> {last:.2f} at m={hi} "
             f"({trend}); the formula (p-1)/(m+p-1) goes {f_lo:.2f} -> {f_hi:.2f}. An action "
             f"computes for {compute_ms:.2f} ms on average; messages and waiting add "
             f"{waiting_ms:.2f} ms per action on the critical path."]
    small = (f"the stages are so small here (width {width}, micro-batches of {microbatch_size} "
             "rows) that sending a micro-batch and waiting for it costs more than computing it")
    rerun = ("the full-size run (without COURSE_SMOKE) makes each action longer" if smoke else
             "a busy machine does this too: rerun when it is quiet")
    if trend == "fell" and f_hi < f_lo:
        above = last - f_hi
        head = "  -> the measured bubble fell with m, as the formula says"
        if above <= TREND_TOL:
            lines.append(f"{head}, and ends within {TREND_TOL} of it at m={hi}.")
        elif waiting_ms > compute_ms:
            lines.append(f"{head}, and ends {above:.2f} above it at m={hi}: {small}.")
        else:
            lines.append(f"{head}, and ends {above:.2f} above it at m={hi}: the share of messages "
                         "and waiting (and of the last stage's extra loss computation).")
    elif f_hi < f_lo:
        lines.append(f"  -> not on this run: the measured bubble {trend} as m grew, while the "
                     "formula's falls. " + (f"Messages and waiting dominate: {small}; {rerun}."
                                            if waiting_ms > compute_ms else
                                            "Computing dominates here, so a busy machine is the "
                                            "likely cause: rerun when it is quiet."))
    else:
        lines.append("  -> one stage or one micro-batch count: the formula has no trend to follow.")
    return lines


def timeline_from_report(rows: list[list[list]]) -> list[list[TimedAction]]:
    """TimedActions from a measured timeline in JSON: rows[stage] = [[kind, mb, start, end], ...]."""
    return [[TimedAction(stage, k, int(mb), s, e) for k, mb, s, e in actions]
            for stage, actions in enumerate(rows)]


def explore_schedule(num_stages: int, num_microbatches: int, schedule_name: str,
                     backward_time: float = 2.0) -> dict:
    """What the notebook's explorer shows: simulated timeline, both bubbles vs their formulas,
    peak activations held."""
    schedule = make_schedule(schedule_name, num_stages, num_microbatches)
    timeline = simulate_schedule(schedule, forward_time=1.0, backward_time=backward_time)
    return {"schedule": schedule, "timeline": timeline, "bubble": bubble_fraction(timeline),
            "formula": bubble_formula(num_stages, num_microbatches),
            "bubble_ratio": bubble_ratio(timeline),
            "ratio_formula": bubble_ratio_formula(num_stages, num_microbatches),
            "peak_in_flight": peak_in_flight(schedule), "makespan": makespan(timeline)}


def plot_gantt(timeline: list[list[TimedAction]], *, title: str, time_unit: str = "forward = 1",
               scale: float = 1.0, ax=None):
    """Stages top to bottom, forwards blue, backwards orange, micro-batch index on each bar."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 * len(timeline) + 1.4))
    origin = min(a.start for stage in timeline for a in stage)
    colors = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
    for stage in timeline:
        for a in stage:
            left, width = (a.start - origin) * scale, (a.end - a.start) * scale
            ax.barh(a.stage, width, left=left, color=colors.get(a.kind, "tab:gray"),
                    edgecolor="white", height=0.7)
            ax.text(left + width / 2, a.stage, f"{a.kind}{a.microbatch}", ha="center",
                    va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(timeline)), [f"stage {s}" for s in range(len(timeline))])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({time_unit})")
    ax.set_title(title)
    ax.figure.tight_layout()
    return ax


# ------------------------------------------------------------------------------------ the lab
def schedule_summary(name: str, num_stages: int, num_microbatches: int,
                     backward_time: float = 2.0) -> dict:
    """One row of the lab's table: a schedule validated, simulated, its bubbles and memory."""
    schedule = make_schedule(name, num_stages, num_microbatches)
    validate_schedule(schedule, num_microbatches)
    result = explore_schedule(num_stages, num_microbatches, name, backward_time)
    return {"schedule": name, "p": num_stages, "m": num_microbatches,
            "idle fraction": result["bubble"], "(p-1)/(m+p-1)": result["formula"],
            "bubble / ideal": result["bubble_ratio"], "(p-1)/m": result["ratio_formula"],
            "most held (stage 0)": result["peak_in_flight"][0]}


def main() -> None:
    from helpers.dist import distributed
    from helpers.notice import notice_if_unsolved
    from helpers.show import table

    with distributed() as ctx:
        rows = {name: attempt(lambda n=name: [schedule_summary(n, 4, m) for m in (1, 4, 8, 16)])
                for name in SCHEDULES}   # a pure function: every rank gets the same answer
        ctx.report(rows=rows)
        if ctx.rank == 0:
            for name, summary in rows.items():
                with notice_if_unsolved():
                    table(solved(summary), floatfmt=".3f",
                          title=f"{name}, simulated with t_B = 2 t_F (no communication cost)")


if __name__ == "__main__":
    main()
