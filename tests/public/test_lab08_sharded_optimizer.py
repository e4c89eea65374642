"""Public tests of lab 08's exercise, `ShardedOptimizer` (labs/lab08_sharded_optimizer.py).

Run:  .venv/bin/python -m pytest tests/public/test_lab08_sharded_optimizer.py -q
      (or ./run.sh check 08)

One launch on 2 ranks (gloo on the CPU) runs every case; this file is also its worker. In each
case every rank trains the same model on its half of each global batch, averages the gradients
with an all-reduce (what DDP would do) and steps your ShardedOptimizer; each rank also trains the
same model with the plain torch optimizer on the whole batch, in its own process: the reference.
Checked after every step: the parameters against the reference (atol 1e-5, rtol 1e-4: the two
halves' gradients are added up in another order than the whole batch's), and bitwise equality of
the parameters across ranks. Checked after training: the bytes each rank's optimizer holds, that
is every tensor reachable from the optimizer object (helpers.accounting.tensors_held_by) other than
the parameters and their gradients, against the unsharded optimizer's state.
"""
from __future__ import annotations

import copy
import sys
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers.exercise import Unsolved
from labs.lab08_sharded_optimizer import ShardedOptimizer
from tests.conftest import launch_ranks

pytestmark = pytest.mark.exercise("ShardedOptimizer")
NPROC = 2
ATOL, RTOL = 1e-5, 1e-4
STEPS = 4
WIDTH, DEPTH = 16, 8  # 16 parameters of 256 or 16 elements: no parameter is a large share
STATE_SLACK_PER_PARAM = 64  # bytes per parameter beyond the moments (Adam's step counter...)
NEEDS = [ShardedOptimizer.__init__, ShardedOptimizer.add_param_group, ShardedOptimizer.step]


# ---------------------------------------------------------------------------------- the worker side
def make_mlp(width: int = WIDTH, depth: int = DEPTH, seed: int = 0) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.Tanh()]
        return nn.Sequential(*layers)


def make_batches(steps: int, rows: int, width: int, out_width: int | None = None, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, width, generator=g), torch.randn(rows, out_width or width, generator=g))
            for _ in range(steps)]


def all_reduce_mean(model: nn.Module) -> None:
    import torch.distributed as dist

    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())


def spread_across_ranks(model: nn.Module) -> float:
    """Largest difference between this rank's parameters and rank 0's (0.0: bitwise equal)."""
    import torch.distributed as dist

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    first = flat.clone()
    dist.broadcast(first, src=0)
    diff = (flat - first).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def optimizer_bytes(optimizer, model: nn.Module) -> int:
    """Bytes of every tensor the optimizer keeps (storages once), parameters and gradients aside."""
    from helpers.accounting import held_bytes, tensors_held_by

    params = list(model.parameters())
    model_tensors = params + [p.grad for p in params if p.grad is not None]
    held = held_bytes({"model": model_tensors,
                       "optimizer": tensors_held_by(optimizer, exclude=model_tensors)})
    return held["optimizer"]


def mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def train_pair(model: nn.Module, params_of: Callable[[nn.Module], list], optimizer_cls, kwargs: dict,
               batches: list, *, reduce: str = "all_reduce", on_step: Callable | None = None,
               loss_fn: Callable = mse) -> dict:
    """Train `model` with ShardedOptimizer on this rank's rows and, for reference, with the plain
    optimizer on whole batches. `params_of(model)` gives what the optimizers take (parameters or
    groups); `on_step(step, sharded, reference, model_s, model_r)` may change both alike (an LR
    schedule, a new group). reduce: "all_reduce" or "stretch" (reduce_gradients)."""
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model_s, model_r = copy.deepcopy(model), copy.deepcopy(model)
    sharded = ShardedOptimizer(params_of(model_s), optimizer_cls, **kwargs)
    reference = optimizer_cls(params_of(model_r), **kwargs)
    diffs, owned_grads = [], []
    for step, (x, y) in enumerate(batches):
        if on_step is not None:
            on_step(step, sharded, reference, model_s, model_r)
        reference.zero_grad()
        loss_fn(model_r, x, y).backward()
        reference.step()
        rows = x.shape[0] // world_size
        sharded.zero_grad()
        loss_fn(model_s, x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]).backward()
        if reduce == "stretch":
            expected = [None if p.grad is None else p.grad.clone() for p in model_s.parameters()]
            for g in expected:
                if g is not None:
                    dist.all_reduce(g)
                    g.div_(world_size)
            sharded.reduce_gradients()
            kept = [i for i, p in enumerate(model_s.parameters()) if p.grad is not None]
            err = max([(p.grad - g).abs().max().item() for p, g in zip(model_s.parameters(), expected)
                       if p.grad is not None and g is not None] or [0.0])
            owned_grads.append({"kept": kept, "max_grad_diff": err})
        else:
            all_reduce_mean(model_s)
        sharded.step()
        diffs.append(max((a - b).abs().max().item() - RTOL * b.abs().max().item()
                         for a, b in zip(model_s.parameters(), model_r.parameters())))
    return {"excess_diff_per_step": diffs, "spread": spread_across_ranks(model_s),
            "optimizer_bytes": optimizer_bytes(sharded, model_s),
            "unsharded_bytes": optimizer_bytes(reference, model_r),
            "numels": [p.numel() for p in model_s.parameters()],
            "grads_after_zero_grad": _grads_after_zero_grad(sharded, model_s, loss_fn, x, y),
            "stretch": owned_grads}


