"""Lab 11 (ring attention): attention over a sequence split across ranks. Each rank keeps its own
queries; the keys and values travel around a ring of point-to-point messages, one block per step,
and the partial results merge with the online softmax. Checked against one process's SDPA.

Run:  ./run.sh 11      (this file alone: ./run.sh labs/lab11_ring_attention.py; 2-4 ranks)

- Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
  Context", arXiv:2310.01889: blockwise attention with the K/V blocks passed around a ring of
  devices while each block is computed, so the transfer hides behind the compute.
- Milakov and Gimelshein 2018, "Online normalizer calculation for softmax", arXiv:1805.02867, and
  FlashAttention (Dao et al. 2022, arXiv:2205.14135): a softmax over blocks merged exactly from
  each block's output and log-sum-exp.

Building blocks (given): `attention_block` (one block of queries against one block of keys, at
global positions; returns the block's output and log-sum-exp), `combine_partials` (merge such
partial results), `ring_peers` / `post_ring_exchange` (the ring's neighbours; isend + irecv
posted together), and the backward pass: `with_ring_backward` (an autograd function whose backward
is a second ring: the K/V blocks travel again, now with their gradient accumulators dK/dV, while dQ
stays home; the references are torch's `_templated_ring_attention_backward` and picotron's
context-parallel code). `block_pairs` says which (query piece, key piece) pairs a rank computes
when it holds another rank's K/V, for the contiguous layout and for lab11_zigzag.py's balanced one.
`trace_ring` records what a run did: blocks computed, messages posted and waited for, received
bytes alive.

Homework: `ring_attention` below (the forward pass). Check it with `./run.sh check 11`
(the public tests: tests/public/test_lab11_ring_attention.py).
"""
from __future__ import annotations

import contextlib
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers import pick
from helpers.comm_count import patched
from helpers.dist import DistContext, distributed
from helpers.notice import attempt
from helpers.show import table
from helpers.tensors import divide

LAYOUTS = ("contiguous", "zigzag")


