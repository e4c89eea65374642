"""Lab 11 (Ulysses): all-to-all sequence parallelism, the other way to split attention's sequence.

Run:  ./run.sh 11      (this file alone: ./run.sh labs/lab11_ulysses.py; 2-4 ranks, heads
                        divisible by the ranks)

DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling
Training of Extreme Long Sequence Transformer Models", arXiv:2309.14509): every rank holds a
shard of the sequence for all a heads, (b, a, S/N, d). One all-to-all turns that into all of the
sequence for a/N heads, (b, a/N, S, d); attention runs unchanged, head by head (any kernel,
FlashAttention included); a second all-to-all turns the output back into sequence shards. The
backward pass is the same two all-to-alls in reverse (an all-to-all is a permutation of blocks:
its adjoint is the inverse all-to-all).

Against ring attention (lab11_ring_attention.py), per rank and layer, X = b a (S/N) d elements
(a heads of d; the notebook keeps h for the model's width):
- bytes sent: Ulysses (N-1)/N of q, k, v and the output, 4 X (N-1)/N, shrinking as N grows;
  the ring N-1 blocks of K and V, 2 X (N-1), about 2 b a S d whatever N;
- the ring's messages hide behind the block computes (point-to-point, overlapped); Ulysses'
  all-to-alls sit between the projections and attention, exposed unless something else overlaps;
- Ulysses cannot use more ranks than heads (with grouped-query attention: KV heads); the ring
  has no such limit.

`measure_bytes` counts what each design sent at the process group: Ulysses' all-to-alls with
their split sizes (labs/lab11_traffic.py: the rows each call sends to the other ranks), the
ring's point-to-point messages (helpers.comm_count.count_p2p), beside `bytes_per_rank`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import labs.lab11_ring_attention as ring
from helpers import pick
from helpers.comm_count import count_p2p
from helpers.dist import DistContext, distributed
from helpers.notice import attempt
from helpers.show import table
from helpers.tensors import divide
from labs.lab11_results import Shown
from labs.lab11_traffic import record_all_to_alls


# ============================================================================ the all-to-alls
def sequence_to_heads(x: torch.Tensor, group=None) -> torch.Tensor:
    """(..., a, S/N, d) sequence shard, every head -> (..., a/N, S, d): the whole sequence of this
    rank's head group (heads r a/N ... (r+1) a/N - 1), positions in rank order."""
    n = dist.get_world_size(group)
    *lead, heads, seq_local, d = x.shape
    per_rank = divide(heads, n, "attention heads over the sequence-parallel ranks (Ulysses gives "
                                "each rank whole heads)")
    send = x.reshape(-1, n, per_rank, seq_local, d).transpose(0, 1).contiguous()  # (N, L, h/N, s, d)
    received = torch.empty_like(send)                  # received[i]: rank i's positions, our heads
    dist.all_to_all_single(received, send, group=group)
    return received.permute(1, 2, 0, 3, 4).reshape(*lead, per_rank, n * seq_local, d)


def heads_to_sequence(y: torch.Tensor, group=None) -> torch.Tensor:
    """The inverse: (..., a/N, S, d) of this rank's heads -> (..., a, S/N, d) of its positions."""
    n = dist.get_world_size(group)
    *lead, per_rank, seq, d = y.shape
    seq_local = divide(seq, n, "the sequence over the sequence-parallel ranks")
    send = y.reshape(-1, per_rank, n, seq_local, d).permute(2, 0, 1, 3, 4).contiguous()  # (N, L, h/N, s, d)
    received = torch.empty_like(send)                  # received[i]: head group i, our positions
    dist.all_to_all_single(received, send, group=group)
    return received.transpose(0, 1).reshape(*lead, n * per_rank, seq_local, d)


