"""Lab 04 (traffic): parameter server vs ring all-reduce, with every byte counted.

Run:  ./run.sh 04      (this file alone: ./run.sh labs/lab04_traffic.py; NPROC=4 for N = 2, 3, 4)

Both algorithms are built from point-to-point messages only, so `helpers.comm_bench.count_p2p`
can count what each rank sends and receives in one all-reduce of K bytes:

- parameter server (one server, N-1 workers): every worker sends K to the server and gets K back;
  the server receives and sends (N-1) K: its traffic grows like C(N-1) with the number of ranks.
- ring: every rank sends 2(N-1)/N K to its next neighbour and receives as much from its previous
  one: under 2K however many ranks there are (Patarasuk and Yuan 2009, "Bandwidth optimal
  all-reduce algorithms for clusters of workstations"; Baidu's ring all-reduce, 2017).
- direct (all to all): every rank sends K to every other rank: (N-1) K out of every rank.

On W ranks the lab measures every N from 2 to W at once, on sub-groups of ranks 0..N-1. It also
times both (and gloo's own all_reduce) at one size, to compare the lecture's bandwidth formula
`sent_bytes / (world_size * duration)` with NCCL's bus bandwidth. `ring_state` is the pure
model of the ring's schedule behind the notebook's step-by-step widget.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers import pick
from helpers.bench import measure
from helpers.comm_bench import MiB, busbw, count_p2p, lecture_bandwidth, slowest
from helpers.dist import DistContext, distributed
from helpers.show import table
from labs.lab04_collectives import ring_all_reduce, ring_implemented


# ============================================================================ the ring, on paper
@dataclass(frozen=True)
class RingState:
    """The ring all-reduce after `step` of its 2(N-1) steps (step 0: before the first)."""
    world_size: int
    step: int
    phase: str                        # the phase `step` belonged to: start, reduce-scatter, all-gather
    sends: tuple[int | None, ...]     # sends[r]: chunk rank r sent to rank r+1 in this step
    receives: tuple[int | None, ...]  # receives[r]: chunk rank r got from rank r-1 in this step
    holds: tuple[tuple[tuple[int, ...], ...], ...]  # holds[r][c]: ranks summed in r's chunk c

    @property
    def total_steps(self) -> int:
        return 2 * (self.world_size - 1)

    def complete(self, rank: int, chunk: int) -> bool:
        return len(self.holds[rank][chunk]) == self.world_size


def ring_send_chunk(world_size: int, rank: int, step: int) -> int:
    """The chunk `rank` sends to rank+1 at `step` (1-based, 1 .. 2(N-1)); it receives chunk
    ring_send_chunk(N, rank - 1, step) from rank-1 at the same step."""
    if not 1 <= step <= 2 * (world_size - 1):
        raise ValueError(f"step must be in 1..{2 * (world_size - 1)} for {world_size} ranks, got {step}")
    if step <= world_size - 1:                      # reduce-scatter: chunk r - (s - 1)
        return (rank - (step - 1)) % world_size
    return (rank + 1 - (step - world_size)) % world_size  # all-gather: chunk r + 1 - (s - N)


def ring_state(world_size: int, step: int) -> RingState:
    """Simulate the ring's schedule for `step` steps and say what every rank holds.

    Each rank starts with its own term in every chunk. A reduce-scatter step adds the incoming
    chunk's terms to the receiver's copy (never the same rank's term twice); an all-gather step
    replaces the receiver's copy with the sender's complete one.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= step <= 2 * (world_size - 1):
        raise ValueError(f"step must be in 0..{2 * (world_size - 1)} for {world_size} ranks, got {step}")
    n = world_size
    holds = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    sends: list[int | None] = [None] * n
    receives: list[int | None] = [None] * n
    for s in range(1, step + 1):
        sends = [ring_send_chunk(n, r, s) for r in range(n)]
        receives = [sends[(r - 1) % n] for r in range(n)]
        outgoing = [holds[r][sends[r]] for r in range(n)]  # everyone sends at once, then receives
        for r in range(n):
            incoming, chunk = outgoing[(r - 1) % n], receives[r]
            if s <= n - 1:
                if incoming & holds[r][chunk]:
                    raise AssertionError(f"step {s}: rank {r} would add a term twice")
                holds[r][chunk] = holds[r][chunk] | incoming
            else:
                holds[r][chunk] = incoming
    phase = "start" if step == 0 else "reduce-scatter" if step <= n - 1 else "all-gather"
    return RingState(n, step, phase, tuple(sends), tuple(receives),
                     tuple(tuple(tuple(sorted(h)) for h in row) for row in holds))


def ring_state_rows(state: RingState) -> list[dict]:
    """A table of the state: one row per rank, one column per chunk ('SUM' when complete,
    ' *' on the chunk that just arrived)."""
    rows = []
    n = state.world_size
    for r in range(n):
        sent, got = state.sends[r], state.receives[r]
        row = {"rank": r,
               "sends": "-" if sent is None else f"chunk {sent} -> rank {(r + 1) % n}",
               "receives": "-" if got is None else f"chunk {got} <- rank {(r - 1) % n}"}
        for c in range(n):
            terms = state.holds[r][c]
            text = "SUM" if len(terms) == n else "+".join(f"x{t}" for t in terms)
            row[f"chunk {c}"] = text + (" *" if c == got else "")
        rows.append(row)
    return rows


def draw_ring_state(state: RingState, ax=None):
    """The state as a ranks x chunks grid: shade = share of the N terms summed in that copy,
    text = the terms ('SUM' when complete), a black frame = the chunk that just arrived."""
    import matplotlib.pyplot as plt

    n = state.world_size
    if ax is None:
        _, ax = plt.subplots(figsize=(1.1 * n + 1.5, 0.8 * n + 1))
    share = [[len(state.holds[r][c]) / n for c in range(n)] for r in range(n)]
    ax.imshow(share, cmap="Blues", vmin=0, vmax=1.25)
    for r in range(n):
        for c in range(n):
            terms = state.holds[r][c]
            text = "SUM" if len(terms) == n else "+".join(f"x{t}" for t in terms)
            ax.text(c, r, text, ha="center", va="center", fontsize=8)
        if state.receives[r] is not None:
            ax.add_patch(plt.Rectangle((state.receives[r] - 0.5, r - 0.5), 1, 1, fill=False, lw=2))
    ax.set_xticks(range(n), [f"chunk {c}" for c in range(n)], fontsize=8)
    ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=8)
    ax.set_title(f"N={n}, step {state.step}/{state.total_steps} ({state.phase})", fontsize=9)
    return ax


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


