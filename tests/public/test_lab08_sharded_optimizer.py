"""Public tests of lab 08's exercise, `ShardedOptimizer` (labs/lab08_sharded_optimizer.py).

Run:  .venv/bin/python -m pytest tests/public/test_lab08_sharded_optimizer.py -q
      (or ./run.sh check 08)

One launch on 2 ranks (gloo on the CPU) runs every case; this file is also its worker. In each
case every rank trains the same model on its half of each global batch, averages the gradients
with an all-reduce (what DDP would do) and steps your ShardedOptimizer; each rank also trains the
same model with the plain torch optimizer on the whole batch, in its own process: the reference.
The cases: Adam, SGD with momentum, two parameter groups, a group added after two steps, an LR
scheduler, a model of three tensors of uneven sizes with tied weights (the count does not divide
by the ranks), a single tensor (a rank owns nothing), six tensors of very different sizes (where
the owner rule, contiguous chunks of the list and round-robin give different shares); the stretch
on the MLP and on the three tensors.

Checked after every step: the parameters against the reference (atol 1e-5, rtol 1e-4: the two
halves' gradients are added up in another order than the whole batch's), and bitwise equality of
the parameters across ranks. Checked after training: the bytes each rank's optimizer holds, that
is every tensor reachable from the optimizer object (helpers.accounting.tensors_held_by) other than
the parameters and their gradients, against the unsharded optimizer's state and the owner rule;
`param_groups`; what `zero_grad()` leaves; the collectives of one `step()` (broadcasts of the
parameters only) and of one `reduce_gradients()` (one reduce-scatter, not an all-reduce).

When a check fails, its message names the likely misunderstanding: the worker also trains the
plain optimizer the way a common misreading would (the LR schedule ignored, the groups'
hyper-parameters dropped...) and reports which one your run matches, which parameters never
changed, and what a case raised.
"""
from __future__ import annotations

import copy
import sys
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers.notice import Unsolved, stub_message
from labs.lab08_sharded_optimizer import ShardedOptimizer
from tests.harness import RankFailure, launch_ranks

pytestmark = pytest.mark.exercise("ShardedOptimizer")
NPROC = 2
ATOL, RTOL = 1e-5, 1e-4
STEPS = 4
WIDTH, DEPTH = 16, 8  # 16 parameters of 256 or 16 elements: no parameter is a large share
STATE_SLACK_PER_PARAM = 64  # bytes per parameter beyond the moments (Adam's step counter...)
NEEDS = [ShardedOptimizer.__init__, ShardedOptimizer.add_param_group, ShardedOptimizer.step]
STRETCH = ShardedOptimizer.reduce_gradients


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


class TiedThree(nn.Module):
    """Three tensors of 240, 64 and 30 elements: an embedding (30 x 8) whose weight is also the
    output layer's (one Parameter used twice: its gradient is the sum of both uses), a hidden
    weight (8 x 8) and the output bias (30). Three tensors do not split evenly over 2 ranks."""

    def __init__(self, vocab: int = 30, dim: int = 8, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab, dim)
            self.hidden = nn.Linear(dim, dim, bias=False)
            self.out = nn.Linear(dim, vocab)
        self.out.weight = self.embed.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # idx (B, T) -> logits (B, T, vocab)
        return self.out(torch.tanh(self.hidden(self.embed(idx))))


class UnevenSizes(nn.Module):
    """Six weight vectors of 500, 400, 300, 200, 100 and 50 elements, in that order; y (B, 1) =
    sum_i x_i . tanh(w_i), x_i the i-th slice of x (B, 1550). On 2 ranks the owner rule gives the
    ranks 800 and 750 elements, contiguous chunks of the list 1200 and 350, round-robin 900 and
    650: the lists of equal-sized layers elsewhere cannot tell those rules apart."""
    SIZES = (500, 400, 300, 200, 100, 50)

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weights = nn.ParameterList([nn.Parameter(0.1 * torch.randn(n, generator=g))
                                         for n in self.SIZES])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slices = x.split(list(self.SIZES), dim=-1)
        return sum((s * torch.tanh(w)).sum(-1, keepdim=True) for s, w in zip(slices, self.weights))


