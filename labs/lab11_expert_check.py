"""Lab 11 (expert check): the homework's `ExpertParallelMoE` against the dense layer, with what
it sent and what its experts ran on.

Run:  ./run.sh 11      (this file alone: ./run.sh labs/lab11_expert_check.py; 2-4 ranks)

- `ep_check`: the dense MoE in float64 and every rank's tokens; the experts split over the ranks
  with `from_dense`; this rank's tokens forward and a random gradient backward, against one
  process (`dense_reference`): output, dL/dx, the router's gradient, each local expert's gradient
  summed over every rank's tokens; every all_to_all_single with its split sizes
  (labs/lab11_traffic.py) against the routing's `all_to_all_bytes`; the rows and calls of each
  local expert (`rows_seen`, forward hooks) against the routing.
- What notebook 11 prints from it: `plan_summary` (the batch routed on paper), `check_summary`,
  `bytes_summary`; and `small_demo` (eight tokens through a small layer, in one process),
  `draw_routing` (the routing explorer's picture).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from helpers import runs
from helpers.comm_count import count_collectives
from helpers.dist import DistContext, distributed
from helpers.notice import attempt, solved
from labs.lab11_experts import (
    MoE, ExpertParallelMoE, all_to_all_bytes, expert_capacity, make_moe, routing_plan, sample_tokens, skew_router,
)
from labs.lab11_results import Shown
from labs.lab11_traffic import record_all_to_alls


# ============================================================================ measured
class ExpertRows(list):
    """rows[j]: input rows experts[j] ran on; `.calls[j]`: how many times it was called."""
    calls: list[int]


@contextlib.contextmanager
def rows_seen(layer: nn.Module) -> Iterator[ExpertRows]:
    """The rows each of `layer.experts` ran on inside the block, and its calls (forward hooks)."""
    rows = ExpertRows([0] * len(layer.experts))
    rows.calls = [0] * len(layer.experts)

    def count(j):
        def hook(_module, inputs, _output):
            rows[j] += len(inputs[0])
            rows.calls[j] += 1
        return hook
    handles = [expert.register_forward_hook(count(j)) for j, expert in enumerate(layer.experts)]
    try:
        yield rows
    finally:
        for handle in handles:
            handle.remove()


def dense_reference(moe: MoE, xs: list[torch.Tensor], rank: int, douts: list[torch.Tensor]) -> dict:
    """One process's answer for rank `rank`: moe(xs[rank]), the gradients of sum(out * dout) w.r.t.
    xs[rank] and the router (this rank's tokens), and every expert's gradient summed over every
    rank's tokens (what expert parallelism must leave on the expert's owner)."""
    params = [moe.router.weight, *moe.experts.parameters()]
    summed = [torch.zeros_like(p) for p in params]
    for r, (x, dout) in enumerate(zip(xs, douts)):
        x = x.detach().clone().requires_grad_(True)
        out = moe(x)
        grads = torch.autograd.grad((out * dout).sum(), [x, *params], allow_unused=True)
        for total, g in zip(summed, grads[1:]):
            if g is not None:
                total += g
        if r == rank:
            mine = {"output": out.detach(), "input_grad": grads[0], "aux_loss": moe.aux_loss.detach(),
                    "router_grad": grads[1] if grads[1] is not None else torch.zeros_like(params[0])}
    names = [name for name, _ in moe.experts.named_parameters()]
    return {**mine, "expert_grads": dict(zip(names, summed[1:]))}


def _max_diff(got: torch.Tensor | None, expected: torch.Tensor) -> float:
    """max |got - expected|; inf when there is nothing (a gradient that never arrived)."""
    if got is None or got.shape != expected.shape:
        return float("inf")
    return (got.detach() - expected).abs().max().item() if got.numel() else 0.0


def ep_check(device: torch.device, sizes: dict, group=None, skew: float = 0.0) -> dict:
    """ExpertParallelMoE against the dense layer on this run's tokens (float64): output, dL/dx,
    router and expert gradients, the all-to-alls' bytes against `all_to_all_bytes`, and the rows
    each local expert ran on against the routing."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    s = sizes
    dense = make_moe(s["hidden"], s["ffn"], s["experts_per_rank"] * n, s["top_k"], s["capacity_factor"],
                     dtype=torch.float64, device=device)
    skew_router(dense, skew)
    xs = [sample_tokens(s["tokens"], s["hidden"], seed=100 + r, shift=s["shift"], dtype=torch.float64,
                        device=device) for r in range(n)]
    douts = [sample_tokens(s["tokens"], s["hidden"], seed=200 + r, dtype=torch.float64, device=device)
             for r in range(n)]
    ref = dense_reference(dense, xs, rank, douts)
    plan = routing_plan(dense, xs, n)
    layer = ExpertParallelMoE.from_dense(dense, group)
    x = xs[rank].clone().requires_grad_(True)
    with record_all_to_alls() as forward, rows_seen(layer) as rows, count_collectives() as log:
        out = layer(x)
    with record_all_to_alls() as backward:
        (out * douts[rank]).sum().backward()
    own = range(layer.first_expert, layer.first_expert + layer.num_local)
    diffs = {"output": _max_diff(out, ref["output"]), "input_grad": _max_diff(x.grad, ref["input_grad"]),
             "router_grad": _max_diff(layer.router.weight.grad, ref["router_grad"]), "experts": 0.0}
    for name, p in layer.experts.named_parameters():
        j, leaf = name.split(".", 1)
        expected = ref["expert_grads"][f"{layer.first_expert + int(j)}.{leaf}"]
        diffs["experts"] = max(diffs["experts"], _max_diff(p.grad, expected))
    formula = all_to_all_bytes(plan["splits"], rank, s["hidden"] * 8, layer.num_experts)
    counted = {"forward": dict(zip(("counts", "dispatch", "combine"), (c.sent_bytes for c in forward))),
               "backward": dict(zip(("combine", "dispatch"), (c.sent_bytes for c in backward)))}
    return {"diffs": diffs, "worst": max(diffs.values()), "plan_splits": plan["splits"],
            "bytes": [{"phase": phase, "all-to-all": what, "counted": counted[phase].get(what),
                       "formula": formula[phase][what]} for phase in formula for what in formula[phase]],
            "collectives": sorted({c.kind for c in log}),
            "rows_per_expert": {"experts": list(own), "ran on": list(rows), "calls": rows.calls,
                                "routed": [plan["tokens_per_expert"][e] for e in own]},
            "rows_received": sum(forward[1].output_splits) if len(forward) > 1 else None}


