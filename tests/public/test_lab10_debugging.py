"""Public tests of lab 10's exercises: `find_divergence` (labs/lab10_divergence.py) and
`diagnose` (labs/lab10_diagnose.py).

Run:  .venv/bin/python -m pytest tests/public/test_lab10_debugging.py -q

One launch on 3 ranks (this file is its worker) runs every find_divergence case and the mystery
jobs of JOBS (on 2 and on 3 of the ranks); diagnose then runs here, on each job's outputs. A
find_divergence case trains a small model (a 128x128 Linear, BatchNorm with an int64 buffer, a
Linear whose weights are whole numbers) with the same deterministic update on every rank, and
plants one difference on one rank after a chosen step: one ulp in one element, +d and -d in two
elements, two elements swapped, +1 and -1 on two bytes 65,521 bytes apart, a buffer. Every
collective the checks issue is counted (helpers.comm_count), with the number of training steps
done when it ran; the worker also measures what a float sum and a sum of squares of the planted
tensor see, so that a failure message says what this run shows.
"""
from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from tests.harness import launch_ranks

NPROC = 3
# name: (steps, every, planted: (after step, on rank, tensor(s) joined by "+", how) or None)
CASES = {
    "healthy": (6, 1, None),
    "one ulp at step 2": (6, 1, (2, 1, "a.weight", "ulp")),
    "+d and -d at step 0": (5, 1, (0, 1, "b.weight", "cancel")),
    "two elements swapped at step 1": (4, 1, (1, 1, "b.weight", "swap")),  # whole numbers: float sums exact
    "+1 and -1 65,521 bytes apart at step 2": (4, 1, (2, 1, "a.weight", "bytes apart 65521")),
    # from here on the plant is large ("plus one": one element 1 larger), so that any checksum sees
    # it and a failure is about which tensors, ranks or steps are checked
    "a buffer at step 1": (5, 1, (1, 1, "norm.running_var", "plus one")),
    "an integer buffer at step 2": (4, 1, (2, 1, "norm.num_batches_tracked", "plus one")),
    "different from the start": (4, 1, (-1, 1, "b.bias", "plus one")),
    "only rank 2 differs": (4, 1, (1, 2, "a.bias", "plus one")),
    "rank 0 is the odd one": (4, 1, (2, 0, "b.bias", "plus one")),
    "every 3 steps": (10, 3, (5, 1, "a.bias", "plus one")),
    "the last, partial interval": (10, 4, (9, 1, "a.bias", "plus one")),
    "two tensors": (6, 2, (1, 1, "a.bias+b.weight", "plus one")),
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
    elif how == "swap far":
        flat[3], flat[-2] = flat[-2].clone(), flat[3].clone()
    elif how == "flip":
        flat[-1] = ~flat[-1]
    elif how == "cancel":  # whole numbers: both changes exact, the plain sum unchanged
        flat[3] += 5
        flat[11] -= 5
    elif how == "plus one":
        flat[0] += 1
    elif how.startswith("bytes apart "):  # +1 and -1 on two bytes that far apart (no carry)
        apart, raw = int(how.split()[-1]), flat.view(torch.uint8)
        first = next(i for i in range(raw.numel() - apart) if raw[i] < 255 and raw[i + apart] > 0)
        raw[first] += 1
        raw[first + apart] -= 1
    else:
        raise ValueError(how)


def what_sums_see(before: torch.Tensor, after: torch.Tensor) -> dict[str, bool]:
    """Whether each order-blind summary of the tensor changed with the plant (floats only)."""
    if not before.is_floating_point():
        return {}
    return {"a float32 sum": bool(before.float().sum() != after.float().sum()),
            "a float64 sum": bool(before.double().sum() != after.double().sum()),
            "a float64 sum of squares": bool(before.double().square().sum() != after.double().square().sum())}


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
    calls, seen = [], {}

    def apply_plant(step: int) -> None:
        if planted and planted[0] == step and rank == planted[1]:
            for name in planted[2].split("+"):
                before = state[name].clone()
                plant(state[name], planted[3])
                seen[name] = what_sums_see(before, state[name])

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
            "model_bytes": sum(t.nbytes for t in state.values()), "sums_see": seen,
            "buffers": [n for n, _ in model.named_buffers()]}


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


