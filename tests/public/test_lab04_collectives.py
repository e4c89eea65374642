"""Public tests of lab 04's exercise, `ring_all_reduce` (labs/lab04_collectives.py).

Run:  .venv/bin/python -m pytest tests/public/test_lab04_collectives.py -q

One launch on 3 ranks (gloo on the CPU, or nccl with 3 GPUs) runs every case; this file is also
its worker. World size 1 runs in this process. Each case compares the ring with dist.all_reduce on
the same inputs and counts, with helpers.comm_bench.count_p2p, every message the ring sends and
receives (count_p2p also makes any built-in collective raise). Inputs are whole numbers, so any
summation order gives exactly the same sum: results must be equal, not just close.
"""
from __future__ import annotations

import math
import sys

import pytest
import torch

from helpers.launch import LaunchError, launch

pytestmark = pytest.mark.exercise("ring_all_reduce")

NPROC = 3
SUBGROUP = [1, 2]  # a group whose ranks are not the global ones: group rank 0 is global rank 1
# name: (dtype, shape); lengths divisible by 3, not divisible, fewer than the ranks, and empty
CASES = {
    "float32 divisible": (torch.float32, (3 * 1000,)),
    "int64 uneven": (torch.int64, (1001,)),
    "float64 two-dimensional": (torch.float64, (7, 5)),
    "int32 fewer elements than ranks": (torch.int32, (2,)),
    "float32 empty": (torch.float32, (0,)),
}


def make_input(rank: int, dtype: torch.dtype, shape: tuple, device) -> torch.Tensor:
    """Whole numbers in [-50, 50) that differ per rank and per position: sums are exact."""
    numel = math.prod(shape)
    gen = torch.Generator().manual_seed(10 * rank + numel)
    return torch.randint(-50, 50, shape, generator=gen).to(dtype).to(device)


def run_case(ring_all_reduce, x: torch.Tensor, group=None) -> dict:
    import torch.distributed as dist
    from helpers.comm_bench import count_p2p

    expected = x.clone()
    dist.all_reduce(expected, group=group)
    pointer = x.data_ptr()
    with count_p2p() as traffic:
        result = ring_all_reduce(x, group=group)
    return {"equal": bool(torch.equal(x, expected)), "returned_input": result is x,
            "same_storage": x.data_ptr() == pointer, "tensor_bytes": x.numel() * x.element_size(),
            "numel": x.numel(), "itemsize": x.element_size(), **traffic.summary()}


# ---------------------------------------------------------------------------------------- launch
@pytest.fixture(scope="module")
def results():
    """{rank: report}; if the launch failed, whatever the ranks reported before it did."""
    try:
        res = launch(__file__, "cases", nproc=NPROC, timeout=180, stream=False,
                     env={"DIST_TIMEOUT": "30"})
        return res.results, None
    except LaunchError as exc:
        return (exc.result.results if exc.result else {}), str(exc)


def reports(results, name: str, ranks=range(NPROC)) -> list:
    """Every listed rank's result for one case (cases report one by one, so a crash in a
    later case does not hide the earlier ones)."""
    by_rank, error = results
    out = []
    for rank in ranks:
        cases = by_rank.get(rank, {}).get("cases", {})
        if name not in cases:
            pytest.fail(f"rank {rank} has no result for case {name!r}: the launch failed before "
                        f"it finished:\n{error}")
        out.append(cases[name])
    return out


def check_traffic(reps: list[dict], ring_size: int) -> None:
    """Messages only to the next rank and from the previous one; 2(N-1)/N of the bytes each."""
    k = reps[0]["tensor_bytes"]
    for ring_rank, rep in enumerate(reps):
        if rep["sends"]:
            assert rep["send_peers"] == [(ring_rank + 1) % ring_size], (
                f"group rank {ring_rank} sent to {rep['send_peers']}; only the next rank "
                f"({(ring_rank + 1) % ring_size}) may receive from it")
        if rep["recvs"]:
            assert rep["recv_peers"] == [(ring_rank - 1) % ring_size], (
                f"group rank {ring_rank} received from {rep['recv_peers']}; only from the previous "
                f"rank ({(ring_rank - 1) % ring_size})")
        if rep["numel"] % ring_size == 0:
            assert rep["sent_bytes"] == 2 * (ring_size - 1) * k // ring_size, (
                f"group rank {ring_rank} sent {rep['sent_bytes']} bytes; a ring sends 2(N-1)/N "
                f"of the {k} bytes = {2 * (ring_size - 1) * k // ring_size}")
            assert rep["recv_bytes"] == rep["sent_bytes"]
        largest_chunk = math.ceil(rep["numel"] / ring_size) * rep["itemsize"]
        assert rep["sent_bytes"] <= 2 * (ring_size - 1) * largest_chunk, (
            f"group rank {ring_rank} sent {rep['sent_bytes']} bytes, more than 2(N-1) chunks")
    total = sum(rep["sent_bytes"] for rep in reps)
    assert total == 2 * (ring_size - 1) * k, (
        f"all ranks together sent {total} bytes; a ring sends every chunk N-1 times in each "
        f"phase: 2(N-1) K = {2 * (ring_size - 1) * k}")


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(CASES))
def test_ring_matches_all_reduce(results, name):
    for rank, rep in enumerate(reports(results, name)):
        assert rep["equal"], f"rank {rank}: ring_all_reduce differs from dist.all_reduce ({name})"
        assert rep["returned_input"], f"rank {rank}: return the input tensor itself (in place)"
        assert rep["same_storage"], f"rank {rank}: the sum must be written into the input's storage"


@pytest.mark.parametrize("name", list(CASES))
def test_ring_sends_to_next_rank_only_and_2_n_minus_1_over_n(results, name):
    check_traffic(reports(results, name), NPROC)


def test_ring_on_a_subgroup(results):
    """group=new_group([1, 2]): group ranks 0, 1 are global ranks 1, 2; rank 0 stays out."""
    reps = reports(results, "subgroup", ranks=SUBGROUP)
    for rep in reps:
        assert rep["equal"], "ring_all_reduce on a sub-group differs from dist.all_reduce on it"
    check_traffic(reps, len(SUBGROUP))
    assert reports(results, "subgroup", ranks=[0]) == ["not a member"]


def test_ring_on_one_rank_sends_nothing():
    """World size 1, in this process: the tensor comes back unchanged and nothing is sent."""
    from helpers.comm_bench import count_p2p
    from helpers.dist import distributed
    from labs.lab04_collectives import ring_all_reduce

    with distributed():
        x = torch.arange(10, dtype=torch.float32)
        with count_p2p() as traffic:
            result = ring_all_reduce(x)
        assert result is x
        assert torch.equal(x, torch.arange(10, dtype=torch.float32))
        assert traffic.messages == []


# ---------------------------------------------------------------------------------------- worker
def worker() -> None:
    import torch.distributed as dist
    from helpers.dist import distributed
    from labs.lab04_collectives import ring_all_reduce

    with distributed() as ctx:
        cases = {}
        for name, (dtype, shape) in CASES.items():
            x = make_input(ctx.rank, dtype, shape, ctx.device)
            cases[name] = run_case(ring_all_reduce, x)
            ctx.report(cases=cases)  # case by case: a later crash keeps these results
        group = dist.new_group(SUBGROUP)  # every rank calls new_group, members or not
        if ctx.rank in SUBGROUP:
            x = make_input(ctx.rank, torch.float32, (2 * 333,), ctx.device)
            cases["subgroup"] = run_case(ring_all_reduce, x, group=group)
        else:
            cases["subgroup"] = "not a member"
        ctx.report(cases=cases)


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    worker()