# ============================================================================ the run
@dataclass(frozen=True)
class Run(runs.Run):
    """The layer (width `hidden`, experts of width `ffn`, experts_per_rank on each rank, top_k of
    them per token, capacity_factor None: no capacity) and each rank's batch of `tokens` tokens
    (`shift`: how far their mean is from 0); lab 11's expert-balance lab extends it."""
    hidden: int = 64
    ffn: int = 128
    experts_per_rank: int = 2
    top_k: int = 2
    tokens: int = 256
    capacity_factor: float | None = None
    shift: float = 2.0
    SMOKE = dict(hidden=16, ffn=32, tokens=24)


def default_sizes() -> dict:
    """The layer and the batch of this mode's preset (Run.preset())."""
    return Run.preset().values()


def run(ctx: DistContext, cfg: Run) -> dict:
    """Everything the notebook shows of the layer, on this rank: the routing plan of this run's batch
    (every rank's tokens, routed in one process), then, once the homework is written, the
    expert-parallel layer against the dense one with a balanced and a skewed router (outputs,
    gradients, bytes counted against the formula, rows per expert)."""
    s = cfg.values()
    n = ctx.world_size
    moe = make_moe(s["hidden"], s["ffn"], s["experts_per_rank"] * n, s["top_k"], s["capacity_factor"])
    xs = [sample_tokens(s["tokens"], s["hidden"], seed=100 + r, shift=s["shift"]) for r in range(n)]
    return {"sizes": s, "world_size": n,
            "plan": routing_plan(moe, xs, n),
            "check": attempt(ep_check, ctx.device, s),
            "check_skewed": attempt(ep_check, ctx.device, s, skew=4.0)}


# ============================================================================ what the notebook shows
def plan_summary(report: dict) -> Shown:
    """Rank 0's report: this run's batch routed on paper, rows each rank sends each rank, against
    balanced routing's T k (N-1)/N."""
    s, plan = report["sizes"], report["plan"]
    n = report["world_size"]
    rows = [{"from rank": i, **{f"to rank {j}": r for j, r in enumerate(row)}, "sent to other ranks": sum(row) - row[i]}
            for i, row in enumerate(plan["splits"])]
    sent = [sum(row) - row[i] for i, row in enumerate(plan["splits"])]
    return Shown(f"this run's batch, routed on paper (routing_plan): rows each rank sends to each rank, "
                 f"{s['tokens']} tokens per rank", rows,
                 [f"balanced routing would send T k (N-1)/N = {s['tokens'] * s['top_k'] * (n - 1) / n:.0f} rows to "
                  f"other ranks; this batch sends {sent} (max/mean rows received per rank: {plan['rank_imbalance']:.2f})"])


