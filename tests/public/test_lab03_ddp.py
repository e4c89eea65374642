"""Public tests of the lab 03 homework: `plan_buckets` and `BucketedDDP` (labs/lab03_ddp.py).

BucketedDDP runs on 2 real processes and is compared with one process that sees the whole global
batch (gradients every step, parameters after 4 SGD-with-momentum steps; atol 1e-6, rtol 1e-5,
float32 sums in a different order). It is also checked for what it is for: fewer collectives than
parameters, every all-reduce launched while backward is still running, none waited on inside it.

Run:  .venv/bin/python -m pytest tests/public/test_lab03_ddp.py -q
"""
from __future__ import annotations

import pytest
import torch

from helpers.launch import launch


ATOL, RTOL = 1e-6, 1e-5
SIZES = [12, 40, 40, 40, 6]   # 8 parameters: W (40, 12), b (40), ..., W (6, 40), b (6)
BUCKET_CAP_MB = 8192 / 2**20  # 8 KiB: buckets [7, 6, 5, 4, 3], [2, 1], [0]
STEPS = 4


def _floats(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.zeros(shape) for shape in shapes]


@pytest.mark.exercise("plan_buckets")
def test_plan_buckets_docstring_examples():
    from labs.lab03_ddp import plan_buckets

    params = _floats((25,), (25,), (25,), (25,))  # 100 bytes each
    assert plan_buckets(params, 250) == [[3, 2], [1, 0]]
    assert plan_buckets(params, 0) == [[3], [2], [1], [0]]
    assert plan_buckets(params, 10**9) == [[3, 2, 1, 0]]


@pytest.mark.exercise("plan_buckets")
def test_plan_buckets_mlp_layout():
    from labs.lab03_ddp import make_mlp, plan_buckets

    params = list(make_mlp(SIZES, seed=0).parameters())
    assert plan_buckets(params, int(BUCKET_CAP_MB * 2**20)) == [[7, 6, 5, 4, 3], [2, 1], [0]]


@pytest.fixture(scope="module")
def bucketed_run():
    return launch(__file__, "bucketed", nproc=2, timeout=120, stream=False).results


@pytest.mark.exercise("bucketed_ddp")
def test_construction_broadcasts_rank0_parameters(bucketed_run):
    for rank, res in bucketed_run.items():
        assert res["max_init_diff_vs_rank0"] == 0.0, f"rank {rank} did not start from rank 0's weights"


@pytest.mark.exercise("bucketed_ddp")
def test_gradients_equal_one_process_with_the_global_batch(bucketed_run):
    for rank, res in bucketed_run.items():
        for step, (diff, scale) in enumerate(zip(res["grad_diffs"], res["grad_scales"])):
            assert diff <= ATOL + RTOL * scale, f"rank {rank} step {step}: grads differ by {diff:g}"


@pytest.mark.exercise("bucketed_ddp")
def test_parameters_after_steps_equal_one_process(bucketed_run):
    for rank, res in bucketed_run.items():
        assert res["max_param_diff_vs_reference"] <= ATOL, (
            f"rank {rank}: parameters after {STEPS} steps differ by "
            f"{res['max_param_diff_vs_reference']:g}")
    assert bucketed_run[0]["params_head"] == bucketed_run[1]["params_head"], \
        "the ranks' parameters are not identical"


@pytest.mark.exercise("bucketed_ddp")
def test_fewer_collectives_than_parameters(bucketed_run):
    res = bucketed_run[0]
    assert res["num_buckets"] == 3
    assert res["collectives_per_step"] == [res["num_buckets"]] * STEPS, \
        "expected one all-reduce per bucket per step"
    assert max(res["collectives_per_step"]) < res["num_params"]
    assert res["bytes_per_step"] == [res["param_bytes"]] * STEPS, \
        "each step should all-reduce every gradient byte exactly once"


@pytest.mark.exercise("bucketed_ddp")
def test_all_reduces_launched_before_backward_returns(bucketed_run):
    for rank, res in bucketed_run.items():
        assert min(res["launched_during_backward"]) >= 1, (
            f"rank {rank}: no all-reduce was launched before loss.backward() returned: "
            "launch them from the gradient hooks")
        assert max(res["waited_during_backward"]) == 0, (
            f"rank {rank}: an all-reduce was waited on inside backward: that removes the overlap")
        assert res["blocking_all_reduces"] == 0, f"rank {rank}: launch the all-reduces with async_op=True"


def bucketed_case(ctx) -> dict:
    from torch import nn

    from labs.lab03_ddp import BucketedDDP, flat_grads, flat_params, global_batch, local_shard, make_mlp

    model = make_mlp(SIZES, seed=100 + ctx.rank)  # a different initialisation on every rank
    ddp = BucketedDDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    reference = make_mlp(SIZES, seed=100)         # rank 0's initialisation, one process
    out = {"max_init_diff_vs_rank0": (flat_params(model) - flat_params(reference)).abs().max().item(),
           "num_buckets": len(ddp.buckets), "num_params": len(list(model.parameters())),
           "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    keys = ("grad_diffs", "grad_scales", "collectives_per_step", "bytes_per_step",
            "launched_during_backward", "waited_during_backward")
    out.update({k: [] for k in keys})
    for step in range(STEPS):
        x, y = global_batch(step, 8 * ctx.world_size, SIZES[0], SIZES[-1])
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(local_shard(x, ctx.rank, ctx.world_size)),
                                      local_shard(y, ctx.rank, ctx.world_size))
        launched, waited, sent = ddp.comm.collectives, ddp.comm.waits, ddp.comm.bytes
        loss.backward()
        out["launched_during_backward"].append(ddp.comm.collectives - launched)
        out["waited_during_backward"].append(ddp.comm.waits - waited)
        ddp.finish_gradient_synchronization()
        out["collectives_per_step"].append(ddp.comm.collectives - launched)
        out["bytes_per_step"].append(ddp.comm.bytes - sent)
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        out["grad_diffs"].append((flat_grads(model) - flat_grads(reference)).abs().max().item())
        out["grad_scales"].append(flat_grads(reference).abs().max().item())
        opt.step()
        ref_opt.step()
    out["max_param_diff_vs_reference"] = (flat_params(model) - flat_params(reference)).abs().max().item()
    out["params_head"] = flat_params(model)[:32].tolist()
    out["blocking_all_reduces"] = ddp.comm.blocking
    return out


if __name__ == "__main__":
    import sys

    from helpers.dist import distributed

    with distributed() as ctx:
        ctx.report(**{"bucketed": bucketed_case}[sys.argv[1]](ctx))
        ctx.report(done=True)
