"""Public tests of lab 10's exercises: `find_divergence` (labs/lab10_divergence.py) and
`diagnose` (labs/lab10_diagnose.py).

Run:  .venv/bin/python -m pytest tests/public/test_lab10_debugging.py -q

One launch on 2 ranks (this file is its worker) runs every find_divergence case and one mystery job
per bug of BUGS; diagnose then runs here, on each job's outputs. A find_divergence case trains a
small model (a 128x128 Linear, BatchNorm with an int64 buffer, a Linear whose weights are whole
numbers) with the same deterministic update on every rank, and plants one difference on one rank
after a chosen step: one ulp in one element, +d and -d in two elements (a plain sum does not see
it), a buffer. Every collective the checks issue is counted (helpers.comm_count), with the number
of training steps done when it ran.
"""
from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from tests.conftest import launch_ranks

NPROC = 2
JOB_SEEDS = 300  # the diagnose jobs use seeds 300, 301, ...
# name: (steps, every, planted: (after step, on rank, tensor, how) or None)
CASES = {
    "healthy": (6, 1, None),
    "one ulp at step 2": (6, 1, (2, 1, "a.weight", "ulp")),
    "+d and -d at step 0": (5, 1, (0, 1, "b.weight", "cancel")),
    "a buffer at step 1": (5, 1, (1, 1, "norm.running_var", "ulp")),
    "different from the start": (4, 1, (-1, 1, "b.bias", "ulp")),
    "every 3 steps": (10, 3, (4, 1, "a.bias", "ulp")),
    "the last, partial interval": (10, 4, (9, 1, "norm.num_batches_tracked", "plus one")),
    "two tensors": (6, 2, (1, 1, "a.bias+b.weight", "ulp")),
}
BYTES_PER_TENSOR = 64


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = nn.Linear(128, 128)
        self.norm = nn.BatchNorm1d(128)
        self.b = nn.Linear(128, 8)
        with torch.no_grad():
            for p in (self.a.weight, self.a.bias, self.b.bias):
                p.copy_(torch.randn(p.shape, generator=gen))
            self.b.weight.copy_(torch.randint(-50, 50, self.b.weight.shape, generator=gen).float())


def plant(t: torch.Tensor, how: str) -> None:
    flat = t.view(-1)
    if how == "ulp":
        flat[7] = torch.nextafter(flat[7], torch.tensor(float("inf"), dtype=t.dtype))
    elif how == "last ulp":
        flat[-1] = torch.nextafter(flat[-1], torch.tensor(float("inf"), dtype=t.dtype))
    elif how == "swap":
        flat[3], flat[11] = flat[11].clone(), flat[3].clone()
    elif how == "flip":
        flat[-1] = ~flat[-1]
    elif how == "cancel":  # whole numbers: both changes exact, the plain sum unchanged
        flat[3] += 5
        flat[11] -= 5
    elif how == "plus one":
        flat[0] += 1


def update_(t: torch.Tensor, step: int, integers: bool) -> None:
    """The same update on every rank: whole numbers stay whole, flags stay flags."""
    if t.dtype == torch.bool:
        return
    t.add_(1 if integers or not t.is_floating_point() else 0.001 * (step + 1))


def run_case(find_divergence, rank: int, steps: int, every: int, planted, make=None, group=None) -> dict:
    """Train `make()` (default Model) under find_divergence with `planted` on one rank; `rank` is
    the rank in `group` that `planted` names."""
    from helpers.comm_count import count_collectives

    model = (make or Model)()
    state = model.state_dict()
    calls = []

    def apply_plant(step: int) -> None:
        if planted and planted[0] == step and rank == planted[1]:
            for name in planted[2].split("+"):
                plant(state[name], planted[3])

    apply_plant(-1)
    with count_collectives() as log:
        def train_step(step: int) -> None:
            calls.append((step, len(log.ops)))
            with log.paused(), torch.no_grad():
                for name, t in state.items():
                    update_(t, step, integers=name == "b.weight")
                apply_plant(step)

        found = find_divergence(model, train_step, steps, every, group)
    # which checkpoint (steps done) each collective ran at
    marks = [n for _, n in calls]
    at = [sum(1 for m in marks if m <= i) for i in range(len(log.ops))]
    per_check: dict[int, int] = {}
    for done, (_, nbytes) in zip(at, log.ops):
        per_check[done] = per_check.get(done, 0) + nbytes
    return {"found": None if found is None else {"step": found.step, "last_agreed": found.last_agreed,
                                                 "names": list(found.names), "ranks": list(found.ranks)},
            "steps_called": [s for s, _ in calls], "checkpoints": sorted(per_check),
            "bytes_per_check": max(per_check.values(), default=0), "n_tensors": len(state),
            "model_bytes": sum(t.nbytes for t in state.values())}


