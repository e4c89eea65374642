"""Hidden tests of the lab 03 homework (instructor only): plan_buckets, BucketedDDP, fit.

Stricter than the public tests: random layouts and mixed dtypes for plan_buckets; 3 ranks; a
subgroup that excludes rank 0 (broadcast from the group's first rank, averaging over the group);
every bucket launched during backward, in bucket order, with exactly the bucket's size, each one
as soon as its last gradient is in (observed by hooks registered before wrapping, as in the public
tests, on another model and world size), also on a gated model whose first gradient completes
the last bucket; no wait of any kind inside backward (one rank holds back its first gradient
until another rank's backward has returned); gradients set to None between steps; gradient
accumulation with no_sync; bucket caps at both extremes; the classifier on 3 ranks, with the
public tests' checks of its batches and logged losses. Tolerances: atol 1e-6 + rtol 1e-5 on
gradients, atol 1e-6 on parameters. One 3-rank launch runs every distributed case; a case that
raises is reported, not fatal (an exercise still a stub is reported as not implemented). The
training next to one process and the observers are the public tests' (tests/public/test_lab03_ddp.py).
"""
from __future__ import annotations

import random
import traceback

import pytest
import torch

from helpers.notice import Unsolved, unsolved_message
from tests.harness import launch_ranks
from tests.public.test_lab03_classifier import classifier_checks, fit_and_observe
from tests.public.test_lab03_ddp import (HoldBack, complete_leading_buckets, train_against_reference,
                                         wrap_and_train)


ATOL, RTOL = 1e-6, 1e-5
CAP_BYTES = 4096
STEPS = 5
HOLD_STEP, HOLD_TIMEOUT_S = 2, 20.0  # rank 2 holds its first gradient until rank 0's backward returned
GATED_CAP_BYTES = 1200  # Gated's buckets: [4, 3, 2], [1], [0] (the gate alone, last)


def reference_plan(params, cap):
    """An independent implementation of the rules in plan_buckets' docstring."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.nbytes
        if current and (p.dtype != params[current[0]].dtype or size + nbytes > cap):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    return buckets + ([current] if current else [])


@pytest.mark.exercise("plan_buckets")
def test_plan_buckets_cap_is_inclusive_and_big_params_stand_alone():
    """A bucket may fill the cap exactly; a parameter larger than the cap gets a bucket of its own."""
    from labs.lab03_ddp import plan_buckets

    params = [torch.zeros(50), torch.zeros(50), torch.zeros(1000), torch.zeros(25), torch.zeros(25)]
    # 200 bytes fit a 200-byte cap exactly; the 4000-byte parameter exceeds it and stands alone
    assert plan_buckets(params, 200) == [[4, 3], [2], [1], [0]]
    assert plan_buckets(params, 400) == [[4, 3], [2], [1, 0]]


@pytest.mark.exercise("plan_buckets")
def test_plan_buckets_splits_on_dtype_change():
    """A new bucket starts whenever the dtype changes, even with a huge cap."""
    from labs.lab03_ddp import plan_buckets

    params = [torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(4),
              torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.float16)]
    assert plan_buckets(params, 10**6) == [[4, 3], [2], [1], [0]]


@pytest.mark.exercise("plan_buckets")
@pytest.mark.points(2)
def test_plan_buckets_random_layouts():
    """Follows plan_buckets' docstring rules on many random layouts, mixed dtypes, caps from 0 up."""
    from labs.lab03_ddp import plan_buckets

    rng = random.Random(3)
    for trial in range(60):
        params = [torch.zeros(rng.choice([1, 3, 17, 64, 100, 257, 1000]),
                              dtype=rng.choice([torch.float32, torch.float32, torch.bfloat16]))
                  for _ in range(rng.randint(1, 12))]
        cap = rng.choice([0, 1, 64, 400, 1024, 4096, 10**9])
        got = plan_buckets(params, cap)
        assert got == reference_plan(params, cap), f"trial {trial}: sizes {[p.numel() for p in params]}, cap {cap}"


@pytest.fixture(scope="module")
def hidden_run():
    return launch_ranks(__file__, nproc=3, timeout=240, env={"DIST_TIMEOUT": "45"})


