"""Lab 11 (expert balance): where the tokens go when the router is uneven, what the load-balancing
loss does about it, and expert parallelism combined with data parallelism.

Run:  ./run.sh 11      (this file alone: ./run.sh labs/lab11_expert_balance.py; 2-4 ranks)

Built on the layer of labs/lab11_experts.py (MoE, ExpertParallelMoE, routing_plan):
- `skew_table`: the routing of the same tokens for routers tilted more and more towards expert 0
  (`skew_router`): tokens per expert and rows per rank, with their max/mean, on paper;
- `capacity_table`: assignments dropped for capacity factors 0.5 to 2, balanced and skewed
  (Switch Transformer's expert capacity, Fedus et al. 2021, arXiv:2101.03961);
- `aux_loss_training`: a skewed MoE trained for a few dozen Adam steps with and without Switch's
  auxiliary loss (eq. 4, coefficient 1e-2): the max/mean load per step (rank 0 trains, in one
  process);
- `skewed_timing`: the expert-parallel layer's forward + backward with a balanced and a skewed
  router: rows each rank received and the seconds its experts took (needs the homework,
  `ExpertParallelMoE.forward`);
- `ep_dp_check`: every (dp, ep) layout of the ranks (experts sharded over the ep group, replicated
  over the dp group; the router everywhere) trained one SGD step against one process, with the
  gradients all-reduced over the right groups (`sync_gradients`; needs the homework).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers import pick
from helpers.comm_count import count_collectives
from helpers.dist import DistContext, device_mesh, distributed, synchronize
from helpers.notice import attempt, solved
from helpers.tensors import divide, seeded
from labs.lab11_expert_check import default_sizes, rows_seen
from labs.lab11_experts import (
    Expert, ExpertParallelMoE, expert_capacity, imbalance, make_moe, routing_plan, sample_tokens, skew_router,
)
from labs.lab11_results import Shown, median_and_noise


# ============================================================================ imbalance
def skew_table(sizes: dict, world_size: int, strengths=(0.0, 1.0, 4.0)) -> list[dict]:
    """The routing of this run's tokens for routers tilted more and more towards expert 0: tokens
    per expert, rows per rank, their max/mean (on paper: `routing_plan`, no communication)."""
    s = sizes
    rows = []
    for strength in strengths:
        moe = skew_router(make_moe(s["hidden"], s["ffn"], s["experts_per_rank"] * world_size, s["top_k"]),
                          strength)
        xs = [sample_tokens(s["tokens"], s["hidden"], seed=100 + r, shift=s["shift"]) for r in range(world_size)]
        plan = routing_plan(moe, xs, world_size)
        rows.append({"skew": strength, "tokens per expert": plan["tokens_per_expert"],
                     "rows per rank": plan["rows_per_rank"], "expert max/mean": plan["expert_imbalance"],
                     "rank max/mean": plan["rank_imbalance"], "splits": plan["splits"]})
    return rows


def capacity_table(sizes: dict, world_size: int, factors=(0.5, 1.0, 1.25, 2.0), skews=(0.0, 4.0)) -> list[dict]:
    """Dropped assignments for capacity factors, with a balanced and a skewed router (one process)."""
    s = sizes
    x = sample_tokens(s["tokens"], s["hidden"], seed=100, shift=s["shift"])
    rows = []
    for skew in skews:
        for factor in factors:
            moe = skew_router(make_moe(s["hidden"], s["ffn"], s["experts_per_rank"] * world_size, s["top_k"],
                                       factor), skew)
            with torch.no_grad():
                moe(x)
            cap = expert_capacity(len(x), moe.top_k, moe.num_experts, factor)
            rows.append({"skew": skew, "capacity factor": factor, "capacity": cap,
                         "dropped": moe.dropped, "dropped %": 100 * moe.dropped / (len(x) * moe.top_k),
                         "kept per expert": moe.tokens_per_expert.tolist()})
    return rows


def aux_loss_training(sizes: dict, num_experts: int = 8, alphas=(0.0, 0.01), steps: int = 60,
                      skew: float = 4.0, lr: float = 1e-2, tokens: int = 256) -> dict:
    """Train a skewed MoE (one process, `tokens` fresh tokens per step) to imitate a fixed random
    MLP with Adam, loss = MSE + alpha * aux (Switch used alpha = 1e-2), once per alpha; per step:
    max/mean tokens per expert, the task loss and the aux loss."""
    s = {**sizes, "tokens": tokens}
    with seeded(7):
        teacher = Expert(s["hidden"], s["ffn"])
    out = {"steps": steps, "skew": skew, "lr": lr, "top_k": s["top_k"], "num_experts": num_experts, "runs": {}}
    for alpha in alphas:
        moe = skew_router(make_moe(s["hidden"], s["ffn"], num_experts, s["top_k"], seed=1), skew)
        opt = torch.optim.Adam(moe.parameters(), lr=lr)
        run = {"imbalance": [], "task_loss": [], "aux_loss": []}
        for step in range(steps):
            x = sample_tokens(s["tokens"], s["hidden"], seed=1000 + step, shift=s["shift"])
            with torch.no_grad():
                target = teacher(x)
            task = F.mse_loss(moe(x), target)
            loss = task + alpha * moe.aux_loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            run["imbalance"].append(imbalance(moe.tokens_per_expert.tolist()))
            run["task_loss"].append(task.item())
            run["aux_loss"].append(moe.aux_loss.item())
        out["runs"][str(alpha)] = run
    return out


def skewed_timing(device: torch.device, sizes: dict, skew: float, repeats: int, group=None) -> dict:
    """Expert-parallel forward + backward with a router of `skew` (float32): rows this rank
    received, and per repeat the seconds its experts took in the forward and the whole call; the
    most loaded rank sets the pace, since every rank waits for it in the combine."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    s = sizes
    dense = make_moe(s["hidden"], s["ffn"], s["experts_per_rank"] * n, s["top_k"], device=device)
    skew_router(dense, skew)
    layer = ExpertParallelMoE.from_dense(dense, group)
    x = sample_tokens(s["tokens"], s["hidden"], seed=100 + rank, shift=s["shift"], device=device)
    busy = [0.0]

    def start(_m, _inputs):
        synchronize(device)                           # CUDA runs asynchronously: time finished work
        busy.append(-time.perf_counter())

    def stop(_m, _inputs, _out):
        synchronize(device)
        busy.append(busy.pop() + time.perf_counter())
    handles = [h for e in layer.experts
               for h in (e.register_forward_pre_hook(start), e.register_forward_hook(stop))]
    out = {"rows": 0, "expert_forward_s": [], "wall_s": []}
    try:
        for _ in range(repeats):
            busy[:] = [0.0]
            dist.barrier(group=group)
            begin = time.perf_counter()
            with rows_seen(layer) as rows:
                layer(x).sum().backward()
            synchronize(device)
            out["wall_s"].append(time.perf_counter() - begin)
            out["expert_forward_s"].append(sum(busy))
            out["rows"] = sum(rows)
    finally:
        for h in handles:
            h.remove()
    return out