def expected(steps: int, every: int, planted, make=None, world_size: int = NPROC) -> dict:
    """What find_divergence must find (planted[1] is a rank of the group the case runs on)."""
    checks = sorted(set(range(0, steps + 1, every)) | {steps})
    if planted is None:
        return {"found": None, "checkpoints": checks, "steps_called": list(range(steps))}
    visible = planted[0] + 1  # steps done when the difference first exists
    step = next(c for c in checks if c >= visible)
    before = [c for c in checks if c < step]
    names = [n for n in (make or Model)().state_dict() if n in planted[2].split("+")]
    return {"found": {"step": step, "last_agreed": before[-1] if before else None, "names": names,
                      "ranks": [planted[1]] if planted[1] else list(range(1, world_size))},
            "checkpoints": checks[:checks.index(step) + 1], "steps_called": list(range(step))}


# ---------------------------------------------------------------------------------------- launch
@pytest.fixture(scope="module")
def ranks():
    return launch_ranks(__file__, "cases", nproc=NPROC, env={"DIST_TIMEOUT": "60"})


def divergence_reports(ranks) -> dict:
    from helpers.exercise import solved
    return {rank: solved(ranks[rank]["find_divergence"]) for rank in range(NPROC)}


# ----------------------------------------------------------------------------- find_divergence
@pytest.mark.exercise("find_divergence")
@pytest.mark.parametrize("name", list(CASES))
def test_find_divergence_reports_the_first_step_and_tensors(ranks, name):
    reps = divergence_reports(ranks)
    steps, every, planted = CASES[name]
    want = expected(steps, every, planted)
    for rank, rep in reps.items():
        got = rep[name]["found"]
        if want["found"] is None:
            assert got is None, (f"{name}: rank {rank} reported {got}, but every rank holds the same "
                                 "model at every check: return None")
            continue
        assert got is not None, (
            f"{name}: rank {rank} returned None, but after step {planted[0]} rank {planted[1]}'s "
            f"{planted[2]} differs ({planted[3]}): compare every bit of every state_dict tensor "
            "(parameters and buffers); a float sum misses one-ulp changes and +d/-d pairs")
        for key in ("step", "last_agreed", "names", "ranks"):
            assert got[key] == want["found"][key], (
                f"{name}: rank {rank} reported {key}={got[key]!r}, expected {want['found'][key]!r} "
                f"(checks run at steps {want['checkpoints']}; the difference exists from step "
                f"{planted[0] + 1} on)")


@pytest.mark.exercise("find_divergence")
@pytest.mark.parametrize("name", list(CASES))
def test_find_divergence_trains_in_order_and_stops_at_the_first_failed_check(ranks, name):
    steps, every, planted = CASES[name]
    want = expected(steps, every, planted)
    for rank, rep in divergence_reports(ranks).items():
        assert rep[name]["steps_called"] == want["steps_called"], (
            f"{name}: rank {rank} called train_step with {rep[name]['steps_called']}; expected "
            f"{want['steps_called']}: steps 0, 1, ... in order, and none after a failed check")


@pytest.mark.exercise("find_divergence")
@pytest.mark.parametrize("name", list(CASES))
def test_find_divergence_checks_only_at_its_checkpoints_with_few_bytes(ranks, name):
    steps, every, planted = CASES[name]
    want = expected(steps, every, planted)
    for rank, rep in divergence_reports(ranks).items():
        r = rep[name]
        assert r["checkpoints"] == want["checkpoints"], (
            f"{name}: rank {rank} communicated after steps {r['checkpoints']}; checks belong "
            f"before the first step and after every {every} steps (and after the last): "
            f"{want['checkpoints']}")
        limit = BYTES_PER_TENSOR * r["n_tensors"]
        assert r["bytes_per_check"] <= limit, (
            f"{name}: rank {rank} put {r['bytes_per_check']} bytes into collectives in one check, "
            f"more than {BYTES_PER_TENSOR} per tensor ({limit}); the model holds {r['model_bytes']} "
            "bytes: send checksums, never the tensors")