# ============================================================================ one block
def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int,
                    causal: bool, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q (b, h, sq, d) at global positions q_start ... q_start + sq - 1 over
    keys and values k, v (b, h, sk, d) at positions k_start ... k_start + sk - 1, this block only.

    Returns (out, lse): out (b, h, sq, d) = softmax(q k^T * scale) v normalised over this block's
    keys, and lse (b, h, sq) = log sum_j exp(score_ij) over the same keys (scale = 1/sqrt(d) by
    default, as F.scaled_dot_product_attention). `causal`: the query at position i sees the key
    at position j only if j <= i; a query that sees no key of the block gets out = 0, lse = -inf.
    Computed in the inputs' dtype (float64 in, float64-exact out)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)              # (b, h, sq, sk)
    if causal:
        scores.masked_fill_(_future(q_start, q.shape[-2], k_start, k.shape[-2], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                  # (b, h, sq)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)    # rows that see no key
    if torch.is_grad_enabled():                                            # autograd keeps scores
        weights = torch.exp(scores - finite.unsqueeze(-1))
    else:                                                                  # one s x s buffer only
        weights = scores.sub_(finite.unsqueeze(-1)).exp_()                # masked: exp(-inf) = 0
    return torch.matmul(weights, v), lse


def _future(q_start: int, sq: int, k_start: int, sk: int, device) -> torch.Tensor:
    """(sq, sk) mask, True where the key's global position is after the query's."""
    q_pos = torch.arange(q_start, q_start + sq, device=device)
    k_pos = torch.arange(k_start, k_start + sk, device=device)
    return k_pos.unsqueeze(0) > q_pos.unsqueeze(1)


def attention_block_backward(q, k, v, dout, lse, delta, q_start: int, k_start: int, causal: bool,
                             scale: float | None = None) -> tuple[torch.Tensor, ...]:
    """This block's share of (dq, dk, dv), given the whole row's lse (b, h, sq) and
    delta = rowsum(dout * out) (b, h, sq) of the merged output: P = exp(scores - lse) is then the
    block's slice of the whole softmax, and dS = P (dP - delta) (FlashAttention-2's backward,
    Dao 2023, arXiv:2307.08691, algorithm 2)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    with torch.no_grad():                                  # in place: two s x s buffers at most
        p = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
        if causal:
            p.masked_fill_(_future(q_start, q.shape[-2], k_start, k.shape[-2], q.device), float("-inf"))
        p.sub_(lse.unsqueeze(-1)).exp_()                   # (b, h, sq, sk): the block's softmax
        dv = torch.matmul(p.transpose(-1, -2), dout)
        ds = torch.matmul(dout, v.transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(p)   # dS
        return torch.matmul(ds, k).mul_(scale), torch.matmul(ds.transpose(-1, -2), q).mul_(scale), dv


def combine_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial results of the same queries over disjoint sets of keys, all at once:
    lse = log sum_i exp(lse_i), out = sum_i exp(lse_i - lse) out_i (each weighted by its share of
    the whole softmax's denominator; stable, since every exponent is <= 0)."""
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
    acc_dtype = torch.promote_types(q.dtype, torch.float32)   # sums of N terms: at least fp32
    delta = (dout.to(acc_dtype) * out.to(acc_dtype)).sum(-1)   # (b, h, sq)
    q_, dout_, lse_ = q.to(acc_dtype), dout.to(acc_dtype), lse.to(acc_dtype)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    kv = torch.stack([k, v])                                  # (2, b, h, s, d): one message
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
    forward returns `out` as it is and keeps q, k, v, out and the log-sum-exp (all linear in the
    sequence: no score matrix); backward runs `ring_attention_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, out, lse, causal, group, layout):
        result = out.detach().clone()
        ctx.save_for_backward(q, k, v, result, lse)
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
    """`out` (b, h, seq_local, d), differentiable in q, k, v through the ring's backward.
    lse (b, h, seq_local): each query's log-sum-exp of its scaled scores over the whole sequence."""
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

    The contract, which the tests check (float64, to rounding; world sizes 1 to 4, sub-groups):
    - Point-to-point only, around the ring: each rank sends only to the next rank of the group,
      (r + 1) % N, and receives only from the previous one; each rank sends N - 1 blocks of K and
      V (its own, then the ones it received), k.nbytes + v.nbytes each. No collective; K and V
      are never gathered: no rank holds more than two received K/V blocks at a time.
    - Overlap: the receive that brings the next block is posted before the current block is
      computed and waited for after it, so the transfer runs while this rank computes.
    - Every block is computed with `attention_block(q, k_block, v_block, q_start, k_start,
      causal)`, positions global; with causal=True a block whose keys all come after all of this
      rank's queries is skipped (it adds nothing), every other block is computed exactly once.
    - The blocks' partial results are merged exactly, also when scores are in the hundreds
      (exp() overflows there: keep the merge relative to the running log-sum-exp).
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
        kv = torch.stack([k, v])                            # (2, b, h, s, d): one contiguous message
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


# ============================================================================ tracing a run
@dataclass
class RingEvent:
    kind: str                   # "send", "recv", "wait send", "wait recv", "block"
    t: float                    # time.perf_counter() when it happened
    peer: int | None = None     # send/recv: the other end, a rank of the group used
    nbytes: int = 0             # send/recv: the message's bytes
    q_start: int = -1           # block: global positions and lengths passed to attention_block
    q_len: int = 0
    k_start: int = -1
    k_len: int = 0
    seconds: float = 0.0        # block: how long attention_block took; wait: how long it blocked
    live_recv_bytes: int = 0    # block: bytes of receive buffers still alive when it started


@dataclass
class RingTrace:
    """What one process did inside `trace_ring()`, in order."""
    events: list[RingEvent] = field(default_factory=list)

    def of(self, kind: str) -> list[RingEvent]:
        return [e for e in self.events if e.kind == kind]

    @property
    def blocks(self) -> list[tuple[int, int, int, int]]:
        """(q_start, q_len, k_start, k_len) of every attention_block call, in order."""
        return [(e.q_start, e.q_len, e.k_start, e.k_len) for e in self.of("block")]

    @property
    def work(self) -> int:
        """Score entries computed: sum of q_len * k_len over the blocks (batch and heads aside)."""
        return sum(e.q_len * e.k_len for e in self.of("block"))

    @property
    def compute_seconds(self) -> float:
        return sum(e.seconds for e in self.of("block"))

    @property
    def wait_seconds(self) -> float:
        """Seconds spent blocked in waits for receives: the transfer time the compute did not hide."""
        return sum(e.seconds for e in self.of("wait recv"))

    @property
    def max_live_recv_bytes(self) -> int:
        return max((e.live_recv_bytes for e in self.of("block")), default=0)

    def rows(self) -> list[dict]:
        """The events as table rows, times in ms from the first event (a timeline to draw)."""
        t0 = self.events[0].t if self.events else 0.0
        rows = []
        for e in self.events:
            what = (f"block q@{e.q_start} x k@{e.k_start}" if e.kind == "block"
                    else f"{e.kind} {'to' if 'send' in e.kind else 'from'} {e.peer}")
            rows.append({"ms": 1e3 * (e.t - t0), "event": what, "bytes": e.nbytes,
                         "lasted ms": 1e3 * e.seconds})
        return rows


class _TracedWork:
    """A request that records when it is waited on and for how long (the real one waits)."""

    def __init__(self, work, event: Callable[[], RingEvent]):
        self._work, self._event = work, event

    def wait(self, *args, **kwargs):
        event = self._event()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            event.seconds = time.perf_counter() - event.t

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def trace_ring() -> Iterator[RingTrace]:
    """Record this process's point-to-point posts and waits (every route ends in ProcessGroup.send
    / recv; waits are seen for the requests isend, irecv and gloo's batch_isend_irecv return) and
    every `attention_block` call of this module, with the bytes of receive buffers still alive
    when it started (weak references: the trace keeps nothing alive)."""
    trace = RingTrace()
    received: dict[int, tuple[weakref.ref, int]] = {}    # storage address -> (ref, bytes)

    def live_bytes() -> int:
        return sum(n for ref, n in received.values() if ref() is not None)

    def make(direction: str):
        def wrap(original):
            def op(self, tensors, peer, tag=0):
                trace.events.append(RingEvent(direction, time.perf_counter(), peer,
                                              sum(t.nbytes for t in tensors)))
                if direction == "recv":
                    for t in tensors:
                        storage = t.untyped_storage()
                        received[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
                work = original(self, tensors, peer, tag)

                def waited() -> RingEvent:
                    trace.events.append(RingEvent(f"wait {direction}", time.perf_counter(), peer))
                    return trace.events[-1]
                return _TracedWork(work, waited)
            return op
        return wrap

    module = globals()
    original_block = module["attention_block"]

    def traced_block(q, k, v, q_start, k_start, causal, scale=None):
        event = RingEvent("block", time.perf_counter(), q_start=int(q_start), q_len=q.shape[-2],
                          k_start=int(k_start), k_len=k.shape[-2], live_recv_bytes=live_bytes())
        result = original_block(q, k, v, q_start, k_start, causal, scale)
        event.seconds = time.perf_counter() - event.t
        trace.events.append(event)
        return result

    module["attention_block"] = traced_block
    try:
        with patched({"send": make("send"), "recv": make("recv")}, required=("send", "recv")):
            yield trace
    finally:
        module["attention_block"] = original_block


# ============================================================================ checks
def sample_qkv(batch: int, heads: int, seq: int, head_dim: int, *, seed: int = 0,
               dtype=torch.float64, device="cpu", logit_scale: float = 1.0) -> tuple[torch.Tensor, ...]:
    """q, k, v (batch, heads, seq, head_dim) for the whole sequence, the same on every rank;
    `logit_scale` multiplies q (scores grow with it: 30 gives scores in the hundreds)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, generator=g, dtype=dtype) for _ in range(3))
    return (q * logit_scale).to(device), k.to(device), v.to(device)


def sequence_shard(x: torch.Tensor, rank: int, world_size: int, layout: str = "contiguous") -> torch.Tensor:
    """Rank `rank`'s positions of x (..., seq, d) in `layout` (a copy)."""
    seq_local = divide(x.shape[-2], world_size, "the sequence over the context-parallel ranks")
    return torch.cat([x[..., start:start + length, :] for _, start, length
                      in local_chunks(layout, rank, world_size, seq_local)], dim=-2).clone()


def compare_with_sdpa(attention, q, k, v, causal: bool, group=None, layout: str = "contiguous",
                      seed: int = 1) -> dict:
    """Run `attention(q_shard, k_shard, v_shard)` on this rank's shard of the whole-sequence q, k, v
    and backpropagate a random gradient; compare output and gradients with one process's
    F.scaled_dot_product_attention on the whole sequence (this rank's rows)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    full = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*full, is_causal=causal)
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(expected.shape, generator=g, dtype=expected.dtype).to(expected.device)
    expected.backward(dout)
    mine = [sequence_shard(t.detach(), rank, n, layout).requires_grad_(True) for t in (q, k, v)]
    out = attention(*mine)
    out.backward(sequence_shard(dout, rank, n, layout))
    diff = {"output": (out.detach() - sequence_shard(expected.detach(), rank, n, layout)).abs().max().item()}
    for name, ours, ref in zip(("dq", "dk", "dv"), mine, full):
        got = ours.grad
        expected_grad = sequence_shard(ref.grad, rank, n, layout)
        diff[name] = float("inf") if got is None else (got - expected_grad).abs().max().item()
    diff["worst"] = max(diff.values())
    return diff


def ring_check(device: torch.device, sizes: dict, group=None) -> dict:
    """ring_attention against SDPA (float64), non-causal and causal, with each rank's trace."""
    n = dist.get_world_size(group)
    q, k, v = sample_qkv(sizes["batch"], sizes["heads"], sizes["seq_local"] * n, sizes["head_dim"],
                         device=device)
    out = {}
    for causal in (False, True):
        with trace_ring() as trace:
            diff = compare_with_sdpa(lambda *t: ring_attention(*t, causal=causal, group=group),
                                     q, k, v, causal, group)
        out["causal" if causal else "full"] = {"max_abs_diff": diff, "blocks": trace.blocks,
                                               "work": trace.work, "timeline": trace.rows()}
    return out


def min_block_for_overlap(flops_per_s: float, link_bytes_per_s: float, element_bytes: int = 2) -> float:
    """Positions per block (c = S/N) above which a step's compute outlasts its transfer, so the ring
    hides its messages: a non-causal block costs 4 b h c^2 d flops (Q K^T and P V) while K and V
    move 2 b h c d e bytes, hence c >= e F / (2 B) (with e = 2, F / B: the condition Liu et al.
    2023 state for ring attention)."""
    return element_bytes * flops_per_s / (2 * link_bytes_per_s)


def overlap_check(device: torch.device, sizes: dict, repeats: int, group=None) -> dict:
    """Non-causal ring_attention forwards on float32 input: per rank, the seconds spent in
    attention_block and the seconds blocked waiting for the next block (transfer not hidden by
    the compute), best of `repeats`, and the bytes moved per step."""
    n = dist.get_world_size(group)
    q, k, v = sample_qkv(sizes["batch"], sizes["heads"], sizes["seq_local"] * n, sizes["head_dim"],
                         dtype=torch.float32, device=device)
    mine = [sequence_shard(t, dist.get_rank(group), n) for t in (q, k, v)]
    runs = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        with trace_ring() as trace:
            ring_attention(*mine, group=group)
        runs.append({"compute_s": trace.compute_seconds, "wait_s": trace.wait_seconds,
                     "wall_s": time.perf_counter() - start})
    best = min(runs, key=lambda r: r["wall_s"])
    return {**best, "block_bytes": mine[1].nbytes + mine[2].nbytes, "steps": n}


def default_sizes() -> dict:
    return dict(batch=2, heads=4, seq_local=pick(256, 16), head_dim=pick(32, 8))


def overlap_sizes() -> dict:
    return dict(batch=1, heads=8, seq_local=pick(1024, 32), head_dim=64)


def run(ctx: DistContext, **sizes) -> dict:
    """ring_attention against one process's SDPA on every rank (or the notice that it is not
    written yet), with the blocks each rank computed and its measured timeline; then, on larger
    blocks, how much of the transfer the compute hid."""
    s = {**default_sizes(), **sizes}
    return {"sizes": s, "world_size": ctx.world_size,
            "check": attempt(ring_check, ctx.device, s),
            "overlap_sizes": overlap_sizes(),
            "overlap": attempt(overlap_check, ctx.device, overlap_sizes(), pick(3, 1))}


def main() -> None:
    with distributed() as ctx:
        result = run(ctx)
        ctx.report(**result)
        check = result["check"]
        if "unsolved" in check:
            return
        rows = [{"rank": ctx.rank, "mask": mask, **{k: f"{v:.1e}" for k, v in c["max_abs_diff"].items()},
                 "blocks computed": len(c["blocks"])} for mask, c in check.items()]
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, rows)
        overlaps = [None] * ctx.world_size
        dist.all_gather_object(overlaps, result["overlap"])
        if ctx.rank == 0:
            table([row for rank_rows in gathered for row in rank_rows],
                  title=f"ring_attention vs SDPA on one process (float64), {ctx.world_size} ranks, "
                        f"{result['sizes']}")
            table([{"rank": r, "computing s": o["compute_s"], "waiting for blocks s": o["wait_s"],
                    "call s": o["wall_s"], "K/V block MiB": o["block_bytes"] / 2**20}
                   for r, o in enumerate(overlaps)],
                  title=f"non-causal ring, float32, {result['overlap_sizes']}: compute vs exposed transfer")
        worst = max(c["max_abs_diff"]["worst"] for c in check.values())
        if not math.isfinite(worst) or worst > 1e-9:
            raise RuntimeError(f"rank {ctx.rank}: ring_attention differs from SDPA by {worst:.2e}")


if __name__ == "__main__":
    main()
