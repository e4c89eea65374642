"""Lab 03: where "N ranks train exactly like one process with the global batch" needs care, measured.

Run:  ./run.sh 03      (or: ./run.sh labs/lab03_caveats.py)

The equivalence of labs/lab03_equivalence.py holds for a model whose loss is a mean over samples
that are treated independently. Each case below breaks one of those assumptions, on 2 ranks
against one process that sees the global batch:

- BatchNorm normalises with the statistics of the *local* batch: gradients differ from one
  process. SyncBatchNorm (CUDA/XPU only) computes them over every rank; `CrossRankBatchNorm`
  below does the same on any backend. DDP also broadcasts rank 0's buffers (running statistics)
  at every forward (`broadcast_buffers`, renamed `forward_sync_buffers` in torch 2.13): every
  rank then evaluates with rank 0's statistics, gathered from rank 0's batches only.
- Dropout draws its mask from each rank's random generator: seeded alike, every rank applies the
  same mask pattern to different samples; one process would draw independent masks.
- A loss averaged over tokens: with uneven token counts the mean of per-rank means is not the
  mean over all tokens; divide the summed loss by the global token count instead.
- A parameter that gets no gradient: DDP waits for it, and the next forward raises "Expected to
  have finished reduction in the prior iteration"; `find_unused_parameters=True` marks it ready.
- Uneven inputs: a rank with one batch more waits forever in its extra all-reduce; the `Join`
  context manager shadows the finished ranks' collectives (they contribute zeros).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import runs
from helpers.dist import DistContext, distributed, new_group
from helpers.show import table
from helpers.tensors import ddp_device_ids, nbytes, seeded
from labs.lab03_ddp import flat_grads, global_batch, local_shard
from labs.lab03_equivalence import spread_over_ranks


class AllReduceSum(torch.autograd.Function):
    """Sum over the ranks of `group`; its backward is the same sum of every rank's gradient, since
    every rank's input reaches every rank's output (notebook 05 meets this pair again)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class CrossRankBatchNorm(nn.Module):
    """What SyncBatchNorm computes in training, on any backend: BatchNorm1d whose mean and
    variance are taken over the samples of every rank (no running statistics kept)."""

    def __init__(self, features: int, group, eps: float = 1e-5):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(features)), nn.Parameter(torch.zeros(features))
        self.group, self.eps = group, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, C)
        count = AllReduceSum.apply(torch.tensor([float(x.shape[0])], device=x.device), self.group)
        mean = AllReduceSum.apply(x.sum(0), self.group) / count                   # (C,)
        var = AllReduceSum.apply((x - mean).square().sum(0), self.group) / count  # (C,) biased
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def bn_model(norm: nn.Module, seed: int = 0) -> nn.Sequential:
    with seeded(seed):
        first, last = nn.Linear(8, 16), nn.Linear(16, 1)
    return nn.Sequential(first, norm, nn.ReLU(), last)


def batchnorm_case(ctx: DistContext, local_batch: int, steps: int) -> dict:
    """Gradients vs one process with BatchNorm, cross-rank BatchNorm (and SyncBatchNorm on GPUs),
    and where the running statistics end up with and without the buffer broadcast."""
    x, y = global_batch(0, local_batch * ctx.world_size, 8, 1, ctx.device)
    mine = local_shard(x, ctx.rank, ctx.world_size), local_shard(y, ctx.rank, ctx.world_size)
    reference = bn_model(nn.BatchNorm1d(16)).to(ctx.device)
    nn.functional.mse_loss(reference(x), y).backward()
    group = new_group(name="batchnorm statistics")  # its own: never mixed with DDP's all-reduces
    norms = {"BatchNorm1d": lambda: nn.BatchNorm1d(16),
             "CrossRankBatchNorm": lambda: CrossRankBatchNorm(16, group)}
    if ctx.device.type == "cuda":  # GPU only: SyncBatchNorm refuses CPU tensors
        norms["SyncBatchNorm"] = lambda: nn.SyncBatchNorm(16)
    out = {"grad_diff": {}}
    for name, make in norms.items():
        model = bn_model(make()).to(ctx.device)
        ddp = DDP(model, device_ids=ddp_device_ids(ctx.device))
        nn.functional.mse_loss(ddp(mine[0]), mine[1]).backward()
        out["grad_diff"][name] = (flat_grads(model) - flat_grads(reference)).abs().max().item()
    for sync in (True, False):  # running statistics after a few steps, then one eval forward
        model = bn_model(nn.BatchNorm1d(16)).to(ctx.device)
        ddp = DDP(model, device_ids=ddp_device_ids(ctx.device), forward_sync_buffers=sync)
        ref = bn_model(nn.BatchNorm1d(16)).to(ctx.device)
        for step in range(steps):
            xs, _ = global_batch(step, local_batch * ctx.world_size, 8, 1, ctx.device)
            ddp(local_shard(xs, ctx.rank, ctx.world_size))
            ref(xs)
        ddp.eval()
        ddp(xs[:2])  # DDP broadcasts rank 0's buffers at the start of every forward, eval too
        running = model[1].running_mean
        out[f"sync={sync}"] = {"running_mean_spread_over_ranks": spread_over_ranks(running),
                               "running_mean_diff_vs_one_process":
                                   (running - ref[1].running_mean).abs().max().item()}
    out["buffer_bytes_per_forward"] = nbytes(model.buffers())
    return out


