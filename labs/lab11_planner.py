"""Lab 11 (planner): notebook 09's planner gains context parallelism (cp) and expert parallelism
(ep): activations and traffic per rank for a long-context and a mixture-of-experts model, and
where each axis belongs on a cluster (its group inside a node or across nodes).

A library of lab 11 (no main): ./run.sh labs/lab11_rankings.py prints the two rankings built on
it (pure arithmetic).

Given code, no exercise. It is built on labs/lab09_planner.py (ModelSpec, ClusterSpec, Link,
collective_seconds, p2p_seconds, activation_bytes_per_layer: nothing here needs notebook 09's
planner exercise) and counts bytes as lab 11's labs count and measure them:
labs/lab11_ulysses.py's `bytes_per_rank` for ring attention and Ulysses, labs/lab11_experts.py's
`all_to_all_bytes` for the dispatch and combine (tests/test_lab11_planner.py holds the two
together; lab 11's tests hold those formulas against the bytes their runs count).

Layout, as Megatron-Core numbers its ranks (megatron/core/parallel_state.py,
`initialize_model_parallel`): two rank generators over the same GPUs. Attention and the dense
layers use tp, cp, dp, pp (order "tp-cp-ep-dp-pp" with ep = 1): a cp group spans tp cp
consecutive GPUs. The experts use a generator of their own, ETP (expert tensor parallel, by
default tp), EP, EDP = GPUs / (ETP EP PP) and PP with cp = 1 (cp is folded into ep and edp: "MoE
parallel folding", Liu et al. 2025, arXiv:2504.14960): an ep group spans etp ep consecutive GPUs.
A group stays inside a node when that many GPUs fit in one (`group_link`).

- Context parallelism splits the sequence: every activation a rank keeps is 1/cp of the
  sequence's (`cp_activation_bytes_per_layer`); attention needs every key and value, which
  travel: around a ring (`design="ring"`, lab 11's ring attention: cp - 1 blocks of K and V per
  layer forward, the blocks again with their gradient accumulators backward), gathered whole
  (`"all-gather"`: Llama 3's choice, Dubey et al. 2024, arXiv:2407.21783, sec. 3.3.2; the same
  bytes forward; backward K and V gathered again, as torch's ring backward does with its
  all-gather rotater (lab11_context_parallel counts all_gather, permute, permute), and a
  reduce-scatter of dK and dV), or as Ulysses' all-to-alls of q, k, v and the output
  (`"ulysses"`, lab 11's lab11_ulysses.py; heads must split over tp cp). One ring step computes a
  block of s/cp queries against s/cp keys (`ring_block`).
- Expert parallelism splits a mixture-of-experts layer's experts (`MoESpec`): each rank holds
  E/ep of them and a copy of everything else (`moe_params_per_rank`); every MoE layer sends each
  token's k rows to the ranks that hold its experts and brings the results back: two all-to-alls
  forward, two backward (`ep_bytes_per_layer`, balanced routing: what lab 11's `all_to_all_bytes`
  gives when every rank sends every rank T k / ep rows).

Times are the alpha-beta costs of notebook 09's planner on the link the group crosses: a message
of the ring `p2p_seconds`, an all-gather or reduce-scatter `collective_seconds`, an all-to-all
`all_to_all_seconds` (n - 1 steps, each rank sending (n-1)/n of its input). The ring's messages
overlap its block computes, so only what a step's transfer takes beyond its block is charged
(exposed); the collectives and all-to-alls are charged whole (exposed), an upper bound where a
framework overlaps them with other work.
"""
from __future__ import annotations

from dataclasses import dataclass

from helpers.tensors import divide
from labs.lab09_planner import (ClusterSpec, Link, ModelSpec, activation_bytes_per_layer, collective_seconds,
                                p2p_seconds)
from labs.lab11_ulysses import bytes_per_rank

DESIGNS = ("ring", "all-gather", "ulysses")
COUNT_BYTES = 8          # lab 11 exchanges the token counts as int64 before the rows


# ===================================================================================== the links
def group_link(cluster: ClusterSpec, span: int) -> Link:
    """The link a group crosses whose ranks lie within `span` consecutive GPUs: inside a node if
    that many fit in one, else between nodes (with the cluster's per-call cost, as axis_link)."""
    inside = span <= cluster.gpus_per_node
    return Link(cluster.intra_latency_s if inside else cluster.inter_latency_s,
                cluster.intra_bytes_per_s if inside else cluster.inter_bytes_per_s,
                cluster.call_s, cluster.reduce_scatter_as_all_reduce)


