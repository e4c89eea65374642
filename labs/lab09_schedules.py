"""Lab 09 (schedules): interleaved 1F1B and zero-bubble pipeline schedules, simulated beside
notebook 06's GPipe and 1F1B.

Run:  ./run.sh 09      (this file alone: ./run.sh labs/lab09_schedules.py; no communication: every
                        rank prints the same table, rank 0 shows it)

Notebook 06 gave every pipeline stage a device of its own. The schedules here break that picture:

- **interleaved 1F1B** (Narayanan et al. 2021, arXiv:2104.04473, sec. 2.2.2): each of the p ranks
  holds v model chunks ("virtual stages"): rank r holds stages r, r + p, ..., r + (v-1)p of a
  pipeline of p*v stages. A micro-batch visits every rank v times, each time for 1/v of its
  layers, so filling and draining the pipeline takes 1/v as long: the bubble falls from (p-1)/m
  to (p-1)/(v m) of the ideal step time, for v times as many point-to-point messages.
- **zero bubble** (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv:2401.10241): a
  backward splits into B, the gradient of the stage's input (the previous stage waits for it),
  and W, the gradient of its weights (nobody waits for it). W's fill the holes of the bubble.
  ZB-H1 holds no more than 1F1B's peak (p micro-batches) on any stage and, when F, B and W take
  equal time, leaves a third of 1F1B's bubble; ZB-V (sec. 6 of the paper; torch's
  `ScheduleZBVZeroBubble`) puts two chunks per rank in a V (rank r: stages r and 2p-1-r).

Notebook 06's simulator (labs/lab06_schedules.py) serialises the actions of one list, one list per
stage. With several stages per rank, what is serialised is a *rank*: so a schedule here is, per
rank, a list of actions (kind, microbatch, stage), kind "F", "B" or "W", stage the index of the
model chunk in the whole pipeline. `simulate_ranks` replays it with notebook 06's dependency rules
(`DEPENDENCIES`, to which this module adds the "W" rule, its documented hook) and returns notebook
06's `TimedAction`s, so its `bubble_fraction`, `bubble_ratio` and `makespan` apply unchanged.
`from_stages` turns any notebook-06 schedule (GPipe, your 1F1B) into this form; `from_torch` turns
the order torch.distributed.pipelining computes (`schedule.pipeline_order`, e.g. "2F0", "1I3") into
it, so torch's own interleaved and ZB-V orders are drawn and timed by the same code.

`register_schedules()` adds ZB-H1 (one stage per rank: notebook 06's format, kinds F, B, W) to
notebook 06's registry. It is not done on import: notebook 06's tests expect its registry to hold
GPipe and 1F1B only, and a test run imports every lab into one process.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from helpers.tensors import divide
from labs import lab06_schedules as sched
from labs.lab06_schedules import DEPENDENCIES, TimedAction, bubble_ratio

StageAction = tuple[str, int, int]        # (kind, microbatch, stage): kind "F", "B" or "W"
RankSchedule = list[list[StageAction]]    # schedule[rank] = that rank's actions, in the order it runs them

# The weight gradient of micro-batch i on a stage needs that stage's input gradient (its B) done:
# B produced dL/d(output) x d(output)/d(input); W reuses dL/d(output) with the saved input.
DEPENDENCIES.setdefault("W", lambda stage, mb, p: [("B", stage, mb)])


@dataclass(frozen=True)
class ChunkAction(TimedAction):
    """A TimedAction on a rank (`stage` is the rank: the Gantt chart's row) of model chunk
    `chunk` (its stage in the whole pipeline)."""
    chunk: int = 0


# ----------------------------------------------------------------------------- placements
def interleaved_stages(rank: int, num_ranks: int, virtual_stages: int) -> list[int]:
    """Stages rank r holds in interleaved 1F1B: r, r + p, ..., r + (v-1) p (Megatron's "looped")."""
    return [chunk * num_ranks + rank for chunk in range(virtual_stages)]


def v_stages(rank: int, num_ranks: int) -> list[int]:
    """Stages rank r holds in ZB-V: r going down the V and 2p - 1 - r coming back up."""
    return [rank, 2 * num_ranks - 1 - rank]


# ------------------------------------------------------------------------------- schedules
def from_stages(schedule: sched.Schedule) -> RankSchedule:
    """A notebook-06 schedule (one stage per rank, actions (kind, mb)) in this module's form."""
    return [[(kind, mb, stage) for kind, mb in actions] for stage, actions in enumerate(schedule)]


def interleaved_1f1b(num_ranks: int, num_microbatches: int, virtual_stages: int) -> RankSchedule:
    """Interleaved 1F1B as Megatron-LM runs it (Narayanan et al. 2021, sec. 2.2.2), v >= 2 chunks
    per rank.

    Rank r runs m*v forwards, the k-th for micro-batch (k // (p v)) p + k % p on its chunk
    (k // p) % v: p micro-batches go through chunk 0, then the same p through chunk 1, and so on.
    Backwards go through the chunks in the opposite order. Rank r first runs
    w = 2(p - r - 1) + (v - 1) p forwards, then alternates one forward and one backward, then
    drains the backwards. Needs m divisible by p (as Megatron). One chunk per rank is notebook 06's
    1F1B, the homework there: it is not produced here.
    """
    p, m, v = num_ranks, num_microbatches, virtual_stages
    if p < 1 or m < 1 or v < 2:
        raise ValueError(f"need p, m >= 1 and v >= 2 chunks per rank, got {p}, {m}, {v} (one chunk "
                         "per rank is plain 1F1B: labs/lab06_schedules.one_f_one_b_schedule)")
    divide(m, p, "micro-batches over the pipeline ranks (interleaved 1F1B runs groups of p)")
    total = m * v

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def chunk(k: int, forward: bool) -> int:
        c = (k // p) % v
        return c if forward else v - 1 - c

    rows: RankSchedule = []
    for rank in range(p):
        warmup = min(total, 2 * (p - rank - 1) + (v - 1) * p)
        fwd = lambda k: ("F", microbatch(k), chunk(k, True) * p + rank)       # noqa: E731
        bwd = lambda k: ("B", microbatch(k), chunk(k, False) * p + rank)      # noqa: E731
        actions = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [fwd(warmup + k), bwd(k)]
        actions += [bwd(k) for k in range(total - warmup, total)]
        rows.append(actions)
    return rows


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> sched.Schedule:
    """ZB-H1 (Qi et al. 2024, sec. 3), in notebook 06's format with kinds "F", "B", "W".

    Stage s runs 1F1B's forwards and backwards (p - s - 1 warm-up forwards, then one forward and
    one backward), and after each backward the W of the micro-batch s backwards earlier: its W's
    lag its B's by s, and the last ones run at the end. The last stages thus defer their W's
    into the time the first stages spend waiting for backwards, and the first stage's cool-down
    is filled. With T_F = T_B = T_W the bubble is (p - 1) T_F = (p - 1)(T_F + T_B - T_W), a third
    of 1F1B's (p - 1)(T_F + T_B + T_W); every stage holds at most p micro-batches (from F to
    W), 1F1B's peak (on its first stage).
    """
    p, m = num_stages, num_microbatches
    if p < 1 or m < 1:
        raise ValueError(f"need num_stages >= 1 and num_microbatches >= 1, got {p} and {m}")
    stages: sched.Schedule = []
    for stage in range(p):
        warmup = min(p - stage - 1, m)
        actions: list[sched.Action] = [("F", i) for i in range(warmup)]
        forward, backward, weight = warmup, 0, 0
        while backward < m:
            if forward < m:
                actions.append(("F", forward))
                forward += 1
            actions.append(("B", backward))
            backward += 1
            if backward - weight > stage:     # W lags B by `stage` micro-batches
                actions.append(("W", weight))
                weight += 1
        actions += [("W", i) for i in range(weight, m)]
        stages.append(actions)
    return stages


def register_schedules() -> None:
    """Add ZB-H1 to notebook 06's registry (make_schedule("ZB-H1", p, m)); idempotent."""
    sched.register_schedule("ZB-H1")(zero_bubble_h1)


_TORCH_ACTION = re.compile(r"^(\d+)(F|B|I|W)(\d+)$")


def from_torch(pipeline_order: dict) -> RankSchedule:
    """torch.distributed.pipelining's `schedule.pipeline_order` ({rank: [action or None]}, actions
    printed "<stage><kind><microbatch>": F forward, I input gradient, W weight gradient, B full
    backward) as a RankSchedule; torch's I becomes our B. Idle slots (None) are dropped."""
    ranks = sorted(int(r) for r in pipeline_order)
    out: RankSchedule = []
    for rank in ranks:
        actions = []
        for action in pipeline_order[rank] if rank in pipeline_order else pipeline_order[str(rank)]:
            if action is None or str(action).strip() in ("", "None"):
                continue
            match = _TORCH_ACTION.match(str(action).strip())
            if not match:
                raise ValueError(f"rank {rank}: cannot read torch action {action!r}")
            stage, kind, mb = match.groups()
            actions.append(("B" if kind == "I" else kind, int(mb), int(stage)))
        out.append(actions)
    return out


# ------------------------------------------------------------------------------ simulating
def stage_owner(schedule: RankSchedule) -> dict[int, int]:
    """stage -> the rank that runs it; ValueError if a stage appears on two ranks."""
    owner: dict[int, int] = {}
    for rank, actions in enumerate(schedule):
        for _, _, stage in actions:
            if owner.setdefault(stage, rank) != rank:
                raise ValueError(f"stage {stage} appears on ranks {owner[stage]} and {rank}")
    return owner


def _replay(schedule: RankSchedule, durations: dict[str, float]) -> list[list[tuple[float, float]]]:
    """(start, end) of every action of every rank: each rank runs its actions in order, each as
    soon as its inputs exist. Each rank runs until it waits; a finished action wakes its waiters."""
    num_stages = len(stage_owner(schedule))
    finished: dict[tuple, float] = {}
    waiting: dict[tuple, list[int]] = {}     # an action not finished yet -> ranks blocked on it
    position, free = [0] * len(schedule), [0.0] * len(schedule)
    times: list[list[tuple[float, float]]] = [[] for _ in schedule]
    runnable = list(range(len(schedule)))
    while runnable:
        rank = runnable.pop()
        actions = schedule[rank]
        while position[rank] < len(actions):
            kind, mb, stage = actions[position[rank]]
            start = free[rank]
            blocked = None
            for dep in DEPENDENCIES[kind](stage, mb, num_stages):
                if dep not in finished:
                    blocked = dep
                    break
                start = max(start, finished[dep])
            if blocked is not None:
                waiting.setdefault(blocked, []).append(rank)
                break
            finished[(kind, stage, mb)] = free[rank] = start + durations[kind]
            times[rank].append((start, free[rank]))
            position[rank] += 1
            runnable += waiting.pop((kind, stage, mb), ())
    if any(position[r] < len(a) for r, a in enumerate(schedule)):
        stuck = "; ".join(f"rank {r} waits at {a[position[r]]}" for r, a in enumerate(schedule)
                          if position[r] < len(a))
        raise sched.ScheduleDeadlock(f"schedule deadlocks: {stuck}")
    return times


def simulate_ranks(schedule: RankSchedule, durations: dict[str, float]) -> list[list[ChunkAction]]:
    """Replay a RankSchedule: each rank runs its actions in order, each as soon as its inputs
    exist (notebook 06's DEPENDENCIES, over the stages of the whole pipeline); communication is
    free. `durations[kind]` is one action's time (give a chunk's time: 1/v of a rank's layers).
    Raises notebook 06's ScheduleDeadlock when some rank can never go on."""
    return [[ChunkAction(rank, kind, mb, start, end, stage)
             for (kind, mb, stage), (start, end) in zip(actions, times)]
            for rank, (actions, times) in enumerate(zip(schedule, _replay(schedule, durations)))]


def validate_ranks(schedule: RankSchedule, num_microbatches: int, kinds: str = "FB") -> None:
    """ValueError unless every stage runs every kind of every micro-batch exactly once, on one
    rank, in the order of `kinds` (F before B before W), and the schedule cannot deadlock."""
    owner = stage_owner(schedule)
    if sorted(owner) != list(range(len(owner))):
        raise ValueError(f"stages must be 0..{len(owner) - 1}, got {sorted(owner)}")
    for rank, actions in enumerate(schedule):
        position = {action: i for i, action in enumerate(actions)}
        if len(position) != len(actions):
            raise ValueError(f"rank {rank} runs an action twice")
        for stage in (s for s, r in owner.items() if r == rank):
            for mb in range(num_microbatches):
                missing = [k for k in kinds if (k, mb, stage) not in position]
                if missing:
                    raise ValueError(f"rank {rank} never runs {missing} of micro-batch {mb} on stage {stage}")
                for before, after in zip(kinds, kinds[1:]):
                    if position[(after, mb, stage)] < position[(before, mb, stage)]:
                        raise ValueError(f"rank {rank} runs {after}{mb} before {before}{mb} on stage {stage}")
        extra = [a for a in actions if a[0] not in kinds or not 0 <= a[1] < num_microbatches]
        if extra:
            raise ValueError(f"rank {rank} runs actions outside kinds {kinds!r} / micro-batches: {extra[:3]}")
    simulate_ranks(schedule, {k: 1.0 for k in kinds})


def peak_held(schedule: RankSchedule) -> list[float]:
    """Per rank: the most activations held at once, in micro-batches through ALL of the rank's
    layers (a chunk of a rank holding v chunks counts 1/v). Held from a chunk's F to the rank's
    last action on that (chunk, micro-batch): its B, or its W where the backward is split."""
    peaks = []
    for actions in schedule:
        share = 1.0 / max(1, len({stage for _, _, stage in actions}))
        last = {(stage, mb): i for i, (_, mb, stage) in enumerate(actions)}
        held = peak = 0.0
        for i, (kind, mb, stage) in enumerate(actions):
            held += share if kind == "F" else 0.0
            peak = max(peak, held)
            held -= share if last[(stage, mb)] == i else 0.0
        peaks.append(round(peak, 9))
    return peaks


# ------------------------------------------------------------------------- for the planner
PLANNER_SCHEDULES = ("GPipe", "1F1B", "interleaved 1F1B", "ZB-H1")


def planner_schedule(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> RankSchedule:
    """The schedules the planner knows, as RankSchedules, for timing them. 1F1B takes exactly as
    long as GPipe with equal micro-batch times (notebook 06: same makespan, fewer activations held),
    so it is timed with GPipe's order: the planner does not depend on notebook 06's exercise."""
    if name in ("GPipe", "1F1B"):
        return from_stages(sched.gpipe_schedule(num_ranks, num_microbatches))
    if name == "interleaved 1F1B":
        return interleaved_1f1b(num_ranks, num_microbatches, virtual_stages)
    if name == "ZB-H1":
        return from_stages(zero_bubble_h1(num_ranks, num_microbatches))
    raise ValueError(f"unknown schedule {name!r}; the planner knows {PLANNER_SCHEDULES}")


def chunk_durations(name: str, t_forward: float, t_backward: float, virtual_stages: int = 1) -> dict[str, float]:
    """Seconds of one action, given t_forward / t_backward of one micro-batch through all of a
    rank's layers: interleaved chunks take 1/v of them; ZB-H1 splits the backward into equal B
    and W (Qi et al.'s assumption T_B = T_W)."""
    if name == "interleaved 1F1B":
        return {"F": t_forward / virtual_stages, "B": t_backward / virtual_stages}
    if name == "ZB-H1":
        return {"F": t_forward, "B": t_backward / 2, "W": t_backward / 2}
    return {"F": t_forward, "B": t_backward}


@functools.lru_cache(maxsize=4096)
def _unit_makespan(name: str, p: int, m: int, v: int, backward_ratio: float) -> float:
    schedule = planner_schedule(name, p, m, v)
    times = _replay(schedule, chunk_durations(name, 1.0, backward_ratio, v))
    return max(end for row in times for _, end in row) - min(start for row in times for start, _ in row)


@functools.lru_cache(maxsize=4096)
def _peak_held_rank0(name: str, p: int, m: int, v: int) -> float:
    if name == "1F1B":  # its warm-up: rank 0 holds at most p micro-batches (notebook 06)
        return float(min(p, m))
    return peak_held(planner_schedule(name, p, m, v))[0]


def pipeline_timing(name: str, num_ranks: int, num_microbatches: int, t_forward: float,
                    t_backward: float, virtual_stages: int = 1) -> dict:
    """Simulated step of a pipeline schedule with per-micro-batch times t_forward and t_backward
    on every rank (communication free): {"makespan": seconds from the first action to the last,
    "bubble": makespan - m (t_forward + t_backward), the idle time of each rank, "bubble_ratio":
    bubble / ideal, "peak_held": micro-batches of activations rank 0 holds at its peak}.
    One rank (num_ranks = 1) has no bubble. Times scale linearly, so the simulation is cached
    per (schedule, p, m, v, t_backward / t_forward), that ratio rounded to 3 significant digits
    (the makespan moves by less than 0.1%)."""
    if t_forward <= 0 or t_backward <= 0:
        raise ValueError(f"need positive times, got t_forward={t_forward}, t_backward={t_backward}")
    span_units = _unit_makespan(name, num_ranks, num_microbatches, virtual_stages,
                                float(f"{t_backward / t_forward:.3g}"))
    held = _peak_held_rank0(name, num_ranks, num_microbatches, virtual_stages)
    span = span_units * t_forward
    ideal = num_microbatches * (t_forward + t_backward)
    return {"makespan": span, "bubble": max(0.0, span - ideal), "bubble_ratio": max(0.0, span - ideal) / ideal,
            "peak_held": held}


# ----------------------------------------------------------------------------------- drawing
def plot_ranks(timeline: list[list[ChunkAction]], *, title: str, num_chunks: int | None = None,
               time_unit: str = "forward of one stage = 1", ax=None):
    """Notebook 06's Gantt chart with chunks told apart: F blue, B orange, W green, later chunks
    of a rank lighter; each bar reads kind, micro-batch and (with several chunks) the stage."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 * len(timeline) + 1.4))
    chunks = num_chunks or len({a.chunk for row in timeline for a in row})
    ranks = len(timeline)
    origin = min(a.start for row in timeline for a in row)
    base = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
    for row in timeline:
        for a in row:
            lighten = 0.5 * (a.chunk // ranks) / max(1, chunks // ranks - 1) if chunks > ranks else 0.0
            color = tuple(c + (1 - c) * lighten for c in to_rgb(base.get(a.kind, "tab:gray")))
            ax.barh(a.stage, a.end - a.start, left=a.start - origin, color=color, edgecolor="white", height=0.7)
            label = f"{a.kind}{a.microbatch}" + (f"\n s{a.chunk}" if chunks > ranks else "")
            ax.text((a.start + a.end) / 2 - origin, a.stage, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set(xlabel=f"time ({time_unit})", title=title)
    ax.figure.tight_layout()
    return ax


# ------------------------------------------------------------------------------------ the lab
def comparison_rows(num_ranks: int, num_microbatches: int, virtual_stages: int = 2,
                    backward_ratio: float = 2.0, extra: dict[str, RankSchedule] | None = None) -> list[dict]:
    """Every schedule simulated with t_F = 1, t_B = backward_ratio (per micro-batch through a
    rank's layers): bubble / ideal against its formula, and activations held on rank 0."""
    p, m, v = num_ranks, num_microbatches, virtual_stages
    rows = []
    for name in PLANNER_SCHEDULES:
        timing = pipeline_timing(name, p, m, 1.0, backward_ratio, v)
        formula = {"GPipe": (p - 1) / m, "1F1B": (p - 1) / m,
                   "interleaved 1F1B": (p - 1) / (v * m)}.get(name)
        rows.append({"schedule": name + (f" (v={v})" if name == "interleaved 1F1B" else ""),
                     "bubble / ideal": timing["bubble_ratio"],
                     "formula": "-" if formula is None else formula,
                     "held on rank 0": timing["peak_held"]})
    for name, schedule in (extra or {}).items():
        kinds = "FBW" if any(a[0] == "W" for row in schedule for a in row) else "FB"
        chunks = len(stage_owner(schedule)) // len(schedule)
        durations = {"F": 1.0 / chunks, "B": backward_ratio / chunks / (2 if kinds == "FBW" else 1),
                     "W": backward_ratio / chunks / 2}
        timeline = simulate_ranks(schedule, durations)
        rows.append({"schedule": name, "bubble / ideal": bubble_ratio(timeline), "formula": "-",
                     "held on rank 0": peak_held(schedule)[0]})
    return rows


def main() -> None:
    from helpers.dist import distributed
    from helpers.show import table

    with distributed() as ctx:
        rows = {f"p={p}, m={m}": comparison_rows(p, m) for p, m in ((4, 8), (4, 16))}
        ctx.report(rows=rows)
        if ctx.rank == 0:
            for title, summary in rows.items():
                table(summary, floatfmt=".3f",
                      title=f"{title}: simulated with t_B = 2 t_F, B = W = t_B / 2 for ZB-H1, free messages")


if __name__ == "__main__":
    main()