# ------------------------------------------------------------------ what a wrong answer means
def _sums_text(seen: dict[str, dict[str, bool]]) -> str:
    said = []
    for name, sums in seen.items():
        blind = [k for k, changed in sums.items() if not changed]
        saw = [k for k, changed in sums.items() if changed]
        if blind:
            said.append(f"measured on {name} in this run: {' and '.join(blind)} did not change"
                        + (f" ({' and '.join(saw)} did)" if saw else ""))
    return "; ".join(said)


def missed(name: str, steps: int, every: int, planted, report: dict, said: str = "you returned None") -> str:
    """Why a check missed the planted difference (returned None, or saw it late: `said`): the
    lesson of the case. `report`: run_case's record on the rank that planted it."""
    after, on_rank, tensors, how = planted
    where = "before training" if after < 0 else f"after step {after}"
    head = (f"{name}: {said}, but {where} rank {on_rank}'s {tensors.replace('+', ' and ')} "
            f"differ{'' if '+' in tensors else 's'}")
    sums = _sums_text(report["sums_see"])
    sums = f" ({sums})" if sums else ""
    if steps % every and after + 1 > steps - steps % every:
        return (f"{head}, in the last, partial interval (steps={steps}, every={every}): check once more "
                "after the last step")
    if after < 0:
        return f"{head}: the copies differ before any training; check once before the first step"
    if set(tensors.split("+")) & set(report["buffers"]):
        return (f"{head}: {tensors} is a buffer, not a parameter; check every tensor of "
                "model.state_dict() (parameters and buffers), not only model.parameters()")
    if how.startswith("swap"):
        return (f"{head}: blind to two swapped elements (two elements traded places){sums}. A "
                "checksum that ignores positions (a sum, a sum of squares, a histogram) cannot see a "
                "swap: weight each element's bits by its position")
    if how == "cancel":
        return (f"{head}: blind to +d and -d (element 3 is 5 larger, element 11 is 5 smaller){sums}. "
                "A plain sum cannot see it: weight each element's bits by its position")
    if how.startswith("bytes apart"):
        apart = int(how.split()[-1])
        return (f"{head}: blind to +1 and -1 on two bytes {apart:,} bytes apart. Position weights that "
                f"repeat with a period dividing {apart:,} (modulo 65,521, Adler-32's modulus, or modulo "
                "2^16) give both bytes the same weight, so the changes cancel: use weights that never "
                "repeat within a tensor")
    if how in ("ulp", "last ulp"):
        return (f"{head} by one ulp in one element (the smallest change of its dtype){sums}: compare the "
                "bits exactly, as integers, not a float computed from them")
    if on_rank >= 2:
        return (f"{head}, and only rank {on_rank}'s: compare every rank's checksums with group rank "
                "0's, not only rank 1's")
    if how == "plus one":
        return f"{head} (one element is 1 larger): compare every bit of every state_dict tensor"
    return f"{head} ({how}): compare every bit of every state_dict tensor"


def wrong_field(name: str, key: str, got: dict, want: dict, every: int, planted) -> str:
    """Why a reported Divergence field is wrong: the misunderstanding that usually gives it."""
    g, w = got[key], want[key]
    head = f"{name}: you reported {key}={g!r}, expected {w!r}"
    if key == "step":
        readings = []
        if g == w - 1:
            readings.append("the index of the last train_step called")
        if g == want["last_agreed"]:
            readings.append("the last check that passed (that is last_agreed)")
        if g == 0 and w > 0:
            readings.append("the first check made")
        if readings:
            return (f"{head}: step is the number of training steps done at the first check that failed, "
                    f"not {', nor '.join(readings)}")
        if g > w:
            return f"{head}: check before the first step and after every {every} steps, and stop at the first failure"
        return f"{head}: the difference exists only from step {planted[0] + 1} on"
    if key == "last_agreed":
        return f"{head}: last_agreed is the step of the check before the failing one (None when the first check fails)"
    if key == "names":
        lost, extra = [n for n in w if n not in g], [n for n in g if n not in w]
        if lost:
            return f"{head}: {lost} differ too; list every state_dict key whose tensor differs on some rank"
        if extra:
            return f"{head}: {extra} agree on every rank"
        return f"{head}: list the names in state_dict order"
    if planted[1] == 0 and g == [0]:
        return (f"{head}: ranks are those whose copy differs from group rank 0's; when rank 0 is the odd "
                "one, every other rank differs from it")
    if any(r >= 2 for r in w) and not any(r >= 2 for r in g):
        return f"{head}: compare every rank's copy with group rank 0's, not only rank 1's"
    return f"{head}: ranks are the group ranks whose copy differs from group rank 0's, ascending"


