"""Lab 11 (ring attention): attention over a sequence split across ranks. Each rank keeps its own
queries; the keys and values travel around a ring of point-to-point messages, one block per step,
and the partial results merge with the online softmax.

A library of lab 11 (no main): ./run.sh 11 runs the labs that use it, and
./run.sh labs/lab11_ring_check.py checks the ring against one process's SDPA.

- Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
  Context", arXiv:2310.01889: blockwise attention with the K/V blocks passed around a ring of
  devices while each block is computed, so the transfer can hide behind the compute.
- Milakov and Gimelshein 2018, "Online normalizer calculation for softmax", arXiv:1805.02867, and
  FlashAttention (Dao et al. 2022, arXiv:2205.14135): a softmax over blocks merged exactly from
  each block's output and log-sum-exp.

Building blocks (given): `attention_block` (one block of queries against one block of keys, at
global positions; returns the block's output and log-sum-exp, in float32 at least: bf16/fp16
inputs are multiplied, exponentiated and summed in float32, as FlashAttention's kernels and
torch's ring keep their log-sum-exp and accumulators), `combine_partials` (merge such partial
results), `ring_peers` / `post_ring_exchange` (the ring's neighbours; isend + irecv posted
together), and the backward pass: `with_ring_backward` (casts the merged output back to the
input's dtype; an autograd function whose backward is a second ring: the K/V blocks travel
again, now with their gradient accumulators dK/dV, while dQ stays home; the references are
torch's `_templated_ring_attention_backward` and picotron's context-parallel code).
`block_pairs` says which (query piece, key piece) pairs a rank computes when it holds another
rank's K/V, for the contiguous layout and for lab11_zigzag.py's balanced one. `sample_qkv`,
`sequence_shard` and `compare_with_sdpa` are the checks' inputs and reference. What a run did
(blocks, messages, bytes alive) is recorded by labs/lab11_ring_trace.py.

Homework: `ring_attention` below (the forward pass). Check it with `./run.sh check 11`
(the public tests: tests/public/test_lab11_ring_attention.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers.tensors import divide

LAYOUTS = ("contiguous", "zigzag")


# ============================================================================ one block
def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int,
                    causal: bool, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q (b, a, sq, d) at global positions q_start ... q_start + sq - 1 over
    keys and values k, v (b, a, sk, d) at positions k_start ... k_start + sk - 1, this block only.

    Returns (out, lse): out (b, a, sq, d) = softmax(q k^T * scale) v normalised over this block's
    keys, and lse (b, a, sq) = log sum_j exp(score_ij) over the same keys (scale = 1/sqrt(d) by
    default, as F.scaled_dot_product_attention). `causal`: the query at position i sees the key
    at position j only if j <= i; a query that sees no key of the block gets out = 0, lse = -inf.
    Computed in `accumulation_dtype(q.dtype)`: float64 stays float64 (exact to rounding), bf16 and
    fp16 are computed in float32 and out, lse come back in float32, for the merge to stay there."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    acc = accumulation_dtype(q.dtype)                                      # no-op for fp32/fp64
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)              # (b, a, sq, sk)
    if causal:
        scores.masked_fill_(_future(q_start, q.shape[-2], k_start, k.shape[-2], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                  # (b, a, sq)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)    # rows that see no key
    if torch.is_grad_enabled():                                            # autograd keeps scores
        weights = torch.exp(scores - finite.unsqueeze(-1))
    else:                                                                  # one s x s buffer only
        weights = scores.sub_(finite.unsqueeze(-1)).exp_()                # masked: exp(-inf) = 0
    return torch.matmul(weights, v), lse


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores, log-sum-exps and running outputs are kept in: float32 at least. bf16 keeps
    8 bits of mantissa: a softmax summed over thousands of keys, or N partial outputs rescaled and
    added, in bf16 loses the small terms (FlashAttention accumulates in float32 and returns its
    log-sum-exp in float32; torch's ring merges in float32, `_cp_options.convert_to_f32`)."""
    return torch.promote_types(dtype, torch.float32)


