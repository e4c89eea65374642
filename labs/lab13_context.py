"""Lab 13 (context parallelism inside the model; a library of lab 13): the course's ring attention as the model's
attention on the cp dimension, for grouped-query attention, at global positions; Ulysses as the
alternative where the key/value heads split over the cp ranks.

Run:  imported by labs/lab13_parallelize.py and labs/lab13_train.py (no run of its own).

- Which positions a cp rank holds: `cp_positions(seq, cp, rank)`, notebook 11's zig-zag layout
  (labs/lab11_zigzag.py: chunks r and 2 cp - 1 - r of 2 cp, Llama 3's and torch's load balance).
  The training loop cuts every sequence so (`shard_sequence`), and an attention layer must be told
  the same positions: its rotary angles and its causal mask are about the place of a row in the
  whole sequence.
- `ContextParallel(group, positions)`: the callable an `Attention` (labs/lab13_model.py) calls as
  its `context`. It learns every cp rank's positions once (an all-gather of a few integers), and
  runs `gqa_ring_attention`: notebook 11's ring (labs/lab11_ring_attention.py's block kernel
  `attention_block`, its backward `attention_block_backward` and `post_ring_exchange`), with the
  key/value blocks of the kv heads only (a query head of group g reads kv head g, by broadcasting:
  no copy of K and V per query head), and with causal masks from global positions: every run of
  consecutive positions a rank holds is a piece, as lab 11's `block_pairs` makes them for the
  zig-zag layout, and a pair of pieces whose keys all lie after its queries is skipped. Its
  backward is the second ring (K/V again, with their gradient accumulators), the kv heads'
  gradients summed over their query heads.
- `design="ulysses"`: DeepSpeed-Ulysses (labs/lab11_ulysses.py's all-to-alls) for q and for K/V
  separately; it needs the kv heads (on a tp rank) divisible by cp.
- `cp_bytes`: the bytes either design sends per layer, from lab 11's planner formula with the kv
  heads: the ring's scale with the kv heads, Ulysses' with the query heads plus the kv heads.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import labs.lab11_ring_attention as ring
from helpers.tensors import divide

DESIGNS = ("ring", "ulysses")


# ============================================================================ the layout
def cp_positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions rank `rank` of `cp` holds: the zig-zag layout (chunks rank and
    2 cp - 1 - rank of 2 cp chunks); all of them when cp == 1."""
    from labs.lab11_zigzag import zigzag_positions

    if cp == 1:
        return torch.arange(seq)
    divide(seq, 2 * cp, "the sequence over twice the context-parallel ranks (zig-zag chunks)")
    return torch.tensor(zigzag_positions(seq, cp)[rank])


