"""Hidden tests of lab 08's exercise, `ShardedOptimizer` (labs/lab08_sharded_optimizer.py).

On 3 and 4 ranks (one launch each; this file is also the worker): AdamW with two parameter groups
of different hyper-parameters on a model with tied weights (an embedding shared with the output
layer); parameters of very uneven sizes with SGD + Nesterov momentum; fewer parameters than
ranks (a rank that owns nothing); an LR scheduler driving the wrapper; step(closure); a frozen and
an unused parameter; a group added after some steps; the stretch, reduce_gradients, on uneven
sizes. Every case is compared with the plain torch optimizer in one process (atol 1e-5 + rtol
1e-4, as in the public tests) and across ranks (bitwise); the state is checked to be sharded
(about 1/N per rank, each element's state exactly once) and to follow the documented owner rule;
param_groups to list every parameter; step() to broadcast each parameter once and nothing else;
reduce_gradients to send one reduce-scatter's bytes. The training, measuring and diagnosing code
is the public tests' (tests/public/test_lab08_sharded_optimizer.py), so a failure names the same
misunderstandings.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from labs.lab08_sharded_optimizer import ShardedOptimizer
from tests.harness import launch_ranks
from tests.public.test_lab08_sharded_optimizer import (BROADCAST_HINT, NEEDS, StepLR, case_reports,
                                                       check_numbers, check_owner_rule,
                                                       check_state_is_sharded, check_stretch_bytes,
                                                       check_stretch_gradients, lm_loss, make_batches,
                                                       make_mlp, run_cases, seeded_linear,
                                                       stretch_reports, token_batches, train_pair)

pytestmark = pytest.mark.exercise("ShardedOptimizer")
ROWS = 24  # divisible by 3 and by 4 ranks
STEPS = 4


# ---------------------------------------------------------------------------------- models
class TiedLM(nn.Module):
    """Embedding -> tanh(Linear) -> Linear back to the vocabulary, whose weight IS the embedding's
    (one Parameter used twice: its gradient is the sum of both uses)."""

    def __init__(self, vocab: int = 40, dim: int = 12, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab, dim)
            self.hidden = nn.Linear(dim, dim)
            self.out = nn.Linear(dim, vocab)
        self.out.weight = self.embed.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # idx (B, T) -> logits (B, T, vocab)
        return self.out(torch.tanh(self.hidden(self.embed(idx))))


class Uneven(nn.Module):
    """Parameters of 1000, 1, 7, 300, 2, 50 and 3 elements; y = sum_i tanh(x @ A_i) @ p_i."""
    SIZES = (1000, 1, 7, 300, 2, 50, 3)

    def __init__(self, in_features: int = 8, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(n, generator=g) / n ** 0.5)
                                         for n in self.SIZES])
        for i, n in enumerate(self.SIZES):  # fixed projections: buffers, not parameters
            self.register_buffer(f"proj{i}", torch.randn(in_features, n, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in) -> (B, 1)
        out = sum(torch.tanh(x @ getattr(self, f"proj{i}")) @ w for i, w in enumerate(self.weights))
        return out.unsqueeze(1)


class FrozenAndUnused(nn.Module):
    """Three linear layers; `frozen` has requires_grad=False, `unused` never takes part in
    forward (its .grad stays None): torch's optimizers leave both unchanged."""

    def __init__(self, seed: int = 0):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.first, self.frozen, self.unused = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)
            self.last = nn.Linear(16, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.frozen(torch.tanh(self.first(x)))))


# ---------------------------------------------------------------------------------- cases
def tied_groups(model: TiedLM) -> list[dict]:
    return [{"params": [model.embed.weight, model.hidden.weight], "weight_decay": 0.1,
             "betas": (0.8, 0.95)},
            {"params": [model.hidden.bias, model.out.bias], "lr": 0.03, "weight_decay": 0.0}]


def join_later(step, sharded, reference, model_s, model_r):
    """Layers 4-7 join at step 1, with their own lr and momentum."""
    if step == 1:
        for optimizer, model in ((sharded, model_s), (reference, model_r)):
            optimizer.add_param_group({"params": list(model[8:].parameters()), "lr": 0.01,
                                       "momentum": 0.5})


def join_later_at_the_defaults(step, optimizer, model):
    """The misreading: the same group, but at the optimizer's default hyper-parameters."""
    if step == 1:
        optimizer.add_param_group({"params": list(model[8:].parameters())})


