"""Public tests of lab 04's exercise, `ring_all_reduce` (labs/lab04_ring.py).

Run:  ./run.sh check 04      (or: .venv/bin/python -m pytest tests/public/test_lab04_collectives.py)

One launch on 3 ranks (gloo on the CPU, or nccl with 3 GPUs) runs every case; this file is also
its worker. World size 1 runs in this process. Each case compares the ring with dist.all_reduce on
the same inputs and counts, with helpers.comm_count.count_p2p, every message the ring sends and
receives (count_p2p also makes any built-in collective raise). Most inputs are whole numbers, so
any summation order gives exactly the same sum: results must be equal, not just close. One input
is random floats: close to dist.all_reduce's, and the same bits on every rank.
"""
from __future__ import annotations

import math
import sys

import pytest
import torch

from labs.lab04_ring import ring_all_reduce
from tests.harness import RankFailure, Ranks, launch_ranks

pytestmark = pytest.mark.exercise("ring_all_reduce")

NPROC = 3
# Two groups side by side, every rank in one: [1, 2] (group rank 0 is global rank 1) and [0] alone.
SUBGROUPS = ([1, 2], [0])
# name: (dtype, shape); lengths divisible by 3, not divisible, fewer than the ranks, and empty
CASES = {
    "float32 divisible": (torch.float32, (3 * 1000,)),
    "int64 uneven": (torch.int64, (1001,)),
    "float64 two-dimensional": (torch.float64, (7, 5)),
    "int32 fewer elements than ranks": (torch.int32, (2,)),
    "float32 empty": (torch.float32, (0,)),
    "float32 random": (torch.float32, (3 * 1000,)),
}
RANDOM = "float32 random"  # compared to rounding (rtol 1e-5), and rank against rank bit for bit


def make_input(rank: int, dtype: torch.dtype, shape: tuple, device, random: bool = False) -> torch.Tensor:
    """Whole numbers in [-50, 50) that differ per rank and per position (sums are exact), or
    random normal floats (`random`)."""
    numel = math.prod(shape)
    gen = torch.Generator().manual_seed(10 * rank + numel)
    if random:
        return torch.randn(shape, generator=gen, dtype=dtype).to(device)
    return torch.randint(-50, 50, shape, generator=gen).to(dtype).to(device)


def run_case(ring_all_reduce, x: torch.Tensor, group=None, keep_values: bool = False) -> dict:
    import torch.distributed as dist
    from helpers.comm_count import count_p2p

    expected = x.clone()
    dist.all_reduce(expected, group=group)
    pointer = x.data_ptr()
    with count_p2p() as traffic:
        result = ring_all_reduce(x, group=group)
    return {"members": group_members(group), **global_peers(traffic),"equal": bool(torch.equal(x, expected)),
            "close": bool(torch.allclose(x.double(), expected.double(), rtol=1e-5, atol=1e-5)),
            "max_diff": (x.double() - expected.double()).abs().max().item() if x.numel() else 0.0,
            "values": x.double().flatten().tolist() if keep_values else [],
            "returned_input": result is x, "same_storage": x.data_ptr() == pointer,
            "tensor_bytes": x.nbytes, "numel": x.numel(), "itemsize": x.element_size(),
            **traffic.summary()}


def group_members(group=None) -> list[int]:
    """The global ranks of `group`'s members, in group-rank order."""
    import torch.distributed as dist

    if group is None:
        return list(range(dist.get_world_size()))
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]


def global_peers(traffic) -> dict:
    """The global ranks this process sent to and received from (None: a receive from any source),
    whichever group each message went through."""
    def peers(direction):
        found = {m.global_peer for m in traffic.messages if m.direction == direction}
        return sorted(found, key=lambda p: -1 if p is None else p)
    return {"send_global_peers": peers("send"), "recv_global_peers": peers("recv")}


DEADLOCK_HINT = (
    "the ranks waited for each other until the timeout: most often every rank calls a blocking "
    "dist.send before its dist.recv, so each waits for a receive nobody has posted (gloo's send "
    "returns only once the peer receives). Post each step's send and receive together "
    "(batch_isend_irecv, or isend + irecv, then wait on both). A ring that waits for a rank "
    "outside its group hangs the same way")


PEER_HINT = (
    "a message went to this rank itself or to a rank outside the group: isend, irecv and P2POp "
    "take GLOBAL ranks, also with group=...; turn the group ranks (rank + 1) % N and (rank - 1) % N "
    "into global ranks with dist.get_global_rank(group, r)")
