"""Fault tolerance (labs/lab03_fault_tolerance.py): a rank is killed with a real SIGKILL mid-training,
torchrun (--max-restarts=1) restarts the group, training resumes from the last checkpoint, and the
final parameters equal those of a run that never failed: one process on the global batch, which
N ranks reproduce exactly (atol 1e-6; resuming without the optimizer's momentum would be off by
about 0.1, restarting from scratch is caught by the resume step).

TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torchrun's shared TCP store (the default), the
restarted workers read the dead workers' gloo addresses and cannot connect (pytorch/pytorch#135712).
"""
from __future__ import annotations

import pytest
import torch

from labs.lab03_fault_tolerance import Run
from tests.harness import launch_ranks

SMOKE = Run.preset("smoke")
STEPS, CKPT_EVERY, KILL_AT = SMOKE.steps, SMOKE.ckpt_every, SMOKE.between_checkpoints
DATASET, LOCAL_BATCH = SMOKE.dataset_size, SMOKE.local_batch_size


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lab03_ft")
    cfg = Run.preset("smoke", ckpt_dir=str(folder), kill_rank=1, kill_at_step=KILL_AT)
    res = launch_ranks("labs/lab03_fault_tolerance.py", *cfg.argv(), nproc=2,
                       torchrun_args=["--max-restarts=1"], env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    return res, folder


def test_rank1_was_killed_and_the_group_restarted(killed_run):
    res, _ = killed_run
    assert res[1]["killed_at_step"] == KILL_AT
    assert "exitcode: -9" in res.output or "Signals.SIGKILL" in res.output
    for rank, rep in res.items():
        assert rep["restart_count"] == 1, f"rank {rank} did not run a second attempt"
        assert rep["attempt0_pid"] != rep["attempt1_pid"]


def test_resumed_from_the_last_checkpoint(killed_run):
    res, folder = killed_run
    last_ckpt = KILL_AT // CKPT_EVERY * CKPT_EVERY
    for rep in res.values():
        assert rep["resumed_from_step"] == last_ckpt
        assert rep["steps_run"] == STEPS - last_ckpt
    state = torch.load(folder / "checkpoint.pt", weights_only=True)
    assert state["step"] == STEPS
    assert [p.name for p in folder.iterdir()] == ["checkpoint.pt"]


def test_final_parameters_equal_an_uninterrupted_run(killed_run):
    from labs.lab03_fault_tolerance import reference_run

    res, _ = killed_run
    reference, ref_losses = reference_run(STEPS, 2, DATASET, LOCAL_BATCH)
    final = [torch.tensor(res[r]["final_params"]) for r in (0, 1)]
    assert torch.equal(final[0], final[1])
    assert (final[0] - reference).abs().max().item() <= 1e-6
    resumed = dict(map(tuple, res[0]["attempt1_losses"]))
    for step, loss in resumed.items():
        assert loss == pytest.approx(ref_losses[int(step)], rel=1e-5)
