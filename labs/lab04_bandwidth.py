"""Lab 04 (bandwidth): how fast the collectives run here, reported as NCCL's benchmark does.

Run:  ./run.sh 04      (this file alone: ./run.sh labs/lab04_bandwidth.py)

For message sizes from 4 bytes to 64 MiB (smoke: four sizes) it times all-reduce, all-gather,
reduce-scatter, broadcast and our ring all-reduce with helpers.comm_bench.sweep (warm-up,
synchronize, barrier, median of several runs, the slowest rank's time), and reports algorithm
bandwidth (size / time) and bus bandwidth (algbw x 2(n-1)/n for all-reduce, (n-1)/n for
all-gather and reduce-scatter, 1 for broadcast; nccl-tests' definitions). It fits
time = latency + size / bandwidth per operation (the smallest messages pin down the latency, the
largest the bandwidth), measures the machine's own limit (a memory copy on the CPU, the GPU's
copies on GPUs), and races our ring against the backend's all-reduce at 16 MiB in alternating
rounds: the goal is a ring at 0.8x or more of its bus bandwidth. Until the ring is written (the
homework, labs/lab04_ring.py) the lab runs everything else and reports that it is not.
"""
from __future__ import annotations

from dataclasses import dataclass

from helpers import runs
from helpers.comm_bench import (BUILTIN_CASES, MiB, all_reduce_case, default_sizes,
                                fit_latency_bandwidth, machine_limit, side_by_side, sweep)
from helpers.dist import DistContext, distributed
from helpers.show import table
from labs.lab04_ring import ring_all_reduce, ring_unsolved

GOAL_SIZE = 16 * MiB
GOAL_RATIO = 0.8  # our ring's busbw / the backend all-reduce's busbw, at GOAL_SIZE (smoke: 4 MiB)


def fits_by_op(rows: list[dict]) -> dict[str, dict]:
    """{op: {"latency_us", "bandwidth_GBps", "busbw_GBps"}} from a sweep's rows; None values
    when the times did not grow with size (too few sizes, or a burst of noise)."""
    out = {}
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        try:
            latency, bandwidth = fit_latency_bandwidth([r["bytes"] for r in mine],
                                                       [r["seconds"] for r in mine])
        except ValueError:
            out[op] = {"latency_us": None, "bandwidth_GBps": None, "busbw_GBps": None}
            continue
        factor = mine[0]["busbw_GBps"] / mine[0]["algbw_GBps"]
        out[op] = {"latency_us": latency * 1e6, "bandwidth_GBps": bandwidth / 1e9,
                   "busbw_GBps": bandwidth * factor / 1e9}
    return out


@dataclass(frozen=True)
class Run(runs.Run):
    """The message sizes swept (bytes; default_sizes: 4 B to 64 MiB by factors of 4) and the
    repeats of each; the size of the race against our ring and its rounds; the copy that measures
    the machine's limit and its repeats."""
    sizes: tuple[int, ...] = tuple(default_sizes(smoke=False))
    repeats: int = 5
    goal_size: int = GOAL_SIZE
    rounds: int = 9
    limit_size: int = 64 * MiB
    limit_repeats: int = 5
    SMOKE = dict(sizes=tuple(default_sizes(smoke=True)), repeats=3, goal_size=4 * MiB, rounds=5,
                 limit_size=16 * MiB, limit_repeats=3)


def run(ctx: DistContext, cfg: Run) -> dict:
    """Sweep, fit, limit and race; return everything. `ring` is the race against our ring, or
    the record that ring_all_reduce is not written yet."""
    unsolved = ring_unsolved(ctx.device)
    ring = [] if unsolved else [all_reduce_case("ring (ours)", ring_all_reduce)]
    goal_size = cfg.goal_size
    rows = sweep([*BUILTIN_CASES, *ring], list(cfg.sizes), device=ctx.device, warmup=1,
                 repeats=cfg.repeats)
    race = side_by_side([BUILTIN_CASES[0], *ring], goal_size, device=ctx.device,
                        rounds=cfg.rounds) if ring else []
    limits = machine_limit(ctx.device, cfg.limit_size, repeats=cfg.limit_repeats) if ctx.rank == 0 else []
    ctx.barrier()  # the others wait while rank 0 measures the limit alone
    if unsolved:
        goal = unsolved
    else:
        ratio = race[1]["busbw_GBps"] / race[0]["busbw_GBps"]
        goal = {"size_bytes": goal_size, "ratio": ratio, "target": GOAL_RATIO,
                "met": ratio >= GOAL_RATIO, "world_size": ctx.world_size, "race": race}
    return {"bench_rows": rows, "fits": fits_by_op(rows), "limits": limits, "ring": goal,
            "backend": ctx.backend}


def print_summary(result: dict) -> None:
    rows = result["bench_rows"]
    by_op = [{"op": op, **{size_label(r["size"]): r["busbw_GBps"] for r in rows if r["op"] == op}}
             for op in dict.fromkeys(r["op"] for r in rows)]
    table(by_op, title=f"bus bandwidth, GB/s ({result['backend']})")
    table([{"op": op, **fit} for op, fit in result["fits"].items()],
          title="fit: time = latency + size / bandwidth")
    for limit in result["limits"]:
        print(f"machine limit: {limit['limit']}: {limit['GBps']:.2f} GB/s")
    g = result["ring"]
    if "unsolved" in g:
        print("ring_all_reduce is not written yet (the homework, labs/lab04_ring.py): no ring in this run")
    else:
        print(f"ring vs built-in all_reduce at {size_label(g['size_bytes'])} on {g['world_size']} "
              f"ranks: {g['ratio']:.2f}x the bus bandwidth (goal >= {g['target']}x: "
              f"{'met' if g['met'] else 'not met in this run'})")


def size_label(nbytes: int) -> str:
    """4 B, 64 KiB, 16 MiB: a message size for a table or an axis."""
    for unit, scale in (("MiB", MiB), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        result = run(ctx, cfg)
        if ctx.rank == 0:
            print_summary(result)
        ctx.report(**result)


if __name__ == "__main__":
    main()
