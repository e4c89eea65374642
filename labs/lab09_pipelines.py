"""Lab 09 (pipelines): torch.distributed.pipelining's interleaved 1F1B and zero-bubble V schedules
train notebook 06's Transformer LM on 2 ranks with 2 stages each, exactly like one process.

Run:  ./run.sh 09      (this file alone: ./run.sh labs/lab09_pipelines.py; the pipeline is always
                        ranks 0 and 1: launched on more ranks, e.g. beside the 4-rank mesh lab in
                        one launch, the others wait)

Both schedules need several stages per rank, so the model (4 blocks) is cut into 4 stages of one
block each (the first with the embedding, the last with the final norm and output layer), built
with the manual frontend of notebook 06 (`PipelineStage`: each stage keeps only its own modules):

- `ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn)`: rank r holds stages r and r + 2
  (Narayanan et al. 2021, arXiv:2104.04473);
- `ScheduleZBVZeroBubble(stages, n_microbatches, loss_fn)`: exactly 2 stages per rank in a V,
  rank 0 holds stages 0 and 3, rank 1 stages 1 and 2 (Qi et al. 2024, ICLR, arXiv:2401.10241, sec. 6):
  the first and last stage are on rank 0, which passes both the batch and the targets. Its
  backward is split into input gradients (torch's "I") and weight gradients ("W").

Each schedule computes, on every rank, the order of every rank's actions (`pipeline_order`); the
lab reports it, so the notebook replays torch's own orders in lab09_schedules' simulator.
Gradients are summed over micro-batches and scaled by 1/m (`scale_grads=True`), so AdamW sees
the gradient of the whole batch; tolerances as notebook 06's (losses rtol 1e-4, parameters 1e-4).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers import runs
from helpers.dist import DistContext, distributed, new_group
from helpers.show import table
from labs.lab06_pipelining_api import (LOSS_RTOL, PARAM_ATOL, PipelinedLM, TinyLM, build_model, lm_loss,
                                       make_token_batches, max_param_diff, train_reference)
from labs.lab09_schedules import interleaved_stages, v_stages

SCHEDULES = ("Interleaved1F1B", "ZBVZeroBubble")
PIPELINE_RANKS = 2       # the pipeline: ranks 0 and 1, two stages each


@dataclass(frozen=True)
class Run(runs.Run, PipelinedLM):
    """Notebook 06's model cut into 2 * PIPELINE_RANKS stages of one block each (ZB-V needs at
    least 2p - 1 micro-batches: 2p), its batch and steps."""
    layers: int = 2 * PIPELINE_RANKS
    batch: int = 4 * PIPELINE_RANKS
    num_microbatches: int = 2 * PIPELINE_RANKS
    steps: int = 10
    SMOKE = dict(dim=32, ffn=128, seq=16, steps=2)
    MIN_RANKS = PIPELINE_RANKS


def stages_of(schedule: str, rank: int, num_ranks: int) -> list[int]:
    """The stages this rank holds: looped for interleaved 1F1B, a V for ZB-V (2 per rank)."""
    return interleaved_stages(rank, num_ranks, 2) if schedule == "Interleaved1F1B" else v_stages(rank, num_ranks)


def stage_module(model: TinyLM, stage: int, num_stages: int) -> TinyLM:
    """A copy of `model` keeping block `stage` only (of num_layers = num_stages blocks), the
    embedding on stage 0 and the final norm and output layer on the last stage."""
    module = copy.deepcopy(model)
    for i in range(num_stages):
        if i != stage:
            del module.layers[str(i)]
    if stage != 0:
        module.tok_embeddings = None
    if stage != num_stages - 1:
        module.norm, module.output = None, None
    return module


def make_schedule(name: str, stages: list, config: PipelinedLM):
    from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

    cls = {"Interleaved1F1B": ScheduleInterleaved1F1B, "ZBVZeroBubble": ScheduleZBVZeroBubble}[name]
    return cls(stages, n_microbatches=config.num_microbatches, loss_fn=lm_loss, scale_grads=True)


def train(ctx: DistContext, name: str, config: PipelinedLM, group=None) -> dict:
    """Train with schedule `name` over `group` (all ranks: None); this rank's losses (if it holds
    the last stage), its stages' parameters after the steps, every rank's action order, and the
    median step time."""
    from torch.distributed.pipelining import PipelineStage

    num_stages = config.layers                                    # one block per stage
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    mine = stages_of(name, rank, ranks)
    if max(mine) >= num_stages or 2 * ranks != num_stages:
        raise ValueError(f"{name} here needs 2 stages per rank: {num_stages} blocks on {ranks} ranks")
    model = build_model(config)
    modules = [stage_module(model, s, num_stages).to(ctx.device) for s in mine]
    stages = [PipelineStage(m, s, num_stages, ctx.device, group=group) for m, s in zip(modules, mine)]
    schedule = make_schedule(name, stages, config)
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=config.lr)
    losses, seconds = [], []
    for tokens in make_token_batches(config, config.steps).to(ctx.device):
        start = time.perf_counter()
        optimizer.zero_grad()
        kwargs, microbatch_losses = {}, []
        if num_stages - 1 in mine:
            kwargs = {"target": tokens[:, 1:], "losses": microbatch_losses}
        schedule.step(*((tokens[:, :-1],) if 0 in mine else ()), **kwargs)
        optimizer.step()
        seconds.append(time.perf_counter() - start)
        if microbatch_losses:
            losses.append(torch.stack(microbatch_losses).mean().item())
    order = {rank: [None if a is None else str(a) for a in actions]
             for rank, actions in schedule.pipeline_order.items()}
    named = {n: p.detach().cpu().clone() for m in modules for n, p in m.named_parameters()}
    return {"stages": mine, "losses": losses, "params": named, "order": order,
            "step_s": sorted(seconds[1:] or seconds)[len(seconds[1:] or seconds) // 2]}


def run(ctx: DistContext, config: Run) -> dict:
    """Both schedules on ranks 0 and 1 against single-process training of the same model on the
    same batches; other ranks (if any) only join the group's creation."""
    group = (None if ctx.world_size == PIPELINE_RANKS
             else new_group(list(range(PIPELINE_RANKS)), name="pipeline"))
    if ctx.rank >= PIPELINE_RANKS:
        return {"idle": True}
    reference = train_reference(config, ctx.device)
    out = {"config": config.as_dict(), "reference_losses": reference["losses"], "runs": {}}
    for name in SCHEDULES:
        result = train(ctx, name, config, group)
        losses = result["losses"]
        out["runs"][name] = {
            "stages": result["stages"], "losses": losses, "order": result["order"], "step_s": result["step_s"],
            "max_param_diff": max_param_diff(result["params"], reference["params"]),
            "max_loss_rel_diff": max((abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"])),
                                     default=None)}
    return out


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        if ctx.world_size < PIPELINE_RANKS:
            raise ValueError(f"this lab needs at least {PIPELINE_RANKS} ranks, got {ctx.world_size}")
        result = run(ctx, cfg)
        ctx.report(**result)
        rows = [] if result.get("idle") else [{"schedule": name, "rank": ctx.rank, "stages": r["stages"],
                 "max |param diff|": r["max_param_diff"],
                 "max rel. loss diff": "-" if r["max_loss_rel_diff"] is None else r["max_loss_rel_diff"],
                 "step ms": 1e3 * r["step_s"]} for name, r in result["runs"].items()]
        for rank in range(ctx.world_size):     # one table per rank, in order
            if rank == ctx.rank and rows:
                table(rows, title=f"rank {rank}: torch.distributed.pipelining vs one process "
                      f"(tolerances: params {PARAM_ATOL:g}, losses rtol {LOSS_RTOL:g})", floatfmt=".2g")
            ctx.barrier()
        bad = [r["schedule"] for r in rows if r["max |param diff|"] > PARAM_ATOL
               or (r["max rel. loss diff"] != "-" and r["max rel. loss diff"] > LOSS_RTOL)]
        if bad:
            raise RuntimeError(f"rank {ctx.rank}: {bad} differ from single-process training")


if __name__ == "__main__":
    main()
