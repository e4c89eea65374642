"""Lab 03: what buckets and overlap buy, measured: step times, an overlap timeline, an alpha-beta model.

Run:  ./run.sh 03      (or: ./run.sh labs/lab03_ddp_bench.py)

The same MLP, the same batch, the same SGD step with every method of labs/lab03_ddp.py (naive,
flat, overlapped, BucketedDDP) and torch's DistributedDataParallel, at bucket caps well below the
model's size and above one layer's weight and bias, so every bucketed row really has several
buckets of several parameters each (each row counts its buckets and parameters per bucket). A cap
below one layer (weight + bias) would leave every parameter alone in its bucket: the overlapped
method again, one message per parameter.
Three measurements:

1. Step time: median over interleaved rounds (a burst of load on a shared machine hits every
   variant alike; compare ratios from one run, never numbers across runs).
2. A timeline of one step (time.perf_counter on every rank): when each parameter's gradient was
   ready during backward, and when each bucket's all-reduce was launched and finished. The
   exposed tail is the time from the last gradient to the last all-reduce's finish: the part of
   the communication that backward could not hide.
3. The alpha-beta model (Hockney 1994): an all-reduce of S bytes takes alpha + S / bandwidth,
   fitted here from all-reduces timed on their own. With gradients ready at the measured times
   and buckets going out one after another, the model predicts each variant's exposed tail, and,
   for equal buckets over a backward of T seconds, the bucket size with the smallest tail (the
   question of Stanford CS336's assignment 2, 2025: best bucket size from s, w, o and n_b).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from helpers import runs
from helpers.bench import measure
from helpers.comm_bench import all_reduce_fit
from helpers.dist import DistContext, distributed, synchronize
from helpers.notice import attempt
from helpers.show import table
from labs.lab03_ddp import make_mlp
from labs.lab03_equivalence import DataParallel, wrap

KiB, MiB = 1024, 2**20


def variants(caps_mb: Sequence[float]) -> list[tuple[str, str, float | None]]:
    """(label, method, bucket_cap_mb) for every configuration the benchmark runs."""
    out = [("naive", "naive", None), ("flat", "flat", None), ("overlapped", "overlapped", None),
           ("torch DDP default", "torch_ddp", None)]
    for cap in caps_mb:
        out += [(f"torch DDP {cap:g} MiB", "torch_ddp", cap), (f"BucketedDDP {cap:g} MiB", "bucketed", cap)]
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


def timed_step(dp: DataParallel, model: nn.Module, opt, x, y, device) -> dict:
    """One step with a timeline: gradient-ready times, buckets' launch and finish (ms from the
    start of backward), and the exposed tail."""
    ready: list[float] = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: ready.append(time.perf_counter()))
             for p in model.parameters()]
    opt.zero_grad(set_to_none=False)
    loss = nn.functional.mse_loss(dp.model(x), y)
    first = len(dp.comm.timeline)
    synchronize(device)
    start = time.perf_counter()
    loss.backward()
    backward_end = time.perf_counter()
    dp.sync()
    synchronize(device)
    synced = time.perf_counter()
    opt.step()
    for hook in hooks:
        hook.remove()
    events = dp.comm.timeline[first:]
    last_finish = max((e["finish_s"] or synced) for e in events)
    ms = lambda t: 1e3 * (t - start)
    return {"ready_ms": [ms(t) for t in ready], "backward_end_ms": ms(backward_end),
            "synced_ms": ms(synced),
            "buckets": [{"bytes": e["bytes"], "launch_ms": ms(e["launch_s"]),
                         "finish_ms": ms(e["finish_s"] or synced)} for e in events],
            "tail_ms": max(0.0, 1e3 * (last_finish - max(ready)))}


def bench(ctx: DistContext, width: int, depth: int, local_batch_size: int,
          caps_mb: Sequence[float], rounds: int, repeats: int) -> list[dict]:
    """Per variant: collectives, buckets, bytes, launches during backward, a timeline, step time."""
    sizes = [width] * (depth + 1)
    gen = torch.Generator().manual_seed(ctx.rank)  # each rank its own local batch
    x = torch.randn(local_batch_size, width, generator=gen).to(ctx.device)
    y = torch.randn(local_batch_size, width, generator=gen).to(ctx.device)
    rows, steps = [], []
    for label, method, cap_mb in variants(caps_mb):
        def counted_run():
            model = make_mlp(sizes, 0, ctx.device)
            dp = wrap(method, model, ctx.device, bucket_cap_mb=cap_mb)
            opt = torch.optim.SGD(dp.model.parameters(), lr=1e-3)
            step = make_step(dp, opt, x, y)
            for _ in range(2):  # torch DDP rebuilds its buckets after the first iteration
                step()
            dp.comm.reset()
            launched = step()
            row = {"method": label, "buckets/step": dp.comm.collectives,
                   "params/bucket": round(len(list(model.parameters())) / max(1, dp.comm.collectives), 2),
                   "MB/step": dp.comm.bytes / 1e6, "launched in backward": launched}
            row["timeline"] = timed_step(dp, model, opt, x, y, ctx.device)
            row["tail ms"] = row["timeline"]["tail_ms"]
            return row, dp, opt
        counted = attempt(counted_run)
        if isinstance(counted, dict):  # {"unsolved": ...}: the student edition, before BucketedDDP
            rows.append({"method": label, **counted})
            continue
        row, dp, opt = counted
        if method == "torch_ddp":  # timed without the counting hook: DDP's own C++ all-reduce
            dp = wrap(method, make_mlp(sizes, 0, ctx.device), ctx.device, bucket_cap_mb=cap_mb,
                      count_torch_ddp=False)
            opt = torch.optim.SGD(dp.model.parameters(), lr=1e-3)
        step = make_step(dp, opt, x, y)
        measure(step, warmup=2, repeats=1, device=ctx.device, barrier=True)
        rows.append(row)
        steps.append((row, step))
    samples: dict[str, list[float]] = {row["method"]: [] for row, _ in steps}
    for _ in range(rounds):  # interleaved: every variant sees the same load
        for row, step in steps:
            samples[row["method"]] += measure(step, warmup=0, repeats=repeats, device=ctx.device,
                                              barrier=True).samples
    for row, _ in steps:
        times = sorted(samples[row["method"]])
        row["step ms"] = 1e3 * times[len(times) // 2]
    return rows


# --- the alpha-beta model ------------------------------------------------------------------------

def serial_tail(ready_s: Sequence[float], bucket_bytes: Sequence[int], latency_s: float,
                bandwidth: float) -> float:
    """Exposed tail when bucket i is ready at ready_s[i] and the all-reduces go out one after
    another over one link, each taking latency_s + bytes / bandwidth (seconds)."""
    finish = -math.inf
    for ready, size in zip(ready_s, bucket_bytes):
        finish = max(finish, ready) + latency_s + size / bandwidth
    return max(0.0, finish - max(ready_s))


def uniform_tail(total_bytes: int, backward_s: float, bucket_bytes: int, latency_s: float,
                 bandwidth: float) -> float:
    """serial_tail for gradients produced at a steady rate over `backward_s` seconds, cut into
    buckets of `bucket_bytes` (the last one holds the rest). With n equal buckets and c = latency
    + bucket / bandwidth this is max(c, T/n + n*c - T): c when the link keeps up, the backlog
    when it does not."""
    n = max(1, math.ceil(total_bytes / bucket_bytes))
    sizes = [bucket_bytes] * (n - 1) + [total_bytes - bucket_bytes * (n - 1)]
    done, ready = 0, []
    for size in sizes:
        done += size
        ready.append(backward_s * done / total_bytes)
    return serial_tail(ready, sizes, latency_s, bandwidth)


def best_bucket(total_bytes: int, backward_s: float, latency_s: float,
                bandwidth: float) -> tuple[int, float]:
    """(bucket bytes, predicted tail in s) minimising uniform_tail over sizes 1 KiB..the model."""
    candidates = sorted({min(total_bytes, int(KiB * 2 ** (k / 4))) for k in range(0, 4 * 40)})
    return min(((b, uniform_tail(total_bytes, backward_s, b, latency_s, bandwidth))
                for b in candidates), key=lambda pair: pair[1])


def alpha_beta(ctx: DistContext, sizes_bytes: Sequence[int], repeats: int) -> dict:
    """all-reduce time = latency + bytes / bandwidth, fitted from all-reduces timed on their own."""
    latency, bandwidth, rows = all_reduce_fit(sizes_bytes, device=ctx.device, repeats=repeats)
    return {"latency_s": latency, "bandwidth_Bps": bandwidth,
            "points": [{"bytes": r["bytes"], "seconds": r["seconds"]} for r in rows]}


def predictions(rows: list[dict], model: dict, total_bytes: int) -> dict:
    """The model's tail for each measured variant, its tail curve over bucket sizes, its best size.

    The backward time T comes from the flat variant (nothing is sent during its backward)."""
    latency, bandwidth = model["latency_s"], model["bandwidth_Bps"]
    flat = next(r for r in rows if r["method"] == "flat")["timeline"]
    backward_s = max(flat["ready_ms"]) / 1e3
    for row in rows:
        if "timeline" in row:
            buckets = row["timeline"]["buckets"]
            last_ready = max(row["timeline"]["ready_ms"]) / 1e3
            # a bucket launched from a hook was ready when launched; the others wait for backward
            ready = [max(b["launch_ms"], 0.0) / 1e3 if row["launched in backward"] else last_ready
                     for b in buckets]
            tail = serial_tail(ready + [last_ready], [b["bytes"] for b in buckets] + [0],
                               latency, bandwidth)
            row["predicted tail ms"] = 1e3 * tail
    best_bytes, best_tail = best_bucket(total_bytes, backward_s, latency, bandwidth)
    curve = [{"bucket_bytes": b, "tail_s": uniform_tail(total_bytes, backward_s, b, latency, bandwidth)}
             for b in sorted({min(total_bytes, int(KiB * 2 ** (k / 2))) for k in range(0, 2 * 40)})]
    return {"backward_s": backward_s, "best_bucket_bytes": best_bytes, "best_tail_s": best_tail,
            "curve": curve}


# --- figures -----------------------------------------------------------------------------------

def draw_timeline(ax, timeline: dict, title: str) -> None:
    """One step on one rank: when gradients became ready (ticks on the backward row) and each
    all-reduce from launch to finish (one row per bucket); the exposed tail shaded red."""
    ready, buckets = timeline["ready_ms"], timeline["buckets"]
    ax.broken_barh([(0, max(ready))], (-0.4, 0.8), color="tab:blue", alpha=0.25)
    ax.plot(ready, [0] * len(ready), "|", color="tab:blue", markersize=10)
    for i, b in enumerate(buckets, start=1):
        ax.broken_barh([(b["launch_ms"], max(b["finish_ms"] - b["launch_ms"], 1e-3))],
                       (i - 0.4, 0.8), color="tab:orange")
    end = max([b["finish_ms"] for b in buckets] + [max(ready)])
    ax.axvspan(max(ready), end, color="tab:red", alpha=0.15,
               label=f"exposed tail {timeline['tail_ms']:.1f} ms")
    ax.set_yticks([0] + list(range(1, len(buckets) + 1)),
                  ["backward"] + [f"{b['bytes'] / KiB:.0f} KiB" for b in buckets], fontsize=6)
    ax.set(title=title, xlabel="ms since backward started")
    ax.legend(loc="upper left", fontsize=7)


def draw_tail_model(ax, model: dict, rows: list[dict]) -> None:
    """The alpha-beta model's exposed tail over bucket sizes, and each measured bucketed row."""
    curve = model["curve"]
    ax.plot([c["bucket_bytes"] / KiB for c in curve], [1e3 * c["tail_s"] for c in curve],
            color="gray", label="alpha-beta model (equal buckets)")
    ax.axvline(model["best_bucket_bytes"] / KiB, color="gray", linestyle="--",
               label=f"model's best: {model['best_bucket_bytes'] / KiB:.0f} KiB")
    for row in rows:
        if "timeline" in row and row["launched in backward"]:
            mean_bucket = 1e6 * row["MB/step"] / row["buckets/step"] / KiB
            ax.scatter([mean_bucket], [row["tail ms"]], label=f"{row['method']} (measured)")
    ax.set_xscale("log")
    ax.set(title="Exposed tail after backward vs bucket size", xlabel="bucket size (KiB)",
           ylabel="tail (ms)")
    ax.legend(fontsize=7)