def link_name(cluster: ClusterSpec, span: int) -> str:
    return "inside a node" if span <= cluster.gpus_per_node else "between nodes"


def all_to_all_seconds(nbytes: float, group_size: int, latency_s: float, bytes_per_s: float,
                       call_s: float = 0.0, reduce_scatter_as_all_reduce: bool = False) -> float:
    """Alpha-beta time of one all-to-all of `nbytes` per rank (its whole input, the part that
    stays included): n - 1 steps (a pairwise exchange), each rank sending (n-1)/n of its input.
    Takes a whole `Link` (`all_to_all_seconds(nbytes, n, *link)`)."""
    n = group_size
    if n <= 1 or nbytes <= 0:
        return 0.0
    return call_s + (n - 1) * latency_s + (n - 1) / n * nbytes / bytes_per_s


# ========================================================================= context parallelism
def head_dim(model: ModelSpec) -> int:
    return divide(model.hidden, model.heads, "the width over the attention heads")


def cp_activation_bytes_per_layer(model: ModelSpec, micro_batch: int, cp: int, *, tp: int = 1,
                                  sequence_parallel: bool = False, element_bytes: int = 2,
                                  dropout: bool = False) -> float:
    """Bytes one layer keeps for its backward on one of cp x tp ranks: Korthikanti et al.'s count
    (activation_bytes_per_layer) for this rank's s/cp positions. Blockwise attention (ring
    attention, FlashAttention) never keeps the s x s scores, only its output and log-sum-exp: the
    formula's "selective" variant, whose s^2 term is 0 with or without cp."""
    seq = divide(model.seq, cp, "the sequence over the context-parallel ranks")
    return activation_bytes_per_layer(seq, micro_batch, model.hidden, model.heads, tp=tp,
                                      sequence_parallel=sequence_parallel, recompute="selective",
                                      element_bytes=element_bytes, dropout=dropout)


def ring_block(model: ModelSpec, micro_batch: int, cp: int, *, tp: int = 1, element_bytes: int = 2,
               kv_heads: int | None = None) -> dict:
    """One ring step of one layer's forward on one rank: its s/cp queries against one block of s/cp
    keys, for its heads/tp heads. "positions": c = s/cp; "scores": b (a/tp) c^2 elements (the
    block a kernel computes and never stores); "flops": 4 b c^2 h / tp (Q K^T and P V, a whole
    block; the causal diagonal block does half); "kv_bytes": the K and V block that travels,
    2 b c (kv_heads/tp) d e."""
    c = divide(model.seq, cp, "the sequence over the context-parallel ranks")
    kv = model.heads if kv_heads is None else kv_heads
    return {"positions": c, "scores": micro_batch * model.heads // tp * c * c,
            "flops": 4 * micro_batch * c * c * model.hidden / tp,
            "kv_bytes": 2 * micro_batch * c * kv / tp * head_dim(model) * element_bytes}


