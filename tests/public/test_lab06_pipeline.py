"""Public tests of lab 06's exercises: `StageExecutor.backward_step` (labs/lab06_pipeline.py) and
`one_f_one_b_schedule` (labs/lab06_schedules.py).

Run:  ./run.sh check 06

The schedule is checked as data: exact lists for small cases, valid (no deadlock, neighbours in
the same order) and, the point of 1F1B, stage s never holding more than p - s micro-batches of
activations. The backward pass is checked in this process (one stage; a middle stage) and on 2
ranks (2 pipeline stages, one launch; this file is also its worker), against single-process
training of the whole model: losses (rtol 1e-5), first-step gradients and parameters after the
steps (atol 1e-6, float32).
"""
from __future__ import annotations

import sys

import pytest
import torch

from helpers.notice import solved
from labs import lab06_pipeline as lab
from labs import lab06_schedules as sched
from tests.harness import launch_ranks

NPROC = 2
STEPS = 3
CONFIG = lab.PipeConfig(width=16, num_blocks=4, num_classes=5, microbatch_size=4,
                        num_microbatches=4, lr=0.5, seed=3)
ATOL = 1e-6


def spell(actions) -> str:
    return " ".join(f"{kind}{i}" for kind, i in actions)


def diagnose_1f1b(have, num_stages: int, num_microbatches: int, stage: int) -> str:
    """What is wrong with one stage's 1F1B order, in the words of the schedule's three phases."""
    try:
        kinds = [kind for kind, _ in have]
        forwards = [i for kind, i in have if kind == "F"]
        backwards = [i for kind, i in have if kind == "B"]
    except (TypeError, ValueError):
        return "every action must be a (kind, micro-batch) pair such as ('F', 0)"
    p, m, s = num_stages, num_microbatches, stage
    warmup = min(p - s - 1, m)
    leading = kinds.index("B") if "B" in kinds else len(kinds)   # forwards before the first backward
    expected = min(warmup + 1, m)   # the warm-up, then the steady state's first forward
    gpipe = " (with that many it has become GPipe's order)" if (
        list(have) == sched.gpipe_schedule(p, m)[stage] and p > 1) else ""
    if forwards != list(range(m)) or backwards != list(range(m)):
        if sorted(backwards) == list(range(m)) and forwards == list(range(m)):
            return (f"its backwards run in the order {backwards}: backwards go in micro-batch order, "
                    "0 to m-1, in the steady state and in the cool-down (the oldest micro-batch first), "
                    "as the next stage sends their gradients")
        return (f"it runs the forwards of {forwards} and the backwards of {backwards}: each micro-batch "
                f"0..{m - 1} exactly once per kind, in micro-batch order")
    if leading > expected:
        return (f"it runs {leading} forwards before its first backward, {expected} expected: "
                f"{leading - expected} warm-up forward(s) too many (warm-up w = min(p - s - 1, m) = "
                f"{warmup}); each extra forward holds one more micro-batch's activations, beyond the "
                f"p - s = {p - s} that 1F1B holds{gpipe}")
    if leading < expected:
        return (f"it runs {leading} forward(s) before its first backward, {expected} expected: the "
                f"w = min(p - s - 1, m) = {warmup} warm-up forwards, then the steady state, whose every "
                "step is one forward (the next micro-batch) and then one backward (the oldest); with "
                "fewer forwards first, the stage waits for a gradient that cannot have come back yet")
    return ("after the warm-up it must alternate one forward (the next micro-batch) and one backward "
            "(the oldest not yet done) until the forwards run out, then run the remaining backwards")


# ------------------------------------------------------------------------------ 1F1B schedule
@pytest.mark.exercise("one_f_one_b_schedule")
def test_one_f_one_b_small_cases():
    """1F1B gives the exact warm-up / one-forward-one-backward / cool-down order for small cases."""
    F, B = "F", "B"
    cases = {
        (2, 3): [[(F, 0), (F, 1), (B, 0), (F, 2), (B, 1), (B, 2)],
                 [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2)]],
        (1, 2): [[(F, 0), (B, 0), (F, 1), (B, 1)]],
        (3, 4): [[(F, 0), (F, 1), (F, 2), (B, 0), (F, 3), (B, 1), (B, 2), (B, 3)],
                 [(F, 0), (F, 1), (B, 0), (F, 2), (B, 1), (F, 3), (B, 2), (B, 3)],
                 [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2), (F, 3), (B, 3)]],
    }
    for (p, m), expected in cases.items():
        got = sched.one_f_one_b_schedule(p, m)
        assert isinstance(got, list) and len(got) == p, (
            f"p={p}, m={m}: expected a list with one list of actions per stage, got {got!r}")
        for stage, (want, have) in enumerate(zip(expected, got)):
            if list(have) != want:
                pytest.fail(f"p={p}, m={m}, stage {stage}: expected {spell(want)}, got {spell(have)}: "
                            f"{diagnose_1f1b(have, p, m, stage)}")


