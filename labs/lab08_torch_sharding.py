"""Lab 08 (what torch ships): FSDP2's `fully_shard` and `ZeroRedundancyOptimizer` on the model of
labs/lab08_zero.py, checked against one process and against the hand-built ZeRO-3 and ZeRO-1,
with memory and collectives counted the same way.

Run:  ./run.sh 08      (this file alone: ./run.sh labs/lab08_torch_sharding.py)

- FSDP2, `torch.distributed.fsdp.fully_shard` (PyTorch docs, "torch.distributed.fsdp.fully_shard";
  Zhao et al. 2023, "PyTorch FSDP", arXiv:2304.11277): every parameter becomes a DTensor sharded
  on dim 0 over the ranks; `fully_shard(block)` makes each block a unit whose parameters are
  all-gathered together before its forward and its backward and freed after, and whose gradients
  are reduce-scattered; `fully_shard(model)` wraps the root. That is ZeRO-3, with one difference
  in layout: each parameter is split along its first dimension instead of one flat vector.
- `torch.distributed.optim.ZeroRedundancyOptimizer`: ZeRO-1 as an optimizer wrapper. Each rank
  owns whole parameters (assigned greedily, largest first, to the least-loaded rank), keeps the
  optimizer state of those only, steps them, then broadcasts each one from its owner. Gradients
  arrive already averaged, here by DDP's all-reduce.
- FSDP2's CPU offload (`CPUOffloadPolicy`) keeps the sharded parameters, gradients and optimizer
  step on the CPU and copies parameters to the accelerator for each use: on a CPU-only machine
  there is nothing to offload from, and torch refuses. The lab tries it and reports what happened.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import runs
from helpers.accounting import held_bytes
from helpers.comm_count import count_collectives, summarize
from helpers.dist import DistContext, distributed
from helpers.show import table
from helpers.tensors import ddp_device_ids
from labs.lab08_zero import (LR, PARTS, PROBLEM_SMOKE, Problem, max_diff, model_state_bytes, my_rows,
                             optimizer_state_tensors, problem, run_stage, spread_over_ranks,
                             step_sent_bytes)


def train_fsdp2(model: nn.Sequential, batches: list, device: torch.device) -> dict:
    """`fully_shard` each block and the root, train with Adam; count the last step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = copy.deepcopy(model).to(device)
    for block in model:
        fully_shard(block)  # one unit: its parameters are gathered and freed together
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)  # on the shards (DTensors)
    for x, y in batches:
        with count_collectives() as log:
            optimizer.zero_grad()
            F.mse_loss(model(my_rows(x, rank, world_size).to(device)),
                       my_rows(y, rank, world_size).to(device)).backward()
            optimizer.step()
    held = held_bytes({"parameters": model.parameters(),  # the gradients live until zero_grad()
                       "gradients": [p.grad for p in model.parameters()],
                       "optimizer state": optimizer_state_tensors(optimizer)})
    params = [p.full_tensor().detach() for p in model.parameters()]  # all-gathers: every rank
    return {"params": params, "held": held, "collectives": summarize(log),
            "shard_shapes": {name: list(p.to_local().shape) for name, p in model.named_parameters()}}


