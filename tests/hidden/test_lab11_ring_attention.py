"""Hidden tests of lab 11's exercise, `ring_attention` (labs/lab11_ring_attention.py).

Stricter than the public ones: other shapes (one head, several sequences, odd lengths, head_dim
above seq_local), float32 beside float64, bfloat16 with and without the mask (torch's own
tolerances, on 4 ranks and on a group of 3), huge scores with the causal mask, transposed inputs,
two calls in a row, and sub-groups of 1, 2 and 3 ranks whose group ranks differ from the global
ones. Every case is checked for everything: output, gradients, the lse handed to the backward,
the blocks computed, the messages (peers, bytes, posted before the compute and waited after, no
receive into a tensor being sent), the received bytes alive, and what is kept for the backward.

One launch on 4 ranks; this file is also its worker. The case runner is the public tests'
(`run_case`: the same trace and comparisons). Tolerances: float64 1e-10, float32 1e-4.
"""
from __future__ import annotations

import sys

import pytest
import torch

from labs.lab11_ring_attention import ring_attention
from tests.harness import launch_ranks
from tests.public.test_lab11_ring_attention import BF16, STOPS, overlap_violation, run_case

pytestmark = pytest.mark.exercise("ring_attention")

NPROC = 4
PARTITIONS = {"trio and solo": [[0, 2, 3], [1]], "two pairs": [[1, 3], [0, 2]]}
GROUPS = {"trio": [0, 2, 3], "solo": [1], "pair": [1, 3], "other pair": [0, 2]}
# name: (batch, heads, seq_local, head_dim, causal, logit scale, layout, dtype)
CASES = {
    "one head": (3, 1, 5, 6, False, 1.0, "contiguous", torch.float64),
    "causal odd": (1, 3, 3, 8, True, 1.0, "contiguous", torch.float64),
    "huge causal": (2, 1, 4, 2, True, 800.0, "contiguous", torch.float64),
    "huge full": (1, 2, 3, 4, False, 800.0, "contiguous", torch.float64),
    "float32 causal": (2, 2, 6, 8, True, 1.0, "contiguous", torch.float32),
    "transposed full": (1, 4, 4, 4, False, 1.0, "transposed", torch.float64),
    "long blocks": (1, 1, 40, 2, False, 1.0, "contiguous", torch.float64),
    "long causal": (1, 1, 40, 2, True, 1.0, "contiguous", torch.float64),
}
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
ALL = list(CASES) + ["second call"] + [f"group {g}" for g in GROUPS]
BF16_CASES = {"bf16 causal": (True, None), "bf16 full": (False, None), "bf16 causal, trio": (True, [0, 2, 3])}


def tol(name: str) -> float:
    return TOL[CASES[name][-1]] if name in CASES else TOL[torch.float64]


@pytest.fixture(scope="module")
def results():
    """{rank: report}; nothing is launched while ring_attention is still the stub."""
    return launch_ranks(__file__, "cases", nproc=NPROC, timeout=240, env={"DIST_TIMEOUT": "40"},
                        needs=[ring_attention])


def reports(results, name: str) -> list[dict]:
    ranks = GROUPS[name[6:]] if name.startswith("group ") else range(NPROC)
    reps = [results[rank]["cases"][name] for rank in ranks]
    for rep in reps:
        assert "error" not in rep, f"group rank {rep['rank']} ({name}) raised {rep['error']}"
    return reps


# ----------------------------------------------------------------------------------------- tests
@pytest.mark.points(2)
@pytest.mark.parametrize("name", ALL)
def test_output_matches_sdpa(results, name):
    """Every rank's output equals one process's SDPA on the whole sequence (4 ranks, sub-groups)."""
    for rep in reports(results, name):
        assert rep["shape_ok"] and rep["output"] < tol(name), (
            f"group rank {rep['rank']} ({name}): output off by {rep['output']:.2e}")


@pytest.mark.points(2)
@pytest.mark.parametrize("name", ALL)
def test_gradients_and_lse(results, name):
    """dq, dk, dv equal SDPA's, and the lse handed to with_ring_backward is the whole rows'."""
    for rep in reports(results, name):
        assert "backward_error" not in rep and rep["backward_called"], (
            f"group rank {rep['rank']} ({name}): not differentiable through with_ring_backward")
        assert rep["lse"] < tol(name), f"group rank {rep['rank']} ({name}): lse off by {rep['lse']:.2e}"
        for grad in ("dq", "dk", "dv"):
            assert rep[grad] < tol(name), f"group rank {rep['rank']} ({name}): {grad} off by {rep[grad]:.2e}"


@pytest.mark.points(2)
@pytest.mark.parametrize("name", list(BF16_CASES))
def test_bfloat16_within_torchs_tolerances(results, name):
    """bf16: output and gradients within torch's own context-parallel tolerances of SDPA in float64."""
    from labs.lab11_ring_attention import bf16_tolerance

    members = BF16_CASES[name][1] or range(NPROC)
    for rank in members:
        rep = results[rank]["cases"][name]
        assert "error" not in rep, f"rank {rank} ({name}) raised {rep['error']}"
        assert rep["out_dtype"] == "torch.bfloat16", f"rank {rank} ({name}): output {rep['out_dtype']}"
        for quantity in ("output", "dq", "dk", "dv"):
            scale = rep["output_scale" if quantity == "output" else f"{quantity}_scale"]
            assert rep[quantity] <= bf16_tolerance(quantity, rep["size"]) + 1e-5 * scale, (
                f"group rank {rep['rank']} ({name}): {quantity} off by {rep[quantity]:.2e}")


