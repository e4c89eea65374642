"""Tests of lab 02's non-exercise parts: the byte accounting, the measurements, the devices cell
helpers, and the three-way training lab end to end on 2 ranks (smoke size). No timing is checked.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers.dist import gpu_count
from helpers.tensors import nbytes
from labs import lab02_dp_costs as costs
from labs.lab02_data_parallel import (FORWARD_PHASES, ThreadDataParallel, gather, make_batch,
                                      make_mlp, max_param_diff, parallel_apply, replicate, scatter)
from tests.harness import launch_ranks


def test_step_record_counts_every_byte_that_crosses_replica_0():
    model = make_mlp(12, 1, 5)
    param_bytes = nbytes(model.parameters())
    x = torch.randn(7, 12, requires_grad=True)  # chunks of 3, 3, 1 rows
    tdp = ThreadDataParallel(model, 3)
    F.cross_entropy(tdp(x), torch.randint(0, 5, (7,))).backward()
    record = tdp.last_step
    row_in, row_out = 12 * 4, 5 * 4  # float32 bytes per sample in and out
    assert record.num_replicas == 3
    assert record.moved == {
        "scatter inputs": 4 * row_in, "broadcast params": 2 * param_bytes,
        "gather outputs": 4 * row_out, "scatter output grads": 4 * row_out,
        "reduce param grads": 2 * param_bytes, "gather input grads": 4 * row_in}
    assert record.moved_total == sum(record.moved.values()) == record.sent + record.received
    assert record.sent == 4 * row_in + 2 * param_bytes + 4 * row_out  # inputs, copies, out grads
    assert record.received == 4 * row_out + 2 * param_bytes + 4 * row_in
    assert set(record.seconds) == set(FORWARD_PHASES) and all(s >= 0 for s in record.seconds.values())
    held0, held2 = record.held[0], record.held[2]
    assert held0["gathered outputs"] == held0["output grads"] == 7 * row_out
    assert held2 == {"parameters": param_bytes, "gradients": param_bytes,
                     "input chunk": row_in, "output chunk": row_out}


def test_no_backward_traffic_without_grad():
    tdp = ThreadDataParallel(make_mlp(8, 1, 3), 2)
    with torch.no_grad():
        out = tdp(torch.randn(4, 8))
    assert not out.requires_grad
    moved = tdp.last_step.moved
    assert moved["scatter output grads"] == moved["reduce param grads"] == 0
    assert moved["broadcast params"] > 0


def test_memory_puts_gathered_outputs_and_loss_on_replica_0():
    rows = costs.memory_by_replica(width=8, num_classes=64, batch_size=6, num_replicas=3)
    assert [r["replica"] for r in rows] == [0, 1, 2]
    output_bytes = 6 * 64 * 4
    assert rows[0]["gathered outputs"] == rows[0]["output grads"] == output_bytes
    assert rows[0]["loss"] == 4
    assert "gathered outputs" not in rows[1] and "loss" not in rows[2]
    # replica 0 holds what the others hold, plus the gathered outputs, their gradient and the loss
    assert rows[0]["total"] - rows[1]["total"] == 2 * output_bytes + 4
    for r in rows:
        assert r["total"] == sum(v for k, v in r.items() if k not in ("replica", "total"))


def test_traffic_grows_linearly_with_the_replica_count():
    rows = costs.traffic_vs_replicas(width=16, depth=2, batch_size=8, replica_counts=[1, 2, 3, 4, 8])
    param_bytes = rows[0]["C"]
    assert [r["replicas"] for r in rows] == [1, 2, 3, 4, 8]
    assert rows[0]["total"] == 0
    for r in rows:
        n = r["replicas"]
        assert r["C*(N-1)"] == param_bytes * (n - 1)
        assert r["broadcast params"] == r["reduce param grads"] == param_bytes * (n - 1)
        # each direction carries C*(N-1) of parameters or gradients, plus the activations
        assert r["sent"] >= param_bytes * (n - 1) and r["received"] >= param_bytes * (n - 1)
        assert r["sent"] + r["received"] == r["total"]
        # activations add a little: inputs and outputs of the N-1 other chunks, both ways
        assert r["total"] >= 2 * param_bytes * (n - 1)
        assert r["total"] == sum(r[k] for k in ("scatter inputs", "broadcast params", "gather outputs",
                                                 "scatter output grads", "reduce param grads",
                                                 "gather input grads"))


def test_phase_times_and_threads_vs_serial_report_every_phase():
    rows = costs.phase_times(width=8, depth=1, batch_size=6, replica_counts=[1, 3], steps=1)
    assert rows[0]["replicas"] == "plain module" and rows[0]["step"] > 0
    for row in rows[1:]:
        phases = [*FORWARD_PHASES, "loss + backward"]
        assert all(row[p] >= 0 for p in phases)
        assert row["step"] == pytest.approx(sum(row[p] for p in phases))
    rows = costs.threads_vs_serial({"tiny": dict(width=8, depth=2, batch_size=4)}, repeats=1)
    assert rows[0]["params"] == sum(p.numel() for p in make_mlp(8, 2, 10).parameters())
    assert math.isfinite(rows[0]["speedup"]) and rows[0]["speedup"] > 0
    assert torch.get_num_threads() >= 1


def test_serial_apply_matches_parallel_apply():
    model = make_mlp(8, 1, 3)
    chunks = scatter(torch.randn(5, 8), 2)
    replicas = replicate(model, 2)
    for a, b in zip(costs.serial_apply(replicas, chunks), parallel_apply(replicas, chunks)):
        assert torch.equal(a, b)


def test_devices_cell_helpers():
    assert "meta" in costs.mixed_device_error("cpu", "meta")
    assert costs.mixed_device_error("cpu", "cpu").startswith("no error")
    assert costs.module_device(make_mlp(4, 1, 2)) == torch.device("cpu")
    with pytest.raises(ValueError, match="2 devices"):
        costs.module_device(torch.nn.Sequential(torch.nn.Linear(2, 2),
                                                torch.nn.Linear(2, 2, device="meta")))
    timing = costs.launch_vs_wait("cpu", size=32, launches=2)
    assert timing["work_finished_s"] >= timing["calls_returned_s"] > 0


@pytest.mark.skipif(gpu_count() > 0, reason="checks the CPU-only behaviour")
def test_dataparallel_is_a_pass_through_without_gpus():
    probe = costs.dataparallel_probe(width=8, depth=1, batch_size=6, repeats=1)
    assert probe["device_ids"] == [] and probe["dp_module_is_model"]
    assert probe["outputs_identical"] and probe["grad_diff_dp_vs_plain"] == 0.0
    outcomes = costs.torch_primitives_on_cpu()
    assert len(outcomes) == 4 and not any(o.startswith("ran") for o in outcomes.values())
    assert all(costs.primitive_outcome_note(o).startswith("expected") for o in outcomes.values())
    if torch.version.cuda is None:  # the CPU-only build: no CUDA comm bindings at all
        assert "_scatter" in outcomes["scatter(x, [0, 1])"]


def test_ours_matches_dataparallel():
    ours = costs.ours_vs_dataparallel(width=8, depth=1, batch_size=6)
    assert ours["replicas"] == 2
    assert ours["output_diff_ours_vs_dp"] < 1e-6 and ours["grad_diff_ours_vs_dp"] < 1e-6


@pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs")
def test_dataparallel_matches_the_plain_module_on_gpus():
    probe = costs.dataparallel_probe(width=32, depth=1, batch_size=16, repeats=1)
    assert probe["device_ids"] == list(range(gpu_count()))
    assert probe["output_diff_dp_vs_plain"] < 1e-5 and probe["grad_diff_dp_vs_plain"] < 1e-5


def test_link_bytes_per_direction_models():
    c = 1000
    assert costs.link_bytes_per_direction(c, 1) == {
        "star (lecture's parameter-server model)": 0,
        "nn.DataParallel with NCCL (broadcast + reduce)": 0, "DDP, ring all-reduce": 0}
    eight = costs.link_bytes_per_direction(c, 8)
    assert eight["star (lecture's parameter-server model)"] == 7 * c  # grows with N
    assert eight["nn.DataParallel with NCCL (broadcast + reduce)"] == c  # pipelined: once per link
    assert eight["DDP, ring all-reduce"] == pytest.approx(2 * c * 7 / 8)  # 2C(N-1)/N
    two = costs.link_bytes_per_direction(c, 2)
    assert len(set(two.values())) == 1  # with 2 devices all three move C each way


def test_launch_note_is_chosen_from_the_clocks():
    cpu = lambda ratio: {"device": "cpu", "ratio": ratio}
    cuda = lambda ratio: {"device": "cuda:0", "ratio": ratio}
    assert "both clocks agree (x1.02)" in costs.launch_note(cpu(1.02))
    assert costs.launch_note(cpu(1.8)).startswith("not on this run")
    assert costs.launch_note(cuda(40.0)).startswith("the calls returned 40.0x sooner")
    assert costs.launch_note(cuda(1.1)).startswith("not on this run")


def test_primitive_outcomes_are_explained_as_expected():
    note = costs.primitive_outcome_note(
        "AttributeError: module 'torch._C' has no attribute '_scatter'", cuda_build=False)
    assert note.startswith("expected") and "not a broken install" in note
    assert costs.primitive_outcome_note("AssertionError: Broadcast function not implemented for "
                                        "CPU tensors").startswith("expected")
    assert costs.primitive_outcome_note("ran, returned tuple").startswith("ran")


def test_small_helpers():
    assert max_param_diff(make_mlp(4, 2, 3, seed=5), make_mlp(4, 2, 3, seed=5)) == 0.0
    assert max_param_diff(make_mlp(4, 2, 3, seed=5), make_mlp(4, 2, 3, seed=6)) > 0.0
    x1, y1 = make_batch(4, 3, 2)
    x2, y2 = make_batch(4, 3, 2)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_costs_main_runs_in_process(monkeypatch, capsys):
    monkeypatch.setenv("COURSE_SMOKE", "1")
    costs.main([])
    out = capsys.readouterr().out
    assert "bytes replica 0 sent and received" in out and "threads vs a serial loop" in out
    assert "not a broken install" in out or torch.version.cuda is not None


@pytest.fixture(scope="module")
def three_ways():
    return launch_ranks("labs/lab02_data_parallel.py", nproc=2, env={"COURSE_SMOKE": "1"},
                        needs=[scatter, replicate, parallel_apply, gather])


def test_lab_trains_the_same_model_three_ways(three_ways):
    assert three_ways[0]["threads"] == {}, "the ThreadDataParallel way did not run"
    rows = three_ways[0]["rows"]
    names = [r["way"] for r in rows]
    assert names[0] == "one process" and "2 threads (ThreadDataParallel)" in names
    assert names[-1] == "2 processes (all_reduce)"
    for row in rows:  # same init, same data, same steps: same parameters (float32, 1e-5)
        assert row["param_diff_vs_one_process"] < 1e-5, row
        assert row["samples_per_s"] > 0 and row["speedup"] > 0
    assert rows[0]["param_diff_vs_one_process"] == 0.0
    assert three_ways[1]["rows"][0]["rank_diff"] == 0.0  # every rank holds the same model
    assert "three ways" in three_ways.output


def test_stacked_bars_draws_one_segment_per_stack_and_label():
    import matplotlib
    matplotlib.use("Agg")
    ax = costs.stacked_bars(["a", "b"], {"x": [1.0, 2.0], "y": [3.0, 0.5]}, title="t",
                            ylabel="ms", reference=2.0, reference_label="ref")
    assert len(ax.patches) == 4
    tops = sorted((p.get_x(), p.get_y() + p.get_height()) for p in ax.patches)
    assert [top for _, top in tops] == [1.0, 4.0, 2.0, 2.5]
    assert ax.get_title() == "t" and ax.get_ylabel() == "ms"
