"""Lab 11 (zig-zag): causal ring attention's load imbalance and the layout that removes it.

Run:  ./run.sh 11      (this file alone: ./run.sh labs/lab11_zigzag.py; 2-4 ranks)

With the contiguous layout (rank r holds positions r S/N ... (r+1) S/N - 1) and a causal mask,
rank 0's queries see only its own block while rank N-1's see every block: rank r computes r + 1
blocks, and every step of the ring waits for the slowest rank. The zig-zag (head-tail) layout
cuts the sequence into 2N chunks and gives rank r chunks r and 2N-1-r, an early one and a late
one: every rank then computes the same number of score tiles (2N + 1 tiles of (S/2N)^2, against
4(r + 1) for the contiguous layout). Llama 3 shards its sequences so (Dubey et al. 2024, "The
Llama 3 Herd of Models", arXiv:2407.21783, sec. 3.3.2: "the i-th CP rank received both the i-th
and the (2 x CP - 1 - i)-th chunks"), and torch's context parallelism does the same by default
(`_HeadTailLoadBalancer` in torch/distributed/tensor/experimental/_context_parallel).

- `ring_schedule(N, layout)`: the ring on paper: at each step, which rank's K/V each rank holds
  and which (query chunk, key chunk) tiles it computes; the data for the notebook's explorer.
- `zigzag_ring_attention`: lab 11's ring in the zig-zag layout (forward here, built on
  lab11_ring_attention's block kernel; backward: the same second ring, in this layout), checked
  against SDPA.
- `measure_balance`: both layouts run on the same causal input; work (score entries) and compute
  seconds measured per rank. The contiguous run uses the homework `ring_attention`.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import labs.lab11_ring_attention as ring
from helpers import pick
from helpers.dist import DistContext, distributed
from helpers.notice import attempt
from helpers.show import table
from helpers.tensors import divide

SCHEDULE_CHUNK = 2  # positions per chunk on paper (1 would make every diagonal chunk "full")


# ============================================================================ the layout
def zigzag_positions(seq: int, world_size: int) -> list[list[int]]:
    """Global positions rank r holds in the zig-zag layout: chunk r, then chunk 2N-1-r, of 2N."""
    seq_local = divide(seq, world_size, "the sequence over the context-parallel ranks")
    return [[start + i for _, start, length in ring.local_chunks("zigzag", r, world_size, seq_local)
             for i in range(length)] for r in range(world_size)]


def torch_head_tail_positions(seq: int, world_size: int) -> list[list[int]] | str:
    """The same from torch's own `_HeadTailLoadBalancer` (a private API: a string saying why, if
    this torch has no such class)."""
    try:
        from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer
    except ImportError as err:
        return f"not in torch {torch.__version__}: {err}"
    order = _HeadTailLoadBalancer(seq, world_size, torch.device("cpu"))._generate_indices()[0]
    return [chunk.tolist() for chunk in order.chunk(world_size)]


# ============================================================================ on paper
def ring_schedule(world_size: int, layout: str, causal: bool = True) -> list[dict]:
    """One row per (step, rank): the K/V it holds (`holds`: the rank they came from) and the tiles
    of the score matrix it computes, in chunks of S / 2N positions: (q_chunk, q_chunks, k_chunk,
    k_chunks, kind) rectangles, kind "full" or "diagonal" (half masked; computed whole), plus the
    ones the mask skips. `work`: tiles computed (a contiguous block is 2 x 2 tiles)."""
    seq_local = 2 * SCHEDULE_CHUNK
    rows = []
    for step in range(world_size):
        for rank in range(world_size):
            source = (rank - step) % world_size
            pairs = ring.block_pairs(layout, rank, source, world_size, seq_local, causal)
            tiles = [(p.q_start // SCHEDULE_CHUNK, p.q_len // SCHEDULE_CHUNK,
                      p.k_start // SCHEDULE_CHUNK, p.k_len // SCHEDULE_CHUNK, p.kind) for p in pairs]
            computed = [t for t in tiles if t[4] != "skipped"]
            rows.append({"step": step, "rank": rank, "holds": source,
                         "computes": computed, "skips": [t for t in tiles if t[4] == "skipped"],
                         "work": sum(t[1] * t[3] for t in computed)})
    return rows


def work_per_rank(schedule: list[dict]) -> list[int]:
    """Tiles each rank computes over the whole ring."""
    ranks = 1 + max(row["rank"] for row in schedule)
    return [sum(row["work"] for row in schedule if row["rank"] == r) for r in range(ranks)]


# ============================================================================ the ring
def zigzag_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                          group=None) -> torch.Tensor:
    """Ring attention on zig-zag shards: q, k, v (b, h, seq_local, d) hold this rank's chunks r and
    2N-1-r (of 2N) one after the other; returns the same rows of SDPA's output, differentiable
    (the backward ring in this layout). Each step computes the tiles `block_pairs` leaves; the
    partial results of each query chunk are merged at the end (`combine_partials`)."""
    peers = ring.ring_peers(group)
    n, r, seq_local = peers.size, peers.rank, q.shape[-2]
    pieces = ring.local_chunks("zigzag", r, n, seq_local)
    with torch.no_grad():
        kv = torch.stack([k, v])                                       # (2, b, h, s, d)
        partial = {offset: ([], []) for offset, _, _ in pieces}        # q chunk -> outs, lses
        for step in range(n):
            source = (r - step) % n
            incoming = torch.empty_like(kv) if step < n - 1 else None
            requests = ring.post_ring_exchange(kv, incoming, peers, group) if incoming is not None else []
            for p in ring.block_pairs("zigzag", r, source, n, seq_local, causal):
                if p.kind == "skipped":
                    continue
                qs, ks = slice(p.q_offset, p.q_offset + p.q_len), slice(p.k_offset, p.k_offset + p.k_len)
                out, lse = ring.attention_block(q[..., qs, :], kv[0][..., ks, :], kv[1][..., ks, :],
                                                p.q_start, p.k_start, causal)
                partial[p.q_offset][0].append(out)
                partial[p.q_offset][1].append(lse)
            for request in requests:
                request.wait()
            if incoming is not None:
                kv = incoming
        merged = [ring.combine_partials(*partial[offset]) for offset, _, _ in pieces]
        out = torch.cat([o for o, _ in merged], dim=-2)
        lse = torch.cat([lse for _, lse in merged], dim=-1)
    return ring.with_ring_backward(q, k, v, out, lse, causal, group, layout="zigzag")


# ============================================================================ measured
def measure_balance(device: torch.device, sizes: dict, layout: str, repeats: int, group=None) -> dict:
    """One causal forward per repeat of `layout`'s ring (contiguous: the homework ring_attention)
    on the same input; per rank: score entries computed (batch and heads aside), seconds inside
    attention_block (the best repeat) and the whole call's seconds."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v = ring.sample_qkv(sizes["batch"], sizes["heads"], sizes["seq_local"] * n,
                              sizes["head_dim"], dtype=torch.float32, device=device)
    mine = [ring.sequence_shard(t, rank, n, layout) for t in (q, k, v)]
    attention = ring.ring_attention if layout == "contiguous" else zigzag_ring_attention
    compute, wall, work = [], [], 0
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        with ring.trace_ring() as trace:
            attention(*mine, causal=True, group=group)
        wall.append(time.perf_counter() - start)
        compute.append(trace.compute_seconds)
        work = trace.work
    return {"work": work, "compute_s": min(compute), "wall_s": min(wall)}


