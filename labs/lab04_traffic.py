"""Lab 04 (traffic): parameter server vs ring all-reduce, with every byte counted.

Run:  ./run.sh 04      (this file alone: ./run.sh labs/lab04_traffic.py; NPROC=4 for N = 2, 3, 4)

Both algorithms are built from point-to-point messages only, so `helpers.comm_count.count_p2p`
can count what each rank sends and receives in one all-reduce of K bytes:

- parameter server (one server, N-1 workers): every worker sends K to the server and gets K back;
  the server receives and sends (N-1) K: its traffic grows like C(N-1) with the number of ranks.
- direct (all to all): every rank sends K to every other rank: (N-1) K out of every rank.
- ring (the homework, labs/lab04_ring.py): every rank sends 2(N-1)/N K to its next neighbour and
  receives as much from its previous one: under 2K however many ranks there are (Patarasuk and
  Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of workstations"; Baidu's ring
  all-reduce, 2017). Counted, timed and checked against dist.all_reduce once it is written; until
  then the lab reports that it is not (`ring_unsolved`) and runs everything else.

On W ranks the lab measures every N from 2 to W at once, on sub-groups of ranks 0..N-1. It also
times each (and the backend's own all_reduce) at one size, to compare the lecture's bandwidth
formula `sent_bytes / (world_size * duration)` with NCCL's bus bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers import runs
from helpers.bench import measure
from helpers.comm_bench import MiB, busbw, lecture_bandwidth, slowest
from helpers.comm_count import count_p2p
from helpers.dist import DistContext, distributed, new_group
from helpers.show import table
from labs.lab04_ring import ring_all_reduce, ring_check, ring_unsolved


# ============================================================================ parameter server
def parameter_server_all_reduce(tensor: torch.Tensor, group=None, server: int = 0) -> torch.Tensor:
    """Sum `tensor` over `group` in place through one server (a rank of the group): every worker
    sends its tensor to the server, which adds them up and sends the sum back to each. Built
    from point-to-point messages like the ring; the server moves (N-1) K bytes each way."""
    world_size = dist.get_world_size(group)
    if world_size == 1 or tensor.numel() == 0:
        return tensor
    rank = dist.get_rank(group)
    ranks = group if group is not None else dist.group.WORLD
    server_global = dist.get_global_rank(ranks, server)
    if rank != server:
        dist.send(tensor, dst=server_global, group=group)
        dist.recv(tensor, src=server_global, group=group)
        return tensor
    workers = [dist.get_global_rank(ranks, r) for r in range(world_size) if r != server]
    inbox = [torch.empty_like(tensor) for _ in workers]  # (N-1) x K bytes of buffers on the server
    for work in [dist.irecv(buf, src=w, group=group) for w, buf in zip(workers, inbox)]:
        work.wait()
    for buf in inbox:  # in rank order, so the float sum is reproducible
        tensor.add_(buf)
    for work in [dist.isend(tensor, dst=w, group=group) for w in workers]:
        work.wait()
    return tensor


def direct_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `tensor` over `group` in place the naive way: every rank sends its whole tensor to
    every other rank and adds up what arrives. One round, but (N-1) K bytes out of every rank:
    N(N-1) K in all, N/2 times what a ring sends."""
    world_size = dist.get_world_size(group)
    if world_size == 1 or tensor.numel() == 0:
        return tensor
    rank = dist.get_rank(group)
    ranks = group if group is not None else dist.group.WORLD
    peers = {r: dist.get_global_rank(ranks, r) for r in range(world_size) if r != rank}
    inbox = {r: torch.empty_like(tensor) for r in peers}
    ops = [dist.P2POp(dist.isend, tensor, peers[r], group) for r in peers]
    ops += [dist.P2POp(dist.irecv, inbox[r], peers[r], group) for r in peers]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    total = torch.zeros_like(tensor)
    for r in range(world_size):  # the same order on every rank: bitwise-identical float sums
        total.add_(tensor if r == rank else inbox[r])
    return tensor.copy_(total)


ALGORITHMS = {"parameter server": parameter_server_all_reduce,
              "direct (all to all)": direct_all_reduce}
RING = {"ring": ring_all_reduce}  # the homework (labs/lab04_ring.py): measured once it is written


