"""Lab 03: what buckets and overlap buy, measured: one training step with each way of averaging.

Run:  ./run.sh 03      (or: ./run.sh labs/lab03_ddp_bench.py)

The same MLP, the same batch, the same SGD step, timed with every method of labs/lab03_ddp.py
(naive per-parameter all-reduce, one flat all-reduce, per-parameter async all-reduce overlapped
with backward, BucketedDDP at a few bucket sizes) and torch's DistributedDataParallel. For each:
median step time, collectives per step, bytes per step, and how many collectives were launched
before `loss.backward()` returned. Methods are timed in interleaved rounds, so a burst of load on
a shared machine hits them all alike; compare ratios from one run, not numbers across runs.
"""
from __future__ import annotations

import torch
from torch import nn

from helpers import pick
from helpers.bench import measure
from helpers.dist import DistContext, distributed
from helpers.show import table
from labs.lab03_ddp import DataParallel, make_mlp, wrap

REFERENCE = "torch_ddp 25MB"


def variants(bucket_sizes_mb: list[float]) -> list[tuple[str, str, float]]:
    """(label, method, bucket_cap_mb) for every configuration the benchmark runs."""
    out = [("naive", "naive", 0.0), ("flat", "flat", 0.0), ("overlapped", "overlapped", 0.0)]
    out += [(f"bucketed {mb:g}MB", "bucketed", mb) for mb in bucket_sizes_mb]
    out.append((REFERENCE, "torch_ddp", 25.0))
    return out


def make_step(dp: DataParallel, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    """One full training step; returns how many collectives were launched during backward."""
    def step() -> int:
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.mse_loss(dp.model(x), y)
        before = dp.comm.collectives
        loss.backward()
        launched_in_backward = dp.comm.collectives - before
        dp.sync()
        opt.step()
        return launched_in_backward
    return step


def bench(ctx: DistContext, width: int, depth: int, local_batch_size: int,
          bucket_sizes_mb: list[float], rounds: int, repeats: int) -> list[dict]:
    """Step time (median over rounds * repeats), collectives, bytes for every variant."""
    sizes = [width] * (depth + 1)
    gen = torch.Generator().manual_seed(ctx.rank)  # each rank its own local batch
    x = torch.randn(local_batch_size, width, generator=gen).to(ctx.device)
    y = torch.randn(local_batch_size, width, generator=gen).to(ctx.device)
    rows, steps = [], []
    for label, method, cap_mb in variants(bucket_sizes_mb):
        # Counting pass: torch DDP counts through a comm hook, so it gets its own instance here
        # and is timed below without the hook (its built-in C++ all-reduce path).
        try:
            counted = wrap(method, make_mlp(sizes, 0, ctx.device), ctx.device,
                           bucket_cap_mb=cap_mb)
            count_step = make_step(counted, torch.optim.SGD(counted.model.parameters(), lr=1e-3),
                                   x, y)
            for _ in range(2):  # torch DDP rebuilds its buckets after the first iteration
                count_step()
        except NotImplementedError as exc:  # the student edition, before the homework is done
            ctx.print0(f"{label}: skipped, not implemented yet ({exc})")
            continue
        counted.comm.reset()
        launched = count_step()
        rows.append({"method": label, "collectives/step": counted.comm.collectives,
                     "MB/step": counted.comm.bytes / 2**20, "launched in backward": launched})
        dp = counted if method != "torch_ddp" else wrap(
            method, make_mlp(sizes, 0, ctx.device), ctx.device, bucket_cap_mb=cap_mb,
            count_torch_ddp=False)
        step = make_step(dp, torch.optim.SGD(dp.model.parameters(), lr=1e-3), x, y)
        measure(step, warmup=1, repeats=1, device=ctx.device, barrier=True)
        steps.append(step)
    samples: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):  # interleaved: every variant sees the same load
        for i, step in enumerate(steps):
            samples[i] += measure(step, warmup=0, repeats=repeats, device=ctx.device,
                                  barrier=True).samples
    for row, times in zip(rows, samples):
        times.sort()
        row["step ms"] = 1e3 * times[len(times) // 2]
    ref_ms = next(r["step ms"] for r in rows if r["method"] == REFERENCE)
    for row in rows:
        row["vs torch DDP"] = row["step ms"] / ref_ms
    return rows


def run(ctx: DistContext) -> dict:
    width, depth = pick(256, 64), pick(24, 6)
    local_batch_size = pick(64, 8)
    bucket_sizes_mb = pick([0.5, 1.0, 4.0, 25.0], [0.01, 0.05, 25.0])
    rounds, repeats = pick(3, 1), pick(3, 2)
    num_params = depth * (width * width + width)
    ctx.print0(f"MLP {depth} x Linear({width}, {width}): {num_params / 1e6:.2f} M parameters "
               f"({num_params * 4 / 2**20:.1f} MB of fp32 gradients), local batch "
               f"{local_batch_size}, {ctx.world_size} ranks, {ctx.backend} on {ctx.device}")
    rows = bench(ctx, width, depth, local_batch_size, bucket_sizes_mb, rounds, repeats)
    ratio = next((r["vs torch DDP"] for r in rows if r["method"] == f"bucketed {25.0:g}MB"),
                 float("nan"))
    if ctx.rank == 0:
        table(rows, title=f"one training step, median of {rounds * repeats} (rank 0's clock)")
        if ratio == ratio:  # not NaN: BucketedDDP ran
            print(f"BucketedDDP (25 MB) / torch DDP step time: {ratio:.2f}x "
                  f"({'within' if ratio <= 1.1 else 'outside'} the 1.1x goal)", flush=True)
    ctx.report(bench=rows, bucketed_vs_torch_ddp=ratio, num_params=num_params,
               bench_config={"width": width, "depth": depth, "local_batch_size": local_batch_size,
                             "bucket_sizes_mb": bucket_sizes_mb, "samples": rounds * repeats})
    return {"bench": rows}


def main() -> None:
    with distributed() as ctx:
        run(ctx)


if __name__ == "__main__":
    main()