def _checks(reports: list[dict]) -> list[dict[str, dict]]:
    return [{"balanced": solved(rep["check"]), "tilted": solved(rep["check_skewed"])} for rep in reports]


def rows_verdict(per_expert: list[dict]) -> str:
    """From each rank's `rows_per_expert`: did every expert run on exactly its routed rows, once?"""
    if any(r["ran on"] != r["routed"] for r in per_expert):
        return "some expert ran on rows that were not routed to it"
    if any(c > 1 for r in per_expert for c in r["calls"]):
        return "every expert ran on exactly the rows routed to it, but some in several calls"
    return "every expert ran on exactly the rows routed to it, in one call"


def check_summary(reports: list[dict]) -> Shown:
    """Every rank's report: the layer against the dense one, both routers (raises Unsolved while
    the homework is a stub)."""
    checks = _checks(reports)
    rows = [{"rank": r, "router": name, **{f"|{k}|": v for k, v in c["diffs"].items()}, "rows received": c["rows_received"],
             "its experts": c["rows_per_expert"]["experts"], "rows they ran on": c["rows_per_expert"]["ran on"],
             "calls": c["rows_per_expert"]["calls"], "rows routed to them": c["rows_per_expert"]["routed"]}
            for r, cs in enumerate(checks) for name, c in cs.items()]
    worst = max(c["worst"] for cs in checks for c in cs.values())
    kinds = sorted({k for cs in checks for c in cs.values() for k in c["collectives"]})
    return Shown(f"ExpertParallelMoE vs the dense MoE on one process, float64, {len(reports)} ranks: largest differences",
                 rows, [f"largest difference {worst:.1e}: " + ("rounding (float64)" if worst < 1e-9 else "MORE than rounding"),
                        rows_verdict([c["rows_per_expert"] for cs in checks for c in cs.values()]),
                        f"collectives in the forward: {kinds}"])


def bytes_summary(reports: list[dict]) -> Shown:
    """Bytes each rank sent to the others, counted at the process group, against `all_to_all_bytes`."""
    checks = _checks(reports)
    s, n = reports[0]["sizes"], len(reports)
    rows = [{"rank": r, **b} for r, cs in enumerate(checks) for b in cs["tilted"]["bytes"]]
    same = all(b["counted"] == b["formula"] for cs in checks for c in cs.values() for b in c["bytes"])
    dispatch = [next(b["counted"] for b in cs["tilted"]["bytes"] if b["phase"] == "forward" and b["all-to-all"] == "dispatch")
                for cs in checks]
    even = s["tokens"] * s["top_k"] * (n - 1) / n * s["hidden"] * 8
    return Shown(f"bytes sent to other ranks, tilted router, {n} ranks: counted vs all_to_all_bytes", rows, [
        "counted bytes " + ("equal the formula on every rank, for both routers" if same else "DIFFER from the formula (see the table)"),
        f"dispatch bytes per rank with the tilted router: {dispatch}; balanced routing: T k (N-1)/N h 8 = {even:.0f}"])


def small_demo() -> Shown:
    """Eight tokens through a small layer (4 experts, top-2) in this process: each token's experts and
    gates, the load per expert, the layer against its definition token by token, the share of the
    parameters one token uses."""
    small = make_moe(16, 32, 4, 2, dtype=torch.float64)
    x8 = sample_tokens(8, 16, seed=0, dtype=torch.float64)
    r8 = small.route(x8)
    rows = [{"token": t, "experts (best first)": r8.experts[t].tolist(),
             "their probabilities": [round(p, 3) for p in r8.probs[t, r8.experts[t]].tolist()],
             "gates": [round(g, 3) for g in r8.weights[t].tolist()]} for t in range(len(x8))]
    by_token = torch.stack([sum(g * small.experts[int(e)](x8[t]) for e, g in zip(r8.experts[t], r8.weights[t]))
                            for t in range(len(x8))])
    total = sum(p.numel() for p in small.parameters())
    active = small.router.weight.numel() + small.top_k * sum(p.numel() for p in small.experts[0].parameters())
    return Shown("top-2 routing of 8 tokens over 4 experts (one process)", rows, [
        f"tokens per expert: {r8.tokens_per_expert.tolist()} (8 tokens x 2 choices = {int(r8.tokens_per_expert.sum())} rows)",
        f"the layer against the gated sum over each token's experts: largest difference "
        f"{(small(x8) - by_token).abs().max().item():.1e}",
        f"parameters: {total}; one token uses the router and {small.top_k} experts: {active} ({active / total:.0%})"])