def _case(hidden_run, name):
    out = {}
    for rank, res in hidden_run.items():
        value = res.get(name)
        assert value is not None, f"case {name} did not report on rank {rank}"
        if "error" in value:
            stub = unsolved_message(RuntimeError(value["error"]))
            if stub:
                raise Unsolved(stub)
            raise AssertionError(f"case {name} failed on rank {rank}:\n{value['error']}")
        out[rank] = value
    return out


@pytest.mark.exercise("bucketed_ddp")
@pytest.mark.points(2)
def test_three_ranks_match_one_process(hidden_run):
    """3 ranks start from identical weights and train like one process (gradients, parameters)."""
    for rank, res in _case(hidden_run, "world").items():
        assert res["max_init_diff_vs_rank0"] == 0.0
        for step, (diff, scale) in enumerate(zip(res["grad_diffs"], res["grad_scales"])):
            assert diff <= ATOL + RTOL * scale, f"rank {rank} step {step}: grads differ by {diff:g}"
        assert res["max_param_diff_vs_reference"] <= ATOL


@pytest.mark.exercise("bucketed_ddp")
@pytest.mark.points(2)
def test_every_bucket_launched_in_order_during_backward(hidden_run):
    """Each bucket is launched once, in bucket order, before backward returns, with no waiting inside it."""
    for rank, res in _case(hidden_run, "world").items():
        expected = res["bucket_numels"]
        assert len(expected) < res["num_params"]
        for step, launched in enumerate(res["launched_numels_per_step"]):
            assert launched == expected, (
                f"rank {rank} step {step}: all-reduced sizes {launched}, expected one per bucket "
                f"in bucket order {expected}")
        assert res["launched_during_backward"] == [len(expected)] * STEPS, \
            "every bucket should be launched from the hooks, before backward returns"
        assert res["waited_during_backward"] == [0] * STEPS
        assert res["waits_per_step"] == [len(expected)] * STEPS
        assert res["blocking_all_reduces"] == 0


@pytest.mark.exercise("bucketed_ddp")
@pytest.mark.points(2)
def test_each_bucket_launched_as_soon_as_it_is_complete(hidden_run):
    """Each bucket is launched as soon as its last gradient arrives, on the world and on a subgroup."""
    for case in ("world", "subgroup"):
        for rank, res in _case(hidden_run, case).items():
            if not res.get("member", True):
                continue
            for step, arrivals in enumerate(res["arrivals"]):
                assert arrivals[-1][1] >= 1, f"{case}, rank {rank} step {step}: no overlap at all"
                for k, (param, launched) in enumerate(arrivals):
                    expected = complete_leading_buckets(res["buckets"], [p for p, _ in arrivals[:k]])
                    assert launched == expected, (
                        f"{case}, rank {rank} step {step}: gradient of parameter {param} arrived "
                        f"with {expected} bucket(s) complete but {launched} launched")


@pytest.mark.exercise("bucketed_ddp")
@pytest.mark.points(2)
def test_bucket_order_kept_when_the_first_gradient_completes_the_last_bucket(hidden_run):
    """Buckets launch in bucket order even when backward completes the last bucket first."""
    for rank, res in _case(hidden_run, "gated").items():
        assert res["buckets"] == [[4, 3, 2], [1], [0]], f"rank {rank}: buckets {res['buckets']}"
        for step, launched in enumerate(res["launched_numels_per_step"]):
            assert launched == res["bucket_numels"], (
                f"rank {rank} step {step}: all-reduced sizes {launched}, expected the buckets in "
                f"bucket order {res['bucket_numels']}")
        for step, arrivals in enumerate(res["arrivals"]):
            for k, (param, launched) in enumerate(arrivals):
                expected = complete_leading_buckets(res["buckets"], [p for p, _ in arrivals[:k]])
                assert launched == expected, (
                    f"rank {rank} step {step}: gradient of parameter {param} arrived with "
                    f"{expected} bucket(s) complete in bucket order but {launched} launched")
        for step, (diff, scale) in enumerate(zip(res["grad_diffs"], res["grad_scales"])):
            assert diff <= ATOL + RTOL * scale, f"rank {rank} step {step}: grads differ by {diff:g}"


