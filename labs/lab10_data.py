"""Lab 10: wrong but running. Data-parallel bugs that raise nothing, each caught by a measured symptom.

Run:  ./run.sh 10      (this file alone: ./run.sh labs/lab10_data.py)

A small regression (Linear 16 -> 4 on a fixed teacher, SGD) trained with DistributedDataParallel,
healthy and with one bug at a time:
- `sampler.set_epoch(epoch)` forgotten: every epoch visits the samples in the first one's order;
- no DistributedSampler: every rank reads the whole dataset in the same order, so each global
  batch holds N copies of one local batch, and N ranks learn exactly what one process would;
- the loss printed from rank 0 alone: its own shard's loss, not the global batch's;
- gradients reduced twice: DDP already averages them, and a leftover manual all-reduce after
  backward either wastes a second all-reduce (sum, then / N: same numbers, twice the traffic),
  or multiplies them by N (sum without / N); a loss divided by N before backward "because DDP
  sums" averages twice and divides them by N;
  With SGD (the optimizer here) gradients N times too large are a learning rate N times too
  large; Adam divides each step by the gradient's running RMS, so it barely notices (measured);
- the global batch grows with the ranks: with the learning rate unchanged, an epoch has N times
  fewer steps of the same size, and the loss after an epoch is worse; the linear scaling rule
  (learning rate times N; Goyal et al. 2017, arXiv:1706.02677) recovers most of it;
- an autograd collective with a wrong backward: torch.distributed.nn.functional.all_gather on
  gloo, when the gradient reaching it is not contiguous (blocks gathered along the sequence,
  then heads and sequence transposed, as attention code does), gives wrong input gradients and
  no error; the fixes: make that gradient contiguous, or an autograd function of one's own.
Every symptom is compared with a single-process reference trained in this process on the same
global batches (N ranks with local batch B train exactly like one process with batch N*B).
"""
from __future__ import annotations

from dataclasses import dataclass

import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from helpers import runs
from helpers.dist import DistContext, distributed, new_group
from helpers.show import table
from helpers.tensors import ddp_device_ids, divide, seeded

IN, OUT, LOCAL_BATCH, LR, SEED = 16, 4, 8, 0.05, 0


def dataset(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (size, 16), y (size, 4): a fixed linear teacher plus a little noise."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(size, IN, generator=gen)
    teacher = torch.randn(IN, OUT, generator=gen) / IN ** 0.5
    return x, x @ teacher + 0.1 * torch.randn(size, OUT, generator=gen)


def make_model(device) -> nn.Linear:
    with seeded(SEED):
        return nn.Linear(IN, OUT).to(device)


def epoch_orders(size: int, world_size: int, rank: int, epochs: int, set_epoch: bool) -> list[list[int]]:
    """The indices `rank` visits in each epoch, from a shuffling DistributedSampler."""
    sampler = DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
    orders = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)  # reshuffles with seed + epoch
        orders.append(list(sampler))
    return orders


def step_batches(order: list[int], batch_size: int) -> list[list[int]]:
    return [order[i:i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]


EXTRA_REDUCTION = {  # what runs on top of DDP's own gradient average
    "DDP alone (healthy)": "none",
    "DDP + all_reduce(grad) / N": "mean",
    "DDP + all_reduce(grad)": "sum",
    "DDP + loss / N": "loss",
}


OPTIMIZERS = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam}


def train_ddp(data, batches: list[list[int]], lr: float, device, extra: str = "none",
              optimizer: str = "SGD") -> dict:
    """DDP training on this rank's `batches`; records the local loss, the loss averaged over ranks,
    the gradient norm at every step and the bytes of any manual all-reduce (`extra`: see
    EXTRA_REDUCTION)."""
    x, y = data
    ddp = DDP(make_model(device), device_ids=ddp_device_ids(device))
    opt = OPTIMIZERS[optimizer](ddp.parameters(), lr=lr)
    world_size = dist.get_world_size()
    local, mean, grad_norm, extra_bytes = [], [], [], 0
    for idx in batches:
        loss = nn.functional.mse_loss(ddp(x[idx].to(device)), y[idx].to(device))
        opt.zero_grad()
        (loss / world_size if extra == "loss" else loss).backward()  # DDP averages the gradients
        if extra in ("mean", "sum"):  # the bug: a leftover manual reduction from before DDP
            for p in ddp.parameters():
                dist.all_reduce(p.grad)
                extra_bytes += p.grad.nbytes
                if extra == "mean":
                    p.grad.div_(world_size)
        grad_norm.append(torch.cat([p.grad.flatten() for p in ddp.parameters()]).norm().item())
        opt.step()
        together = loss.detach().clone()
        dist.all_reduce(together, op=dist.ReduceOp.AVG)  # what to print: the global batch's loss
        local.append(loss.item())
        mean.append(together.item())
    return {"model": ddp.module, "local_loss": local, "mean_loss": mean, "grad_norm": grad_norm,
            "extra_bytes_per_step": extra_bytes / max(1, len(batches))}


