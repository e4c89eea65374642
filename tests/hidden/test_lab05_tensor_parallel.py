"""Hidden tests of lab 05's exercises (instructor only): 3 ranks, sizes whose chunks are odd,
non-contiguous inputs, more SGD steps, the exact collectives each backward issues, a process
group that is not the world (ranks {0, 1} and {2} as two separate tensor-parallel groups), and a
Transformer block with attention heads split across ranks.

One launch on 3 ranks runs every case (this file is also the worker); float64, TOL = 1e-9 (a
correct implementation differs by summation order, ~1e-15). Reading the reports, comparing with
the dense model and training side by side are the public tests' (tests/public/test_lab05_tensor_parallel.py).
"""
from __future__ import annotations

import pytest

import labs.lab05_tensor_parallel as lab
from helpers.notice import stub_message
from tests.harness import launch_ranks
from tests.public.test_lab05_tensor_parallel import (BACKWARDS, F_G, GATHER, TOL, assert_matches_dense,
                                                     case, mlp_report, run_each, training_report)

NPROC = 3
BATCH, SEQ, D_MODEL, D_FF, STEPS = 3, 5, 6, 21, 5   # d_ff / 3 = 7 columns per rank
SUBGROUP_D_FF = 14                                  # split over the groups {0, 1} and {2}
HEADS, HEAD_DIM, BLOCK_FF = 6, 2, 12                # 2 heads per rank


@pytest.fixture(scope="module")
def results():
    """{rank: report}; nothing is launched while every backward is still the stub."""
    all_stubs = all(stub_message(backward) for backward in BACKWARDS)
    return launch_ranks(__file__, "hidden", nproc=NPROC, timeout=240, env={"DIST_TIMEOUT": "30"},
                        needs=BACKWARDS if all_stubs else [])


@pytest.mark.exercise("f_g_backward")
@pytest.mark.points(2)
def test_megatron_mlp_three_ranks_odd_chunks(results):
    """Megatron MLP on another world size, non-contiguous input: trains like dense, expected collectives."""
    reports = case(results, "megatron", F_G)
    assert_matches_dense(reports, "Megatron MLP, 3 ranks, non-contiguous input: ", STEPS)
    shape = [SEQ, BATCH, D_MODEL]  # the input was transposed
    for rep in reports:
        assert rep["calls"] == [["forward", "all_reduce", shape], ["backward", "all_reduce", shape]], (
            f"one all-reduce forward (g), one backward (f), nothing else; got {rep['calls']}")


@pytest.mark.exercise("gather_backward")
@pytest.mark.points(2)
def test_allgather_mlp_three_ranks(results):
    """All-gather MLP on another world size trains like the dense MLP, only the expected collectives."""
    reports = case(results, "allgather", GATHER)
    assert_matches_dense(reports, "all-gather MLP, 3 ranks: ", STEPS)
    for rep in reports:
        assert rep["calls"] == [["forward", "all_gather", [SEQ, BATCH, D_FF]],
                                ["forward", "all_gather", [SEQ, BATCH, D_MODEL]],
                                ["backward", "all_reduce", [SEQ, BATCH, D_FF]],
                                ["backward", "all_reduce", [SEQ, BATCH, D_MODEL]]], rep["calls"]


@pytest.mark.exercise("f_g_backward")
@pytest.mark.points(2)
def test_backward_uses_the_layers_group(results):
    """Megatron MLP on two separate tensor-parallel groups of different sizes trains like dense.

    Ranks {0, 1} form one tensor-parallel group and {2} another; an all-reduce over the world
    instead of ctx.group mixes the two models' gradients."""
    reports = case(results, "subgroup_megatron", F_G)
    assert [rep["group_size"] for rep in reports] == [2, 2, 1]
    assert_matches_dense(reports, "Megatron MLP on a sub-group: ", STEPS)


@pytest.mark.exercise("gather_backward")
def test_gather_backward_uses_the_rank_in_the_group(results):
    """All-gather MLP on groups whose ranks differ from the global ranks trains like dense."""
    reports = case(results, "subgroup_allgather", GATHER)
    assert_matches_dense(reports, "all-gather MLP on a sub-group: ", STEPS)


@pytest.mark.exercise("f_g_backward")
def test_f_backward_three_ranks_leaves_grad_output_alone(results):
    """f's backward gives the right input gradient on another world size, grad_output left unchanged."""
    for rank, rep in enumerate(case(results, "f_skip", F_G)):
        assert rep["grad_diff"] < TOL, f"rank {rank}: f's dL/dx off by {rep['grad_diff']:.2e} on 3 ranks"
        assert rep["skip_grad_diff"] < TOL, (
            f"rank {rank}: f's backward modified grad_output in place (a branch beside f changed)")


