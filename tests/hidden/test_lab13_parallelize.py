"""Hidden tests of lab 13's exercise, `parallelize` (labs/lab13_parallelize.py).

Other meshes of the 4 ranks than the public tests' (cp over all four, HSDP with dp_shard (cp 1:
ep is dp_shard alone), tensor parallelism with dp_shard, a pipeline with tp and with dp_shard,
Ulysses), and a model of another shape (multi-head attention, 8 experts, 4 blocks, no shared expert); every case
checked for everything the public tests check: positions, the attention's group, the experts'
ranks, the routers' load group, FSDP's and HSDP's placements, the experts' unit, tensor
parallelism, reshard_after_forward, and training against one process.

One launch on 4 ranks; this file is also its worker. The case runner and the checks are the
public tests' (tests/public/test_lab13_parallelize.py).
"""
from __future__ import annotations

import sys

import pytest

from labs.lab13_parallelize import parallelize
from tests.harness import launch_ranks
from tests.public.test_lab13_parallelize import (NPROC, check_attention_at_global_positions,
                                                 check_attention_over_the_cp_group, check_experts_a_unit_of_their_own,
                                                 check_experts_over_dp_shard_cp, check_fsdp_over_dp_shard_cp,
                                                 check_load_counted_over_the_batch, check_reshard_after_forward_rule,
                                                 check_tensor_parallel_first, check_trains_like_one_process, run_worker)

OTHER_SHAPE = {"heads": 4, "kv_heads": 4, "experts": 8, "layers": 4, "shared_ffn": 0, "top_k": 3}
CASES = {
    "cp 4": ({"cp": 4}, {}),
    "dp_replicate 2 x dp_shard 2 (HSDP)": ({"dp_replicate": 2, "dp_shard": 2}, {}),
    "dp_shard 2 x tp 2": ({"dp_shard": 2, "tp": 2}, {}),
    "dp_shard 2 x cp 2, Ulysses": ({"dp_shard": 2, "cp": 2}, {"design": "ulysses"}),
    "dp_replicate 2 x cp 2, other shape": ({"dp_replicate": 2, "cp": 2}, {"config": OTHER_SHAPE}),
    "pp 2 x tp 2": ({"pp": 2, "tp": 2}, {}),                   # pipelines last: a broken one may hang
    "pp 2 x dp_shard 2, other shape": ({"pp": 2, "dp_shard": 2}, {"config": OTHER_SHAPE}),
}
CHECKS = [check_attention_at_global_positions, check_attention_over_the_cp_group, check_experts_over_dp_shard_cp,
          check_load_counted_over_the_batch, check_fsdp_over_dp_shard_cp, check_experts_a_unit_of_their_own,
          check_tensor_parallel_first, check_reshard_after_forward_rule, check_trains_like_one_process]


@pytest.fixture(scope="module")
def results():
    return launch_ranks(__file__, "cases", nproc=NPROC, timeout=420, env={"DIST_TIMEOUT": "30"}, needs=[parallelize])


@pytest.mark.exercise("parallelize")
@pytest.mark.points(2)
@pytest.mark.parametrize("name", list(CASES))
def test_placed_and_trained_like_one_process(results, name):
    """Placements (positions, cp group, ep, load group, FSDP/HSDP, experts' unit, tp, resharding) and training against one process."""
    for check in CHECKS:
        check(results, name)


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    run_worker(CASES)
