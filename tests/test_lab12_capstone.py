"""Tests of lab 12 beyond the exercises: the model and its data, initialisation by name, the
pipeline split, the FLOP count, the timeline parser (in this process), and the labs' runs end to
end in one launch on 4 ranks:

- labs/lab12_resume.py: a rank SIGKILLs itself mid-run, torchrun (--max-restarts=1) restarts
  the group, training resumes from the last DCP checkpoint, recomputes the lost steps with the same
  losses and continues those of an uninterrupted run (one process); the checkpoint is reloaded on
  another mesh and in one process, whose next losses equal the run's;
- labs/lab12_train.py: the composed run against one process, what each rank holds and sends, the
  held-out loss, a sample from one process that loaded the final checkpoint;
- labs/lab12_trace.py: the profiler trace and its timeline, tokens/s, MFU;
- labs/lab12_memory.py: with a pipeline every FSDP unit of a stage is whole at once during a step,
  without one at most two (both measured here); FSDP2's all-gathers and reduce-scatters per step
  are what `fsdp2_calls` counts, with and without `reshard_after_forward`.

The launch restarts, so its ranks start fresh (torchrun's default) in both attempts; this file is
its worker. Everything runs on the instructor's solutions (the exercises are used throughout).

Run:  .venv/bin/python -m pytest tests/test_lab12_capstone.py -q
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from labs import lab12_model as model_lab
from tests.harness import launch_ranks

NPROC = 4
CONFIG = dict(dim=32, heads=4, layers=4, ffn=64, seq=32, batch=8)
STEPS, CKPT_EVERY, KILL_RANK, KILL_AT = 6, 2, 1, 3
PIPELINE, GRID = (2, 1, 2), (1, 2, 2)
LOSS_RTOL, PARAM_ATOL = 1e-4, 1e-4


# ============================================================================ in this process
def config():
    return model_lab.LMConfig(**CONFIG)


def test_init_value_depends_on_the_name_only():
    a = model_lab.init_value("layers.0.attention.wq.weight", (4, 8))
    assert torch.equal(a, model_lab.init_value("layers.0.attention.wq.weight", (4, 8)))
    assert not torch.equal(a, model_lab.init_value("layers.1.attention.wq.weight", (4, 8)))
    assert torch.equal(model_lab.init_value("norm.weight", (5,)), torch.ones(5))
    assert a.std().item() == pytest.approx(8 ** -0.5, rel=0.5)


def test_meta_model_holds_nothing_and_materialises_by_name():
    cfg = config()
    meta = model_lab.build_model(cfg)
    assert all(p.is_meta for p in meta.parameters())
    assert sum(p.numel() for p in meta.parameters()) == model_lab.parameter_count(cfg)
    meta.to_empty(device="cpu")
    meta.init_weights()
    whole = model_lab.build_model(cfg, "cpu")
    for (name, p), (_, q) in zip(meta.named_parameters(), whole.named_parameters()):
        assert torch.equal(p, q) and torch.equal(p, model_lab.init_value(name, tuple(p.shape))), name


def test_wrapper_prefixes_are_stripped():
    assert model_lab.canonical_name("layers.3._checkpoint_wrapped_module.attention.wq.weight") == \
        "layers.3.attention.wq.weight"


def test_pipeline_stages_keep_their_names():
    from labs.lab12_parallelize import pipeline_stage

    first = pipeline_stage(model_lab.build_model(config()), 0, 2)
    last = pipeline_stage(model_lab.build_model(config()), 1, 2)
    assert sorted(first.layers) == ["0", "1"] and sorted(last.layers) == ["2", "3"]
    assert first.tok_embeddings is not None and first.norm is None and first.output is None
    assert last.tok_embeddings is None and last.norm is not None and last.output is not None
    names = {n for n, _ in first.named_parameters()} | {n for n, _ in last.named_parameters()}
    assert names == {n for n, _ in model_lab.build_model(config()).named_parameters()}
    with pytest.raises(ValueError, match="the blocks over the pipeline stages: 4 is not divisible by 3"):
        pipeline_stage(model_lab.build_model(config()), 0, 3)


def test_mesh_shapes():
    from labs.lab12_parallelize import mesh_shape

    assert [mesh_shape(n) for n in (1, 2, 4, 8, 16)] == [(1, 1, 1), (1, 1, 2), (2, 1, 2), (2, 2, 2), (2, 4, 2)]


def test_data_is_deterministic_and_held_out_is_the_end():
    data = model_lab.corpus(200_000)
    assert len(data) == 200_000 and data.dtype == torch.uint8
    train, held = model_lab.split(data)
    assert len(held) == 20_000 and torch.equal(held, data[-20_000:])
    x, y = model_lab.batch_at(train, 7, 4, 16)
    x2, y2 = model_lab.batch_at(train, 7, 4, 16)
    assert torch.equal(x, x2) and torch.equal(x[:, 1:], y[:, :-1]) and x.shape == (4, 16)
    assert not torch.equal(x, model_lab.batch_at(train, 8, 4, 16)[0])


def test_flops_per_token_against_torch_count():
    """The matmul part of the formula equals what torch's FlopCounterMode counts for a forward and
    backward (6 per weight per token); attention's part (12 L t h) is added on top of it."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = model_lab.LMConfig(**{**CONFIG, "batch": 2, "seq": 16})
    model = model_lab.build_model(cfg, "cpu")
    x = torch.randint(0, 256, (cfg.batch, cfg.seq))
    with FlopCounterMode(display=False) as counter:
        model_lab.lm_loss(model(x), x).backward()
    matmuls = counter.get_flop_counts()["Global"][torch.ops.aten.mm]
    attention = 12 * cfg.layers * cfg.seq * cfg.dim
    assert model_lab.model_flops_per_token(cfg) - attention == matmuls / (cfg.batch * cfg.seq)


