"""Hidden tests of lab 04's exercise, `ring_all_reduce` (labs/lab04_ring.py).

Stricter than the public ones: 4 ranks, sub-groups of 1, 2 and 3 ranks whose group ranks differ
from the global ones, more dtypes and lengths (1 element, fewer than the ranks, uneven), random
floats, repeated calls, every rank bitwise-identical (all values, every float case), the exact
traffic per rank when N divides
the length and within one element per message of the docstring's schedule otherwise.

One launch on 4 ranks runs every case; this file is also its worker (it uses its own copy of the
inputs and checks; only helpers.comm_count.count_p2p is shared with the public tests).
Tolerances: whole-number inputs must match dist.all_reduce exactly; random float32 inputs within
rtol 1e-5, atol 1e-5 (N=4 sums in another order round differently), float64 within 1e-12.
"""
from __future__ import annotations

import hashlib
import math
import sys

import pytest
import torch

from labs.lab04_ring import ring_all_reduce
from tests.harness import launch_ranks

pytestmark = pytest.mark.exercise("ring_all_reduce")

NPROC = 4
# Each partition splits the 4 ranks into groups that run side by side (a ring that ignores its
# group then reduces over the wrong ranks instead of waiting for ranks that never come).
PARTITIONS = {"trio and solo": [[0, 2, 3], [1]], "two pairs": [[1, 3], [0, 2]]}
GROUPS = {"trio": [0, 2, 3], "solo": [1], "pair": [1, 3], "other pair": [0, 2]}
EXACT_CASES = {  # name: (dtype, shape); whole numbers, so exact equality is required
    "int64 divisible": (torch.int64, (4 * 257,)),
    "int32 uneven": (torch.int32, (4099,)),
    "float32 one element": (torch.float32, (1,)),
    "float32 three elements": (torch.float32, (3,)),
    "bfloat16 uneven": (torch.bfloat16, (6,)),
    "float64 matrix": (torch.float64, (9, 7)),
    "int64 empty matrix": (torch.int64, (0, 3)),
}
RANDOM_CASES = {"float32 random": (torch.float32, (1000,)), "float64 random": (torch.float64, (1001,))}
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def make_input(rank: int, dtype, shape, device, random: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + 7 * rank + math.prod(shape))
    if random:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device)
    return torch.randint(-20, 20, shape, generator=gen).to(dtype).to(device)


def run_case(ring_all_reduce, x, group=None, repeat: int = 1) -> dict:
    import torch.distributed as dist
    from helpers.comm_count import count_p2p

    expected = x.clone()
    for _ in range(repeat):
        dist.all_reduce(expected, group=group)
    pointer, shape = x.data_ptr(), tuple(x.shape)
    sent, received = [], []
    result = x
    for _ in range(repeat):
        with count_p2p() as traffic:
            result = ring_all_reduce(x, group=group)
        sent.append(traffic.sent_bytes)
        received.append(traffic.recv_bytes)
    members = (list(range(dist.get_world_size())) if group is None else
               [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))])
    peers = {direction: sorted({m.global_peer for m in traffic.messages if m.direction == direction},
                               key=lambda p: -1 if p is None else p) for direction in ("send", "recv")}
    tol = TOLERANCE.get(x.dtype)
    close = torch.equal(x, expected) if tol is None else torch.allclose(
        x.double(), expected.double(), **tol)
    return {"equal": bool(torch.equal(x, expected)), "close": bool(close),
            "returned_input": result is x, "same_storage": x.data_ptr() == pointer,
            "same_shape": tuple(x.shape) == shape, "bits": bits(x),
            "tensor_bytes": x.nbytes, "numel": x.numel(),
            "itemsize": x.element_size(), "sent_each_call": sent, "recv_each_call": received,
            "members": members, "send_global_peers": peers["send"], "recv_global_peers": peers["recv"],
            **traffic.summary()}


def bits(x: torch.Tensor) -> str:
    """A digest of the tensor's bytes: equal digests, equal bits."""
    raw = x.detach().cpu().contiguous().flatten().view(torch.uint8)
    return hashlib.sha256(bytes(raw.tolist())).hexdigest()


@pytest.fixture(scope="module")
def results():
    """{rank: report}; nothing is launched while ring_all_reduce is still the stub."""
    return launch_ranks(__file__, "cases", nproc=NPROC, timeout=240, env={"DIST_TIMEOUT": "40"},
                        needs=[ring_all_reduce])


def reports(results, name: str, ranks=range(NPROC)) -> list:
    """Every listed rank's result for one case."""
    return [results[rank]["cases"][name] for rank in ranks]


def expected_sent_bytes(numel: int, itemsize: int, ring_size: int) -> list[int]:
    """Per group rank, for the schedule of the docstring: reduce-scatter sends chunk r - s,
    all-gather sends chunk r + 1 - s (s = 0 .. N-2), chunks as tensor_split makes them."""
    sizes = [len(c) for c in torch.arange(numel).tensor_split(ring_size)]
    out = []
    for r in range(ring_size):
        chunks = [(r - s) % ring_size for s in range(ring_size - 1)]
        chunks += [(r + 1 - s) % ring_size for s in range(ring_size - 1)]
        out.append(sum(sizes[c] for c in chunks) * itemsize)
    return out