def closure_case() -> dict:
    """step(closure): the closure runs once per step on every rank and its loss comes back."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    rows = ROWS // n
    model_s, model_r = make_mlp(seed=30, depth=4), make_mlp(seed=30, depth=4)
    sharded = ShardedOptimizer(model_s.parameters(), torch.optim.Adam, lr=0.01)
    reference = torch.optim.Adam(model_r.parameters(), lr=0.01)
    calls, returned_ok, diffs = [], [], []
    for x, y in make_batches(STEPS, ROWS, 16, seed=31):
        def closure_s(x=x, y=y):
            sharded.zero_grad()
            mine = slice(rank * rows, (rank + 1) * rows)
            loss = F.mse_loss(model_s(x[mine]), y[mine])
            loss.backward()
            for p in model_s.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(n)
            calls.append(loss.item())
            return loss

        def closure_r(x=x, y=y):
            reference.zero_grad()
            loss = F.mse_loss(model_r(x), y)
            loss.backward()
            return loss

        before = len(calls)
        loss = sharded.step(closure_s)
        reference.step(closure_r)
        returned_ok.append(len(calls) == before + 1 and loss is not None and loss.item() == calls[-1])
        diffs.append(max((a - b).abs().max().item() - 1e-4 * b.abs().max().item()
                         for a, b in zip(model_s.parameters(), model_r.parameters())))
    return {"returned_ok": returned_ok, "excess_diff_per_step": diffs, "spread": 0.0}


CASES = {
    "adamw groups, tied weights": lambda: train_pair(
        TiedLM(seed=1), tied_groups, torch.optim.AdamW, {"lr": 0.01}, token_batches(STEPS, ROWS, 6, vocab=40, seed=2),
        loss_fn=lm_loss,
        misreadings={"groups at the defaults": dict(params_of=lambda m: list(m.parameters()))}),
    "sgd nesterov, uneven sizes": lambda: train_pair(
        Uneven(seed=3), lambda m: list(m.parameters()), torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9, "nesterov": True}, make_batches(STEPS, ROWS, 8, 1, seed=4)),
    "fewer parameters than ranks": lambda: train_pair(
        seeded_linear(6, 1, seed=16, bias=True), lambda m: list(m.parameters()), torch.optim.Adam, {"lr": 0.05},
        make_batches(STEPS, ROWS, 6, 1, seed=5)),
    "lr scheduler": lambda: train_pair(
        make_mlp(seed=6), lambda m: list(m.parameters()), torch.optim.Adam, {"lr": 0.02},
        make_batches(STEPS, ROWS, 16, seed=7), on_step=StepLR(),
        misreadings={"lr never changed": {}}),
    "frozen and unused": lambda: train_pair(
        FrozenAndUnused(seed=8), lambda m: list(m.parameters()), torch.optim.Adam, {"lr": 0.02},
        make_batches(STEPS, ROWS, 8, seed=9)),
    "group added later": lambda: train_pair(
        make_mlp(seed=10), lambda m: list(m[:8].parameters()), torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9}, make_batches(STEPS, ROWS, 16, seed=11), on_step=join_later,
        misreadings={"added group at the defaults": dict(on_step=join_later_at_the_defaults)}),
    "adamw many parameters": lambda: train_pair(
        make_mlp(seed=12, depth=12), lambda m: list(m.parameters()), torch.optim.AdamW,
        {"lr": 0.01, "weight_decay": 0.05}, make_batches(STEPS, ROWS, 16, seed=13)),
    "closure": closure_case,
}
STRETCH_CASES = {
    "stretch, uneven sizes": lambda: train_pair(
        Uneven(seed=14), lambda m: list(m.parameters()), torch.optim.Adam, {"lr": 0.02},
        make_batches(STEPS, ROWS, 8, 1, seed=15), reduce="stretch"),
}


# ---------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module", params=[3, 4], ids=["3 ranks", "4 ranks"])
def ranks(request):
    return request.param, launch_ranks(__file__, "cases", nproc=request.param, timeout=240,
                                       needs=NEEDS, env={"DIST_TIMEOUT": "40"})


HINTS = {
    "lr scheduler": "a scheduler sets the lr in this optimizer's param_groups: step() must pass "
                    "the groups' hyper-parameters on to the wrapped optimizer",
    "group added later": "add_param_group must give the new parameters owners and pass this "
                         "rank's on to the wrapped optimizer, with the group's hyper-parameters",
    "frozen and unused": "parameters without a gradient must stay as they are, as in torch",
}


@pytest.mark.points(2)
@pytest.mark.parametrize("name", [n for n in CASES if n != "closure"])
def test_parameters_match_one_process(ranks, name):
    """Trains like the plain torch optimizer in one process, identical on every rank, 3 and 4 ranks."""
    nproc, reports = ranks
    check_numbers(case_reports(reports, name, nproc), f"{name} ({nproc} ranks)",
                  HINTS.get(name, BROADCAST_HINT))


def test_step_with_closure(ranks):
    """step(closure) calls the closure exactly once, returns its loss, and trains like torch's."""
    nproc, reports = ranks
    for rank, r in enumerate(case_reports(reports, "closure", nproc)):
        assert all(r["returned_ok"]), (f"rank {rank}: step(closure) must call the closure exactly "
                                       "once and return its loss")
        assert max(r["excess_diff_per_step"]) <= 1e-5, (
            f"rank {rank}: step(closure) does not train like the wrapped optimizer's step(closure)")