class SequenceToHeads(torch.autograd.Function):
    """Ulysses' first all-to-all (sequence shards -> head shards); backward: the inverse one."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_sequence(grad.contiguous(), ctx.group), None


class HeadsToSequence(torch.autograd.Function):
    """Ulysses' second all-to-all (head shards -> sequence shards); backward: the inverse one."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return heads_to_sequence(y, group)

    @staticmethod
    def backward(ctx, grad):
        return sequence_to_heads(grad.contiguous(), ctx.group), None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      group=None) -> torch.Tensor:
    """The same contract as ring_attention: q, k, v (b, a, S/N, d), this rank's contiguous shard of
    the sequence; returns its rows of SDPA over the whole sequence, differentiable. Needs a
    divisible by N (a ValueError says so otherwise). q, k and v go in one all-to-all."""
    divide(q.shape[1], dist.get_world_size(group), "attention heads over the sequence-parallel "
           "ranks (Ulysses gives each rank whole heads)")
    qkv = SequenceToHeads.apply(torch.stack([q, k, v]), group)        # (3, b, a/N, S, d)
    out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=causal)
    return HeadsToSequence.apply(out, group)                           # (b, a, S/N, d)


# ============================================================================ bytes
def bytes_per_rank(kind: str, world_size: int, batch: int, heads: int, seq: int, head_dim: int,
                   element_bytes: int, accumulate_bytes: int | None = None) -> dict:
    """Bytes one rank sends for one attention layer, forward and backward, X = b a (S/N) d elements
    (`heads` = a):
    "ulysses": forward 4 X (N-1)/N (q, k, v out, the output back), backward the same (dO out; dq,
    dk, dv back); "ring": forward N-1 K/V blocks, 2 X (N-1); backward the K/V again and the dK/dV
    accumulators, which make N hops: 2 X (N-1) + 2 X' N (X' in the accumulation dtype)."""
    n = world_size
    x = batch * heads * (seq // n) * head_dim
    acc = element_bytes if accumulate_bytes is None else accumulate_bytes
    if n == 1:
        return {"forward": 0, "backward": 0}
    if kind == "ulysses":
        one_way = 4 * x * element_bytes * (n - 1) // n
        return {"forward": one_way, "backward": one_way}
    if kind == "ring":
        return {"forward": 2 * x * element_bytes * (n - 1),
                "backward": 2 * x * element_bytes * (n - 1) + 2 * x * acc * n}
    raise ValueError(f"kind must be 'ulysses' or 'ring', got {kind!r}")


def measure_bytes(device: torch.device, sizes: dict, kind: str, group=None) -> dict:
    """One causal forward and backward of `kind` ("ulysses", or "ring": the homework's
    ring_attention) on float64 input: the bytes this rank sent, counted at the process group
    (Ulysses: each all-to-all's rows for the other ranks, from its split sizes; the ring: its
    point-to-point messages), and the formula."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    b, a, s, d = sizes["batch"], sizes["heads"], sizes["seq_local"] * n, sizes["head_dim"]
    mine = [ring.sequence_shard(t, rank, n).requires_grad_(True)
            for t in ring.sample_qkv(b, a, s, d, device=device)]
    if kind == "ulysses":
        with record_all_to_alls() as forward:
            y = ulysses_attention(*mine, causal=True, group=group)
        with record_all_to_alls() as backward:
            y.backward(torch.ones_like(y))
        counted = {"forward": sum(c.sent_bytes for c in forward), "backward": sum(c.sent_bytes for c in backward)}
    else:
        with count_p2p() as forward:
            y = ring.ring_attention(*mine, causal=True, group=group)
        with count_p2p() as backward:
            y.backward(torch.ones_like(y))
        counted = {"forward": forward.sent_bytes, "backward": backward.sent_bytes}
    return {"counted": counted, "formula": bytes_per_rank(kind, n, b, a, s, d, mine[0].element_size())}


def default_sizes() -> dict:
    return dict(batch=1, heads=4, seq_local=pick(64, 8), head_dim=pick(32, 8))


def run(ctx: DistContext, **sizes) -> dict:
    """Ulysses against SDPA (float64, causal and not) and the bytes both designs send, counted and
    by formula (the ring part needs the homework)."""
    s = {**default_sizes(), **sizes}
    n = ctx.world_size
    if s["heads"] % n:
        return {"sizes": s, "world_size": n,
                "skipped": f"{s['heads']} heads do not split over {n} ranks: Ulysses needs heads "
                           "divisible by the ranks (NPROC=2 or 4 with 4 heads)"}
    q, k, v = ring.sample_qkv(2, s["heads"], 4 * n, 4, device=ctx.device)
    checks = {("causal" if c else "full"): ring.compare_with_sdpa(
        lambda *t, c=c: ulysses_attention(*t, causal=c), q, k, v, c) for c in (False, True)}
    return {"sizes": s, "world_size": n, "ulysses_vs_sdpa": checks,
            "bytes": {"ulysses": measure_bytes(ctx.device, s, "ulysses"),
                      "ring": attempt(measure_bytes, ctx.device, s, "ring")}}


def formula_rows(world_sizes=(2, 4, 8, 16, 32, 64), batch: int = 1, heads: int = 32,
                 seq: int = 131072, head_dim: int = 128, element_bytes: int = 2) -> list[dict]:
    """Both designs' bytes per rank by formula for one layer of a long sequence (default: 128K
    tokens, 32 heads of 128, bf16), and whether Ulysses can use that many ranks."""
    rows = []
    for n in world_sizes:
        u = bytes_per_rank("ulysses", n, batch, heads, seq, head_dim, element_bytes, 4)
        r = bytes_per_rank("ring", n, batch, heads, seq, head_dim, element_bytes, 4)
        rows.append({"ranks": n, "Ulysses fwd MB": u["forward"] / 1e6, "ring fwd MB": r["forward"] / 1e6,
                     "ring / Ulysses": r["forward"] / u["forward"],
                     "Ulysses possible": heads % n == 0 and n <= heads})
    return rows


def bytes_summary(report: dict) -> Shown:
    """Rank 0's `run` report: Ulysses against SDPA, and the bytes both designs sent, counted
    against the formulas (the ring's rows are left out while the homework is a stub)."""
    if "skipped" in report:
        return Shown(report["skipped"], [], [])
    worst = max(c["worst"] for c in report["ulysses_vs_sdpa"].values())
    rows = [{"design": kind, "phase": phase, "bytes sent (counted)": m["counted"][phase], "formula": m["formula"][phase]}
            for kind, m in report["bytes"].items() if "unsolved" not in m for phase in ("forward", "backward")]
    same = all(r["bytes sent (counted)"] == r["formula"] for r in rows)
    return Shown(f"bytes rank 0 sent, one causal attention layer, {report['world_size']} ranks, {report['sizes']}",
                 rows, [f"ulysses_attention vs SDPA on one process (float64, output and gradients): largest "
                        f"difference {worst:.1e}",
                        "counted bytes " + ("equal the formulas" if same else "DIFFER from the formulas")])


@dataclass(frozen=True)
class Crossover(Shown):
    ranks: list[int]
    ring_mb: list[float]
    ulysses_mb: list[float]
    ulysses_possible: list[bool]


def crossover(rows: list[dict]) -> Crossover:
    """From `formula_rows`: from how many ranks the ring sends more than Ulysses, and Ulysses' limit."""
    cross = next((r["ranks"] for r in rows if r["ring / Ulysses"] > 1), None)
    limit = max((r["ranks"] for r in rows if r["Ulysses possible"]), default=None)
    last = rows[-1]
    return Crossover("per rank, one attention layer of 128K tokens (32 heads x 128, bf16), forward", rows,
                 [(f"the ring sends more than Ulysses from N = {cross} on" if cross else
                   "the ring never sends more than Ulysses in these rows")
                  + f" (ring / Ulysses = N/2: x{last['ring / Ulysses']:.0f} at N = {last['ranks']}); "
                  + (f"Ulysses stops at N = {limit} (the heads)" if limit else "Ulysses is impossible in every row")],
                     [r["ranks"] for r in rows], [r["ring fwd MB"] for r in rows], [r["Ulysses fwd MB"] for r in rows],
                     [r["Ulysses possible"] for r in rows])


def main() -> None:
    with distributed() as ctx:
        result = run(ctx)
        ctx.report(**result)
        if "skipped" in result:
            ctx.print0(result["skipped"])
            return
        if ctx.rank == 0:
            table([{"mask": m, **{k: f"{v:.1e}" for k, v in c.items() if k != "scale"}}
                   for m, c in result["ulysses_vs_sdpa"].items()],
                  title="ulysses_attention vs SDPA on one process (float64), rank 0")
            bytes_summary(result).show()
            crossover(formula_rows()).show()
        worst = max(c["worst"] for c in result["ulysses_vs_sdpa"].values())
        if worst > 1e-9:
            raise RuntimeError(f"rank {ctx.rank}: ulysses_attention differs from SDPA by {worst:.2e}")


if __name__ == "__main__":
    main()
