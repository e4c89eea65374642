"""Lab 11 (planner): notebook 09's planner gains context parallelism (cp) and expert parallelism
(ep): activations and traffic per rank for a long-context and a mixture-of-experts model, and
where each axis belongs on a cluster (its group inside a node or across nodes).

Run:  ./run.sh labs/lab11_planner.py      (pure arithmetic: rank 0 prints the two rankings)

Given code, no exercise. It is built on labs/lab09_planner.py (ModelSpec, ClusterSpec, Link,
collective_seconds, p2p_seconds, activation_bytes_per_layer: nothing here needs notebook 09's
planner exercise) and counts bytes as lab 11's labs count and measure them:
labs/lab11_ulysses.py's `bytes_per_rank` for ring attention and Ulysses, labs/lab11_experts.py's
`all_to_all_bytes` for the dispatch and combine (tests/test_lab11_planner.py holds the two
together; lab 11's tests hold those formulas against the bytes their runs count).

Layout: ranks tp fastest, then cp, then ep, then dp, then pp (Megatron-Core's default order,
"tp-cp-ep-dp-pp", megatron/core/parallel_state.py). A cp group spans tp cp consecutive GPUs, an
ep group tp cp ep; a group stays inside a node when that many GPUs fit in one (`group_link`).

- Context parallelism splits the sequence: every activation a rank keeps is 1/cp of the
  sequence's (`cp_activation_bytes_per_layer`); attention needs every key and value, which
  travel: around a ring (`design="ring"`, lab 11's ring attention: cp - 1 blocks of K and V per
  layer forward, the blocks again with their gradient accumulators backward), gathered whole
  (`"all-gather"`: Llama 3's choice, Dubey et al. 2024, arXiv:2407.21783, sec. 3.3.2; the same
  bytes forward, a reduce-scatter of dK and dV backward), or as Ulysses' all-to-alls of q, k, v
  and the output (`"ulysses"`, lab 11's lab11_ulysses.py; heads must split over tp cp). One
  ring step computes a block of s/cp queries against s/cp keys (`ring_block`).
- Expert parallelism splits a mixture-of-experts layer's experts (`MoESpec`): each rank holds
  E/ep of them and a copy of everything else (`moe_params_per_rank`); every MoE layer sends each
  token's k rows to the ranks that hold its experts and brings the results back: two all-to-alls
  forward, two backward (`ep_bytes_per_layer`, balanced routing: what lab 11's `all_to_all_bytes`
  gives when every rank sends every rank T k / ep rows).

Times are the alpha-beta costs of notebook 09's planner on the link the group crosses: a message
of the ring `p2p_seconds`, an all-gather or reduce-scatter `collective_seconds`, an all-to-all
`all_to_all_seconds` (n - 1 steps, each rank sending (n-1)/n of its input). Nothing overlaps,
except where a row says what the ring could hide behind its block computes.
"""
from __future__ import annotations

from dataclasses import dataclass

from helpers.tensors import divide
from labs.lab08_zero import model_state_bytes
from labs.lab09_planner import (GB, ClusterSpec, Link, ModelSpec, activation_bytes_per_layer,
                                collective_seconds, p2p_seconds)
