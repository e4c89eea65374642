"""Tests of labs/lab11_planner.py (pure arithmetic, no launch): context parallelism's bytes are
lab 11's own count (labs/lab11_ulysses.bytes_per_rank, which lab 11's tests hold against the
bytes its ring attention and Ulysses runs send), expert parallelism's are lab 11's
`all_to_all_bytes` for a balanced routing (which lab 11's tests hold against the bytes its
expert-parallel layer sends) and come close to what a real router's routing sends; activations
divide by cp; the layer's experts are lab 11's; each axis goes on the link its group crosses,
with the cluster's per-call cost; the rankings of the published models keep their promises.
"""
from __future__ import annotations

import pytest

from labs import lab09_planner as pl
from labs import lab11_experts as experts
from labs import lab11_planner as lp
from labs import lab11_rankings as ranked
from labs.lab11_ulysses import bytes_per_rank

MODEL = pl.ModelSpec("long", layers=4, hidden=64, heads=8, seq=64, vocab=0, global_batch=4)
CLUSTER = pl.ClusterSpec("test", gpus_per_node=4, memory_bytes=1e9, peak_flops=1e9, matmul_efficiency=1.0,
                         intra_latency_s=1e-6, intra_bytes_per_s=1e9, inter_latency_s=1e-5, inter_bytes_per_s=1e8,
                         call_s=1e-4)