# ============================================================================ expert x data parallel
def ep_dp_groups(device: torch.device, ep_size: int):
    """(ep group, dp group) of a (dp, ep) mesh over every rank: rank = dp_rank * ep + ep_rank; the ep
    group shares one set of experts between it, the dp group holds the same experts."""
    dp_size = divide(dist.get_world_size(), ep_size, "the ranks over the expert-parallel groups")
    mesh = device_mesh(device.type, dp=dp_size, ep=ep_size)
    return mesh.get_group("ep"), mesh.get_group("dp")


def sync_gradients(layer: ExpertParallelMoE, dp_group, world_size: int) -> list[dict]:
    """Data parallelism over an expert-parallel layer: each gradient summed over the ranks that hold
    the same parameter, then divided by the world size (the loss is the mean over every rank's).
    - experts: the backward's all-to-all already summed the ep group's tokens on the owner; the
      other ranks holding these experts are the dp group: all-reduce over it;
    - router: a copy on every rank, each with its own tokens: all-reduce over every rank.
    Returns what went where: parameter, group ranks, bytes."""
    done = []
    for what, params, group in (("experts", list(layer.experts.parameters()), dp_group),
                                ("router", list(layer.router.parameters()), None)):
        flat = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in params])
        dist.all_reduce(flat, group=group)                    # one call per group: one flat buffer
        flat /= world_size
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad = g.view_as(p).clone()
        done.append({"parameters": what, "all-reduced over ranks": dist.get_process_group_ranks(group)
                     if group is not None else list(range(world_size)), "bytes": flat.nbytes})
    return done