@pytest.mark.exercise("gather_backward")
def test_gather_backward_middle_rank(results):
    """Gather's backward: the right input gradient on every rank (a middle one too), expected collectives."""
    for rank, rep in enumerate(case(results, "gather", GATHER)):
        assert rep["grad_diff"] < TOL, f"rank {rank}: dL/dx is not chunk {rank} of dL/dy"
        assert rep["calls"] == [["forward", "all_gather", [2, 4, 9]]], rep["calls"]


@pytest.mark.exercise("f_g_backward")
@pytest.mark.points(2)
def test_transformer_block_trains_like_dense(results):
    """A Transformer block with its heads split over the ranks trains like the dense block."""
    reports = case(results, "block", F_G)
    assert_matches_dense(reports, "Transformer block (2 heads per rank): ", STEPS)
    for rep in reports:
        assert [c[:2] for c in rep["calls"]] == [["forward", "all_reduce"]] * 2 + [["backward", "all_reduce"]] * 2
        losses_dense, losses_tp = rep["diffs"]["losses_dense"], rep["diffs"]["losses_parallel"]
        assert max(abs(a - b) for a, b in zip(losses_dense, losses_tp)) < TOL


# ----------------------------------------------------------------------------------------------
# The worker
# ----------------------------------------------------------------------------------------------


def worker_cases(ctx) -> dict:
    import torch
    import torch.distributed as dist
    import labs.lab05_tp_transformer as block_lab

    dtype = torch.float64
    # every rank must create every group, in the same order
    groups = [dist.new_group([0, 1]), dist.new_group([2])]
    my_group = groups[0] if ctx.rank < 2 else groups[1]

    def transposed_batch(seed):  # [SEQ, BATCH, D]: a non-contiguous view
        x, target = lab.sample_batch(BATCH, SEQ, D_MODEL, seed=seed, dtype=dtype, device=ctx.device)
        return x.transpose(0, 1), target.transpose(0, 1)

    def mlp_case(scheme, group, d_ff=D_FF):
        x, target = transposed_batch(5)
        return {**mlp_report(scheme, group, x, target, d_ff, STEPS, seed=4),
                "group_size": dist.get_world_size(group)}

    def gather_case():
        log = lab.CommLog()
        gen = torch.Generator().manual_seed(6)
        full = torch.randn(4, 2, 9, generator=gen, dtype=dtype)           # [S, B, d]
        upstream = torch.randn(2, 4, 9, generator=gen, dtype=dtype)
        x = full.chunk(3, dim=-1)[ctx.rank].transpose(0, 1).to(ctx.device).requires_grad_(True)
        y = lab.gather_from_tp_region(x, None, log)                       # [B, S, 9]
        log.phase = "backward"
        (y * upstream.to(ctx.device)).sum().backward()
        mine = upstream.chunk(3, dim=-1)[ctx.rank]
        return {"grad_diff": (x.grad.cpu() - mine).abs().max().item(), "calls": log.summary()}

    def f_skip_case():  # y = f(x) + branch: the add hands one gradient tensor to both
        log = lab.CommLog()
        gen = torch.Generator().manual_seed(9)
        x = torch.randn(3, 5, generator=gen, dtype=dtype).to(ctx.device).requires_grad_(True)
        weights = [torch.randn(3, 5, generator=gen, dtype=dtype) for _ in range(NPROC)]
        skip = torch.zeros(3, 5, dtype=dtype, device=ctx.device, requires_grad=True)
        branch = skip * 1.0  # made before f, so autograd runs f's backward first
        y = lab.copy_to_tp_region(x, None, log) + branch
        (y * weights[ctx.rank].to(ctx.device)).sum().backward()
        return {"grad_diff": (x.grad.cpu() - sum(weights)).abs().max().item(),
                "skip_grad_diff": (skip.grad.cpu() - weights[ctx.rank]).abs().max().item()}

    def block_case():
        log = lab.CommLog()
        dense = block_lab.dense_block(HEADS * HEAD_DIM, HEADS, BLOCK_FF, seed=7, dtype=dtype, device=ctx.device)
        parallel = block_lab.tensor_parallel_block(dense, None, log)
        x, target = lab.sample_batch(2, 4, HEADS * HEAD_DIM, seed=8, dtype=dtype, device=ctx.device)
        return training_report(dense, parallel, log, x, target, STEPS, lr=0.1)

    cases = {
        "megatron": lambda: mlp_case("megatron", None),
        "allgather": lambda: mlp_case("allgather", None),
        "subgroup_megatron": lambda: mlp_case("megatron", my_group, SUBGROUP_D_FF),
        "subgroup_allgather": lambda: mlp_case("allgather", my_group, SUBGROUP_D_FF),
        "gather": gather_case,
        "f_skip": f_skip_case,
        "block": block_case,
    }
    return run_each(cases)


if __name__ == "__main__":
    from helpers.dist import distributed

    with distributed() as ctx:
        ctx.report(**worker_cases(ctx))
