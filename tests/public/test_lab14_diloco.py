"""Public tests of lab 14's exercise, `DiLoCo.outer_step` (labs/lab14_diloco.py).

Run:  .venv/bin/python -m pytest tests/public/test_lab14_diloco.py -q
      (or ./run.sh check 14)

One launch on 2 ranks (gloo on the CPU), each rank a replica; this file is also its worker. In
each case every replica trains three copies of a small MLP side by side on the same batches (its
own data, different on each replica): one with torchft's `DiLoCo` (torchft 0.2.0, its lighthouse
and managers in the launch), one with your `DiLoCo`, and one for each usual misreading of the
outer step, written here (`Misread`). Checked after every inner step: your parameters against
torchft's (atol 1e-5); after every outer step: the anchor, the outer optimizer's momentum and the
inner optimizer's state against torchft's, every replica holding the same parameters, and what
your outer step sent (helpers.comm_count). When your run differs from torchft's, the message
names the misreading whose run yours matches on every replica, if one does.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labs.lab14_diloco import OUTER, DiLoCo, INNER_LR, flat_state, toy_batch, toy_model
from labs.lab14_replicas import in_one_launch   # (imported before torchft: it quiets its servers)
from tests.harness import launch_ranks

pytestmark = pytest.mark.exercise("DiLoCo.outer_step")
NPROC = 2
ATOL = 1e-5
NEEDS = [DiLoCo.outer_step]

# The misreadings, and what each means (a failing test shows the one your run matches).
MISREADINGS = {
    "wrong sign": "the pseudo-gradient has the wrong sign: it is the anchor minus the replica's "
                  "parameters (theta - theta_r), which points uphill like a gradient; theta_r - theta "
                  "makes the outer step undo the inner steps",
    "parameters averaged": "you averaged the parameters (local SGD) instead of stepping the outer "
                           "optimizer with the averaged pseudo-gradient: DiLoCo's outer SGD with "
                           "Nesterov momentum is what makes it more than parameter averaging",
    "outer state reset": "the outer optimizer's momentum starts from zero every round: use the "
                         "outer optimizer you were given, and keep its state from round to round",
    "inner state reset": "the inner optimizer's state (AdamW's moments and step count) was thrown "
                         "away at the outer step: the replicas keep it across rounds",
    "rank 0 only": "only replica 0 applied the outer step: every replica must run it (the same "
                   "update from the same average), or the others drift away",
    "no all-reduce": "each replica stepped with its own pseudo-gradient: average them over the "
                     "replicas (an all-reduce over self.group) first",
    "summed": "the pseudo-gradients were summed over the replicas, not averaged: divide the "
              "all-reduced sum by the number of replicas",
    "no restore": "the outer step started from the replica's own parameters: put the anchor "
                  "(the round's global parameters) back first, then step the outer optimizer",
    "stale anchor": "the anchor was not updated: after the outer step it must hold the new global "
                    "parameters, the start of the next round",
    "anchor aliases the parameters": "self.anchor shares storage with the parameters (p.data, not a "
                                     "copy), so it moves with every inner step and the next round's "
                                     "pseudo-gradient is zero: keep a copy",
}


class Misread(DiLoCo):
    """The lab's DiLoCo with the outer step as a misreading `how` (a key of MISREADINGS) writes it."""

    def __init__(self, *args, how: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.how = how

    def outer_step(self) -> None:
        how, params = self.how, list(self.model.parameters())
        n = dist.get_world_size(self.group)
        with torch.no_grad():
            if how == "parameters averaged":
                for p, a in zip(params, self.anchor):
                    dist.all_reduce(p, group=self.group)
                    p /= n
                    a.copy_(p)
                return
            deltas = [(p - a) if how == "wrong sign" else (a - p) for p, a in zip(params, self.anchor)]
            for d in deltas:
                if how != "no all-reduce":
                    dist.all_reduce(d, group=self.group)
                if how not in ("summed", "no all-reduce"):
                    d /= n
            if how == "inner state reset":
                self.inner_optimizer.state.clear()
            if how == "outer state reset":
                self.outer_optimizer.state.clear()
            if how == "rank 0 only" and dist.get_rank(self.group) != 0:
                return
            for p, a, d in zip(params, self.anchor, deltas):
                if how != "no restore":
                    p.copy_(a)
                p.grad = d
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad()
        if how == "anchor aliases the parameters":
            self.anchor = [p.data for p in params]
        elif how != "stale anchor":
            with torch.no_grad():
                for a, p in zip(self.anchor, params):
                    a.copy_(p)


# ---------------------------------------------------------------------------------- the worker side
def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest elementwise difference; infinite when the shapes differ (a state that is missing)."""
    a, b = list(a), list(b)
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return float("inf")
    return max([(x - y).abs().max().item() for x, y in zip(a, b) if x.numel()] or [0.0])


def spread(model: nn.Module) -> float:
    """Largest difference between any replica's parameters and replica 0's."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    first = flat.clone()
    dist.broadcast(first, src=0)
    diff = (flat - first).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def side_by_side(ctx, sync_every: int, rounds: int, outer: dict, width: int = 16, seed: int = 0,
                 misreadings=tuple(MISREADINGS)) -> dict:
    """torchft's DiLoCo, yours and each misreading, trained side by side on this replica's batches.
    Returns this rank's report: per step, your largest parameter difference from torchft and the
    calls your step() sent; per outer step, anchor / outer state / inner state differences and the
    replicas' spread; which misreadings your run matched."""
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    from helpers.comm_count import count_collectives
    from helpers.notice import unsolved_message

    def trio():
        model = toy_model(width, seed)
        return model, torch.optim.AdamW(model.parameters(), lr=INNER_LR), torch.optim.SGD(model.parameters(), **outer)

    ref, ref_inner, ref_outer = trio()
    mine = DiLoCo(*trio(), sync_every)
    others = {how: Misread(*trio(), sync_every, how=how) for how in misreadings}
    manager, lighthouse = in_one_launch(ctx, lambda: {"model": ref.state_dict()},
                                        lambda s: ref.load_state_dict(s["model"]))
    report = {"steps": [], "outer": [], "param_bytes": sum(4 * p.numel() for p in ref.parameters())}
    trail = {how: [] for how in others}
    mine_trail = []
    try:
        with TorchftDiLoCo(manager, [ref], ref_inner, ref_outer, sync_every=sync_every) as ft:
            for step in range(sync_every * rounds):
                x, y = toy_batch(step, ctx.rank)
                for model, inner in [(ref, ref_inner), (mine.model, mine.inner_optimizer),
                                     *[(o.model, o.inner_optimizer) for o in others.values()]]:
                    inner.zero_grad()
                    nn.functional.mse_loss(model(x), y).backward()
                ref_inner.step()
                with count_collectives() as log:
                    try:
                        synced = mine.step()
                    except Exception as exc:
                        if unsolved_message(exc):
                            raise
                        raise StudentError(f"your DiLoCo.outer_step raised {type(exc).__name__}: "
                                           f"{exc}") from exc
                for other in others.values():
                    other.step()
                mine_trail.append(_params(mine.model))
                for how, other in others.items():
                    trail[how].append(_params(other.model))
                report["steps"].append({"diff": _diff(mine_trail[-1], _params(ref)), "synced": synced,
                                        "calls": [[c.kind, c.nbytes] for c in log]})
                if synced:
                    original = ft._fragments[0].original_parameters
                    params = list(mine.model.parameters())
                    report["outer"].append({
                        "step": step,
                        "anchor": _diff(mine.anchor, [original[n] for n, _ in ref.named_parameters()]),
                        "anchor vs params": _diff(mine.anchor, _params(mine.model)),
                        "outer state": _diff([flat_state(mine.outer_optimizer, params)],
                                             [flat_state(ref_outer, list(ref.parameters()))]),
                        "inner state": _diff([flat_state(mine.inner_optimizer, params)],
                                             [flat_state(ref_inner, list(ref.parameters()))]),
                        "spread": spread(mine.model)})
    finally:
        manager.shutdown(wait=False)
        ctx.barrier()
        if lighthouse is not None:
            lighthouse.shutdown()
    report["matches"] = [how for how in others
                         if max(_diff(a, b) for a, b in zip(mine_trail, trail[how])) <= ATOL]
    return report


class StudentError(RuntimeError):
    """The exercise raised: the launch fails with this message (the first rank's), the traceback
    pointing into the lab."""


def run_cases(cases: dict) -> None:
    """The worker: every case on every rank, reported case by case."""
    from helpers.dist import distributed

    with distributed() as ctx:
        torch.set_num_threads(1)
        results = {}
        for name, case in cases.items():
            results[name] = case(ctx)
            ctx.report(cases=results)


CASES = {
    "H=3, Nesterov": lambda ctx: side_by_side(ctx, sync_every=3, rounds=3, outer=OUTER),
}


# ---------------------------------------------------------------------------------- the test side
@pytest.fixture(scope="module")
def ranks():
    return launch_ranks(__file__, "cases", nproc=NPROC, timeout=240, needs=NEEDS,
                        env={"DIST_TIMEOUT": "30"})


def case_reports(ranks, name: str, nproc: int = NPROC) -> list[dict]:
    reports = []
    for rank in range(nproc):
        cases = ranks[rank].get("cases", {})
        assert name in cases, f"rank {rank} reported no result for case {name!r}"
        reports.append(cases[name])
    return reports


def diagnosis(reports: list[dict]) -> str:
    """The misreading every replica's run matched, if one did."""
    common = set(reports[0]["matches"]).intersection(*(set(r["matches"]) for r in reports[1:]))
    for how in MISREADINGS:
        if how in common:
            return f"your run matches this misreading on every replica: {MISREADINGS[how]}"
    return "no usual misreading matches your run: compare your steps with the docstring's contract"


def check_parameters(reports: list[dict], name: str) -> None:
    for rank, r in enumerate(reports):
        for step, s in enumerate(r["steps"]):
            assert s["diff"] <= ATOL, (
                f"{name}, replica {rank}: after inner step {step} your parameters differ from torchft's "
                f"DiLoCo by {s['diff']:.3g} (atol {ATOL}); {diagnosis(reports)}")


def check_replicas_agree(reports: list[dict], name: str) -> None:
    for o in reports[0]["outer"]:
        assert o["spread"] == 0.0, (
            f"{name}: after the outer step at inner step {o['step']} the replicas' parameters differ "
            f"by {o['spread']:.3g}; they must be identical: every replica applies the same update, "
            f"computed from the same average; {diagnosis(reports)}")


def check_anchor(reports: list[dict], name: str) -> None:
    for rank, r in enumerate(reports):
        for o in r["outer"]:
            assert o["anchor vs params"] == 0.0, (
                f"{name}, replica {rank}: after the outer step at inner step {o['step']} self.anchor "
                f"differs from the model's parameters by {o['anchor vs params']:.3g}: both must hold "
                f"the new global parameters; {diagnosis(reports)}")
            assert o["anchor"] <= ATOL, (
                f"{name}, replica {rank}: after the outer step at inner step {o['step']} self.anchor "
                f"differs from torchft's global parameters by {o['anchor']:.3g}; {diagnosis(reports)}")


def _by(difference: float) -> str:
    return "is missing (no state, or not shaped like torchft's)" if difference == float("inf") else \
        f"differs from torchft's by {difference:.3g}"


def check_states(reports: list[dict], name: str) -> None:
    for rank, r in enumerate(reports):
        for o in r["outer"]:
            assert o["outer state"] <= ATOL, (
                f"{name}, replica {rank}: after the outer step at inner step {o['step']} the outer "
                f"optimizer's momentum {_by(o['outer state'])}: step the outer optimizer you were "
                f"given, once per round, and keep its state; {diagnosis(reports)}")
            assert o["inner state"] <= ATOL, (
                f"{name}, replica {rank}: after the outer step at inner step {o['step']} the inner "
                f"optimizer's state {_by(o['inner state'])}: the outer step leaves AdamW's moments "
                f"and step count as they are; {diagnosis(reports)}")


def check_traffic(reports: list[dict], name: str) -> None:
    for rank, r in enumerate(reports):
        for step, s in enumerate(r["steps"]):
            sent = {}
            for kind, nbytes in s["calls"]:
                sent[kind] = sent.get(kind, 0) + nbytes
            if not s["synced"]:
                assert not sent, (f"{name}, replica {rank}: inner step {step} sent {sent} bytes; "
                                  "only the outer step communicates")
                continue
            assert set(sent) == {"all_reduce"} and sent["all_reduce"] == r["param_bytes"], (
                f"{name}, replica {rank}: the outer step at inner step {step} sent {sent} (bytes by "
                f"collective); it sends all-reduces of the pseudo-gradients only, {r['param_bytes']} "
                "bytes in all (each parameter's element once): no parameters, no broadcast, no "
                "second pass")


def test_parameters_match_torchft_after_every_step(ranks):
    """Your parameters equal torchft's DiLoCo's after every inner and outer step."""
    check_parameters(case_reports(ranks, "H=3, Nesterov"), "H=3, Nesterov")


def test_every_replica_holds_the_same_parameters(ranks):
    """After each outer step every replica holds the same parameters (no drift)."""
    check_replicas_agree(case_reports(ranks, "H=3, Nesterov"), "H=3, Nesterov")


def test_anchor_holds_the_new_global_parameters(ranks):
    """After each outer step self.anchor holds the new global parameters, as torchft's copy does."""
    check_anchor(case_reports(ranks, "H=3, Nesterov"), "H=3, Nesterov")


def test_outer_momentum_carries_over_and_inner_state_is_kept(ranks):
    """The outer momentum carries over rounds; the inner optimizer's state is untouched."""
    check_states(case_reports(ranks, "H=3, Nesterov"), "H=3, Nesterov")


def test_outer_step_sends_the_pseudo_gradients_once(ranks):
    """Only the outer step communicates: all-reduces of the pseudo-gradients, each element once."""
    check_traffic(case_reports(ranks, "H=3, Nesterov"), "H=3, Nesterov")


if __name__ == "__main__" and sys.argv[1:2] == ["cases"]:
    run_cases(CASES)