def ep_dp_check(device: torch.device, sizes: dict, ep_size: int, lr: float = 0.1, sync=sync_gradients) -> dict:
    """One SGD step of a (dp, ep) layout against one process training the dense layer on every
    rank's tokens (loss: the mean over ranks of MSE + 0.01 aux, float64): parameters after the
    step, and which gradients went over which group (`sync`: how the gradients are reduced)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    s = sizes
    ep_group, dp_group = ep_dp_groups(device, ep_size)
    dense = make_moe(s["hidden"], s["ffn"], s["experts_per_rank"] * ep_size, s["top_k"],
                     dtype=torch.float64, device=device)
    xs = [sample_tokens(s["tokens"], s["hidden"], seed=100 + r, shift=s["shift"], dtype=torch.float64,
                        device=device) for r in range(world)]
    targets = [sample_tokens(s["tokens"], s["hidden"], seed=300 + r, dtype=torch.float64, device=device)
               for r in range(world)]
    layer = ExpertParallelMoE.from_dense(dense, ep_group)

    def loss_of(model, x, target):
        return F.mse_loss(model(x), target) + 0.01 * model.aux_loss

    loss_of(layer, xs[rank], targets[rank]).backward()
    with count_collectives() as log:
        groups = sync(layer, dp_group, world)
    torch.optim.SGD(layer.parameters(), lr=lr).step()
    (sum(loss_of(dense, x, t) for x, t in zip(xs, targets)) / world).backward()   # one process
    torch.optim.SGD(dense.parameters(), lr=lr).step()
    diffs = {"router": (layer.router.weight - dense.router.weight).abs().max().item()}
    for j, expert in enumerate(layer.experts):
        twin = dense.experts[layer.first_expert + j]
        diffs[f"expert {layer.first_expert + j}"] = max((a - b).abs().max().item() for a, b in
                                                        zip(expert.parameters(), twin.parameters()))
    return {"ep": ep_size, "dp": world // ep_size, "ep_group": dist.get_process_group_ranks(ep_group),
            "dp_group": dist.get_process_group_ranks(dp_group), "groups": groups,
            "all_reduces": [(c.kind, c.world_size, c.nbytes) for c in log], "diffs": diffs,
            "worst": max(diffs.values())}


# ============================================================================ the run
def run(ctx: DistContext, **sizes) -> dict:
    """Everything the notebook shows of the balance, on this rank: the skew and capacity tables,
    the aux-loss training (rank 0), then, once the homework is written, the time a skewed router
    costs and every (dp, ep) layout of the ranks against one process."""
    s = {**default_sizes(), **sizes}
    n = ctx.world_size
    timing_sizes = {**s, "tokens": pick(2048, 64)}
    layouts = [ep for ep in range(1, n + 1) if n % ep == 0]
    return {"sizes": s, "world_size": n,
            "skew": skew_table(s, n), "capacity": capacity_table(s, n),
            "training": aux_loss_training(s) if ctx.rank == 0 else None,
            "timing": {str(skew): attempt(skewed_timing, ctx.device, timing_sizes, skew, pick(5, 3))
                       for skew in (0.0, 4.0)},
            "ep_dp": {f"dp{n // ep} x ep{ep}": attempt(ep_dp_check, ctx.device, s, ep) for ep in layouts}}


# ============================================================================ what the notebook shows
def aux_loss_table(tokens: int = 64, hidden: int = 16, experts: int = 4) -> Shown:
    """Switch's loss on `tokens` tokens for routers from uniform to one that sends every token to
    expert 0 (top-1 and top-2), measured in this process, and which way a descent step on it moves
    the tilted router's logits."""
    from labs.lab11_experts import route

    x = sample_tokens(tokens, hidden, seed=1, shift=2.0, dtype=torch.float64)
    uniform = make_moe(hidden, 32, experts, 2, dtype=torch.float64)
    with torch.no_grad():
        uniform.router.weight.zero_()
    routers = {"weights zero: uniform probabilities": uniform,
               "random": make_moe(hidden, 32, experts, 2, dtype=torch.float64),
               "tilted towards expert 0": skew_router(make_moe(hidden, 32, experts, 2, dtype=torch.float64), 4.0)}
    for k in (1, 2):   # tokens far along the shared direction, expert 0 tilted hard along it: p_0 = 1
        routers[f"everything to expert 0, top-{k}"] = skew_router(make_moe(hidden, 32, experts, k, dtype=torch.float64), 1e4)
    far = sample_tokens(tokens, hidden, seed=1, shift=5.0, dtype=torch.float64)
    rows = []
    for name, m in routers.items():
        r = m.route(far if name.startswith("everything") else x)
        rows.append({"router": name, "top-k": m.top_k, "tokens per expert": r.tokens_per_expert.tolist(),
                     "f": [round(f, 3) for f in (r.tokens_per_expert / r.tokens_per_expert.sum()).tolist()],
                     "P": [round(p, 3) for p in r.probs.mean(0).tolist()], "aux loss": r.aux_loss.item(),
                     "E/k": experts / m.top_k})
    tilted = routers["tilted towards expert 0"]
    logits = tilted.router(x).detach().requires_grad_(True)
    r = route(lambda _: logits, x, tilted.top_k)                      # the same routing, from these logits
    (grad,) = torch.autograd.grad(r.aux_loss, logits)
    push = (-grad.sum(0)).tolist()       # a descent step's move of each expert's logit, summed over tokens
    return Shown(f"Switch's load-balancing loss on {tokens} tokens, {experts} experts (one process)", rows, [
        f"uniform probabilities give {rows[0]['aux loss']:.4f} (1 by the formula, whatever the top-k picks: f = {rows[0]['f']})",
        ceiling_verdict(rows[-2]["aux loss"], experts, 1) + "; " + ceiling_verdict(rows[-1]["aux loss"], experts, 2),
        f"tilted router: a descent step on the aux loss moves the experts' logits by {[f'{v:+.3f}' for v in push]} "
        "(per unit of learning rate, summed over the tokens): " + push_verdict(push, int(r.tokens_per_expert.argmax()))])