def seeded_linear(in_features: int, out_features: int, seed: int, bias: bool = False) -> nn.Linear:
    """One weight tensor, no bias: a single parameter (with 2 ranks, one of them owns nothing);
    with `bias`, two."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(in_features, out_features, bias=bias)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def token_batches(steps: int, rows: int = 8, length: int = 5, vocab: int = 30, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(vocab, (rows, length), generator=g),
             torch.randint(vocab, (rows, length), generator=g)) for _ in range(steps)]


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


def excess(params: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """How far `params` are from `reference` beyond rtol (<= ATOL: they match)."""
    return max((a - b).abs().max().item() - RTOL * b.abs().max().item()
               for a, b in zip(params, reference))


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def train_reference(model: nn.Module, params_of: Callable, optimizer_cls, kwargs: dict, batches: list,
                    loss_fn: Callable, on_step: Callable | None = None) -> list[list[torch.Tensor]]:
    """The plain optimizer on whole batches, in this process: the parameters after each step.
    `on_step(step, optimizer, model)` may change it before a step. Used for the misreadings."""
    model = copy.deepcopy(model)
    optimizer = optimizer_cls(params_of(model), **kwargs)
    after = []
    for step, (x, y) in enumerate(batches):
        if on_step is not None:
            on_step(step, optimizer, model)
        optimizer.zero_grad()
        loss_fn(model, x, y).backward()
        optimizer.step()
        after.append(snapshot(model))
    return after


def describe(exc: BaseException) -> str:
    """"Type: message (at file:line, in function)": the innermost frame in labs/, else the
    innermost frame."""
    import os
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    in_labs = [f for f in frames if os.sep + "labs" + os.sep in f.filename]
    where = ""
    if frames:
        frame = (in_labs or frames)[-1]
        where = f" (at {os.path.relpath(frame.filename)}:{frame.lineno}, in {frame.name})"
    return f"{type(exc).__name__}: {exc}{where}"


class CaseError(Exception):
    """Raised alike on every rank, so that the ranks stay in step and the next case can run."""


def build_on_every_rank(params, optimizer_cls, kwargs: dict) -> ShardedOptimizer:
    """ShardedOptimizer(params, ...); if it raises on any rank, every rank raises CaseError (a
    rank that owns nothing is the usual one to fail: the others would wait for it forever)."""
    import torch.distributed as dist

    from helpers.notice import unsolved_message

    try:
        sharded, error = ShardedOptimizer(params, optimizer_cls, **kwargs), None
    except Exception as exc:
        if unsolved_message(exc):
            raise
        sharded, error = None, describe(exc)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, error = failed[0]
        raise CaseError(f"ShardedOptimizer(...) raised on rank {rank}: {error}")
    return sharded


def comm_summary(log) -> dict:
    """Calls and bytes (nccl-tests' size, and sent with ring algorithms) per kind of collective."""
    out: dict = {"calls": {}, "bytes": {}, "sent": {}}
    for c in log:
        for key, value in (("calls", 1), ("bytes", c.nbytes), ("sent", c.sent_bytes)):
            out[key][c.kind] = out[key].get(c.kind, 0) + value
    return out


def train_pair(model: nn.Module, params_of: Callable[[nn.Module], list], optimizer_cls, kwargs: dict,
               batches: list, *, reduce: str = "all_reduce", on_step: Callable | None = None,
               loss_fn: Callable = mse, misreadings: dict[str, dict] | None = None) -> dict:
    """Train `model` with ShardedOptimizer on this rank's rows and, for reference, with the plain
    optimizer on whole batches. `params_of(model)` gives what the optimizers take (parameters or
    groups); `on_step(step, sharded, reference, model_s, model_r)` may change both alike (an LR
    schedule, a new group). reduce: "all_reduce" or "stretch" (reduce_gradients).
    `misreadings` {name in MISREADINGS: train_reference's keyword arguments}: the plain optimizer
    trained the way that misreading would; the report lists those the sharded run matches."""
    import torch.distributed as dist

    from helpers.comm_count import count_collectives

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model_s, model_r = copy.deepcopy(model), copy.deepcopy(model)
    sharded = build_on_every_rank(params_of(model_s), optimizer_cls, kwargs)
    reference = optimizer_cls(params_of(model_r), **kwargs)
    first_s, first_r = snapshot(model_s), snapshot(model_r)
    diffs, after, grads_left, stretch = [], [], [], []
    step_comm = {}
    for step, (x, y) in enumerate(batches):
        if on_step is not None:
            on_step(step, sharded, reference, model_s, model_r)
        reference.zero_grad()
        cleared = [p.grad is None for p in model_r.parameters()]  # (not all: a group added later)
        loss_fn(model_r, x, y).backward()
        reference.step()
        rows = x.shape[0] // world_size
        sharded.zero_grad()
        grads_left.append(sum(p.grad is not None and none
                              for p, none in zip(model_s.parameters(), cleared)))
        loss_fn(model_s, x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]).backward()
        if reduce == "stretch":
            stretch.append(_reduce_gradients_checked(sharded, model_s))
        else:
            all_reduce_mean(model_s)
        with count_collectives() as log:
            sharded.step()
        step_comm = comm_summary(log)
        diffs.append(excess(list(model_s.parameters()), list(model_r.parameters())))
        after.append(snapshot(model_s))
    matches = [name for name, how in (misreadings or {}).items()
               if max(diffs) > ATOL and all(
                   excess(a, b) <= ATOL for a, b in zip(after, train_reference(
                       model, optimizer_cls=optimizer_cls, kwargs=kwargs, batches=batches,
                       loss_fn=loss_fn, **{"params_of": params_of, **how})))]
    stale = [i for i, (p, p0, r, r0) in enumerate(zip(model_s.parameters(), first_s,
                                                      model_r.parameters(), first_r))
             if torch.equal(p, p0) and not torch.equal(r, r0)]
    return {"excess_diff_per_step": diffs, "spread": spread_across_ranks(model_s),
            "matches": matches, "stale": stale, "grads_left": grads_left, "step_comm": step_comm,
            "optimizer_bytes": optimizer_bytes(sharded, model_s),
            "unsharded_bytes": optimizer_bytes(reference, model_r),
            "numels": [p.numel() for p in model_s.parameters()],
            "param_groups": _groups(sharded), "reference_groups": _groups(reference),
            "grads_after_zero_grad": _grads_after_zero_grad(sharded, model_s, loss_fn, x, y),
            "stretch": stretch}