# ============================================================================ measurements
def _test_tensor(rank: int, numel: int, device: torch.device) -> torch.Tensor:
    # small whole numbers in float32: every summation order gives the exact same sum
    return (torch.arange(numel, device=device) % 100 + rank).to(torch.float32)


def prefix_groups(world_size: int) -> dict[int, dist.ProcessGroup]:
    """{N: the group of ranks 0..N-1} for N = 2..world_size. Every rank must call it (new_group is
    collective, members or not); make them once, they are reused by every measurement."""
    return {n: new_group(list(range(n)), name=f"first {n} ranks") for n in range(2, world_size + 1)}


def count_traffic(rank: int, groups: dict, device: torch.device, numel: int,
                  algorithms: dict) -> list[dict]:
    """Bytes each rank sends and receives in one all-reduce of `numel` float32, for every group
    of `groups` ({N: ranks 0..N-1}) and every algorithm. Rows for this rank only."""
    rows = []
    for n, group in groups.items():
        if rank < n:
            expected = _test_tensor(0, numel, device) * n + sum(range(n))
            for name, fn in algorithms.items():
                x = _test_tensor(rank, numel, device)
                with count_p2p() as traffic:  # also: any built-in collective would raise here
                    fn(x, group=group)
                rows.append({"algorithm": name, "world_size": n, "rank": rank,
                             "tensor_bytes": x.nbytes, **traffic.summary(),
                             "correct": bool(torch.equal(x, expected))})
        dist.barrier()
    return rows


def time_algorithms(rank: int, groups: dict, device: torch.device, numel: int,
                    algorithms: dict, repeats: int, built_in: bool = True) -> list[dict]:
    """Median time (the slowest rank's) of one all-reduce of `numel` float32 per group of
    `groups` and algorithm, the backend's own all_reduce included unless `built_in` is False.
    Rows for the groups this rank is in."""
    def backend_all_reduce(x, group=None):
        dist.all_reduce(x, group=group)

    cases = dict(algorithms, **{"built-in all_reduce": backend_all_reduce}) if built_in else algorithms
    rows = []
    for n, group in groups.items():
        for name, fn in cases.items():
            if rank < n:
                x = torch.zeros(numel, device=device)
                timing = measure(lambda: fn(x, group=group), warmup=1, repeats=repeats, device=device)
                rows.append({"algorithm": name, "world_size": n, "bytes": x.nbytes,
                             "seconds": slowest(timing.median, device, group)})
            dist.barrier()  # the ranks outside this group wait here instead of competing for CPU
    return rows


def traffic_summary(rows: list[dict]) -> list[dict]:
    """Per algorithm and N: the busiest rank's and the average rank's bytes, in units of K."""
    out = []
    for name in dict.fromkeys(r["algorithm"] for r in rows):
        for n in sorted({r["world_size"] for r in rows if r["algorithm"] == name}):
            mine = [r for r in rows if r["algorithm"] == name and r["world_size"] == n]
            k = mine[0]["tensor_bytes"]
            out.append({"algorithm": name, "N": n,
                        "max sent / K": max(r["sent_bytes"] for r in mine) / k,
                        "mean sent / K": sum(r["sent_bytes"] for r in mine) / len(mine) / k,
                        "max received / K": max(r["recv_bytes"] for r in mine) / k,
                        "all correct": all(r["correct"] for r in mine)})
    return out