def test_generate_continues_the_prompt():
    cfg = config()
    text = model_lab.generate(model_lab.build_model(cfg, "cpu"), "def ", 10, cfg)
    assert text.startswith("def ") and len(text.encode("utf-8", errors="replace")) >= 14


def test_timeline_from_a_trace():
    from labs.lab12_trace import timeline

    def event(name, ts, dur, tid=1):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}

    trace = {"traceEvents": [
        event("step 3", 0, 100), event("aten::mm", 5, 10), event("comm tp all_gather", 10, 5),
        event("comm tp wait", 12, 6),            # overlaps the previous label: not counted twice
        event("pipeline wait", 30, 20), event("FSDP::all_gather_copy_out (layers.0)", 60, 10),
        event("comm pp send", 80, 1), event("gloo:all_gather", 0, 90, tid=2)]}
    line = timeline(trace, dp_size=2)
    assert line["span_s"] == pytest.approx(100e-6)
    totals = {k: round(v * 1e6, 3) for k, v in line["totals_s"].items()}
    assert totals == {"compute": 61.0, "tp communication": 8.0, "pipeline idle": 20.0,
                      "dp communication": 10.0, "pp communication": 1.0}
    assert line["intervals"][0] == [0.0, 0.01, "compute"]
    assert timeline(trace, dp_size=1)["totals_s"]["compute"] == pytest.approx(71e-6)


def test_memory_verdicts_flip():
    """Each verdict of labs/lab12_memory.py, fed both cases: every unit whole or a few; resharding
    after forward saving at least half a unit's gathered parameters, or less."""
    from labs.lab12_memory import StepMemory, reshard_verdict, whole_units_verdict

    def step(peak, whole, gathers):
        return StepMemory(peak, whole, 3, 1000, gathers, 3, 4, 2)

    assert whole_units_verdict(step(5000, 3, 11)).every_unit_whole
    assert not whole_units_verdict(step(5000, 2, 11)).every_unit_whole
    little = reshard_verdict(step(5000, 3, 11), step(5400, 3, 3))
    assert not little.saves_memory and little.extra_all_gathers == 8 and "saves no memory" in little.text
    much = reshard_verdict(step(5000, 2, 11), step(6000, 3, 3))
    assert much.saves_memory and much.saved_bytes == 1000 and "it saves memory" in much.text


