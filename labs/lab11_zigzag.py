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

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import labs.lab11_ring_attention as ring
from helpers import pick
from helpers.dist import DistContext, distributed
from helpers.notice import attempt
from helpers.tensors import divide
from labs.lab11_results import Shown, median_and_noise
from labs.lab11_ring_trace import trace_ring

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
    """Ring attention on zig-zag shards: q, k, v (b, a, seq_local, d) hold this rank's chunks r and
    2N-1-r (of 2N) one after the other; returns the same rows of SDPA's output, differentiable
    (the backward ring in this layout). Each step computes the tiles `block_pairs` leaves; the
    partial results of each query chunk are merged at the end (`combine_partials`)."""
    peers = ring.ring_peers(group)
    n, r, seq_local = peers.size, peers.rank, q.shape[-2]
    pieces = ring.local_chunks("zigzag", r, n, seq_local)
    with torch.no_grad():
        kv = torch.stack([k, v])                                       # (2, b, a, s, d)
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
    on the same input; per rank: score entries computed (batch and heads aside), and per repeat
    the seconds inside attention_block and the whole call's seconds."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v = ring.sample_qkv(sizes["batch"], sizes["heads"], sizes["seq_local"] * n,
                              sizes["head_dim"], dtype=torch.float32, device=device)
    mine = [ring.sequence_shard(t, rank, n, layout) for t in (q, k, v)]
    attention = ring.ring_attention if layout == "contiguous" else zigzag_ring_attention
    compute, wall, work = [], [], 0
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        with trace_ring() as trace:
            attention(*mine, causal=True, group=group)
        wall.append(time.perf_counter() - start)
        compute.append(trace.compute_seconds)
        work = trace.work
    return {"work": work, "compute_s": compute, "wall_s": wall}


def default_sizes() -> dict:
    return dict(batch=1, heads=4, seq_local=pick(1024, 32), head_dim=pick(64, 8))


def run(ctx: DistContext, repeats: int | None = None, **sizes) -> dict:
    """The schedules on paper, the zig-zag ring against SDPA (float64) and both layouts' work and
    compute time measured per rank (every rank reports its own)."""
    s = {**default_sizes(), **sizes}
    repeats = pick(5, 3) if repeats is None else repeats
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


# ============================================================================ what the notebook shows
def spread_per_repeat(per_rank_seconds: list[list[float]]) -> list[float]:
    """Slowest / fastest rank's seconds in each repeat."""
    return [max(times) / min(times) for times in zip(*per_rank_seconds) if min(times) > 0]


def narrowed_verdict(contiguous: list[float], zigzag: list[float]) -> str:
    """From each layout's slowest/fastest ratio per repeat: did zig-zag narrow the spread by more
    than the repeats' noise?"""
    (c, c_noise), (z, z_noise) = median_and_noise(contiguous), median_and_noise(zigzag)
    noise = max(c_noise, z_noise)
    if c - z > 2 * noise:
        return f"zig-zag narrowed it ({c:.2f} to {z:.2f}, noise {noise:.2f})"
    if z - c > 2 * noise:
        return f"zig-zag widened it on this run ({c:.2f} to {z:.2f}, noise {noise:.2f})"
    return f"the difference ({c:.2f} against {z:.2f}) is within the run's noise ({noise:.2f}): noise"


@dataclass(frozen=True)
class BalanceResult(Shown):
    compute_ms: dict[str, list[float]]       # layout -> per rank, median ms inside attention_block


