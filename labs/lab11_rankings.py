"""Lab 11 (rankings): labs/lab11_planner.py applied to two published runs: Llama 3 405B's 128K-token
stage (where cp goes, which attention design, which recomputation) and DeepSeek-V3's MoE layers
(where ep goes), each configuration ranked, and what notebook 11 concludes from the rankings.

Run:  ./run.sh labs/lab11_rankings.py      (pure arithmetic: rank 0 prints the two rankings)
"""
from __future__ import annotations

from labs.lab08_zero import model_state_bytes
from labs.lab09_planner import GB, ClusterSpec, ModelSpec
from labs.lab09_schedules import pipeline_timing
from labs.lab11_planner import (
    DESIGNS, MoESpec, cp_activation_bytes_per_layer, cp_bytes_per_layer, cp_seconds_per_layer, ep_bytes_per_layer,
    ep_seconds_per_layer, expert_flops_per_layer, moe_params_per_rank,
)
from labs.lab11_results import Shown


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
                timing = pipeline_timing("1F1B", pp, m, layers_here * (forward_s + t["forward_s"]),
                                         layers_here * (backward_s + t["backward_s"]))
                step = timing["makespan"]
                rows.append({"cp": cp, "design": design if cp > 1 else "-", "recompute": recompute, "dp": dp,
                             "micro-batches": m, "activations GB/GPU": acts / GB, "states GB/GPU": states / GB,
                             "fits": acts + states <= cluster.memory_bytes, "cp link": t["link"] if cp > 1 else "-",
                             "cp MB/layer (fwd+bwd)": (sent["forward"] + sent["backward"]) / 1e6,
                             "cp ms/layer transfers": 1e3 * t.get("transfer_s", 0.0),
                             "cp ms/layer exposed": 1e3 * comm, "compute ms/layer": 1e3 * compute_s,
                             "ring hides its steps": t.get("hidden", "-"),
                             "bubble share": timing["bubble"] / step, "step s": step})
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


def long_context_summary(rows: list[dict], pp: int) -> Shown:
    """`rank_long_context`'s rows in words: the fastest that fits, the best without cp and where
    the difference comes from (pipeline bubble or busy time), the links, and the ring's overlap."""
    lines = []
    best = rows[0]
    if not best["fits"]:
        return Shown("", rows, ["no configuration of the table fits in memory"])
    lines.append(f"fastest that fits: cp {best['cp']}, {best['design']}, {best['recompute']} recomputation: "
                 f"{best['step s']:.3g} s per step")
    alone = [r for r in rows if r["cp"] == 1 and r["fits"]]
    if alone:
        lines.append(step_gap_verdict(alone[0], best, pp))
    else:
        lines.append("without cp nothing fits: the activations of the whole sequence exceed the memory")
    ring = [r for r in rows if r["design"] == "ring"]
    hidden = sum(bool(r["ring hides its steps"]) for r in ring)
    lines.append(f"the ring's step transfer hides behind its block's compute in {hidden} of its {len(ring)} rows "
                 "(the table charges it only what its blocks do not cover)")
    return Shown("", rows, lines)


def step_gap_verdict(slow: dict, fast: dict, pp: int) -> str:
    """Why row `slow` takes longer than row `fast`: split each step into the busy time of a stage
    (m micro-batches of compute and exposed traffic) and the pipeline's idle time (the bubble)."""
    ratio = slow["step s"] / fast["step s"]
    busy = {k: r["step s"] * (1 - r["bubble share"]) for k, r in (("slow", slow), ("fast", fast))}
    gap = slow["step s"] - fast["step s"]
    bubble_part = slow["step s"] * slow["bubble share"] - fast["step s"] * fast["bubble share"]
    where = ("mostly the pipeline bubble" if bubble_part > 0.5 * gap else "mostly the stages' busy time")
    return (f"without cp the best that fits ({slow['recompute']} recomputation) takes {slow['step s']:.3g} s, "
            f"{ratio:.1f}x longer: {where} (with cp {slow['cp']}: {slow['micro-batches']} micro-batch(es) per "
            f"replica, the bubble (p-1)/(m+p-1) idles {slow['bubble share']:.0%} of the step; with cp {fast['cp']}: "
            f"{fast['micro-batches']}, {fast['bubble share']:.0%}; busy time {busy['slow']:.3g} s against "
            f"{busy['fast']:.3g} s, p = {pp})")


def moe_summary(rows: list[dict]) -> Shown:
    """`rank_moe`'s rows (sorted by ep) in words: all-to-alls against the experts' compute, inside a
    node and across nodes."""
    ratio = {r["ep"]: r["all-to-all ms/layer"] / r["experts ms/layer"] for r in rows}
    inside = [r["ep"] for r in rows if r["ep link"] == "inside a node"]
    across = [r for r in rows if r["ep link"] != "inside a node"]
    lines = []
    if inside:
        lines.append(f"ep groups inside a node (ep {', '.join(map(str, inside))}): the all-to-alls take "
                     f"{', '.join(f'{ratio[e]:.2f}' for e in inside)}x the experts' compute per layer")
    if across:
        lines.append(f"across nodes (ep {across[0]['ep']} to {across[-1]['ep']}): {min(ratio[r['ep']] for r in across):.2f}x to "
                     f"{max(ratio[r['ep']] for r in across):.2f}x; the same groups inside one node would take "
                     f"{min(r['if inside a node ms'] / r['experts ms/layer'] for r in across):.2f}x to "
                     f"{max(r['if inside a node ms'] / r['experts ms/layer'] for r in across):.2f}x")
    return Shown("", rows, lines)


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