def _grads_after_zero_grad(sharded, model: nn.Module, loss_fn: Callable, x, y) -> dict:
    """zero_grad(set_to_none=False), then zero_grad(), each after a backward pass."""
    loss_fn(model, x, y).backward()
    had = [p for group in sharded.param_groups for p in group["params"] if p.grad is not None]
    sharded.zero_grad(set_to_none=False)
    zeros = all(p.grad is not None and not p.grad.any() for p in had)
    sharded.zero_grad()
    none = all(p.grad is None for group in sharded.param_groups for p in group["params"])
    return {"set_to_none_false_gives_zeros": zeros, "default_gives_none": none}


def groups_of(model: nn.Module) -> list[dict]:
    """Two groups: the first half of the layers at the defaults, the second with its own lr."""
    params = list(model.parameters())
    half = len(params) // 2
    return [{"params": params[:half]}, {"params": params[half:], "lr": 0.003}]


CASES = {
    "adam": lambda: train_pair(make_mlp(), lambda m: list(m.parameters()), torch.optim.Adam,
                               {"lr": 0.01}, make_batches(STEPS, 8, WIDTH)),
    "sgd momentum": lambda: train_pair(make_mlp(seed=2), lambda m: list(m.parameters()),
                                       torch.optim.SGD, {"lr": 0.05, "momentum": 0.9},
                                       make_batches(STEPS, 8, WIDTH, seed=3)),
    "adam two groups": lambda: train_pair(make_mlp(seed=4), groups_of, torch.optim.Adam,
                                          {"lr": 0.01}, make_batches(STEPS, 8, WIDTH, seed=5)),
    "add_param_group": lambda: train_pair(
        make_mlp(seed=6), lambda m: list(m[:8].parameters()), torch.optim.Adam, {"lr": 0.01},
        make_batches(STEPS, 8, WIDTH, seed=7), on_step=_add_second_half_at_step_2),
}


def _add_second_half_at_step_2(step, sharded, reference, model_s, model_r):
    """Until step 2 only the first 4 layers train; then the others join, with their own lr."""
    if step == 2:
        sharded.add_param_group({"params": list(model_s[8:].parameters()), "lr": 0.02})
        reference.add_param_group({"params": list(model_r[8:].parameters()), "lr": 0.02})


def run_cases(cases: dict, stretch_cases: dict) -> None:
    """The worker: every case on every rank, reported case by case."""
    from helpers.dist import distributed
    from helpers.exercise import unsolved_message

    with distributed() as ctx:
        torch.set_num_threads(1)
        results = {}
        for name, case in cases.items():
            results[name] = case()
            ctx.report(cases=results)
        for name, case in stretch_cases.items():
            try:
                results[name] = case()
            except NotImplementedError as exc:  # the stretch may still be its stub
                if not unsolved_message(exc):
                    raise
                results[name] = {"unsolved": unsolved_message(exc)}
            ctx.report(cases=results)


STRETCH_CASES = {
    "stretch adam": lambda: train_pair(make_mlp(seed=8), lambda m: list(m.parameters()),
                                       torch.optim.Adam, {"lr": 0.01},
                                       make_batches(STEPS, 8, WIDTH, seed=9), reduce="stretch"),
}


# ---------------------------------------------------------------------------------- the test side
@pytest.fixture(scope="module")
def ranks():
    return launch_ranks(__file__, "cases", nproc=NPROC, timeout=180, needs=NEEDS,
                        env={"DIST_TIMEOUT": "30"})


def case_reports(ranks, name: str, nproc: int = NPROC) -> list[dict]:
    """Every rank's result for one case; Unsolved (not implemented yet) for a stub's."""
    reports = []
    for rank in range(nproc):
        cases = ranks[rank].get("cases", {})
        assert name in cases, f"rank {rank} reported no result for case {name!r}"
        if "unsolved" in cases[name]:
            raise Unsolved(cases[name]["unsolved"])
        reports.append(cases[name])
    return reports


BROADCAST_HINT = "check that every parameter is updated by exactly one rank and broadcast from it"


