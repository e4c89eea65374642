"""Tests of lab 01's non-exercise parts: the machine report and the scale numbers, the workloads,
the measurement code and its verdicts, and the lab end to end on 2 ranks (smoke size). Correctness
only; timings are never checked."""
import json
import math
import sys

import pytest
import torch

import labs.lab01_gil_threads as lab
import labs.lab01_machine as machine
from tests.harness import launch_ranks


def test_scale_of_the_trillion_parameter_run():
    rows = {r["quantity"].split(" (")[0].split(",")[0]: r for r in machine.scale_of_a_large_run()}
    assert rows["fp16 weights alone"]["value"] == "2 TB"  # 1e12 parameters x 2 bytes
    assert rows["fp16 weights alone"]["one GPU's worth"].startswith("25 GPUs of 80 GB")
    training = rows["weights + gradients + Adam state"]
    assert training["value"] == "16 TB" and training["one GPU's worth"].startswith("200 GPUs")
    compute = next(r for q, r in rows.items() if q.startswith("training compute"))
    assert compute["value"] == "3.6e+24 FLOPs"  # 8 x 450e9 tokens x 1e12 parameters
    assert "163 TFLOP/s" in compute["one GPU's worth"]  # 502 PFLOP/s over 3072 GPUs
    days = next(r for q, r in rows.items() if q.startswith("the same on 3072 GPUs"))
    assert days["value"] == "83 days"  # Narayanan et al. estimate ~84 days at 163 TFLOP/s
    assert days["one GPU's worth"] == "384 nodes of 8 GPUs"


def test_smt_is_read_from_the_core_counts_not_assumed():
    assert machine.smt_summary(16, 8) == "SMT: 2 logical per physical core"
    assert machine.smt_summary(10, 10).startswith("no SMT")  # e.g. Apple silicon
    assert "some cores only" in machine.smt_summary(20, 14)  # e.g. an Intel hybrid chip
    assert machine.smt_summary(8, None).startswith("unknown")
    labels = {r["item"]: r["value"] for r in machine.machine_rows()}
    assert "SMT (from those two counts)" in labels and "GPUs visible" in labels


def test_simd_width_from_torchs_cpu_capability():
    assert machine.simd_summary("AVX2").endswith("8 float32 lanes per instruction")
    assert machine.simd_summary("AVX512").startswith("AVX512: 512-bit")
    assert machine.simd_summary("DEFAULT").startswith("DEFAULT: 128-bit")
    assert machine.simd_summary().startswith(torch.backends.cpu.get_cpu_capability())


def test_a_function_of_main_cannot_be_found_by_a_fresh_process(monkeypatch):
    def square(x):
        return x * x

    square.__module__, square.__qualname__ = "__main__", "square_of_main"
    monkeypatch.setattr(sys.modules["__main__"], "square_of_main", square, raising=False)
    rows = machine.send_to_a_fresh_process(square, json.dumps)
    assert rows[0]["pickled as"] == "__main__.square_of_main"
    assert rows[0]["in a fresh process"].startswith("AttributeError"), rows[0]
    assert "square_of_main" in rows[0]["in a fresh process"]
    assert rows[1]["pickled as"] == "json.dumps" and rows[1]["in a fresh process"] == "found"
    assert all(0 < r["bytes"] < 100 for r in rows)  # a name, not the code


def test_work_is_split_into_the_same_total_for_any_worker_count():
    smoke = lab.Run.preset("smoke")
    for name, spec in lab.WORKLOADS.items():
        for workers in (1, 2, 3, 4):
            items = spec.items(4 * workers, spec.total(smoke))
            assert len(items) == 4 * workers
            assert [item[0] for item in items] == list(range(4 * workers))  # distinct seeds
            total = sum(item[1] for item in items)
            rounding = 0.0 if not spec.whole else len(items) / 2  # whole units per item
            assert abs(total - spec.total(smoke)) <= rounding + 1e-9, (name, workers, total)
    with pytest.raises(ValueError):
        lab.WORKLOADS["python"].items(0)


def test_workloads_are_deterministic_and_seed_dependent():
    for spec in lab.WORKLOADS.values():
        a, b = spec.items(2, spec.total(lab.Run.preset("smoke")) / 100)
        assert spec.fn(a) == spec.fn(a)
        assert spec.fn(a) != spec.fn(b)


def test_intra_op_threads_sets_and_restores():
    before = torch.get_num_threads()
    with lab.intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_gil_status_matches_this_interpreter():
    status = machine.gil_status()
    assert status["python"] == sys.version.split()[0]
    assert status["gil_enabled"] == getattr(sys, "_is_gil_enabled", lambda: True)()
    if not status["free_threaded_build"]:
        assert status["gil_enabled"]


def test_rank_shards_are_disjoint_and_cover_everything():
    items = list(range(11))
    for world_size in (1, 2, 3):
        shards = [lab.rank_shard(items, r, world_size) for r in range(world_size)]
        assert sorted(sum(shards, [])) == items


def test_verdict_thresholds():
    assert lab.verdict(1.9, 2) == "parallel"
    assert lab.verdict(1.0, 2) == "serialised"
    assert lab.verdict(0.7, 2) == "serialised"
    assert lab.verdict(1.4, 2) == "partly parallel"
    assert lab.verdict(3.1, 4) == "parallel"
    assert lab.verdict(1.0, 1) == "serialised"