@pytest.mark.parametrize("name", ALL)
def test_blocks_computed(results, name):
    """Blocks at global positions, each visible one exactly once, the causal future skipped."""
    for rep in reports(results, name):
        r, n, s = rep["rank"], rep["size"], rep["seq_local"]
        assert all(q == r * s for q, _, _, _ in rep["blocks"]), f"group rank {r} ({name}): local q_start"
        sources = sorted(k // s for _, _, k, _ in rep["blocks"])
        assert sources == (list(range(r + 1)) if rep["causal"] else list(range(n))), (
            f"group rank {r} ({name}) computed the blocks of ranks {sources}")


@pytest.mark.points(2)
@pytest.mark.parametrize("name", ALL)
def test_ring_traffic(results, name):
    """Only the ring's neighbours, N-1 K/V blocks each way (a group of one sends nothing)."""
    for rep in reports(results, name):
        r, n, t = rep["rank"], rep["size"], rep["traffic"]
        assert set(t["send_peers"]) <= {(r + 1) % n} and set(t["recv_peers"]) <= {(r - 1) % n}, (
            f"group rank {r} ({name}) talked to {t['send_peers']} / {t['recv_peers']}")
        assert t["sent_bytes"] == t["recv_bytes"] == (n - 1) * rep["kv_bytes"], (
            f"group rank {r} ({name}) sent {t['sent_bytes']}, received {t['recv_bytes']} bytes")


@pytest.mark.points(2)
@pytest.mark.parametrize("name", ALL)
def test_overlap_order(results, name):
    """The next block's receive is posted before each block's compute and waited for after it."""
    for rep in reports(results, name):
        problem = overlap_violation(rep)
        assert not problem, f"group rank {rep['rank']} ({name}) {problem}"
        assert not rep["into_sending"], f"group rank {rep['rank']} ({name}) received into a tensor it was sending"


@pytest.mark.points(2)
@pytest.mark.parametrize("name", ["long blocks", "long causal"])
def test_memory_of_the_ring(results, name):
    """At most two received K/V blocks alive at any compute, and nothing seq_local^2 kept for backward."""
    for rep in reports(results, name):
        assert rep["max_live"] <= 2 * rep["kv_bytes"], (
            f"group rank {rep['rank']} ({name}) kept {rep['max_live']} bytes of received blocks alive")
        assert rep["saved"] <= 4 * rep["q_bytes"] + rep["lse_bytes"], (
            f"group rank {rep['rank']} ({name}) kept {rep['saved']} bytes for the backward")


def test_second_call_like_the_first(results):
    """A second call on the same inputs is as exact as the first and sends the same bytes."""
    for rank in range(NPROC):
        first, second = results[rank]["cases"]["causal odd"], results[rank]["cases"]["second call"]
        assert second.get("output") == first.get("output"), f"rank {rank}: a second call differs"
        assert second.get("traffic") == first.get("traffic"), f"rank {rank}: a second call sends other bytes"


def test_one_rank_float32():
    """World size 1 in this process, float32: SDPA's output and gradients, nothing sent."""
    from helpers.dist import distributed

    with distributed() as ctx:
        rep = run_case(1, 2, 7, 4, True, 1.0, "contiguous", dtype=torch.float32, device=ctx.device)
    assert "error" not in rep and rep["output"] < 1e-4 and rep["dv"] < 1e-4
    assert rep["traffic"]["sends"] == 0


# ---------------------------------------------------------------------------------------- worker
def worker() -> None:
    import torch.distributed as dist
    from helpers.dist import distributed, new_group

    with distributed() as ctx:
        cases = {}
        for name, (*args, dtype) in CASES.items():
            cases[name] = run_case(*args, seed=7, dtype=dtype, device=ctx.device)
            if cases[name].get("error", "").startswith(STOPS):
                ctx.report(cases=cases)
                raise SystemExit(cases[name]["error"])   # messages in flight: nothing after this is sound
        *args, dtype = CASES["causal odd"]
        cases["second call"] = run_case(*args, seed=7, dtype=dtype, device=ctx.device)
        for name, (causal, members) in BF16_CASES.items():
            if members is None:
                cases[name] = run_case(*BF16[:4], causal, *BF16[5:], seed=12, dtype=torch.bfloat16, device=ctx.device)
        for pname, partition in PARTITIONS.items():
            groups = [new_group(members, name=f"{pname}: {members}") for members in partition]   # every rank, every group
            members, group = next((m, g) for m, g in zip(partition, groups) if ctx.rank in m)
            name = next(n for n, m in GROUPS.items() if m == members)
            cases[f"group {name}"] = run_case(2, 2, 3, 4, True, 1.0, "contiguous", group=group, seed=11,
                                              device=ctx.device)
            if members == BF16_CASES["bf16 causal, trio"][1]:
                cases["bf16 causal, trio"] = run_case(*BF16, group=group, seed=13, dtype=torch.bfloat16,
                                                      device=ctx.device)
            dist.barrier()
        ctx.report(cases=cases)


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    worker()
