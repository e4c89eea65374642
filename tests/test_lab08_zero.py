"""Tests of lab 08's non-exercise parts: the ZeRO paper's accounting, the byte counters, the
hand-built ZeRO stages 0-3 (labs/lab08_zero.py) and torch's FSDP2 and ZeroRedundancyOptimizer next
to them (labs/lab08_torch_sharding.py).

In this process (world size 1): the formulas, the counters, and every stage against plain Adam.
One launch on 2 ranks (this module is also its worker, at the smoke sizes): every stage and FSDP2
against one process on the whole batch (parameters after 3 Adam steps within 1e-6: only the
summation order of the two halves' gradients differs), bitwise equal across ranks; memory held
per rank within 10% of the formula for each of parameters, gradients and optimizer state; the
collectives of one step and their bytes exactly as the stage prescribes; ZeRO-2's full gradients
and ZeRO-3's gathered parameters alive one unit at a time.
"""
from __future__ import annotations

import sys

import pytest
import torch

from helpers.accounting import held_bytes, tensors_held_by
from labs import lab08_zero as zero
from tests.harness import launch_ranks

PARTS = ("parameters", "gradients", "optimizer state")
TOLERANCE = 1e-6


# ---------------------------------------------------------------------------------- in process
def test_the_papers_figure_1():
    """Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB."""
    totals = [zero.model_state_bytes(7.5e9, 64, stage, **zero.MIXED_PRECISION_ADAM)["total"] / 1e9
              for stage in zero.STAGES]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    assert zero.model_state_bytes(1, 1, 0, **zero.FP32_ADAM)["total"] == 16  # 4 + 4 + 8


def test_zero3_sends_one_and_a_half_times_ddp():
    for n in (2, 4, 64):
        ddp, z3 = (zero.step_sent_bytes(1000, n, stage) for stage in (0, 3))
        assert z3 == pytest.approx(1.5 * ddp)
        assert ddp == pytest.approx(2 * (n - 1) / n * 4000)
        assert zero.step_sent_bytes(1000, n, 1) == zero.step_sent_bytes(1000, n, 2) == ddp


def test_held_bytes_counts_each_storage_once():
    base = torch.zeros(100)
    views = [base[:10], base[10:].view(9, 10)]  # (10,) and (9, 10): one storage of 100 floats
    held = held_bytes({"a": views, "b": [base, torch.zeros(3), None]})
    assert held == {"a": 400, "b": 12, "total": 412}


def test_tensors_held_by_finds_state_wherever_it_is():
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.ones(4)

    class Wrapper:
        def __init__(self):
            self.inner = torch.optim.SGD([param], lr=0.1, momentum=0.9)
            self.extra = {"buffers": [torch.zeros(5)], "param": param}
            self.self_ref = self

    wrapper = Wrapper()
    wrapper.inner.step()
    found = tensors_held_by(wrapper, exclude=[param])
    assert sorted(t.numel() for t in found) == [4, 5]  # the momentum buffer and the extra one
    assert all(t is not param.grad for t in found)


def test_every_stage_on_one_rank_is_plain_adam():
    from helpers.dist import distributed

    model = zero.make_model(8, 3)
    batches = zero.make_batches(3, 4, 8)
    reference = zero.train_one_process(model, batches)
    with distributed() as ctx:
        for stage in zero.STAGES:
            result = zero.run_stage(stage, model, batches, reference, ctx.device, keep_params=True)
            assert zero.max_diff(result["params"], reference) <= TOLERANCE, f"stage {stage}"
            assert result["held"]["total"] == pytest.approx(result["formula"]["total"], rel=0.01)
    assert result["gathered_peak"] == max(result["unit_bytes"])


# ---------------------------------------------------------------------------------- on 2 ranks
@pytest.fixture(scope="module")
def ranks():
    return launch_ranks(__file__, "run", nproc=2, timeout=240,
                        env={"COURSE_SMOKE": "1", "DIST_TIMEOUT": "40"})


def stages(ranks, rank: int) -> list[dict]:
    return ranks[rank]["runs"]["2"]


@pytest.mark.parametrize("stage", zero.STAGES)
def test_stage_matches_one_process_and_ranks_agree(ranks, stage):
    for rank in ranks:
        s = stages(ranks, rank)[stage]
        assert s["max_diff_vs_one_process"] <= TOLERANCE, (
            f"{s['name']}, rank {rank}: parameters differ from one process by "
            f"{s['max_diff_vs_one_process']:.3g}")
        assert s["max_diff_across_ranks"] == 0.0, f"{s['name']}: ranks disagree"


