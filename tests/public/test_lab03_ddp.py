"""Public tests of the lab 03 homework: `plan_buckets` and `BucketedDDP` (labs/lab03_ddp.py).

BucketedDDP runs on 2 real processes and is compared with one process that sees the whole global
batch (gradients every step, parameters after 4 SGD-with-momentum steps; atol 1e-6, rtol 1e-5,
float32 sums in a different order). It is also checked for what it is for: fewer collectives than
parameters, and overlap, observed from outside: hooks registered on every parameter *before* the
model is wrapped run just before BucketedDDP's own hook for that gradient, and note how many
all-reduces had been launched by then. When a gradient arrives, every bucket whose gradients had
all arrived before it must already be on its way (in bucket order); none may be waited on inside
backward.

Run:  ./run.sh check 03
"""
from __future__ import annotations

import pytest
import torch

from labs.lab03_ddp import BucketedDDP, plan_buckets
from tests.conftest import launch_ranks


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
    for cap, expected in ((250, [[3, 2], [1, 0]]), (0, [[3], [2], [1], [0]]),
                          (10**9, [[3, 2, 1, 0]])):
        got = plan_buckets(params, cap)
        assert got == expected, (
            f"four 100-byte parameters, cap {cap}: expected {expected}, got {got} (walk from the "
            "last parameter to the first: backward produces the last layer's gradient first)")
    got = plan_buckets(params, 200)
    assert got == [[3, 2], [1, 0]], (
        f"four 100-byte parameters, cap 200: expected [[3, 2], [1, 0]], got {got}: a bucket may "
        "reach the cap exactly; start a new one only when adding would go above it")


@pytest.mark.exercise("plan_buckets")
def test_plan_buckets_mlp_layout():
    from labs.lab03_ddp import make_mlp, plan_buckets

    params = list(make_mlp(SIZES, seed=0).parameters())
    got = plan_buckets(params, int(BUCKET_CAP_MB * 2**20))
    assert got == [[7, 6, 5, 4, 3], [2, 1], [0]], f"MLP {SIZES} with 8 KiB buckets: got {got}"


@pytest.fixture(scope="module")
def bucketed_run():
    return launch_ranks(__file__, "bucketed", nproc=2, timeout=120, needs=[plan_buckets, BucketedDDP])


@pytest.mark.exercise("bucketed_ddp")
def test_construction_broadcasts_rank0_parameters(bucketed_run):
    for rank, res in bucketed_run.items():
        assert res["max_init_diff_vs_rank0"] == 0.0, f"rank {rank} did not start from rank 0's weights"


@pytest.mark.exercise("bucketed_ddp")
def test_gradients_equal_one_process_with_the_global_batch(bucketed_run):
    for rank, res in bucketed_run.items():
        for step, (diff, scale, ratio) in enumerate(zip(res["grad_diffs"], res["grad_scales"],
                                                        res["grad_norm_ratios"])):
            assert diff <= ATOL + RTOL * scale, (
                f"rank {rank} step {step}: gradients differ from one process on the global batch "
                f"by {diff:g} (their norm is {ratio:.3g} times the reference's; "
                f"{res['world_size']} would mean summed over the ranks, not averaged)")


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


@pytest.mark.exercise("bucketed_ddp")
def test_earlier_buckets_are_on_their_way_when_the_last_gradient_arrives(bucketed_run):
    for rank, res in bucketed_run.items():
        for step, arrivals in enumerate(res["arrivals"]):
            last_param, launched = arrivals[-1]
            assert launched >= 1, (
                f"rank {rank} step {step}: when the step's last gradient (parameter {last_param}) "
                "arrived, no all-reduce had been launched yet: buckets must go out from "
                "_on_grad_ready as soon as they are complete, not all at the end of backward "
                "(then nothing overlaps)")


@pytest.mark.exercise("bucketed_ddp")
def test_each_bucket_launched_as_soon_as_it_is_complete(bucketed_run):
    for rank, res in bucketed_run.items():
        for step, arrivals in enumerate(res["arrivals"]):
            for k, (param, launched) in enumerate(arrivals):
                expected = complete_leading_buckets(res["buckets"], [p for p, _ in arrivals[:k]])
                assert launched == expected, (
                    f"rank {rank} step {step}: when the gradient of parameter {param} arrived, "
                    f"{expected} bucket(s) were complete (in bucket order) but {launched} "
                    "all-reduce(s) had been launched: launch each bucket, in order, right after "
                    "its last gradient is copied in")


def complete_leading_buckets(buckets: list[list[int]], arrived: list[int]) -> int:
    """How many buckets, counted in bucket order, have all their parameters in `arrived`."""
    count = 0
    for bucket in buckets:
        if not set(bucket) <= set(arrived):
            break
        count += 1
    return count


def observe_arrivals(model, state: dict) -> list:
    """Hooks registered before wrapping (so each runs just before the wrapper's hook for the same
    gradient): (parameter index, all-reduces launched so far this step) per arriving gradient."""
    arrivals: list[tuple[int, int]] = []
    for index, param in enumerate(model.parameters()):
        param.register_post_accumulate_grad_hook(
            lambda p, index=index: arrivals.append((index, state["ddp"].comm.collectives - state["start"])))
    return arrivals


def bucketed_case(ctx) -> dict:
    from torch import nn

    from labs.lab03_ddp import BucketedDDP, flat_grads, flat_params, global_batch, local_shard, make_mlp

    model = make_mlp(SIZES, seed=100 + ctx.rank)  # a different initialisation on every rank
    state = {"ddp": None, "start": 0}
    arrivals = observe_arrivals(model, state)     # before wrapping: these hooks run first
    ddp = state["ddp"] = BucketedDDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    reference = make_mlp(SIZES, seed=100)         # rank 0's initialisation, one process
    out = {"max_init_diff_vs_rank0": (flat_params(model) - flat_params(reference)).abs().max().item(),
           "num_buckets": len(ddp.buckets), "num_params": len(list(model.parameters())),
           "param_bytes": sum(p.nbytes for p in model.parameters()),
           "buckets": [b.param_indices for b in ddp.buckets], "arrivals": [],
           "world_size": ctx.world_size}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    keys = ("grad_diffs", "grad_scales", "grad_norm_ratios", "collectives_per_step",
            "bytes_per_step", "launched_during_backward", "waited_during_backward")
    out.update({k: [] for k in keys})
    for step in range(STEPS):
        x, y = global_batch(step, 8 * ctx.world_size, SIZES[0], SIZES[-1])
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(local_shard(x, ctx.rank, ctx.world_size)),
                                      local_shard(y, ctx.rank, ctx.world_size))
        launched, waited, sent = ddp.comm.collectives, ddp.comm.waits, ddp.comm.bytes
        state["start"] = launched
        arrivals.clear()
        loss.backward()
        out["arrivals"].append(list(arrivals))
        out["launched_during_backward"].append(ddp.comm.collectives - launched)
        out["waited_during_backward"].append(ddp.comm.waits - waited)
        ddp.finish_gradient_synchronization()
        out["collectives_per_step"].append(ddp.comm.collectives - launched)
        out["bytes_per_step"].append(ddp.comm.bytes - sent)
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        out["grad_diffs"].append((flat_grads(model) - flat_grads(reference)).abs().max().item())
        out["grad_scales"].append(flat_grads(reference).abs().max().item())
        out["grad_norm_ratios"].append((flat_grads(model).norm() / flat_grads(reference).norm()).item())
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
