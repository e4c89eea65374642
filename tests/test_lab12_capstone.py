"""Tests of lab 12 beyond the exercises: the model and its data, initialisation by name, the
pipeline split, the FLOP count, the timeline parser (in this process), and the labs' runs end to
end in one launch on 4 ranks:

- labs/lab12_resume.py: a rank SIGKILLs itself mid-run, torchrun (--max-restarts=1) restarts
  the group, training resumes from the last DCP checkpoint, recomputes the lost steps with the same
  losses and continues those of an uninterrupted run (one process); the checkpoint is reloaded on
  another mesh and in one process, whose next losses equal the run's;
- labs/lab12_train.py: the composed run against one process, what each rank holds and sends, the
  held-out loss, a sample from one process that loaded the final checkpoint;
- labs/lab12_trace.py: the profiler trace and its timeline, tokens/s, MFU.

The launch restarts, so its ranks start fresh (torchrun's default) in both attempts; this file is
its worker. Everything runs on the instructor's solutions (the exercises are used throughout).

Run:  .venv/bin/python -m pytest tests/test_lab12_capstone.py -q
"""
from __future__ import annotations

import json
import math
import sys
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
        assert rep["attempt"] == 1, f"rank {rank} did not run a second attempt"
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
    reference = res[0]["uninterrupted"]
    for rank, rep in res.items():
        losses = {**dict(map(tuple, rep["attempt0_losses"])), **dict(map(tuple, rep["attempt1_losses"]))}
        assert sorted(int(s) for s in losses) == list(range(STEPS))
        for step, loss in losses.items():
            assert loss == pytest.approx(reference[int(step)], rel=LOSS_RTOL), f"rank {rank}, step {step}"


def test_checkpoint_files_and_rank0_cost(run):
    """One .distcp file per rank plus .metadata; the metadata's tensors are the whole model's and AdamW's state."""
    res, _ = run
    ck = res[0]["checkpoint"]
    assert sorted(ck["files"]) == [".metadata"] + [f"__{r}_0.distcp" for r in range(NPROC)]
    params = model_lab.parameter_count(config())
    tensors = len(list(model_lab.build_model(config()).parameters()))
    assert ck["full_state"]["model"] == 4 * params
    assert ck["full_state"]["optimizer"] == 8 * params + 4 * tensors   # exp_avg, exp_avg_sq, step
    assert sum(ck["payload"].values()) == ck["full_state"]["total"], "a piece written twice, or missing"
    for rank, rep in res.items():
        assert 0 < rep["checkpoint"]["my_file_bytes"] < ck["full_state"]["total"]
        assert ck["payload"][f"__{rank}_0.distcp"] < ck["full_state"]["total"] / 2   # a shard, not the whole


def test_reloaded_on_another_mesh_and_in_one_process(run):
    """The checkpoint of the pipelined run, reloaded on a dp x tp mesh and in one process, gives the run's next losses."""
    res, _ = run
    for rank, rep in res.items():
        r = rep["reshard"]
        for layout, losses in r["layouts"].items():
            assert losses == pytest.approx(r["expected"], rel=LOSS_RTOL), f"rank {rank}, {layout}"
    assert res[0]["reshard"]["one process"] == pytest.approx(res[0]["reshard"]["expected"], rel=LOSS_RTOL)


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


def test_trace_and_timeline(run):
    """lab12_trace: a valid chrome trace per rank, a timeline whose parts add up, MFU between 0 and 1."""
    res, folder = run
    for rank, rep in res.items():
        tr = rep["trace"]
        trace = json.loads(Path(tr["trace"]).read_text())
        assert any(e.get("name", "").startswith("comm tp") for e in trace["traceEvents"])
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

# ---------------------------------------------------------------------------------------- worker
def worker(folder: Path) -> None:
    from helpers.dist import distributed
    from labs import lab12_checkpoint as ck, lab12_resume as resume
    from labs import lab12_clipping, lab12_trace, lab12_train

    cfg = config()
    with distributed() as ctx:
        result = resume.train_with_restarts(ctx, cfg, PIPELINE, STEPS, CKPT_EVERY, folder / "ft", KILL_RANK, KILL_AT)
        trainer = result.pop("trainer")
        report = {"attempt": result["attempt"],
                  "checkpoint": ck.checkpoint_report(ck.latest(folder / "ft")[1], ctx, trainer)}
        del trainer
        report["reshard"] = resume.reshard_check(ctx, cfg, folder / "ft", 4, result["losses"], [GRID])
        train = lab12_train.run(ctx, steps=3, check_steps=2, eval_every=2, shape=GRID, config=cfg,
                                ckpt_dir=folder / "train", sample_bytes=12, eval_batches=2)
        train.pop("stage_params", None)
        report["train"] = train
        report["trace"] = lab12_trace.run(ctx, config=cfg, shape=PIPELINE, warmup=1, timed=1, profiled=1,
                                          trace_dir=folder / "trace", peak_window_s=0.1)
        report["trace"]["timeline"].pop("intervals")
        report["clipping"] = lab12_clipping.run(ctx, config=cfg, shape=PIPELINE, steps=3)
        if ctx.rank == 0:
            report["uninterrupted"] = model_lab.train_reference(cfg, STEPS, model_lab.split(model_lab.corpus())[0])["losses"]
        ctx.report(**report)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(Path(sys.argv[2]))
