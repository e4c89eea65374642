"""Hidden tests of lab 11's exercise, `ExpertParallelMoE.forward` (labs/lab11_experts.py).

Stricter than the public ones: 4 ranks, expert-parallel groups of 4, 3, 2 and 1 ranks whose group
ranks differ from the global ones, one expert per rank and several, top-1 to top-3, other sizes,
a rank without tokens, routings where some ranks receive no row at all, a small capacity factor,
float32 input that is a non-contiguous view, and two calls before one backward.

One launch on 4 ranks runs every case; this file is also its worker. The reference, the
recorders and the comparison are the public tests' (`measure` in tests/public/test_lab11_experts.py,
which also reads the reports); this file builds other MoEs and tokens. Float64 results must match
the MoE's definition to 1e-9 (rounding is about 1e-15), float32 to 1e-5.
"""
from __future__ import annotations

import sys

import pytest
import torch

from labs.lab11_experts import ExpertParallelMoE
from tests.harness import launch_ranks
from tests.public.test_lab11_experts import case as reports_of
from tests.public.test_lab11_experts import expected_bytes, measure, reference

pytestmark = pytest.mark.exercise("ExpertParallelMoE.forward")

NPROC = 4
PARTITIONS = {"world": [[0, 1, 2, 3]], "trio and solo": [[0, 2, 3], [1]], "two pairs": [[1, 3], [0, 2]]}
F64, F32 = torch.float64, torch.float32
# name: (partition, hidden, ffn, experts per rank, top_k, tokens per global rank, capacity factor,
#        router skew, dtype, non-contiguous input, calls before backward)
CASES = {
    "world top-2": ("world", 6, 10, 2, 2, (11, 7, 13, 9), None, 0.0, F64, False, 1),
    "world one expert each, top-3": ("world", 5, 9, 1, 3, (8, 10, 6, 9), None, 0.0, F64, False, 1),
    "world top-1, one expert takes all": ("world", 6, 8, 2, 1, (9, 9, 9, 9), None, 8.0, F64, False, 1),
    "world, a rank without tokens": ("world", 6, 10, 2, 2, (10, 0, 12, 6), None, 1.0, F64, False, 1),
    "world small capacity": ("world", 6, 10, 2, 2, (12, 12, 12, 12), 0.5, 1.0, F64, False, 1),
    "world float32 view": ("world", 8, 12, 2, 2, (10, 14, 6, 8), None, 0.0, F32, True, 1),
    "trio and solo": ("trio and solo", 7, 11, 2, 2, (9, 13, 8, 10), None, 0.5, F64, False, 1),
    "two pairs skewed": ("two pairs", 6, 10, 3, 2, (14, 10, 12, 16), None, 3.0, F64, False, 1),
    "two calls, one backward": ("world", 6, 10, 2, 2, (8, 12, 10, 6), None, 0.0, F64, False, 2),
}
TOLERANCE = {F64: 1e-9, F32: 1e-5}


def run_case(name: str, group) -> dict:
    """One case of CASES on `group` (None: every rank): its MoE and tokens, then the public `measure`."""
    import torch.distributed as dist

    import labs.lab11_experts as lab

    _, hidden, ffn, per_rank, top_k, counts, factor, skew, dtype, view, calls = CASES[name]
    n = dist.get_world_size(group)
    members = list(range(NPROC)) if group is None else dist.get_process_group_ranks(group)
    with torch.random.fork_rng():
        torch.manual_seed(1000 + hidden * n + len(name))
        moe = lab.MoE(hidden, ffn, per_rank * n, top_k, factor).to(dtype)
    with torch.no_grad():
        moe.router.weight[0] += skew * hidden ** -0.5
    gen = torch.Generator().manual_seed(31 * n + len(name))
    shift = 2.0 * hidden ** -0.5 if skew else 0.0
    xs = [(torch.randn(counts[g], hidden, generator=gen, dtype=F64) + shift).to(dtype) for g in members]
    douts = [torch.randn(len(x), hidden, generator=gen, dtype=F64).to(dtype) for x in xs]
    return measure(moe, xs, douts, group, per_rank, calls=calls, transposed=view)


def worker() -> None:
    import torch.distributed as dist
    from helpers.dist import distributed, new_group

    with distributed() as ctx:
        groups = {}
        for pname, partition in PARTITIONS.items():   # every rank creates every group, in this order
            made = [None if len(m) == NPROC else new_group(m, name=f"{pname}: {m}") for m in partition]
            groups[pname] = next(g for m, g in zip(partition, made) if ctx.rank in m)
        cases = {}
        for name, spec in CASES.items():
            cases[name] = run_case(name, groups[spec[0]])
            ctx.report(cases=cases)
            if cases[name].get("error", "").startswith("SkippedCollective"):
                raise SystemExit(cases[name]["error"])    # the other ranks wait in a collective: end now
            dist.barrier()


# ---------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def results():
    """{rank: report}; nothing is launched while ExpertParallelMoE.forward is still the stub."""
    return launch_ranks(__file__, "cases", nproc=NPROC, timeout=240, env={"DIST_TIMEOUT": "40"},
                        needs=[ExpertParallelMoE.forward])


def case(results, name: str) -> list[dict]:
    """Every rank's report for one case (each in its own group), even from a launch that crashed later."""
    return reports_of(results, name, ranks=range(NPROC))