def ceiling_verdict(aux: float, experts: int, top_k: int, rtol: float = 0.02) -> str:
    """The loss of a router that sends every token's first choice to one expert against E/k."""
    bound = experts / top_k
    return (f"one expert taking every token, top-{top_k}: {aux:.3f}, "
            + (f"E/k = {bound:g}, the most it can be" if abs(aux - bound) <= rtol * bound else f"NOT E/k = {bound:g}"))


def push_verdict(push: list[float], crowded: int) -> str:
    others = [v for e, v in enumerate(push) if e != crowded]
    return (f"down for the crowded expert {crowded}, up for the others" if push[crowded] < 0 < min(others)
            else "NOT down for the crowded expert and up for the others on this run")


def capacity_summary(report: dict) -> Shown:
    cap, s, n = report["capacity"], report["sizes"], report["world_size"]
    lines = []
    for skew in sorted({r["skew"] for r in cap}):
        none_from = next((r["capacity factor"] for r in cap if r["skew"] == skew and r["dropped"] == 0), None)
        lines.append(f"router skew {skew}: " + (f"nothing dropped from capacity factor {none_from} on"
                                                if none_from is not None else "assignments dropped at every factor of the table"))
    pairs = [(a, b) for a in cap if a["skew"] > 0 for b in cap if b["skew"] == 0 and b["capacity factor"] == a["capacity factor"]]
    lines.append("the tilted router drops at least as many as the balanced one at every factor"
                 if all(a["dropped"] >= b["dropped"] for a, b in pairs)
                 else "not on this run: at some factor the tilted router drops fewer than the balanced one")
    return Shown(f"dropped (token, expert) assignments, {s['tokens']} tokens, top-{s['top_k']} of "
                 f"{s['experts_per_rank'] * n} experts (one process)", cap, lines)


