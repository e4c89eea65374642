"""Public tests of lab 06's exercises (labs/lab06_pipeline.py): `StageExecutor.backward_step`
and `one_f_one_b_schedule`.

Run:  .venv/bin/python -m pytest tests/public/test_lab06_pipeline.py -q

One launch on 2 ranks (2 pipeline stages) trains a small model with GPipe and with 1F1B; this file
is also its worker. The test compares every rank's stage with single-process training of the
whole model, computed here: losses (rtol 1e-5), first-step gradients and parameters after the
steps (atol 1e-6, float32). The single-stage and middle-stage checks run in this process.
"""
from __future__ import annotations

import sys
import traceback

import pytest
import torch

from helpers.launch import LaunchError, launch
from labs import lab06_pipeline as lab

NPROC = 2
STEPS = 3
CONFIG = lab.PipeConfig(width=16, num_blocks=4, num_classes=5, microbatch_size=4,
                        num_microbatches=4, lr=0.5, seed=3)
ATOL = 1e-6


# ------------------------------------------------------------------------------ 1F1B schedule
@pytest.mark.exercise("one_f_one_b_schedule")
def test_one_f_one_b_small_cases():
    F, B = "F", "B"
    assert lab.one_f_one_b_schedule(2, 3) == [
        [(F, 0), (F, 1), (B, 0), (F, 2), (B, 1), (B, 2)],
        [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2)]]
    assert lab.one_f_one_b_schedule(1, 2) == [[(F, 0), (B, 0), (F, 1), (B, 1)]]
    assert lab.one_f_one_b_schedule(3, 4)[0] == [
        (F, 0), (F, 1), (F, 2), (B, 0), (F, 3), (B, 1), (B, 2), (B, 3)]


@pytest.mark.exercise("one_f_one_b_schedule")
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_one_f_one_b_valid_and_bounded(num_stages):
    for num_microbatches in range(1, 9):
        schedule = lab.one_f_one_b_schedule(num_stages, num_microbatches)
        assert len(schedule) == num_stages
        lab.validate_schedule(schedule, num_microbatches)   # raises if invalid or deadlocking
        peaks = lab.peak_in_flight(schedule)
        for stage, peak in enumerate(peaks):
            assert peak <= num_stages - stage, (
                f"p={num_stages}, m={num_microbatches}: stage {stage} holds {peak} micro-batches")


# ------------------------------------------------------------------------- backward, in process
@pytest.mark.exercise("StageExecutor.backward_step")
def test_single_stage_training_equals_reference():
    """p = 1: the only stage is first and last; no messages, so no process group is needed."""
    reference = lab.train_reference(CONFIG, STEPS)
    run = lab.train_pipeline(CONFIG, "GPipe", STEPS, rank=0, world_size=1,
                             device=torch.device("cpu"))
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"]),
                               rtol=1e-5, atol=ATOL)
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(run["grads"][name], grad, rtol=0, atol=ATOL, msg=name)
    assert run["stash_left"] == 0, "backward_step must remove the micro-batch from self.stash"


@pytest.mark.exercise("StageExecutor.backward_step")
def test_middle_stage_returns_input_gradient():
    """Stage 1 of 3: backward seeded with dL/d(output) returns dL/d(input) and fills .grad."""
    torch.manual_seed(0)
    module = lab.StageModule({1: torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU())})
    executor = lab.StageExecutor(module, stage=1, num_stages=3, boundary_shape=(3, 6),
                                 device=torch.device("cpu"))
    x, output_grad = torch.randn(3, 6), torch.randn(3, 6)
    executor.forward_step(0, x.clone())
    input_grad = executor.backward_step(0, output_grad)

    x_ref = x.clone().requires_grad_(True)
    reference = lab.StageModule({1: module.blocks["1"]})
    expected = torch.autograd.grad(reference(x_ref), [x_ref, *module.parameters()], output_grad)
    assert input_grad is not None, "stages > 0 must return dL/d(input) for the previous stage"
    torch.testing.assert_close(input_grad, expected[0])
    for param, grad in zip(module.parameters(), expected[1:]):
        torch.testing.assert_close(param.grad, grad)
    assert executor.stash == {}


# ----------------------------------------------------------------------- 2 ranks, 2 stages
@pytest.fixture(scope="module")
def results():
    try:
        res = launch(__file__, "train", nproc=NPROC, timeout=180, stream=False,
                     env={"DIST_TIMEOUT": "30"})
    except LaunchError as exc:
        pytest.fail(f"the {NPROC}-rank launch failed:\n{exc}")
    return res.results


@pytest.fixture(scope="module")
def reference():
    return lab.train_reference(CONFIG, STEPS)


def check_training(results, reference, schedule_name: str) -> None:
    for rank in range(NPROC):
        if "error" in results[rank]:
            pytest.fail(f"rank {rank} raised:\n{results[rank]['error']}")
        run = results[rank]["runs"][schedule_name]
        if run == "not implemented":
            pytest.fail(f"{schedule_name}: the schedule raised NotImplementedError")
        assert run["stash_left"] == 0, f"rank {rank}: activations left in self.stash after a step"
        names = lab.build_stage_module(CONFIG, NPROC, rank).state_dict().keys()
        assert sorted(run["grads"]) == sorted(names)
        for name in names:
            torch.testing.assert_close(torch.tensor(run["grads"][name]), reference["grads"][name],
                                       rtol=0, atol=ATOL, msg=f"rank {rank} first-step grad {name}")
            torch.testing.assert_close(torch.tensor(run["params"][name]), reference["params"][name],
                                       rtol=0, atol=ATOL, msg=f"rank {rank} param {name}")
    losses = results[NPROC - 1]["runs"][schedule_name]["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]),
                               rtol=1e-5, atol=ATOL)


@pytest.mark.exercise("StageExecutor.backward_step")
def test_gpipe_training_equals_single_process(results, reference):
    check_training(results, reference, "GPipe")


@pytest.mark.exercise("one_f_one_b_schedule")
def test_1f1b_training_equals_single_process(results, reference):
    check_training(results, reference, "1F1B")
    peaks = [results[rank]["runs"]["1F1B"]["peak_held"] for rank in range(NPROC)]
    assert peaks == [2, 1], f"1F1B holds at most p - s micro-batches per stage, measured {peaks}"


# ---------------------------------------------------------------------------------------- worker
def worker() -> None:
    from helpers.dist import distributed

    with distributed() as ctx:
        try:
            runs = {}
            for name in lab.SCHEDULES:
                try:  # a pure function, same on every rank: all ranks skip it together
                    lab.make_schedule(name, ctx.world_size, CONFIG.num_microbatches)
                except NotImplementedError:
                    runs[name] = "not implemented"
                    continue
                run = lab.train_pipeline(CONFIG, name, STEPS, rank=ctx.rank,
                                         world_size=ctx.world_size, device=ctx.device)
                runs[name] = {"losses": run["losses"], "stash_left": run["stash_left"],
                              "peak_held": run["peak_held"],
                              "grads": {n: t.tolist() for n, t in run["grads"].items()},
                              "params": {n: t.tolist() for n, t in run["params"].items()}}
            ctx.report(runs=runs)
        except Exception:
            ctx.report(error=traceback.format_exc())
            raise


if __name__ == "__main__" and sys.argv[1:] == ["train"]:
    worker()