@pytest.mark.points(2)
@pytest.mark.parametrize("name,moments", [("adamw many parameters", 2), ("lr scheduler", 2),
                                          ("group added later", 1)])
def test_state_is_sharded(ranks, name, moments):
    """Optimizer state is sharded: about 1/N per rank, each element's state held exactly once."""
    nproc, reports = ranks
    check_state_is_sharded(case_reports(reports, name, nproc), f"{name} ({nproc} ranks)", moments,
                           HINTS.get(name, "") if name == "group added later" else "")


@pytest.mark.parametrize("name,moments", [("adamw many parameters", 2),
                                          ("sgd nesterov, uneven sizes", 1)])
def test_owners_follow_the_documented_rule(ranks, name, moments):
    """Each rank holds optimizer state for exactly the parameters the documented owner rule gives it.

    State per rank = (bytes per element) x the elements the rule gives that rank (+ small counters)."""
    nproc, reports = ranks
    check_owner_rule(case_reports(reports, name, nproc), f"{name} ({nproc} ranks)", moments)


@pytest.mark.parametrize("name", ["adamw groups, tied weights", "group added later"])
def test_param_groups_list_every_parameter(ranks, name):
    """param_groups lists every parameter with its group's hyper-parameters on every rank, 3 and 4 ranks."""
    nproc, reports = ranks
    for rank, r in enumerate(case_reports(reports, name, nproc)):
        assert r["param_groups"] == r["reference_groups"], (
            f"{name} ({nproc} ranks), rank {rank}: param_groups holds {r['param_groups']} "
            f"(parameters per group, lr), the plain optimizer's {r['reference_groups']}: "
            "param_groups must list every parameter on every rank")


@pytest.mark.parametrize("name", ["sgd nesterov, uneven sizes", "adamw many parameters"])
def test_step_only_broadcasts_each_parameter_once(ranks, name):
    """step() communicates parameters only, each broadcast once from its owner, on 3 and 4 ranks."""
    nproc, reports = ranks
    reps = case_reports(reports, name, nproc)
    param_bytes = 4 * sum(reps[0]["numels"])
    for rank, r in enumerate(reps):
        calls, sizes = r["step_comm"].get("calls", {}), r["step_comm"].get("bytes", {})
        assert set(calls) == {"broadcast"} and sizes["broadcast"] == param_bytes, (
            f"{name} ({nproc} ranks), rank {rank}: step() issued {calls}, {sizes} bytes; the "
            f"parameters are {param_bytes} bytes: step() broadcasts each parameter once, from "
            "its owner, and communicates nothing else (the gradients are already averaged)")


def test_a_rank_may_own_nothing(ranks):
    """Fewer parameters than ranks works: a rank may own nothing and then holds no state."""
    nproc, reports = ranks
    reps = case_reports(reports, "fewer parameters than ranks", nproc)
    empty = [rank for rank, r in enumerate(reps) if r["optimizer_bytes"] == 0]
    assert empty, (f"with 2 parameters on {nproc} ranks some rank must hold no state; held: "
                   f"{[r['optimizer_bytes'] for r in reps]}")


def test_zero_grad_with_frozen_and_unused_parameters(ranks):
    """zero_grad() behaves as torch's, both set_to_none settings, with frozen and unused parameters."""
    nproc, reports = ranks
    for rank, r in enumerate(case_reports(reports, "frozen and unused", nproc)):
        z = r["grads_after_zero_grad"]
        assert "error" not in z and z["not_zeros"] == z["not_none"] == z["not_none_in_model"] == 0, (
            f"rank {rank} of {nproc}: zero_grad() must clear every gradient as torch's does "
            f"(gradients left: {z})")


@pytest.mark.exercise("ShardedOptimizer.reduce_gradients")
@pytest.mark.points(2)
def test_stretch_on_uneven_sizes(ranks):
    """reduce_gradients, uneven sizes: each gradient kept on exactly its owner rank, correctly averaged."""
    nproc, reports = ranks
    reps = stretch_reports(reports, "stretch, uneven sizes", nproc)
    check_stretch_gradients(reps, f"stretch, uneven sizes ({nproc} ranks)")


@pytest.mark.exercise("ShardedOptimizer.reduce_gradients")
def test_stretch_sends_one_reduce_scatter(ranks):
    """reduce_gradients sends one reduce-scatter's bytes, not an all-reduce's, on 3 and 4 ranks."""
    nproc, reports = ranks
    reps = stretch_reports(reports, "stretch, uneven sizes", nproc)
    check_stretch_bytes(reps, f"stretch, uneven sizes ({nproc} ranks)")


if __name__ == "__main__" and sys.argv[1:] == ["cases"]:
    run_cases(CASES, STRETCH_CASES)
