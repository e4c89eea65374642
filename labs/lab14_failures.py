"""Lab 14 (the same failure, two ways): a whole-job restart from checkpoints and per-step fault
tolerance with torchft, run one after the other on the same task with the same planted failure,
timed, and accounted: where each run's time went, and what one failure cost.

Run:  ./run.sh 14      (this file alone: ./run.sh labs/lab14_failures.py; it runs on one rank and
                        starts the other runs itself; --help: its sizes)

1. labs/lab14_restart.py on W = replicas x group ranks, under torchrun with `--max-restarts=1`:
   rank 1 SIGKILLs itself before step `kill_at`, torchrun restarts every rank, they reload the
   last checkpoint and repeat the steps since.
2. labs/lab14_replicas.py as `replicas` replica groups of `group` ranks, each its own torchrun
   (`--max-restarts=1`), with torchft's lighthouse in this process (loopback only): group 1's
   rank 0 dies in the middle of step `kill_at`; the other groups discard that step and go on; torchrun
   restarts group 1 alone, which heals from a peer's live state and rejoins.
3. One process trains on whole global batches for as many steps: the run that never failed.

Nothing is left behind: the lighthouse lives in this process and the replica groups are launches
of this process (helpers.launch: each under a guard that ends its tree when this process ends),
so an interrupted cell or a restarted kernel ends them all (tests/test_lab14_no_leftovers.py).
"""
from __future__ import annotations

import os
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from helpers.dist import DistContext, distributed
from labs import lab14_replicas as replicas_lab
from labs import lab14_restart as restart_lab
from labs.lab14_restart import Task, on_the_cpu, reference_losses, task_config


@dataclass(frozen=True)
class Run(Task):
    """`replicas` replica groups of `group` ranks (the restart run: all of them as one job),
    `steps` steps, a checkpoint every `ckpt_every`, the failure in step `kill_at` (-1: none);
    `only_ft`: the torchft run alone, not accounted (tests/test_lab14_no_leftovers.py). The lab
    itself is one rank, which starts the runs (more ranks: rank 0 does it, the others wait)."""
    ranks: int | None = 1
    replicas: int = 2
    group: int = 2
    steps: int = 40
    ckpt_every: int = 8
    kill_at: int = 13
    only_ft: bool = False
    timeout_s: float = 900.0
    SMOKE = dict(Task.SMOKE, group=1, steps=12, ckpt_every=4, kill_at=6)
    TOUR = dict(SMOKE, steps=8, ckpt_every=3, kill_at=4)

    def __post_init__(self):
        if self.replicas < 2 or self.group < 1:
            raise ValueError(f"--replicas must be at least 2 and --group at least 1, got {self.replicas}, {self.group}")
        if not -1 <= self.kill_at < self.steps:
            raise ValueError(f"--kill-at must lie in -1..{self.steps - 1}, got {self.kill_at}")


# ============================================================================= the two runs
def forked() -> bool:
    """Whether the runs' ranks are forks of a warm torchrun (COURSE_FORK_RANKS=1: the tests and
    CI), restarts included: no torch import per rank and per attempt. A student's run starts
    them fresh, as a real job does (helpers/launch/torchrun.py)."""
    from helpers.config import settings

    return settings().fork_ranks