def balance_summary(reports: list[dict]) -> BalanceResult:
    """Every rank's `run` report: the zig-zag ring against SDPA, torch's layout, and per (layout,
    rank) the tiles (on paper and traced) and the compute time, with the verdicts."""
    first, n = reports[0], len(reports)
    worst = max(c["worst"] for rep in reports for c in rep["zigzag_vs_sdpa"].values())
    tile = (first["sizes"]["seq_local"] // 2) ** 2
    lines = [f"zigzag_ring_attention vs SDPA (float64, output and gradients, every rank): largest difference "
             f"{worst:.1e} ({'rounding' if worst < 1e-9 else 'MORE than rounding'})",
             f"rank positions for s = {4 * n}: ours {first['positions']}; torch's _HeadTailLoadBalancer "
             f"{first['torch_positions']}" + (": the same" if first["positions"] == first["torch_positions"]
                                              else ": DIFFERENT")]
    rows, compute_ms, spreads = [], {}, {}
    for layout in ring.LAYOUTS:
        measured = [rep["balance"][layout] for rep in reports]
        if any("unsolved" in m for m in measured):
            continue
        medians = [median_and_noise(m["compute_s"])[0] for m in measured]
        compute_ms[layout] = [1e3 * t for t in medians]
        spreads[layout] = spread_per_repeat([m["compute_s"] for m in measured])
        for rank, m in enumerate(measured):
            rows.append({"layout": layout, "rank": rank, "tiles (paper)": first["predicted_tiles"][layout][rank],
                         "tiles (traced)": m["work"] / tile, "compute ms": compute_ms[layout][rank],
                         "compute / slowest": medians[rank] / max(medians),
                         "call ms": 1e3 * median_and_noise(m["wall_s"])[0]})
    agree = all(math.isclose(r["tiles (paper)"], r["tiles (traced)"]) for r in rows)
    lines.append("tiles traced " + ("equal the schedule on paper in every row" if agree else "DIFFER from the schedule"))
    if len(spreads) < 2:
        lines.append("only the zig-zag layout ran (ring_attention is not written yet)")
    else:
        lines.append("slowest / fastest rank's compute time: " + narrowed_verdict(spreads["contiguous"], spreads["zigzag"]))
        paper = {layout: max(first["predicted_tiles"][layout]) for layout in ring.LAYOUTS}
        calls = {layout: max(r["call ms"] for r in rows if r["layout"] == layout) for layout in ring.LAYOUTS}
        lines.append(f"the slowest rank's call: contiguous {calls['contiguous']:.1f} ms, zig-zag {calls['zigzag']:.1f} ms "
                     f"(x{calls['contiguous'] / calls['zigzag']:.2f}; the busiest ranks' tiles on paper: "
                     f"{paper['contiguous']} against {paper['zigzag']}, x{paper['contiguous'] / paper['zigzag']:.2f})")
    return BalanceResult(f"causal ring attention, {n} ranks, {first['sizes']}: work and compute time per rank",
                         rows, lines, compute_ms)


def draw_schedule(n: int, layout: str, causal: bool):
    """The explorer's picture: which rank computes each tile at which step (left), and the tiles per
    rank stacked by step (right). Returns (figure, text)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Polygon, Rectangle

    rows = ring_schedule(n, layout, causal)
    work = work_per_rank(rows)
    fig, (grid, bars) = plt.subplots(1, 2, figsize=(9.2, 3.9), gridspec_kw={"width_ratios": [1, 1.15]})
    if causal:
        grid.add_patch(Polygon([(0, 0), (2 * n, 0), (2 * n, 2 * n)], closed=True, facecolor="none",
                               edgecolor="lightgray", hatch="//", linewidth=0))
    for row in rows:
        for q0, ql, k0, kl, _ in row["computes"]:
            grid.add_patch(Rectangle((k0, q0), kl, ql, facecolor=plt.get_cmap("tab10")(row["rank"] % 10), alpha=0.55,
                                     edgecolor="black"))
            grid.text(k0 + kl / 2, q0 + ql / 2, f"r{row['rank']}\ns{row['step']}" if n <= 4 else str(row["step"]),
                      ha="center", va="center", fontsize=8 if n <= 4 else 6)
    grid.set(xlim=(0, 2 * n), ylim=(2 * n, 0), xticks=range(2 * n + 1), yticks=range(2 * n + 1), aspect="equal",
             xlabel="key chunk (s/2N positions)", ylabel="query chunk", title=f"{layout}: tile's rank (r) and step (s)")
    bottom = [0] * n
    for step in range(n):
        heights = [next(r["work"] for r in rows if r["rank"] == rank and r["step"] == step) for rank in range(n)]
        bars.bar(range(n), heights, bottom=bottom, color=plt.get_cmap("viridis")(step / max(n - 1, 1)),
                 edgecolor="white", label=f"step {step}")
        bottom = [x + y for x, y in zip(bottom, heights)]
    mean = sum(work) / n
    bars.axhline(mean, color="gray", linestyle="--", linewidth=1)
    bars.set(xlabel="rank", ylabel="tiles computed", xticks=range(n), ylim=(0, 1.35 * max(work)),
             title="work per rank, by step (dashed: mean)")
    bars.legend(fontsize=7, ncol=4, loc="upper left")
    fig.tight_layout()
    other = work_per_rank(ring_schedule(n, next(x for x in ring.LAYOUTS if x != layout), causal))
    return fig, (f"tiles per rank: {work}; the busiest rank computes {max(work)}, the average is {mean:.1f}: the "
                 f"ring, which finishes with its busiest rank, takes {max(work) / mean:.2f}x the time of a perfectly "
                 f"balanced split; the other layout's busiest rank computes {max(other)} tiles")


def main() -> None:
    with distributed() as ctx:
        result = run(ctx)
        ctx.report(**result)
        reports = [None] * ctx.world_size
        dist.all_gather_object(reports, result)
        if ctx.rank == 0:
            balance_summary(reports).show()
        worst = max(c["worst"] for c in result["zigzag_vs_sdpa"].values())
        if worst > 1e-9:
            raise RuntimeError(f"rank {ctx.rank}: zigzag_ring_attention differs from SDPA by {worst:.2e}")


if __name__ == "__main__":
    main()
