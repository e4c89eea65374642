"""The plain DDP script (labs/lab03_plain_ddp.py, torch only, no course helpers) on 2 ranks: it
trains, the loss it logs (a mean over ranks) falls, every rank ends with the same parameters, and
the checkpoint rank 0 saved from `ddp.module` loads back equal on every rank."""
from __future__ import annotations

import re

import pytest

from tests.harness import launch_ranks


@pytest.fixture(scope="module")
def plain_run():
    ranks = launch_ranks("labs/lab03_plain_ddp.py", nproc=2)
    dict(ranks)  # a failed launch fails here, naming the rank and its error
    return ranks.output


def test_logged_loss_falls(plain_run):
    losses = [float(v) for v in re.findall(r"epoch \d+: loss \(mean over 2 ranks\) ([\d.]+)", plain_run)]
    assert len(losses) == 3, f"expected one loss line per epoch from rank 0, got {losses}"
    assert losses[-1] < losses[0]


def test_ranks_agree_and_the_checkpoint_loads_back(plain_run):
    lines = re.findall(r"rank (\d): parameter checksum ([-\d.]+), checkpoint loaded back equal: (\w+)", plain_run)
    assert sorted(int(r) for r, _, _ in lines) == [0, 1], plain_run[-2000:]
    assert len({checksum for _, checksum, _ in lines}) == 1, "ranks ended with different parameters"
    assert all(equal == "True" for _, _, equal in lines)
