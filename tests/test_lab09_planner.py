"""Tests of labs/lab09_planner.py's given parts (pure): the model's parameter and FLOP counts
against Narayanan et al. 2021's formulas, the activation formula against Korthikanti et al.
2022's table 2, the alpha-beta collective cost with its fixed cost per call, the links, the published data, the ranking and
the explorer's logic (the last two call the exercise: they need it solved).
"""
from __future__ import annotations

import pytest

from helpers.notice import stub_message
from labs import lab09_at_scale as scale
from labs import lab09_planner as pl
from labs.lab09_schedules import pipeline_timing

GPT = pl.ModelSpec("gpt", layers=24, hidden=2304, heads=24, seq=2048, vocab=51200, global_batch=512)


def needs_planner():
    if stub_message(pl.plan_memory) or stub_message(pl.plan_step_time):
        pytest.skip("the planner is still an exercise here")


def test_parameters_and_flops_follow_narayanan():
    """params = 12 L h^2 (1 + 13/(12h) + (V+s)/(12 L h)); FLOPs = 96 B s L h^2 (...) (eq. 2, 3)."""
    L, h, V, s = GPT.layers, GPT.hidden, GPT.vocab, GPT.seq
    assert GPT.params == pytest.approx(12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h)))
    assert GPT.params / 1e9 == pytest.approx(1.7, abs=0.05)          # table 1's first row
    per_layer = GPT.layer_forward_flops(1)
    assert per_layer == 24 * s * h * h * (1 + s / (6 * h))
    total = GPT.global_batch * (4 * GPT.layers * per_layer + 3 * GPT.logits_forward_flops(1))
    assert pl.narayanan_flops(GPT) == pytest.approx(total)
    assert pl.narayanan_flops(GPT, recompute=False) == pytest.approx(
        GPT.global_batch * 3 * (GPT.layers * per_layer + GPT.logits_forward_flops(1)))
    assert GPT.layer_params(4) == pytest.approx((12 * h * h + 7 * h) / 4 + 6 * h)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_activation_formula_is_korthikanti_table_2(t):
    """16-bit activations with dropout: the five rows of Korthikanti et al.'s table 2."""
    s, b, h, a = 2048, 4, 4096, 32
    f = lambda **kw: pl.activation_bytes_per_layer(s, b, h, a, tp=t, **kw)   # noqa: E731
    assert f() == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    assert f(sequence_parallel=True) == pytest.approx(s * b * h / t * (34 + 5 * a * s / h))
    assert f(recompute="selective") == pytest.approx(s * b * h * (10 + 24 / t))
    assert f(recompute="selective", sequence_parallel=True) == pytest.approx(s * b * h * 34 / t)
    assert f(recompute="full") == pytest.approx(2 * s * b * h)
    if t == 1:
        assert f() == pytest.approx(s * b * h * (34 + 5 * a * s / h))


def test_activation_formula_in_fp32_without_dropout():
    """fp32, no dropout (what the lab measures): 16 elements per s b h, plus a s^2 b once."""
    s, b, h, a = 16, 2, 32, 4
    assert pl.activation_bytes_per_layer(s, b, h, a, element_bytes=4, dropout=False) == \
        s * b * h * 64 + a * s * s * b * 4
    assert pl.activation_bytes_per_layer(s, b, h, a, tp=2, element_bytes=4, dropout=False,
                                         recompute="selective", sequence_parallel=True) == s * b * h * 32
    with pytest.raises(ValueError):
        pl.activation_bytes_per_layer(s, b, h, a, recompute="some")


def test_collective_cost_is_the_ring_alpha_beta_model():
    """steps x latency + RING_SHARE x S / bandwidth; nothing on one GPU."""
    assert pl.collective_seconds("all_reduce", 1e6, 4, 1e-5, 1e9) == pytest.approx(6e-5 + 1.5e-3)
    assert pl.collective_seconds("all_gather", 1e6, 4, 1e-5, 1e9) == pytest.approx(3e-5 + 0.75e-3)
    assert pl.collective_seconds("reduce_scatter", 1e6, 2, 0.0, 1e9) == pytest.approx(0.5e-3)
    assert pl.collective_seconds("all_reduce", 1e6, 1, 1.0, 1.0) == 0.0
    assert pl.p2p_seconds(1e6, 1e-5, 1e9) == pytest.approx(1.01e-3)


