"""Hidden tests of lab 10's exercises, `find_divergence` and `diagnose`.

Stricter than the public ones: 4 ranks; a swap of two elements far apart, on another rank; the
odd rank being rank 0 (then every other rank differs from it) or the last rank; +1/-1 on two bytes
65,536 and 131,042 bytes apart (position weights modulo 2^16, or modulo 65,521 met twice); the
last element of a tensor whose byte count is not a multiple of 4 or 8; bfloat16 parameters, int32
and bool buffers; no training at all; `every` larger than `steps`; a sub-group that leaves ranks
out; a model of 40 tensors (bytes per check); every bug of BUGS on 4 ranks and most on 2 or 3,
with other seeds (so other forms of each bug) than the public tests, plus random plants.
One launch on 4 ranks; this file is its worker. The model, the planting, the counting and the
failure messages come from the public tests (tests/public/test_lab10_debugging.py).
"""
from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from tests.harness import launch_ranks
from tests.public.test_lab10_debugging import (HINTS, Model, assert_diagnosed, expected, missed,
                                               run_case, wrong_field)

NPROC = 4
SUBGROUP = [0, 2]


class Mixed(nn.Module):
    """Odd sizes and dtypes: a (257, 255) float32 weight, a bfloat16 vector, int32 and bool buffers."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.big = nn.Parameter(torch.randn(257, 255, generator=gen))
        self.low = nn.Parameter(torch.randn(5, generator=gen).to(torch.bfloat16))
        self.register_buffer("counts", torch.arange(3, dtype=torch.int32))
        self.register_buffer("mask", torch.tensor([True, False, True]))


class Many(nn.Module):
    """40 small tensors."""

    def __init__(self):
        super().__init__()
        from helpers.tensors import seeded
        with seeded(3):
            self.layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(20)])


# name: (steps, every, planted (after step, on group rank, tensor, how) or None, model, on subgroup)
CASES = {
    "a swap of two elements far apart": (5, 1, (2, 2, "b.weight", "swap far"), Model, False),
    "rank 0 is the odd one": (5, 1, (1, 0, "a.weight", "swap"), Model, False),
    "only the last rank differs": (4, 1, (2, 3, "a.bias", "plus one"), Model, False),
    "+1 and -1 65,536 bytes apart": (3, 1, (1, 1, "big", "bytes apart 65536"), Mixed, False),
    "+1 and -1 131,042 bytes apart": (3, 1, (0, 2, "big", "bytes apart 131042"), Mixed, False),
    "the last element of an odd-sized tensor": (4, 1, (1, 1, "big", "last ulp"), Mixed, False),
    "a bfloat16 parameter": (4, 2, (0, 2, "low", "last ulp"), Mixed, False),
    "a bool buffer": (4, 1, (2, 1, "mask", "flip"), Mixed, False),
    "no training": (0, 1, None, Model, False),
    "every larger than steps": (3, 5, (2, 1, "a.bias", "ulp"), Model, False),
    "healthy, 40 tensors": (4, 1, None, Many, False),
    "a sub-group without ranks 1 and 3": (5, 1, (1, 1, "a.weight", "ulp"), Model, True),
}
# (bug, seed, ranks): other seeds than the public tests', so other forms of each bug
JOBS = [
    ("healthy", 700, 4), ("healthy", 701, 2),
    ("collective_on_one_rank", 709, 4), ("collective_on_one_rank", 716, 3),
    ("collectives_in_different_orders", 708, 4), ("collectives_in_different_orders", 731, 4),
    ("collectives_in_different_orders", 703, 2),
    ("different_initialisation", 719, 4), ("different_initialisation", 706, 3),
    ("random_state", 702, 4), ("random_state", 726, 4),
    ("buffer_not_synchronised", 704, 4),
    ("no_set_epoch", 710, 4), ("no_set_epoch", 705, 2),
    ("no_distributed_sampler", 733, 4), ("no_distributed_sampler", 707, 3),
    ("loss_logged_from_one_rank", 711, 4), ("loss_logged_from_one_rank", 712, 3),
    ("gradients_summed", 713, 4),
    ("gradients_averaged_twice", 714, 4), ("gradients_averaged_twice", 715, 3),
]
RANDOM_JOBS = [(911, 4), (912, 3), (913, 4), (914, 2)]  # (seed, ranks); the bug is plant(seed)


@pytest.fixture(scope="module")
def ranks():
    return launch_ranks(__file__, "cases", nproc=NPROC, env={"DIST_TIMEOUT": "60"})


def divergence_reports(ranks) -> dict:
    from helpers.notice import solved
    return {rank: solved(ranks[rank]["find_divergence"]) for rank in range(NPROC)}


def members(name: str) -> list[int]:
    return SUBGROUP if CASES[name][4] else list(range(NPROC))


@pytest.mark.exercise("find_divergence")
@pytest.mark.points(2)
@pytest.mark.parametrize("name", list(CASES))
def test_find_divergence_hidden_cases(ranks, name):
    """find_divergence gives the right answer, steps and checks, cheaply, in tricky cases on 4 ranks."""
    reps = divergence_reports(ranks)
    steps, every, planted, make, _ = CASES[name]
    want = expected(steps, every, planted, make, world_size=len(members(name)))
    for rank in members(name):
        r = reps[rank][name]
        if want["found"] is None:
            assert r["found"] is None, f"{name}: rank {rank} reported {r['found']}, expected None"
        else:
            planter = reps[members(name)[planted[1]]][name]  # what the rank that planted it measured
            assert r["found"] is not None, f"rank {rank}: " + missed(name, steps, every, planted, planter)
            assert r["found"]["step"] <= want["found"]["step"], f"rank {rank}: " + missed(
                name, steps, every, planted, planter, f"you reported step={r['found']['step']}, later than "
                f"{want['found']['step']}")
            for key in ("step", "last_agreed", "names", "ranks"):
                assert r["found"][key] == want["found"][key], (
                    f"rank {rank}: " + wrong_field(name, key, r["found"], want["found"], every, planted))
        assert r["steps_called"] == want["steps_called"], (
            f"{name}: rank {rank} trained steps {r['steps_called']}, expected {want['steps_called']}")
        assert r["checkpoints"] == want["checkpoints"], (
            f"{name}: rank {rank} communicated after steps {r['checkpoints']}, expected {want['checkpoints']}")
        assert r["bytes_per_check"] <= 64 * r["n_tensors"], (
            f"{name}: rank {rank} sent {r['bytes_per_check']} bytes in one check for {r['n_tensors']} tensors")
    if CASES[name][4]:
        for outside in sorted(set(range(NPROC)) - set(SUBGROUP)):
            assert reps[outside][name] == "not a member", \
                f"rank {outside} is outside the sub-group and must not take part"


@pytest.mark.exercise("diagnose")
@pytest.mark.points(2)
@pytest.mark.parametrize("bug", sorted(HINTS))
def test_diagnose_on_other_jobs(ranks, bug):
    """diagnose names the planted bug of jobs on 2 to 4 ranks, in forms the public tests do not show."""
    assert_diagnosed(bug, ranks[0]["job_list"], ranks[0]["jobs"], skip_seeds=dict(RANDOM_JOBS))


@pytest.mark.exercise("diagnose")
def test_diagnose_on_random_plants(ranks):
    """diagnose names the bug of jobs whose bug was drawn at random."""
    from helpers.mystery_jobs import outputs_from_dict
    from labs.lab10_diagnose import diagnose

    jobs, outputs = ranks[0]["job_list"], ranks[0]["jobs"]
    wrong = [(seed, bug, diagnose(outputs_from_dict(out))) for (bug, seed, _), out in zip(jobs, outputs)
             if seed in dict(RANDOM_JOBS) and diagnose(outputs_from_dict(out)) != bug]
    assert not wrong, f"wrong diagnoses (seed, planted, said): {wrong}"


def worker() -> None:
    import torch.distributed as dist

    from helpers.dist import distributed
    from helpers.notice import stub_message
    from helpers.mystery_jobs import gather_outputs, plant, run_jobs
    from labs.lab10_divergence import find_divergence

    with distributed() as ctx:
        subgroup = dist.new_group(SUBGROUP)  # every rank calls new_group, members or not
        message = stub_message(find_divergence)
        if message:
            ctx.report(find_divergence={"unsolved": message})
        else:
            cases = {}
            for name, (steps, every, planted, make, on_subgroup) in CASES.items():
                if on_subgroup and ctx.rank not in SUBGROUP:
                    cases[name] = "not a member"
                    continue
                group_rank = SUBGROUP.index(ctx.rank) if on_subgroup else ctx.rank
                cases[name] = run_case(find_divergence, group_rank, steps, every, planted, make,
                                       subgroup if on_subgroup else None)
            ctx.report(find_divergence=cases)
        dist.barrier()
        jobs = JOBS + [(plant(seed), seed, world) for seed, world in RANDOM_JOBS]
        outputs = gather_outputs(run_jobs(jobs, ctx.rank, ctx.world_size), ctx.world_size)
        if ctx.rank == 0:
            ctx.report(jobs=outputs, job_list=jobs)


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    worker()
