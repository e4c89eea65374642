"""Public tests of lab 05's exercises: the backward passes of Megatron's f and g operators and of
the all-gather (labs/lab05_tensor_parallel.py).

Run:  .venv/bin/python -m pytest tests/public/test_lab05_tensor_parallel.py -q

One launch on 2 ranks (gloo on the CPU, or nccl with 2 GPUs) runs every case; this file is also
the worker. Everything is float64, so a correct implementation differs from the dense reference
only by summation order (about 1e-15) and TOL = 1e-9 separates that from any real mistake (a
missing or extra all-reduce is off by about 1e-1).
"""
from __future__ import annotations

import traceback

import pytest

from helpers.launch import launch

TOL = 1e-9
NPROC = 2
BATCH, SEQ, D_MODEL, D_FF, STEPS = 2, 3, 8, 16, 3


@pytest.fixture(scope="module")
def results():
    res = launch(__file__, "public", nproc=NPROC, timeout=180, stream=False, env={"DIST_TIMEOUT": "30"})
    return res.results


def case(results, name):
    """Every rank's report for one case; an exception on a rank fails the test with its traceback."""
    reports = [results[rank][name] for rank in range(NPROC)]
    for rank, rep in enumerate(reports):
        if "error" in rep:  # "rank R raised <last line>", as helpers.launch words a failed rank
            last = rep["error"].strip().splitlines()[-1]
            pytest.fail(f"rank {rank} raised {last}\n(case {name!r}; traceback below)\n{rep['error']}")
    return reports


def assert_matches_dense(reports):
    for rank, rep in enumerate(reports):
        d = rep["diffs"]
        assert d["output"] < TOL, f"rank {rank}: output differs from dense by {d['output']:.2e}"
        assert d["input_grad"] < TOL, f"rank {rank}: input gradient differs by {d['input_grad']:.2e}"
        for name, diff in d["grads"].items():
            assert diff < TOL, f"rank {rank}: gradient of {name} (this rank's shard) differs by {diff:.2e}"
        for name, diff in d["params_after_steps"].items():
            assert diff < TOL, f"rank {rank}: {name} differs by {diff:.2e} after {STEPS} SGD steps"


@pytest.mark.exercise("f_g_backward")
def test_f_backward_sums_every_ranks_share(results):
    for rank, rep in enumerate(case(results, "f")):
        assert rep["grad_diff"] < TOL, (
            f"rank {rank}: dL/dx should be the sum over ranks of each rank's share "
            f"(off by {rep['grad_diff']:.2e})")
        assert rep["calls"] == [["backward", "all_reduce", [BATCH, SEQ, D_MODEL]]], (
            f"f: nothing in forward, one all-reduce of the gradient in backward; got {rep['calls']}")


@pytest.mark.exercise("f_g_backward")
def test_g_backward_is_identity(results):
    for rank, rep in enumerate(case(results, "g")):
        assert rep["out_diff"] < TOL
        assert rep["grad_diff"] < TOL, (
            f"rank {rank}: dL/dpartial should equal dL/dy (off by {rep['grad_diff']:.2e})")
        assert rep["calls"] == [["forward", "all_reduce", [BATCH, SEQ, D_MODEL]]], (
            f"g: one all-reduce in forward, nothing in backward; got {rep['calls']}")


@pytest.mark.exercise("f_g_backward")
def test_megatron_mlp_matches_dense(results):
    assert_matches_dense(case(results, "megatron"))


@pytest.mark.exercise("f_g_backward")
def test_megatron_mlp_one_all_reduce_each_way(results):
    for rep in case(results, "megatron"):
        assert rep["calls"] == [["forward", "all_reduce", [BATCH, SEQ, D_MODEL]],
                                ["backward", "all_reduce", [BATCH, SEQ, D_MODEL]]]