def test_fixed_cost_per_call_and_gloos_reduce_scatter():
    """call_s once per call whatever its size; gloo's reduce-scatter costs an all-reduce; the link carries both."""
    assert pl.collective_seconds("all_gather", 1e6, 4, 1e-5, 1e9, 2e-3) == pytest.approx(2e-3 + 3e-5 + 0.75e-3)
    assert pl.collective_seconds("all_reduce", 4, 2, 0.0, 1e9, 2e-3) == pytest.approx(2e-3 + 4 / 1e9)
    assert pl.collective_seconds("all_reduce", 1e6, 1, 1.0, 1.0, 2e-3) == 0.0          # one rank: no call
    ring = pl.collective_seconds("reduce_scatter", 1e6, 4, 1e-5, 1e9)
    gloo = pl.collective_seconds("reduce_scatter", 1e6, 4, 1e-5, 1e9, 0.0, True)
    assert gloo == pytest.approx(pl.collective_seconds("all_reduce", 1e6, 4, 1e-5, 1e9)) == pytest.approx(2 * ring)
    assert pl.collective_seconds("all_gather", 1e6, 4, 1e-5, 1e9, 0.0, True) == pytest.approx(3e-5 + 0.75e-3)
    assert pl.p2p_seconds(1e6, 1e-5, 1e9, 2e-3, True) == pytest.approx(2e-3 + 1.01e-3)
    cluster = pl.ClusterSpec("gloo-like", 4, 1e9, 1e9, 1.0, 1e-5, 1e9, 1e-4, 1e8, call_s=2e-3,
                             reduce_scatter_as_all_reduce=True)
    config = pl.ParallelConfig(dp=2, tp=2, pp=2)
    assert pl.axis_link(cluster, config, "tp") == pl.Link(1e-5, 1e9, 2e-3, True)
    assert pl.axis_link(cluster, config, "pp") == pl.Link(1e-4, 1e8, 2e-3, True)      # 8 GPUs apart: 2 nodes
    assert pl.axis_link(pl.A100_SELENE, config, "dp").call_s == 0.0                     # published: 0


def test_links_and_tp_collectives():
    """tp inside a node unless it is larger; sp: all-gathers and reduce-scatters, one more gather back."""
    cluster = scale.H100_CLUSTER
    inside = pl.ParallelConfig(dp=16, tp=8, pp=8)
    assert pl.axis_link(cluster, inside, "tp") == (cluster.intra_latency_s, cluster.intra_bytes_per_s, 0.0, False)
    assert pl.axis_link(cluster, inside, "dp")[1] == cluster.inter_bytes_per_s
    assert pl.axis_link(cluster, inside, "pp")[1] == cluster.inter_bytes_per_s
    assert pl.axis_link(cluster, pl.ParallelConfig(dp=2, tp=2, pp=2), "pp")[1] == cluster.intra_bytes_per_s
    assert pl.axis_link(scale.with_tp_across_nodes(inside, cluster), inside, "tp")[1] == cluster.inter_bytes_per_s
    plain = pl.tp_collectives_per_layer(pl.ParallelConfig(tp=2))
    assert plain == {"forward": ["all_reduce"] * 2, "backward": ["all_reduce"] * 2}
    sp = pl.tp_collectives_per_layer(pl.ParallelConfig(tp=2, sequence_parallel=True))
    assert sorted(sp["forward"]) == ["all_gather"] * 2 + ["reduce_scatter"] * 2
    assert sp["backward"].count("all_gather") == 4 and sp["backward"].count("reduce_scatter") == 2
    full = pl.tp_collectives_per_layer(pl.ParallelConfig(tp=2, recompute="full"))
    assert len(full["backward"]) == 4


def test_check_config_names_what_does_not_split():
    """Heads over tp, layers over pp, the batch over dp x m, unknown names: a ValueError each."""
    for bad, words in ((pl.ParallelConfig(tp=5), "heads"), (pl.ParallelConfig(pp=5), "layers"),
                       (pl.ParallelConfig(dp=3), "batch"), (pl.ParallelConfig(schedule="x"), "schedule"),
                       (pl.ParallelConfig(recompute="x"), "recompute"), (pl.ParallelConfig(zero_stage=4), "zero")):
        with pytest.raises(ValueError, match=words):
            pl.check_config(GPT, bad)
    pl.check_config(GPT, pl.ParallelConfig(dp=8, tp=4, pp=4, micro_batches=8, schedule="interleaved 1F1B",
                                           virtual_stages=2, sequence_parallel=True))


def test_published_table_is_as_printed():
    """Narayanan et al. 2021 table 1: 10 rows, t p d multiply to the GPUs, % of 312 TFLOP/s."""
    assert len(scale.NARAYANAN_2021_TABLE1) == 10
    for billions, heads, hidden, layers, t, p, gpus, batch, tflops, pct in scale.NARAYANAN_2021_TABLE1:
        model = pl.ModelSpec("", layers, hidden, heads, 2048, 51200, batch)
        assert model.params / 1e9 == pytest.approx(billions, rel=0.04), billions
        assert gpus % (t * p) == 0 and abs(100 * tflops / 312 - pct) < 1, billions


