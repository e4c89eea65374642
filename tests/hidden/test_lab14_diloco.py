"""Hidden tests of lab 14's exercise, `DiLoCo.outer_step` (labs/lab14_diloco.py).

One launch on 4 ranks (this file is also the worker):
- 4 replicas, H = 2, an outer SGD with plain (not Nesterov) momentum and another lr, a wider model:
  against torchft's DiLoCo after every step, as the public tests do (their code: parameters,
  anchor, both optimizers' states, replicas identical, bytes of the outer step);
- two DiLoCo jobs side by side, replicas {0, 1} and {2, 3} (`group=` a sub-group), H = 5:
  against the documented outer step written here (torchft's lighthouse would join all four in one
  quorum), the replicas of a job identical, the two jobs apart, and each job's outer step sending
  its pseudo-gradients over its own group only.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labs.lab14_diloco import INNER_LR, DiLoCo, toy_batch, toy_model
from tests.harness import launch_ranks
from tests.public.test_lab14_diloco import (ATOL, NEEDS, Misread, StudentError, _diff, _params,
                                            check_anchor, check_parameters, check_replicas_agree,
                                            check_states, check_traffic, run_cases,
                                            side_by_side)

pytestmark = pytest.mark.exercise("DiLoCo.outer_step")
NPROC = 4
PLAIN = {"lr": 0.5, "momentum": 0.8, "nesterov": False}
JOBS = [[0, 1], [2, 3]]


def in_groups(ctx, sync_every: int, rounds: int) -> dict:
    """Two DiLoCo jobs on sub-groups: yours and the documented outer step, side by side."""
    from helpers.comm_count import count_collectives
    from helpers.dist import new_group

    groups = [new_group(ranks, name=f"diloco job {j}") for j, ranks in enumerate(JOBS)]
    job = next(j for j, ranks in enumerate(JOBS) if ctx.rank in ranks)
    group = groups[job]

    def trio():
        model = toy_model(12, seed=5)
        return (model, torch.optim.AdamW(model.parameters(), lr=INNER_LR),
                torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True))

    mine = DiLoCo(*trio(), sync_every, group=group)
    documented = Misread(*trio(), sync_every, group=group, how="as documented")
    report = {"steps": [], "calls": [], "job": job}
    for step in range(sync_every * rounds):
        x, y = toy_batch(step, ctx.rank)
        for model, inner in ((mine.model, mine.inner_optimizer), (documented.model, documented.inner_optimizer)):
            inner.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
        with count_collectives() as log:
            try:
                synced = mine.step()
            except Exception as exc:
                raise StudentError(f"your DiLoCo.outer_step raised {type(exc).__name__}: {exc}") from exc
        documented.step()
        report["steps"].append(_diff(_params(mine.model), _params(documented.model)))
        if synced:
            report["calls"].append([[c.kind, c.nbytes, c.world_size] for c in log])
    flat = torch.cat([p.detach().reshape(-1) for p in mine.model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, flat)
    report["differs from rank"] = [(flat - other).abs().max().item() for other in everyone]
    report["param_bytes"] = 4 * flat.numel()
    return report


CASES = {
    "4 replicas, H=2, plain momentum": lambda ctx: side_by_side(ctx, sync_every=2, rounds=3, outer=PLAIN,
                                                                  width=24, seed=3),
    "two jobs of 2 replicas, H=5": lambda ctx: in_groups(ctx, sync_every=5, rounds=2),
}


@pytest.fixture(scope="module")
def ranks():
    return launch_ranks(__file__, "cases", nproc=NPROC, timeout=300, needs=NEEDS, env={"DIST_TIMEOUT": "30"})


def reports(ranks, name: str) -> list[dict]:
    out = []
    for rank in range(NPROC):
        cases = ranks[rank].get("cases", {})
        assert name in cases, f"rank {rank} reported no result for case {name!r}"
        out.append(cases[name])
    return out


FOUR = "4 replicas, H=2, plain momentum"
JOBS_CASE = "two jobs of 2 replicas, H=5"


def test_four_replicas_match_torchft_after_every_step(ranks):
    """4 replicas, H = 2, plain momentum: parameters equal torchft's after every step."""
    check_parameters(reports(ranks, FOUR), FOUR)


def test_four_replicas_agree_and_keep_their_states(ranks):
    """4 replicas: identical after each outer step; anchor, outer momentum and inner state as torchft's."""
    rs = reports(ranks, FOUR)
    check_replicas_agree(rs, FOUR)
    check_anchor(rs, FOUR)
    check_states(rs, FOUR)


def test_four_replicas_outer_step_traffic(ranks):
    """4 replicas: the outer step sends the pseudo-gradients once, nothing else."""
    check_traffic(reports(ranks, FOUR), FOUR)


def test_jobs_on_sub_groups_follow_the_documented_step(ranks):
    """Two jobs on sub-groups, H = 5: each equals the documented outer step over its own group."""
    rs = reports(ranks, JOBS_CASE)
    for rank, r in enumerate(rs):
        for step, diff in enumerate(r["steps"]):
            assert diff <= ATOL, (
                f"{JOBS_CASE}, rank {rank}: after inner step {step} your parameters differ from the documented "
                f"outer step over self.group by {diff:.3g}: average over the replicas of self.group "
                "(all-reduce on it, divide by its size), not over every rank")


def test_jobs_on_sub_groups_stay_apart_and_talk_within(ranks):
    """Two jobs: replicas of a job identical, the two jobs different, the outer step on the job's group."""
    rs = reports(ranks, JOBS_CASE)
    for rank, r in enumerate(rs):
        for other, diff in enumerate(r["differs from rank"]):
            same_job = rs[other]["job"] == r["job"]
            assert (diff == 0.0) == same_job, (
                f"{JOBS_CASE}: ranks {rank} and {other} ({'same' if same_job else 'different'} job) differ by "
                f"{diff:.3g}; replicas of one job must agree and the jobs must not mix")
        for calls in r["calls"]:
            sizes = {size for _, _, size in calls}
            assert sizes == {2} and sum(n for _, n, _ in calls) == r["param_bytes"], (
                f"{JOBS_CASE}, rank {rank}: an outer step sent {calls} (kind, bytes, group size); it sends the "
                f"pseudo-gradients ({r['param_bytes']} bytes) over self.group, of 2 replicas")


if __name__ == "__main__" and sys.argv[1:2] == ["cases"]:
    run_cases(CASES)