@pytest.mark.exercise("bucketed_ddp")
@pytest.mark.points(2)
def test_backward_returns_while_another_rank_has_launched_nothing(hidden_run):
    """Backward never waits for the other ranks: no wait, spin on is_completed or blocking call inside it."""
    res = _case(hidden_run, "world")[2]
    assert res["rank0_backward_returned_while_held"] is True, (
        f"rank 2 held its first gradient for {HOLD_TIMEOUT_S:g} s and rank 0's backward did not "
        "return meanwhile: something inside backward waits for an all-reduce")


@pytest.mark.exercise("bucketed_ddp")
@pytest.mark.points(2)
def test_subgroup_without_rank0(hidden_run):
    """Works on a process group that leaves out global rank 0: start weights and averaging per group."""
    results = _case(hidden_run, "subgroup")
    assert results[0]["member"] is False
    for rank in (1, 2):
        res = results[rank]
        assert res["max_init_diff_vs_rank0"] == 0.0, \
            "broadcast must come from the group's first rank (global rank 1 here)"
        assert res["max_param_diff_vs_reference"] <= ATOL
        assert res["collectives"] > 0
    assert results[1]["params_head"] == results[2]["params_head"]


@pytest.mark.exercise("bucketed_ddp")
def test_no_sync_accumulation_equals_big_batch(hidden_run):
    """Accumulating under no_sync equals one big batch, and no_sync backward passes communicate nothing."""
    for rank, res in _case(hidden_run, "no_sync").items():
        assert res["grad_diff"] <= ATOL + RTOL * res["grad_scale"], f"rank {rank}: {res['grad_diff']:g}"
        assert res["collectives"] == res["num_buckets"], "no_sync backward passes must not all-reduce"


@pytest.mark.exercise("bucketed_ddp")
def test_extreme_bucket_caps(hidden_run):
    """Trains correctly with a 0 MB and a huge bucket cap, with the number of buckets each cap implies."""
    for rank, res in _case(hidden_run, "caps").items():
        for cap, row in res.items():
            assert row["param_diff"] <= ATOL, f"rank {rank}, cap {cap}: {row['param_diff']:g}"
        assert res["0"]["collectives_per_step"] == res["0"]["num_params"]
        assert res["1000"]["collectives_per_step"] == 1


@pytest.mark.exercise("ddp_classifier")
@pytest.mark.points(2)
def test_classifier_on_three_ranks(hidden_run):
    """fit on 3 ranks: good test accuracy, identical weights, disjoint shards reshuffled every epoch."""
    from labs.lab03_classifier import TRAIN_SIZE

    results = _case(hidden_run, "classifier")
    for rank, res in results.items():
        assert res["test_accuracy"] >= 0.85, f"rank {rank}: accuracy {res['test_accuracy']:.3f}"
        assert len(res["epoch_losses"]) == res["epochs"]
    assert results[0]["params_head"] == results[1]["params_head"] == results[2]["params_head"]
    for epoch in range(2):
        shards = [set(results[r]["indices"][epoch]) for r in range(3)]
        assert sum(len(s) for s in shards) == TRAIN_SIZE
        assert set.union(*shards) == set(range(TRAIN_SIZE)), f"epoch {epoch}: shards overlap"
    for rank in range(3):
        assert results[rank]["indices"][0] != results[rank]["indices"][1]


@pytest.mark.exercise("ddp_classifier")
def test_classifier_batches_and_logged_losses_on_three_ranks(hidden_run):
    """fit on 3 ranks passes the public tests' checks of its batches and logged losses."""
    for rank, res in _case(hidden_run, "classifier").items():
        for problem in classifier_checks(res):
            raise AssertionError(f"rank {rank}: {problem}")


# --- the 3-rank worker ---------------------------------------------------------------------------

def _mixed_model(seed):
    from torch import nn

    torch.manual_seed(seed)
    # a parameter larger than the cap (12000 bytes), small ones, a LayerNorm in between
    return nn.Sequential(nn.Linear(10, 300), nn.LayerNorm(300), nn.ReLU(), nn.Linear(300, 3),
                         nn.Tanh(), nn.Linear(3, 7))


def case_world(ctx):
    from labs.lab03_ddp import plan_buckets

    hold = HoldBack(HOLD_STEP, holder=2, waited_for=0, timeout_s=HOLD_TIMEOUT_S, tag="hidden")
    model = _mixed_model(10 + ctx.rank)
    params = list(model.parameters())  # the sizes the plan gives, whatever buckets the wrapper made
    bucket_numels = [sum(params[i].numel() for i in b) for b in plan_buckets(params, CAP_BYTES)]
    out = wrap_and_train(model, _mixed_model(10), ctx.rank, ctx.world_size, CAP_BYTES / 2**20, STEPS,
                         [10, 7], local_batch_size=4, hold=hold)
    out["bucket_numels"] = bucket_numels
    out["rank0_backward_returned_while_held"] = hold.released
    return out