def default_sizes() -> dict:
    return dict(batch=1, heads=4, seq_local=pick(1024, 32), head_dim=pick(64, 8))


def run(ctx: DistContext, repeats: int | None = None, **sizes) -> dict:
    """The schedules on paper, the zig-zag ring against SDPA (float64) and both layouts' work and
    compute time measured per rank (every rank reports its own)."""
    s = {**default_sizes(), **sizes}
    repeats = pick(3, 1) if repeats is None else repeats
    n = ctx.world_size
    schedules = {layout: ring_schedule(n, layout) for layout in ring.LAYOUTS}
    check_sizes = dict(batch=2, heads=2, seq_local=8, head_dim=4)
    q, k, v = ring.sample_qkv(check_sizes["batch"], check_sizes["heads"], check_sizes["seq_local"] * n,
                              check_sizes["head_dim"], device=ctx.device)
    checks = {("causal" if causal else "full"): ring.compare_with_sdpa(
        lambda *t, c=causal: zigzag_ring_attention(*t, causal=c), q, k, v, causal, layout="zigzag")
        for causal in (True, False)}
    balance = {"zigzag": measure_balance(ctx.device, s, "zigzag", repeats),
               "contiguous": attempt(measure_balance, ctx.device, s, "contiguous", repeats)}
    return {"sizes": s, "world_size": n, "schedules": schedules,
            "predicted_tiles": {layout: work_per_rank(rows) for layout, rows in schedules.items()},
            "zigzag_vs_sdpa": checks, "balance": balance,
            "positions": zigzag_positions(2 * n * 2, n),
            "torch_positions": torch_head_tail_positions(2 * n * 2, n)}