def _future(q_start: int, sq: int, k_start: int, sk: int, device) -> torch.Tensor:
    """(sq, sk) mask, True where the key's global position is after the query's."""
    q_pos = torch.arange(q_start, q_start + sq, device=device)
    k_pos = torch.arange(k_start, k_start + sk, device=device)
    return k_pos.unsqueeze(0) > q_pos.unsqueeze(1)


def attention_block_backward(q, k, v, dout, lse, delta, q_start: int, k_start: int, causal: bool,
                             scale: float | None = None) -> tuple[torch.Tensor, ...]:
    """This block's share of (dq, dk, dv), given the whole row's lse (b, a, sq) and
    delta = rowsum(dout * out) (b, a, sq) of the merged output: P = exp(scores - lse) is then the
    block's slice of the whole softmax, and dS = P (dP - delta) (FlashAttention-2's backward,
    Dao 2023, arXiv:2307.08691, algorithm 2)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    acc = accumulation_dtype(q.dtype)
    q, k, v, dout, lse, delta = (t.to(acc) for t in (q, k, v, dout, lse, delta))
    with torch.no_grad():                                  # in place: two s x s buffers at most
        p = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
        if causal:
            p.masked_fill_(_future(q_start, q.shape[-2], k_start, k.shape[-2], q.device), float("-inf"))
        p.sub_(lse.unsqueeze(-1)).exp_()                   # (b, a, sq, sk): the block's softmax
        dv = torch.matmul(p.transpose(-1, -2), dout)
        ds = torch.matmul(dout, v.transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(p)   # dS
        return torch.matmul(ds, k).mul_(scale), torch.matmul(ds.transpose(-1, -2), q).mul_(scale), dv


def combine_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial results of the same queries over disjoint sets of keys, all at once:
    lse = log sum_i exp(lse_i), out = sum_i exp(lse_i - lse) out_i (each weighted by its share of
    the whole softmax's denominator; stable, since every exponent is <= 0). In the partials' dtype:
    attention_block's are float32 at least."""
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = sum(torch.exp(part_lse - finite).unsqueeze(-1) * part for part, part_lse in zip(outs, lses))
    return out, lse


# ============================================================================ layouts
def local_chunks(layout: str, rank: int, world_size: int, seq_local: int) -> list[tuple[int, int, int]]:
    """(offset in the rank's shard, global start, length) of each contiguous piece of the
    sequence rank `rank` holds. "contiguous": one piece, positions r*seq_local ...;
    "zigzag": chunks r and 2N-1-r of 2N equal chunks (lab11_zigzag.py)."""
    if layout == "contiguous":
        return [(0, rank * seq_local, seq_local)]
    if layout == "zigzag":
        c = divide(seq_local, 2, "a zig-zag shard into its two chunks")
        return [(0, rank * c, c), (c, (2 * world_size - 1 - rank) * c, c)]
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


@dataclass(frozen=True)
class BlockPair:
    """One (query piece, key piece) pair: offsets into the local shards, global starts, lengths,
    and what causal masking leaves of it: "full", "diagonal" (partly masked) or "skipped"."""
    q_offset: int
    q_start: int
    q_len: int
    k_offset: int
    k_start: int
    k_len: int
    kind: str


def block_pairs(layout: str, rank: int, source: int, world_size: int, seq_local: int,
                causal: bool) -> list[BlockPair]:
    """Every (query piece of `rank`, key piece of `source`) pair, with what the mask leaves of it."""
    pairs = []
    for q_offset, q_start, q_len in local_chunks(layout, rank, world_size, seq_local):
        for k_offset, k_start, k_len in local_chunks(layout, source, world_size, seq_local):
            if not causal or k_start + k_len - 1 <= q_start:
                kind = "full"          # every key at or before every query
            elif k_start > q_start + q_len - 1:
                kind = "skipped"       # every key after every query: nothing to compute
            else:
                kind = "diagonal"
            pairs.append(BlockPair(q_offset, q_start, q_len, k_offset, k_start, k_len, kind))
    return pairs


# ============================================================================ the ring
@dataclass(frozen=True)
class RingPeers:
    rank: int          # this process's rank in the group
    size: int          # the group's size N
    next: int          # global rank of group rank (rank + 1) % N: we only send to it
    prev: int          # global rank of group rank (rank - 1) % N: we only receive from it


