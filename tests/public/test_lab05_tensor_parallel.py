"""Public tests of lab 05's exercises: the backward passes of Megatron's f and g operators and of
the all-gather (labs/lab05_tensor_parallel.py).

Run:  ./run.sh check 05      (or: .venv/bin/python -m pytest tests/public/test_lab05_tensor_parallel.py)

One launch on 2 ranks (gloo on the CPU, or nccl with 2 GPUs) runs every case; this file is also
the worker. Nothing is launched while all three backward passes are still their stubs, and a test
whose exercise is still its stub reports it as not implemented yet. Everything is float64, so a
correct implementation differs from the dense reference only by summation order (about 1e-15) and
TOL = 1e-9 separates that from any real mistake (a missing or extra all-reduce is off by about 1e-1).
"""
from __future__ import annotations

import traceback

import pytest

import labs.lab05_tensor_parallel as lab
from helpers.notice import Unsolved, stub_message
from tests.harness import launch_ranks

TOL = 1e-9
NPROC = 2
BATCH, SEQ, D_MODEL, D_FF, STEPS = 2, 3, 8, 16, 3
F_G = [lab.CopyToTensorParallelRegion.backward, lab.ReduceFromTensorParallelRegion.backward]
GATHER = [lab.GatherFromTensorParallelRegion.backward, lab.CopyToTensorParallelRegion.backward]
BACKWARDS = F_G + GATHER[:1]


@pytest.fixture(scope="module")
def results():
    """{rank: report}; nothing is launched while every backward is still the stub."""
    all_stubs = all(stub_message(backward) for backward in BACKWARDS)
    return launch_ranks(__file__, "public", nproc=NPROC, timeout=180, env={"DIST_TIMEOUT": "30"},
                        needs=BACKWARDS if all_stubs else [])


def case(results, name, needs, hint=""):
    """Every rank's report for one case. A stub among `needs` makes the test "not implemented
    yet"; an exception on a rank fails it with that rank's error (and `hint`, what it likely means)."""
    for backward in needs:
        message = stub_message(backward)
        if message:
            raise Unsolved(message)
    reports = [results[rank][name] for rank in range(len(results))]
    for rank, rep in enumerate(reports):
        if "error" in rep:  # "rank R raised <last line>", as helpers.launch words a failed rank
            last = rep["error"].strip().splitlines()[-1]
            pytest.fail(f"rank {rank} raised {last}{hint}\n(case {name!r}; traceback below)\n{rep['error']}")
    return reports


def assert_matches_dense(reports, what="", steps=STEPS):
    """Every rank's output, input gradient, gradients of its shards and parameters after `steps`
    SGD steps equal the dense model's (within TOL); `what` starts each message."""
    for rank, rep in enumerate(reports):
        d = rep["diffs"]
        assert d["output"] < TOL, f"{what}rank {rank}: output differs from dense by {d['output']:.2e}"
        assert d["input_grad"] < TOL, f"{what}rank {rank}: input gradient differs by {d['input_grad']:.2e}"
        for name, diff in d["grads"].items():
            assert diff < TOL, f"{what}rank {rank}: gradient of {name} (this rank's shard) differs by {diff:.2e}"
        for name, diff in d["params_after_steps"].items():
            assert diff < TOL, f"{what}rank {rank}: {name} differs by {diff:.2e} after {steps} SGD steps"


def scaled(rep, what: str, small: str = "the contributions add up (chain rule), they are not "
           "estimates to average") -> str:
    """": " and what a gradient off by exactly a factor of N or 1/N means (`small`: why not 1/N),
    or "" if it is not."""
    k, residual = rep["grad_factor"]
    if residual < TOL and abs(k - NPROC) < 1e-6:
        return (f": {what} is exactly {NPROC} times too large on {NPROC} ranks: a sum over the ranks "
                "of something every rank already holds complete (an all-reduce too many)")
    if residual < TOL and abs(k - 1 / NPROC) < 1e-6:
        return f": {what} is exactly 1/{NPROC} of the right one on {NPROC} ranks: {small}"
    return ""


RECORDED = "(communicate through all_reduce_sum / all_gather_last_dim: a collective called directly is not recorded)"


@pytest.mark.exercise("f_g_backward")
def test_f_backward_gives_the_whole_input_gradient(results):
    """f's backward returns on every rank the whole dL/dx, as one process computes it."""
    for rank, rep in enumerate(case(results, "f", F_G)):
        assert rep["grad_diff"] < TOL, (
            f"rank {rank}: f's backward returned a dL/dx off by {rep['grad_diff']:.2e}"
            + (scaled(rep, "f's dL/dx") or ": autograd's grad_output on one rank holds only the part "
               "of dL/dx that flows through that rank's Y_r (notebook 05, section 4, question 1)"))


@pytest.mark.exercise("f_g_backward")
def test_f_backward_communicates_once(results):
    """f issues exactly one collective: an all-reduce of the gradient, in its backward."""
    for rep in case(results, "f", F_G):
        assert rep["calls"] == [["backward", "all_reduce", [BATCH, SEQ, D_MODEL]]], (
            f"f (identity forward) issued {rep['calls']}; its backward needs exactly one collective "
            f"of the gradient {RECORDED}")