def shard_sequence(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The columns (dim 1: the sequence) of a batch (b, seq, ...) at `positions`."""
    return t[:, positions.to(t.device)]


def runs(positions: list[int]) -> list[tuple[int, int, int]]:
    """(offset, first position, length) of each run of consecutive positions, in order."""
    out: list[list[int]] = []
    for offset, p in enumerate(positions):
        if out and p == out[-1][1] + out[-1][2]:
            out[-1][2] += 1
        else:
            out.append([offset, p, 1])
    return [tuple(r) for r in out]


def piece_pairs(q_runs, k_runs) -> list[tuple[tuple, tuple, bool]]:
    """The (query run, key run) pairs a causal mask leaves something of, and whether the mask
    cuts into the pair (diagonal) or leaves it whole."""
    pairs = []
    for q in q_runs:
        for k in k_runs:
            if k[1] > q[1] + q[2] - 1:             # every key after every query: nothing
                continue
            pairs.append((q, k, k[1] + k[2] - 1 > q[1]))
    return pairs


# ============================================================================ the ring
def gqa_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, all_runs: list, group) -> torch.Tensor:
    """Causal attention of this rank's rows over the whole sequence held by the ranks of `group`.
    q (b, h, s, d), k and v (b, kv_heads, s, d); all_runs[i]: the runs of group rank i's positions
    (`runs`). Returns (b, h, s, d), differentiable (the backward ring)."""
    peers = ring.ring_peers(group)
    n, r = peers.size, peers.rank
    b, h, s, d = q.shape
    kv_heads = k.shape[1]
    q5 = q.reshape(b, kv_heads, h // kv_heads, s, d)          # query heads grouped by their kv head
    k5, v5 = k.unsqueeze(2), v.unsqueeze(2)                    # (b, kv_heads, 1, s, d): broadcast
    with torch.no_grad():
        kv = torch.stack([k5, v5])
        partial = {qr: ([], []) for qr in all_runs[r]}
        for step in range(n):
            source = (r - step) % n
            incoming = torch.empty_like(kv) if step < n - 1 else None
            requests = ring.post_ring_exchange(kv, incoming, peers, group) if incoming is not None else []
            for qr, kr, _ in piece_pairs(all_runs[r], all_runs[source]):
                out, lse = ring.attention_block(q5[..., qr[0]:qr[0] + qr[2], :], kv[0][..., kr[0]:kr[0] + kr[2], :],
                                                kv[1][..., kr[0]:kr[0] + kr[2], :], qr[1], kr[1], True)
                partial[qr][0].append(out)
                partial[qr][1].append(lse)
            for request in requests:
                request.wait()
            if incoming is not None:
                kv = incoming
        merged = [ring.combine_partials(*partial[qr]) for qr in all_runs[r]]
        out = torch.cat([o for o, _ in merged], dim=-2)
        lse = torch.cat([x for _, x in merged], dim=-1)
    return _RingGrad.apply(q5, k5, v5, out, lse, all_runs, group).reshape(b, h, s, d)


class _RingGrad(torch.autograd.Function):
    """The forward's output with the second ring as its backward (labs/lab11_ring_attention.py's
    `ring_attention_backward`, in pieces of runs, with the kv heads' gradients summed over the
    query heads that read them)."""

    @staticmethod
    def forward(ctx, q5, k5, v5, out, lse, all_runs, group):
        result = out.detach().clone()
        ctx.save_for_backward(q5, k5, v5, result, lse)
        ctx.all_runs, ctx.group = all_runs, group
        return result

    @staticmethod
    def backward(ctx, dout):
        q5, k5, v5, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q5, k5, v5, out, lse, dout.contiguous(), ctx.all_runs, ctx.group)
        return dq, dk, dv, None, None, None, None


def _ring_backward(q, k, v, out, lse, dout, all_runs, group):
    peers = ring.ring_peers(group)
    n, r = peers.size, peers.rank
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    delta = (dout.to(acc_dtype) * out.to(acc_dtype)).sum(-1)
    q_, dout_, lse_ = q.to(acc_dtype), dout.to(acc_dtype), lse.to(acc_dtype)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    kv = torch.stack([k, v])                                    # (2, b, kv_heads, 1, s, d)
    acc_incoming, acc_requests, acc = None, [], None
    for step in range(n):
        source = (r - step) % n
        kv_next = torch.empty_like(kv) if step < n - 1 else None
        kv_requests = ring.post_ring_exchange(kv, kv_next, peers, group) if kv_next is not None else []
        share = torch.zeros(kv.shape, dtype=acc_dtype, device=q.device)
        for qr, kr, _ in piece_pairs(all_runs[r], all_runs[source]):
            qs, ks = slice(qr[0], qr[0] + qr[2]), slice(kr[0], kr[0] + kr[2])
            dq_, dk_, dv_ = ring.attention_block_backward(
                q_[..., qs, :], kv[0][..., ks, :].to(acc_dtype), kv[1][..., ks, :].to(acc_dtype),
                dout_[..., qs, :], lse_[..., qs], delta[..., qs], qr[1], kr[1], True)
            dq[..., qs, :] += dq_
            share[0][..., ks, :] += dk_.sum(2, keepdim=True)    # summed over the group's query heads
            share[1][..., ks, :] += dv_.sum(2, keepdim=True)
        for request in acc_requests:
            request.wait()
        acc = share if acc_incoming is None else acc_incoming + share
        if n > 1:
            acc_incoming = torch.empty_like(acc)
            acc_requests = ring.post_ring_exchange(acc, acc_incoming, peers, group, ring.GRAD_TAG)
        for request in kv_requests:
            request.wait()
        if kv_next is not None:
            kv = kv_next
    for request in acc_requests:
        request.wait()
    mine = acc if n == 1 else acc_incoming
    return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype)


# ============================================================================ Ulysses
def ulysses_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          group) -> torch.Tensor:
    """DeepSpeed-Ulysses for grouped-query attention: q to head shards (all of the sequence, h/cp
    heads), K and V likewise (kv_heads/cp heads: a query head and its kv head land on the same
    rank), causal attention by global position, then back to sequence shards. `positions`: every
    rank's positions, in rank order (S,)."""
    from labs.lab11_ulysses import HeadsToSequence, SequenceToHeads

    n = dist.get_world_size(group)
    divide(k.shape[1], n, "key/value heads over the context-parallel ranks (Ulysses gives each "
                          "rank whole kv heads)")
    qh = SequenceToHeads.apply(q, group)                               # (b, h/cp, S, d)
    kvh = SequenceToHeads.apply(torch.stack([k, v]), group)            # (2, b, kv/cp, S, d)
    seen = positions[None, :] <= positions[:, None]                    # (S, S): key before query
    out = F.scaled_dot_product_attention(qh, kvh[0], kvh[1], attn_mask=seen.to(q.device), enable_gqa=True)
    return HeadsToSequence.apply(out, group)


