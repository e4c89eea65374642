"""Tests of lab 13 in this process (no launch): the grown-up model's pieces against plain
references, the router's bias, the grouped GEMM against the loop and padded capacity, the layout
planner's arithmetic, and every verdict the notebook prints fed both cases.

Run:  .venv/bin/python -m pytest tests/test_lab13_model.py -q
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from labs import lab13_balance as balance_lab
from labs import lab13_chooser as chooser_lab
from labs import lab13_context as cp_lab
from labs import lab13_grouped_gemm as gemm_lab
from labs import lab13_model as model_lab
from labs import lab13_planner as plan_lab
from labs import lab13_studies as studies_lab
from labs import lab13_train as train_lab

SMALL = dict(dim=32, heads=4, kv_heads=2, layers=2, ffn=64, seq=16, batch=2, experts=4, expert_ffn=16, shared_ffn=16)


def config(**changes):
    return model_lab.default_config("smoke", **{**SMALL, **changes})


# ============================================================================ the model
def test_rope_at_is_lab12s_rope_at_0_to_t():
    from labs.lab12_model import rope

    x = torch.randn(2, 3, 10, 8)
    assert torch.allclose(model_lab.rope_at(x, torch.arange(10)), rope(x))
    shifted = model_lab.rope_at(x, torch.arange(5, 15))
    assert not torch.allclose(shifted, rope(x)), "positions must change the angles"


def test_rows_at_global_positions_match_the_whole_sequence():
    """An attention given a row subset at their global positions turns them as the whole does."""
    x = torch.randn(1, 2, 12, 8)
    positions = torch.tensor([0, 1, 2, 9, 10, 11])
    assert torch.allclose(model_lab.rope_at(x, torch.arange(12))[:, :, positions], model_lab.rope_at(x[:, :, positions], positions))


def test_grouped_query_attention_is_repeated_kv():
    cfg = config()
    attention = model_lab.build_model(cfg).layers["0"].attention
    x = torch.randn(2, cfg.seq, cfg.dim)
    b, t, _ = x.shape
    q, k, v = (w(x).view(b, t, -1, cfg.head_dim).transpose(1, 2) for w in (attention.wq, attention.wk, attention.wv))
    assert k.shape[1] == cfg.kv_heads and q.shape[1] == cfg.heads
    pos = torch.arange(t)
    q, k = model_lab.rope_at(q, pos), model_lab.rope_at(k, pos)
    group = cfg.heads // cfg.kv_heads
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True)
    expected = attention.wo(expected.transpose(1, 2).reshape(b, t, -1))
    assert torch.allclose(attention(x), expected, atol=1e-6)


def test_moe_layer_against_a_token_by_token_reference():
    cfg = config()
    moe = model_lab.build_model(cfg).layers["1"].moe
    x = torch.randn(3, 5, cfg.dim)
    out = moe(x)
    tokens = x.reshape(-1, cfg.dim)
    experts, gates, _, _ = moe.router(tokens)
    ex, sh = moe.experts, moe.shared_expert
    for t in range(tokens.shape[0]):
        want = sum(gates[t, c] * (F.gelu(tokens[t] @ ex.w1[e].t()) @ ex.w2[e].t()) for c, e in enumerate(experts[t].tolist()))
        want = want + F.gelu(tokens[t] @ sh.w1[0].t()) @ sh.w2[0].t()
        assert torch.allclose(out.reshape(-1, cfg.dim)[t], want, atol=1e-5), f"token {t}"


@pytest.mark.parametrize("counts", [[5, 0, 3, 4], [0, 0, 12, 0]])
def test_grouped_gemm_equals_the_loop(counts):
    cfg = config()
    grads = {}
    for impl in model_lab.EXPERT_IMPLS:
        experts = model_lab.GroupedExperts(4, cfg.dim, cfg.expert_ffn, impl)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            experts.w1.copy_(torch.randn(experts.w1.shape, generator=g))
            experts.w2.copy_(torch.randn(experts.w2.shape, generator=g))
        rows = torch.randn(sum(counts), cfg.dim, generator=torch.Generator().manual_seed(1)).requires_grad_()
        out = experts(rows, torch.tensor(counts))
        out.backward(torch.ones_like(out))
        grads[impl] = (out.detach(), rows.grad, experts.w1.grad, experts.w2.grad)
    for a, b in zip(grads["grouped"], grads["loop"]):
        assert torch.allclose(a, b, atol=1e-5)


def test_router_bias_chooses_and_does_not_weigh():
    """The model's router passes; a router with the bias in its gates (the opposite case) fails."""
    cfg = config()
    good = balance_lab.bias_chooses_only(model_lab.Router(cfg))
    bad = balance_lab.bias_chooses_only(balance_lab.BiasInGates(cfg))
    assert good["moved"] > 0 and good["gates_unbiased"]
    assert bad["moved"] > 0 and not bad["gates_unbiased"]