def ring_peers(group=None) -> RingPeers:
    """This rank's place in the ring of `group` (default: all ranks); isend/irecv take global ranks."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    members = dist.group.WORLD if group is None else group
    return RingPeers(rank, size, dist.get_global_rank(members, (rank + 1) % size),
                     dist.get_global_rank(members, (rank - 1) % size))


def post_ring_exchange(outgoing: torch.Tensor, incoming: torch.Tensor, peers: RingPeers,
                       group=None, tag: int = 0) -> list:
    """Post `outgoing` to the next rank and a receive into `incoming` from the previous one, both
    at once (no rank blocks in a send nobody receives); returns the requests to wait on."""
    return dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, outgoing.contiguous(), peers.next, group, tag),
         dist.P2POp(dist.irecv, incoming, peers.prev, group, tag)])


GRAD_TAG = 1  # the backward's accumulators travel beside the K/V blocks: their own tag


def ring_attention_backward(q, k, v, out, lse, dout, causal: bool, group=None,
                            layout: str = "contiguous") -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of this rank's shard. The ring again: at step i this rank holds the K/V block
    of rank r - i and adds its share of that block's gradient to the block's accumulator (dK, dV
    summed over the ranks the block has visited), which then travels on; dQ stays home. K/V make
    N - 1 hops, the accumulators N: after the last one each is back with the rank that owns the
    block. Both transfers overlap a block's compute: the next K/V block is posted before it, the
    accumulator of this step's block is waited for only once this rank's share is computed."""
    peers = ring_peers(group)
    n, r, seq_local = peers.size, peers.rank, q.shape[-2]
    acc_dtype = accumulation_dtype(q.dtype)                  # sums of N terms: at least fp32
    delta = (dout.to(acc_dtype) * out.to(acc_dtype)).sum(-1)   # (b, a, sq)
    q_, dout_, lse_ = q.to(acc_dtype), dout.to(acc_dtype), lse.to(acc_dtype)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    kv = torch.stack([k, v])                                  # (2, b, a, s, d): one message
    acc = None                                                # the accumulator in our hands
    acc_incoming, acc_requests = None, []
    for step in range(n):
        source = (r - step) % n
        kv_next = torch.empty_like(kv) if step < n - 1 else None
        kv_requests = post_ring_exchange(kv, kv_next, peers, group) if kv_next is not None else []
        share = torch.zeros(kv.shape, dtype=acc_dtype, device=q.device)   # our part of dK, dV
        for pair in block_pairs(layout, r, source, n, seq_local, causal):
            if pair.kind == "skipped":
                continue
            qs = slice(pair.q_offset, pair.q_offset + pair.q_len)
            ks = slice(pair.k_offset, pair.k_offset + pair.k_len)
            dq_, dk_, dv_ = attention_block_backward(
                q_[..., qs, :], kv[0][..., ks, :].to(acc_dtype), kv[1][..., ks, :].to(acc_dtype),
                dout_[..., qs, :], lse_[..., qs], delta[..., qs], pair.q_start, pair.k_start, causal)
            dq[..., qs, :] += dq_
            share[0][..., ks, :] += dk_
            share[1][..., ks, :] += dv_
        for request in acc_requests:                         # block `source`'s accumulator so far
            request.wait()
        acc = share if acc_incoming is None else acc_incoming + share
        if n > 1:                                            # on to the next rank
            acc_incoming = torch.empty_like(acc)
            acc_requests = post_ring_exchange(acc, acc_incoming, peers, group, GRAD_TAG)
        for request in kv_requests:
            request.wait()
        if kv_next is not None:
            kv = kv_next
    for request in acc_requests:                             # our own block's, home again
        request.wait()
    mine = acc if n == 1 else acc_incoming
    return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype)