@pytest.mark.exercise("f_g_backward")
def test_f_backward_leaves_grad_output_alone(results):
    """f's backward leaves grad_output alone: a branch beside f gets its gradient unchanged.

    y = f(x) + branch: autograd hands the same gradient tensor to f and to the branch, whose
    backward runs after f's."""
    for rank, rep in enumerate(case(results, "f", F_G)):
        assert rep["skip_grad_diff"] < TOL, (
            f"rank {rank}: the gradient of a branch beside f changed by {rep['skip_grad_diff']:.2e}: "
            "f's backward modified grad_output in place (return a new tensor; all_reduce_sum does)")


@pytest.mark.exercise("f_g_backward")
def test_g_backward(results):
    """g's forward sums the partial outputs; its backward gives dL/dpartial without a collective."""
    for rank, rep in enumerate(case(results, "g", F_G)):
        assert rep["out_diff"] < TOL, f"rank {rank}: g's forward output is off by {rep['out_diff']:.2e}"
        assert rep["grad_diff"] < TOL, (
            f"rank {rank}: g's backward returned a dL/dpartial off by {rep['grad_diff']:.2e}"
            + (scaled(rep, "g's dL/dpartial", "y is the sum of the partials, so a change in one "
                      "rank's partial changes y by as much: nothing is shared out")
               or ": y is the sum of the partials, so how does y change when one rank's partial "
                  "changes? (notebook 05, section 4, question 2)"))
        assert rep["calls"] == [["forward", "all_reduce", [BATCH, SEQ, D_MODEL]]], (
            f"g issued {rep['calls']}: its forward all-reduce is all it needs; its backward issues "
            f"no collective {RECORDED}")


@pytest.mark.exercise("f_g_backward")
def test_megatron_mlp_matches_dense(results):
    """The Megatron MLP gives the dense MLP's outputs and gradients, and its weights after SGD steps."""
    assert_matches_dense(case(results, "megatron", F_G))


@pytest.mark.exercise("f_g_backward")
def test_megatron_mlp_one_all_reduce_each_way(results):
    """The Megatron MLP issues one all-reduce in its forward (g) and one in its backward (f), no more."""
    for rep in case(results, "megatron", F_G):
        assert rep["calls"] == [["forward", "all_reduce", [BATCH, SEQ, D_MODEL]],
                                ["backward", "all_reduce", [BATCH, SEQ, D_MODEL]]], (
            f"the Megatron MLP issued {rep['calls']}: f and g are conjugate, one all-reduce in each "
            f"pass {RECORDED}")


@pytest.mark.exercise("f_g_backward")
def test_backward_uses_the_layers_group(results):
    """The backward passes communicate over the layer's group (ctx.group), not over every rank.

    Each rank is a tensor-parallel group of its own: a backward that communicates over every
    rank instead of ctx.group mixes two separate models' gradients."""
    assert_matches_dense(case(results, "subgroup_megatron", F_G),
                         "Megatron MLP on a group of one rank (use ctx.group): ")


@pytest.mark.exercise("gather_backward")
def test_gather_backward_keeps_this_ranks_chunk(results):
    """The all-gather's backward returns this rank's slice of dL/dy (x's shape) without a collective."""
    shape_hint = (f" (dL/dx must have x's shape, [{BATCH}, {SEQ}, {D_MODEL // NPROC}]: return this "
                  "rank's columns of dL/dy, not all of them)")
    for rank, rep in enumerate(case(results, "gather", GATHER, shape_hint)):
        assert rep["out_diff"] < TOL
        assert rep["grad_shape"] == [BATCH, SEQ, D_MODEL // NPROC], (
            f"rank {rank}: dL/dx has shape {rep['grad_shape']}; it must have x's shape")
        assert rep["grad_diff"] < TOL, (
            f"rank {rank}: dL/dx is off by {rep['grad_diff']:.2e}"
            + (scaled(rep, "dL/dx") or ": which columns of y did this rank's x become? "
               "(notebook 05, section 4, question 3)"))
        assert rep["calls"] == [["forward", "all_gather", [BATCH, SEQ, D_MODEL]]], (
            f"the all-gather issued {rep['calls']}: every rank already holds all of dL/dy, so its "
            f"backward needs no collective {RECORDED}")


@pytest.mark.exercise("gather_backward")
def test_allgather_mlp_matches_dense(results):
    """The all-gather MLP trains like the dense MLP: two all-gathers forward, two all-reduces back.

    Needs f's backward too (each column layer starts with f)."""
    reports = case(results, "allgather", GATHER)
    assert_matches_dense(reports)
    for rep in reports:
        assert [c[:2] for c in rep["calls"]] == [["forward", "all_gather"], ["forward", "all_gather"],
                                                 ["backward", "all_reduce"], ["backward", "all_reduce"]], (
            f"the all-gather MLP issued {rep['calls']}")