def case_is_what_it_claims(name: str, reps: list[dict]) -> None:
    """The test's own routing: some ranks receive no row, a rank has no token, the capacity drops
    choices, the pairs' splits are asymmetric (else a test could not fail)."""
    splits = reps[0]["splits"]
    if name == "world top-1, one expert takes all":
        assert sum(1 for j in range(NPROC) if sum(row[j] for row in splits) == 0) >= 2, splits
    if name == "world, a rank without tokens":
        assert reps[1]["tokens"] == 0
    if name == "world small capacity":
        assert reps[0]["dropped"] > 0
    if name == "two pairs skewed":
        assert any(rep["splits"][0][1] != rep["splits"][1][0] for rep in reps)


@pytest.mark.points(2)
@pytest.mark.parametrize("name", list(CASES))
def test_output_matches_the_dense_layer(results, name):
    """Each rank's output equals the dense MoE's on its tokens, in token order (4 ranks, several groupings)."""
    tol = TOLERANCE[CASES[name][8]]
    reps = case(results, name)
    case_is_what_it_claims(name, reps)
    for rep in reps:
        assert rep["out_shape"] == [rep["tokens"], CASES[name][1]], f"{name}: wrong output shape {rep['out_shape']}"
        assert rep["output"] < tol, (
            f"group rank {rep['rank']} of {rep['members']} ({name}): output off by {rep['output']:.2e}")


@pytest.mark.points(2)
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_the_dense_layer(results, name):
    """dL/dx, the router's gradient, and each expert's summed over the group's tokens, as in one process."""
    tol = TOLERANCE[CASES[name][8]]
    for rep in case(results, name):
        who = f"group rank {rep['rank']} of {rep['members']} ({name})"
        assert "backward_error" not in rep, f"{who}: {rep['backward_error']}"
        assert not rep["missing_expert_grads"], f"{who}: no gradient reached {rep['missing_expert_grads']}"
        for what in ("x_grad", "router_grad", "expert_grad"):
            assert rep[what] < tol, f"{who}: {what} off by {rep[what]:.2e}"


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][10] == 1])
def test_only_all_to_all_and_bytes_from_the_routing(results, name):
    """Only all_to_all_single (3 forward, 2 backward); each rank sends exactly its routed rows, both ways."""
    for rep in case(results, name):
        who = f"group rank {rep['rank']} of {rep['members']} ({name})"
        kinds = set(rep["fwd_kinds"] + rep.get("bwd_kinds", []))
        assert kinds <= {"all_to_all"} and not rep["fwd_p2p"] and not rep.get("bwd_p2p"), f"{who} used {sorted(kinds)}"
        fwd, bwd = rep["a2a"]["forward"], rep["a2a"]["backward"]
        assert len(fwd) == 3 and len(bwd) == 2, f"{who}: {len(fwd)} forward and {len(bwd)} backward all-to-alls"
        assert not fwd[0]["floating"] and fwd[0]["numel"] <= rep["num_experts"], f"{who}: counts too large"
        dispatch, combine = expected_bytes(rep)
        sent = [fwd[1]["sent"], fwd[2]["sent"], bwd[0]["sent"], bwd[1]["sent"]]
        assert sent == [dispatch, combine, dispatch, combine], (
            f"{who}: sent {sent} bytes (dispatch, combine, and their backwards); the routing gives "
            f"{[dispatch, combine, dispatch, combine]}")


@pytest.mark.parametrize("name", list(CASES))
def test_each_expert_called_once_per_forward(results, name):
    """Each local expert is called at most once per forward, and at least once when rows were routed to it."""
    for rep in case(results, name):
        for calls, routed in zip(rep["expert_calls"], rep["routed"]):
            assert calls <= rep["calls"] and (calls >= 1 or routed == 0), (
                f"group rank {rep['rank']} of {rep['members']} ({name}): an expert was called {calls} times in "
                f"{rep['calls']} forward(s)")


@pytest.mark.parametrize("name", list(CASES))
def test_each_expert_runs_only_on_its_rows(results, name):
    """Each local expert runs on exactly the rows routed to it from every rank of its group."""
    for rep in case(results, name):
        assert rep["seen"] == rep["routed"] and all(rep["seen_ok"]), (
            f"group rank {rep['rank']} of {rep['members']} ({name}): local experts ran on {rep['seen']} rows, "
            f"{rep['routed']} were routed to them" + ("" if all(rep["seen_ok"]) else ", and not those rows"))


def test_aux_loss_of_the_last_call(results):
    """aux_loss after forward is the load-balancing loss of the tokens of the last call."""
    for name in ("world top-2", "two calls, one backward"):
        for rep in case(results, name):
            assert rep["aux"] is not None and rep["aux"] < 1e-9, f"{name}: aux_loss missing or wrong"


def test_one_rank_in_process_with_capacity_and_top_3():
    """World size 1, in this process: capacity drops and top-3 routing give the dense layer's output."""
    import labs.lab11_experts as lab
    from helpers.dist import distributed

    with distributed():
        with torch.random.fork_rng():
            torch.manual_seed(3)
            moe = lab.MoE(5, 7, 4, 3, capacity_factor=0.75).double()
        x = torch.randn(9, 5, generator=torch.Generator().manual_seed(4), dtype=F64)
        out = ExpertParallelMoE.from_dense(moe)(x)
        assert (out - reference(moe, x)[0]).abs().max() < 1e-9


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    worker()