def test_bias_step_moves_towards_balance():
    router = model_lab.Router(config())
    router.load.copy_(torch.tensor([9.0, 1.0, 1.0, 1.0]))
    load = router.update_bias(0.01)
    assert load.tolist() == [9.0, 1.0, 1.0, 1.0]
    assert router.bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    assert router.load.sum() == 0


def test_switch_loss_is_one_when_balanced():
    cfg = config(aux_coef=0.01)
    moe = model_lab.MoE(cfg)
    counts = torch.tensor([2, 2, 2, 2])
    affinity = torch.full((4, 4), 0.25)
    assert moe.switch_loss(counts, affinity).item() == pytest.approx(1.0)
    skewed = moe.switch_loss(torch.tensor([8, 0, 0, 0]), torch.tensor([[1.0, 0, 0, 0]] * 4))
    assert skewed.item() == pytest.approx(4.0)


def test_parameter_count_and_imbalance():
    cfg = config()
    counts = model_lab.parameter_count(cfg)
    assert counts["total"] == sum(p.numel() for p in model_lab.MoELM(cfg).parameters())
    assert counts["active"] < counts["total"]
    assert model_lab.imbalance([2, 2, 2, 2]) == 1.0 and model_lab.imbalance([4, 4, 0, 0]) == 2.0


def test_reference_trains():
    cfg = config()
    data, _ = model_lab.split(model_lab.corpus(200_000))
    run = model_lab.train_reference(cfg, 3, data, keep_grads=True)
    assert len(run["losses"]) == 3 and run["grads"] and all(math.isfinite(v) for v in run["losses"])
    assert any(abs(b) > 0 for m in run["model"].moe_layers().values() for b in m.router.bias.tolist())


