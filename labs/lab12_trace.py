"""Lab 12 (where the time goes): a torch.profiler trace of the composed run on every rank, parsed
into a timeline of compute, each mesh dimension's collectives and the pipeline's idle time; tokens
per second and model FLOPs utilisation against this machine's measured matmul rate.

Run:  ./run.sh 12      (8 ranks; alone: NPROC=8 ./run.sh labs/lab12_trace.py). The traces are
                        written to runs/lab12/trace/rank<r>.json: open one in https://ui.perfetto.dev
                        or chrome://tracing)

What the profiler records on the CPU: every operator, autograd's backward functions, FSDP2's own
labels (`FSDP::all_gather`, `FSDP::all_gather_copy_out` (the wait), `FSDP::post_backward_reduce`)
and gloo's work on its own threads. It does not say which process group a collective used, so
while profiling this lab labels each collective itself (`CommLabels`, the course's traffic meter,
wraps every call it sees, DTensor's own included, and the wait for a functional one, in
`record_function("comm <dim> <kind>")`) and the pipeline schedule's waits for its messages
(`pipeline wait`). The timeline of a rank is its main thread: the labelled intervals, and compute
in between.

MFU (Chowdhery et al. 2022, PaLM, arXiv:2204.02311, appendix B): the model's training FLOPs per
step (6 per weight per token plus attention, `model_flops_per_token`) over the step time, divided
by the hardware's peak FLOP/s. A CPU has no datasheet peak to divide by, so here the divisor is a
*measured matmul rate*: the FLOP/s of a large float32 matmul run on every rank at once (the ranks
share this machine's cores as they do in training), summed over the ranks. It is an upper bound on
what a matmul reaches here, not the machine's theoretical peak, so this "MFU" reads higher than
MFU against a peak would.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

from helpers import pick
from helpers.dist import DistContext, distributed
from helpers.memory import quiet_stderr
from helpers.traffic import TrafficMeter
from labs.lab12_model import LMConfig, corpus, default_config, model_flops_per_token, split
from labs.lab12_parallelize import mesh_shape
from labs.lab12_train import Trainer

LAB_NPROC = 8
TRACE_DIR = Path(__file__).resolve().parent.parent / "runs" / "lab12" / "trace"
# FSDP2's own labels for its communication on the dp dimension
FSDP_COMM = ("FSDP::all_gather", "FSDP::all_gather_copy_out", "FSDP::post_backward_reduce")
PIPELINE_WAIT = "pipeline wait"
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")    # the matrix products' kernels


# =============================================================================== labelling
class CommLabels(TrafficMeter):
    """The traffic meter (helpers/traffic.py: DTensor's collectives too), wrapping each call it
    sees, and the wait for a functional collective's result, in a profiler label
    "comm <mesh dimension> <kind>"."""

    def __init__(self, mesh):
        super().__init__(mesh)
        self.pending: dict[int, str] = {}   # output storage of a functional collective -> dimension

    def issue(self, func, args, kwargs, calls):
        if calls:
            with record_function(f"comm {calls[0].dim} {calls[0].kind}"):
                out = func(*args, **kwargs)
            if calls[0].functional and isinstance(out, torch.Tensor):
                self.pending[_storage(out)] = calls[0].dim
            return out
        if func.namespace == "_c10d_functional" and func._schema.name.endswith("wait_tensor"):
            dim = self.pending.pop(_storage(args[0]), None)
            if dim is not None:
                with record_function(f"comm {dim} wait"):
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return id(t)


@contextlib.contextmanager
def labelled_pipeline_waits():
    """The schedule's waits for its sends and receives, labelled "pipeline wait"."""
    from torch.distributed.pipelining import schedules

    original = schedules._wait_batch_p2p

    def wait(work):
        if not work:
            return original(work)
        with record_function(PIPELINE_WAIT):
            return original(work)

    schedules._wait_batch_p2p = wait
    try:
        yield
    finally:
        schedules._wait_batch_p2p = original


# ================================================================================ profiling
def profile_steps(trainer: Trainer, data: torch.Tensor, first_step: int, steps: int, path: Path) -> dict:
    """Profile `steps` training steps on this rank, export the chrome trace to `path`, and return
    this rank's parsed timeline."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if trainer.ctx.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    with quiet_stderr():
        prof.start()
    try:
        with labelled_pipeline_waits(), CommLabels(trainer.mesh):
            for step in range(first_step, first_step + steps):
                with record_function(f"step {step}"):
                    trainer.train_step(data, step)
    finally:
        with quiet_stderr():
            prof.stop()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return timeline(json.loads(path.read_text()), trainer.dp)


def category(name: str, dp_size: int = 2) -> str | None:
    """The timeline category of a labelled event, or None (not a label of ours or FSDP's). With
    one dp rank FSDP's labels mark local copies, not communication."""
    if name == PIPELINE_WAIT:
        return "pipeline idle"
    if name.startswith("comm "):
        return f"{name.split()[1]} communication"
    if name.split(" (")[0] in FSDP_COMM and dp_size > 1:
        return "dp communication"
    return None


def timeline(trace: dict, dp_size: int = 2) -> dict:
    """A rank's main thread from its chrome trace: the steps' span, and disjoint intervals
    [start ms, end ms, category] (the outermost labelled interval wins; the rest is compute),
    with the seconds spent in each category, and the seconds of its matmul kernels (`MATMULS`,
    inside compute: the part of it that is FLOPs at a matmul's rate)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    main = min((e for e in events if e["name"].startswith("step ")), key=lambda e: e["ts"])
    main_tid, pid = main["tid"], main["pid"]
    mine = [e for e in events if e["tid"] == main_tid and e["pid"] == pid]
    steps = sorted((e for e in mine if e["name"].startswith("step ")), key=lambda e: e["ts"])
    begin, end = steps[0]["ts"], max(e["ts"] + e["dur"] for e in steps)
    labelled = sorted(((e["ts"], e["ts"] + e["dur"], category(e["name"], dp_size)) for e in mine
                       if category(e["name"], dp_size) is not None), key=lambda x: (x[0], -x[1]))
    intervals, cursor = [], begin
    for start, stop, what in labelled:
        if stop <= cursor:
            continue                         # inside an interval already placed
        start = max(start, cursor)
        if start > cursor:
            intervals.append([cursor, start, "compute"])
        intervals.append([start, stop, what])
        cursor = stop
    if cursor < end:
        intervals.append([cursor, end, "compute"])
    totals: dict[str, float] = {}
    for start, stop, what in intervals:
        totals[what] = totals.get(what, 0.0) + (stop - start) / 1e6
    matmul, reached = 0.0, begin              # matmul kernels inside the steps, each once
    for e in sorted((e for e in mine if e["name"] in MATMULS), key=lambda e: e["ts"]):
        start, stop = max(e["ts"], reached), min(e["ts"] + e["dur"], end)
        if stop > start:
            matmul += (stop - start) / 1e6
            reached = stop
    return {"span_s": (end - begin) / 1e6, "steps": len(steps), "totals_s": totals, "matmul_s": matmul,
            "intervals": [[(a - begin) / 1e3, (b - begin) / 1e3, what] for a, b, what in intervals]}


# ====================================================================================== MFU
def matmul_peak(ctx: DistContext, n: int = 512, window_s: float = 0.5) -> dict:
    """FLOP/s of n x n float32 matmuls that every rank runs at the same time for `window_s`
    seconds (after a barrier, so the windows overlap), and their sum over the ranks: the
    machine's peak as the training run's ranks, sharing its cores, can reach it."""
    from helpers.dist import synchronize

    a = torch.randn(n, n, device=ctx.device)
    b = torch.randn(n, n, device=ctx.device)
    for _ in range(2):                                   # warm-up
        a @ b
    synchronize(ctx.device)
    ctx.barrier()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < window_s:
        a @ b
        synchronize(ctx.device)
        count += 1
    mine = torch.tensor([2 * n ** 3 * count / (time.perf_counter() - start)], dtype=torch.float64,
                        device=ctx.device)
    total = mine.clone()
    if ctx.world_size > 1:
        dist.all_reduce(total)
    return {"n": n, "rank_flops_per_s": mine.item(), "sum_flops_per_s": total.item()}


def run(ctx: DistContext, *, config: LMConfig | None = None, shape=None, warmup: int = 2,
        timed: int = 3, profiled: int = 1, trace_dir: Path = TRACE_DIR, peak_window_s: float = 0.5) -> dict:
    """Warm up, time `timed` steps (tokens/s, MFU), profile `profiled` more (trace + timeline)."""
    config = config or default_config()
    shape = tuple(shape or mesh_shape(ctx.world_size))
    data, _ = split(corpus())
    trainer = Trainer(ctx, config, shape)
    for step in range(warmup):
        trainer.train_step(data, step)
    seconds = []
    for step in range(warmup, warmup + timed):
        ctx.barrier()
        start = time.perf_counter()
        trainer.train_step(data, step)
        seconds.append(time.perf_counter() - start)
    step_s = sorted(seconds)[len(seconds) // 2]
    peak = matmul_peak(ctx, window_s=peak_window_s)
    tokens = config.batch * config.seq
    flops = model_flops_per_token(config) * tokens
    path = trace_dir / f"rank{ctx.rank}.json"
    line = profile_steps(trainer, data, warmup + timed, profiled, path)
    return {"shape": list(shape), "config": config.as_dict(), "step_seconds": seconds, "step_s": step_s,
            "tokens_per_step": tokens, "tokens_per_s": tokens / step_s, "model_flops_per_step": flops,
            "achieved_flops_per_s": flops / step_s, "peak": peak, "mfu": flops / step_s / peak["sum_flops_per_s"],
            "trace": str(path), "timeline": line}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timed", type=int, default=pick(5, 2))
    parser.add_argument("--profiled", type=int, default=pick(2, 1))
    parser.add_argument("--trace-dir", default=str(TRACE_DIR))
    return parser.parse_args(argv)


def main(argv=None) -> None:
    """The profiled run, reported under "trace" ({"unsolved": ...} while an exercise is a stub)."""
    from helpers.notice import attempt
    from helpers.show import table

    args = parse_args(argv)
    with distributed() as ctx:
        out = attempt(run, ctx, timed=args.timed, profiled=args.profiled, trace_dir=Path(args.trace_dir))
        ctx.report(trace=out)
        if ctx.rank == 0 and "unsolved" not in out:
            print(f"{' x '.join(map(str, out['shape']))} mesh: step {1e3 * out['step_s']:.0f} ms, "
                  f"{out['tokens_per_s']:.0f} tokens/s, {out['achieved_flops_per_s'] / 1e9:.2f} GFLOP/s of "
                  f"model FLOPs; measured matmul rate {out['peak']['sum_flops_per_s'] / 1e9:.1f} GFLOP/s "
                  f"(all ranks): MFU against it {100 * out['mfu']:.2f}%", flush=True)
            line = out["timeline"]
            table([{"category": k, "seconds": v, "share": v / line["span_s"]} for k, v in
                   sorted(line["totals_s"].items())],
                  title=f"rank 0's main thread over {line['steps']} profiled step(s); trace: {out['trace']}")

if __name__ == "__main__":
    main()