# ---------------------------------------------------------------------------------------- launch
@pytest.fixture(scope="module")
def ranks():
    return launch_ranks(__file__, "cases", nproc=NPROC, env={"DIST_TIMEOUT": "60"})


def divergence_reports(ranks) -> dict:
    from helpers.notice import solved
    return {rank: solved(ranks[rank]["find_divergence"]) for rank in range(NPROC)}


# ----------------------------------------------------------------------------- find_divergence
@pytest.mark.exercise("find_divergence")
@pytest.mark.parametrize("name", list(CASES))
def test_find_divergence_reports_the_first_step_and_tensors(ranks, name):
    """find_divergence finds the planted difference: its first step, the last step agreed, the tensors and the ranks."""
    reps = divergence_reports(ranks)
    steps, every, planted = CASES[name]
    want = expected(steps, every, planted)
    for rank, rep in reps.items():
        got = rep[name]["found"]
        if want["found"] is None:
            assert got is None, (f"{name}: rank {rank} reported {got}, but every rank holds the same "
                                 "model at every check: return None")
            continue
        planter = reps[planted[1]][name]  # what the rank that planted it measured
        assert got is not None, f"rank {rank}: " + missed(name, steps, every, planted, planter)
        assert got["step"] <= want["found"]["step"], f"rank {rank}: " + missed(
            name, steps, every, planted, planter,
            f"you reported step={got['step']}, later than {want['found']['step']}")
        for key in ("step", "last_agreed", "names", "ranks"):
            assert got[key] == want["found"][key], (
                f"rank {rank}: " + wrong_field(name, key, got, want["found"], every, planted)
                + f" (checks run at steps {want['checkpoints']})")


@pytest.mark.exercise("find_divergence")
@pytest.mark.parametrize("name", list(CASES))
def test_find_divergence_trains_in_order_and_stops_at_the_first_failed_check(ranks, name):
    """find_divergence calls train_step(0), train_step(1), ... in order, and none after the first failed check."""
    steps, every, planted = CASES[name]
    want = expected(steps, every, planted)
    for rank, rep in divergence_reports(ranks).items():
        got = rep[name]["steps_called"]
        why = ("steps 0, 1, ... in order, each once, and none after a failed check")
        if got[:len(want["steps_called"])] == want["steps_called"] and len(got) > len(want["steps_called"]):
            why = ("training went on after the check that should have failed: " + (
                "your checks did not see the planted difference (see this case in "
                "test_find_divergence_reports_the_first_step_and_tensors)" if rep[name]["found"] is None
                else "stop at the first failed check"))
        assert got == want["steps_called"], (
            f"{name}: rank {rank} called train_step with {got}; expected {want['steps_called']}: {why}")


@pytest.mark.exercise("find_divergence")
@pytest.mark.parametrize("name", list(CASES))
def test_find_divergence_checks_only_at_its_checkpoints_with_few_bytes(ranks, name):
    """find_divergence checks before training, every `every` steps and after the last, with few bytes per tensor."""
    steps, every, planted = CASES[name]
    want = expected(steps, every, planted)
    for rank, rep in divergence_reports(ranks).items():
        r = rep[name]
        unseen = (" (your checks did not see the planted difference, so they went on: see this case in "
                  "test_find_divergence_reports_the_first_step_and_tensors)"
                  if r["found"] is None and want["found"] is not None else "")
        assert r["checkpoints"] == want["checkpoints"], (
            f"{name}: rank {rank} communicated after steps {r['checkpoints']}; checks belong "
            f"before the first step and after every {every} steps (and after the last), up to the "
            f"first that fails: {want['checkpoints']}{unseen}")
        limit = BYTES_PER_TENSOR * r["n_tensors"]
        assert r["bytes_per_check"] <= limit, (
            f"{name}: rank {rank} put {r['bytes_per_check']} bytes into collectives in one check, "
            f"more than {BYTES_PER_TENSOR} per tensor ({limit}); the model holds {r['model_bytes']} "
            "bytes: send checksums, never the tensors")