# ============================================================================ context parallelism's layout
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_positions_cover_the_sequence_once(cp):
    seq = 32
    held = torch.cat([cp_lab.cp_positions(seq, cp, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(seq))
    if cp > 1:
        assert cp_lab.cp_positions(seq, cp, 0).tolist()[-1] == seq - 1, "zig-zag: rank 0 holds the last chunk"


def test_runs_and_causal_pairs():
    assert cp_lab.runs([0, 1, 2, 7, 8, 3]) == [(0, 0, 3), (3, 7, 2), (5, 3, 1)]
    pairs = cp_lab.piece_pairs([(0, 0, 4)], [(0, 4, 4), (4, 0, 4)])
    assert [(k[1], diagonal) for _, k, diagonal in pairs] == [(0, True)], "keys after every query: skipped"


def test_cp_bytes_formula_scales_with_kv_heads():
    ring_mha = cp_lab.cp_bytes("ring", 2, 1, 4, 4, 64, 16)
    ring_gqa = cp_lab.cp_bytes("ring", 2, 1, 4, 2, 64, 16)
    assert ring_mha["forward"] == 2 * ring_gqa["forward"]
    uly_mha, uly_gqa = cp_lab.cp_bytes("ulysses", 2, 1, 4, 4, 64, 16), cp_lab.cp_bytes("ulysses", 2, 1, 4, 2, 64, 16)
    assert uly_gqa["forward"] == pytest.approx(0.75 * uly_mha["forward"])


# ============================================================================ grouped GEMMs
def test_grouped_gemm_support_is_asked_of_torch():
    rows = {(r["dtype"], r["row width"]): r["grouped_mm"] for r in gemm_lab.support(widths=(64, 10))}
    assert rows[("float32", 64)] == "runs"
    assert rows[("float64", 64)] != "runs"
    assert "16 bytes" in rows[("float32", 10)]


def test_grouped_mm_is_a_loop_of_matmuls_on_this_cpu():
    """What the notebook says of this build: one aten::mm per group inside the operator."""
    assert gemm_lab.inside_grouped_mm(3) == {"aten::mm": 3}


def test_three_ways_agree_where_nothing_is_dropped():
    x, chosen, gates = gemm_lab.routed(64, 16, 4, 2, skew=0.0)
    w1, w2 = gemm_lab.expert_weights(4, 16, 16)
    loop, _ = gemm_lab.moe_forward("loop", x, chosen, gates, w1, w2)
    grouped, _ = gemm_lab.moe_forward("grouped", x, chosen, gates, w1, w2)
    padded, dropped = gemm_lab.moe_forward("padded", x, chosen, gates, w1, w2, capacity_factor=100.0)
    assert dropped == 0 and torch.allclose(loop, grouped, atol=1e-5) and torch.allclose(loop, padded, atol=1e-5)
    _, dropped = gemm_lab.moe_forward("padded", *gemm_lab.routed(64, 16, 4, 2, skew=3.0), w1, w2, capacity_factor=1.0)
    assert dropped > 0


def result(impl, ratios, peak=100, dropped=0):
    return gemm_lab.GemmResult(impl, "float32", 1.0, ratios, peak, dropped, 0.0)


@pytest.mark.parametrize("ratios, faster", [([1.5, 1.2, 1.3], "grouped"), ([0.5, 0.8, 0.9], "other"),
                                             ([0.8, 1.3, 1.0], "noise")])
def test_gemm_verdict_can_flip(ratios, faster):
    v = gemm_lab.verdict([result("grouped", [1, 1, 1]), result("loop", ratios), result("padded", ratios, 150, 7)])
    assert v["loop"]["faster"] == faster and v["padded"]["memory_ratio"] == 1.5 and v["dropped"]["padded"] == 7
    words = gemm_lab.sentence(v)
    assert {"grouped": "slower in every round", "other": "faster in every round", "noise": "no difference"}[faster] in words


# ============================================================================ balancing
def study(bias_imbalance):
    none = {"imbalance": [3.0] * 9, "losses": [2.0] * 9}
    return {"none": none, "bias (DeepSeek-V3)": {"imbalance": bias_imbalance, "losses": [2.0] * 9}}


@pytest.mark.parametrize("curve, outcome", [([3.0] * 6 + [2.0] * 3, "lower"), ([3.0] * 6 + [4.0] * 3, "higher"),
                                            ([3.0] * 6 + [2.0, 4.0, 3.0], "no clear difference"),
                                            ([3.0] * 9, "no clear difference")])
def test_balance_verdict_can_flip(curve, outcome):
    v = balance_lab.balance_verdict(study(curve))
    assert v["bias (DeepSeek-V3)"]["outcome"] == outcome
    assert outcome in balance_lab.balance_sentence(v)


# ============================================================================ the planner
SHAPE = plan_lab.MoEShape.from_config(config())


def test_candidates_respect_the_shapes():
    layouts = plan_lab.candidates(8, SHAPE)
    assert plan_lab.Layout(dp_shard=2, cp=2, tp=2) in layouts
    assert all(not plan_lab.layout_problem(layout, SHAPE) for layout in layouts)
    assert "experts" in plan_lab.layout_problem(plan_lab.Layout(dp_shard=8), SHAPE)
    assert "heads" in plan_lab.layout_problem(plan_lab.Layout(tp=4, dp_shard=2), SHAPE)


def test_dimension_labels_name_the_same_ranks_once():
    sizes = {"cp": 2, "tp": 2}
    assert plan_lab.dimension_label("dp_shard_cp", sizes) == "cp=dp_shard_cp=dp_cp"
    assert plan_lab.dimension_label("tp", sizes) == "tp"
    full = {"dp_shard": 2, "cp": 2, "tp": 2}
    assert plan_lab.dimension_label("world", full) == "world"
    merged = plan_lab.relabel({"cp": {"calls": {"send": 2}, "sent_bytes": 4.0},
                               "dp_shard_cp": {"calls": {"all_gather": 1}, "sent_bytes": 6.0}}, sizes)
    assert merged == {"cp=dp_shard_cp=dp_cp": {"calls": {"send": 2, "all_gather": 1}, "bytes": {}, "sent_bytes": 10.0}}


def test_step_calls_counts():
    calls = plan_lab.per_dimension(plan_lab.step_calls(plan_lab.Layout(dp_shard=2, cp=2), SHAPE), {"dp_shard": 2, "cp": 2})
    fsdp = calls["dp_shard_cp=dp_cp"]["calls"]
    assert fsdp == {"all_gather": 6, "reduce_scatter": 3, "all_to_all": 5, "all_reduce": 2}
    assert calls["cp"]["calls"] == {"send": 8}


def test_rank_groups_in_torchtitans_order():
    rows = plan_lab.rank_groups({"dp_shard": 2, "cp": 2, "tp": 2})
    assert rows[0]["tp group"] == [0, 1] and rows[0]["cp group"] == [0, 2] and rows[0]["dp_shard_cp group"] == [0, 2, 4, 6]


@pytest.mark.parametrize("times, outcome", [(([1, 1, 1], [2, 2, 2]), "held"), (([2, 2, 2], [1, 1, 1]), "reversed"),
                                            (([1, 2, 1], [2, 1, 2]), "noise")])
def test_ranking_verdict_can_flip(times, outcome):
    v = chooser_lab.ranking_verdict(["a", "b"], {"a": times[0], "b": times[1]})
    assert v["outcome"] == outcome
    assert {"held": "held", "reversed": "did not hold", "noise": "noise"}[outcome] in chooser_lab.verdict_sentence(v, ["a", "b"])


def test_the_published_layout_is_a_candidate_and_fits():
    shape = plan_lab.MoEShape(**{**chooser_lab.DEEPSEEK_V3.__dict__, "layers": 64})
    from labs.lab11_rankings import H800_CLUSTER

    row = plan_lab.predict(chooser_lab.DEEPSEEK_V3_PUBLISHED, shape, H800_CLUSTER, element_bytes=2, micro_batch_rows=1,
                           recompute="full")
    assert not plan_lab.layout_problem(chooser_lab.DEEPSEEK_V3_PUBLISHED, shape) and row["fits"]
    assert max(row["comm_s"], key=row["comm_s"].get) == "dp_shard_cp", "its all-to-alls dominate"


# ============================================================================ the studies' verdicts
def reshard(peaks_off, peaks_on, gathers=(3, 15), between=(400, 100)):
    return {r: {"False": {"peak_bytes": a, "all_gathers": gathers[0], "between_forwards": between[0]},
                "True": {"peak_bytes": b, "all_gathers": gathers[1], "between_forwards": between[1]}}
            for r, (a, b) in enumerate(zip(peaks_off, peaks_on))}


@pytest.mark.parametrize("off, on, outcome", [((100, 100), (100, 101), "about the same"), ((150, 150), (100, 100), "keeps more"),
                                               ((100, 100), (150, 150), "keeps less"), ((150, 100), (100, 150), "mixed")])
def test_reshard_verdict_can_flip(off, on, outcome):
    v = studies_lab.reshard_verdict(reshard(off, on))
    assert v["outcome"] == outcome and v["fewer_gathers"]
    assert {"about the same": "the same peak", "keeps more": "held more", "keeps less": "held less",
            "mixed": "some ranks"}[outcome] in studies_lab.reshard_sentence(v)
    assert v["holds_more_between"] and not studies_lab.reshard_verdict(reshard(off, on, between=(100, 400)))["holds_more_between"]
    assert not studies_lab.reshard_verdict(reshard(off, on, (15, 3)))["fewer_gathers"]


@pytest.mark.parametrize("hsdp, flat, outcome", [(10, 100, "less"), (100, 10, "more"), (5, 5, "same")])
def test_hsdp_verdict_can_flip(hsdp, flat, outcome):
    rows = {0: {"hsdp": {"crossing_bytes": hsdp}, "flat": {"crossing_bytes": flat}}}
    v = studies_lab.hsdp_verdict(rows)
    assert v["outcome"] == outcome and studies_lab.hsdp_sentence(v)


def test_crossing_groups():
    hsdp, flat = {"dp_replicate": 2, "dp_shard": 2, "cp": 2}, {"dp_shard": 4, "cp": 2}
    assert studies_lab.crosses("dp_replicate", hsdp) and not studies_lab.crosses("dp_shard_cp", hsdp)
    assert studies_lab.crosses("dp_shard_cp=dp_cp", flat) and not studies_lab.crosses("cp", flat)


@pytest.mark.parametrize("sent, less", [({("ring", 4): 8, ("ring", 2): 4, ("ulysses", 4): 4, ("ulysses", 2): 3}, "ulysses"),
                                        ({("ring", 4): 2, ("ring", 2): 1, ("ulysses", 4): 4, ("ulysses", 2): 3}, "ring")])
def test_gqa_effect_can_flip(sent, less):
    rows = [{"design": d, "kv_heads": k, "sent": v} for (d, k), v in sent.items()]
    effect = studies_lab.gqa_effect(rows)
    assert effect["ring"] == 2 and effect["less"]["grouped"] == less
    assert less in studies_lab.gqa_sentence(effect)


def test_agreement_can_flip():
    good = {"max_loss_rel_diff": 1e-7, "max_grad_diff": 1e-7, "max_param_diff": 1e-6, "bias_diff": 0.0}
    bad = {**good, "max_param_diff": 1e-2}
    assert all(v["within"] for v in train_lab.agreement([good, good]).values())
    a = train_lab.agreement([good, bad])
    assert not a["parameter"]["within"] and "BEYOND the tolerance for parameter" in train_lab.agreement_sentence(a, 3)