def cp_bytes_per_layer(model: ModelSpec, micro_batch: int, cp: int, design: str = "ring", *, tp: int = 1,
                       element_bytes: int = 2, accumulate_bytes: int = 4, kv_heads: int | None = None) -> dict:
    """Bytes one rank sends for one attention layer, {"forward", "backward"}, with X = b (a/tp)
    (s/cp) d elements (X_kv with kv_heads/tp heads; multi-head attention: X_kv = X):
    - "ring": lab11_ulysses.bytes_per_rank's count, 2 X_kv e (cp-1) forward; backward the blocks
      again and the dK/dV accumulators, which make cp hops: 2 X_kv e (cp-1) + 2 X_kv e' cp
      (e' = accumulate_bytes);
    - "all-gather": an all-gather of K and V forward (what the ring sends: cp - 1 blocks);
      backward the same all-gather again (the gathered K and V are not kept: torch's backward
      gathers them again) and a reduce-scatter of dK and dV (cp - 1 blocks of e');
    - "ulysses": bytes_per_rank's 4 X e (cp-1)/cp each way (q, k, v out and the output back;
      with fewer kv heads, (2 X + 2 X_kv) e (cp-1)/cp). ValueError if the heads (kv heads) on a
      tp rank do not split over cp: Ulysses gives each rank whole heads."""
    kv = model.heads if kv_heads is None else kv_heads
    heads = divide(model.heads, tp, "attention heads over the tensor-parallel ranks")
    kv_here = divide(kv, tp, "key/value heads over the tensor-parallel ranks")
    b, s, d = micro_batch, model.seq, head_dim(model)
    if cp == 1:
        return {"forward": 0, "backward": 0}
    if design == "ring":
        return bytes_per_rank("ring", cp, b, kv_here, s, d, element_bytes, accumulate_bytes)
    x_kv = b * kv_here * divide(s, cp, "the sequence over the context-parallel ranks") * d
    if design == "all-gather":
        gather = 2 * x_kv * element_bytes * (cp - 1)
        return {"forward": gather, "backward": gather + 2 * x_kv * accumulate_bytes * (cp - 1)}
    if design == "ulysses":
        divide(kv_here, cp, "key/value heads of a tensor-parallel rank over the context-parallel ranks "
                            "(Ulysses gives each rank whole heads)")
        if kv_here == heads:
            return bytes_per_rank("ulysses", cp, b, heads, s, d, element_bytes)
        x = b * heads * (s // cp) * d
        one_way = (2 * x + 2 * x_kv) * element_bytes * (cp - 1) // cp
        return {"forward": one_way, "backward": one_way}
    raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")


def cp_seconds_per_layer(model: ModelSpec, cluster: ClusterSpec, micro_batch: int, cp: int,
                         design: str = "ring", *, tp: int = 1, element_bytes: int = 2,
                         accumulate_bytes: int = 4, kv_heads: int | None = None) -> dict:
    """One layer's context-parallel communication on the link a cp group crosses (span tp cp):
    "forward_s", "backward_s" (the exposed seconds), "transfer_s" (all of its messages' seconds,
    exposed or not), "link", and for the ring "step_transfer_s" (one K/V block's message),
    "step_compute_s" (one block at the cluster's FLOP/s), "hidden" (the transfer fits behind the
    compute: lab 11's overlap condition). The ring's steps overlap their blocks: a forward step
    exposes max(0, transfer - compute), a backward step (the block and the accumulators travel;
    twice the block's forward compute) the same; the other designs are exposed whole."""
    link = group_link(cluster, tp * cp)
    out = {"link": link_name(cluster, tp * cp), "forward_s": 0.0, "backward_s": 0.0}
    if cp == 1:
        return out
    block = ring_block(model, micro_batch, cp, tp=tp, element_bytes=element_bytes, kv_heads=kv_heads)
    kv_acc = block["kv_bytes"] / element_bytes * accumulate_bytes
    if design == "ring":
        step, compute = p2p_seconds(block["kv_bytes"], *link), block["flops"] / cluster.flops_per_s
        step_backward = step + p2p_seconds(kv_acc, *link)            # K/V and the dK/dV accumulator
        out["transfer_s"] = (cp - 1) * step + (cp - 1) * step + cp * p2p_seconds(kv_acc, *link)
        out["forward_s"] = (cp - 1) * max(0.0, step - compute)
        out["backward_s"] = (cp - 1) * max(0.0, step_backward - 2 * compute) + p2p_seconds(kv_acc, *link)
        out["step_transfer_s"], out["step_compute_s"] = step, compute
        out["hidden"] = compute >= step
        return out
    elif design == "all-gather":
        out["forward_s"] = collective_seconds("all_gather", cp * block["kv_bytes"], cp, *link)
        out["backward_s"] = out["forward_s"] + collective_seconds("reduce_scatter", cp * kv_acc, cp, *link)
    elif design == "ulysses":
        cp_bytes_per_layer(model, micro_batch, cp, design, tp=tp, kv_heads=kv_heads)   # heads must split
        # two all-to-alls each way: q, k, v together (X + 2 X_kv elements in), then the output (X);
        # backward the gradients of both, reversed
        x = block["scores"] // block["positions"] * head_dim(model)              # b (a/tp) c d
        x_kv = block["kv_bytes"] / (2 * element_bytes)
        out["forward_s"] = (all_to_all_seconds((x + 2 * x_kv) * element_bytes, cp, *link)
                            + all_to_all_seconds(x * element_bytes, cp, *link))
        out["backward_s"] = out["forward_s"]
    else:
        raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
    out["transfer_s"] = out["forward_s"] + out["backward_s"]
    return out


# ========================================================================== expert parallelism
@dataclass(frozen=True)
class MoESpec:
    """The mixture-of-experts layers of a model: `experts` routed experts (E), each token to
    `top_k` of them (k), each an MLP of width `expert_ffn`; `gated`: three matrices (SwiGLU: gate,
    up, down) instead of two (lab 11's experts: fc1, GELU, fc2); `biases` as lab 11's experts have;
    `shared_experts` run on every token (replicated, not routed); the first `dense_layers` layers
    keep a dense MLP (the ModelSpec's ffn)."""
    experts: int
    top_k: int
    expert_ffn: int
    gated: bool = False
    biases: bool = True
    shared_experts: int = 0
    dense_layers: int = 0

    def expert_params(self, hidden: int) -> int:
        """Parameters of one expert: (2 or 3) h f weights, plus f + h biases (2 f + h gated)."""
        f = self.expert_ffn
        matrices = 3 if self.gated else 2
        return matrices * hidden * f + ((matrices - 1) * f + hidden if self.biases else 0)


def moe_layers(model: ModelSpec, moe: MoESpec) -> int:
    return model.layers - moe.dense_layers


def moe_params_per_rank(model: ModelSpec, moe: MoESpec, ep: int, tp: int = 1) -> dict:
    """Parameters a rank holds with the routed experts split over ep ranks (whole experts: E/ep of
    each MoE layer's) and everything else as without ep (attention and norms split over tp as
    notebook 09's planner splits them; routers, shared experts and the dense layers' MLPs
    replicated; embeddings as `embedding_params` and `last_stage_params`, one pipeline stage).
    Returns "experts per rank", "expert", "other" and "total" parameters."""
    local = divide(moe.experts, ep, "experts over the expert-parallel ranks")
    h, layers = model.hidden, moe_layers(model, moe)
    dense_mlp = model.layer_params(tp) - attention_and_norm_params(model, tp)
    expert = layers * local * moe.expert_params(h)
    other = (model.layers * attention_and_norm_params(model, tp) + moe.dense_layers * dense_mlp
             + layers * (h * moe.experts + moe.shared_experts * moe.expert_params(h))
             + model.embedding_params(tp) + (0 if model.tied else model.last_stage_params(tp)))
    return {"experts per rank": local, "expert": expert, "other": other, "total": expert + other}


def attention_and_norm_params(model: ModelSpec, tp: int = 1) -> float:
    """A layer's parameters outside its MLP: attention (split over tp, its output bias
    replicated) and the two norms (replicated)."""
    h = model.hidden
    return (4 * h * h + (3 * h if model.biases else 0)) / tp + (h if model.biases else 0) + 2 * model.norm_params()


def ep_bytes_per_layer(tokens: int, moe: MoESpec, ep: int, hidden: int, element_bytes: int = 2,
                       count_bytes: int = COUNT_BYTES) -> dict:
    """Bytes one rank sends for one MoE layer with balanced routing: each of its `tokens` tokens
    sends k rows of `hidden` elements, T k / ep to each rank (its own share stays). Keys as lab 11's
    `all_to_all_bytes`: forward {"counts" (E/ep integers to each other rank), "dispatch" (its rows
    for other ranks' experts), "combine" (the results for other ranks' rows)}, backward
    {"combine", "dispatch"} (the same volumes, reversed)."""
    local = divide(moe.experts, ep, "experts over the expert-parallel ranks")
    if ep == 1:
        return {"forward": {"counts": 0, "dispatch": 0, "combine": 0}, "backward": {"combine": 0, "dispatch": 0}}
    rows = tokens * moe.top_k * (ep - 1) / ep
    rows = int(rows) if rows == int(rows) else rows
    row_bytes = hidden * element_bytes
    return {"forward": {"counts": (ep - 1) * local * count_bytes, "dispatch": rows * row_bytes,
                        "combine": rows * row_bytes},
            "backward": {"combine": rows * row_bytes, "dispatch": rows * row_bytes}}


def ep_seconds_per_layer(tokens: int, moe: MoESpec, ep: int, hidden: int, cluster: ClusterSpec, *,
                         etp: int = 1, element_bytes: int = 2) -> dict:
    """One MoE layer's all-to-alls on the link an ep group crosses (span etp ep: Megatron-Core's
    expert rank generator, expert tensor parallelism fastest, then ep; cp folded away): the
    counts, the dispatch and the combine forward, the two row all-to-alls backward ("forward_s",
    "backward_s", "link"); each row all-to-all's input is the rank's T k rows."""
    span = etp * ep
    link = group_link(cluster, span)
    rows_in = tokens * moe.top_k * hidden * element_bytes
    counts = all_to_all_seconds(moe.experts * COUNT_BYTES, ep, *link)
    rows = all_to_all_seconds(rows_in, ep, *link)
    return {"link": link_name(cluster, span), "forward_s": counts + 2 * rows, "backward_s": 2 * rows}


def expert_flops_per_layer(tokens: int, moe: MoESpec, hidden: int) -> float:
    """Forward FLOPs of one MoE layer's routed experts on a rank's tokens (balanced: each rank
    computes T k rows): 2 flops per weight per row."""
    matrices = 3 if moe.gated else 2
    return 2 * tokens * moe.top_k * matrices * hidden * moe.expert_ffn