from labs.lab09_schedules import pipeline_timing
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
    - "all-gather": an all-gather of K and V forward (what the ring sends: cp - 1 blocks), a
      reduce-scatter of dK and dV backward (cp - 1 blocks of e');
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
        return {"forward": 2 * x_kv * element_bytes * (cp - 1), "backward": 2 * x_kv * accumulate_bytes * (cp - 1)}
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
    "forward_s", "backward_s" (exposed: nothing overlaps), "link", and for the ring what it could
    hide: "step_transfer_s" (one K/V block's message), "step_compute_s" (one block at the cluster's
    FLOP/s), "hidden" (the transfer fits behind the compute: lab 11's overlap condition)."""
    link = group_link(cluster, tp * cp)
    out = {"link": link_name(cluster, tp * cp), "forward_s": 0.0, "backward_s": 0.0}
    if cp == 1:
        return out
    block = ring_block(model, micro_batch, cp, tp=tp, element_bytes=element_bytes, kv_heads=kv_heads)
    kv_acc = block["kv_bytes"] / element_bytes * accumulate_bytes
    if design == "ring":
        out["forward_s"] = (cp - 1) * p2p_seconds(block["kv_bytes"], *link)
        out["backward_s"] = out["forward_s"] + cp * p2p_seconds(kv_acc, *link)
        out["step_transfer_s"] = p2p_seconds(block["kv_bytes"], *link)
        out["step_compute_s"] = block["flops"] / cluster.flops_per_s
        out["hidden"] = out["step_compute_s"] >= out["step_transfer_s"]
    elif design == "all-gather":
        out["forward_s"] = collective_seconds("all_gather", cp * block["kv_bytes"], cp, *link)
        out["backward_s"] = collective_seconds("reduce_scatter", cp * kv_acc, cp, *link)
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
                         tp: int = 1, cp: int = 1, element_bytes: int = 2) -> dict:
    """One MoE layer's all-to-alls on the link an ep group crosses (span tp cp ep): the counts, the
    dispatch and the combine forward, the two row all-to-alls backward ("forward_s",
    "backward_s", "link"); each row all-to-all's input is the rank's T k rows."""
    span = tp * cp * ep
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


# ==================================================================== published models, ranked
# Llama 3 405B (Dubey et al. 2024, arXiv:2407.21783, table 3): 126 layers, width 16,384, an MLP of
# 53,248 (SwiGLU: three matrices; the planner's MLP has two, so its FLOPs and parameters come out
# lower), 128 heads with 8 key/value heads (grouped-query attention), vocabulary 128,000, rotary
# positions, RMSNorm, no biases. 128K-token sequences in the long-context stage; the 16K-GPU run
# used tp 8, cp 16, pp 16, dp 8 (sec. 3.3.2, table 4), CP gathering K and V (sec. 3.3.2).
LLAMA3_405B_128K = ModelSpec("Llama 3 405B, 128K context", layers=126, hidden=16384, heads=128, seq=131072,
                             vocab=128000, global_batch=128, ffn=53248, biases=False, norm="rmsnorm",
                             positions="rotary", tied=False)
LLAMA3_KV_HEADS = 8
# DeepSeek-V3 (DeepSeek-AI 2024, arXiv:2412.19437; the released model's config): 61 layers (the
# first 3 with a dense MLP of 18,432), width 7168, 128 heads (multi-head latent attention: the
# planner counts plain attention), 256 routed experts and 1 shared per MoE layer, 8 per token,
# each a SwiGLU MLP of 2048; vocabulary 129,280. Trained on 2048 H800s with 64-way expert
# parallelism spanning 8 nodes (sec. 3.2); NVLink 160 GB/s inside a node, InfiniBand 50 GB/s
# between (sec. 3.2.2). Sequences of 4096 tokens in pre-training.
DEEPSEEK_V3 = ModelSpec("DeepSeek-V3", layers=61, hidden=7168, heads=128, seq=4096, vocab=129280,
                        global_batch=1, ffn=18432, biases=False, norm="rmsnorm", positions="rotary", tied=False)
DEEPSEEK_V3_MOE = MoESpec(experts=256, top_k=8, expert_ffn=2048, gated=True, biases=False, shared_experts=1,
                          dense_layers=3)
# H800 nodes as the paper gives them; the compute is an ASSUMPTION (the H100 SXM datasheet's 989
# TFLOP/s dense bf16 at the planner's 0.7), as are the latencies (lab09_at_scale's).
H800_CLUSTER = ClusterSpec("H800, 8 per node, NVLink 160 GB/s + InfiniBand 50 GB/s", gpus_per_node=8,
                           memory_bytes=80 * GB, peak_flops=989e12, matmul_efficiency=0.7,
                           intra_latency_s=1e-6, intra_bytes_per_s=160e9, inter_latency_s=5e-6,
                           inter_bytes_per_s=50e9)


def rank_long_context(model: ModelSpec = LLAMA3_405B_128K, cluster: ClusterSpec | None = None, *,
                      gpus: int = 16384, tp: int = 8, pp: int = 16, micro_batch: int = 1,
                      kv_heads: int | None = LLAMA3_KV_HEADS, cps=(1, 2, 4, 8, 16, 32), designs=DESIGNS,
                      recomputes=("selective", "full"), element_bytes: int = 2) -> list[dict]:
    """Each (cp, design, recomputation) for `model` on `gpus` GPUs with tp and pp fixed (default:
    Llama 3 405B at 128K tokens on 16K GPUs, tp 8 inside a node, 16 stages, on lab09_at_scale's
    H100 cluster); dp = gpus / (tp cp pp) replicas share the global batch, m = B / dp micro-batches
    of `micro_batch` sequences each. Per GPU of the most loaded stage (ceil(L/pp) layers): the
    activations it keeps (x the micro-batches 1F1B keeps in flight, sequence parallelism;
    "selective": attention's scores never kept; "full": only each layer's input) and whether they
    fit beside the model states (bf16 weights and gradients, fp32 Adam states sharded over dp:
    ZeRO-1, an ASSUMPTION); per layer and micro-batch: the cp bytes and their exposed seconds on
    the link a cp group crosses, the layer's compute (its matmuls and causal attention, forward and
    backward, a forward more with full recomputation, over tp cp GPUs at the cluster's FLOP/s), and
    for the ring whether a step's transfer hides behind its block; per step: 1F1B's simulated
    makespan (lab09_schedules.pipeline_timing) with those per-micro-batch times (compute + exposed cp
    traffic of the stage's layers; no other parallelism's traffic). Sorted: what fits first, then by
    that step time. Designs that cannot split (Ulysses' heads) are left out."""
    import math

    if cluster is None:
        from labs.lab09_at_scale import H100_CLUSTER as cluster
    rows = []
    layers_here = math.ceil(model.layers / pp)
    b, s, h = micro_batch, model.seq, model.hidden
    forward_flops = 2 * b * s * (4 * h * h + 2 * h * model.mlp_width) + 2 * b * s * s * h   # causal
    for cp in cps:
        if gpus % (tp * cp * pp) or model.global_batch % ((gpus // (tp * cp * pp)) * b):
            continue
        dp = gpus // (tp * cp * pp)
        m = model.global_batch // (dp * b)
        stage_params = model.embedding_params(tp) + layers_here * model.layer_params(tp)
        states = model_state_bytes(stage_params, dp, 1, 2, 2, 12)["total"]
        for recompute in recomputes:
            in_flight = pipeline_timing("1F1B", pp, m, 1.0, 2.0)["peak_held"]
            if recompute == "full":
                acts = element_bytes * b * s * h / (cp * tp) * layers_here * in_flight
            else:
                acts = (cp_activation_bytes_per_layer(model, b, cp, tp=tp, sequence_parallel=tp > 1,
                                                      element_bytes=element_bytes) * layers_here * in_flight)
            forward_s = forward_flops / (cp * tp) / cluster.flops_per_s
            backward_s = (3 if recompute == "full" else 2) * forward_s
            compute_s = forward_s + backward_s
            for design in designs if cp > 1 else designs[:1]:
                try:
                    sent = cp_bytes_per_layer(model, b, cp, design, tp=tp, element_bytes=element_bytes,
                                              kv_heads=kv_heads)
                except ValueError:
                    continue
                t = cp_seconds_per_layer(model, cluster, b, cp, design, tp=tp, element_bytes=element_bytes,
                                         kv_heads=kv_heads)
                comm = t["forward_s"] + t["backward_s"]
                step = pipeline_timing("1F1B", pp, m, layers_here * (forward_s + t["forward_s"]),
                                       layers_here * (backward_s + t["backward_s"]))["makespan"]
                rows.append({"cp": cp, "design": design if cp > 1 else "-", "recompute": recompute, "dp": dp,
                             "micro-batches": m, "activations GB/GPU": acts / GB, "states GB/GPU": states / GB,
                             "fits": acts + states <= cluster.memory_bytes, "cp link": t["link"] if cp > 1 else "-",
                             "cp MB/layer (fwd+bwd)": (sent["forward"] + sent["backward"]) / 1e6,
                             "cp ms/layer exposed": 1e3 * comm, "compute ms/layer": 1e3 * compute_s,
                             "ring hides its steps": t.get("hidden", "-"),
                             "step s": step})
    rows.sort(key=lambda r: (not r["fits"], r["step s"]))
    return rows


def rank_moe(model: ModelSpec = DEEPSEEK_V3, moe: MoESpec = DEEPSEEK_V3_MOE, cluster: ClusterSpec = H800_CLUSTER,
             *, gpus: int = 2048, pp: int = 16, tokens: int | None = None, eps=(8, 16, 32, 64, 128, 256),
             element_bytes: int = 2) -> list[dict]:
    """Each ep for `model`'s MoE layers on `gpus` GPUs in `pp` stages (default: DeepSeek-V3 on 2048
    H800s, 16 stages, one 4096-token sequence per rank and micro-batch, tp 1). Per GPU of a stage
    (ceil(L/pp) layers, all MoE: the most loaded): its experts, the rows each expert gets (T k ep / E:
    the size of its matmuls), the model states (bf16 weights and gradients, fp32 Adam states
    sharded ZeRO-1 over the replicas: gpus / (pp ep) of each expert, gpus / pp of the rest; an
    ASSUMPTION) and whether they fit; per MoE layer and micro-batch: the all-to-alls' bytes and
    seconds on the link an ep group crosses, beside the same on the link inside a node (what they
    would cost if the group fitted in one), and the routed experts' compute (forward and backward).
    Sorted: what fits first, then by the layer's time (compute + all-to-alls, exposed). Uniform
    routing over all ep ranks: DeepSeek's node-limited routing (at most 4 nodes per token) and its
    FP8 dispatch are not modelled, so the traffic between nodes is an upper bound; nor is what
    bigger matmuls per expert gain."""
    import math
    from dataclasses import replace

    tokens = model.seq if tokens is None else tokens
    layers_here = math.ceil(model.layers / pp)
    stage = replace(model, layers=layers_here)
    stage_moe = replace(moe, dense_layers=0)
    compute_s = 3 * expert_flops_per_layer(tokens, moe, model.hidden) / cluster.flops_per_s
    rows = []
    for ep in eps:
        if gpus % (pp * ep):
            continue
        params = moe_params_per_rank(stage, stage_moe, ep)
        states = (model_state_bytes(params["expert"], gpus // (pp * ep), 1, 2, 2, 12)["total"]
                  + model_state_bytes(params["other"], gpus // pp, 1, 2, 2, 12)["total"])
        sent = ep_bytes_per_layer(tokens, moe, ep, model.hidden, element_bytes)
        t = ep_seconds_per_layer(tokens, moe, ep, model.hidden, cluster, element_bytes=element_bytes)
        inside = ep_seconds_per_layer(tokens, moe, ep, model.hidden, _with_nodes_of(cluster, ep),
                                      element_bytes=element_bytes)
        comm = t["forward_s"] + t["backward_s"]
        rows.append({"ep": ep, "experts/GPU": params["experts per rank"],
                     "rows per expert": tokens * moe.top_k * ep // moe.experts,
                     "states GB/GPU": states / GB, "fits": states <= cluster.memory_bytes, "ep link": t["link"],
                     "all-to-all MB/layer (fwd+bwd)": (sum(sent["forward"].values()) + sum(sent["backward"].values())) / 1e6,
                     "all-to-all ms/layer": 1e3 * comm,
                     "if inside a node ms": 1e3 * (inside["forward_s"] + inside["backward_s"]),
                     "experts ms/layer": 1e3 * compute_s})
    rows.sort(key=lambda r: (not r["fits"], r["all-to-all ms/layer"] + r["experts ms/layer"]))
    return rows


def _with_nodes_of(cluster: ClusterSpec, gpus: int) -> ClusterSpec:
    """The same cluster with nodes of at least `gpus` GPUs (what if the group fitted in one)."""
    from dataclasses import replace
    return replace(cluster, gpus_per_node=max(cluster.gpus_per_node, gpus))


def main() -> None:
    from helpers.dist import distributed
    from helpers.show import table

    with distributed() as ctx:
        if ctx.rank != 0:        # pure arithmetic: one rank is enough
            return
        long_rows, moe_rows = rank_long_context(), rank_moe()
        ctx.report(long_context=long_rows, moe=moe_rows)
        table(long_rows, floatfmt=".3g", title=f"{LLAMA3_405B_128K.name}: context parallelism, tp 8, pp 16")
        table(moe_rows, floatfmt=".3g", title=f"{DEEPSEEK_V3.name}'s MoE layers on {H800_CLUSTER.name}")


if __name__ == "__main__":
    main()