# ============================================================================ the callable
class ContextParallel:
    """An attention's `context` on a cp group: this rank holds rows at `positions` (global, in
    the order of its rows); every rank's positions are gathered once, here (every rank of the
    group makes its ContextParallel at the same time)."""

    def __init__(self, group, positions: torch.Tensor, design: str = "ring"):
        if design not in DESIGNS:
            raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
        self.group, self.design = group, design
        self.positions = positions.to(torch.int64).cpu()
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, self.positions.tolist(), group=group)
        self.all_positions = [torch.tensor(p) for p in gathered]
        self.all_runs = [runs(p) for p in gathered]
        self.ranks = dist.get_process_group_ranks(group)

    def __call__(self, q, k, v):
        if self.design == "ring":
            return gqa_ring_attention(q, k, v, self.all_runs, self.group)
        return ulysses_gqa_attention(q, k, v, torch.cat(self.all_positions), self.group)


def context_parallel(attention, cp_mesh, positions: torch.Tensor, design: str = "ring"):
    """Make `attention` (labs/lab13_model.py's) attend over the sequence held by the ranks of
    `cp_mesh` (1-D), this rank's rows being at global `positions`. In place; returns it."""
    attention.positions = positions
    if cp_mesh.size() > 1:
        attention.context = ContextParallel(cp_mesh.get_group(), positions, design)
    return attention


# ============================================================================ bytes
def cp_bytes(design: str, cp: int, batch: int, heads: int, kv_heads: int, seq: int, head_dim: int,
             element_bytes: int = 4) -> dict:
    """Bytes one rank sends for one attention layer, {"forward", "backward"}: lab 11's planner
    formula (`cp_bytes_per_layer`) with the kv heads; the ring's gradient accumulators travel in
    float32 (element_bytes of fp32 here)."""
    from labs.lab09_planner import ModelSpec
    from labs.lab11_planner import cp_bytes_per_layer

    model = ModelSpec("one layer", layers=1, hidden=heads * head_dim, heads=heads, seq=seq, vocab=0,
                      global_batch=batch)
    return cp_bytes_per_layer(model, batch, cp, "ring" if design == "ring" else "ulysses",
                              element_bytes=element_bytes, accumulate_bytes=4, kv_heads=kv_heads)