def test_fsdp2_calls_against_zero3():
    """FSDP2's calls per step, per unit (root + blocks), under 1F1B and without a pipeline: 11
    all-gathers and 3 reduce-scatters on a stage of 2 blocks with 4 micro-batches (the planner's
    ZeRO-3 counts 3 calls per micro-batch, 12); 3 and 3 without resharding after forward."""
    from labs.lab12_plan import fsdp2_calls, one_f_one_b, planner_calls

    assert one_f_one_b(0, 2, 4) == ["F", "F", "B", "F", "B", "F", "B", "B"]
    assert one_f_one_b(1, 2, 4) == ["F", "B"] * 4 and one_f_one_b(0, 1, 1) == ["F", "B"]
    assert fsdp2_calls(one_f_one_b(0, 2, 4), 2) == {"all_gather": 11, "reduce_scatter": 3}
    assert fsdp2_calls(one_f_one_b(0, 2, 4), 2, reshard_after_forward=False) == {"all_gather": 3, "reduce_scatter": 3}
    assert fsdp2_calls(["F", "B"], 4, pipelined=False) == {"all_gather": 9, "reduce_scatter": 5}
    calls = planner_calls((2, 2, 2), 4, 4)
    assert calls["dp"] == 14 and calls["zero3"] == 12 and calls["pp"] == 8


# ======================================================================= the launch (restarts)
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lab12")
    res = launch_ranks(__file__, "worker", folder, nproc=NPROC, timeout=420, env={"DIST_TIMEOUT": "40"},
                       torchrun_args=["--max-restarts=1"])
    return res, folder


def test_rank_killed_and_group_restarted(run):
    """Rank 1 died by SIGKILL before step 3; torchrun started every rank again."""
    res, _ = run
    assert res[KILL_RANK]["killed_at_step"] == KILL_AT
    assert "exitcode: -9" in res.output or "Signals.SIGKILL" in res.output
    for rank, rep in res.items():
        assert rep["resume"]["attempt"] == 1, f"rank {rank} did not run a second attempt"
        assert rep["attempt0_pid"] != rep["attempt1_pid"]


def test_resumed_from_the_last_complete_checkpoint(run):
    """The restart loaded the checkpoint written after step 2, recomputed step 2 with the same loss."""
    res, folder = run
    last = KILL_AT // CKPT_EVERY * CKPT_EVERY
    for rank, rep in res.items():
        assert rep["attempt1_start"] == last, f"rank {rank} resumed at {rep['attempt1_start']}"
        first = dict(map(tuple, rep["attempt0_losses"]))
        second = dict(map(tuple, rep["attempt1_losses"]))
        assert second[last] == first[last], f"rank {rank}: step {last} gave another loss after the restart"
    found = sorted(p.name for p in (folder / "ft").iterdir())
    assert found == [f"step-{s:05d}" for s in range(CKPT_EVERY, STEPS + 1, CKPT_EVERY)]


def test_losses_continue_the_uninterrupted_run(run):
    """Every step's loss, before and after the restart, equals one uninterrupted process's."""
    res, _ = run
    reference = res[0]["resume"]["uninterrupted"]
    for rank, rep in res.items():
        losses = {**dict(map(tuple, rep["attempt0_losses"])), **dict(map(tuple, rep["attempt1_losses"]))}
        assert sorted(int(s) for s in losses) == list(range(STEPS))
        for step, loss in losses.items():
            assert loss == pytest.approx(reference[int(step)], rel=LOSS_RTOL), f"rank {rank}, step {step}"


