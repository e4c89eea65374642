"""Tests of lab 03's non-exercise parts: every method against one process, torch DDP's bucket rule,
the benchmark and its alpha-beta model, the training-script practicalities (sampler, padding,
checkpoint, logging, no_sync, learning-rate scaling, memory) and the equivalence caveats.

One 2-rank launch runs `run(ctx)` of labs/lab03_equivalence.py, lab03_ddp.py, lab03_ddp_bench.py,
lab03_training.py and lab03_caveats.py in smoke mode; the tests assert on what they reported.
BucketedDDP (homework) is tested in tests/public and tests/hidden; here its rows are checked only
when present. Tolerance against one process on the global batch: atol 1e-6 (float32, a few steps).
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.harness import DEFAULT_TIMEOUT_S, launch_ranks

ATOL = 1e-6
LABS = ("lab03_equivalence", "lab03_ddp", "lab03_ddp_bench", "lab03_training", "lab03_caveats")
MiB = 2**20


@pytest.fixture(scope="module")
def labs_run():
    return launch_ranks(__file__, *LABS, nproc=2, env={"COURSE_SMOKE": "1"})


def _rows(labs_run, rank=0):
    return labs_run[rank]["lab03_equivalence"]["compare"]


# --- in-process -------------------------------------------------------------------------------

def test_sampler_shards_are_disjoint_and_set_epoch_reshuffles():
    from labs.lab03_training import sampler_orders, shards_disjoint_and_complete

    with_epoch = sampler_orders(12, 3, epochs=3, set_epoch=True)
    without = sampler_orders(12, 3, epochs=3, set_epoch=False)
    assert all(shards_disjoint_and_complete(epoch, 12) for epoch in with_epoch)
    assert with_epoch[0] == without[0]                     # epoch 0 is seeded the same way
    assert without[0] == without[1] == without[2]          # forgetting set_epoch repeats the order
    assert with_epoch[0] != with_epoch[1] != with_epoch[2]
    assert not shards_disjoint_and_complete([[0, 1], [1, 2]], 3)


@pytest.mark.parametrize("size,world", [(10, 4), (7, 3), (13, 2)])
def test_sampler_padding_repeats_the_first_shuffled_indices_round_robin(size, world):
    from labs.lab03_training import padding

    pad = padding(size, world)
    total = math.ceil(size / world) * world
    assert pad["appended"] == pad["shuffled"][:total - size]
    padded = pad["shuffled"] + pad["appended"]
    for rank, shard in enumerate(pad["shards"]):
        assert shard == padded[rank::world], f"rank {rank}: not dealt round-robin"
    trimmed = pad["shuffled"][:size // world * world]
    assert [i for s in pad["shards_drop_last"] for i in s] != [] and \
        sorted(i for s in pad["shards_drop_last"] for i in s) == sorted(trimmed)
    assert pad["dropped"] == sorted(set(range(size)) - set(trimmed))


def test_padding_double_counts_in_evaluation():
    from labs.lab03_training import padded_accuracy

    ev = padded_accuracy([i % 3 != 0 for i in range(10)], 4)
    assert ev["counted"] == 12 and ev["accuracy_true"] == pytest.approx(0.6)
    assert ev["accuracy_counted"] != pytest.approx(ev["accuracy_true"])


def test_checkpoint_save_is_atomic(tmp_path):
    from labs.lab03_training import load_checkpoint, save_checkpoint

    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"step": 1, "w": torch.ones(3)}, rank=0)
    with pytest.raises(Exception):  # a save that fails half-way (unpicklable object)...
        save_checkpoint(path, {"step": 2, "w": torch.zeros(3), "bad": lambda: None}, rank=0)
    state = load_checkpoint(path, torch.device("cpu"))  # ...leaves the previous file intact
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # and no temporary file behind
    save_checkpoint(path, {"step": 3}, rank=1)  # only rank 0 writes
    assert load_checkpoint(path, torch.device("cpu"))["step"] == 1


def test_linear_scaling_rule_recovers_the_small_batch_loss():
    from labs.lab03_training import lr_scaling

    rows = lr_scaling(batch_sizes=(8, 64), samples=1024)
    base, same_lr, scaled = rows
    assert same_lr["optimizer steps"] * 8 == base["optimizer steps"]
    assert same_lr["final loss"] > 10 * base["final loss"], "8x the batch at the same rate should lag"
    assert scaled["lr"] == pytest.approx(8 * base["lr"])
    assert scaled["final loss"] < 3 * base["final loss"]


def test_alpha_beta_tail_model():
    from labs.lab03_ddp_bench import best_bucket, serial_tail, uniform_tail

    # one link, 1 ms per call + 1 ms per MB: buckets ready every 10 ms keep up, the tail is one call
    assert serial_tail([0.01, 0.02, 0.03], [1e6] * 3, 1e-3, 1e9) == pytest.approx(0.002)
    # all ready at once: the calls queue up
    assert serial_tail([0.03] * 3, [1e6] * 3, 1e-3, 1e9) == pytest.approx(0.006)
    s, T, alpha, w = 8 * MiB, 0.05, 1e-3, 1e9
    for b in (256 * 1024, MiB, 4 * MiB):
        n, c = s // b, alpha + b / w
        assert uniform_tail(s, T, b, alpha, w) == pytest.approx(max(c, T / n + n * c - T))
    for T, alpha in ((0.05, 1e-3), (0.005, 1e-4), (0.05, 0.02)):  # n* = max((T - s/w)/a, sqrt(T/a))
        b_star = s / max((T - s / w) / alpha, math.sqrt(T / alpha), 1)
        best, tail = best_bucket(s, T, alpha, w)
        assert 0.5 * b_star <= best <= 2 * b_star, f"T {T}, alpha {alpha}: best {best}, b* {b_star:.0f}"
        assert tail <= uniform_tail(s, T, s, alpha, w) and tail <= uniform_tail(s, T, 1024, alpha, w)


# --- the 2-rank launch -------------------------------------------------------------------------

def test_losses_differ_but_gradients_and_parameters_agree(labs_run):
    for method in ("naive", "flat", "overlapped", "torch_ddp"):
        r0, r1 = _rows(labs_run, 0)[method], _rows(labs_run, 1)[method]
        assert r0["losses"] != r1["losses"], f"{method}: each rank should see its own shard"
        for row in (r0, r1):
            assert row["grad_spread_over_ranks"] == 0.0 and row["param_spread_over_ranks"] == 0.0
            assert row["max_grad_diff_vs_reference"] <= ATOL
            assert row["max_param_diff_vs_reference"] <= ATOL
    bucketed = _rows(labs_run)["bucketed"]
    if "unsolved" not in bucketed:
        assert bucketed["max_param_diff_vs_reference"] <= ATOL


def test_collective_counts_of_each_method(labs_run):
    rows = _rows(labs_run)
    n = rows["naive"]["num_params"]
    assert set(rows["naive"]["collectives_per_step"]) == {n}
    assert set(rows["flat"]["collectives_per_step"]) == {1}
    assert set(rows["overlapped"]["collectives_per_step"]) == {n}
    assert set(rows["naive"]["launched_in_backward_per_step"]) == {0}
    assert set(rows["overlapped"]["launched_in_backward_per_step"]) == {n}
    torch_ddp = rows["torch_ddp"]["collectives_per_step"]
    assert torch_ddp[0] == 1, "torch DDP's first step puts every gradient in one bucket"
    assert all(c > 1 for c in torch_ddp[1:]), "later steps use the rebuilt, capped buckets"
    sent = {row["bytes_per_step"] for row in rows.values() if "unsolved" not in row}
    assert len(sent) == 1  # same bytes, different packing


def test_torch_ddp_bucket_rule(labs_run):
    rule = labs_run[0]["lab03_ddp"]["bucket_rule"]
    per = rule["buckets_per_step"]
    total, cap = rule["model_bytes"], rule["small_cap_mb"] * MiB
    default = per["torch DDP, bucket_cap_mb=None (its default)"]
    assert total > MiB, "the rule needs a model above 1 MiB to show the small first bucket"
    assert default[0] == [pytest.approx(total, rel=0.01)], "first step: one bucket"
    assert len(default[1]) == 2 and default[1][0] <= 1.3 * MiB, \
        f"later steps with bucket_cap_mb=None: a ~1 MiB first bucket, then 25 MiB ones; got {default[1]}"
    explicit = per["torch DDP, bucket_cap_mb=25"]
    assert explicit[1] == [pytest.approx(total, rel=0.01)], "bucket_cap_mb=25 given: no small first bucket"
    small = per[f"torch DDP, bucket_cap_mb={rule['small_cap_mb']:g}"]
    assert len(small[0]) == 1 and len(small[1]) > 1 and small[1] == small[2]
    unused = per[f"torch DDP, bucket_cap_mb={rule['small_cap_mb']:g}, find_unused_parameters=True"]
    assert len(unused[0]) > 1, "with find_unused_parameters=True buckets exist from the first step"
    ours = per[f"BucketedDDP, bucket_cap_mb={rule['small_cap_mb']:g}"]
    if "unsolved" not in ours:
        assert all(b <= cap for b in ours[0]) and sum(ours[0]) == sum(small[1])


def test_benchmark_has_several_buckets_and_a_timeline(labs_run):
    res = labs_run[0]["lab03_ddp_bench"]
    rows = {row["method"]: row for row in res["bench"]}
    depth = res["bench_config"]["depth"]
    assert rows["naive"]["buckets/step"] == 2 * depth      # a weight and a bias per layer
    assert rows["flat"]["buckets/step"] == 1
    assert rows["overlapped"]["launched in backward"] == 2 * depth
    for cap in res["bench_config"]["caps_mb"]:
        assert rows[f"torch DDP {cap:g} MiB"]["buckets/step"] > 1, "the caps must give several buckets"
        assert rows[f"torch DDP {cap:g} MiB"]["launched in backward"] >= 1
        assert cap * MiB >= res["bench_config"]["layer_bytes"], \
            f"cap {cap:g} MiB is below one layer: one bucket per parameter, the overlapped method"
        for method in ("torch DDP", "BucketedDDP"):
            row = rows[f"{method} {cap:g} MiB"]
            if "unsolved" not in row:
                assert row["params/bucket"] >= 2, f"{method} at {cap:g} MiB: buckets of one parameter"
    measured = [row for row in rows.values() if "unsolved" not in row]
    assert len({round(row["MB/step"], 9) for row in measured}) == 1
    for row in measured:
        assert row["step ms"] > 0 and row["tail ms"] >= 0 and row["predicted tail ms"] >= 0
        timeline = row["timeline"]
        assert len(timeline["buckets"]) == row["buckets/step"]
        assert len(timeline["ready_ms"]) == 2 * depth
        assert all(b["finish_ms"] >= b["launch_ms"] for b in timeline["buckets"])
    model = res["alpha_beta"]
    assert model["latency_s"] > 0 and model["bandwidth_Bps"] > 0 and model["backward_s"] > 0
    assert 1024 <= model["best_bucket_bytes"] <= res["bench_config"]["total_bytes"]


def test_sampler_and_checkpoint_and_logging(labs_run):
    for rank, res in labs_run.items():
        res = res["lab03_training"]
        sampler = res["sampler"]
        assert all(sampler["disjoint"])
        orders = sampler["without_set_epoch"]
        assert orders[0] == orders[1] == orders[2]
        ckpt = res["checkpoint"]
        assert ckpt["files_after_save"] == ["checkpoint.pt"]
        assert ckpt["loaded_step"] == 3 and ckpt["loaded_device"] == "cpu"
        assert ckpt["max_param_diff_after_load"] == 0.0 and ckpt["max_momentum_diff_after_load"] == 0.0
        assert all(k.startswith("module.") for k in ckpt["ddp_state_dict_keys"])
        assert not any(k.startswith("module.") for k in ckpt["module_state_dict_keys"])
        assert "Missing key" in ckpt["wrapper_load_error"]
    losses0, losses1 = (labs_run[r]["lab03_training"]["checkpoint"]["losses"] for r in (0, 1))
    for a, b in zip(losses0, losses1):
        assert a["mean_over_ranks"] == pytest.approx(b["mean_over_ranks"], rel=1e-6)
        assert a["mean_over_ranks"] == pytest.approx((a["rank_loss"] + b["rank_loss"]) / 2, rel=1e-5)


def test_no_sync_accumulation_equals_big_batch(labs_run):
    for rank, res in labs_run.items():
        acc = res["lab03_training"]["accumulation"]
        assert acc["global_batch"] == 4 * 4 * 2
        for case in ("sync every micro-batch", "no_sync, forward inside", "no_sync, forward outside"):
            assert acc[case]["max_grad_diff_vs_big_batch"] <= ATOL, case
        assert acc["no_sync, forward inside"]["collectives"] * 4 == acc["sync every micro-batch"]["collectives"]
        assert acc["no_sync, forward outside"]["collectives"] == acc["sync every micro-batch"]["collectives"], \
            "a forward outside no_sync() still makes DDP all-reduce"


def test_every_rank_holds_the_whole_training_state(labs_run):
    mems = [res["lab03_training"]["memory"] for res in labs_run.values()]
    assert all(m == mems[0] for m in mems)
    m = mems[0]
    assert m["gradients"] == m["parameters"]
    assert 2 * m["parameters"] <= m["optimizer state"] <= 2 * m["parameters"] + 8 * 16  # + AdamW's step counts


def test_caveats(labs_run):
    cav = labs_run[0]["lab03_caveats"]["caveats"]
    bn = cav["batchnorm"]
    assert bn["grad_diff"]["BatchNorm1d"] > 1e-3, "local batch statistics should change the gradient"
    assert bn["grad_diff"]["CrossRankBatchNorm"] <= 1e-5
    assert bn["sync=True"]["running_mean_spread_over_ranks"] == 0.0
    assert bn["sync=False"]["running_mean_spread_over_ranks"] > 0.0
    assert bn["sync=True"]["running_mean_diff_vs_one_process"] > 1e-4
    assert cav["dropout"]["same seed on every rank"] == 1.0
    assert 0.3 < cav["dropout"]["seed + rank"] < 0.7
    assert cav["token_loss"]["mean over this rank's tokens"] > 1e-3
    assert cav["token_loss"]["sum / global token count"] <= 1e-5
    assert cav["unused"]["find_unused_parameters=False"].startswith("Expected to have finished reduction")
    assert cav["unused"]["find_unused_parameters=True"] == "2 steps done"
    joins = {r: res["lab03_caveats"]["caveats"]["join"] for r, res in labs_run.items()}
    assert joins[0]["batches"] == joins[1]["batches"] + 1
    assert joins[0]["averaged_grads"][-1] == pytest.approx(joins[0]["own_grads"][-1] / 2), \
        "under Join the finished rank contributes zeros"
    assert joins[0]["param_spread_over_ranks"] == 0.0


# --- runs that end cleanly ----------------------------------------------------------------------
EXIT_RUNS = 1  # fresh ranks: forked ranks skip the interpreter's exit, where it aborted (its checks
#               are of threads and groups, not of chance: one run sees them)


def test_bucketed_ddp_runs_end_cleanly():
    """The issue's run (2 ranks, BucketedDDP with 0.0016 MiB buckets, 5 steps, then the end every
    lab has) exits with code 0, each time, on fresh ranks; it leaves no gloo thread behind the
    teardown (the group it served would otherwise be torn down during the interpreter's exit,
    which aborted about 1 exit in 6 with "terminate called without an active exception"), and
    torch.distributed.nn's defaults hold no group. The check sees a group that outlives its
    destruction: rank 0 holds one through the teardown and reports its threads."""
    from helpers.launch import launch
    from helpers.notice import Unsolved, stub_message
    from labs.lab03_ddp import BucketedDDP

    if stub_message(BucketedDDP):
        raise Unsolved(stub_message(BucketedDDP))
    for attempt in range(EXIT_RUNS):
        res = launch("tests/scripts/ddp_exit.py", nproc=2, timeout=DEFAULT_TIMEOUT_S, stream=False,
                     fork_ranks=False)
        assert res.returncode == 0, f"run {attempt}: exit code {res.returncode}\n{res.output[-2000:]}"
        for rank, report in res.results.items():
            assert report["late_defaults"] == [], (
                f"rank {rank}: torch.distributed.nn's {report['late_defaults']} hold the default group "
                "(imported after init_process_group): destroy_process_group cannot free it")
            assert report["gloo_threads_after"] == [], (
                f"rank {rank}: gloo threads {report['gloo_threads_after']} outlived the groups' "
                "destruction: they run on into the interpreter's exit")
        assert res.results[0]["held_gloo_threads"] and not res.results[1]["held_gloo_threads"], \
            "a group held past its destruction keeps its threads: the check must see them"


if __name__ == "__main__":
    import importlib
    import sys

    from helpers.dist import distributed
    from helpers.runs import run_lab

    with distributed() as ctx:
        for name in sys.argv[1:]:
            ctx.report(**{name: run_lab(importlib.import_module(f"labs.{name}"), ctx, "smoke")})
        ctx.report(done=True)


def test_step_ratio_calls_overlapping_quartiles_noise():
    from labs.lab03_ddp_bench import step_ratio, summary_lines
    row = lambda q1, med, q3, **kw: {"step ms q1": q1, "step ms": med, "step ms q3": q3, **kw}  # noqa: E731
    assert step_ratio(row(8, 9, 10), row(12, 13, 14)).endswith("faster")
    assert step_ratio(row(12, 13, 14), row(8, 9, 10)).endswith("slower")
    assert "within this run's noise" in step_ratio(row(8, 11, 13), row(10, 12, 14))
    rows = [row(8, 9, 10, method=m, **{"buckets/step": n, "params/bucket": 2}) for m, n in
            [("naive", 8), ("flat", 1), ("overlapped", 8), ("torch DDP 1 MiB", 3), ("BucketedDDP 1 MiB", 3)]]
    lines = summary_lines(rows, {"caps_mb": [1.0], "layer_bytes": 4096})
    assert lines[0].startswith("flat / naive step time:") and "8 messages -> 1" in lines[0]
    assert lines[-1].startswith("BucketedDDP / torch DDP at 1 MiB: 1.00x, within")


def test_benchmark_reports_quartiles(labs_run):
    for row in labs_run[0]["lab03_ddp_bench"]["bench"]:
        if "unsolved" not in row:
            assert row["step ms q1"] <= row["step ms"] <= row["step ms q3"], row["method"]


def test_notebook_verdicts_flip():
    from labs.lab03_ddp import cap_verdict
    from labs.lab03_equivalence import naive_verdict
    from labs.lab03_training import accumulation_lines
    rec = lambda losses, spread, gap: {"losses": losses, "grad_spread_over_ranks": spread,  # noqa: E731
                                       "param_spread_over_ranks": spread, "max_param_diff_vs_reference": gap}
    good = naive_verdict({0: rec([1.0], 0, 1e-7), 1: rec([2.0], 0, 2e-7)})
    assert "losses differ between ranks: True" in good[0] and "identical on every rank: True" in good[0]
    assert good[1].endswith("(float32 rounding)")
    bad = naive_verdict({0: rec([1.0], 0.5, 0.3), 1: rec([1.0], 0.5, 0.3)})
    assert "losses differ between ranks: False" in bad[0] and "identical on every rank: False" in bad[0]
    assert "not the same training" in bad[1]
    assert cap_verdict([1024, 2048], 1.0).endswith("each at or below the cap")
    assert cap_verdict([2 * 2**20], 1.0).endswith("NOT all within the cap")
    way = lambda n, b, gap: {"collectives": n, "bytes": b, "max_grad_diff_vs_big_batch": gap}  # noqa: E731
    acc = {"sync every micro-batch": way(4, 400, 0.0), "no_sync, forward inside": way(1, 100, 0.0),
           "no_sync, forward outside": way(4, 400, 0.0)}
    lines = accumulation_lines(acc)
    assert "4x fewer bytes" in lines[0] and "all equal one big batch's" in lines[0]
    assert lines[1].endswith("as many as without no_sync")
    acc["no_sync, forward outside"] = way(2, 200, 1e-3)
    lines = accumulation_lines(acc)
    assert "do NOT all equal" in lines[0] and "against 4 without no_sync and 1 with the forward inside" in lines[1]