def draw_traffic(summary: list[dict], ax=None):
    """The busiest rank's bytes per all-reduce against N, one line per algorithm in `summary`
    (traffic_summary rows), over the two formulas: C(N-1) for a server, 2(N-1)/N for a ring."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4))
    styles = {"parameter server": "o-", "direct (all to all)": "x--", "ring": "s-"}
    for name in dict.fromkeys(row["algorithm"] for row in summary):
        mine = [row for row in summary if row["algorithm"] == name]
        ax.plot([row["N"] for row in mine], [row["max sent / K"] for row in mine],
                styles.get(name, "d-"), markersize=9, label=f"{name}: busiest rank (counted)")
    ns = sorted({row["N"] for row in summary})
    ax.plot(ns, [n - 1 for n in ns], ":", color="gray", label="C(N-1): the server")
    ax.plot(ns, [2 * (n - 1) / n for n in ns], ":", color="black", label="2(N-1)/N: a ring")
    ax.set_xticks(ns)
    ax.set_xlabel("ranks N")
    ax.set_ylabel("bytes sent by the busiest rank / K")
    ax.set_title("Traffic of one all-reduce of K bytes (counted)")
    ax.legend(fontsize=8)
    return ax


def bandwidth_comparison(timings: list[dict], traffic: list[dict]) -> list[dict]:
    """For each timed all-reduce: algbw, NCCL's busbw, and the lecture's
    sent_bytes / (world_size * duration) with sent_bytes counted (ring, parameter server) or, for
    the built-in all_reduce whose messages we cannot see, assumed to be a ring's 2(N-1) S."""
    out = []
    for t in timings:
        n, s, sec = t["world_size"], t["bytes"], t["seconds"]
        counted = [r for r in traffic if r["algorithm"] == t["algorithm"] and r["world_size"] == n
                   and r["tensor_bytes"] == s]
        sent_total = sum(r["sent_bytes"] for r in counted) if counted else 2 * (n - 1) * s
        busiest = max(r["sent_bytes"] for r in counted) if counted else 2 * (n - 1) / n * s
        out.append({"algorithm": t["algorithm"], "N": n, "MiB": s / MiB, "ms": sec * 1e3,
                    "algbw GB/s": s / sec / 1e9, "busbw GB/s": busbw("all_reduce", s, sec, n) / 1e9,
                    "lecture GB/s": lecture_bandwidth(sent_total, n, sec) / 1e9,
                    "busiest rank sends GB/s": busiest / sec / 1e9,
                    "sent_bytes": "counted" if counted else "assumed 2(N-1)S"})
    return out


@dataclass(frozen=True)
class Run(runs.Run):
    """Ranks (the more, the clearer the trend; any count works), the all-reduced tensor's elements
    (3 MiB of float32, smoke 48 KiB: divisible by 2, 3 and 4, so every chunk is K/N exactly),
    the timing repeats, and the elements of the ring's check."""
    ranks: int | None = 4
    numel: int = 3 * 2 ** 18
    repeats: int = 5
    check_numel: int = 1_000_003
    SMOKE = dict(ranks=3, numel=3 * 2 ** 12, repeats=3, check_numel=1_003)


def run(ctx: DistContext, cfg: Run) -> dict:
    """Count and time the parameter server and the direct all-reduce (and the backend's own);
    then the same for the ring, with `ring_check`, or the record that it is not written yet."""
    numel, repeats = cfg.numel, cfg.repeats
    groups = prefix_groups(ctx.world_size)
    traffic = count_traffic(ctx.rank, groups, ctx.device, numel, ALGORITHMS)
    timings = time_algorithms(ctx.rank, groups, ctx.device, numel, ALGORITHMS, repeats)
    ring = ring_unsolved(ctx.device) or {
        "traffic": count_traffic(ctx.rank, groups, ctx.device, numel, RING),
        "timings": time_algorithms(ctx.rank, groups, ctx.device, numel, RING, repeats, built_in=False),
        "check": ring_check(ctx.device, numel=cfg.check_numel)}
    return {"traffic": traffic, "timings": timings, "ring": ring}


def print_summary(ctx: DistContext, result: dict) -> None:
    """Rank 0 gathers every rank's counts and prints the tables."""
    every = [None] * ctx.world_size if ctx.rank == 0 else None
    ring = result["ring"]
    dist.gather_object([*result["traffic"], *ring.get("traffic", [])], every, dst=0)
    if ctx.rank != 0:
        return
    traffic = [row for rows in every for row in rows]
    table(traffic_summary(traffic), title="bytes sent per rank in one all-reduce of K bytes")
    table(bandwidth_comparison(result["timings"] + ring.get("timings", []), traffic),
          title="bandwidth three ways, from the same durations")
    if "unsolved" in ring:
        print("ring_all_reduce is not written yet (the homework, labs/lab04_ring.py): no ring rows")


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        result = run(ctx, cfg)
        print_summary(ctx, result)
        ctx.report(**result)


if __name__ == "__main__":
    main()