def check_traffic(reps, ring_size):
    k = reps[0]["tensor_bytes"]
    for r, rep in enumerate(reps):
        # global ranks: messages may go through the group or through the default group
        after, before = rep["members"][(r + 1) % ring_size], rep["members"][(r - 1) % ring_size]
        assert set(rep["send_global_peers"]) <= {after}, (
            f"group rank {r} sent to global rank(s) {rep['send_global_peers']}, not only to the next "
            f"rank of the ring (global rank {after})")
        assert set(rep["recv_global_peers"]) <= {before}, (
            f"group rank {r} received from global rank(s) {rep['recv_global_peers']}, not only from "
            f"the previous rank of the ring (global rank {before})")
        assert rep["recv_bytes"] <= 2 * (ring_size - 1) * math.ceil(rep["numel"] / ring_size) * rep["itemsize"]
        if rep["numel"] % ring_size == 0:
            assert rep["sent_bytes"] == rep["recv_bytes"] == 2 * (ring_size - 1) * k // ring_size
    assert sum(rep["sent_bytes"] for rep in reps) == 2 * (ring_size - 1) * k
    assert sum(rep["recv_bytes"] for rep in reps) == 2 * (ring_size - 1) * k


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.points(2)
@pytest.mark.parametrize("name", list(EXACT_CASES))
def test_exactly_equal_to_all_reduce_on_4_ranks(results, name):
    """Exactly dist.all_reduce's result, in place, 4 ranks, several dtypes, tiny/uneven/empty shapes."""
    reps = reports(results, name)
    for rank, rep in enumerate(reps):
        assert rep["equal"], f"rank {rank}: differs from dist.all_reduce ({name})"
        assert rep["returned_input"] and rep["same_storage"] and rep["same_shape"], (
            f"rank {rank}: must sum in place into the input and return it ({name})")


@pytest.mark.points(2)
@pytest.mark.parametrize("name", list(RANDOM_CASES))
def test_random_floats_close_and_identical_on_every_rank(results, name):
    """Random floats: close to dist.all_reduce and bitwise-identical on every rank, 4 ranks."""
    reps = reports(results, name)
    for rank, rep in enumerate(reps):
        assert rep["close"], f"rank {rank}: random floats differ from dist.all_reduce beyond tolerance"
        assert rep["bits"] == reps[0]["bits"], f"rank {rank} holds other bits than rank 0 ({name})"


def test_every_case_identical_on_every_rank(results):
    """Bitwise-identical results on every rank, 4 ranks, every exact case and repeated calls."""
    for name in list(EXACT_CASES) + ["repeated"]:
        reps = reports(results, name)
        assert all(rep["bits"] == reps[0]["bits"] for rep in reps), f"ranks hold other bits ({name})"


@pytest.mark.points(2)
@pytest.mark.parametrize("name", list(EXACT_CASES) + list(RANDOM_CASES))
def test_traffic_only_between_ring_neighbours(results, name):
    """Each rank talks only to its ring neighbours, and the bytes sent are a ring all-reduce's, 4 ranks."""
    check_traffic(reports(results, name), NPROC)


def test_uneven_traffic_per_rank_within_one_element_per_message(results):
    """Uneven lengths: bytes each rank sends follow the docstring's schedule up to chunk rounding."""
    for name in ("int32 uneven", "bfloat16 uneven", "float32 three elements"):
        reps = reports(results, name)
        rep0 = reps[0]
        schedule = expected_sent_bytes(rep0["numel"], rep0["itemsize"], NPROC)
        for r, rep in enumerate(reps):
            # any rotation of the chunk assignment is a valid ring: allow a chunk's +-1 element
            assert abs(rep["sent_bytes"] - schedule[r]) <= 2 * (NPROC - 1) * rep["itemsize"], (
                f"{name}: group rank {r} sent {rep['sent_bytes']} bytes, schedule says {schedule[r]}")


@pytest.mark.points(2)
@pytest.mark.parametrize("group_name", list(GROUPS))
def test_subgroups_with_other_global_ranks(results, group_name):
    """Correct on sub-groups of 1, 2 and 3 ranks whose group ranks differ from the global ranks."""
    members = GROUPS[group_name]
    reps = reports(results, f"group {group_name}", ranks=members)
    for rep in reps:
        assert rep["equal"] and rep["returned_input"], f"wrong result on sub-group {members}"
    if len(members) == 1:
        assert reps[0]["sends"] == reps[0]["recvs"] == 0, "a group of one sends nothing"
    else:
        check_traffic(reps, len(members))


def test_repeated_calls_keep_working(results):
    """Three calls in a row stay correct, and every call sends the same number of bytes."""
    for rank, rep in enumerate(reports(results, "repeated")):
        assert rep["equal"], f"rank {rank}: three calls in a row differ from three all_reduces"
        assert len(set(rep["sent_each_call"])) == 1, "every call sends the same bytes"


# ---------------------------------------------------------------------------------------- worker
def worker() -> None:
    import torch.distributed as dist
    from helpers.dist import distributed

    with distributed() as ctx:
        cases = {}

        def record(name, value):
            cases[name] = value

        for name, (dtype, shape) in EXACT_CASES.items():
            record(name, run_case(ring_all_reduce, make_input(ctx.rank, dtype, shape, ctx.device)))
        for name, (dtype, shape) in RANDOM_CASES.items():
            x = make_input(ctx.rank, dtype, shape, ctx.device, random=True)
            record(name, run_case(ring_all_reduce, x))
        x = make_input(ctx.rank, torch.int64, (2, 3 * NPROC), ctx.device)
        record("repeated", run_case(ring_all_reduce, x, repeat=3))
        for partition in PARTITIONS.values():
            groups = [dist.new_group(members) for members in partition]  # every rank, every group
            members, group = next((m, g) for m, g in zip(partition, groups) if ctx.rank in m)
            name = next(n for n, m in GROUPS.items() if m == members)
            x = make_input(ctx.rank, torch.int64, (3 * len(members) + 1,), ctx.device)
            record(f"group {name}", run_case(ring_all_reduce, x, group=group))
            dist.barrier()
        ctx.report(cases=cases)


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    worker()