def _reduce_gradients_checked(sharded, model: nn.Module) -> dict:
    """reduce_gradients(), against the average over ranks computed here by all-reduce."""
    import torch.distributed as dist

    from helpers.comm_count import count_collectives

    n = dist.get_world_size()
    expected = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    for g in expected:
        if g is not None:
            dist.all_reduce(g)
            g.div_(n)
    with count_collectives() as log:
        sharded.reduce_gradients()
    pairs = [(p.grad, g) for p, g in zip(model.parameters(), expected)
             if p.grad is not None and g is not None]
    return {"kept": [i for i, p in enumerate(model.parameters()) if p.grad is not None],
            "max_grad_diff": max([(a - g).abs().max().item() for a, g in pairs] or [0.0]),
            "max_diff_from_sum": max([(a - n * g).abs().max().item() for a, g in pairs] or [0.0]),
            "comm": comm_summary(log)}


def _groups(optimizer) -> list[dict]:
    """Each group's parameter count and lr."""
    return [{"params": len(g["params"]), "lr": g.get("lr")} for g in optimizer.param_groups]


def _grads_after_zero_grad(sharded, model: nn.Module, loss_fn: Callable, x, y) -> dict:
    """zero_grad(set_to_none=False), then zero_grad(), each after a backward pass: how many
    gradients each leaves as they should not be."""
    params = [p for group in sharded.param_groups for p in group["params"]]
    loss_fn(model, x, y).backward()
    had = [p for p in params if p.grad is not None]
    try:
        sharded.zero_grad(set_to_none=False)
    except Exception as exc:
        return {"error": f"zero_grad(set_to_none=False) raised {type(exc).__name__}: {exc}"}
    not_zeros = sum(p.grad is None or bool(p.grad.any()) for p in had)
    sharded.zero_grad()
    not_none = sum(p.grad is not None for p in params)
    not_none_in_model = sum(p.grad is not None for p in model.parameters())
    return {"had": len(had), "not_zeros": not_zeros, "not_none": not_none,
            "not_none_in_model": not_none_in_model}


def groups_of(model: nn.Module) -> list[dict]:
    """Two groups: the first half of the layers at the defaults, the second with its own lr."""
    params = list(model.parameters())
    half = len(params) // 2
    return [{"params": params[:half]}, {"params": params[half:], "lr": 0.003}]


def _add_second_half_at_step_2(step, sharded, reference, model_s, model_r):
    """Until step 2 only the first 4 layers train; then the others join, with their own lr."""
    if step == 2:
        sharded.add_param_group({"params": list(model_s[8:].parameters()), "lr": 0.02})
        reference.add_param_group({"params": list(model_r[8:].parameters()), "lr": 0.02})


def _add_second_half_at_default_lr(step, optimizer, model):
    if step == 2:
        optimizer.add_param_group({"params": list(model[8:].parameters())})


class StepLR:
    """StepLR(step_size=1, gamma=0.5) on both optimizers, stepped before every step but the first:
    what changes is "lr" in the wrapper's param_groups."""

    def __call__(self, step, sharded, reference, model_s, model_r):
        if step == 0:
            self.schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
                               for o in (sharded, reference)]
        else:
            for scheduler in self.schedulers:
                scheduler.step()