@pytest.mark.exercise("gather_backward")
def test_gather_backward_keeps_this_ranks_chunk(results):
    for rank, rep in enumerate(case(results, "gather")):
        assert rep["out_diff"] < TOL
        assert rep["grad_shape"] == [BATCH, SEQ, D_MODEL // NPROC], f"rank {rank}: {rep['grad_shape']}"
        assert rep["grad_diff"] < TOL, (
            f"rank {rank}: dL/dx should be columns {rank}*d/N... of dL/dy (off by {rep['grad_diff']:.2e})")
        assert rep["calls"] == [["forward", "all_gather", [BATCH, SEQ, D_MODEL]]], (
            f"the all-gather's backward sends nothing; got {rep['calls']}")


@pytest.mark.exercise("gather_backward")
def test_allgather_mlp_matches_dense(results):
    """Needs f's backward too (each column layer starts with f)."""
    reports = case(results, "allgather")
    assert_matches_dense(reports)
    for rep in reports:
        assert [c[:2] for c in rep["calls"]] == [["forward", "all_gather"], ["forward", "all_gather"],
                                                 ["backward", "all_reduce"], ["backward", "all_reduce"]]


# ----------------------------------------------------------------------------------------------
# The worker: `launch(__file__, "public")` runs this on every rank
# ----------------------------------------------------------------------------------------------


def worker_cases(ctx) -> dict:
    import torch
    import labs.lab05_tensor_parallel as lab

    dtype = torch.float64

    def per_rank(seed, *shape):  # a different tensor on every rank; any rank can rebuild any
        return [torch.randn(*shape, generator=torch.Generator().manual_seed(seed + r), dtype=dtype)
                for r in range(ctx.world_size)]

    def f_case():
        log = lab.CommLog()
        x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(0), dtype=dtype)
        x = x.to(ctx.device).requires_grad_(True)
        weights = per_rank(10, BATCH, SEQ, D_MODEL)
        y = lab.copy_to_tp_region(x, None, log)
        log.phase = "backward"
        (y * weights[ctx.rank].to(ctx.device)).sum().backward()
        expected = sum(weights)  # dL/dx = sum over ranks of w_r
        return {"grad_diff": (x.grad.cpu() - expected).abs().max().item(), "calls": log.summary()}

    def g_case():
        log = lab.CommLog()
        partials = per_rank(20, BATCH, SEQ, D_MODEL)
        p = partials[ctx.rank].to(ctx.device).requires_grad_(True)
        y = lab.reduce_from_tp_region(p, None, log)
        upstream = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(1), dtype=dtype)
        log.phase = "backward"
        (y * upstream.to(ctx.device)).sum().backward()
        return {"out_diff": (y.detach().cpu() - sum(partials)).abs().max().item(),
                "grad_diff": (p.grad.cpu() - upstream).abs().max().item(), "calls": log.summary()}

    def gather_case():
        log = lab.CommLog()
        pieces = per_rank(30, BATCH, SEQ, D_MODEL // ctx.world_size)
        x = pieces[ctx.rank].to(ctx.device).requires_grad_(True)
        y = lab.gather_from_tp_region(x, None, log)
        upstream = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(2), dtype=dtype)
        log.phase = "backward"
        (y * upstream.to(ctx.device)).sum().backward()
        mine = upstream.chunk(ctx.world_size, dim=-1)[ctx.rank]
        return {"out_diff": (y.detach().cpu() - torch.cat(pieces, -1)).abs().max().item(),
                "grad_shape": list(x.grad.shape), "grad_diff": (x.grad.cpu() - mine).abs().max().item(),
                "calls": log.summary()}

    def mlp_case(scheme):
        log = lab.CommLog()
        parallel = lab.SCHEMES[scheme](lab.dense_mlp(D_MODEL, D_FF, dtype=dtype, device=ctx.device), None, log)
        x, target = lab.sample_batch(BATCH, SEQ, D_MODEL, seed=3, dtype=dtype, device=ctx.device)
        calls = lab.count_collectives(parallel, log, x)
        diffs = lab.compare_training(lab.dense_mlp(D_MODEL, D_FF, dtype=dtype, device=ctx.device),
                                     parallel, x, target, steps=STEPS)
        return {"diffs": diffs, "calls": [(c.phase, c.op, c.shape) for c in calls]}

    cases = {"f": f_case, "g": g_case, "gather": gather_case,
             "megatron": lambda: mlp_case("megatron"), "allgather": lambda: mlp_case("allgather")}
    out = {}
    for name, fn in cases.items():
        try:
            out[name] = fn()
        except Exception:  # every rank fails the same way (e.g. NotImplementedError): report it
            out[name] = {"error": traceback.format_exc(limit=-3)}
    return out


if __name__ == "__main__":
    from helpers.dist import distributed

    with distributed() as ctx:
        ctx.report(**worker_cases(ctx))