@pytest.mark.exercise("find_divergence")
def test_find_divergence_gives_every_rank_the_same_answer(ranks):
    """Every rank's find_divergence returns the same answer."""
    reps = divergence_reports(ranks)
    for name in CASES:
        answers = {rank: rep[name]["found"] for rank, rep in reps.items()}
        assert len({repr(a) for a in answers.values()}) == 1, (
            f"{name}: the ranks disagree about the divergence: {answers}; decide from data every "
            "rank has (e.g. an all-gather of every rank's checksums)")


@pytest.mark.exercise("find_divergence")
def test_find_divergence_rejects_bad_arguments(ranks):
    """find_divergence raises ValueError for every < 1 and for steps < 0."""
    for rank, rep in divergence_reports(ranks).items():
        assert rep["bad arguments"] == ["ValueError", "ValueError"], (
            f"rank {rank}: every=0 and steps=-1 gave {rep['bad arguments']}; raise ValueError")


# ----------------------------------------------------------------------------------- diagnose
# (bug, seed, ranks): each bug on 2 and on 3 ranks, the seeds picked for the form of the bug
# (labs/lab10_diagnose.job_config; tests/test_lab10_debugging.py checks that they still cover):
JOBS = [
    ("healthy", 320, 2), ("healthy", 321, 3),
    ("collective_on_one_rank", 301, 2),            # rank 1 all-reduces alone
    ("collective_on_one_rank", 302, 3),            # rank 2 waits in a barrier alone
    ("collective_on_one_rank", 306, 3),            # rank 0 all-gathers alone
    ("collectives_in_different_orders", 307, 2),   # rank 0: all-reduce, broadcast; rank 1 the reverse
    ("collectives_in_different_orders", 310, 2),   # rank 1: all-reduce, all-gather; rank 0 the reverse
    ("collectives_in_different_orders", 303, 3),   # rank 2: barrier, all-reduce; the others the reverse
    ("collectives_in_different_orders", 300, 3),   # rank 1: all-gather, barrier; the others the reverse
    ("different_initialisation", 305, 2),          # every rank its own seed
    ("different_initialisation", 322, 3),          # rank 2 alone
    ("random_state", 304, 2),                      # rank 1 alone, at step 6
    ("random_state", 323, 3),                      # rank 2 alone, at step 1
    ("buffer_not_synchronised", 308, 2), ("buffer_not_synchronised", 309, 3),
    ("no_set_epoch", 312, 2),                      # 3 epochs
    ("no_set_epoch", 311, 3),                      # 2 epochs
    ("no_distributed_sampler", 313, 2),            # the whole dataset on every rank
    ("no_distributed_sampler", 319, 3),            # the same shard on every rank
    ("loss_logged_from_one_rank", 314, 2),         # each rank logs its own
    ("loss_logged_from_one_rank", 325, 3),         # rank 2's loss, sent to every rank
    ("gradients_summed", 315, 2), ("gradients_summed", 316, 3),
    ("gradients_averaged_twice", 317, 2), ("gradients_averaged_twice", 318, 3),
]
HANGS = ("collective_on_one_rank", "collectives_in_different_orders")
HINTS = {
    "healthy": "nothing is wrong with this job: every check should pass",
    "collective_on_one_rank": "the job failed; one rank's flight recorder holds one collective more than the others'",
    "collectives_in_different_orders": "the job failed; the ranks issued as many collectives, but not the same ones",
    "different_initialisation": "param_digest differs across ranks from index 0 (before training)",
    "random_state": "param_digest agrees at first and differs from a later step on",
    "buffer_not_synchronised": "param_digest agrees everywhere, buffer_digest does not",
    "no_set_epoch": "each rank's later epochs visit its samples in epoch 0's order",
    "no_distributed_sampler": "every rank trained on the same samples",
    "loss_logged_from_one_rank": "logged_loss is not the mean of the ranks' local_loss",
    "gradients_summed": "grad_norm[0] is world_size times reference_grad_norm",
    "gradients_averaged_twice": "grad_norm[0] is reference_grad_norm / world_size",
}


