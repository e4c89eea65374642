"""Tests of lab 11's mixture-of-experts lab beyond the exercise: the MoE against a loop over tokens,
the gate convention, the load-balancing loss, capacity and dropped tokens, the routing plan and
the byte formula, skew and imbalance, the aux loss in training (labs/lab11_expert_balance.py),
and, in one launch on 4 ranks, both labs' run() end to end: the expert-parallel layer against the
dense one, the bytes counted against the formula, and every (dp, ep) layout of expert x data
parallelism against one process, with the wrong gradient reductions shown to differ; and every
conclusion notebook 11 prints in part 2, from its summary function fed this run's reports, each
verdict fed the opposite case.

Run:  .venv/bin/python -m pytest tests/test_lab11_experts.py -q
"""
from __future__ import annotations


import copy

import pytest
import torch

import labs.lab11_expert_balance as balance
import labs.lab11_expert_check as check
import labs.lab11_experts as lab
from helpers.notice import solved
from tests.harness import launch_ranks

NPROC = 4
TOL = 1e-12


def loop_reference(moe: lab.MoE, x: torch.Tensor) -> torch.Tensor:
    """out[t] = sum over t's kept top-k choices of gate * expert(x[t]), one token at a time."""
    probs = torch.softmax(moe.router(x), -1)
    top, chosen = probs.topk(moe.top_k, -1)
    gates = top / top.sum(-1, keepdim=True) if moe.top_k > 1 else top
    cap = lab.expert_capacity(len(x), moe.top_k, moe.num_experts, moe.capacity_factor)
    load = [0] * moe.num_experts
    out = [torch.zeros_like(x[0]) for _ in range(len(x))]
    for c in range(moe.top_k):
        for t in range(len(x)):
            e = int(chosen[t, c])
            if cap is None or load[e] < cap:
                load[e] += 1
                out[t] = out[t] + gates[t, c] * moe.experts[e](x[t:t + 1])[0]
    return torch.stack(out)


def tokens(n=20, hidden=6, seed=0, shift=0.0):
    return lab.sample_tokens(n, hidden, seed=seed, shift=shift, dtype=torch.float64)


# ------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("top_k, factor", [(1, None), (2, None), (3, None), (2, 0.75), (1, 1.0)])
def test_moe_is_the_loop_over_tokens(top_k, factor):
    moe = lab.make_moe(6, 10, 4, top_k, factor, dtype=torch.float64)
    x = tokens(shift=2.0)
    lab.skew_router(moe, 1.0)
    assert (moe(x) - loop_reference(moe, x)).abs().max() < TOL


def test_moe_keeps_leading_dimensions():
    moe = lab.make_moe(6, 10, 4, 2, dtype=torch.float64)
    x = tokens(24).reshape(2, 3, 4, 6)
    assert torch.equal(moe(x), moe(x.reshape(-1, 6)).reshape(2, 3, 4, 6))


def test_every_expert_runs_once_on_exactly_its_tokens():
    moe = lab.make_moe(6, 10, 4, 2, dtype=torch.float64)
    x = tokens()
    calls = []
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda _m, inp, _o, e=e: calls.append((e, len(inp[0]))))
    moe(x)
    counts = moe.tokens_per_expert.tolist()
    assert calls == [(e, c) for e, c in enumerate(counts) if c], (calls, counts)
    assert sum(counts) == 2 * len(x)


def test_gates_top1_is_the_probability_topk_renormalised():
    """Switch (k=1): the gate is p itself, so the router learns from the task loss; k>1: they sum to 1."""
    moe = lab.make_moe(6, 10, 4, 1, dtype=torch.float64)
    x = tokens()
    r = moe.route(x)
    assert torch.equal(r.weights[:, 0], r.probs.max(-1).values)
    task = moe(x).square().sum()
    (grad,) = torch.autograd.grad(task, moe.router.weight)
    assert grad.abs().max() > 1e-6
    moe.top_k = 2
    r = moe.route(x)
    assert torch.allclose(r.weights.sum(-1), torch.ones(len(x), dtype=torch.float64))
    assert (r.weights[:, 0] >= r.weights[:, 1]).all()


