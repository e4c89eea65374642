"""Tests of lab 14's failure runs, end to end in one launch (labs/lab14_failures.py on one rank,
which launches the others): a whole-job restart and torchft replica groups on the same task with
the same planted failure, and the run that never failed.

- the restart: rank 1 died by SIGKILL, torchrun started every rank again, they resumed from the
  last checkpoint, repeated exactly the steps since it, and every loss is one process's;
- torchft: group 1's rank died in the middle of a step; group 0 discarded that step and trained on
  without restarting (one process, one attempt); group 1 was restarted alone, healed from group 0's
  live state (group 0 sent it once), and both ended at the same step with identical parameters;
  before the failure its losses are one process's; the manager's counts (quorums, commit votes,
  reconfigurations, all-reduces and their bytes) agree with the steps each group recorded;
- the accounting and the timeline drawn from what the ranks recorded.

Run:  .venv/bin/python -m pytest tests/test_lab14_failures.py -q
"""
from __future__ import annotations

import pytest
import torch

from labs import lab14_failures as failures_lab
from labs.lab14_restart import task_config
from tests.harness import launch_ranks

STEPS, CKPT_EVERY, KILL_AT = 8, 3, 4
GROUP = 1      # ranks per replica group (the notebook's full run: 2, FSDP inside a group)
LOSS_RTOL = 1e-4
# The runs' ranks are forks of a warm torchrun (COURSE_FORK_RANKS=1), restarts included: the
# launch takes some 30 s on a quiet 2-core machine, minutes on a busy one.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def out():
    ranks = launch_ranks("labs/lab14_failures.py", "--replicas", 2, "--group", GROUP, "--steps", STEPS,
                         "--ckpt-every", CKPT_EVERY, "--kill-at", KILL_AT, nproc=1, timeout=840,
                         env={"DIST_TIMEOUT": "30", "COURSE_FORK_RANKS": "1"})
    return ranks[0]["failures"]


def attempts(report: dict) -> list[dict]:
    return [report[f"attempt{a}"] for a in range(5) if f"attempt{a}" in report]


def test_restart_run_restarted_every_rank(out):
    ranks = out["restart"]["ranks"]
    assert ranks[1]["killed"]["step"] == KILL_AT
    for rank, report in enumerate(ranks):
        assert len(attempts(report)) == 2, f"rank {rank} ran {len(attempts(report))} attempt(s), not 2"


def test_restart_repeats_exactly_the_steps_since_the_last_checkpoint(out):
    last = KILL_AT // CKPT_EVERY * CKPT_EVERY
    a0, a1 = attempts(out["restart"]["ranks"][0])
    assert a1["load"][2] == last, f"attempt 1 loaded step {a1['load'][2]}'s checkpoint, not {last}'s"
    assert out["restart"]["account"]["steps_recomputed"] == KILL_AT - last
    assert [s[0] for s in a1["steps"]] == list(range(last, STEPS))


def test_restart_losses_are_one_process(out):
    losses, reference = out["restart"]["account"]["losses"], out["reference"]
    assert len(losses) == STEPS
    for step, (a, b) in enumerate(zip(losses, reference)):
        assert a == pytest.approx(b, rel=LOSS_RTOL), f"step {step}: {a} against one process's {b}"


def test_torchft_survivor_never_restarted_and_the_failed_group_healed(out):
    g0, g1 = (g[0] for g in out["ft"]["groups"])
    assert len(attempts(g0)) == 1, "group 0 was restarted: only the failed group may be"
    assert len(attempts(g1)) == 2, "group 1 was not restarted after its rank died"
    assert g1["killed"]["step"] == KILL_AT
    assert g1["result"]["counts"].get("healed from a peer") == 1, g1["result"]["counts"]
    assert g0["result"]["counts"].get("state sent to a healing group") == 1, g0["result"]["counts"]
    assert g0["result"]["counts"].get("should_commit: no") == 1, "the step in flight must be discarded, once"
    steps_alone = [r for r in attempts(g0)[0]["steps"] if r[7] == 1 and r[6]]
    assert steps_alone, "group 0 never trained while group 1 was down"
    healed_at = attempts(g1)[1]["heals"][0][2]
    assert healed_at > KILL_AT and attempts(g1)[1]["steps"][0][0] == healed_at


def test_torchft_groups_end_identical(out):
    g0, g1 = (g[0]["result"] for g in out["ft"]["groups"])
    assert g0["final_step"] == g1["final_step"] >= STEPS
    assert g0["params"] == g1["params"], "after healing the groups' parameters differ"


def test_torchft_losses_before_the_failure_are_one_process(out):
    reference = out["reference"]
    for step, loss, groups in out["ft"]["account"]["losses"]:
        if step < KILL_AT:
            assert groups == 2 and loss == pytest.approx(reference[step], rel=LOSS_RTOL), step


def test_manager_counts_agree_with_the_steps(out):
    """Each step: one quorum, one commit vote, one all-reduce of every gradient and the loss."""
    # rank 0's FSDP shard of every parameter (dim 0 chunked over the group's ranks), and the loss
    from labs.lab14_restart import make_model

    shard = sum(torch.chunk(torch.empty(p.shape[0]), GROUP)[0].numel() * p[0].numel()
                for p in make_model(task_config())[0].parameters())
    flat_bytes = 4 * (shard + 1)
    for g, group in enumerate(out["ft"]["groups"]):
        report = group[0]
        rows = [r for events in attempts(report) for r in events["steps"]]
        last = attempts(report)[-1]["steps"]
        counts, traffic = report["result"]["counts"], report["result"]["traffic"]
        committed = sum(1 for r in last if r[6])
        assert counts["should_commit: yes"] == committed, (g, counts)
        assert traffic["all_reduce calls"] == len(last), (g, traffic)
        assert traffic["all_reduce bytes"] == len(last) * flat_bytes, (g, traffic)
        assert counts["reconfigurations"] >= (3 if g == 0 else 1), counts   # both, alone, both again
        final = report["result"]["final_step"]
        if g == 0:     # every step from 0 committed once, one discarded
            assert sum(1 for r in rows if r[6]) == final and len(rows) == final + 1, (g, len(rows), final)
        else:          # from the step it healed to
            assert len(last) == final - attempts(report)[-1]["heals"][0][2], (g, len(last), final)


def test_accounting_and_timeline(out):
    r, f = out["restart"]["account"], out["ft"]["account"]
    assert 0 < r["kept"] < r["wall"] and r["restarts"] > 0 and r["checkpoints"] > 0
    assert f["groups"][1]["down"] > 0 and f["groups"][0]["down"] == 0
    rows = failures_lab.timeline(out)
    assert set(rows) == {"restart run", "torchft group 0", "torchft group 1"}
    assert len(rows["restart run"]["recomputed step"]) == r["steps_recomputed"]
    assert len(rows["restart run"]["restart"]) == 1 and len(rows["torchft group 1"]["down"]) == 1
    assert len(rows["torchft group 0"]["discarded step"]) == 1
    assert set(out["per_failure"]) == {"whole-job restart", "torchft"} and min(out["per_failure"].values()) > 0
