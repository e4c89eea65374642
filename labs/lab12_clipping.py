"""Lab 12 (clipping over DTensors): the global gradient norm against the norm a rank can compute
from what it holds, and what clipping with the latter does to training.

Run:  ./run.sh 12      (8 ranks, a 2 x 2 x 2 mesh; alone: ./run.sh labs/lab12_clipping.py)

`torch.nn.utils.clip_grad_norm_` on one process scales every gradient by min(1, max_norm / n),
n the 2-norm of the whole model's gradient. On a (pp, dp, tp) mesh no rank holds that gradient:
each holds its dp x tp shard of its pipeline stage's. Three norms a rank can compute, measured
on the same first step's gradients (before any clipping):
- "this rank's shards": the 2-norm of the local tensors (`to_local()`), what a loop over
  `p.grad.to_local()` gives: every rank a different number, all of them too small;
- "this stage": `torch.nn.utils.get_total_norm` over the stage's DTensor gradients, which DTensor
  reduces over their mesh (the squares of the shards summed over dp and tp, a replicated piece
  counted once): right for the stage, but blind to the other pipeline stages;
- "global": the exercise's `clip_grad_norm_(parameters, max_norm, pp_group)` (labs/lab12_
  parallelize.py): the stages' squares summed over pp as well, equal to one process's norm.
Then a few AdamW steps clipped with the global norm and a few clipped with each rank's own
norm, both beside one process. With its own norm each rank scales its gradients by another
coefficient, and by another one each step, so the parameters leave the one-process run, and the
ranks that hold copies of one replicated piece (each norm weight, on the tp ranks of its dp shard)
step them differently: copies that no longer agree (notebook 10's silent divergence). One step
would hide most of it: AdamW's first update is about lr * sign(g), whatever the gradient's scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers.dist import DistContext, distributed
from labs.lab12_model import LMRun, batch_at, corpus, split, train_reference
from labs.lab12_parallelize import clip_grad_norm_, mesh_shape
from labs.lab12_train import Trainer

OWN = "this rank's norm"      # the clipping that uses what a rank holds


def coefficient(norm: float, max_norm: float) -> float:
    """The factor torch's clip_grad_norm_ scales the gradients by for a total norm `norm`."""
    return min(1.0, max_norm / (norm + 1e-6))


def first_step_norms(trainer: Trainer, data: torch.Tensor) -> dict[str, float]:
    """Forward and backward of step 0, then the three norms of the gradients (nothing clipped)."""
    from torch.distributed.tensor import DTensor

    x, y = batch_at(data, 0, trainer.config.batch, trainer.config.seq)
    trainer.forward_backward(x, y)
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    stage = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    return {"this rank's shards": torch.nn.utils.get_total_norm(local, norm_type=2.0).item(),
            "this stage": (stage.full_tensor() if isinstance(stage, DTensor) else stage).item()}


@torch.no_grad()
def tp_replica_spread(trainer: Trainer) -> float:
    """Largest difference between the copies of a replicated piece held by the tp ranks of one
    dp shard (the norms' weights: Replicate on tp), after the step: 0 while they agree."""
    from torch.distributed.tensor import Replicate

    tp = trainer.mesh["tp"]
    if tp.size() == 1:
        return 0.0
    worst = torch.zeros((), device=trainer.ctx.device)
    for p in trainer.model.parameters():
        if isinstance(p.placements[-1], Replicate):      # the tp dimension is the mesh's last
            local = p.to_local().contiguous()
            copies = [torch.empty_like(local) for _ in range(tp.size())]
            dist.all_gather(copies, local, group=tp.get_group())
            for copy in copies[1:]:
                worst = torch.maximum(worst, (copy - copies[0]).abs().max())
    return worst.item()