# What a misreading of the contract gives, as the explanation a failing test shows (a worker
# reports the names its run matches).
MISREADINGS = {
    "lr never changed": (
        "they match the plain optimizer with the LR schedule ignored: a scheduler sets 'lr' in "
        "this optimizer's param_groups, and step() must hand such changes on to the wrapped "
        "optimizer's groups"),
    "groups at the defaults": (
        "they match the plain optimizer with every parameter at the default hyper-parameters: "
        "give the wrapped optimizer one group per group, with that group's hyper-parameters"),
    "added group at the defaults": (
        "they match the plain optimizer with the added group at the default lr: add_param_group "
        "must hand the group's own hyper-parameters to the wrapped optimizer with this rank's "
        "parameters of it"),
}

CASES = {
    "adam": lambda: train_pair(make_mlp(), lambda m: list(m.parameters()), torch.optim.Adam,
                               {"lr": 0.01}, make_batches(STEPS, 8, WIDTH)),
    "sgd momentum": lambda: train_pair(make_mlp(seed=2), lambda m: list(m.parameters()),
                                       torch.optim.SGD, {"lr": 0.05, "momentum": 0.9},
                                       make_batches(STEPS, 8, WIDTH, seed=3)),
    "adam two groups": lambda: train_pair(
        make_mlp(seed=4), groups_of, torch.optim.Adam, {"lr": 0.01},
        make_batches(STEPS, 8, WIDTH, seed=5),
        misreadings={"groups at the defaults": dict(params_of=lambda m: list(m.parameters()))}),
    "add_param_group": lambda: train_pair(
        make_mlp(seed=6), lambda m: list(m[:8].parameters()), torch.optim.Adam, {"lr": 0.01},
        make_batches(STEPS, 8, WIDTH, seed=7), on_step=_add_second_half_at_step_2,
        misreadings={"added group at the defaults": dict(on_step=_add_second_half_at_default_lr)}),
    "lr scheduler": lambda: train_pair(
        make_mlp(seed=12), lambda m: list(m.parameters()), torch.optim.Adam, {"lr": 0.02},
        make_batches(STEPS, 8, WIDTH, seed=13), on_step=StepLR(),
        misreadings={"lr never changed": {}}),
    "three tensors, tied": lambda: train_pair(
        TiedThree(seed=14), lambda m: list(m.parameters()), torch.optim.AdamW,
        {"lr": 0.02, "weight_decay": 0.1}, token_batches(STEPS, seed=15), loss_fn=lm_loss),
    "one tensor": lambda: train_pair(
        seeded_linear(6, 1, seed=16), lambda m: list(m.parameters()), torch.optim.Adam,
        {"lr": 0.05}, make_batches(STEPS, 8, 6, 1, seed=17)),
    "uneven sizes": lambda: train_pair(
        UnevenSizes(seed=18), lambda m: list(m.parameters()), torch.optim.Adam, {"lr": 0.01},
        make_batches(STEPS, 8, sum(UnevenSizes.SIZES), 1, seed=19)),
}
STRETCH_CASES = {
    "stretch adam": lambda: train_pair(make_mlp(seed=8), lambda m: list(m.parameters()),
                                       torch.optim.Adam, {"lr": 0.01},
                                       make_batches(STEPS, 8, WIDTH, seed=9), reduce="stretch"),
    "stretch, three tensors": lambda: train_pair(
        TiedThree(seed=10), lambda m: list(m.parameters()), torch.optim.Adam, {"lr": 0.02},
        token_batches(STEPS, seed=11), loss_fn=lm_loss, reduce="stretch"),
}


def every_rank_failed() -> bool:
    """Called by a rank whose case raised: did every rank's (so that they are still in step)?
    A rank that did not fail is somewhere else; then this fails or disagrees: False."""
    import torch.distributed as dist

    flags = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(flags, "failed")
    except Exception:
        return False
    return all(flag == "failed" for flag in flags)


def run_cases(cases: dict, stretch_cases: dict) -> None:
    """The worker: every case on every rank, reported case by case. A case that raised on every
    rank (CaseError, or an error at the same point everywhere, such as a broadcast from a rank
    that does not exist) is reported and the next one runs. When the ranks are out of step after
    an error (a collective timed out, one rank raised alone), the worker raises, naming the case
    and the error: the launch fails with that message, and every test shows it."""
    import torch.distributed as dist

    from helpers.dist import distributed
    from helpers.notice import unsolved_message

    with distributed() as ctx:
        torch.set_num_threads(1)
        results = {}
        for name, case in [*cases.items(), *stretch_cases.items()]:
            try:
                results[name] = case()
            except CaseError as exc:
                results[name] = {"error": str(exc)}
            except Exception as exc:
                message = unsolved_message(exc)
                if message and name in stretch_cases:  # the stretch may still be its stub
                    results[name] = {"unsolved": message}
                elif message:
                    raise
                else:
                    results[name] = {"error": describe(exc)}
                    if not every_rank_failed():
                        ctx.report(cases=results)
                        raise RuntimeError(
                            f"case {name!r} raised {describe(exc)}; "
                            f"{error_hint(describe(exc), dist.get_world_size())}. The ranks are "
                            "out of step after it: no other case can run") from None
            ctx.report(cases=results)


