"""Hidden tests of lab 06's exercises: `StageExecutor.backward_step` (labs/lab06_pipeline.py),
`one_f_one_b_schedule` (labs/lab06_schedules.py).

Stricter than the public ones: 1F1B must be exactly the warm-up / steady / cool-down schedule for
every p <= 4, m <= 8 (including m < p), finish as early as GPipe with unit and with unequal
forward/backward times, and hold exactly min(p - s, m) micro-batches. The executor's backward is
run on 3 ranks (a middle stage receives and sends gradients), with m = 3 and m = 1, against
single-process training computed here (rtol 1e-5 on losses, atol 1e-6 on gradients and
parameters), plus in-process checks of out-of-order backwards and gradient accumulation.
"""
from __future__ import annotations

import sys

import pytest
import torch

from helpers.notice import solved
from labs import lab06_pipeline as lab
from labs import lab06_schedules as sched
from tests.harness import launch_ranks

NPROC = 3
STEPS = 2
CONFIGS = {  # name -> (schedule, config); 3 stages, so num_blocks divisible by 3
    "1F1B m=3": ("1F1B", lab.PipeConfig(width=12, num_blocks=3, num_classes=4, microbatch_size=2,
                                        num_microbatches=3, lr=0.5, seed=5)),
    "1F1B m=5": ("1F1B", lab.PipeConfig(width=12, num_blocks=3, num_classes=4, microbatch_size=2,
                                        num_microbatches=5, lr=0.5, seed=6)),
    "GPipe m=1": ("GPipe", lab.PipeConfig(width=12, num_blocks=6, num_classes=4, microbatch_size=5,
                                          num_microbatches=1, lr=0.5, seed=7)),
}
ATOL = 1e-6


def expected_1f1b(num_stages: int, num_microbatches: int) -> list[list[tuple[str, int]]]:
    """Written independently: for each stage, the position of every action."""
    schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        order = [("F", i) for i in range(warmup)]
        for i in range(num_microbatches - warmup):
            order += [("F", warmup + i), ("B", i)]
        order += [("B", i) for i in range(num_microbatches - warmup, num_microbatches)]
        schedule.append(order)
    return schedule


# ------------------------------------------------------------------------------ 1F1B schedule
@pytest.mark.exercise("one_f_one_b_schedule")
@pytest.mark.points(2)
def test_1f1b_exact_for_all_sizes():
    """Exactly the docstring's 1F1B order for many numbers of stages and micro-batches."""
    for p in range(1, 5):
        for m in range(1, 9):
            assert sched.one_f_one_b_schedule(p, m) == expected_1f1b(p, m), (
                f"p={p}, m={m}: not the warm-up / one-forward-one-backward / cool-down order")


@pytest.mark.exercise("one_f_one_b_schedule")
def test_1f1b_fewer_microbatches_than_stages():
    """Correct 1F1B order when there are fewer micro-batches than stages."""
    F, B = "F", "B"
    assert sched.one_f_one_b_schedule(4, 2) == [
        [(F, 0), (F, 1), (B, 0), (B, 1)], [(F, 0), (F, 1), (B, 0), (B, 1)],
        [(F, 0), (F, 1), (B, 0), (B, 1)], [(F, 0), (B, 0), (F, 1), (B, 1)]], \
        "p=4, m=2: fewer micro-batches than stages: the warm-up is min(p - s - 1, m) forwards"


@pytest.mark.exercise("one_f_one_b_schedule")
def test_1f1b_as_fast_as_gpipe_and_exact_memory_bound():
    """Same makespan as GPipe (same bubble), but only min(p - s, m) activations held."""
    for p in range(1, 5):
        for m in range(1, 9):
            schedule = sched.one_f_one_b_schedule(p, m)
            assert all(isinstance(a, tuple) and isinstance(a[1], int) for s in schedule for a in s)
            assert sched.peak_in_flight(schedule) == [min(p - s, m) for s in range(p)], (
                f"p={p}, m={m}: stage s must hold exactly min(p - s, m) micro-batches")
            for backward_time in (1.0, 2.0):
                ours = sched.simulate_schedule(schedule, 1.0, backward_time)
                end = max(a.end for stage in ours for a in stage)
                assert end == pytest.approx((m + p - 1) * (1.0 + backward_time)), (
                    f"p={p}, m={m}, t_B={backward_time}: slower than GPipe ({end})")


