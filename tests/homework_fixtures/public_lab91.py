"""Public test of the fixture lab 91 (copied to tests/public/test_lab91_fixture.py).

The module is also the torchrun worker: `launch(__file__, "rank-sum")` runs the block at the bottom.
"""
import pytest

pytestmark = pytest.mark.exercise("rank_sum")


def test_rank_sum_on_two_ranks():
    from helpers.launch import launch

    res = launch(__file__, "rank-sum", nproc=2, timeout=120, stream=False)
    assert [r["total"] for r in res.results.values()] == [3.0, 3.0], "1 + 2 on every rank"


if __name__ == "__main__":
    import torch

    from helpers.dist import distributed
    from labs.lab91_fixture import rank_sum

    with distributed() as ctx:
        ctx.report(total=rank_sum(torch.tensor([ctx.rank + 1.0])).item())