ALGORITHMS = {"ring": ring_all_reduce, "parameter server": parameter_server_all_reduce,
              "direct (all to all)": direct_all_reduce}


# ============================================================================ measurements
def _test_tensor(rank: int, numel: int, device: torch.device) -> torch.Tensor:
    # small whole numbers in float32: every summation order gives the exact same sum
    return (torch.arange(numel, device=device) % 100 + rank).to(torch.float32)


def count_traffic(rank: int, world_size: int, device: torch.device, numel: int,
                  algorithms: dict) -> list[dict]:
    """Bytes each rank sends and receives in one all-reduce of `numel` float32, for every group
    size N = 2..world_size (ranks 0..N-1) and every algorithm. Rows for this rank only."""
    rows = []
    for n in range(2, world_size + 1):
        group = dist.new_group(list(range(n)))  # every rank calls new_group, members or not
        if rank < n:
            expected = _test_tensor(0, numel, device) * n + sum(range(n))
            for name, fn in algorithms.items():
                x = _test_tensor(rank, numel, device)
                with count_p2p() as traffic:  # also: any built-in collective would raise here
                    fn(x, group=group)
                rows.append({"algorithm": name, "world_size": n, "rank": rank,
                             "tensor_bytes": x.numel() * x.element_size(), **traffic.summary(),
                             "correct": bool(torch.equal(x, expected))})
        dist.barrier()
    return rows


def time_algorithms(rank: int, world_size: int, device: torch.device, numel: int,
                    algorithms: dict, repeats: int) -> list[dict]:
    """Median time (the slowest rank's) of one all-reduce of `numel` float32 per group size N
    and algorithm, the backend's own all_reduce included. Rows for the groups this rank is in."""
    def built_in(x, group=None):
        dist.all_reduce(x, group=group)

    rows = []
    for n in range(2, world_size + 1):
        group = dist.new_group(list(range(n)))
        for name, fn in dict(algorithms, **{"built-in all_reduce": built_in}).items():
            if rank < n:
                x = torch.zeros(numel, device=device)
                timing = measure(lambda: fn(x, group=group), warmup=1, repeats=repeats, device=device)
                rows.append({"algorithm": name, "world_size": n, "bytes": numel * 4,
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


def run(ctx: DistContext) -> dict:
    algorithms = dict(ALGORITHMS)
    implemented = ring_implemented(ctx.device)
    if not implemented:
        del algorithms["ring"]
    # 3 MiB of float32 (smoke: 48 KiB): divisible by 2, 3 and 4, so every chunk is K/N exactly
    numel = 3 * pick(2 ** 18, 2 ** 12)
    traffic = count_traffic(ctx.rank, ctx.world_size, ctx.device, numel, algorithms)
    timings = time_algorithms(ctx.rank, ctx.world_size, ctx.device, numel, algorithms,
                              repeats=pick(5, 3))
    ctx.report(traffic=traffic, timings=timings, ring_implemented=implemented)
    return {"traffic": traffic, "timings": timings, "ring_implemented": implemented}


def print_summary(ctx: DistContext, result: dict) -> None:
    """Rank 0 gathers every rank's counts and prints the two tables."""
    every = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(result["traffic"], every, dst=0)
    if ctx.rank != 0:
        return
    if not result["ring_implemented"]:
        print("ring_all_reduce is not implemented yet (the homework): no ring rows")
    traffic = [row for rows in every for row in rows]
    table(traffic_summary(traffic), title="bytes sent per rank in one all-reduce of K bytes")
    table(bandwidth_comparison(result["timings"], traffic),
          title="bandwidth three ways, from the same durations")


def main() -> None:
    with distributed() as ctx:
        print_summary(ctx, run(ctx))


if __name__ == "__main__":
    main()
