"""The 5-D run on 8 ranks against one process, one launch (the instructor's solution): the
notebook's composed mesh, dp_shard 2 x cp 2 x tp 2 (ep = dp_shard x cp), and its pipelined
variant, pp 2 x dp_shard 2 x cp 2, two steps each at the small sizes, within labs/lab13_train.py's
tolerances; tests/test_lab13_stack.py checks the rest on 4 ranks.

Run:  .venv/bin/python -m pytest tests/test_lab13_mesh8.py -q
"""
from __future__ import annotations

import sys

import pytest

from tests.harness import launch_ranks

MESHES = {"dp_shard 2 x cp 2 x tp 2": {"dp_shard": 2, "cp": 2, "tp": 2},
          "pp 2 x dp_shard 2 x cp 2": {"pp": 2, "dp_shard": 2, "cp": 2}}
CONFIG = dict(dim=32, heads=4, kv_heads=2, layers=2, ffn=64, seq=32, batch=4, experts=4, expert_ffn=16, shared_ffn=16)


def worker() -> None:
    from helpers.dist import distributed
    from labs.lab13_model import default_config
    from labs.lab13_train import check_run

    with distributed() as ctx:
        ctx.report(runs={name: check_run(ctx, sizes, config=default_config("smoke", **CONFIG), steps=2, traffic_step=None)
                         for name, sizes in MESHES.items()})


@pytest.fixture(scope="module")
def res():
    return launch_ranks(__file__, "worker", nproc=8, timeout=400, env={"DIST_TIMEOUT": "60"})


@pytest.mark.parametrize("name", list(MESHES))
def test_eight_ranks_match_one_process(res, name):
    from labs.lab13_train import agreement

    reports = [res[r]["runs"][name] for r in range(8)]
    for what, v in agreement(reports).items():
        assert v["within"], f"{name}: {what} differs from one process by {v['worst']:.2e} (tolerance {v['tolerance']:g})"
    assert max(r["bias_moved"] for r in reports) > 0


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    worker()