@dataclass(frozen=True)
class Run(runs.Run):
    """The MLP timed (depth x Linear(width, width)), the local batch, the bucket caps (MiB:
    several buckets of several parameters at every cap, above one layer's weight and bias, 257 KiB
    at full size, below the whole model, 6 MiB), the timing rounds and repeats, and the message
    sizes (bytes) the alpha-beta model is fitted on, with its repeats."""
    width: int = 256
    depth: int = 24
    local_batch_size: int = 256
    caps_mb: tuple[float, ...] = (2.0, 1.0, 0.5)
    rounds: int = 3
    repeats: int = 3
    fit_sizes: tuple[int, ...] = (4, 64 * KiB, MiB, 4 * MiB)
    fit_repeats: int = 5
    SMOKE = dict(width=128, depth=8, local_batch_size=64, caps_mb=(0.125,), rounds=1, repeats=2,
                 fit_sizes=(4, 256 * KiB, 4 * MiB), fit_repeats=3)


def run(ctx: DistContext, cfg: Run) -> dict:
    width, depth, local_batch_size = cfg.width, cfg.depth, cfg.local_batch_size
    caps_mb, rounds, repeats = list(cfg.caps_mb), cfg.rounds, cfg.repeats
    total_bytes = depth * (width * width + width) * 4
    ctx.print0(f"MLP {depth} x Linear({width}, {width}): {total_bytes / MiB:.2f} MiB of fp32 "
               f"gradients, local batch {local_batch_size}, {ctx.world_size} ranks, {ctx.backend} "
               f"on {ctx.device}")
    rows = bench(ctx, width, depth, local_batch_size, caps_mb, rounds, repeats)
    model = alpha_beta(ctx, list(cfg.fit_sizes), repeats=cfg.fit_repeats)
    model.update(predictions(rows, model, total_bytes))
    config = {"width": width, "depth": depth, "local_batch_size": local_batch_size,
              "caps_mb": caps_mb, "samples": rounds * repeats, "total_bytes": total_bytes,
              "layer_bytes": (width * width + width) * 4}  # a cap below it: one bucket per parameter
    result = {"bench": rows, "alpha_beta": model, "bench_config": config}
    ctx.report(**result)
    if ctx.rank == 0:
        table([{k: v for k, v in r.items() if k != "timeline"} for r in rows if "unsolved" not in r],
              title=f"one training step, median of {rounds * repeats} (rank 0's clock)")
        print(f"all-reduce = {1e6 * model['latency_s']:.0f} us + bytes / "
              f"{model['bandwidth_Bps'] / 1e9:.2f} GB/s; backward {1e3 * model['backward_s']:.1f} ms; "
              f"best bucket by the model {model['best_bucket_bytes'] / KiB:.0f} KiB "
              f"(tail {1e3 * model['best_tail_s']:.2f} ms)", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        run(ctx, cfg)


if __name__ == "__main__":
    main()