PEER_ERRORS = ("Pair is not connected", "not part of", "does not contain", "Invalid destination",
               "Invalid source", "itself")


def with_launch_hint(runs: Ranks) -> Ranks:
    """A failed launch whose error has a usual cause, with that cause first in its message."""
    try:
        len(runs)
    except RankFailure as err:
        text = str(err)
        if "timed out" in text.lower():
            return Ranks(None, RankFailure(f"{DEADLOCK_HINT} [{text}]"), runs.output)
        if any(pattern in text for pattern in PEER_ERRORS):
            return Ranks(None, RankFailure(f"{PEER_HINT} [{text}]"), runs.output)
    return runs


# ---------------------------------------------------------------------------------------- launch
@pytest.fixture(scope="module")
def results():
    """{rank: report}; nothing is launched while ring_all_reduce is still the stub."""
    return with_launch_hint(launch_ranks(__file__, "cases", nproc=NPROC, timeout=180,
                                           env={"DIST_TIMEOUT": "30"}, needs=[ring_all_reduce]))


def reports(results, name: str, ranks=range(NPROC)) -> list:
    """Every listed rank's result for one case."""
    return [results[rank]["cases"][name] for rank in ranks]


def check_traffic(reps: list[dict], ring_size: int) -> None:
    """Messages only to the next rank and from the previous one; 2(N-1)/N of the bytes each."""
    k = reps[0]["tensor_bytes"]
    for ring_rank, rep in enumerate(reps):
        members = rep["members"]
        me, after, before = (members[ring_rank], members[(ring_rank + 1) % ring_size],
                             members[(ring_rank - 1) % ring_size])
        if rep["sends"]:
            assert rep["send_global_peers"] == [after], (
                f"group rank {ring_rank} (global rank {me}) sent to global rank(s) "
                f"{rep['send_global_peers']}; only the next rank of the ring may receive from it: "
                f"group rank {(ring_rank + 1) % ring_size}, global rank {after}")
        if rep["recvs"]:
            assert rep["recv_global_peers"] == [before], (
                f"group rank {ring_rank} (global rank {me}) received from global rank(s) "
                f"{rep['recv_global_peers']} (None: any source); only from the previous rank of "
                f"the ring: group rank {(ring_rank - 1) % ring_size}, global rank {before}")
        if rep["numel"] % ring_size == 0:
            assert rep["sent_bytes"] == 2 * (ring_size - 1) * k // ring_size, (
                f"group rank {ring_rank} sent {rep['sent_bytes']} bytes; a ring sends 2(N-1)/N "
                f"of the {k} bytes = {2 * (ring_size - 1) * k // ring_size}: each of its 2(N-1) "
                "steps moves one chunk of K/N, never the whole tensor")
            assert rep["recv_bytes"] == rep["sent_bytes"]
        largest_chunk = math.ceil(rep["numel"] / ring_size) * rep["itemsize"]
        assert rep["sent_bytes"] <= 2 * (ring_size - 1) * largest_chunk, (
            f"group rank {ring_rank} sent {rep['sent_bytes']} bytes, more than 2(N-1) chunks of at "
            f"most ceil(length / N) elements ({2 * (ring_size - 1) * largest_chunk} bytes): each of "
            "the ring's 2(N-1) steps moves one chunk, never the whole tensor")
    total = sum(rep["sent_bytes"] for rep in reps)
    assert total == 2 * (ring_size - 1) * k, (
        f"all ranks together sent {total} bytes; a ring sends every chunk N-1 times in each "
        f"phase: 2(N-1) K = {2 * (ring_size - 1) * k}")


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(CASES))
def test_ring_matches_all_reduce(results, name):
    """The ring's sum equals dist.all_reduce's, written into the input tensor, which it returns."""
    for rank, rep in enumerate(reports(results, name)):
        assert rep["returned_input"], f"rank {rank}: return the input tensor itself, summed in place ({name})"
        assert rep["same_storage"], f"rank {rank}: the sum must be written into the input's storage ({name})"
        if name == RANDOM:
            assert rep["close"], (f"rank {rank}: ring_all_reduce differs from dist.all_reduce by "
                                  f"{rep['max_diff']:.2e} on random floats, more than rounding")
        else:
            assert rep["equal"], (f"rank {rank}: ring_all_reduce differs from dist.all_reduce by "
                                  f"{rep['max_diff']:.3g} ({name}): follow ring_chunks' schedule; "
                                  "a reduce-scatter step adds the incoming chunk to this rank's "
                                  "copy, an all-gather step replaces this rank's copy with it")