def test_aux_loss_values():
    """E sum f_i P_i: 1 for a uniform router whatever top-k picks; E when one expert takes everything;
    a hand-worked case."""
    moe = lab.make_moe(6, 10, 4, 2, dtype=torch.float64)
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(tokens())
    assert abs(moe.aux_loss.item() - 1.0) < TOL
    lab.skew_router(moe, 1e4)
    moe.top_k = 1
    moe(tokens(shift=5.0))
    assert abs(moe.aux_loss.item() - 4.0) < 1e-6
    # two tokens, two experts, top-1: probs (0.75, 0.25) and (0.4, 0.6): f = (1/2, 1/2), P = (0.575, 0.425)
    router = torch.nn.Linear(2, 2, bias=False).double()
    with torch.no_grad():
        router.weight.copy_(torch.eye(2))
    x = torch.log(torch.tensor([[0.75, 0.25], [0.4, 0.6]], dtype=torch.float64))
    r = lab.route(router, x, 1)
    assert abs(r.aux_loss.item() - 2 * (0.5 * 0.575 + 0.5 * 0.425)) < TOL


def test_aux_loss_gradient_pushes_the_crowded_expert_down():
    moe = lab.skew_router(lab.make_moe(6, 10, 4, 1, dtype=torch.float64), 4.0)
    x = tokens(shift=2.0)
    moe(x)
    (grad,) = torch.autograd.grad(moe.aux_loss, moe.router.weight)
    direction = torch.full((6,), 6 ** -0.5, dtype=torch.float64)
    assert (grad @ direction)[0] > 0 > (grad @ direction)[1:].max()   # descent lowers expert 0's logit


def test_capacity_formula_and_priority():
    assert lab.expert_capacity(10, 2, 4, 1.0) == 5 and lab.expert_capacity(10, 1, 4, 1.25) == 4
    assert lab.expert_capacity(10, 2, 4, None) is None
    # 4 tokens, top-2, capacity 2. First choices queue first: tokens 0 and 1 fill expert 0; then the
    # second choices, in token order: tokens 0 and 1 fill expert 1 before token 3 comes to it.
    experts = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 1]])
    kept = lab.within_capacity(experts, 3, 2)
    assert kept.tolist() == [[True, True], [True, True], [False, True], [False, False]]
    assert lab.within_capacity(experts, 3, None).all()


def test_capacity_drops_are_counted_and_add_nothing():
    moe = lab.skew_router(lab.make_moe(6, 10, 4, 2, 0.5, dtype=torch.float64), 2.0)
    x = tokens(shift=2.0)
    out = moe(x)
    r = moe.route(x)
    assert moe.dropped == r.dropped > 0
    assert moe.tokens_per_expert.max() <= lab.expert_capacity(len(x), 2, 4, 0.5)
    dropped_both = (~r.kept).all(-1)
    if dropped_both.any():
        assert out[dropped_both].abs().max() == 0