# ---------------------------------------------------------------------------------- the test side
@pytest.fixture(scope="module")
def ranks():
    return launch_ranks(__file__, "cases", nproc=NPROC, timeout=240, needs=NEEDS,
                        env={"DIST_TIMEOUT": "30"})


def error_hint(error: str, nproc: int) -> str:
    """What a case's exception most likely means."""
    if "invalid root rank" in error:
        return (f"a broadcast named a rank that does not exist on {nproc} ranks: every parameter "
                f"needs an owner in 0..{nproc - 1} whatever the number of parameters (contiguous "
                "chunks of len(params) // N break when N does not divide it); balance the ranks by "
                "element count as the docstring says")
    if "ZeroDivisionError" in error:
        return ("fewer parameters than ranks? len(params) // N is 0 then; balance the ranks by "
                "element count as the docstring says")
    if "imed out" in error or "timeout" in error:
        return ("a collective timed out: every rank must issue the same collectives in the same "
                "order, each broadcast with the same src on every rank (the parameter's owner, "
                "decided alike on every rank)")
    if "empty parameter list" in error:
        return ("a rank that owns no parameter still builds its wrapped optimizer, from groups "
                "(torch refuses an empty list of parameters, not a group without parameters)")
    return "fix that error first"


def rank_report(ranks, rank: int, name: str, nproc: int) -> dict:
    """What `rank` reported; if the launch failed later on (a rank crashed in a later case), what
    it had reported by then, as long as that includes case `name` on every rank."""
    try:
        return ranks[rank]
    except RankFailure:
        partial = getattr(ranks, "partial", {})
        if all(name in partial.get(r, {}).get("cases", {}) for r in range(nproc)):
            return partial[rank]
        raise


def case_reports(ranks, name: str, nproc: int = NPROC) -> list[dict]:
    """Every rank's result for one case; Unsolved (not implemented yet) for a stub's; an
    AssertionError naming the misunderstanding for a case that raised."""
    reports = []
    for rank in range(nproc):
        cases = rank_report(ranks, rank, name, nproc).get("cases", {})
        assert name in cases, f"rank {rank} reported no result for case {name!r}"
        result = cases[name]
        if "unsolved" in result:
            raise Unsolved(result["unsolved"])
        assert "error" not in result, (f"{name}, rank {rank}: the case raised {result['error']}; "
                                       f"{error_hint(result['error'], nproc)}")
        reports.append(result)
    return reports


BROADCAST_HINT = "check that every parameter is updated by exactly one rank and broadcast from it"


def diagnosis(reports: list[dict], hint: str) -> str:
    """The likeliest misunderstanding behind parameters that differ from the reference, from
    what every rank reported."""
    for rank, r in enumerate(reports):
        if r.get("matches"):
            return MISREADINGS[r["matches"][0]]
    for rank, r in enumerate(reports):
        left = [(step, n) for step, n in enumerate(r.get("grads_left", [])) if n]
        if left:
            step, n = left[0]
            return (f"on rank {rank}, zero_grad() left {n} gradient(s) before step {step}, which "
                    "backward then added to (and the all-reduce spread): zero_grad() must clear "
                    "every parameter's gradient, not only those of the rank's own")
    for rank, r in enumerate(reports):
        if r.get("stale"):
            return (f"parameters {r['stale']} (in model order) never changed on rank {rank}, "
                    "though the plain optimizer changed them: their updates were lost. Every "
                    "parameter needs an owner whose wrapped optimizer updates it, and the "
                    "broadcast of a parameter must come from that owner")
    return hint


def check_numbers(reports: list[dict], name: str, hint: str = BROADCAST_HINT) -> None:
    for rank, r in enumerate(reports):
        for step, excess_diff in enumerate(r["excess_diff_per_step"]):
            assert excess_diff <= ATOL, (
                f"{name}, rank {rank}: after step {step} the parameters differ from the unsharded "
                f"optimizer's by {excess_diff + ATOL:.3g} (more than atol {ATOL} + rtol {RTOL}); "
                f"{diagnosis(reports, hint)}")
        assert r["spread"] == 0.0, (
            f"{name}, rank {rank}: parameters differ across ranks by {r['spread']:.3g} after "
            "training; every rank must end each step with its owners' values (broadcast them)")