def balance_rows(reports: list[dict]) -> list[dict]:
    """One row per (layout, rank) from every rank's `run` report: predicted tiles, measured work
    (in tiles of (S/2N)^2) and compute seconds against the slowest rank's."""
    rows = []
    first = reports[0]
    tile = (first["sizes"]["seq_local"] // 2) ** 2
    for layout in ring.LAYOUTS:
        measured = [rep["balance"][layout] for rep in reports]
        if any("unsolved" in m for m in measured):
            continue
        slowest = max(m["compute_s"] for m in measured)
        for rank, m in enumerate(measured):
            rows.append({"layout": layout, "rank": rank,
                         "tiles (paper)": first["predicted_tiles"][layout][rank],
                         "tiles (measured)": m["work"] / tile,
                         "compute s": m["compute_s"], "compute / slowest": m["compute_s"] / slowest,
                         "wall s": m["wall_s"]})
    return rows


def balance_summary(rows: list[dict]) -> str:
    """One sentence from `balance_rows`: the spread of compute time over ranks (slowest / fastest)
    per layout, and whether zig-zag narrowed it on this run."""
    spread = {}
    for layout in ring.LAYOUTS:
        seconds = [r["compute s"] for r in rows if r["layout"] == layout]
        if seconds and min(seconds) > 0:
            spread[layout] = max(seconds) / min(seconds)
    if len(spread) < 2:
        return "only the zig-zag layout ran (ring_attention is not written yet)"
    verdict = ("zig-zag narrowed it on this run" if spread["zigzag"] < spread["contiguous"]
               else "zig-zag did not narrow it on this run (timings on a busy machine vary)")
    return (f"slowest / fastest rank's compute time: contiguous {spread['contiguous']:.2f}, "
            f"zig-zag {spread['zigzag']:.2f}; {verdict}")


def main() -> None:
    with distributed() as ctx:
        result = run(ctx)
        ctx.report(**result)
        reports = [None] * ctx.world_size
        dist.all_gather_object(reports, result)
        if ctx.rank == 0:
            table([{"rank": r, "mask": m, **{k: f"{v:.1e}" for k, v in rep["zigzag_vs_sdpa"][m].items()}}
                   for r, rep in enumerate(reports) for m in ("full", "causal")],
                  title="zigzag_ring_attention vs SDPA on one process (float64)")
            rows = balance_rows(reports)
            table(rows, title=f"causal ring attention, {ctx.world_size} ranks, "
                  f"{result['sizes']}: work and compute time per rank")
            print(balance_summary(rows), flush=True)
        worst = max(c["worst"] for c in result["zigzag_vs_sdpa"].values())
        if worst > 1e-9:
            raise RuntimeError(f"rank {ctx.rank}: zigzag_ring_attention differs from SDPA by {worst:.2e}")


if __name__ == "__main__":
    main()