def train_single(data, batches: list[list[int]], lr: float, device) -> dict:
    """One process, plain SGD on `batches` (the reference)."""
    x, y = data
    model = make_model(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grad_norm = [], []
    for idx in batches:
        loss = nn.functional.mse_loss(model(x[idx].to(device)), y[idx].to(device))
        opt.zero_grad()
        loss.backward()
        grad_norm.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item())
        opt.step()
        losses.append(loss.item())
    return {"model": model, "loss": losses, "grad_norm": grad_norm}


def full_loss(model: nn.Module, data, device) -> float:
    with torch.no_grad():
        return nn.functional.mse_loss(model(data[0].to(device)), data[1].to(device)).item()


def param_gap(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


# ============================================================================ a wrong backward
BHSD = (2, 3, 4, 5)  # one rank's block: (batch, heads, sequence, head dim); heads > 1 matters


class ContiguousGrad(torch.autograd.Function):
    """Identity forward; backward hands on a contiguous copy of the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class AllGather(torch.autograd.Function):
    """All-gather whose backward is a reduce-scatter: this rank's block receives the sum over
    ranks of the gradients of its copy (each gradient made contiguous before it is sent)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = [torch.empty_like(x, memory_format=torch.contiguous_format)
               for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        mine = torch.empty_like(grads[0], memory_format=torch.contiguous_format)
        dist.reduce_scatter(mine, [g.contiguous() for g in grads], group=ctx.group)
        return mine, None


def gathered_loss(blocks: list[torch.Tensor], rank: int) -> torch.Tensor:
    """Rank `rank`'s loss on every rank's block: the blocks joined along the sequence, then
    (b, h, s, d) -> (b, s, h, d) as attention code does, so the gradient that flows back into the
    blocks is a transposed (non-contiguous) view; weights seeded by the rank."""
    joined = torch.cat(blocks, dim=2).transpose(1, 2)  # (b, n*s, h, d)
    weight = torch.randn(joined.shape, generator=torch.Generator().manual_seed(100 + rank))
    return (joined * weight).sum()


def all_gather_backward(rank: int, world_size: int) -> dict:
    """Each rank's block's gradient of the sum of every rank's loss, three ways, against one
    process that computes that sum itself: the largest |difference| over the ranks, per way.
    On a gloo group and CPU tensors even on a GPU machine (nccl takes another path in torch)."""
    group = new_group(name="all_gather backward", backend="gloo")
    blocks = [torch.randn(BHSD, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    reference = [b.clone().requires_grad_() for b in blocks]
    sum(gathered_loss(reference, r) for r in range(world_size)).backward()
    ways = {
        "torch.distributed.nn.functional.all_gather":
            lambda x: dist_autograd.all_gather(x, group=group),
        "the same, gradient made contiguous":
            lambda x: [ContiguousGrad.apply(t) for t in dist_autograd.all_gather(x, group=group)],
        "an autograd function of our own (reduce-scatter)":
            lambda x: AllGather.apply(x, group),
    }
    out = {}
    for name, gather in ways.items():
        x = blocks[rank].clone().requires_grad_()
        with warnings.catch_warnings():  # the functional collectives' deprecation notice
            warnings.simplefilter("ignore", FutureWarning)
            gathered_loss(list(gather(x)), rank).backward()
        gap = (x.grad - reference[rank].grad).abs().max()
        dist.all_reduce(gap, op=dist.ReduceOp.MAX, group=group)
        out[name] = gap.item()
    out["gradient size (max |reference|)"] = max(r.grad.abs().max().item() for r in reference)
    return out


@dataclass(frozen=True)
class Run(runs.Run):
    """Samples in the dataset (divisible by the ranks' local batches)."""
    dataset_size: int = 256
    SMOKE = dict(dataset_size=128)


def run(ctx: DistContext, cfg: Run) -> dict:
    rank, world_size, device = ctx.rank, ctx.world_size, ctx.device
    size = cfg.dataset_size
    divide(size, world_size * LOCAL_BATCH, "the dataset over the ranks' local batches")
    data = dataset(size)
    out = {"world_size": world_size, "dataset_size": size, "local_batch": LOCAL_BATCH, "lr": LR}

    # 1. set_epoch forgotten: how many later epochs repeat epoch 0's order
    epochs = 4
    for name, flag in (("with set_epoch", True), ("without set_epoch", False)):
        orders = epoch_orders(size, world_size, rank, epochs, flag)
        out[name] = {"repeats_of_epoch_0": sum(o == orders[0] for o in orders[1:]),
                     "later_epochs": epochs - 1, "first_indices": [o[:6] for o in orders]}

    # every rank's batches for one epoch (each rank can compute the others' from the same seed)
    shards = [epoch_orders(size, world_size, r, 1, True)[0] for r in range(world_size)]
    local_batches = [step_batches(s, LOCAL_BATCH) for s in shards]
    global_batches = [sum((lb[i] for lb in local_batches), []) for i in range(len(local_batches[0]))]

    healthy = train_ddp(data, local_batches[rank], LR, device)
    reference = train_single(data, global_batches, LR, device)  # one process, batch N*B
    out["healthy"] = {"param_gap_to_reference": param_gap(healthy["model"], reference["model"]),
                      "local_loss": healthy["local_loss"], "mean_loss": healthy["mean_loss"],
                      "reference_loss": reference["loss"]}

    # 2. no DistributedSampler: every rank reads the whole dataset, in the same order
    same = step_batches(epoch_orders(size, 1, 0, 1, True)[0], LOCAL_BATCH)[:len(global_batches)]
    unsharded = train_ddp(data, same, LR, device)
    alone = train_single(data, same, LR, device)  # one process, batch B, the same batches
    everyone = [None] * world_size
    dist.all_gather_object(everyone, sum(same, []))
    seen = [i for order in everyone for i in order]
    out["no sampler"] = {"distinct_fraction": len(set(seen)) / len(seen),
                         "param_gap_to_one_process_batch_B": param_gap(unsharded["model"], alone["model"]),
                         "param_gap_to_reference": param_gap(unsharded["model"], reference["model"])}

    # 3. gradients reduced twice
    out["reduced twice"] = {}
    runs = {}
    for name, extra in EXTRA_REDUCTION.items():
        run_ = runs[extra] = healthy if extra == "none" else train_ddp(data, local_batches[rank], LR, device, extra)
        out["reduced twice"][name] = {
            "gradient / reference": run_["grad_norm"][0] / reference["grad_norm"][0],
            "manual all-reduce bytes per step": run_.get("extra_bytes_per_step", 0),
            "loss after the epoch": full_loss(run_["model"], data, device)}
    # the same gradients N times too large, under SGD and under Adam: how far from the healthy run
    adam = {extra: train_ddp(data, local_batches[rank], LR, device, extra, optimizer="Adam")
            for extra in ("none", "sum")}
    out["gradients x N, by optimizer"] = {
        "SGD": {"parameter gap to the healthy run": param_gap(runs["sum"]["model"], healthy["model"]),
                "parameter change in the healthy run": param_gap(healthy["model"], make_model(device))},
        "Adam": {"parameter gap to the healthy run": param_gap(adam["sum"]["model"], adam["none"]["model"]),
                 "parameter change in the healthy run": param_gap(adam["none"]["model"], make_model(device))}}

    # 4. one epoch, three ways: 1 process batch B; N ranks at lr; N ranks at N * lr
    single_b = train_single(data, step_batches(epoch_orders(size, 1, 0, 1, True)[0], LOCAL_BATCH), LR, device)
    scaled = train_ddp(data, local_batches[rank], LR * world_size, device)
    out["learning rate"] = {
        "1 process, batch B, lr": {"steps": len(single_b["loss"]), "loss": full_loss(single_b["model"], data, device)},
        f"{world_size} ranks, batch {world_size}B, lr": {"steps": len(global_batches),
                                                        "loss": full_loss(healthy["model"], data, device)},
        f"{world_size} ranks, batch {world_size}B, {world_size} x lr": {
            "steps": len(global_batches), "loss": full_loss(scaled["model"], data, device)},
        "loss before training": full_loss(make_model(device), data, device)}

    # 5. an autograd collective whose backward is wrong on gloo
    out["all_gather backward"] = all_gather_backward(rank, world_size)
    return out


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        out = run(ctx, cfg)
        ctx.report(data=out)
        if ctx.rank != 0:
            return
        n = ctx.world_size
        h = out["healthy"]
        table([
            {"bug": "set_epoch forgotten", "symptom": f"{out['without set_epoch']['repeats_of_epoch_0']} of "
             f"{out['without set_epoch']['later_epochs']} later epochs repeat epoch 0's order "
             f"(with set_epoch: {out['with set_epoch']['repeats_of_epoch_0']})"},
            {"bug": "no DistributedSampler", "symptom": f"{out['no sampler']['distinct_fraction']:.0%} of the "
             f"samples seen are distinct; parameters within {out['no sampler']['param_gap_to_one_process_batch_B']:.1e}"
             " of ONE process's"},
            {"bug": "loss printed from rank 0", "symptom": "mean |rank 0's loss - global loss| = "
             f"{sum(abs(a - b) for a, b in zip(h['local_loss'], h['mean_loss'])) / len(h['mean_loss']):.3g}"},
        ], title=f"wrong but running, {n} ranks (healthy DDP vs reference: parameters within "
                 f"{h['param_gap_to_reference']:.1e})")
        table([{"gradients": k, **v} for k, v in out["reduced twice"].items()],
              title="gradients reduced twice: step 0's gradient norm over the reference's")
        table([{"run": k, **v} if isinstance(v, dict) else {"run": k, "loss": v}
               for k, v in out["learning rate"].items()], title="one epoch: the loss on the whole dataset")
        table([{"optimizer": k, **v} for k, v in out["gradients x N, by optimizer"].items()],
              title=f"gradients {n} times too large: parameters after one epoch vs the healthy run's")
        ag = dict(out["all_gather backward"])
        size = ag.pop("gradient size (max |reference|)")
        table([{"all-gather": k, "largest error in an input gradient": v} for k, v in ag.items()],
              title=f"an all-gather's backward when the gradient reaching it is not contiguous (gloo; "
                    f"gradients up to {size:.2g})")


if __name__ == "__main__":
    main()