def skew_summary(report: dict) -> Shown:
    rows, s = report["skew"], report["sizes"]
    e = s["experts_per_rank"] * report["world_size"]
    flat, steep = rows[0], rows[-1]
    return Shown(f"a router tilted towards expert 0: {s['tokens']} tokens per rank, top-{s['top_k']} of {e} experts on "
                 f"{report['world_size']} ranks", [{k: v for k, v in row.items() if k != "splits"} for row in rows],
                 [f"from skew {flat['skew']} to {steep['skew']}: the busiest expert went from {flat['expert max/mean']:.2f}x "
                  f"to {steep['expert max/mean']:.2f}x the mean load (at most E/k = {e / s['top_k']:.0f}x), the busiest rank "
                  f"from {flat['rank max/mean']:.2f}x to {steep['rank max/mean']:.2f}x the mean rows"])


def load_verdict(rows: list[int], seconds: list[list[float]]) -> str:
    """Per rank its rows and its repeated seconds in the experts: did the time follow the rows, and
    is the spread of times more than the repeats' own noise?"""
    medians, noises = zip(*(median_and_noise(t) for t in seconds))
    spread, noise = max(medians) - min(medians), max(noises)
    rows_ratio, time_ratio = imbalance(rows), imbalance(medians)
    if spread <= 2 * noise:
        return (f"rows {rows_ratio:.2f}x the mean, time {time_ratio:.2f}x: the spread of times is within the repeats' "
                f"noise ({1e3 * noise:.2g} ms): noise")
    if rows_ratio <= 1.1:
        return (f"rows even, yet the time spread ({time_ratio:.2f}x) exceeds the noise: the machine (other processes on "
                "its cores), not the routing")
    busiest, slowest = max(range(len(rows)), key=rows.__getitem__), max(range(len(medians)), key=medians.__getitem__)
    return (f"rows {rows_ratio:.2f}x, time {time_ratio:.2f}x the mean, beyond the noise: "
            + ("the time followed the rows (the busiest rank was the slowest)" if busiest == slowest
               else f"NOT the rows: the busiest rank ({busiest}) was not the slowest ({slowest})"))


def timing_summary(reports: list[dict]) -> Shown:
    """Every rank's timing (raises Unsolved while the homework is a stub)."""
    timing = [{skew: solved(t) for skew, t in rep["timing"].items()} for rep in reports]
    rows = [{"router skew": float(skew), "rank": r, "rows its experts ran on": per[skew]["rows"],
             "ms in its experts (forward, median)": 1e3 * median_and_noise(per[skew]["expert_forward_s"])[0],
             "ms, whole call (median)": 1e3 * median_and_noise(per[skew]["wall_s"])[0]}
            for skew in timing[0] for r, per in enumerate(timing)]
    lines = [f"router skew {skew}: " + load_verdict([per[skew]["rows"] for per in timing],
                                                     [per[skew]["expert_forward_s"] for per in timing]) for skew in timing[0]]
    return Shown(f"expert-parallel forward + backward, float32, {len(reports)} ranks", rows, lines)


@dataclass(frozen=True)
class TrainingResult(Shown):
    curves: dict[str, dict[str, list[float]]]      # run label -> {"imbalance", "task_loss"} per step
    bound: float                                   # E/k