def test_checkpoint_files_and_rank0_cost(run):
    """One .distcp file per rank plus .metadata; the metadata's tensors are the whole model's and AdamW's state."""
    res, _ = run
    ck = res[0]["resume"]["checkpoint"]
    assert sorted(ck["files"]) == [".metadata"] + [f"__{r}_0.distcp" for r in range(NPROC)]
    params = model_lab.parameter_count(config())
    tensors = len(list(model_lab.build_model(config()).parameters()))
    assert ck["full_state"]["model"] == 4 * params
    assert ck["full_state"]["optimizer"] == 8 * params + 4 * tensors   # exp_avg, exp_avg_sq, step
    assert sum(ck["payload"].values()) == ck["full_state"]["total"], "a piece written twice, or missing"
    for rank, rep in res.items():
        assert 0 < rep["resume"]["checkpoint"]["my_file_bytes"] < ck["full_state"]["total"]
        assert ck["payload"][f"__{rank}_0.distcp"] < ck["full_state"]["total"] / 2   # a shard, not the whole


def test_reloaded_on_another_mesh_and_in_one_process(run):
    """The checkpoint of the pipelined run, reloaded on a dp x tp mesh and in one process, gives the run's next losses."""
    res, _ = run
    for rank, rep in res.items():
        r = rep["resume"]["reshard"]
        for layout, losses in r["layouts"].items():
            assert losses == pytest.approx(r["expected"], rel=LOSS_RTOL), f"rank {rank}, {layout}"
    assert res[0]["resume"]["reshard"]["one process"] == pytest.approx(res[0]["resume"]["reshard"]["expected"], rel=LOSS_RTOL)


def test_composed_run_matches_one_process(run):
    """labs/lab12_train.py's run: losses and parameters within the tolerances of one process."""
    res, _ = run
    for rank, rep in res.items():
        t = rep["train"]
        assert t["max_loss_rel_diff"] < LOSS_RTOL and t["max_param_diff"] < PARAM_ATOL, rank
        assert len(t["losses"]) == 3 and t["held_out_curve"][0][1] > t["held_out_curve"][-1][1]
    assert res[0]["train"]["one_process_held_out"] == pytest.approx(
        res[0]["train"]["held_out_curve"][-1][1], rel=LOSS_RTOL)
    assert res[0]["train"]["sample"].startswith("def ")


def test_what_each_rank_holds(run):
    """Materialising takes less than the whole model; FSDP reduce-scatters this rank's tp shard of the gradients once a step."""
    res, _ = run
    cfg = config()
    for rank, rep in res.items():
        t = rep["train"]
        assert t["materialise"]["peak"] < t["model_bytes"] and t["materialise"]["held"] < t["model_bytes"] / 2
        assert t["held"]["gradients"] == t["held"]["parameters"] and t["held"]["optimizer state"] > t["held"]["parameters"]
        tp = GRID[2]
        tp_shard = sum(p.numel() if n.endswith("norm.weight") else p.numel() // tp
                       for n, p in model_lab.build_model(cfg).named_parameters())
        traffic = t["traffic"]
        assert traffic["dp"]["bytes"]["reduce_scatter"] == 4 * tp_shard, rank
        assert traffic["tp"]["calls"]["all_gather"] > 0 and "send" not in traffic.get("pp", {}).get("calls", {})
        assert t["activations"]["per_microbatch"] > 0 and t["activations"]["in_flight"] == 1
        # gradients are made during the step (zero_grad sets them to None): the peak holds them
        assert t["step_peak"] > t["held"]["gradients"] + t["activations"]["peak"], (rank, t["step_peak"])