def test_ideal_speedup_is_capped_by_cores_except_for_waiting(monkeypatch):
    assert 1 <= lab.compute_cores() <= lab.available_cores()
    monkeypatch.setattr(lab, "compute_cores", lambda: 2)
    assert lab.ideal_speedup("python", 8) == 2
    assert lab.ideal_speedup("matmul", 1) == 1
    assert lab.ideal_speedup("io", 8) == 8


def row(workload, kind, speedup, seconds=1.0, overhead_s=0.0, workers=2):
    return dict(workload=workload, kind=kind, workers=workers, speedup=speedup, seconds=seconds,
                overhead_s=overhead_s)


def test_lessons_follow_the_measured_numbers():
    assert "GIL" in lab.lesson(row("python", "thread", 1.02))
    assert "1.02x" in lab.lesson(row("python", "thread", 1.02))
    assert "slower than serial" in lab.lesson(row("python", "thread", 0.7))
    assert "own GIL" in lab.lesson(row("python", "process", 1.9))
    assert "releases the GIL" in lab.lesson(row("matmul", "thread", 1.8))
    # a number that contradicts the expectation is reported as such, not explained away
    surprise = lab.lesson(row("python", "thread", 1.9))
    assert "expected serialised" in surprise and "Re-run" in surprise
    assert "expected parallel" in lab.lesson(row("matmul", "thread", 1.0))
    # without a GIL, parallel threads are the expected outcome
    assert "PEP 703" in lab.lesson(row("python", "thread", 1.9), gil_enabled=False)
    # a pool that spent most of the time starting up is named as the cause
    startup = lab.lesson(row("python", "process", 1.1, seconds=0.2, overhead_s=0.1))
    assert "starting and stopping the pool" in startup
    # 8 processes on 2 cores can reach 2x at most: 1.9x is the expected outcome, not a surprise
    capped = lab.lesson({**row("python", "process", 1.9, workers=8), "ideal": 2})
    assert "own GIL" in capped and "ideal 2x" in capped
    assert "expected" not in capped


def test_design_note_is_chosen_from_the_speedups():
    assert lab.design_note(1.9, 1.0).startswith("Processes beat threads here (1.90x against 1.00x)")
    not_here = lab.design_note(1.1, 1.0)
    assert not_here.startswith("Not on this run") and "beat" in not_here
    assert "not written" in lab.design_note(1.9, None)
    assert all("notebook 03" in lab.design_note(*s) for s in ((1.9, 1.0), (1.1, 1.0), (1.9, None)))


def test_speedup_table_rows_and_argument_checks():
    rows = lab.speedup_table("io", 2, kinds=("thread", "thread"), total=0.04, repeats=1)
    assert [(r["kind"], r["workers"]) for r in rows] == [("serial", 1), ("thread", 2)]
    assert rows[0]["speedup"] == 1.0
    assert all(r["seconds"] > 0 and r["overhead_s"] >= 0 for r in rows)
    with pytest.raises(ValueError):
        lab.speedup_table("sorting", 2)
    with pytest.raises(ValueError):
        lab.speedup_table("io", 2, kinds=("gpu",))
    with pytest.raises(ValueError):
        lab.speedup_table("io", 0)


def test_speedup_table_refuses_a_fast_wrong_answer(monkeypatch):
    real = lab.parallel_map

    def wrong_threads(fn, items, workers, kind):
        results = real(fn, items, workers, kind)
        return results[::-1] if kind == "thread" else results

    monkeypatch.setattr(lab, "parallel_map", wrong_threads)
    with pytest.raises(RuntimeError, match="other results than serial"):
        lab.speedup_table("io", 2, kinds=("thread",), total=0.04, repeats=1)


def test_creation_cost():
    assert machine.creation_cost("thread", count=3) > 0
    assert machine.creation_cost("process", count=2) > 0
    with pytest.raises(ValueError):
        machine.creation_cost("fiber")


@pytest.fixture(scope="module")
def lab_run():
    return launch_ranks("labs/lab01_gil_threads.py", nproc=2, env={"COURSE_SMOKE": "1"},
                        needs=[lab.parallel_map])


def test_lab_ranks_together_compute_the_single_process_result(lab_run):
    rank0, rank1 = lab_run[0], lab_run[1]
    n_items = 4 * 2
    items = lab.WORKLOADS["python"].items(n_items, lab.Run.preset("smoke").lab_iterations)
    results = [lab.python_work(item) for item in items]  # the single-process reference
    expected = sum(results)
    assert rank0["serial_checksum"] == expected
    assert rank0["threads"]["checksum"] == expected and rank0["threads"]["match_serial"]
    # each rank did only its own shard (every 2nd item), and the shards add up
    assert rank0["shard_checksum"] == sum(results[0::2])
    assert rank1["shard_checksum"] == sum(results[1::2])
    assert rank0["processes_checksum"] == rank1["processes_checksum"] == expected


def test_lab_reports_the_three_throughputs(lab_run):
    rank0, threads = lab_run[0], lab_run[0]["threads"]
    assert rank0["items"] == 8 and rank0["workers"] == 2
    assert rank0["throughput_1_process"] > 0 and rank0["throughput_processes"] > 0
    assert threads["throughput"] > 0
    assert math.isclose(rank0["speedup_processes"],
                        rank0["throughput_processes"] / rank0["throughput_1_process"])
    assert math.isclose(threads["processes_vs_threads"],
                        rank0["throughput_processes"] / threads["throughput"])
    assert "notebook 03" in lab_run.output