def dropout_case(ctx: DistContext, p: float = 0.5) -> dict:
    """Fraction of dropout-mask entries equal on rank 0 and rank 1, seeds alike or per rank."""
    out = {}
    for name, seed in (("same seed on every rank", 0), ("seed + rank", ctx.rank)):
        with seeded(seed):
            mask = (nn.functional.dropout(torch.ones(64, 64), p) != 0).float().to(ctx.device)
        masks = [torch.empty_like(mask) for _ in range(ctx.world_size)]
        dist.all_gather(masks, mask)
        out[name] = (masks[0] == masks[1]).float().mean().item()
    return out


def token_loss_case(ctx: DistContext) -> dict:
    """Gradient vs one process with a per-token loss and uneven token counts per rank."""
    tokens = [4 + 8 * r for r in range(ctx.world_size)]  # rank r has 4 + 8r real tokens
    with seeded(0):
        model = nn.Linear(8, 1)
        data = [(torch.randn(n, 8), torch.randn(n, 1)) for n in tokens]
    reference = copy.deepcopy(model).to(ctx.device)
    xs, ys = (torch.cat(t).to(ctx.device) for t in zip(*data))
    nn.functional.mse_loss(reference(xs), ys).backward()  # the mean over every token
    x, y = (t.to(ctx.device) for t in data[ctx.rank])
    out = {"tokens_per_rank": tokens}
    for name in ("mean over this rank's tokens", "sum / global token count"):
        local = copy.deepcopy(model).to(ctx.device)
        ddp = DDP(local, device_ids=ddp_device_ids(ctx.device))
        squared = (ddp(x) - y).square()
        if name.startswith("mean"):
            loss = squared.mean()
        else:
            total = torch.tensor([float(len(y))], device=ctx.device)
            dist.all_reduce(total)  # every rank learns the global token count
            loss = squared.sum() / total * ctx.world_size  # DDP divides by the world size
        loss.backward()
        out[name] = (flat_grads(local) - flat_grads(reference)).abs().max().item()
    return out


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        with seeded(0):
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)  # self.unused never gets a gradient


def unused_case(ctx: DistContext) -> dict:
    """Two steps with a parameter that gets no gradient, with and without find_unused_parameters."""
    out = {}
    for find in (False, True):
        ddp = DDP(WithUnused().to(ctx.device), device_ids=ddp_device_ids(ctx.device),
                  find_unused_parameters=find)
        try:
            for _ in range(2):
                ddp(torch.ones(2, 4, device=ctx.device)).sum().backward()
            out[f"find_unused_parameters={find}"] = "2 steps done"
        except RuntimeError as err:
            out[f"find_unused_parameters={find}"] = str(err).split(". ")[0]
    return out


def join_case(ctx: DistContext) -> dict:
    """Rank 0 has one batch more than the others; Join lets it finish."""
    with seeded(0):
        model = nn.Linear(4, 1).to(ctx.device)
    ddp = DDP(model, device_ids=ddp_device_ids(ctx.device))
    batches = 3 if ctx.rank == 0 else 2
    grads, local = [], []
    with Join([ddp]):
        for _ in range(batches):
            ddp.zero_grad()
            x = torch.full((2, 4), float(ctx.rank + 1), device=ctx.device)
            ddp(x).sum().backward()
            grads.append(model.weight.grad[0, 0].item())
            local.append(x.sum(0)[0].item())  # this rank's own gradient of that weight
    return {"batches": batches, "averaged_grads": grads, "own_grads": local,
            "param_spread_over_ranks": spread_over_ranks(model.weight.detach())}


@dataclass(frozen=True)
class Run(runs.Run):
    """The BatchNorm case's local batch and steps."""
    local_batch: int = 8
    batchnorm_steps: int = 3
    SMOKE = dict(batchnorm_steps=2)
    MIN_RANKS = 2


def run(ctx: DistContext, cfg: Run) -> dict:
    if ctx.world_size < 2:
        ctx.print0("the caveats need 2 ranks or more")
        return {}
    result = {"batchnorm": batchnorm_case(ctx, local_batch=cfg.local_batch, steps=cfg.batchnorm_steps),
              "dropout": dropout_case(ctx), "token_loss": token_loss_case(ctx),
              "unused": unused_case(ctx), "join": join_case(ctx)}
    ctx.report(caveats=result)
    if ctx.rank == 0:
        table([{"normalisation": k, "max |grad - one process|": v}
               for k, v in result["batchnorm"]["grad_diff"].items()], title="BatchNorm under DDP")
        table([{"dropout seeds": k, "mask entries equal on ranks 0 and 1": v}
               for k, v in result["dropout"].items()])
        table([{"token loss": k, "max |grad - one process|": v}
               for k, v in result["token_loss"].items() if k != "tokens_per_rank"])
        table([{"unused parameter": k, "outcome": v} for k, v in result["unused"].items()])
    return {"caveats": result}


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        run(ctx, cfg)


if __name__ == "__main__":
    main()