def test_trace_and_timeline(run):
    """lab12_trace: a valid chrome trace per rank, DTensor's collectives labelled, a timeline whose parts add up, MFU between 0 and 1."""
    res, folder = run
    for rank, rep in res.items():
        tr = rep["trace"]
        trace = json.loads(Path(tr["trace"]).read_text())
        assert any(e.get("name", "").startswith("comm tp") for e in trace["traceEvents"])
        # DTensor's own reductions (the clip's norm on every rank, the loss's under loss_parallel on
        # the last stage) are labelled communication, not left inside compute
        assert any(e.get("name") == "comm tp all_reduce" for e in trace["traceEvents"]), rank
        line = tr["timeline"]
        assert sum(line["totals_s"].values()) == pytest.approx(line["span_s"], rel=1e-6)
        assert {"compute", "tp communication"} <= set(line["totals_s"])
        assert "pipeline idle" in line["totals_s"] or "pp communication" in line["totals_s"]
        assert 0 < tr["mfu"] < 1 and tr["tokens_per_s"] > 0 and not math.isnan(tr["step_s"])



def test_clipping_needs_the_global_norm(run):
    """lab12_clipping: clip_grad_norm_'s norm is one process's on every rank; the norm of a rank's own
    shards, or of its stage alone, is smaller and differs between ranks, and clipping with it moves
    the parameters away from one process and the tp copies of a norm weight away from each other."""
    from labs.lab12_clipping import OWN

    res, _ = run
    own = {rank: rep["clipping"]["norms"]["this rank's shards"] for rank, rep in res.items()}
    for rank, rep in res.items():
        c = rep["clipping"]
        true = c["one_process"]["norm"]
        assert c["norms"]["global (clip_grad_norm_)"] == pytest.approx(true, rel=1e-4), f"rank {rank}"
        assert own[rank] < true and c["norms"]["this stage"] < true, f"rank {rank}: {c['norms']} vs {true}"
        assert c["true_coefficient"] < 1, "max_norm must be small enough to clip, or the lesson is moot"
        right, wrong = c["runs"]["global norm"], c["runs"][OWN]
        assert right["max_param_diff"] < PARAM_ATOL and right["tp_replica_spread"] == 0.0, f"rank {rank}: {right}"
        assert wrong["max_param_diff"] > 10 * max(right["max_param_diff"], 1e-7), f"rank {rank}: {wrong} vs {right}"
    assert len({round(v, 6) for v in own.values()}) > 1, f"every rank's own norm is the same: {own}"
    assert max(rep["clipping"]["runs"][OWN]["tp_replica_spread"] for rep in res.values()) > 0, \
        "clipping with each rank's own norm left the tp copies of the norm weights equal"

def test_pipelining_keeps_every_fsdp_unit_whole(run):
    """With a pipeline (pp 2 x dp 2) every FSDP unit of a stage is whole at once during a step; on the
    same ranks without one (dp 4), at most two at a time."""
    from labs.lab12_memory import StepMemory, whole_units_verdict

    res, _ = run
    for rank, rep in res.items():
        piped = StepMemory(**rep["memory"]["pipelined"]["default"])
        plain = StepMemory(**rep["memory"]["no pipeline"]["default"])
        assert whole_units_verdict(piped).every_unit_whole, (rank, piped)
        assert not whole_units_verdict(plain).every_unit_whole and plain.most_whole_units <= 2, (rank, plain)