@pytest.mark.parametrize("cp,tp,b,e,acc", [(2, 1, 1, 8, 8), (4, 1, 2, 2, 4), (4, 2, 1, 2, 4), (8, 1, 3, 4, 4)])
def test_cp_bytes_are_lab11s_count(cp, tp, b, e, acc):
    """Ring and Ulysses bytes per layer equal lab11_ulysses.bytes_per_rank for the rank's heads (a/tp)."""
    d = MODEL.hidden // MODEL.heads
    for design in ("ring", "ulysses"):
        got = lp.cp_bytes_per_layer(MODEL, b, cp, design, tp=tp, element_bytes=e, accumulate_bytes=acc)
        want = bytes_per_rank(design, cp, b, MODEL.heads // tp, MODEL.seq, d, e, acc)
        assert got == want, (design, got, want)
    # the all-gather design sends what the ring sends forward; backward K and V gathered again (as
    # torch's backward does: tests/test_lab11_context.py counts it) and a reduce-scatter of dK, dV
    ring = lp.cp_bytes_per_layer(MODEL, b, cp, "ring", tp=tp, element_bytes=e, accumulate_bytes=acc)
    gather = lp.cp_bytes_per_layer(MODEL, b, cp, "all-gather", tp=tp, element_bytes=e, accumulate_bytes=acc)
    assert gather["forward"] == ring["forward"]
    x = b * MODEL.heads // tp * MODEL.seq // cp * d
    assert gather["backward"] == gather["forward"] + 2 * x * acc * (cp - 1) < ring["backward"]
    assert lp.cp_bytes_per_layer(MODEL, b, 1, "ring") == {"forward": 0, "backward": 0}


def test_fewer_kv_heads_send_fewer_kv_bytes_and_limit_ulysses():
    """Grouped-query attention: the ring moves kv_heads/heads of the bytes; Ulysses needs whole kv heads per rank."""
    full = lp.cp_bytes_per_layer(MODEL, 1, 4, "ring")
    gqa = lp.cp_bytes_per_layer(MODEL, 1, 4, "ring", kv_heads=2)
    assert gqa["forward"] * 4 == full["forward"] and gqa["backward"] * 4 == full["backward"]
    d = MODEL.hidden // MODEL.heads
    u = lp.cp_bytes_per_layer(MODEL, 1, 2, "ulysses", kv_heads=2)       # q and the output: 8 heads; k, v: 2
    x, x_kv = 1 * 8 * 32 * d, 1 * 2 * 32 * d
    assert u == {"forward": (2 * x + 2 * x_kv) * 2 // 2, "backward": (2 * x + 2 * x_kv) * 2 // 2}
    with pytest.raises(ValueError, match="whole heads"):
        lp.cp_bytes_per_layer(MODEL, 1, 4, "ulysses", kv_heads=2)
    with pytest.raises(ValueError):
        lp.cp_bytes_per_layer(MODEL, 1, 4, "tree")


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_cp_divides_the_activations(cp):
    """Activations per rank: Korthikanti's count for s/cp positions, selective (no s^2 term): 1/cp of cp = 1's."""
    one = lp.cp_activation_bytes_per_layer(MODEL, 2, 1, tp=2, sequence_parallel=True)
    got = lp.cp_activation_bytes_per_layer(MODEL, 2, cp, tp=2, sequence_parallel=True)
    assert got == pytest.approx(one / cp)
    assert got == pl.activation_bytes_per_layer(MODEL.seq // cp, 2, 64, 8, tp=2, sequence_parallel=True,
                                                recompute="selective", dropout=False)
    with pytest.raises(ValueError):
        lp.cp_activation_bytes_per_layer(MODEL, 2, 3)


def test_ring_block_and_its_time_on_the_cp_link():
    """A ring step's block: s/cp queries x s/cp keys; cp of them make a layer's attention; its K/V message on the cp link."""
    block = lp.ring_block(MODEL, 2, 4, tp=2)
    c = 16
    assert block["positions"] == c and block["scores"] == 2 * 4 * c * c
    assert 4 * block["flops"] == pytest.approx(4 * 2 * MODEL.seq ** 2 * 64 / (4 * 2))    # cp blocks per rank
    assert block["kv_bytes"] == 2 * 2 * c * 4 * 8 * 2
    inside = lp.cp_seconds_per_layer(MODEL, CLUSTER, 2, 2, "ring", tp=2)                 # span 4: one node
    across = lp.cp_seconds_per_layer(MODEL, CLUSTER, 2, 4, "ring", tp=2)                 # span 8: two nodes
    assert (inside["link"], across["link"]) == ("inside a node", "between nodes")
    message = lp.ring_block(MODEL, 2, 4, tp=2)["kv_bytes"]
    inter = pl.Link(1e-5, 1e8, 1e-4, False)
    step, accumulator = pl.p2p_seconds(message, *inter), pl.p2p_seconds(2 * message, *inter)
    compute = block["flops"] / 1e9
    assert across["step_compute_s"] == pytest.approx(compute) and across["step_transfer_s"] == pytest.approx(step)
    assert across["hidden"] == (compute >= step)
    # the ring's steps overlap their blocks: only what a step's transfer takes beyond its block is exposed
    assert across["forward_s"] == pytest.approx(3 * max(0.0, step - compute))
    assert across["backward_s"] == pytest.approx(3 * max(0.0, step + accumulator - 2 * compute) + accumulator)
    assert across["transfer_s"] == pytest.approx(6 * step + 4 * accumulator)
    slow = pl.ClusterSpec(**{**CLUSTER.__dict__, "inter_bytes_per_s": 1e5})        # a link too slow to hide
    exposed = lp.cp_seconds_per_layer(MODEL, slow, 2, 4, "ring", tp=2)
    assert not exposed["hidden"] and exposed["forward_s"] > 0
    gather = lp.cp_seconds_per_layer(MODEL, CLUSTER, 2, 4, "all-gather", tp=2)
    assert gather["forward_s"] == pytest.approx(pl.collective_seconds("all_gather", 4 * message, 4, *inter))
    assert gather["backward_s"] == pytest.approx(gather["forward_s"] + pl.collective_seconds(
        "reduce_scatter", 4 * 2 * message, 4, *inter)) and gather["transfer_s"] == gather["forward_s"] + gather["backward_s"]
    uly = lp.cp_seconds_per_layer(MODEL, CLUSTER, 2, 4, "ulysses", tp=2)
    x = 2 * 4 * c * 8
    assert uly["forward_s"] == pytest.approx(lp.all_to_all_seconds(3 * x * 2, 4, *inter)
                                             + lp.all_to_all_seconds(x * 2, 4, *inter)) == uly["backward_s"]
    assert lp.all_to_all_seconds(1000, 4, *inter) == pytest.approx(1e-4 + 3e-5 + 0.75 * 1000 / 1e8)
    assert lp.all_to_all_seconds(1000, 1, *inter) == 0.0


@pytest.mark.parametrize("ep,tokens,k", [(2, 12, 1), (4, 24, 2), (8, 40, 3)])
def test_ep_bytes_are_lab11s_all_to_all_bytes_when_balanced(ep, tokens, k):
    """Dispatch and combine bytes per rank equal lab 11's all_to_all_bytes when every rank sends every rank T k / ep rows."""
    moe = lp.MoESpec(experts=2 * ep, top_k=k, expert_ffn=32)
    rows = tokens * k // ep
    splits = [[rows] * ep for _ in range(ep)]
    for rank in range(ep):
        assert lp.ep_bytes_per_layer(tokens, moe, ep, 16, 8) == experts.all_to_all_bytes(splits, rank, 16 * 8, 2 * ep)
    assert lp.ep_bytes_per_layer(tokens, moe, 1, 16, 8)["forward"]["dispatch"] == 0


def test_ep_bytes_against_a_real_routing():
    """lab 11's MoE routing 512 tokens per rank (random router): the balanced estimate is the ranks' mean within 5%; a skewed router loads one rank far beyond it."""
    ep, hidden, tokens = 4, 16, 512
    moe = experts.make_moe(hidden, 32, 8, 2)
    xs = [experts.sample_tokens(tokens, hidden, seed=100 + r) for r in range(ep)]
    plan = experts.routing_plan(moe, xs, ep)
    estimate = lp.ep_bytes_per_layer(tokens, lp.MoESpec(8, 2, 32), ep, hidden, 4)
    counted = [experts.all_to_all_bytes(plan["splits"], rank, hidden * 4, 8) for rank in range(ep)]
    assert all(c["forward"]["counts"] == estimate["forward"]["counts"] for c in counted)
    for phase in ("forward", "backward"):
        for what in ("dispatch", "combine"):
            mean = sum(c[phase][what] for c in counted) / ep
            assert mean == pytest.approx(estimate[phase][what], rel=0.05), (phase, what, mean)
    skewed = experts.skew_router(experts.make_moe(hidden, 32, 8, 2), 4.0)
    plan = experts.routing_plan(skewed, [experts.sample_tokens(tokens, hidden, seed=100 + r, shift=2.0)
                                         for r in range(ep)], ep)
    worst = max(experts.all_to_all_bytes(plan["splits"], r, hidden * 4, 8)["forward"]["combine"] for r in range(ep))
    assert worst > 1.5 * estimate["forward"]["combine"], "a skewed router loads one rank beyond the balanced estimate"


def test_experts_and_params_per_rank_are_lab11s_layer():
    """An expert's parameters are lab 11's Expert's; ep divides the experts, everything else stays."""
    h, f = 16, 40
    assert lp.MoESpec(8, 2, f).expert_params(h) == sum(p.numel() for p in experts.Expert(h, f).parameters())
    moe = experts.make_moe(h, f, 8, 2)
    spec = lp.MoESpec(8, 2, f)
    assert sum(p.numel() for p in moe.parameters()) == 8 * spec.expert_params(h) + h * 8      # + the router
    assert lp.MoESpec(8, 2, f, gated=True, biases=False).expert_params(h) == 3 * h * f
    model = pl.ModelSpec("moe", layers=4, hidden=h, heads=4, seq=8, vocab=32, global_batch=2)
    one, four = lp.moe_params_per_rank(model, spec, 1), lp.moe_params_per_rank(model, spec, 4)
    assert one["other"] == four["other"] and one["expert"] == 4 * four["expert"] == 4 * 8 * spec.expert_params(h)
    assert four["experts per rank"] == 2
    assert one["total"] == pytest.approx(model.params - 4 * (model.layer_params() - lp.attention_and_norm_params(model))
                                         + 4 * (8 * spec.expert_params(h) + h * 8))
    with pytest.raises(ValueError):
        lp.moe_params_per_rank(model, spec, 3)


def test_ep_link_and_seconds():
    """The all-to-alls of an ep group inside a node use the intra link, of a larger one the inter link, each paying the per-call cost."""
    moe = lp.MoESpec(16, 2, 32)
    inside = lp.ep_seconds_per_layer(100, moe, 4, 16, CLUSTER)
    across = lp.ep_seconds_per_layer(100, moe, 8, 16, CLUSTER)
    assert (inside["link"], across["link"]) == ("inside a node", "between nodes")
    intra = pl.Link(1e-6, 1e9, 1e-4, False)
    rows = lp.all_to_all_seconds(100 * 2 * 16 * 2, 4, *intra)
    assert inside["forward_s"] == pytest.approx(lp.all_to_all_seconds(16 * 8, 4, *intra) + 2 * rows)
    assert inside["backward_s"] == pytest.approx(2 * rows)
    assert lp.ep_seconds_per_layer(100, moe, 2, 16, CLUSTER, etp=4)["link"] == "between nodes"   # span etp ep = 8
    assert lp.expert_flops_per_layer(100, moe, 16) == 2 * 100 * 2 * 2 * 16 * 32


def test_rankings_of_the_published_models():
    """Llama 3 at 128K and DeepSeek-V3's experts: every candidate that splits, what fits first, fastest first; the links as the layout says."""
    rows = ranked.rank_long_context()
    assert rows and {r["cp"] for r in rows} == {1, 2, 4, 8, 16, 32}
    assert "ulysses" not in {r["design"] for r in rows}        # 8 kv heads over tp 8: one per rank
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True)
    fitting = [r["step s"] for r in rows if r["fits"]]
    assert fitting == sorted(fitting)
    assert all(r["cp link"] == "between nodes" for r in rows if r["cp"] > 1)     # tp 8 fills the node
    sixteen = [r for r in rows if r["cp"] == 16 and r["recompute"] == "selective"]
    assert all(r["activations GB/GPU"] == pytest.approx(sixteen[0]["activations GB/GPU"]) for r in sixteen)
    moe_rows = ranked.rank_moe()
    by_ep = {r["ep"]: r for r in moe_rows}
    assert by_ep[8]["ep link"] == "inside a node" and by_ep[64]["ep link"] == "between nodes"
    assert by_ep[64]["experts/GPU"] == 4 and by_ep[64]["rows per expert"] == 4096 * 8 * 64 // 256
    assert by_ep[64]["all-to-all ms/layer"] > by_ep[64]["if inside a node ms"]
    times = [r["all-to-all ms/layer"] + r["experts ms/layer"] for r in moe_rows if r["fits"]]
    assert times == sorted(times)


def test_long_context_summary_and_the_gap_verdict():
    """The cp 1 row's longer step is put down to what makes it: the bubble here, busy time when fed that case."""
    rows = ranked.rank_long_context()
    lines = ranked.long_context_summary(rows, 16).lines
    assert lines[0].startswith("fastest that fits: cp ") and "mostly the pipeline bubble" in lines[1]
    assert "10 of its 10 rows" in lines[2]
    slow = {"step s": 10.0, "bubble share": 0.1, "recompute": "full", "cp": 1, "micro-batches": 8}
    fast = {"step s": 5.0, "bubble share": 0.1, "recompute": "selective", "cp": 8, "micro-batches": 8}
    assert "mostly the stages' busy time" in ranked.step_gap_verdict(slow, fast, 4)
    assert "mostly the pipeline bubble" in ranked.step_gap_verdict({**slow, "bubble share": 0.55}, fast, 4)
    assert ranked.long_context_summary([{**rows[0], "fits": False}], 16).lines == [
        "no configuration of the table fits in memory"]
    moe = ranked.moe_summary(sorted(ranked.rank_moe(), key=lambda r: r["ep"])).lines
    assert moe[0].startswith("ep groups inside a node (ep 8)") and moe[1].startswith("across nodes (ep 16 to 128)")