def owner_loads(numels_per_group: list[list[int]], world_size: int) -> list[int]:
    """Elements per rank under the documented rule: largest first, to the least-loaded rank."""
    load = [0] * world_size
    for numels in numels_per_group:
        for numel in sorted(numels, reverse=True):
            rank = min(range(world_size), key=lambda r: load[r])
            load[rank] += numel
    return load


def misread_loads(numels: list[int], world_size: int) -> dict[str, list[int]]:
    """Elements per rank under the usual wrong rules, by name."""
    n = len(numels)
    floor, ceil = max(1, n // world_size), -(-n // world_size)
    rules = {"round-robin by parameter count": [i % world_size for i in range(n)],
             "contiguous chunks of the list (parameter i to rank i // (n // N), the last rank "
             "taking the rest)": [min(i // floor, world_size - 1) for i in range(n)],
             "contiguous chunks of the list (ceil(n / N) parameters each)": [
                 min(i // ceil, world_size - 1) for i in range(n)]}
    out = {}
    for rule, owners in rules.items():
        load = [0] * world_size
        for numel, owner in zip(numels, owners):
            load[owner] += numel
        out[rule] = load
    return out


def check_state_is_sharded(reports: list[dict], name: str, moments: int, hint: str = "") -> None:
    """Each rank holds the state of about 1/N of the elements; together, each element's once."""
    numels = reports[0]["numels"]
    total, largest, n = sum(numels), max(numels), len(reports)
    slack = STATE_SLACK_PER_PARAM * len(numels)
    per_rank_limit = moments * 4 * (total / n + largest) + slack
    state = moments * 4 * total  # every element's state once, counters aside
    held = [r["optimizer_bytes"] for r in reports]
    unsharded = reports[0]["unsharded_bytes"]
    hint = f" ({hint})" if hint else ""
    if all(b >= state for b in held):
        raise AssertionError(
            f"{name}: every rank's optimizer holds the state of every parameter ({held} bytes; "
            f"the unsharded optimizer {unsharded}): the wrapped optimizer must only ever see "
            f"this rank's own parameters; updating every parameter on every rank, or building "
            f"state for all of them, shards nothing{hint}")
    assert sum(held) <= state + n * slack, (
        f"{name}: the ranks' optimizers hold {sum(held)} bytes together, more than the state of "
        f"every element once ({state} bytes + small counters): some parameters' state lives on "
        f"several ranks; each parameter has one owner, and only its wrapped optimizer sees it{hint}")
    assert sum(held) >= state, (
        f"{name}: the ranks' optimizers hold {sum(held)} bytes together, less than the state of "
        f"every element once ({state} bytes): some parameters are stepped by no rank{hint}")
    for rank, b in enumerate(held):
        assert b <= per_rank_limit, (
            f"{name}: rank {rank}'s optimizer holds {b} bytes of tensors, the ranks {held}, the "
            f"unsharded optimizer {unsharded}: each parameter's state is on one rank, but not "
            f"about 1/{n} of the {total} elements per rank (at most {per_rank_limit:.0f} bytes "
            "here): balance the owners by element count (largest first, each to the rank with "
            "the fewest elements so far), not by number of parameters (round-robin or equal "
            f"chunks of the list){hint}")


def check_owner_rule(reports: list[dict], name: str, moments: int) -> None:
    """Each rank holds the state of exactly the elements the documented owner rule gives it."""
    numels = reports[0]["numels"]
    n = len(reports)
    loads = owner_loads([numels], n)
    slack = STATE_SLACK_PER_PARAM * len(numels)
    held = [r["optimizer_bytes"] for r in reports]
    elements = [b // (4 * moments) for b in held]  # about: counters aside

    def fits(load):
        return all(moments * 4 * e <= b <= moments * 4 * e + slack for e, b in zip(load, held))

    if fits(loads):
        return
    named = [rule for rule, load in misread_loads(numels, n).items() if fits(load)]
    raise AssertionError(
        f"{name}: parameters of {numels} elements on {n} ranks; the ranks' optimizers hold the "
        f"state of about {elements} elements; the owner rule (each parameter, largest first, to "
        f"the rank with the fewest elements so far; ties: the lowest rank) gives {loads}"
        + (f"; {named[0]} gives what you hold: the rule balances elements, not parameters"
           if named else ""))


CASE_HINTS = {
    "add_param_group": "add_param_group must give the new parameters owners, as __init__ does, "
                       "and hand this rank's to the wrapped optimizer",
    "lr scheduler": "a scheduler changes 'lr' in this optimizer's param_groups; step() must hand "
                    "it on to the wrapped optimizer",
}


@pytest.mark.parametrize("name", list(CASES))
def test_parameters_match_one_process(ranks, name):
    """Parameters match the plain optimizer in one process after every step, bitwise equal across ranks."""
    check_numbers(case_reports(ranks, name), name, CASE_HINTS.get(name, BROADCAST_HINT))


@pytest.mark.parametrize("name,moments", [("adam", 2), ("sgd momentum", 1), ("adam two groups", 2),
                                          ("add_param_group", 2), ("three tensors, tied", 2)])
def test_each_rank_holds_about_one_nth_of_the_state(ranks, name, moments):
    """Each rank's optimizer holds about 1/N of the state, every element's state exactly once."""
    check_state_is_sharded(case_reports(ranks, name), name, moments, CASE_HINTS.get(name, ""))


@pytest.mark.parametrize("name", ["adam", "three tensors, tied", "one tensor", "uneven sizes"])
def test_owners_follow_the_documented_rule(ranks, name):
    """Owners follow the documented rule: largest parameter first, to the rank with the fewest elements."""
    check_owner_rule(case_reports(ranks, name), name, moments=2)


@pytest.mark.parametrize("name", ["adam two groups", "add_param_group", "lr scheduler"])
def test_param_groups_list_every_parameter(ranks, name):
    """param_groups lists every parameter with its group's hyper-parameters, on every rank, as torch's."""
    for rank, r in enumerate(case_reports(ranks, name)):
        assert r["param_groups"] == r["reference_groups"], (
            f"{name}, rank {rank}: param_groups holds {r['param_groups']} (parameters per group, "
            f"lr), the plain optimizer's {r['reference_groups']}: param_groups must list every "
            "parameter on every rank, not only this rank's own (zero_grad() and LR schedulers "
            "work through it)")


@pytest.mark.parametrize("name", ["adam", "three tensors, tied"])
def test_step_only_broadcasts_each_parameter_once(ranks, name):
    """step() communicates parameters only: one broadcast of each parameter, from its owner."""
    reports = case_reports(ranks, name)
    param_bytes = 4 * sum(reports[0]["numels"])
    for rank, r in enumerate(reports):
        calls, sizes = r["step_comm"].get("calls", {}), r["step_comm"].get("bytes", {})
        others = {k: v for k, v in calls.items() if k != "broadcast"}
        assert not others, (
            f"{name}, rank {rank}: step() issued {others} besides broadcasts: the gradients are "
            "already averaged when step() runs (DDP or an all-reduce did it); step() only "
            "broadcasts each parameter from its owner")
        assert sizes.get("broadcast", 0) == param_bytes, (
            f"{name}, rank {rank}: step() broadcast {sizes.get('broadcast', 0)} bytes, the "
            f"parameters are {param_bytes} bytes: broadcast every parameter exactly once, from "
            "its owner")


def test_zero_grad_as_in_torch(ranks):
    """zero_grad() clears every parameter's gradient on every rank, as torch's does (both set_to_none)."""
    for rank, r in enumerate(case_reports(ranks, "adam")):
        z = r["grads_after_zero_grad"]
        assert "error" not in z, f"rank {rank}: {z.get('error')}; keep torch's zero_grad signature"
        assert z["not_zeros"] == 0, (
            f"rank {rank}: zero_grad(set_to_none=False) left {z['not_zeros']} of {z['had']} "
            "gradients other than a zero tensor: it must zero every parameter's gradient, not "
            "only this rank's own (the next all-reduce sums every gradient on every rank)")
        assert z["not_none"] == 0 and z["not_none_in_model"] == 0, (
            f"rank {rank}: zero_grad() left .grad set on {z['not_none_in_model']} of the model's "
            "parameters: it must clear every parameter's gradient, not only this rank's own (the "
            "next all-reduce sums every gradient on every rank); param_groups lists them all")


def test_one_rank_is_the_plain_optimizer():
    """World size 1, in this process: ShardedOptimizer updates exactly as the wrapped AdamW does."""
    from helpers.dist import distributed

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
            "param_groups must list every parameter with its hyper-parameters, as in torch "
            "(ShardedOptimizer takes an iterator of parameters too, as model.parameters() gives)")


def stretch_reports(ranks, name: str, nproc: int = NPROC) -> list[dict]:
    """The stretch's reports; its own state when it, or what it needs, is not written yet."""
    if stub_message(STRETCH):
        raise Unsolved(stub_message(STRETCH))
    missing = [m.__name__ for m in NEEDS if stub_message(m)]
    if missing:
        raise Unsolved(f"Exercise ShardedOptimizer.reduce_gradients is written, but it can only "
                       f"be checked once ShardedOptimizer's {', '.join(missing)} are written too "
                       "(the main exercise: the checks train with it)")
    return case_reports(ranks, name, nproc)


def check_stretch_gradients(reports: list[dict], name: str) -> None:
    """Each gradient kept on exactly one rank (the one holding its state), the average over ranks."""
    num_params = len(reports[0]["numels"])
    n = len(reports)
    for step in range(len(reports[0]["stretch"])):
        kept = [set(r["stretch"][step]["kept"]) for r in reports]
        every_param_once = (sum(map(len, kept)) == num_params
                            and set().union(*kept) == set(range(num_params)))
        assert every_param_once, (
            f"{name}, step {step}: after reduce_gradients() each parameter must keep its gradient "
            f"on exactly one rank (its owner) and have .grad None on the others (ZeRO-2 drops "
            f"them); kept per rank: {kept}")
        for rank, r in enumerate(reports):
            s = r["stretch"][step]
            summed = s["max_diff_from_sum"] <= 1e-6 < s["max_grad_diff"]
            assert s["max_grad_diff"] <= 1e-6, (
                f"{name}, rank {rank}, step {step}: a kept gradient differs from the average over "
                f"ranks by {s['max_grad_diff']:.3g}"
                + ("; it is the sum over the ranks: divide by N" if summed else
                   "; part r of the buffer must hold rank r's parameters' gradients, in order"))
    # the owner of a gradient is the rank that holds its parameter's state (the rule's loads)
    loads = sorted(sum(reports[0]["numels"][i] for i in r["stretch"][0]["kept"]) for r in reports)
    assert loads == sorted(owner_loads([reports[0]["numels"]], n)), (
        f"{name}: gradient elements kept per rank {loads}; the owner rule gives "
        f"{sorted(owner_loads([reports[0]['numels']], n))}: keep the gradients of the parameters "
        "this rank owns")
    check_numbers(reports, f"{name}: reduce_gradients + step")


def check_stretch_bytes(reports: list[dict], name: str) -> None:
    """reduce_gradients sends what one reduce-scatter of the packed gradients sends: (N-1)/N of
    the buffer of N parts of the largest rank's size (half an all-reduce's 2(N-1)/N when the
    parts are equal)."""
    n, numels = len(reports), reports[0]["numels"]
    grad_bytes = 4 * sum(numels)
    part = max(sum(numels[i] for i in r["stretch"][0]["kept"]) for r in reports)
    reduce_scatter = (n - 1) / n * 4 * n * part  # the padded buffer of N parts
    all_reduce = 2 * (n - 1) / n * grad_bytes
    for rank, r in enumerate(reports):
        comm = r["stretch"][-1]["comm"]
        sent = sum(comm.get("sent", {}).values())
        assert "all_reduce" not in comm.get("calls", {}), (
            f"{name}, rank {rank}: reduce_gradients() issued {comm['calls']}: an all-reduce "
            f"gives every rank every averaged gradient, sending 2(N-1)/N of them ({all_reduce:.0f} "
            "bytes here), only for all but this rank's own to be dropped; ZeRO-2 reduce-scatters "
            "instead, so that each rank receives only its own part: one reduce-scatter of the "
            f"packed buffer sends (N-1)/N of it ({reduce_scatter:.0f} bytes here; half an "
            "all-reduce's when the ranks' parts are equal)")
        assert sent <= reduce_scatter * (1 + 1e-9), (
            f"{name}, rank {rank}: reduce_gradients() sent {sent:.0f} bytes ({comm['calls']}); one "
            f"reduce-scatter of the packed gradients sends {reduce_scatter:.0f} (an all-reduce of "
            f"them {all_reduce:.0f})")


@pytest.mark.exercise("ShardedOptimizer.reduce_gradients")
@pytest.mark.parametrize("name", list(STRETCH_CASES))
def test_stretch_reduce_gradients_keeps_only_own_gradients(ranks, name):
    """reduce_gradients keeps each averaged gradient on its owner only, and step() then trains as torch."""
    check_stretch_gradients(stretch_reports(ranks, name), name)


@pytest.mark.exercise("ShardedOptimizer.reduce_gradients")
@pytest.mark.parametrize("name", list(STRETCH_CASES))
def test_stretch_sends_one_reduce_scatter(ranks, name):
    """reduce_gradients sends one reduce-scatter's bytes, not an all-reduce's (twice as many when balanced)."""
    check_stretch_bytes(stretch_reports(ranks, name), name)


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    run_cases(CASES, STRETCH_CASES)