def check_numbers(reports: list[dict], name: str, hint: str = BROADCAST_HINT) -> None:
    for rank, r in enumerate(reports):
        for step, excess in enumerate(r["excess_diff_per_step"]):
            assert excess <= ATOL, (
                f"{name}, rank {rank}: after step {step} the parameters differ from the unsharded "
                f"optimizer's by {excess + ATOL:.3g} (more than atol {ATOL} + rtol {RTOL}); {hint}")
        assert r["spread"] == 0.0, (
            f"{name}, rank {rank}: parameters differ across ranks by {r['spread']:.3g} after "
            "training; every rank must end each step with its owners' values (broadcast them)")


def check_state_is_sharded(reports: list[dict], name: str, moments: int) -> None:
    """Each rank holds the state of about 1/N of the elements; together, each element's once."""
    numels = reports[0]["numels"]
    total, largest, n = sum(numels), max(numels), len(reports)
    slack = STATE_SLACK_PER_PARAM * len(numels)
    per_rank_limit = moments * 4 * (total / n + largest) + slack
    held = [r["optimizer_bytes"] for r in reports]
    unsharded = reports[0]["unsharded_bytes"]
    for rank, b in enumerate(held):
        assert b <= per_rank_limit, (
            f"{name}: rank {rank}'s optimizer holds {b} bytes of tensors, the unsharded optimizer "
            f"{unsharded}; a rank may hold the state of about 1/{n} of the {total} elements "
            f"(at most {per_rank_limit:.0f} bytes here): give each parameter one owner and keep "
            "only the owners' state")
    assert moments * 4 * total <= sum(held) <= moments * 4 * total + n * slack, (
        f"{name}: the ranks' optimizers hold {sum(held)} bytes together; the state of every "
        f"element exactly once is {moments * 4 * total} bytes (+ small counters): each "
        "parameter's state must live on exactly one rank")


@pytest.mark.parametrize("name", list(CASES))
def test_parameters_match_one_process(ranks, name):
    check_numbers(case_reports(ranks, name), name)


@pytest.mark.parametrize("name,moments", [("adam", 2), ("sgd momentum", 1), ("adam two groups", 2)])
def test_each_rank_holds_about_one_nth_of_the_state(ranks, name, moments):
    check_state_is_sharded(case_reports(ranks, name), name, moments)


def test_zero_grad_as_in_torch(ranks):
    for rank, r in enumerate(case_reports(ranks, "adam")):
        z = r["grads_after_zero_grad"]
        assert z["set_to_none_false_gives_zeros"], (
            f"rank {rank}: zero_grad(set_to_none=False) must leave every gradient a zero tensor")
        assert z["default_gives_none"], f"rank {rank}: zero_grad() must set every .grad to None"


def test_one_rank_is_the_plain_optimizer():
    """World size 1, in this process: ShardedOptimizer must equal the wrapped optimizer exactly."""
    from helpers.dist import distributed
    from helpers.exercise import stub_message

    for method in NEEDS:
        if stub_message(method):
            raise Unsolved(stub_message(method))
    with distributed():
        model_s, model_r = make_mlp(seed=10), make_mlp(seed=10)
        sharded = ShardedOptimizer(model_s.parameters(), torch.optim.AdamW, lr=0.01, weight_decay=0.1)
        reference = torch.optim.AdamW(model_r.parameters(), lr=0.01, weight_decay=0.1)
        assert isinstance(sharded, torch.optim.Optimizer), "subclass torch.optim.Optimizer"
        for x, y in make_batches(3, 4, WIDTH, seed=11):
            for model, opt in ((model_s, sharded), (model_r, reference)):
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
        for a, b in zip(model_s.parameters(), model_r.parameters()):
            assert torch.equal(a, b), "on one rank, ShardedOptimizer must update exactly as AdamW does"
        group = sharded.param_groups[0]
        assert group["lr"] == 0.01 and len(group["params"]) == 2 * DEPTH, (
            "param_groups must list every parameter with its hyper-parameters, as in torch")


@pytest.mark.exercise("ShardedOptimizer.reduce_gradients")
def test_stretch_reduce_gradients_keeps_only_own_gradients(ranks):
    reports = case_reports(ranks, "stretch adam")
    check_numbers(reports, "reduce_gradients + step")
    num_params = len(reports[0]["numels"])
    for step in range(STEPS):
        kept = [set(r["stretch"][step]["kept"]) for r in reports]
        every_param_once = (sum(map(len, kept)) == num_params
                            and set().union(*kept) == set(range(num_params)))
        assert every_param_once, (
            f"step {step}: after reduce_gradients() each parameter must keep its gradient on exactly "
            f"one rank (its owner) and have .grad None on the others; kept per rank: {kept}")
        for rank, r in enumerate(reports):
            err = r["stretch"][step]["max_grad_diff"]
            assert err <= 1e-6, (f"rank {rank}, step {step}: a kept gradient differs from the "
                                 f"average over ranks by {err:.3g}")


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    run_cases(CASES, STRETCH_CASES)