class Gated(torch.nn.Module):
    """A gate registered first and applied last: its gradient arrives first and completes the
    last bucket (parameter 0 alone) before any other."""

    def __init__(self, seed):
        from torch import nn

        super().__init__()
        torch.manual_seed(seed)
        self.gate = nn.Parameter(torch.rand(7) + 0.5)  # 28 bytes
        self.first = nn.Linear(10, 30)                 # 1200 + 120 bytes
        self.last = nn.Linear(30, 7)                   # 840 + 28 bytes

    def forward(self, x):
        return self.last(torch.tanh(self.first(x))) * self.gate


def case_gated(ctx):
    return wrap_and_train(Gated(50 + ctx.rank), Gated(50), ctx.rank, ctx.world_size, GATED_CAP_BYTES / 2**20,
                          2, [10, 7], local_batch_size=4)


def case_subgroup(ctx):
    import torch.distributed as dist

    group = dist.new_group([1, 2])  # every rank must call new_group, members or not
    if ctx.rank not in (1, 2):
        return {"member": False}
    out = wrap_and_train(_mixed_model(20 + ctx.rank), _mixed_model(21),  # global rank 1's init
                         dist.get_rank(group), dist.get_world_size(group), CAP_BYTES / 2**20, 3, [10, 7],
                         local_batch_size=4, group=group)
    return {"member": True, **out}


def case_no_sync(ctx):
    from torch import nn

    from labs.lab03_ddp import BucketedDDP, flat_grads, global_batch, local_shard

    model, reference = _mixed_model(30), _mixed_model(30)
    ddp = BucketedDDP(model, bucket_cap_mb=CAP_BYTES / 2**20)
    micro, micro_size = 3, 4
    x, y = global_batch(0, micro * micro_size * ctx.world_size, 10, 7)
    x_local, y_local = local_shard(x, ctx.rank, ctx.world_size), local_shard(y, ctx.rank, ctx.world_size)
    for i, (xm, ym) in enumerate(zip(x_local.chunk(micro), y_local.chunk(micro))):
        if i < micro - 1:
            with ddp.no_sync():
                (nn.functional.mse_loss(ddp(xm), ym) / micro).backward()
        else:
            (nn.functional.mse_loss(ddp(xm), ym) / micro).backward()
    ddp.finish_gradient_synchronization()
    nn.functional.mse_loss(reference(x), y).backward()
    return {"grad_diff": (flat_grads(model) - flat_grads(reference)).abs().max().item(),
            "grad_scale": flat_grads(reference).abs().max().item(),
            "collectives": ddp.comm.collectives, "num_buckets": len(ddp.buckets)}


def case_caps(ctx):
    from labs.lab03_ddp import BucketedDDP

    out = {}
    for cap_mb in (0, 1000):
        model, reference = _mixed_model(40 + ctx.rank), _mixed_model(40)
        ddp = BucketedDDP(model, bucket_cap_mb=cap_mb)
        row = train_against_reference(ddp, model, reference, ctx.rank, ctx.world_size, 2, [10, 7],
                                      local_batch_size=4)
        out[str(cap_mb)] = {"param_diff": row["max_param_diff_vs_reference"],
                            "collectives_per_step": ddp.comm.collectives / 2,
                            "num_params": len(list(model.parameters()))}
    return out


def case_classifier(ctx):
    return fit_and_observe(ctx, epochs=4, local_batch_size=16, seed=1)


if __name__ == "__main__":
    from helpers.dist import distributed

    with distributed() as ctx:
        for name, case in (("world", case_world), ("gated", case_gated), ("subgroup", case_subgroup),
                           ("no_sync", case_no_sync), ("caps", case_caps),
                           ("classifier", case_classifier)):
            try:
                ctx.report(**{name: case(ctx)})
            except Exception:  # reported per case, so one broken part fails only its tests
                ctx.report(**{name: {"error": traceback.format_exc()}})
            ctx.barrier()
        ctx.report(done=True)