def draw_routing(n: int, per: int, top_k: int, skew: float, capacity_factor: float | None, tokens: int):
    """The routing explorer's picture for a batch routed on paper: each rank's choices coloured by the
    expert's owner, the split matrix, and the load per expert (with N x capacity). Returns
    (figure, text); the figure is about 850 px wide at 90 dpi."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    num_experts = n * per
    k = min(top_k, num_experts)
    p = routing_plan(skew_router(make_moe(16, 16, num_experts, k, capacity_factor), skew),
                     [sample_tokens(tokens, 16, seed=100 + r, shift=2.0) for r in range(n)], n)
    grid = torch.full((n * k, tokens), -1)
    for c in p["choices"]:
        if c["kept"]:
            grid[c["rank"] * k + c["choice"], c["token"]] = c["owner"]
    colours = [plt.get_cmap("tab10")(r % 10) for r in range(n)]
    fig = plt.figure(figsize=(9.4, 6.6))
    left, middle, right = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 2, 3), fig.add_subplot(2, 2, 4)
    left.imshow(grid, cmap=ListedColormap(["lightgray", *colours]), vmin=-1, vmax=n - 1, aspect="auto",
                interpolation="nearest")
    if tokens * n * k <= 128:
        for c in p["choices"]:
            left.text(c["token"], c["rank"] * k + c["choice"], str(c["expert"]), ha="center", va="center", fontsize=7)
    left.set(yticks=[r * k + (k - 1) / 2 for r in range(n)], yticklabels=[f"rank {r}" for r in range(n)],
             xlabel="token (on its rank)", title="each choice's expert, coloured by its rank (grey: dropped)")
    for r in range(1, n):
        left.axhline(r * k - 0.5, color="white", linewidth=2)
    splits = torch.tensor(p["splits"])
    middle.imshow(splits, cmap="Blues")
    for i in range(n):
        for j in range(n):
            middle.text(j, i, str(p["splits"][i][j]), ha="center", va="center", fontsize=8,
                        color="white" if splits[i, j] > 0.6 * splits.max() else "black")
    middle.set(xticks=range(n), yticks=range(n), xlabel="to rank j", ylabel="from rank i", title="rows rank i sends rank j")
    right.bar(range(num_experts), p["tokens_per_expert"], color=[colours[e // per] for e in range(num_experts)])
    capacity = expert_capacity(tokens, k, num_experts, capacity_factor)   # per rank's batch
    if capacity is not None:
        right.axhline(n * capacity, color="tab:red", linestyle="--", linewidth=1, label=f"N x capacity: {n} x {capacity}")
        right.legend(fontsize=8)
    right.axhline(sum(p["tokens_per_expert"]) / num_experts, color="gray", linestyle=":", linewidth=1)
    right.xaxis.get_major_locator().set_params(integer=True)   # expert ids, never 0.5
    right.set(xlabel="expert (colour: its rank)", ylabel="rows (all ranks' tokens)", title="load per expert (dotted: mean)")
    fig.tight_layout()
    rank0 = all_to_all_bytes(p["splits"], 0, 4096 * 2, num_experts)
    return fig, (f"rows received per rank {p['rows_per_rank']}: the busiest rank gets {p['rank_imbalance']:.2f}x the mean; "
                 f"the busiest expert {p['expert_imbalance']:.2f}x; dropped {p['dropped']} of {len(p['choices'])} "
                 f"assignments.\nrank 0 with rows of 4096 bf16 values: dispatch {rank0['forward']['dispatch'] / 1e6:.2f} MB, "
                 f"combine {rank0['forward']['combine'] / 1e6:.2f} MB sent in the forward (balanced: "
                 f"{tokens * k * (n - 1) / n * 4096 * 2 / 1e6:.2f} MB each)")


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        result = run(ctx, cfg)
        ctx.report(**result)
        reports = [None] * ctx.world_size
        dist.all_gather_object(reports, result)
        if ctx.rank == 0:
            plan_summary(result).show()
            if "unsolved" not in result["check"]:
                check_summary(reports).show(floatfmt=".1e")
                bytes_summary(reports).show()
        if "unsolved" not in result["check"]:
            worst = max(result[name]["worst"] for name in ("check", "check_skewed"))
            if not worst < 1e-9:
                raise RuntimeError(f"rank {ctx.rank}: the expert-parallel layer differs from the dense one by {worst:.2e}")


if __name__ == "__main__":
    main()