# ------------------------------------------------------------------------- backward, in process
def _stage(stage: int, num_stages: int, seed: int = 0) -> lab.StageExecutor:
    torch.manual_seed(seed)
    blocks = {stage: torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Tanh())}
    return lab.StageExecutor(lab.StageModule(blocks), stage=stage, num_stages=num_stages,
                             boundary_shape=(2, 5), device=torch.device("cpu"))


@pytest.mark.exercise("StageExecutor.backward_step")
def test_first_stage_returns_none_and_accumulates():
    """First stage: backward_step returns None, empties the stash, accumulates grads out of order."""
    executor = _stage(0, 2)
    xs, grads = torch.randn(2, 2, 5), torch.randn(2, 2, 5)
    for i in range(2):
        executor.forward_step(i, xs[i])
    assert executor.backward_step(1, grads[1]) is None      # out of order: micro-batch 1 first
    assert sorted(executor.stash) == [0]
    assert executor.backward_step(0, grads[0]) is None
    assert executor.stash == {}
    params = list(executor.module.parameters())
    outputs = executor.module(xs.reshape(4, 5))
    expected = torch.autograd.grad(outputs, params, grads.reshape(4, 5))
    for param, grad in zip(params, expected):   # sum over the two micro-batches
        torch.testing.assert_close(param.grad, grad)


@pytest.mark.exercise("StageExecutor.backward_step")
def test_last_stage_seeds_with_scaled_loss():
    """Last stage: backward_step(i, None) gives the right input and weight grads with loss_scale set."""
    executor = _stage(1, 2, seed=1)
    executor.loss_scale = 0.25
    x, target = torch.randn(2, 5), torch.tensor([1, 3])
    executor.forward_step(0, x.clone(), target)
    input_grad = executor.backward_step(0, None)
    x_ref = x.clone().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(executor.module(x_ref), target) * 0.25
    expected = torch.autograd.grad(loss, [x_ref, *executor.module.parameters()])
    torch.testing.assert_close(input_grad, expected[0])
    for param, grad in zip(executor.module.parameters(), expected[1:]):
        torch.testing.assert_close(param.grad, grad)


# ------------------------------------------------------------------ 3 ranks, middle stage included
@pytest.fixture(scope="module")
def results():
    return launch_ranks(__file__, "train", nproc=NPROC, timeout=180, env={"DIST_TIMEOUT": "30"},
                        needs=[lab.StageExecutor.backward_step])


@pytest.mark.exercise("StageExecutor.backward_step")
@pytest.mark.points(3)
@pytest.mark.parametrize("case", list(CONFIGS))
def test_three_stage_training_equals_single_process(results, case):
    """A deeper pipeline, middle stage included, trains like one process and holds the expected peak."""
    schedule_name, config = CONFIGS[case]
    reference = lab.train_reference(config, STEPS)
    for rank in range(NPROC):
        run = solved(results[rank]["runs"][case])
        assert "invalid" not in run, f"{case}: {run.get('invalid')}"
        assert run["stash_left"] == 0, f"{case}, stage {rank}: activations left in self.stash"
        m = config.num_microbatches
        expected_peak = m if schedule_name == "GPipe" else min(NPROC - rank, m)
        assert run["peak_held"] == expected_peak, (
            f"{case}, stage {rank}: held {run['peak_held']} micro-batches, expected {expected_peak}")
        names = lab.build_stage_module(config, NPROC, rank).state_dict().keys()
        assert sorted(run["params"]) == sorted(names)
        for name in names:
            torch.testing.assert_close(torch.tensor(run["grads"][name]), reference["grads"][name],
                                       rtol=0, atol=ATOL, msg=f"rank {rank} grad {name}")
            torch.testing.assert_close(torch.tensor(run["params"][name]), reference["params"][name],
                                       rtol=0, atol=ATOL, msg=f"rank {rank} param {name}")
    torch.testing.assert_close(torch.tensor(results[NPROC - 1]["runs"][case]["losses"]),
                               torch.tensor(reference["losses"]), rtol=1e-5, atol=ATOL)


# ---------------------------------------------------------------------------------------- worker
def worker() -> None:
    from helpers.dist import distributed
    from tests.public.test_lab06_pipeline import train_case

    with distributed() as ctx:
        ctx.report(runs={case: train_case(name, config, STEPS, ctx.rank, ctx.world_size, ctx.device)
                         for case, (name, config) in CONFIGS.items()})


if __name__ == "__main__" and sys.argv[1:] == ["train"]:
    worker()