def clipped_with_own_norm(trainer: Trainer, data: torch.Tensor, step: int) -> float:
    """One training step whose clipping uses this rank's own norm (the misreading); the loss."""
    x, y = batch_at(data, step, trainer.config.batch, trainer.config.seq)
    loss = trainer.forward_backward(x, y)
    local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
             for p in trainer.model.parameters() if p.grad is not None]
    scale = coefficient(torch.nn.utils.get_total_norm(local, norm_type=2.0).item(), trainer.config.max_norm)
    with torch.no_grad():
        for g in local:
            g.mul_(scale)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return trainer.global_loss(loss)


@dataclass(frozen=True)
class Run(LMRun):
    """The model and the ranks (LMRun); `steps` steps clipped each way; `mesh` pp,dp,tp (empty:
    mesh_shape of the ranks)."""
    steps: int = 5
    mesh: tuple[int, ...] = ()
    SMOKE = dict(LMRun.SMOKE, steps=3)


def run(ctx: DistContext, cfg: Run) -> dict:
    """Norms of step 0's gradients on this rank; then `steps` steps clipped with the global norm
    and `steps` clipped with each rank's own norm, both against one process: losses, parameters,
    and the spread of the tp copies of replicated parameters."""
    config, steps = cfg.config(), cfg.steps
    shape = tuple(cfg.mesh) or mesh_shape(ctx.world_size)
    data, _ = split(corpus())
    reference = train_reference(config, steps, data, device=ctx.device)
    reference_params = {n: p.detach().float().cpu() for n, p in reference["model"].named_parameters()}

    def param_diff(trainer: Trainer) -> float:
        mine = trainer.full_params()
        return max((mine[n] - reference_params[n]).abs().max().item() for n in mine)

    right = Trainer(ctx, config, shape)               # the exercise's global norm
    norms = first_step_norms(right, data)
    pp_group = right.pp_group if right.pp > 1 else None
    norms["global (clip_grad_norm_)"] = clip_grad_norm_(right.model.parameters(), config.max_norm, pp_group).item()
    right.optimizer.step()
    right.optimizer.zero_grad(set_to_none=True)
    for step in range(1, steps):
        right.train_step(data, step)
    result = {"global norm": {"max_param_diff": param_diff(right), "tp_replica_spread": tp_replica_spread(right)}}
    coordinate = {"pp": right.pp_rank, "dp": right.dp_rank, "tp": right.tp_rank}
    del right

    wrong = Trainer(ctx, config, shape)               # clipped with what this rank holds
    losses = [clipped_with_own_norm(wrong, data, step) for step in range(steps)]
    result[OWN] = {"max_param_diff": param_diff(wrong), "tp_replica_spread": tp_replica_spread(wrong),
                   "losses": losses}
    return {"shape": list(shape), "steps": steps, "max_norm": config.max_norm, "coordinate": coordinate,
            "one_process": {"norm": reference["grad_norms"][0], "losses": reference["losses"]},
            "norms": norms, "coefficients": {k: coefficient(v, config.max_norm) for k, v in norms.items()},
            "true_coefficient": coefficient(reference["grad_norms"][0], config.max_norm), "runs": result}


def main(argv: list[str] | None = None) -> None:
    from helpers.notice import attempt
    from helpers.show import table

    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        out = attempt(run, ctx, cfg)
        ctx.report(clipping=out)
        if "unsolved" in out:
            return
        rows = [{"rank": ctx.rank, **out["coordinate"], **out["norms"], "one process": out["one_process"]["norm"]}]
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, rows[0])
        if ctx.rank == 0:
            table(gathered, title=f"step 0's gradient norm as each rank computes it (max_norm {out['max_norm']:g})",
                  floatfmt=".4g")
            runs = out["runs"]
            print(f"rank 0, {out['steps']} AdamW steps clipped with the global norm: max |parameter - one process| "
                  f"{runs['global norm']['max_param_diff']:.1e}; with each rank's own norm: "
                  f"{runs[OWN]['max_param_diff']:.1e}, and the tp copies of one parameter differ by up to "
                  f"{runs[OWN]['tp_replica_spread']:.1e}", flush=True)


if __name__ == "__main__":
    main()