@pytest.mark.exercise("one_f_one_b_schedule")
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_one_f_one_b_valid_and_bounded(num_stages):
    """1F1B schedules run without deadlock and stage s never holds more than min(p - s, m) micro-batches."""
    for num_microbatches in range(1, 9):
        schedule = sched.one_f_one_b_schedule(num_stages, num_microbatches)
        assert len(schedule) == num_stages, (
            f"p={num_stages}, m={num_microbatches}: {len(schedule)} stages in the schedule")
        try:
            sched.validate_schedule(schedule, num_microbatches)
        except ValueError as exc:
            beyond = sorted({a[1] for actions in schedule for a in actions if isinstance(a, tuple)
                             and len(a) == 2 and isinstance(a[1], int) and a[1] >= num_microbatches})
            hint = (f" (it runs micro-batches {beyond}, which do not exist: the warm-up is "
                    "min(p - s - 1, m), clamped by m)" if beyond else "")
            pytest.fail(f"p={num_stages}, m={num_microbatches}: the schedule is not valid: {exc}{hint}")
        for stage, peak in enumerate(sched.peak_in_flight(schedule)):
            bound = min(num_stages - stage, num_microbatches)
            assert peak <= bound, (
                f"p={num_stages}, m={num_microbatches}: stage {stage} holds the activations of "
                f"{peak} micro-batches at once; 1F1B must hold at most min(p - s, m) = {bound} "
                f"(start each backward as early as possible): {spell(schedule[stage])}")


# ------------------------------------------------------------------------- backward, in process
@pytest.mark.exercise("StageExecutor.backward_step")
def test_single_stage_training_equals_reference():
    """A one-stage pipeline trains like one process: backward_step's gradients add up over micro-batches.

    p = 1: the only stage is first and last; no messages, so no process group is needed."""
    reference = lab.train_reference(CONFIG, STEPS)
    run = lab.train_pipeline(CONFIG, "GPipe", STEPS, rank=0, world_size=1,
                             device=torch.device("cpu"))
    assert run["stash_left"] == 0, "backward_step must remove the micro-batch from self.stash"
    executor_grads = run["grads"]
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(
            executor_grads[name], grad, rtol=0, atol=ATOL,
            msg=lambda m, n=name: f"first-step gradient of {n} differs from single-process "
                                  f"training (gradients must add up over the micro-batches, each "
                                  f"loss already scaled by 1/m): {m}")
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"]),
                               rtol=1e-5, atol=ATOL,
                               msg=lambda m: f"losses differ from single-process training: {m}")


@pytest.mark.exercise("StageExecutor.backward_step")
def test_middle_stage_returns_input_gradient():
    """A middle stage's backward_step returns dL/d(input) and fills its weights' .grad.

    Stage 1 of 3: backward seeded with dL/d(output) returns dL/d(input) and fills .grad."""
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
    assert input_grad is not None, ("stages > 0 must return dL/d(input): it is what the previous "
                                    "stage needs for its own backward (send the gradient upstream)")
    assert input_grad is not output_grad and not torch.equal(input_grad, output_grad), (
        "backward_step returned the gradient it received, dL/d(output): the previous stage needs "
        "dL/d(input), what autograd leaves in stage_input.grad after running back through the stage")
    torch.testing.assert_close(input_grad, expected[0], msg=lambda m: (
        f"the returned gradient is not dL/d(stage input) (seed autograd with output_grad): {m}"))
    for (name, param), grad in zip(module.named_parameters(), expected[1:]):
        assert param.grad is not None, f"backward_step left {name}.grad empty: run autograd " \
                                       f"through the stage so the weights get their gradients"
        torch.testing.assert_close(param.grad, grad, msg=lambda m, n=name: f"{n}.grad: {m}")
    assert executor.stash == {}, "backward_step must remove the micro-batch from self.stash"