def training_result(training: dict) -> TrainingResult:
    """One row per aux-loss coefficient (the load and the losses at the first and last step), the
    verdicts, and the curves to draw."""
    rows, curves = [], {}
    for alpha, r in training["runs"].items():
        rows.append({"aux coefficient": float(alpha),
                     "max/mean tokens per expert, first step": r["imbalance"][0], "last step": r["imbalance"][-1],
                     "task loss first": r["task_loss"][0], "task loss last": r["task_loss"][-1],
                     "aux loss last": r["aux_loss"][-1]})
        label = "task loss only" if float(alpha) == 0 else f"task + {alpha} x aux loss"
        curves[label] = {"imbalance": r["imbalance"], "task_loss": r["task_loss"]}
    plain, aux = rows[0], rows[-1]
    bound = training["num_experts"] / training["top_k"]
    learnt = max(aux["task loss last"], plain["task loss last"]) < 0.5 * aux["task loss first"]
    return TrainingResult(
        f"{training['steps']} Adam steps (lr {training['lr']}), {training['num_experts']} experts, top-{training['top_k']}",
        rows, [f"last step: the busiest expert takes {aux['last step']:.2f}x the mean with the aux loss, "
               f"{plain['last step']:.2f}x without: " + ("the aux loss evened the load" if aux["last step"] < plain["last step"]
                                                          else "no evening on this run"),
               f"the aux loss without it ended at {plain['aux loss last']:.2f} (at most E/k = {bound:g})",
               f"the task loss fell from {aux['task loss first']:.3g} to {aux['task loss last']:.3g} with it and to "
               f"{plain['task loss last']:.3g} without" + (": the task was learnt in both runs" if learnt else
                                                           ": NOT learnt in both runs on this run")
               + f"; the last task loss with the aux loss is {aux['task loss last'] / plain['task loss last']:.2f}x the one without"],
        curves, bound)


def mesh_table(world: int = 8, ep: int = 4, experts: int = 8) -> Shown:
    """A (dp, ep) mesh on paper: each rank's experts and groups (rank = dp_rank * ep + ep_rank)."""
    rows = [{"rank": r, "dp rank": r // ep, "ep rank": r % ep,
             "experts it holds": list(range((r % ep) * experts // ep, (r % ep + 1) * experts // ep)),
             "ep group (exchanges tokens)": [r // ep * ep + e for e in range(ep)],
             "dp group (same experts: expert grads)": [d * ep + r % ep for d in range(world // ep)],
             "router grads over": f"all {world}"} for r in range(world)]
    return Shown(f"a (dp={world // ep}, ep={ep}) mesh of {world} ranks, {experts} experts", rows, [])


def ep_dp_summary(reports: list[dict]) -> Shown:
    """Every rank's (dp, ep) layouts against one process (raises Unsolved while the homework is a stub)."""
    layouts = [{name: solved(c) for name, c in rep["ep_dp"].items()} for rep in reports]
    rows = [{"rank": r, "layout": name, "ep group": c["ep_group"], "dp group": c["dp_group"],
             "all-reduces": ", ".join(f"{g['parameters']} over {g['all-reduced over ranks']} ({g['bytes']} B)" for g in c["groups"]),
             "max |param - one process| after the step": c["worst"]}
            for r, per in enumerate(layouts) for name, c in per.items()]
    worst = max(c["worst"] for per in layouts for c in per.values())
    return Shown(f"expert x data parallelism on {len(reports)} ranks: one SGD step against one process, float64", rows,
                 [f"largest difference {worst:.1e}: " + ("every layout trains as one process does (rounding)" if worst < 1e-9
                                                         else "MORE than rounding: a layout differs from one process")])


def main() -> None:
    with distributed() as ctx:
        result = run(ctx)
        ctx.report(**result)
        reports = [None] * ctx.world_size
        dist.all_gather_object(reports, result)
        if ctx.rank == 0:
            for shown in (skew_summary(result), capacity_summary(result), training_result(result["training"])):
                shown.show()
            if not any("unsolved" in t for t in result["timing"].values()):
                timing_summary(reports).show()
                ep_dp_summary(reports).show(floatfmt=".1e")
        if not any("unsolved" in c for c in result["ep_dp"].values()):
            worst = max(c["worst"] for c in result["ep_dp"].values())
            if not worst < 1e-9:
                raise RuntimeError(f"rank {ctx.rank}: a (dp, ep) layout differs from one process by {worst:.2e}")


if __name__ == "__main__":
    main()