@pytest.mark.exercise("find_divergence")
def test_find_divergence_gives_every_rank_the_same_answer(ranks):
    reps = divergence_reports(ranks)
    for name in CASES:
        answers = {rank: rep[name]["found"] for rank, rep in reps.items()}
        assert len({repr(a) for a in answers.values()}) == 1, (
            f"{name}: the ranks disagree about the divergence: {answers}; decide from data every "
            "rank has (e.g. an all-gather of every rank's checksums)")


@pytest.mark.exercise("find_divergence")
def test_find_divergence_rejects_bad_arguments(ranks):
    for rank, rep in divergence_reports(ranks).items():
        assert rep["bad arguments"] == ["ValueError", "ValueError"], (
            f"rank {rank}: every=0 and steps=-1 gave {rep['bad arguments']}; raise ValueError")


# ----------------------------------------------------------------------------------- diagnose
def job_list() -> list[tuple[str, int]]:
    from labs.lab10_diagnose import BUGS
    return [(bug, JOB_SEEDS + i) for i, bug in enumerate(sorted(BUGS))]


HINTS = {
    "healthy": "nothing is wrong with this job: every check should pass",
    "collective_on_one_rank": "the job failed; compare how many collectives each rank's flight recorder holds",
    "collectives_in_different_orders": "the job failed; the ranks issued as many collectives, but not the same ones",
    "different_initialisation": "param_digest differs across ranks from index 0 (before training)",
    "random_state": "param_digest agrees at first and differs from a later step on",
    "buffer_not_synchronised": "param_digest agrees everywhere, buffer_digest does not",
    "no_set_epoch": "each rank's epoch 1 visits its samples in epoch 0's order",
    "no_distributed_sampler": "every rank trained on the same samples",
    "loss_logged_from_one_rank": "logged_loss is not the mean of the ranks' local_loss",
    "gradients_summed": "grad_norm[0] is world_size times reference_grad_norm",
    "gradients_averaged_twice": "grad_norm[0] is reference_grad_norm / world_size",
}


@pytest.mark.exercise("diagnose")
@pytest.mark.parametrize("bug", sorted(HINTS))
def test_diagnose_names_the_planted_bug(ranks, bug):
    from labs.lab10_diagnose import diagnose, outputs_from_dict

    jobs = job_list()
    outputs = ranks[0]["jobs"]
    index = [b for b, _ in jobs].index(bug)
    said = diagnose(outputs_from_dict(outputs[index]))
    assert said == bug, f"a job with bug {bug!r} was diagnosed as {said!r}; its signature: {HINTS[bug]}"


@pytest.mark.exercise("diagnose")
def test_diagnose_answers_with_a_name_from_bugs(ranks):
    from labs.lab10_diagnose import BUGS, diagnose, outputs_from_dict

    for out in ranks[0]["jobs"]:
        said = diagnose(outputs_from_dict(out))
        assert said in BUGS, f"diagnose returned {said!r}; return one of {sorted(BUGS)}"


# ---------------------------------------------------------------------------------------- worker
def worker() -> None:
    import torch.distributed as dist

    from helpers.dist import distributed
    from helpers.exercise import stub_message
    from labs.lab10_diagnose import gather_outputs, run_jobs
    from labs.lab10_divergence import find_divergence

    with distributed() as ctx:
        message = stub_message(find_divergence)
        if message:
            ctx.report(find_divergence={"unsolved": message})
        else:
            cases = {name: run_case(find_divergence, ctx.rank, *spec) for name, spec in CASES.items()}
            bad = []
            for steps, every in ((3, 0), (-1, 1)):
                try:
                    find_divergence(Model(), lambda s: None, steps, every)
                    bad.append("no error")
                except Exception as exc:  # noqa: BLE001: the test reports what was raised
                    bad.append(type(exc).__name__)
            cases["bad arguments"] = bad
            ctx.report(find_divergence=cases)
        dist.barrier()
        outputs = gather_outputs(run_jobs(job_list(), ctx.rank, ctx.world_size), ctx.world_size)
        if ctx.rank == 0:
            ctx.report(jobs=outputs)


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    worker()