# ----------------------------------------------------------------------- 2 ranks, 2 stages
@pytest.fixture(scope="module")
def results():
    return launch_ranks(__file__, "train", nproc=NPROC, timeout=180, env={"DIST_TIMEOUT": "30"},
                        needs=[lab.StageExecutor.backward_step])


@pytest.fixture(scope="module")
def reference():
    return lab.train_reference(CONFIG, STEPS)


def check_training(results, reference, schedule_name: str) -> None:
    for rank in range(NPROC):
        run = solved(results[rank]["runs"][schedule_name])   # the stub's message if unsolved
        assert "invalid" not in run, f"{schedule_name}: {run.get('invalid')}"
        assert run["stash_left"] == 0, f"rank {rank}: activations left in self.stash after a step"
        names = lab.build_stage_module(CONFIG, NPROC, rank).state_dict().keys()
        assert sorted(run["grads"]) == sorted(names), f"rank {rank}: gradients of {run['grads']}"
        for name in names:
            torch.testing.assert_close(
                torch.tensor(run["grads"][name]), reference["grads"][name], rtol=0, atol=ATOL,
                msg=lambda m, n=name: f"{schedule_name}, stage {rank}: first-step gradient of {n} "
                                      f"differs from single-process training: {m}")
            torch.testing.assert_close(
                torch.tensor(run["params"][name]), reference["params"][name], rtol=0, atol=ATOL,
                msg=lambda m, n=name: f"{schedule_name}, stage {rank}: {n} after {STEPS} steps "
                                      f"differs from single-process training: {m}")
    losses = results[NPROC - 1]["runs"][schedule_name]["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]),
                               rtol=1e-5, atol=ATOL,
                               msg=lambda m: f"{schedule_name}: losses differ from one process: {m}")


@pytest.mark.exercise("StageExecutor.backward_step")
def test_gpipe_training_equals_single_process(results, reference):
    """Two stages on two ranks train with GPipe exactly like one process (gradients, weights, losses)."""
    check_training(results, reference, "GPipe")


@pytest.mark.exercise("one_f_one_b_schedule")
def test_1f1b_training_equals_single_process(results, reference):
    """Two stages train with your 1F1B exactly like one process, holding 2 and 1 micro-batches at most."""
    check_training(results, reference, "1F1B")
    peaks = [results[rank]["runs"]["1F1B"]["peak_held"] for rank in range(NPROC)]
    assert peaks == [2, 1], (f"with 1F1B on 2 stages the executor held {peaks} micro-batches of "
                             f"activations at most (stage 0, stage 1); 1F1B holds p - s = [2, 1]")


# ---------------------------------------------------------------------------------------- worker
def train_case(schedule_name: str, config, steps: int, rank: int, world_size: int, device) -> dict:
    """One training run on this rank, as JSON; an unsolved or invalid schedule is reported, not run
    (make_schedule is pure and the same on every rank, so all ranks skip it together)."""
    from helpers.notice import unsolved_message

    try:
        schedule = sched.make_schedule(schedule_name, world_size, config.num_microbatches)
        sched.validate_schedule(schedule, config.num_microbatches)
    except NotImplementedError as exc:
        if not unsolved_message(exc):
            raise
        return {"unsolved": unsolved_message(exc)}
    except ValueError as exc:   # it would hang or fail on the executor
        return {"invalid": f"the schedule is not valid: {exc}"}
    run = lab.train_pipeline(config, schedule_name, steps, rank=rank, world_size=world_size,
                             device=device)
    return {"losses": run["losses"], "stash_left": run["stash_left"], "peak_held": run["peak_held"],
            "grads": {n: t.tolist() for n, t in run["grads"].items()},
            "params": {n: t.tolist() for n, t in run["params"].items()}}


def worker() -> None:
    from helpers.dist import distributed

    with distributed() as ctx:
        ctx.report(runs={name: train_case(name, CONFIG, STEPS, ctx.rank, ctx.world_size, ctx.device)
                         for name in sched.SCHEDULES})


if __name__ == "__main__" and sys.argv[1:] == ["train"]:
    worker()