def test_routing_plan_and_byte_formula():
    moe = lab.skew_router(lab.make_moe(6, 10, 6, 2, 1.0), 1.0)
    xs = [lab.sample_tokens(n, 6, seed=s, shift=2.0) for s, n in enumerate((9, 5, 12))]
    plan = lab.routing_plan(moe, xs, 3)
    kept = [c for c in plan["choices"] if c["kept"]]
    assert sum(map(sum, plan["splits"])) == len(kept) == sum(plan["tokens_per_expert"])
    assert len(plan["choices"]) == 2 * (9 + 5 + 12) and plan["dropped"] == len(plan["choices"]) - len(kept)
    for i in range(3):
        for j in range(3):
            assert plan["splits"][i][j] == sum(1 for c in kept if c["rank"] == i and c["owner"] == j)
    assert plan["rows_per_rank"] == [sum(row[j] for row in plan["splits"]) for j in range(3)]
    assert all(c["owner"] == c["expert"] // 2 for c in plan["choices"])
    splits = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    b = lab.all_to_all_bytes(splits, 1, 10, 6)
    assert b == {"forward": {"counts": 2 * 2 * 8, "dispatch": (4 + 6) * 10, "combine": (2 + 8) * 10},
                 "backward": {"combine": (4 + 6) * 10, "dispatch": (2 + 8) * 10}}


def test_imbalance_and_skew():
    assert lab.imbalance([3, 3, 3]) == 1.0 and lab.imbalance([6, 0, 0]) == 3.0 and lab.imbalance([0, 0]) == 1.0
    sizes = {**check.default_sizes(), "hidden": 8, "ffn": 8, "tokens": 64}
    rows = balance.skew_table(sizes, 2, strengths=(0.0, 4.0))
    assert rows[0]["expert max/mean"] < rows[1]["expert max/mean"] > 1.9   # top-2 of 4 experts: at most 2
    assert rows[1]["tokens per expert"][0] == max(rows[1]["tokens per expert"])


def test_capacity_table_drops_more_with_skew_and_less_with_capacity():
    sizes = {**check.default_sizes(), "hidden": 8, "ffn": 8, "tokens": 64}
    rows = balance.capacity_table(sizes, 2, factors=(1.0, 2.0), skews=(0.0, 4.0))
    dropped = {(r["skew"], r["capacity factor"]): r["dropped"] for r in rows}
    assert dropped[(4.0, 1.0)] > dropped[(0.0, 1.0)] and dropped[(4.0, 2.0)] <= dropped[(4.0, 1.0)]
    assert dropped[(0.0, 2.0)] == 0 or dropped[(0.0, 2.0)] < dropped[(0.0, 1.0)]


# --------------------------------------------------------------------------------- 4 ranks, once
SIZES = dict(hidden=16, ffn=32, experts_per_rank=2, top_k=2, tokens=12, capacity_factor=None, shift=2.0)


def sync_experts_over_everyone(layer, dp_group, world_size):
    """Wrong: the experts' gradients all-reduced over every rank (ranks holding other experts too)."""
    return balance.sync_gradients(layer, None, world_size)


def sync_experts_over_ep_group(layer, dp_group, world_size):
    """Wrong: over the ep group, which the all-to-all already summed (and which holds other experts)."""
    return balance.sync_gradients(layer, layer.group, world_size)


def no_sync(layer, dp_group, world_size):
    """Wrong: no reduction at all (each rank steps with its own tokens' gradients)."""
    return []


WRONG = {"experts over every rank": sync_experts_over_everyone,
         "experts over the ep group": sync_experts_over_ep_group, "nothing reduced": no_sync}


@pytest.fixture(scope="module")
def ranks():
    return launch_ranks(__file__, nproc=NPROC, timeout=300, env={"DIST_TIMEOUT": "60"})


def test_run_end_to_end_on_4_ranks(ranks):
    for rank in range(NPROC):
        rep = ranks[rank]["run"]
        assert rep["world_size"] == NPROC and rep["printed"]
        for name in ("check", "check_skewed"):
            check = solved(rep[name])
            assert check["worst"] < 1e-9, check["diffs"]
            assert check["collectives"] == ["all_to_all"]
            for row in check["bytes"]:
                assert row["counted"] == row["formula"], row
            rows = check["rows_per_expert"]
            assert rows["ran on"] == rows["routed"] and all(c <= 1 for c in rows["calls"])
        skewed = solved(rep["check_skewed"])["plan_splits"]
        received = [sum(row[j] for row in skewed) for j in range(NPROC)]
        assert max(received) >= 2 * min(received), skewed    # the skewed check is really uneven


def test_ep_dp_layouts_match_one_process(ranks):
    """Every (dp, ep) layout of 4 ranks: one SGD step equals one process's; experts reduced over the
    dp group, the router over every rank."""
    for rank in range(NPROC):
        layouts = ranks[rank]["run"]["ep_dp"]
        assert sorted(layouts) == ["dp1 x ep4", "dp2 x ep2", "dp4 x ep1"]
        for name, layout in layouts.items():
            layout = solved(layout)
            assert layout["worst"] < 1e-12, (name, layout["diffs"])
            groups = {g["parameters"]: g["all-reduced over ranks"] for g in layout["groups"]}
            assert groups == {"experts": layout["dp_group"], "router": list(range(NPROC))}
            assert rank in layout["dp_group"] and rank in layout["ep_group"]
            assert len(layout["dp_group"]) == layout["dp"] and len(layout["ep_group"]) == layout["ep"]
            assert [a[1] for a in layout["all_reduces"]] == [layout["dp"], NPROC]
        two = layouts["dp2 x ep2"]
        assert two["ep_group"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert two["dp_group"] == [rank % 2, rank % 2 + 2]


def test_aux_loss_evens_the_load_in_training(ranks):
    """The lab's claim, on the lab's settings (rank 0 trains; smoke width): 60 Adam steps with the
    aux loss end far more balanced than without it, and the task is still learnt."""
    runs = ranks[0]["run"]["training"]["runs"]
    plain, balanced = runs["0.0"], runs["0.01"]
    assert plain["imbalance"][0] == balanced["imbalance"][0] > 3
    assert balanced["imbalance"][-1] < 2 < plain["imbalance"][-1]
    assert balanced["task_loss"][-1] < 0.5 * balanced["task_loss"][0]
    assert all(ranks[rank]["run"]["training"] is None for rank in range(1, NPROC))


@pytest.mark.parametrize("mistake", list(WRONG))
def test_wrong_gradient_reductions_differ_from_one_process(ranks, mistake):
    worst = max(ranks[rank]["wrong"][mistake] for rank in range(NPROC))
    assert worst > 1e-6, f"{mistake}: the check cannot tell it from the right reduction"


# ---------------------------------------------------------------------------------------- what the notebook prints
def reports(ranks):
    return [ranks[r]["run"] for r in range(NPROC)]


def test_expert_check_summaries(ranks):
    plan = check.plan_summary(ranks[0]["run"])
    assert len(plan.rows) == NPROC and "balanced routing would send" in plan.lines[0]
    shown = check.check_summary(reports(ranks))
    assert shown.lines[0].endswith("rounding (float64)") and shown.lines[1].endswith("in one call")
    assert shown.lines[2] == "collectives in the forward: ['all_to_all']"
    assert check.bytes_summary(reports(ranks)).lines[0].startswith("counted bytes equal the formula")
    wrong = copy.deepcopy(reports(ranks))
    wrong[2]["check"]["worst"] = 1.0
    wrong[1]["check_skewed"]["bytes"][1]["counted"] += 8
    assert check.check_summary(wrong).lines[0].endswith("MORE than rounding")
    assert check.bytes_summary(wrong).lines[0].startswith("counted bytes DIFFER")


def test_rows_verdict_flips():
    right = {"ran on": [3, 4], "routed": [3, 4], "calls": [1, 1]}
    assert check.rows_verdict([right]).endswith("in one call")
    assert check.rows_verdict([{**right, "calls": [4, 1]}]).endswith("in several calls")
    assert check.rows_verdict([{**right, "ran on": [7, 4]}]).startswith("some expert ran on rows")


def test_demo_and_explorer_picture():
    demo = check.small_demo()
    assert len(demo.rows) == 8 and "16 rows" in demo.lines[0] and demo.lines[1].endswith(("e-16", "e-17", "e+00"))
    fig, text = check.draw_routing(4, 2, 2, 4.0, 1.0, 16)
    assert fig.get_size_inches()[0] * 90 <= 860 and "rows received per rank" in text   # fits a 1366 px page


def test_balance_summaries(ranks):
    run = ranks[0]["run"]
    assert balance.skew_summary(run).lines[0].startswith("from skew 0.0 to 4.0")
    cap = balance.capacity_summary(run)
    assert cap.lines[-1].startswith("the tilted router drops at least as many")
    everywhere, from_125 = copy.deepcopy(run), copy.deepcopy(run)
    for row in everywhere["capacity"]:
        row["dropped"] += 1
    for row in from_125["capacity"]:
        row["dropped"] = 0 if row["capacity factor"] >= 1.25 else row["dropped"] + 1
    assert balance.capacity_summary(everywhere).lines[0].endswith("assignments dropped at every factor of the table")
    assert balance.capacity_summary(from_125).lines[0] == "router skew 0.0: nothing dropped from capacity factor 1.25 on"
    wrong = copy.deepcopy(run)
    tilted = next(r for r in wrong["capacity"] if r["skew"] > 0)
    tilted["dropped"] = -1
    assert balance.capacity_summary(wrong).lines[-1].startswith("not on this run")
    assert all(line.startswith("router skew") for line in balance.timing_summary(reports(ranks)).lines)
    assert balance.ep_dp_summary(reports(ranks)).lines[0].endswith("(rounding)")
    wrong = copy.deepcopy(reports(ranks))
    wrong[3]["ep_dp"]["dp2 x ep2"]["worst"] = 0.1
    assert "MORE than rounding" in balance.ep_dp_summary(wrong).lines[0]
    assert len(balance.mesh_table(8, 4, 8).rows) == 8


def test_aux_loss_table_reaches_e_over_k():
    """Switch's loss is at most E/k: measured, top-1 and top-2, with one expert taking every token."""
    shown = balance.aux_loss_table()
    hard = {row["top-k"]: row["aux loss"] for row in shown.rows if row["router"].startswith("everything")}
    assert hard == {1: pytest.approx(4.0), 2: pytest.approx(2.0)}
    assert all(row["aux loss"] <= row["E/k"] + 1e-9 for row in shown.rows)
    assert shown.lines[1].count("the most it can be") == 2 and shown.lines[2].endswith("up for the others")
    assert balance.ceiling_verdict(3.0, 4, 1).endswith("NOT E/k = 4")
    assert balance.push_verdict([0.1, -0.1, 0.2], 0).startswith("NOT down")


def test_load_verdict_flips():
    """The time follows the rows only beyond the repeats' noise; a spread within it is noise."""
    quiet = [[0.010, 0.0101, 0.0099], [0.030, 0.0301, 0.0299]]
    assert balance.load_verdict([10, 30], quiet).endswith("the time followed the rows (the busiest rank was the slowest)")
    assert "NOT the rows" in balance.load_verdict([30, 10], quiet)
    assert "not the routing" in balance.load_verdict([20, 20], quiet)
    noisy = [[0.010, 0.060, 0.002], [0.012, 0.001, 0.050]]
    assert balance.load_verdict([20, 20], noisy).endswith(": noise")


def test_training_result(ranks):
    result = balance.training_result(ranks[0]["run"]["training"])
    assert result.lines[0].endswith("the aux loss evened the load") and result.bound == 4.0
    assert set(result.curves) == {"task loss only", "task + 0.01 x aux loss"}
    flipped = copy.deepcopy(ranks[0]["run"]["training"])
    flipped["runs"]["0.01"]["imbalance"][-1] = 99.0
    flipped["runs"]["0.01"]["task_loss"][-1] = 99.0
    lines = balance.training_result(flipped).lines
    assert lines[0].endswith("no evening on this run") and "NOT learnt" in lines[2]


# ---------------------------------------------------------------------------------------- worker
def worker(ctx) -> dict:
    result = check.run(ctx, **SIZES)
    balanced = balance.run(ctx, **SIZES)
    wrong = {name: balance.ep_dp_check(ctx.device, SIZES, 2, sync=sync)["worst"] for name, sync in WRONG.items()}
    return {"run": {**result, **balanced, "printed": True}, "wrong": wrong}


if __name__ == "__main__":
    from helpers.dist import distributed

    with distributed() as ctx:
        ctx.report(**worker(ctx))