@pytest.mark.exercise("gather_backward")
def test_gather_backward_uses_the_rank_in_the_group(results):
    """The all-gather's backward takes its slice by the rank in the layer's group, not the global rank."""
    hint = (" (the all-gather MLP on a group of one rank: the chunk to keep is given by the rank "
            "and size in ctx.group, dist.get_rank(ctx.group), not by the global ones)")
    assert_matches_dense(case(results, "subgroup_allgather", GATHER, hint),
                         "all-gather MLP on a group of one rank (use the rank in ctx.group): ")


# ----------------------------------------------------------------------------------------------
# The worker: `launch(__file__, "public")` runs this on every rank
# ----------------------------------------------------------------------------------------------
def training_report(dense, parallel, log, x, target, steps: int = STEPS, lr: float = 0.05) -> dict:
    """The collectives of one step of `parallel` (recorded in its CommLog `log`), then `dense` and
    `parallel` trained side by side from the same weights: their differences."""
    calls = lab.step_collectives(parallel, log, x)
    diffs = lab.compare_training(dense, parallel, x, target, steps=steps, lr=lr)
    return {"diffs": diffs, "calls": [(c.phase, c.op, c.shape) for c in calls]}


def mlp_report(scheme: str, group, x, target, d_ff: int = D_FF, steps: int = STEPS, seed: int = 0) -> dict:
    """The `scheme` MLP (lab.SCHEMES) on `group` against the dense MLP it was split from."""
    def dense():
        return lab.dense_mlp(x.shape[-1], d_ff, seed=seed, dtype=x.dtype, device=x.device)

    log = lab.CommLog()
    return training_report(dense(), lab.SCHEMES[scheme](dense(), group, log), log, x, target, steps)


def run_each(cases: dict) -> dict:
    """{name: case()} for every case, in order; a case that raised reports its traceback instead."""
    import torch.distributed as dist

    out = {}
    for name, fn in cases.items():
        try:
            out[name] = fn()
        except Exception:  # every rank fails the same way (e.g. NotImplementedError): report it
            out[name] = {"error": traceback.format_exc(limit=-3)}
        dist.barrier()  # a rank that failed early waits here instead of running ahead
    return out


def worker_cases(ctx) -> dict:
    import torch
    import torch.distributed as dist

    dtype = torch.float64
    groups = [dist.new_group([r]) for r in range(ctx.world_size)]  # every rank creates every group

    def factor(got, want):  # (k, max |got - k want|): is the gradient off by a constant factor?
        got, want = got.detach().cpu().double().flatten(), want.double().flatten()
        k = float(got @ want / (want @ want))
        return [k, (got - k * want).abs().max().item()]

    def per_rank(seed, *shape):  # a different tensor on every rank; any rank can rebuild any
        return [torch.randn(*shape, generator=torch.Generator().manual_seed(seed + r), dtype=dtype)
                for r in range(ctx.world_size)]

    def f_case():
        log = lab.CommLog()
        x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(0), dtype=dtype)
        x = x.to(ctx.device).requires_grad_(True)
        skip = torch.zeros(BATCH, SEQ, D_MODEL, dtype=dtype, device=ctx.device, requires_grad=True)
        weights = per_rank(10, BATCH, SEQ, D_MODEL)
        branch = skip * 1.0  # made before f, so autograd runs f's backward first
        y = lab.copy_to_tp_region(x, None, log) + branch  # the add hands one gradient tensor to both
        log.phase = "backward"
        (y * weights[ctx.rank].to(ctx.device)).sum().backward()
        expected = sum(weights)  # dL/dx = sum over ranks of w_r
        return {"grad_diff": (x.grad.cpu() - expected).abs().max().item(),
                "grad_factor": factor(x.grad, expected),
                "skip_grad_diff": (skip.grad.cpu() - weights[ctx.rank]).abs().max().item(),
                "calls": log.summary()}

    def g_case():
        log = lab.CommLog()
        partials = per_rank(20, BATCH, SEQ, D_MODEL)
        p = partials[ctx.rank].to(ctx.device).requires_grad_(True)
        y = lab.reduce_from_tp_region(p, None, log)
        upstream = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(1), dtype=dtype)
        log.phase = "backward"
        (y * upstream.to(ctx.device)).sum().backward()
        return {"out_diff": (y.detach().cpu() - sum(partials)).abs().max().item(),
                "grad_diff": (p.grad.cpu() - upstream).abs().max().item(),
                "grad_factor": factor(p.grad, upstream), "calls": log.summary()}

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
                "grad_factor": factor(x.grad, mine), "calls": log.summary()}

    def mlp_case(scheme, group=None):
        x, target = lab.sample_batch(BATCH, SEQ, D_MODEL, seed=3, dtype=dtype, device=ctx.device)
        return mlp_report(scheme, group, x, target)

    cases = {"f": f_case, "g": g_case, "gather": gather_case,
             "megatron": lambda: mlp_case("megatron"), "allgather": lambda: mlp_case("allgather"),
             "subgroup_megatron": lambda: mlp_case("megatron", groups[ctx.rank]),
             "subgroup_allgather": lambda: mlp_case("allgather", groups[ctx.rank])}
    return run_each(cases)


if __name__ == "__main__":
    from helpers.dist import distributed

    with distributed() as ctx:
        ctx.report(**worker_cases(ctx))