def test_ring_gives_every_rank_the_same_bits(results):
    """Random floats: every rank must hold exactly rank 0's values, as with dist.all_reduce."""
    reps = reports(results, RANDOM)
    for rank, rep in enumerate(reps):
        assert rep["returned_input"] and rep["same_storage"], (
            f"rank {rank}: return the input tensor itself, summed in place")
    for rank, rep in enumerate(reps[1:], start=1):
        differ = [i for i, (a, b) in enumerate(zip(rep["values"], reps[0]["values"])) if a != b]
        assert not differ, (
            f"rank {rank} holds other bits than rank 0 at {len(differ)} of {len(rep['values'])} "
            f"positions (first: element {differ[0]}, {rep['values'][differ[0]]!r} vs "
            f"{reps[0]['values'][differ[0]]!r}): each chunk's sum must be added up once, on one "
            "rank, and only copied to the others in the all-gather phase")


@pytest.mark.parametrize("name", list(CASES))
def test_ring_sends_to_next_rank_only_and_2_n_minus_1_over_n(results, name):
    """Messages go only to the next rank and come from the previous one; each rank sends 2(N-1)/N of the tensor."""
    check_traffic(reports(results, name), NPROC)


def test_ring_on_a_subgroup(results):
    """Correct on a sub-group whose group ranks are not its global ranks, beside a group of one.

    Ranks 1, 2 reduce over new_group([1, 2]) (group ranks 0, 1 are global ranks 1, 2) while
    rank 0 reduces over a group of its own: a ring that ignores `group` sums over all three."""
    pair, solo = SUBGROUPS
    reps = reports(results, "subgroup", ranks=pair)
    for members, group_reps in ((pair, reps), (solo, reports(results, "subgroup", ranks=solo))):
        for rep in group_reps:
            assert rep["returned_input"], f"on the group {members}: return the input tensor itself, summed in place"
            if rep["equals_world_sum"] and not rep["equal"]:
                raise AssertionError(
                    f"ring_all_reduce on the group {members} returned the sum over all {NPROC} "
                    "ranks: it ignored `group`. Use the group's rank and size "
                    "(dist.get_rank(group), dist.get_world_size(group)) and its members' global "
                    "ranks (dist.get_global_rank(group, r)) as peers")
            world_ok = all(r["equal"] for name in CASES if name != RANDOM for r in reports(results, name))
            assert rep["equal"], (
                f"ring_all_reduce on the group {members} differs from dist.all_reduce on it by "
                f"{rep['max_diff']:.3g}" + (
                    ", while it is right on the whole world: use the group's rank and size "
                    "(dist.get_rank(group), dist.get_world_size(group)) and its members' global "
                    "ranks (dist.get_global_rank)" if world_ok else
                    " (it is wrong on the whole world too: see the other tests)"))
    check_traffic(reps, len(pair))
    assert reports(results, "subgroup", ranks=solo)[0]["sends"] == 0, "a group of one sends nothing"


def test_ring_on_one_rank_sends_nothing():
    """World size 1, in this process: the tensor comes back unchanged and nothing is sent."""
    from helpers.comm_count import count_p2p
    from helpers.dist import distributed

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

    with distributed() as ctx:
        cases = {}
        for name, (dtype, shape) in CASES.items():
            x = make_input(ctx.rank, dtype, shape, ctx.device, random=name == RANDOM)
            cases[name] = run_case(ring_all_reduce, x, keep_values=name == RANDOM)
        groups = [dist.new_group(members) for members in SUBGROUPS]  # every rank creates every group
        mine = next(g for g, members in zip(groups, SUBGROUPS) if ctx.rank in members)
        x = make_input(ctx.rank, torch.float32, (2 * 333,), ctx.device)
        world_sum = x.clone()
        dist.all_reduce(world_sum)  # what a ring that ignores its group would compute
        cases["subgroup"] = run_case(ring_all_reduce, x, group=mine)
        cases["subgroup"]["equals_world_sum"] = bool(torch.equal(x, world_sum))
        ctx.report(cases=cases)


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    worker()
