"""Hidden tests of lab 10's exercises, `find_divergence` and `diagnose`.

Stricter than the public ones: 3 ranks; a swap of two elements (no order-blind checksum sees it);
the odd rank being rank 0 (then every other rank differs from it); the last element of a tensor
whose byte count is not a multiple of 4 or 8; bfloat16 parameters, int32 and bool buffers; no
training at all; `every` larger than `steps`; a sub-group that leaves a rank out; a model of 40
tensors (bytes per check); every bug of BUGS on 3 ranks with other seeds, plus random plants.
One launch on 3 ranks; this file is its worker. The model, the planting and the counting come
from the public tests (tests/public/test_lab10_debugging.py).
"""
from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from tests.conftest import launch_ranks
from tests.public.test_lab10_debugging import HINTS, Model, expected, run_case

NPROC = 3
SUBGROUP = [0, 2]
JOB_SEEDS = 700
EXTRA_SEEDS = [911, 912, 913, 914]


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
    "a swap of two elements": (5, 1, (2, 2, "b.weight", "swap"), Model, False),
    "rank 0 is the odd one": (5, 1, (1, 0, "a.weight", "ulp"), Model, False),
    "the last element of an odd-sized tensor": (4, 1, (1, 1, "big", "last ulp"), Mixed, False),
    "a bfloat16 parameter": (4, 2, (0, 2, "low", "last ulp"), Mixed, False),
    "a bool buffer": (4, 1, (2, 1, "mask", "flip"), Mixed, False),
    "no training": (0, 1, None, Model, False),
    "every larger than steps": (3, 5, (2, 1, "a.bias", "ulp"), Model, False),
    "healthy, 40 tensors": (4, 1, None, Many, False),
    "a sub-group without rank 1": (5, 1, (1, 1, "a.weight", "ulp"), Model, True),
}


@pytest.fixture(scope="module")
def ranks():
    return launch_ranks(__file__, "cases", nproc=NPROC, env={"DIST_TIMEOUT": "60"})


def divergence_reports(ranks) -> dict:
    from helpers.exercise import solved
    return {rank: solved(ranks[rank]["find_divergence"]) for rank in range(NPROC)}


def members(name: str) -> list[int]:
    return SUBGROUP if CASES[name][4] else list(range(NPROC))


@pytest.mark.exercise("find_divergence")
@pytest.mark.points(2)
@pytest.mark.parametrize("name", list(CASES))
def test_find_divergence_hidden_cases(ranks, name):
    """find_divergence gives the right answer, steps and checks, cheaply, in tricky cases on 3 ranks."""
    reps = divergence_reports(ranks)
    steps, every, planted, make, _ = CASES[name]
    want = expected(steps, every, planted, make, world_size=len(members(name)))
    for rank in members(name):
        r = reps[rank][name]
        assert r["found"] == want["found"], (
            f"{name}: rank {rank} reported {r['found']}, expected {want['found']}")
        assert r["steps_called"] == want["steps_called"], (
            f"{name}: rank {rank} trained steps {r['steps_called']}, expected {want['steps_called']}")
        assert r["checkpoints"] == want["checkpoints"], (
            f"{name}: rank {rank} communicated after steps {r['checkpoints']}, expected {want['checkpoints']}")
        assert r["bytes_per_check"] <= 64 * r["n_tensors"], (
            f"{name}: rank {rank} sent {r['bytes_per_check']} bytes in one check for {r['n_tensors']} tensors")
    if CASES[name][4]:
        assert reps[1][name] == "not a member", "rank 1 is outside the sub-group and must not take part"


@pytest.mark.exercise("diagnose")
@pytest.mark.points(2)
@pytest.mark.parametrize("bug", sorted(HINTS))
def test_diagnose_on_three_ranks(ranks, bug):
    """diagnose names the planted bug of a 3-rank job, for every bug in BUGS."""
    from labs.lab10_diagnose import diagnose, outputs_from_dict

    jobs = ranks[0]["job_list"]
    index = [b for b, _ in jobs].index(bug)
    said = diagnose(outputs_from_dict(ranks[0]["jobs"][index]))
    assert said == bug, f"3 ranks, seed {jobs[index][1]}: a job with bug {bug!r} was diagnosed as {said!r}"


@pytest.mark.exercise("diagnose")
def test_diagnose_on_random_plants(ranks):
    """diagnose names the bug of 3-rank jobs with randomly planted bugs."""
    from labs.lab10_diagnose import diagnose, outputs_from_dict

    jobs, outputs = ranks[0]["job_list"], ranks[0]["jobs"]
    wrong = [(seed, bug, diagnose(outputs_from_dict(out))) for (bug, seed), out in zip(jobs, outputs)
             if seed in EXTRA_SEEDS and diagnose(outputs_from_dict(out)) != bug]
    assert not wrong, f"wrong diagnoses (seed, planted, said): {wrong}"


def worker() -> None:
    import torch.distributed as dist

    from helpers.dist import distributed
    from helpers.exercise import stub_message
    from labs.lab10_diagnose import BUGS, gather_outputs, plant, run_jobs
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
        jobs = [(bug, JOB_SEEDS + i) for i, bug in enumerate(sorted(BUGS))]
        jobs += [(plant(seed), seed) for seed in EXTRA_SEEDS]
        outputs = gather_outputs(run_jobs(jobs, ctx.rank, ctx.world_size), ctx.world_size)
        if ctx.rank == 0:
            ctx.report(jobs=outputs, job_list=jobs)


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    worker()