def misdiagnosed(bug: str, said, seed: int, job) -> str:
    """Why diagnose named the wrong bug: what this job shows that the answer overlooked."""
    from helpers.mystery_jobs import job_config

    cfg, n = job_config(seed, job.world_size), job.world_size
    head = f"a {n}-rank job (seed {seed}) with bug {bug!r} was diagnosed as {said!r}"
    if bug in HANGS and said in HANGS:
        return (f"{head}: both hang bugs end in an error like this one ({job.error[:60]!r}, blamed on rank "
                f"{job.error_rank}); its text and the rank blamed vary with timing (timed out in send or "
                "recv, connection closed), so they do not tell the bugs apart. Compare the ranks' flight "
                "records: one rank holding one collective more, or as many in another order")
    if bug in HANGS:
        return f"{head}: the job ended in an error ({job.error[:60]!r}): {HINTS[bug]}"
    if said in HANGS and job.error:  # not the planted bug's doing: the run itself failed
        return (f"{head}: this job's bug is no hang, yet it ended in an error ({job.error[:120]!r}, "
                f"rank {job.error_rank}): the run failed around the bug (a busy machine's timeout?); "
                "rerun the check")
    if said in HANGS:
        return f"{head}: this job ended without an error, so nothing hung"
    odd = "every rank" if cfg["every_rank"] else f"rank {cfg['odd_rank']} alone"
    if bug in ("different_initialisation", "random_state") and not cfg["every_rank"] and cfg["odd_rank"] >= 2:
        return (f"{head}: here only rank {cfg['odd_rank']}'s copy differs; compare every rank's digests, "
                f"not only ranks 0 and 1 ({HINTS[bug]})")
    if bug in ("different_initialisation", "random_state", "buffer_not_synchronised"):
        return f"{head}: {HINTS[bug]} (here {odd})" if bug != "buffer_not_synchronised" else f"{head}: {HINTS[bug]}"
    if bug in ("gradients_summed", "gradients_averaged_twice"):
        return (f"{head}: {HINTS[bug]}; on {n} ranks the factor is {n if bug == 'gradients_summed' else f'1/{n}'}: "
                "compare with job.world_size")
    if bug == "no_distributed_sampler":
        how = "the whole dataset" if cfg["every_rank"] else "the same shard"
        return (f"{head}: every rank trained on the same samples (here {how}); compare the ranks' samples "
                "with each other")
    if bug == "loss_logged_from_one_rank":
        how = "each rank logs its own" if cfg["every_rank"] else f"every rank logs rank {cfg['odd_rank']}'s"
        return (f"{head}: logged_loss is not the mean of the ranks' local_loss (here {how}); compare it "
                "with the mean over every rank")
    return f"{head}: {HINTS[bug]}"


def assert_diagnosed(bug: str, jobs: list, outputs: list, skip_seeds=()) -> None:
    """diagnose names `bug` on every job of `jobs` ((bug, seed, ranks) each, their outputs in
    `outputs`) that planted it, except those whose seed is in `skip_seeds`."""
    from helpers.mystery_jobs import outputs_from_dict
    from labs.lab10_diagnose import diagnose

    for (planted, seed, _), out in zip(jobs, outputs):
        if planted != bug or seed in skip_seeds:
            continue
        job = outputs_from_dict(out)
        said = diagnose(job)
        assert said == bug, misdiagnosed(bug, said, seed, job)


@pytest.mark.exercise("diagnose")
@pytest.mark.parametrize("bug", sorted(HINTS))
def test_diagnose_names_the_planted_bug(ranks, bug):
    """diagnose names the planted bug of jobs on 2 and 3 ranks, whatever form the bug takes in each."""
    assert_diagnosed(bug, JOBS, ranks[0]["jobs"])


@pytest.mark.exercise("diagnose")
def test_diagnose_answers_with_a_name_from_bugs(ranks):
    """diagnose returns one of the keys of BUGS."""
    from helpers.mystery_jobs import BUGS, outputs_from_dict
    from labs.lab10_diagnose import diagnose

    for out in ranks[0]["jobs"]:
        said = diagnose(outputs_from_dict(out))
        assert said in BUGS, f"diagnose returned {said!r}; return one of {sorted(BUGS)}"


# ---------------------------------------------------------------------------------------- worker
def worker() -> None:
    import torch.distributed as dist

    from helpers.dist import distributed
    from helpers.notice import stub_message
    from helpers.mystery_jobs import gather_outputs, run_jobs
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
        outputs = gather_outputs(run_jobs(JOBS, ctx.rank, ctx.world_size), ctx.world_size)
        if ctx.rank == 0:
            ctx.report(jobs=outputs)


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    worker()