@pytest.mark.parametrize("stage", zero.STAGES)
def test_memory_held_within_10_percent_of_the_formula(ranks, stage):
    for rank in ranks:
        s = stages(ranks, rank)[stage]
        for part in PARTS:
            held, formula = s["held"][part], s["formula"][part]
            assert abs(held / formula - 1) <= 0.10, (
                f"{s['name']}, rank {rank}: {part} {held} bytes held, formula {formula:.0f}")


def test_collectives_of_each_stage(ranks):
    units = len(stages(ranks, 0)[0]["unit_bytes"])
    expected = {0: {"all_reduce": units}, 1: {"reduce_scatter": units, "all_gather": units},
                2: {"reduce_scatter": units, "all_gather": units},
                3: {"all_gather": 2 * units, "reduce_scatter": units}}
    for s in stages(ranks, 0):
        assert s["collectives"]["calls"] == expected[s["stage"]], s["name"]
        padded_sent = zero.step_sent_bytes(s["padded_params"], 2, s["stage"])
        assert s["collectives"]["sent_bytes"] == pytest.approx(padded_sent), s["name"]
    ddp, z3 = (stages(ranks, 0)[i]["collectives"]["sent_bytes"] for i in (0, 3))
    assert z3 == pytest.approx(1.5 * ddp)


def test_zero3_holds_one_unit_of_gathered_parameters_at_a_time(ranks):
    s = stages(ranks, 0)[3]
    assert s["gathered_peak"] == max(s["unit_bytes"])
    events = s["gathered_events"]
    units = len(s["unit_bytes"])
    assert len(events) == 4 * units  # gather + free, in forward and again in backward
    assert events[-1][1] == 0, "gathered parameters still alive after the step"
    kinds = [what.split()[0] for what, _ in events]
    assert kinds == ["gather", "free"] * (2 * units), "a unit was gathered before the last was freed"


def test_zero2_holds_one_unit_of_full_gradients_at_a_time(ranks):
    s = stages(ranks, 0)[2]
    assert s["full_grad_peak"] == max(s["unit_grad_bytes"]), (
        f"ZeRO-2: {s['full_grad_peak']} bytes of full gradients alive at once in backward; one "
        f"unit's are {max(s['unit_grad_bytes'])}")


def test_fsdp2_matches_one_process_and_the_hand_built_zero3(ranks):
    for rank in ranks:
        f = ranks[rank]["fsdp2"]
        assert f["max_diff_vs_one_process"] <= TOLERANCE
        assert f["max_diff_vs_hand_zero3"] <= TOLERANCE
        assert f["max_diff_across_ranks"] == 0.0
        for part in PARTS:
            assert abs(f["held"][part] / f["formula"][part] - 1) <= 0.10, part
    hand = ranks[0]["hand"]["zero3"]["collectives"]
    assert ranks[0]["fsdp2"]["collectives"]["calls"] == hand["calls"]
    assert ranks[0]["fsdp2"]["collectives"]["sent_bytes"] == pytest.approx(hand["sent_bytes"])


def test_zero_redundancy_optimizer_matches_the_hand_built_zero1(ranks):
    for rank in ranks:
        z = ranks[rank]["zero_redundancy"]
        assert z["max_diff_vs_one_process"] <= TOLERANCE
        assert z["max_diff_vs_hand_zero1"] <= TOLERANCE
        assert z["max_diff_across_ranks"] == 0.0
    owned = [ranks[r]["zero_redundancy"]["owned_numel"] for r in ranks]
    assert sum(owned) == ranks[0]["num_params"]
    state = [ranks[r]["zero_redundancy"]["held"]["optimizer state"] for r in ranks]
    assert max(state) <= 0.6 * 8 * ranks[0]["num_params"], "each rank should hold about half the state"
    calls = ranks[0]["zero_redundancy"]["collectives"]["calls"]
    assert set(calls) == {"all_reduce", "broadcast"}, calls


def test_cpu_offload_needs_an_accelerator(ranks):
    probe = ranks[0]["cpu_offload"]
    if ranks[0]["backend"] == "nccl":
        assert probe["ran"] and probe["shard_device"] == "cpu", probe
    else:
        assert not probe["ran"] and "accelerator" in probe["error"], probe


# ---------------------------------------------------------------------------------- the worker
def worker() -> None:
    from helpers.dist import distributed
    from labs import lab08_torch_sharding

    with distributed() as ctx:
        torch.set_num_threads(1)
        zero.run(ctx, zero.Run.preset())
        lab08_torch_sharding.run(ctx, lab08_torch_sharding.Run.preset())


if __name__ == "__main__" and sys.argv[1:] == ["run"]:
    worker()
