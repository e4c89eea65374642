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

import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers import pick
from helpers.comm_count import count_collectives
from helpers.dist import DistContext, distributed, synchronize
from helpers.notice import attempt
from helpers.show import table
from helpers.tensors import divide, seeded
from labs.lab11_experts import (
    Expert, ExpertParallelMoE, default_sizes, expert_capacity, imbalance, make_moe, routing_plan, rows_seen,
    sample_tokens, skew_router,
)


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
    received and the seconds its experts took (best of `repeats`); the most loaded rank sets the
    pace, since every rank waits for it in the combine."""
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
    best = None
    try:
        for _ in range(repeats):
            busy[:] = [0.0]
            dist.barrier(group=group)
            begin = time.perf_counter()
            with rows_seen(layer) as rows:
                layer(x).sum().backward()
            synchronize(device)
            wall = time.perf_counter() - begin
            if best is None or wall < best["wall_s"]:
                best = {"rows": sum(rows), "expert_forward_s": sum(busy), "wall_s": wall}
    finally:
        for h in handles:
            h.remove()
    return best


# ============================================================================ expert x data parallel
def ep_dp_groups(device: torch.device, ep_size: int):
    """(ep group, dp group) of a (dp, ep) mesh over every rank: rank = dp_rank * ep + ep_rank; the ep
    group shares one set of experts between it, the dp group holds the same experts."""
    from torch.distributed.device_mesh import init_device_mesh

    dp_size = divide(dist.get_world_size(), ep_size, "the ranks over the expert-parallel groups")
    mesh = init_device_mesh(device.type, (dp_size, ep_size), mesh_dim_names=("dp", "ep"))
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
            "timing": {str(skew): attempt(skewed_timing, ctx.device, timing_sizes, skew, pick(3, 1))
                       for skew in (0.0, 4.0)},
            "ep_dp": {f"dp{n // ep} x ep{ep}": attempt(ep_dp_check, ctx.device, s, ep) for ep in layouts}}


def training_summary(training: dict) -> list[dict]:
    """One row per aux-loss coefficient: the load and the losses at the first and last step."""
    rows = []
    for alpha, r in training["runs"].items():
        rows.append({"aux coefficient": float(alpha),
                     "max/mean tokens per expert, first step": r["imbalance"][0], "last step": r["imbalance"][-1],
                     "task loss first": r["task_loss"][0], "task loss last": r["task_loss"][-1],
                     "aux loss last": r["aux_loss"][-1]})
    return rows


def print_results(ctx: DistContext, result: dict) -> None:
    """run()'s tables on rank 0 (every rank must call it: it gathers the ranks' timings); raises if
    a (dp, ep) layout differs from one process."""
    n = ctx.world_size
    if ctx.rank == 0:
        table([{k: v for k, v in row.items() if k != "splits"} for row in result["skew"]],
              title="a router tilted towards expert 0: load per expert and per rank")
        table(result["capacity"], title="capacity factor and dropped (token, expert) assignments")
        rows = training_summary(result["training"])
        table(rows, title=f"{result['training']['steps']} Adam steps of a skewed MoE, with and without "
                          "the aux loss")
        plain, balanced = rows[0]["last step"], rows[-1]["last step"]
        print(f"with the aux loss the last step's max/mean load is {balanced:.2f} against {plain:.2f} "
              f"without: {'the aux loss evened the load' if balanced < plain else 'no evening on this run'}",
              flush=True)
    if any("unsolved" in t for t in result["timing"].values()):
        return
    gathered = [None] * n
    dist.all_gather_object(gathered, result["timing"])
    if ctx.rank == 0:
        table([{"rank": r, "skew": skew, **t} for r, g in enumerate(gathered) for skew, t in g.items()],
              title="forward + backward, float32: rows received and seconds in the experts per rank")
        for skew in result["timing"]:
            runs = [g[skew] for g in gathered]
            print(f"router skew {skew}: max/mean rows per rank {imbalance([t['rows'] for t in runs]):.2f}, "
                  f"max/mean seconds in the experts {imbalance([t['expert_forward_s'] for t in runs]):.2f} "
                  "(the most loaded rank sets the pace of the combine)", flush=True)
        table([{"layout": name, **{k: c[k] for k in ("ep_group", "dp_group", "worst")},
                "all-reduces": ", ".join(f"{g['parameters']} over {g['all-reduced over ranks']}"
                                         for g in c["groups"])}
               for name, c in result["ep_dp"].items()],
              title="expert x data parallel, one SGD step against one process (rank 0)")
    worst = max(c["worst"] for c in result["ep_dp"].values())
    if not worst < 1e-9:
        raise RuntimeError(f"rank {ctx.rank}: a (dp, ep) layout differs from one process by {worst:.2e}")


def main() -> None:
    with distributed() as ctx:
        result = run(ctx)
        ctx.report(**result)
        print_results(ctx, result)


if __name__ == "__main__":
    main()