def test_fsdp2_calls_per_unit_as_measured(run):
    """FSDP2's all-gathers and reduce-scatters on dp in one step, counted by the traffic meter, are
    fsdp2_calls' per-unit count (1F1B's order, each setting of reshard_after_forward), not the
    planner's ZeRO-3 count per micro-batch."""
    from labs.lab12_memory import StepMemory, reshard_verdict
    from labs.lab12_plan import fsdp2_calls, one_f_one_b

    res, _ = run
    blocks = CONFIG["layers"]
    for rank, rep in res.items():
        m = rep["memory"]
        stage = m["pipelined"]["coordinate"]["pp"]
        for setting, reshard in (("default", True), ("reshard_after_forward=False", False)):
            got = StepMemory(**m["pipelined"][setting])
            want = fsdp2_calls(one_f_one_b(stage, 2, got.microbatches), blocks // 2, reshard)
            assert (got.all_gathers, got.reduce_scatters) == (want["all_gather"], want["reduce_scatter"]), (rank, setting, got)
        plain = StepMemory(**m["no pipeline"]["default"])
        want = fsdp2_calls(one_f_one_b(0, 1, 1), blocks, pipelined=False)
        assert (plain.all_gathers, plain.reduce_scatters) == (want["all_gather"], want["reduce_scatter"]), (rank, plain)
        verdict = reshard_verdict(StepMemory(**m["pipelined"]["default"]), StepMemory(**m["pipelined"]["reshard_after_forward=False"]))
        assert verdict.extra_all_gathers > 0, verdict


# ======================= notebook 12's verdicts (labs/lab12_report.py, labs/lab12_time_report.py)
# Each is fed both cases here, in this process; test_report_reads_what_the_labs_report feeds them
# this launch's reports, so a renamed field fails in seconds, not minutes into nbmake.
def trained(loss=1e-6, param=1e-6, peak=10, whole=100, curve=((0, 5.0), (3, 4.0))):
    return {"max_loss_rel_diff": loss, "max_param_diff": param, "reference_losses": [5.0, 4.9],
            "materialise": {"peak": peak, "held": 5}, "model_bytes": whole, "held_out_curve": [list(c) for c in curve],
            "coordinate": {"pp": 0, "dp": 0, "tp": 0},
            "held": {"parameters": 4, "gradients": 4, "optimizer state": 8, "total": 16},
            "activations": {"peak": 8, "in_flight": 1}, "step_peak": 40,
            "traffic": {"tp": {"calls": {"all_gather": 9}, "bytes": {"all_gather": 10}, "sent_bytes": 5.0},
                        "dp": {"calls": {"reduce_scatter": 3}, "bytes": {"reduce_scatter": 100}, "sent_bytes": 50.0}}}


def test_report_verdicts_flip():
    from labs import lab12_report as report
    from labs import lab12_time_report as time_report

    assert report.agreement({0: trained()}, 1e-4, 1e-4).within
    bad = report.agreement({0: trained(), 1: trained(param=1e-3)}, 1e-4, 1e-4)
    assert not bad.within and "NOT within" in bad.text
    assert report.held_out([[0, 5.0], [3, 4.0]], 3).fell and not report.held_out([[0, 4.0], [3, 4.5]], 3).fell
    assert report.materialise({0: trained()}).never_whole and not report.materialise({0: trained(peak=100)}).never_whole
    t = report.traffic({0: trained()})
    assert (t.most_calls, t.most_bytes) == ("tp", "dp") and len(t.rows) == 2
    assert "less than was kept" in report.activation_ratio_text({0: 0.5}) and "more than was kept" in \
        report.activation_ratio_text({1: 1.5}) and "within 5%" in report.activation_ratio_text({0: 1.01})
    line = {"span_s": 1.0, "steps": 1, "totals_s": {"compute": 0.7, "pipeline idle": 0.3}, "matmul_s": 0.2}
    assert time_report.matmul_share(line).mostly_other and not time_report.matmul_share({**line, "matmul_s": 0.6}).mostly_other
    assert time_report.bubble(0.1, line, 1.0, [1.0, 1.05]).verdict == "larger"
    assert time_report.bubble(0.5, line, 1.0, [1.0, 1.05]).verdict == "smaller"
    assert time_report.bubble(0.28, line, 1.0, [1.0, 1.05]).verdict == "noise"


def clipped(own, truth=2.0, spread=0.0, wrong=1e-2):
    return {"coordinate": {"pp": 0}, "norms": {"this rank's shards": own, "this stage": own, "global (clip_grad_norm_)": truth},
            "one_process": {"norm": truth}, "coefficients": {"this rank's shards": 1.0}, "true_coefficient": 0.5,
            "runs": {"global norm": {"max_param_diff": 1e-7, "tp_replica_spread": 0.0},
                     "this rank's norm": {"max_param_diff": wrong, "tp_replica_spread": spread}}}


def test_report_clipping_checkpoint_restart_flip():
    from labs import lab12_report as report

    assert report.clip_norms({0: clipped(1.0), 1: clipped(1.5)}, "this rank's shards", False).all_below
    assert not report.clip_norms({0: clipped(1.0), 1: clipped(2.5)}, "this rank's shards", False).all_below
    assert "silently diverge" in report.clip_runs({0: clipped(1.0, spread=1e-3)}, "this rank's norm", 2).text
    assert "no copies" in report.clip_runs({0: clipped(1.0)}, "this rank's norm", 1).text
    ck = {"files": {".metadata": 1, "__0_0.distcp": 5}, "payload": {"__0_0.distcp": 4, "__1_0.distcp": 4},
          "full_state": {"total": 8, "model": 4, "optimizer": 4}, "my_file_bytes": 5}
    assert report.checkpoint({0: {"checkpoint": ck}, 1: {"checkpoint": ck}}, 2).once
    assert not report.checkpoint({0: {"checkpoint": {**ck, "full_state": {**ck["full_state"], "total": 9}}}}, 2).once
    rep = {"attempt": 1, "resumed_from": 2, "uninterrupted": [3.0, 2.0, 1.0]}
    r0 = {"attempt0_losses": [[0, 3.0], [1, 2.0], [2, 1.0]], "attempt1_losses": [[2, 1.0]]}
    assert report.restart(r0, rep, 1e-4).same_losses
    assert not report.restart({**r0, "attempt1_losses": [[2, 1.1]]}, rep, 1e-4).same_losses
    assert not report.restart(r0, {**rep, "attempt": 0}, 1e-4).restarted
    loaded = {"shape": [2, 1, 2], "reshard": {"step": 4, "expected": [1.0], "layouts": {"1 x 2 x 2": [1.0]},
                                              "one process": [1.0], "max_rel_diff": 0.0}}
    assert report.reshard(loaded, 1e-4).same
    assert not report.reshard({**loaded, "reshard": {**loaded["reshard"], "max_rel_diff": 1e-2}}, 1e-4).same


def test_report_planner_and_cpu_flip():
    from labs import lab12_time_report as time_report
    from labs.lab12_plan import StepMeasurement

    cpu = {"composed step": {"wall": 1.0, "process_cpu": 0.9, "thread_cpu": 0.5},
           "dense step": {"wall": 0.1, "process_cpu": 0.1, "thread_cpu": 0.05}}
    step = StepMeasurement(microbatches=4, step_seconds=[1.0, 1.1], step_s=1.0, traffic={}, calls={"tp": 36, "dp": 15},
                           planner_calls={"tp": 36, "dp": 14, "zero3": 12}, ops=1000, dtensor_ops=400, dense_ops=100,
                           dispatch_s={"plain": 1e-6, "DTensor": 5e-5}, cpu=cpu)
    prediction = {"step_s": 0.5, "time": {"compute": 0.2, "tp_comm": 0.1, "dp_comm": 0.05, "dp_comm_zero3": 0.06,
                                          "pp_comm": 0.05, "bubble": 0.1}}
    line = {"span_s": 2.0, "steps": 1, "totals_s": {"compute": 1.4, "tp communication": 0.4, "pipeline idle": 0.2},
            "matmul_s": 0.1}
    longer = time_report.planner_vs_trace(asdict(step), prediction, line, 1e-3)
    assert longer.gap_ms == 500 and longer.biggest == "compute" and "longer" in longer.text
    assert "FSDP2's 14 calls" in longer.text and "ZeRO-3 term counts 12" in longer.text and "+1:" in longer.text
    shorter = time_report.planner_vs_trace(asdict(step), {**prediction, "step_s": 2.0}, line, 1e-3)
    assert "shorter" in shorter.text
    one_replica = asdict(step) | {"planner_calls": {"tp": 36, "dp": 0, "zero3": 0}, "calls": {"tp": 36}}
    assert "ZeRO-3" not in time_report.planner_vs_trace(one_replica, prediction, line, 1e-3).text    # no dp: nothing to say
    machine = {"compute": {"flops": 1e6}}
    busy = time_report.cpu_work({0: asdict(step), 1: asdict(step)}, prediction, machine, 1e9, line, 2, 2)
    assert busy.cpu_bound and busy.busy == 0.9
    idle = time_report.cpu_work({0: asdict(step)}, prediction, machine, 1e9, line, 2, 4)
    assert not idle.cpu_bound


def test_report_reads_what_the_labs_report(run):
    """Every summary of labs/lab12_report.py and lab12_time_report.py computed from this launch's own reports."""
    from labs import lab12_report as report
    from labs import lab12_time_report as time_report
    from labs.lab12_clipping import OWN
    from labs.lab12_plan import plan_lab12

    res, _ = run
    train = {rank: rep["train"] for rank, rep in res.items()}
    assert report.agreement(train, LOSS_RTOL, PARAM_ATOL).within
    assert report.held_out(train[0]["held_out_curve"], 3).fell and report.materialise(train).never_whole
    assert len(report.held_rows(train)) == NPROC and report.traffic(train).most_calls == "tp"
    import labs.lab09_planner as pl

    plan = plan_lab12(config(), GRID, train[0]["microbatches"], pl.A100_SELENE)
    assert len(report.memory_vs_planner(train, plan, GRID[0]).rows) == 4
    clips = {rank: rep["clipping"] for rank, rep in res.items()}
    assert report.clip_norms(clips, "this rank's shards", False).all_below and report.clip_runs(clips, OWN, 2).wrong > 0
    resumed = {rank: rep["resume"] for rank, rep in res.items()}
    assert report.checkpoint(resumed, NPROC).once
    assert report.restart(res[0], resumed[0], LOSS_RTOL).same_losses and report.reshard(resumed[0], LOSS_RTOL).same
    assert 0 < time_report.matmul_share(res[0]["trace"]["timeline"]).share < 1
    assert len(time_report.timeline_shares({rank: rep["trace"] for rank, rep in res.items()})) == NPROC
    study = report.memory_study(res[0]["memory"])
    assert study.pipelined.every_unit_whole and not study.no_pipeline.every_unit_whole and len(study.rows) == 3


# ---------------------------------------------------------------------------------------- worker
def worker(folder: Path) -> None:
    from helpers.dist import distributed
    from labs import lab12_resume as resume
    from labs import lab12_clipping, lab12_memory, lab12_trace, lab12_train

    cfg = config()
    with distributed() as ctx:
        args = argparse.Namespace(steps=STEPS, ckpt_every=CKPT_EVERY, kill_rank=KILL_RANK, kill_at_step=KILL_AT,
                                  layouts=",".join(map(str, GRID)))
        report = {"resume": resume.lab(ctx, args, folder / "ft", cfg)}    # what notebook 12's second launch reports
        train = lab12_train.run(ctx, steps=3, check_steps=2, eval_every=2, shape=GRID, config=cfg,
                                ckpt_dir=folder / "train", sample_bytes=12, eval_batches=2)
        train.pop("stage_params", None)
        report["train"] = train
        report["trace"] = lab12_trace.run(ctx, config=cfg, shape=PIPELINE, warmup=1, timed=1, profiled=1,
                                          trace_dir=folder / "trace", peak_window_s=0.1)
        report["trace"]["timeline"].pop("intervals")
        report["clipping"] = lab12_clipping.run(ctx, config=cfg, shape=PIPELINE, steps=3)
        report["memory"] = lab12_memory.run(ctx, config=cfg)
        ctx.report(**report)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(Path(sys.argv[2]))
