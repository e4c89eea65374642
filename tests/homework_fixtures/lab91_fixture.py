"""Lab 91: a fixture of tests/test_homework.py, not a lesson. One exercise that runs in ranks.

Run: ./run.sh 91 (the public test launches 2 ranks)
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def rank_sum(value: torch.Tensor, group=None) -> torch.Tensor:
    """Sum `value` over the ranks of `group` in place (all-reduce, SUM) and return it."""
    ### BEGIN SOLUTION
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)  # fixture solution, rank_sum
    return value  # fixture solution: the tensor summed in place
    ### END SOLUTION