def restart_run(cfg: Run, folder: Path) -> dict:
    """labs/lab14_restart.py with rank 1 killed before `kill_at`; what each rank reported (by rank)."""
    from helpers.launch import launch

    job = restart_lab.Run(dim=cfg.dim, ffn=cfg.ffn, seq=cfg.seq, steps=cfg.steps, ckpt_every=cfg.ckpt_every,
                          kills=(cfg.kill_at,) if cfg.kill_at >= 0 else (), ckpt_dir=str(folder))
    res = launch("labs/lab14_restart.py", *job.argv(), nproc=cfg.replicas * cfg.group,
                 torchrun_args=["--max-restarts=1"], timeout=cfg.timeout_s, fork_ranks=forked(),
                 env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[restart run, rank${rank}]:"})
    return {"ranks": [res.results[r] for r in sorted(res.results)], "seconds": res.seconds}


def ft_run(cfg: Run) -> dict:
    """`replicas` torchrun launches of labs/lab14_replicas.py at once, around a lighthouse here;
    group 1's rank 0 dies in step `kill_at`. What every rank of every group reported (by group, by rank)."""
    from helpers.launch import launch

    replicas, group = cfg.replicas, cfg.group
    lighthouse, address = replicas_lab.start_lighthouse()
    # the groups run at once: share the cores out between all their ranks, as one launch would
    threads = max(1, (os.cpu_count() or 1) // (replicas * group))

    def group_launch(replica: int):
        job = replicas_lab.Run(dim=cfg.dim, ffn=cfg.ffn, seq=cfg.seq, replica=replica, replicas=replicas,
                               lighthouse=address, steps=cfg.steps, kill_at=cfg.kill_at if replica == 1 else -1)
        return launch("labs/lab14_replicas.py", *job.argv(),
                      nproc=group, torchrun_args=["--max-restarts=1"], timeout=cfg.timeout_s, fork_ranks=forked(),
                      env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": f"[replica group {replica}, rank${{rank}}]:",
                           "OMP_NUM_THREADS": str(threads)})

    try:
        with ThreadPoolExecutor(replicas) as pool:
            launches = list(pool.map(group_launch, range(replicas)))
    finally:
        lighthouse.shutdown()
    # lists, not {rank: report}: the reports travel as JSON, whose keys are strings
    return {"groups": [[res.results[r] for r in sorted(res.results)] for res in launches],
            "seconds": [res.seconds for res in launches]}


# ============================================================================== accounting
def step_spread(durations: list[float]) -> float:
    """Relative spread of step times: (upper quartile - lower quartile) / median."""
    if len(durations) < 4:
        return 0.0
    q = statistics.quantiles(durations, n=4)
    return (q[2] - q[0]) / q[1]


def account_restart(rank0: dict) -> dict:
    """Rank 0's attempts of the restart run -> seconds kept, recomputed, checkpointing, restarting
    (from the failure to the next attempt's first step), the wall-clock time and the step time."""
    attempts = [rank0[f"attempt{a}"] for a in range(10) if f"attempt{a}" in rank0]
    final = {}
    for events in attempts:                     # the last execution of each step is the one kept
        for step, t0, t1, _ in events["steps"]:
            final[step] = (t0, t1)
    runs = [(s, t0, t1) for events in attempts for s, t0, t1, _ in events["steps"]]
    kept = sum(t1 - t0 for t0, t1 in final.values())
    recomputed = sum(t1 - t0 for _, t0, t1 in runs) - kept
    checkpoints = sum(t1 - t0 for events in attempts for _, t0, t1 in events["checkpoints"])
    restarts, loads = [], []
    for before, after in zip(attempts, attempts[1:]):
        last = max([t1 for _, _, t1, _ in before["steps"]] + [c[2] for c in before["checkpoints"]])
        restarts.append(after["steps"][0][1] - last)
        loads.append(after["load"][1] - after["load"][0] if after["load"] else 0.0)
    start = attempts[0]["steps"][0][1]
    end = attempts[-1]["steps"][-1][2]
    durations = [t1 - t0 for _, t0, t1 in runs[1:]]
    return {"wall": end - start, "kept": kept, "recomputed": recomputed, "checkpoints": checkpoints,
            "restarts": sum(restarts), "restart_each": restarts, "load_each": loads,
            "steps_recomputed": len(runs) - len(final), "step_s": statistics.median(durations),
            "spread": step_spread(durations), "losses": _final_losses(attempts),
            "checkpoint_each": [t1 - t0 for events in attempts for _, t0, t1 in events["checkpoints"]]}


def _final_losses(attempts: list[dict]) -> list[float]:
    losses = {}
    for events in attempts:
        for step, _, _, loss in events["steps"]:
            losses[step] = loss
    return [losses[s] for s in sorted(losses)]


def account_ft(groups: list[list[dict]]) -> dict:
    """Every group's rank 0 -> per group: seconds of committed steps (kept), of discarded steps,
    down (from the last step before dying to the first step after healing); in all: the wall-clock
    time, the step time, and the losses of the run (the surviving group's view)."""
    per_group, starts, ends, durations = [], [], [], []
    for ranks in groups:
        rank0 = ranks[0]
        attempts = [rank0[f"attempt{a}"] for a in range(10) if f"attempt{a}" in rank0]
        rows = [row for events in attempts for row in events["steps"]]
        kept = sum(r[5] - r[1] for r in rows if r[6])
        discarded = sum(r[5] - r[1] for r in rows if not r[6])
        down = sum(after["steps"][0][1] - before["steps"][-1][5] if before["steps"] else 0.0
                   for before, after in zip(attempts, attempts[1:]) if after["steps"])
        starts.append(rows[0][1])
        ends.append(rows[-1][5])
        durations += [r[5] - r[1] for r in rows[1:] if r[6] and r[7] == len(groups)]
        per_group.append({"kept": kept, "discarded": discarded, "down": down, "attempts": len(attempts),
                          "steps": len(rows), "heals": [h for events in attempts for h in events["heals"]]})
    wall = max(ends) - min(starts)
    survivor = groups[0][0]["attempt0"]["steps"]
    return {"wall": wall, "groups": per_group, "step_s": statistics.median(durations),
            "spread": step_spread(durations),
            "losses": [[r[0], r[8], r[7]] for r in survivor if r[6]],
            "kept": sum(g["kept"] for g in per_group) / len(per_group),
            "discarded": sum(g["discarded"] for g in per_group) / len(per_group),
            "down": sum(g["down"] for g in per_group) / len(per_group)}


def timeline(out: dict) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """What each row of the timeline figure shows: for the restart run's rank 0 and each torchft
    group's rank 0, spans (start, end) in seconds from its run's first step (the runs came one
    after the other), by kind: kept and recomputed steps, checkpoints and the restart for the first;
    committed and discarded steps, down time and healing for the others."""
    rank0 = out["restart"]["ranks"][0]
    attempts = [rank0[f"attempt{a}"] for a in range(10) if f"attempt{a}" in rank0]
    groups = [[g[0][f"attempt{a}"] for a in range(10) if f"attempt{a}" in g[0]] for g in out["ft"]["groups"]]
    t0 = attempts[0]["steps"][0][1]
    last = {}
    for events in attempts:
        for step, a, b, _ in events["steps"]:
            last[step] = (a, b)
    rows = {"restart run": {"kept step": [], "recomputed step": [], "checkpoint": [], "restart": []}}
    row = rows["restart run"]
    for i, events in enumerate(attempts):
        for step, a, b, _ in events["steps"]:
            row["kept step" if last[step] == (a, b) else "recomputed step"].append((a - t0, b - t0))
        row["checkpoint"] += [(a - t0, b - t0) for _, a, b in events["checkpoints"]]
        if i + 1 < len(attempts):
            end = max([b for _, _, b, _ in events["steps"]] + [c[2] for c in events["checkpoints"]])
            row["restart"].append((end - t0, attempts[i + 1]["steps"][0][1] - t0))
    t0 = min(group[0]["steps"][0][1] for group in groups)
    for g, group in enumerate(groups):
        row = rows[f"torchft group {g}"] = {"committed step": [], "discarded step": [], "down": [], "heal": []}
        for i, events in enumerate(group):
            for r in events["steps"]:
                row["committed step" if r[6] else "discarded step"].append((r[1] - t0, r[5] - t0))
            row["heal"] += [(a - t0, b - t0) for a, b, _ in events["heals"]]
            if i + 1 < len(group) and events["steps"] and group[i + 1]["steps"]:
                row["down"].append((events["steps"][-1][5] - t0, group[i + 1]["steps"][0][1] - t0))
    return rows


def same_losses(losses: list[float], reference: list[float], rtol: float = 1e-4) -> str:
    """The verdict on a run's losses against the run that never failed, step by step."""
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    if worst <= rtol:
        return f"the same run as one process that never failed (largest relative difference {worst:.1e})"
    return f"NOT the uninterrupted run: losses differ by up to {worst:.1e} (relative; tolerance {rtol:g})"


def same_parameters(per_group: list[list[float]]) -> str:
    """The verdict on the groups' parameters (a checksum per tensor, per group) after healing."""
    if all(sums == per_group[0] for sums in per_group):
        return f"all {len(per_group)} groups hold identical parameters"
    return "the groups' parameters DIFFER: a group that healed did not get its peer's state"


def per_failure_cost(restart: dict, ft: dict, replicas: int) -> dict:
    """What one failure cost, in seconds of the whole job's time (all of its ranks): the restart
    stops every rank for the restart and the recomputed steps; torchft stops one group of
    `replicas` for its time down, and every group for the discarded step."""
    return {"whole-job restart": restart["restarts"] + restart["recomputed"],
            "torchft": sum(g["down"] for g in ft["groups"]) / replicas + ft["discarded"]}


# ==================================================================================== the lab
def run(ctx: DistContext, cfg: Run) -> dict:
    """Both runs, the reference and their accounts (rank 0 does it all; other ranks, if any,
    return at once)."""
    if ctx.rank != 0:
        return {}
    if cfg.only_ft:
        return {"ft": ft_run(cfg)}
    with tempfile.TemporaryDirectory(prefix="lab14-ckpt-") as folder:
        restart = restart_run(cfg, Path(folder))
    ft = ft_run(cfg)
    r_acc, f_acc = account_restart(restart["ranks"][0]), account_ft(ft["groups"])
    return {"config": {"replicas": cfg.replicas, "group": cfg.group, "steps": cfg.steps,
                       "ckpt_every": cfg.ckpt_every, "kill_at": cfg.kill_at, **task_config(cfg).as_dict()},
            "restart": {**restart, "account": r_acc}, "ft": {**ft, "account": f_acc},
            "reference": reference_losses(task_config(cfg), max(cfg.steps, len(f_acc["losses"]) + 1)),
            "per_failure": per_failure_cost(r_acc, f_acc, cfg.replicas)}


def main(argv=None) -> None:
    from helpers.show import table

    cfg = Run.from_argv(argv)
    on_the_cpu()
    with distributed() as ctx:
        out = run(ctx, cfg)
        ctx.report(failures=out)
        if cfg.only_ft or ctx.rank != 0:
            return
        r, f = out["restart"]["account"], out["ft"]["account"]
        table([{"run": name, "wall s": a["wall"], "kept s": a["kept"], "step ms": 1e3 * a["step_s"]}
               for name, a in (("whole-job restart", r), ("torchft (per group)", f))],
              title="the same failure, two ways")
        print(f"one failure cost (seconds of the whole job): {out['per_failure']}", flush=True)


if __name__ == "__main__":
    main()