def train_zero_redundancy(model: nn.Sequential, batches: list, device: torch.device) -> dict:
    """DDP + ZeroRedundancyOptimizer(Adam); count the last step's collectives."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ddp = DDP(copy.deepcopy(model).to(device), device_ids=ddp_device_ids(device))
    # DDP's C++ reducer all-reduces out of Python's sight; torch's own hook does the same
    # all-reduce (then divides) through torch.distributed, where count_collectives sees it.
    ddp.register_comm_hook(None, allreduce_hook)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    for x, y in batches:
        with count_collectives() as log:
            optimizer.zero_grad()
            F.mse_loss(ddp(my_rows(x, rank, world_size).to(device)),
                       my_rows(y, rank, world_size).to(device)).backward()
            optimizer.step()
    owned = [p for group in optimizer.optim.param_groups for p in group["params"]]
    held = held_bytes({"parameters": ddp.parameters(), "gradients": [p.grad for p in ddp.parameters()],
                       "optimizer state": optimizer_state_tensors(optimizer.optim)})
    return {"params": [p.detach().clone() for p in ddp.parameters()], "held": held,
            "collectives": summarize(log), "owned_numel": sum(p.numel() for p in owned),
            "optimizer": optimizer, "model": ddp.module}


def cpu_offload_probe(device: torch.device) -> dict:
    """Try FSDP2 with CPUOffloadPolicy on a tiny layer: report where the shards live, or torch's
    error. Every rank calls it (fully_shard's first forward all-gathers)."""
    layer = nn.Linear(8, 8).to(device)
    try:
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
        layer(torch.randn(2, 8, device=device)).sum().backward()
    except Exception as exc:  # whatever torch says, it is the answer we report
        return {"ran": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
    return {"ran": True, "shard_device": str(layer.weight.to_local().device),
            "compute_device": str(device)}


@dataclass(frozen=True)
class Run(runs.Run, Problem):
    """Lab 08's problem (labs/lab08_zero.py)."""
    SMOKE = PROBLEM_SMOKE


def run(ctx: DistContext, cfg: Run) -> dict:
    model, batches, reference, shape = problem(cfg)
    num_params = sum(p.numel() for p in reference)
    n = ctx.world_size
    out = {"num_params": num_params, "world_size": n, "width": shape["width"],
           "depth": shape["depth"]}

    hand = {stage: run_stage(stage, model, batches, reference, ctx.device, keep_params=True)
            for stage in (1, 3)}
    fsdp = train_fsdp2(model, batches, ctx.device)
    out["fsdp2"] = {"held": fsdp["held"], "collectives": fsdp["collectives"],
                    "shard_shapes": fsdp["shard_shapes"],
                    "formula": model_state_bytes(num_params, n, 3),
                    "sent_formula": step_sent_bytes(num_params, n, 3),
                    "max_diff_vs_one_process": max_diff(fsdp["params"], reference),
                    "max_diff_vs_hand_zero3": max_diff(fsdp["params"], hand[3]["params"]),
                    "max_diff_across_ranks": spread_over_ranks(fsdp["params"])}
    zro = train_zero_redundancy(model, batches, ctx.device)
    out["zero_redundancy"] = {"held": zro["held"], "collectives": zro["collectives"],
                              "owned_numel": zro["owned_numel"],
                              "formula": model_state_bytes(num_params, n, 1),
                              "max_diff_vs_one_process": max_diff(zro["params"], reference),
                              "max_diff_vs_hand_zero1": max_diff(zro["params"], hand[1]["params"]),
                              "max_diff_across_ranks": spread_over_ranks(zro["params"])}
    for stage in (1, 3):
        hand[stage].pop("params")
    out["hand"] = {f"zero{stage}": hand[stage] for stage in (1, 3)}
    out["cpu_offload"] = cpu_offload_probe(ctx.device)
    ctx.report(**out)
    return out


def comparison_rows(out: dict) -> list[dict]:
    """Memory held per rank and bytes sent per step: torch's implementations next to ours."""
    pairs = (("ZeRO-1 by hand", out["hand"]["zero1"]),
             ("ZeroRedundancyOptimizer", out["zero_redundancy"]),
             ("ZeRO-3 by hand", out["hand"]["zero3"]), ("FSDP2 fully_shard", out["fsdp2"]))
    rows = []
    for name, r in pairs:
        rows.append({"implementation": name,
                     **{f"{k} MiB": r["held"][k] / 2**20 for k in PARTS},
                     "formula MiB": r["formula"]["total"] / 2**20,
                     "collectives seen": ", ".join(f"{kind} x{count}" for kind, count
                                                   in r["collectives"]["calls"].items()),
                     "sent MiB/step (seen)": r["collectives"]["sent_bytes"] / 2**20,
                     "max diff vs 1 process": r["max_diff_vs_one_process"]})
    return rows


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        out = run(ctx, cfg)
        if ctx.rank == 0:
            table(comparison_rows(out), floatfmt=".3g", title=f"torch's ZeRO vs ours on "
                  f"{ctx.world_size} ranks, {out['num_params']:,} parameters (per rank)")
            print(f"FSDP2 vs hand-built ZeRO-3: max |param diff| "
                  f"{out['fsdp2']['max_diff_vs_hand_zero3']:.2g}; ZeroRedundancyOptimizer vs "
                  f"hand-built ZeRO-1: {out['zero_redundancy']['max_diff_vs_hand_zero1']:.2g}")
            probe = out["cpu_offload"]
            print("FSDP2 CPU offload: " + (f"shards on {probe['shard_device']}, compute on "
                                           f"{probe['compute_device']}" if probe["ran"]
                                           else f"not available here ({probe['error']})"))


if __name__ == "__main__":
    main()