class RingAttentionGrad(torch.autograd.Function):
    """Ring attention's backward pass (Liu et al. 2023) attached to an output computed elsewhere:
    forward returns `out` cast to q's dtype (the merge ran in float32 at least) and keeps q, k, v,
    that output and the log-sum-exp in float32 at least (all linear in the sequence: no score
    matrix; FlashAttention keeps the same); backward runs `ring_attention_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, out, lse, causal, group, layout):
        result = out.detach().to(q.dtype, copy=True)
        ctx.save_for_backward(q, k, v, result, lse.detach().to(accumulation_dtype(q.dtype)))
        ctx.causal, ctx.group, ctx.layout = causal, group, layout
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(q, k, v, out, lse, dout.contiguous(), ctx.causal,
                                             ctx.group, ctx.layout)
        return dq, dk, dv, None, None, None, None, None


def with_ring_backward(q, k, v, out, lse, causal: bool = False, group=None,
                       layout: str = "contiguous") -> torch.Tensor:
    """`out` (b, a, seq_local, d) in q's dtype, differentiable in q, k, v through the ring's
    backward. lse (b, a, seq_local): each query's log-sum-exp of its scaled scores over the whole
    sequence. Hand it the merged out and lse as the merge left them (float32 for bf16 inputs):
    the cast to q's dtype happens here, once, at the end."""
    return RingAttentionGrad.apply(q, k, v, out, lse, causal, group, layout)


# ============================================================================ the homework
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                   group=None) -> torch.Tensor:
    """This rank's rows of softmax(Q K^T / sqrt(d)) V over the whole sequence, K and V passed around a ring.

    Exercise. q, k, v: (batch, heads, seq_local, head_dim), this rank's contiguous shard of the
    sequence: rank r of `group` (default: all ranks; N ranks) holds the global positions
    r * seq_local ... (r + 1) * seq_local - 1, every rank the same seq_local. They may be views
    that are not contiguous (e.g. after a transpose(1, 2)). Returns a (batch, heads, seq_local,
    head_dim) tensor: the rows of F.scaled_dot_product_attention(Q, K, V, is_causal=causal) on the
    whole sequence that belong to this rank's queries. With causal=True the query at global
    position i sees the keys at global positions j <= i.

    The contract, which the tests check (float64 to rounding, and bfloat16 within torch's own
    context-parallel tolerances; world sizes 1 to 4, sub-groups):
    - Point-to-point only, around the ring: each rank sends only to the next rank of the group,
      (r + 1) % N, and receives only from the previous one; each rank sends N - 1 blocks of K and
      V (its own, then the ones it received), k.nbytes + v.nbytes each. No collective; K and V
      are never gathered: while a block is computed, at most two received K/V blocks are alive
      on a rank (the one computed and the one arriving; the tests count the bytes).
    - Overlap: the receive that brings the next block is posted before the current block is
      computed and waited for after it, so the transfer runs while this rank computes. A tensor
      being sent is not written to (nor received into) until its send has been waited for.
    - Every block is computed with `attention_block(q, k_block, v_block, q_start, k_start,
      causal)`, positions global; with causal=True a block whose keys all come after all of this
      rank's queries is skipped (it adds nothing), every other block is computed exactly once.
    - The blocks' partial results are merged exactly, also when scores are in the hundreds
      (exp() overflows there: keep the merge relative to the running log-sum-exp), and in the
      dtype attention_block returns (float32 for bf16 inputs: a running output kept in bf16
      loses what later blocks add).
    - Differentiable: autograd through the result gives SDPA's gradients for q, k and v. Return
      `with_ring_backward(q, k, v, out, lse, causal, group)`, where lse (batch, heads, seq_local)
      is each query's log-sum-exp of its scaled scores over the whole (visible) sequence; its
      backward is the second ring. Compute the forward without autograd: the tests count what is
      kept for the backward (q, k, v, out and lse only: nothing seq x seq).
    """
    ### BEGIN SOLUTION
    peers = ring_peers(group)
    n, r, seq_local = peers.size, peers.rank, q.shape[-2]
    with torch.no_grad():                                   # the backward is with_ring_backward's
        kv = torch.stack([k, v])                            # (2, b, a, s, d): one contiguous message
        out = lse = None
        for step in range(n):
            source = (r - step) % n                         # whose K/V this rank holds now
            incoming = torch.empty_like(kv) if step < n - 1 else None
            requests = post_ring_exchange(kv, incoming, peers, group) if incoming is not None else []
            if not causal or source <= r:                   # later ranks' keys: all in the future
                block_out, block_lse = attention_block(q, kv[0], kv[1], r * seq_local,
                                                       source * seq_local, causal)
                if out is None:                             # step 0: our own block (the diagonal)
                    out, lse = block_out, block_lse
                else:                                       # online softmax: rescale both sides
                    merged = torch.logaddexp(lse, block_lse)
                    out = (torch.exp(lse - merged).unsqueeze(-1) * out
                           + torch.exp(block_lse - merged).unsqueeze(-1) * block_out)
                    lse = merged
            for request in requests:                        # after the compute: overlap
                request.wait()
            if incoming is not None:
                kv = incoming
    return with_ring_backward(q, k, v, out, lse, causal, group)
    ### END SOLUTION