def test_published_comparison_and_ranking():
    """Predicted TFLOP/s within 2x of the published; the ranking fits in 80 GB, fastest first."""
    needs_planner()
    rows = scale.published_comparison()
    assert all(0.5 < r["predicted / published"] < 2 for r in rows), rows
    for row in rows:        # run as they ran it (sec. 5.1): interleaved wherever there is a pipeline
        layers = next(r[3] for r in scale.NARAYANAN_2021_TABLE1 if f"GPT {r[0]}B" == row["model"])
        assert row["v"] == "-" if row["p"] == 1 else (row["v"] >= 2 and (layers // row["p"]) % row["v"] == 0), row
    ranked = scale.rank_configs(scale.GPT_70B, scale.H100_CLUSTER, 256, top=4)
    assert ranked and all(r["GB/GPU"] <= 80 for r in ranked)
    assert [r["step s"] for r in ranked] == sorted(r["step s"] for r in ranked)
    assert all(r["tp"] <= 8 and r["dp"] * r["tp"] * r["pp"] == 256 for r in ranked)


def test_explorer_logic():
    """explore(): errors for configurations that do not split, a full breakdown otherwise."""
    needs_planner()
    assert "multiple" in scale.explore("7B", 64, 3, 1, 1, "selective", "1F1B")["error"]
    ok = scale.explore("70B", 512, 8, 4, 1, "selective", "interleaved 1F1B")
    assert ok["error"] is None and ok["config"]["virtual_stages"] == 2 and ok["config"]["dp"] == 16
    assert set(ok["time"]) == {"compute", "tensor parallel", "pipeline messages", "bubble", "data parallel"}
    assert ok["summary"]["GB per GPU"] == pytest.approx(sum(ok["memory"].values()))
    assert ok["summary"]["step s"] == pytest.approx(sum(ok["time"].values()))
    assert 0 < ok["summary"]["MFU"] < 1
    no_pp = scale.explore("7B", 64, 8, 1, 1, "full", "interleaved 1F1B")
    assert no_pp["config"]["schedule"] == "1F1B" and no_pp["time"]["bubble"] == 0
    rows = scale.axis_rows(scale.GPT_70B, scale.H100_CLUSTER, pl.ParallelConfig(dp=16, tp=8, pp=4, micro_batches=64))
    assert [r["link"] for r in rows] == ["inside a node", "between nodes", "between nodes"]


STUBS = {name: (f"Exercise {name} (notebook 09_combining.ipynb): predict it. Fill in the block in "
                "labs/lab09_planner.py and run ./run.sh check 09") for name in ("plan_memory", "plan_step_time")}


def _stub(monkeypatch, *names):
    """The student edition with the planner's exercises `names` still stubs."""
    import helpers.notice as exercise

    def stub(message):
        def unsolved(*args, **kwargs):
            raise NotImplementedError(message)
        return unsolved

    monkeypatch.setattr(exercise, "student_edition", lambda root=None: True)
    for name in names:
        monkeypatch.setattr(scale, name, stub(STUBS[name]))


def test_explorer_without_the_planner(monkeypatch):
    """Student edition, planner unsolved: the explorer still shows the model, the links and the
    schedule, and one stub message per exercise still to write (both named, not the first only)."""
    _stub(monkeypatch, "plan_memory", "plan_step_time")
    r = scale.explore("70B", 512, 8, 4, 1, "selective", "interleaved 1F1B")
    assert r["error"] is None and r["unsolved"] == [STUBS["plan_memory"], STUBS["plan_step_time"]]
    assert "memory" not in r and "time" not in r and "summary" not in r
    assert [row["link"] for row in r["links"]] == ["inside a node", "between nodes", "between nodes"]
    timing = pipeline_timing("interleaved 1F1B", 4, r["config"]["micro_batches"], 1.0, 2.0, 2)
    assert r["schedule"] == {"bubble / ideal": timing["bubble_ratio"], "held on stage 0": timing["peak_held"]}
    one = scale.explore("7B", 64, 8, 1, 1, "full", "1F1B")
    assert one["schedule"] == {"bubble / ideal": 0.0, "held on stage 0": 1.0}
    assert one["error"] is None and len(one["unsolved"]) == 2
    # the model control changes what an unsolved explorer shows
    assert one["model"]["parameters"] == scale.GPT_7B.params and \
        scale.explore("70B", 64, 8, 1, 1, "full", "1F1B")["model"]["parameters"] == scale.GPT_70B.params


def test_explorer_with_one_exercise_written(monkeypatch):
    """plan_memory written, plan_step_time not: the memory shows, and the notice names the other."""
    needs_planner()
    _stub(monkeypatch, "plan_step_time")
    r = scale.explore("70B", 512, 8, 4, 1, "selective", "interleaved 1F1B")
    assert r["unsolved"] == [STUBS["plan_step_time"]] and "time" not in r and "summary" not in r
    assert r["memory"]["parameters"] > 0
    _stub(monkeypatch, "plan_memory")
    monkeypatch.setattr(scale, "plan_step_time", pl.plan_step_time)
    r = scale.explore("70B", 512, 8, 4, 1, "selective", "interleaved 1F1B")
    assert r["unsolved"] == [STUBS["plan_memory"]] and "memory" not in r and r["time"]["compute"] > 0


def test_traffic_agrees_with_notebook_05():
    """Tensor and pipeline bytes per step equal notebook 05's step_traffic for its Llama 2 70B layout."""
    needs_planner()
    from labs.lab05_tp_comm_volume import LLAMA2_70B, LLAMA2_70B_LAYOUT, step_traffic

    lay = LLAMA2_70B_LAYOUT
    plan = pl.plan_step_time(scale.GPT_70B, scale.H100_CLUSTER, pl.ParallelConfig(
        dp=lay["dp"], tp=lay["tp"], pp=lay["pp"], micro_batches=lay["micro_batches"]))
    theirs = step_traffic(LLAMA2_70B, **lay)
    assert plan.tp_bytes == pytest.approx(theirs["tensor parallel"]["bytes"])
    assert plan.pp_bytes == pytest.approx(theirs["pipeline parallel"]["bytes"])
    assert plan.dp_bytes == pytest.approx(theirs["data parallel"]["bytes"], rel=0.1)   # GPT vs Llama parameters


# ------------------------------------------------------------------------------ lab 12's run
def lab12_stage_params(config, shape, stage):
    """What a rank of `stage` holds in lab 12 (before FSDP's dp sharding): its stage's parameters,
    matrices and the embedding / output layer split over tp, norms whole (labs/lab12_parallelize)."""
    from labs.lab12_model import build_model
    from labs.lab12_parallelize import pipeline_stage

    pp, _, tp = shape
    model = pipeline_stage(build_model(config), stage, pp)
    return sum(p.numel() if name.endswith("norm.weight") else p.numel() / tp for name, p in model.named_parameters())


@pytest.mark.parametrize("small", [False, True])
def test_lab12_model_counts_lab12s_parameters(small):
    """RMSNorm, rotary positions, no biases, an MLP of ffn, an untied output: the planner counts lab 12's model."""
    from labs.lab12_model import LMConfig, parameter_count
    from labs.lab12_plan import lab12_model

    config = LMConfig(dim=32, heads=4, layers=4, ffn=64, seq=32, batch=8) if small else LMConfig()
    spec = lab12_model(config)
    assert spec.params + spec.norm_params() == parameter_count(config)       # + the final norm
    h, f = config.dim, config.ffn
    assert spec.layer_params(2) == (4 * h * h + 2 * h * f) / 2 + 2 * h
    assert spec.layer_forward_flops(1) == 2 * config.seq * (4 * h * h + 2 * h * f) + 4 * config.seq ** 2 * h
    assert spec.embedding_params(2) == config.vocab * h / 2 and spec.last_stage_params(2) == config.vocab * h / 2 + h


@pytest.mark.parametrize("shape,microbatches", [((2, 2, 2), 4), ((2, 1, 2), 4), ((1, 1, 2), 1), ((1, 2, 1), 1)])
def test_plan_lab12_holds_what_each_stage_holds(shape, microbatches):
    """plan_lab12: per stage, the parameters lab 12's stage holds on a rank (tp-split, then ZeRO-3 over dp), AdamW's 8 bytes."""
    needs_planner()
    from labs.lab08_zero import model_state_bytes
    from labs.lab12_plan import lab12_config, plan_lab12
    from labs.lab12_model import LMConfig

    config = LMConfig()
    plan = plan_lab12(config, shape, microbatches, pl.A100_SELENE)
    pp, dp, _ = shape
    for key, stage in (("first stage", 0), ("last stage", pp - 1)):
        memory = plan["memory"][key]
        params = lab12_stage_params(config, shape, stage)
        if key == "first stage" and pp == 1:      # one stage: the planner's stage 0 leaves out the output layer
            continue
        assert memory["params_per_gpu"] == pytest.approx(params), (key, memory["params_per_gpu"], params)
        states = model_state_bytes(params, dp, 3, 4, 4, 8)
        assert memory["parameters"] == pytest.approx(states["parameters"])
        assert memory["optimizer state"] == pytest.approx(states["optimizer state"])
    assert plan["config"]["zero_stage"] == 3 and plan["config"]["sequence_parallel"] == (shape[2] > 1)
    assert plan["step_s"] == pytest.approx(sum(plan["time"][k] for k in ("compute", "tp_comm", "pp_comm", "bubble", "dp_comm")))
    assert lab12_config(shape, microbatches, activation_checkpointing=True).recompute == "full"