# ============================================================================ checks
# torch's own test of its ring in bfloat16 (pytorch/pytorch test/distributed/tensor/
# test_attention.py, RingAttentionTest._test_ring_attention_sdpa): q, k, v uniform in [0, 1),
# backward of out.sum(), torch.allclose(atol=...) with these per-rank absolute tolerances, times
# the world size, for the output and for dq, dk, dv.
BF16_ATOL_PER_RANK = {"output": 1e-3, "grads": 8e-3}


def bf16_tolerance(quantity: str, world_size: int) -> float:
    """torch's absolute tolerance for `quantity` ("output", "dq", "dk" or "dv") on world_size ranks."""
    return BF16_ATOL_PER_RANK["output" if quantity == "output" else "grads"] * world_size


def sample_qkv(batch: int, heads: int, seq: int, head_dim: int, *, seed: int = 0,
               dtype=torch.float64, device="cpu", logit_scale: float = 1.0,
               uniform: bool = False) -> tuple[torch.Tensor, ...]:
    """q, k, v (batch, heads, seq, head_dim) for the whole sequence, the same on every rank:
    normal, or uniform in [0, 1) as torch's own ring test draws them (`uniform`); `logit_scale`
    multiplies q (scores grow with it: 30 gives scores in the hundreds)."""
    g = torch.Generator().manual_seed(seed)
    draw = torch.rand if uniform else torch.randn
    q, k, v = (draw(batch, heads, seq, head_dim, generator=g, dtype=torch.float64) for _ in range(3))
    return tuple(t.to(dtype=dtype, device=device) for t in (q * logit_scale, k, v))


def sequence_shard(x: torch.Tensor, rank: int, world_size: int, layout: str = "contiguous") -> torch.Tensor:
    """Rank `rank`'s positions of x (..., seq, d) in `layout` (a copy)."""
    seq_local = divide(x.shape[-2], world_size, "the sequence over the context-parallel ranks")
    return torch.cat([x[..., start:start + length, :] for _, start, length
                      in local_chunks(layout, rank, world_size, seq_local)], dim=-2).clone()


def compare_with_sdpa(attention, q, k, v, causal: bool, group=None, layout: str = "contiguous",
                      seed: int = 1, dout: torch.Tensor | None = None) -> dict:
    """Run `attention(q_shard, k_shard, v_shard)` on this rank's shard of the whole-sequence q, k, v
    and backpropagate `dout` (default: a random gradient); compare output and gradients with one
    process's F.scaled_dot_product_attention in float64 on the same values (this rank's rows).
    Returns the largest absolute differences ("output", "dq", "dk", "dv", "worst") and, beside
    them, each reference's largest magnitude ("scale": {...})."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    full = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*full, is_causal=causal)
    if dout is None:
        g = torch.Generator().manual_seed(seed)
        dout = torch.randn(expected.shape, generator=g, dtype=torch.float64).to(q.dtype)
    dout = dout.to(q.device)
    expected.backward(dout.double())
    mine = [sequence_shard(t.detach(), rank, n, layout).requires_grad_(True) for t in (q, k, v)]
    out = attention(*mine)
    out.backward(sequence_shard(dout, rank, n, layout))
    references = {"output": expected.detach(), "dq": full[0].grad, "dk": full[1].grad, "dv": full[2].grad}
    got = {"output": out.detach(), "dq": mine[0].grad, "dk": mine[1].grad, "dv": mine[2].grad}
    diff, scale = {}, {}
    for name, ref in references.items():
        want = sequence_shard(ref, rank, n, layout)
        scale[name] = want.abs().max().item()
        diff[name] = float("inf") if got[name] is None else (got[name].double() - want).abs().max().item()
    diff["worst"] = max(diff.values())
    return {**diff, "scale": scale}
