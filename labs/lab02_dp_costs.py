"""Lab 02 (costs): device semantics, and what DataParallel's design costs, measured.

Run:  ./run.sh 02      (or: ./run.sh labs/lab02_dp_costs.py); rank 0 measures, other ranks idle.

- Devices: every tensor and module lives on a device; mixing devices raises; CUDA is asynchronous.
- The real nn.DataParallel on this machine (a pass-through without GPUs) against the plain module,
  and what torch.nn.parallel's CUDA primitives say to CPU tensors.
- ThreadDataParallel (labs/lab02_data_parallel.py, the homework): time per phase, bytes held by
  replica 0 against the others, bytes replica 0 sends and receives as the replica count N grows
  (C*(N-1) each way for C bytes of parameters: the lecture's parameter-server star), against what
  NCCL's pipelined broadcast/reduce (real nn.DataParallel on GPUs) and a ring all-reduce (DDP) move
  per link, and Python threads against a serial loop (the GIL). While the homework is a stub
  (student edition) these parts are reported as not done yet and the others still run.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import runs
from helpers.bench import intra_op_threads, measure
from helpers.dist import distributed, gpu_count, synchronize
from helpers.notice import attempt
from helpers.tensors import nbytes
from labs.lab02_data_parallel import (FORWARD_PHASES, ThreadDataParallel, make_batch, make_mlp,
                                      parallel_apply, replicate, scatter)
# notebook 02's readings of these runs live in labs/lab02_readings.py (cells call them here)
from labs.lab02_readings import (  # noqa: F401
    TrafficGrowth, link_bytes_per_direction, plot_traffic, stacked_bars, threads_verdict,
    traffic_growth, traffic_table)

REPO_ROOT = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------------------------
# Devices
# ----------------------------------------------------------------------------------------------


def module_device(module: nn.Module) -> torch.device:
    """A module has no device of its own: it is where its parameters are (all on one here)."""
    devices = {p.device for p in module.parameters()}
    if len(devices) != 1:
        raise ValueError(f"parameters on {len(devices)} devices: {sorted(map(str, devices))}")
    return devices.pop()


def mixed_device_error(device_a: str, device_b: str) -> str:
    """The error PyTorch raises for `a + b` with `a` on device_a and `b` on device_b."""
    a = torch.ones(3, device=device_a)
    b = torch.ones(3, device=device_b)
    try:
        a + b
    except RuntimeError as exc:
        return f"RuntimeError: {str(exc).splitlines()[0]}"
    return f"no error: {device_a} + {device_b} worked"


def launch_vs_wait(device: torch.device | str, size: int = 2048, launches: int = 10) -> dict:
    """Queue `launches` matmuls; time until the Python calls return and until the work is done.

    On CUDA the calls return once the kernels are queued, so a timer without synchronize() measures
    the queueing, not the work. On the CPU every op finishes before it returns: the two agree.
    """
    device = torch.device(device)
    a = torch.randn(size, size, device=device)
    for _ in range(2):  # warm-up: the first CUDA call pays for context and kernel loading
        a @ a
    synchronize(device)
    start = time.perf_counter()
    for _ in range(launches):
        a @ a
    returned = time.perf_counter() - start
    synchronize(device)
    finished = time.perf_counter() - start
    return {"device": str(device), "calls_returned_s": returned, "work_finished_s": finished,
            "ratio": finished / returned}


AGREE = 1.1    # the two clocks "agree" within 10%
QUEUED = 2.0   # on CUDA the calls "returned long before the work finished": at least 2x sooner


def launch_note(timing: dict) -> str:
    """One sentence on a `launch_vs_wait` result, chosen from its numbers (CPU or CUDA device)."""
    ratio, cuda = timing["ratio"], timing["device"].startswith("cuda")
    if cuda and ratio >= QUEUED:
        return (f"the calls returned {ratio:.1f}x sooner than the work finished: a timer without "
                "synchronize() would have measured the queueing, not the work")
    if cuda:
        return (f"not on this run: the calls returned only {ratio:.2f}x sooner than the work "
                f"finished (expected >= {QUEUED:g}x: the kernels were short, or the GPU busy)")
    if ratio <= AGREE:
        return f"CPU ops finish before they return, so both clocks agree (x{ratio:.2f})"
    return (f"not on this run: the clocks differ (x{ratio:.2f}) although CPU ops finish before "
            "they return; the machine was busy between the two readings: re-run")


def launch_vs_wait_in_subprocess(env: dict[str, str], size: int = 2048, launches: int = 10) -> dict:
    """launch_vs_wait on cuda:0 in a fresh Python with extra `env` (CUDA_LAUNCH_BLOCKING=1 must be
    set before CUDA initialises, so it cannot be switched on inside a running notebook)."""
    import os
    code = ("import json; from labs.lab02_dp_costs import launch_vs_wait; "
            f"print(json.dumps(launch_vs_wait('cuda:0', {size}, {launches})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------
# The real nn.DataParallel on this machine
# ----------------------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"


def torch_primitives_on_cpu() -> dict[str, str]:
    """What torch.nn.parallel's replicate/scatter/parallel_apply/gather do with CPU tensors.

    All four refuse: they are written for CUDA devices. On torch's CPU-only build (no
    `torch.version.cuda`), scatter fails earlier, with "module 'torch._C' has no attribute
    '_scatter'": the CUDA communication bindings are compiled only into CUDA builds. That is
    expected there, not a broken install (`primitive_outcome_note` says so next to each outcome)."""
    from torch.nn import parallel as tp
    module, x = nn.Linear(4, 2), torch.randn(6, 4)
    attempts = {
        "replicate(module, [0, 1])": lambda: tp.replicate(module, [0, 1]),
        "scatter(x, [0, 1])": lambda: tp.scatter(x, [0, 1]),
        "parallel_apply([module] * 2, [x[:3], x[3:]])": lambda: tp.parallel_apply([module] * 2,
                                                                                 [x[:3], x[3:]]),
        "gather([x[:3], x[3:]], target_device=-1)": lambda: tp.gather([x[:3], x[3:]], -1),
    }
    outcomes = {}
    for call, try_call in attempts.items():
        try:
            value = try_call()
            outcomes[call] = f"ran, returned {type(value).__name__}"
        except Exception as exc:  # the point is to show the error
            outcomes[call] = _first_line(exc)
    return outcomes


def primitive_outcome_note(outcome: str, cuda_build: bool | None = None) -> str:
    """Why a `torch_primitives_on_cpu` outcome is what it is (every refusal here is expected)."""
    cuda_build = torch.version.cuda is not None if cuda_build is None else cuda_build
    if outcome.startswith("ran"):
        return "ran: this call accepts CPU tensors in this torch version"
    if "torch._C" in outcome and "has no attribute" in outcome and not cuda_build:
        return ("expected: torch's CPU-only build has no CUDA communication bindings "
                "(torch._C._scatter, _broadcast_coalesced); not a broken install")
    return "expected: written for CUDA devices, refuses CPU tensors"


def _seconds(fn, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().cpu().double() - b.detach().cpu().double()).abs().max().item()


def _forward_backward(models: dict[str, nn.Module], inputs: dict[str, tuple]) -> tuple[dict, dict]:
    """Outputs and parameter gradients of one cross-entropy step per named model."""
    outs, grads = {}, {}
    for name, model in models.items():
        x, y = inputs[name]
        outs[name] = model(x)
        F.cross_entropy(outs[name], y).backward()
        module = model.module if isinstance(model, (nn.DataParallel, ThreadDataParallel)) else model
        grads[name] = [p.grad for p in module.parameters()]
    return outs, grads


def dataparallel_probe(width: int, depth: int, batch_size: int, repeats: int = 20) -> dict:
    """nn.DataParallel around an MLP against the same MLP alone: device_ids, outputs, grads, time.

    Both run on cuda:0 when a GPU exists (DataParallel then uses every visible GPU), else on CPU.
    """
    num_classes = 10
    device = torch.device("cuda", 0) if gpu_count() >= 1 else torch.device("cpu")
    x, y = make_batch(batch_size, width, num_classes)
    plain = make_mlp(width, depth, num_classes).to(device)
    dp_model = make_mlp(width, depth, num_classes).to(device)
    wrapped = nn.DataParallel(dp_model)
    batch = (x.to(device), y.to(device))
    outs, grads = _forward_backward({"plain": plain, "dp": wrapped}, {"plain": batch, "dp": batch})
    bare, via_dp = [], []
    with torch.no_grad():  # interleaved, so both see the same machine load
        for _ in range(repeats + 2):
            bare.append(_seconds(lambda: plain(x.to(device)), device))
            via_dp.append(_seconds(lambda: wrapped(x.to(device)), device))
    bare_s, dp_s = statistics.median(bare[2:]), statistics.median(via_dp[2:])  # the first two warm up
    return {
        "device": str(device), "gpus": gpu_count(), "device_ids": list(wrapped.device_ids),
        "dp_module_is_model": wrapped.module is dp_model,
        "outputs_identical": bool(torch.equal(outs["plain"], outs["dp"])),
        "output_diff_dp_vs_plain": max_diff(outs["plain"], outs["dp"]),
        "grad_diff_dp_vs_plain": max(max_diff(a, b) for a, b in zip(grads["plain"], grads["dp"])),
        "bare_s": bare_s, "dp_s": dp_s, "dp_over_bare": dp_s / bare_s,
    }


def ours_vs_dataparallel(width: int, depth: int, batch_size: int, num_replicas: int = 2) -> dict:
    """ThreadDataParallel (CPU replicas) against nn.DataParallel (every GPU, or the CPU
    pass-through without one) on the same batch: the largest output and gradient differences."""
    num_classes = 10
    device = torch.device("cuda", 0) if gpu_count() >= 1 else torch.device("cpu")
    x, y = make_batch(batch_size, width, num_classes)
    wrapped = nn.DataParallel(make_mlp(width, depth, num_classes).to(device))
    ours = ThreadDataParallel(make_mlp(width, depth, num_classes), num_replicas)
    outs, grads = _forward_backward({"dp": wrapped, "ours": ours},
                                    {"dp": (x.to(device), y.to(device)), "ours": (x, y)})
    return {"replicas": ours.last_step.num_replicas, "dp device_ids": list(wrapped.device_ids),
            "output_diff_ours_vs_dp": max_diff(outs["ours"], outs["dp"]),
            "grad_diff_ours_vs_dp": max(max_diff(a, b) for a, b in zip(grads["ours"], grads["dp"]))}


@dataclass(frozen=True)
class Equivalence:
    """ThreadDataParallel against the plain module on one batch: the largest differences."""
    replicas: int          # replicas asked for
    batch: int
    replicas_used: int     # fewer when the batch gives fewer pieces (scatter follows torch.chunk)
    outputs: float
    input_grads: float
    param_grads: float

    def worst(self) -> float:
        return max(self.outputs, self.input_grads, self.param_grads)


def equivalence(num_replicas: int, batch_size: int, width: int = 16, num_classes: int = 5) -> Equivalence:
    """One cross-entropy step of ThreadDataParallel and of the plain module (same weights, same
    batch); the largest differences of outputs, input gradients and parameter gradients."""
    torch.manual_seed(0)
    x, y = torch.randn(batch_size, width), torch.randint(0, num_classes, (batch_size,))
    plain, master = make_mlp(width, 2, num_classes), make_mlp(width, 2, num_classes)  # same seed: same weights
    x_plain, x_dp = x.clone().requires_grad_(), x.clone().requires_grad_()
    tdp = ThreadDataParallel(master, num_replicas)
    out_plain, out_dp = plain(x_plain), tdp(x_dp)
    F.cross_entropy(out_plain, y).backward()
    F.cross_entropy(out_dp, y).backward()
    return Equivalence(num_replicas, batch_size, tdp.last_step.num_replicas, max_diff(out_dp, out_plain),
                       max_diff(x_dp.grad, x_plain.grad),
                       max(max_diff(a.grad, b.grad) for a, b in zip(master.parameters(), plain.parameters())))


# ----------------------------------------------------------------------------------------------
# ThreadDataParallel, measured
# ----------------------------------------------------------------------------------------------


def phase_times(width: int, depth: int, batch_size: int, replica_counts,
                steps: int = 5) -> list[dict]:
    """Median seconds per phase of a training step (forward phases + loss/backward), per N.

    Torch runs 1 intra-op thread meanwhile: each replica thread stands for one device, and intra-op
    thread teams (one per calling thread) would otherwise oversubscribe the cores and add noise.
    """
    num_classes = 10
    x, y = make_batch(batch_size, width, num_classes)
    plain = make_mlp(width, depth, num_classes)

    def plain_step():
        F.cross_entropy(plain(x), y).backward()

    with intra_op_threads(1):
        rows = [{"replicas": "plain module", "step": measure(plain_step, repeats=steps).median}]
        for num_replicas in replica_counts:
            rows.append(_phase_row(ThreadDataParallel(make_mlp(width, depth, num_classes),
                                                      num_replicas), x, y, steps))
    return rows


def _phase_row(tdp: ThreadDataParallel, x, y, steps: int) -> dict:
    samples: dict[str, list[float]] = {p: [] for p in (*FORWARD_PHASES, "loss + backward")}
    for step in range(steps + 1):  # the first step warms up
        out = tdp(x)
        start = time.perf_counter()
        F.cross_entropy(out, y).backward()
        backward_s = time.perf_counter() - start
        if step:
            for phase in FORWARD_PHASES:
                samples[phase].append(tdp.last_step.seconds[phase])
            samples["loss + backward"].append(backward_s)
    row = {"replicas": tdp.num_replicas, **{p: statistics.median(v) for p, v in samples.items()}}
    row["step"] = sum(row[p] for p in samples)
    return row


def memory_by_replica(width: int, num_classes: int, batch_size: int,
                      num_replicas: int) -> list[dict]:
    """Bytes of the tensors each replica holds during one step (a wide output layer, LM-head-like).

    From ThreadDataParallel's record of real tensors, after backward; the loss sits on replica 0.
    """
    model = make_mlp(width, 1, num_classes)
    x, y = make_batch(batch_size, width, num_classes)
    tdp = ThreadDataParallel(model, num_replicas)
    loss = F.cross_entropy(tdp(x), y)
    loss.backward()
    rows = []
    for index, held in enumerate(tdp.last_step.held):
        row = {"replica": index, **held}
        if index == 0:
            row["loss"] = loss.nbytes
        row["total"] = sum(v for k, v in row.items() if k != "replica")
        rows.append(row)
    return rows


def traffic_vs_replicas(width: int, depth: int, batch_size: int, replica_counts) -> list[dict]:
    """Bytes replica 0 sent and received in one training step, measured, per replica count N."""
    num_classes = 10
    model = make_mlp(width, depth, num_classes)
    param_bytes = nbytes(model.parameters())
    x, y = make_batch(batch_size, width, num_classes)
    rows = []
    for num_replicas in replica_counts:
        model.zero_grad(set_to_none=True)
        tdp = ThreadDataParallel(model, num_replicas)
        F.cross_entropy(tdp(x), y).backward()
        record = tdp.last_step
        rows.append({"replicas": record.num_replicas, **record.moved, "total": record.moved_total,
                     "sent": record.sent, "received": record.received,
                     "C": param_bytes, "C*(N-1)": param_bytes * (record.num_replicas - 1)})
    return rows


def serial_apply(replicas, inputs) -> list:
    """parallel_apply's result computed in a plain loop, one replica after the other."""
    return [replica(chunk) for replica, chunk in zip(replicas, inputs)]


def threads_vs_serial(configs: dict[str, dict], num_replicas: int = 2,
                      repeats: int = 7) -> list[dict]:
    """Forward of `num_replicas` replicas: one thread each vs a serial loop, per model config.

    configs: name -> dict(width, depth, batch_size). Torch runs 1 intra-op thread meanwhile, so any
    speed-up comes from the Python threads running kernels at the same time (they release the GIL);
    many tiny ops spend their time in Python and the dispatcher, under the GIL, and gain nothing.
    """
    rows = []
    for name, cfg in configs.items():
        model = make_mlp(cfg["width"], cfg["depth"], 10)
        x, _ = make_batch(cfg["batch_size"], cfg["width"], 10)
        chunks = scatter(x, num_replicas)
        with torch.no_grad(), intra_op_threads(1):
            replicas = replicate(model, len(chunks))
            serial, threaded = [], []
            for _ in range(repeats + 2):  # interleaved: both see the same machine load
                serial.append(_seconds(lambda: serial_apply(replicas, chunks), x.device))
                threaded.append(_seconds(lambda: parallel_apply(replicas, chunks), x.device))
        serial_s, threads_s = statistics.median(serial[2:]), statistics.median(threaded[2:])  # two warm-ups
        ratios = [s / t for s, t in zip(serial[2:], threaded[2:])]  # each pair ran back to back
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        ops = 2 * cfg["depth"] + 1  # linear and relu ops per replica forward
        rows.append({"model": name, **cfg, "params": sum(p.numel() for p in model.parameters()),
                     "ms_per_op": 1e3 * serial_s / (ops * len(chunks)),
                     "serial_s": serial_s, "threads_s": threads_s, "speedup": serial_s / threads_s,
                     "speedup_q1": q1, "speedup_q3": q3})
    return rows


@dataclass(frozen=True)
class Run(runs.Run):
    """Sizes of notebook 02's measurements (and of this file's run): the matmul timed against the
    clock and how many; the MLP width and batch of the DataParallel probe (and its repeats),
    of ours against DataParallel and of the traffic count (its batch: traffic_batch); the phases'
    model and steps; the memory count's model (a wide output layer); and the big model of the
    threads-vs-loop race, with its repeats."""
    launch_size: int = 1024
    launches: int = 10
    width: int = 512
    batch_size: int = 256
    probe_repeats: int = 30
    phase_width: int = 1024
    phase_steps: int = 7
    memory_width: int = 256
    memory_classes: int = 8192
    memory_batch: int = 256
    traffic_batch: int = 64
    gil_width: int = 1024
    gil_batch: int = 512
    gil_repeats: int = 9
    SMOKE = dict(launch_size=256, launches=3, width=64, batch_size=32, probe_repeats=20,
                 phase_width=64, phase_steps=3, memory_width=32, memory_classes=512, memory_batch=32,
                 traffic_batch=16, gil_width=512, gil_batch=128, gil_repeats=5)


def main(argv: list[str] | None = None) -> None:
    from helpers.show import table
    c = Run.from_argv(argv)
    with distributed() as ctx:
        if ctx.rank != 0:
            return  # one-process measurements: the other ranks have nothing to do
        print("cpu + meta ->", mixed_device_error("cpu", "meta"))
        print("launch vs wait:", launch_vs_wait(ctx.device, c.launch_size, c.launches))
        table([dataparallel_probe(c.width, 2, c.batch_size, repeats=c.probe_repeats)],
              ["device", "device_ids", "outputs_identical", "grad_diff_dp_vs_plain", "dp_over_bare"],
              title="nn.DataParallel here")
        table([{"call": call, "outcome": outcome, "why": primitive_outcome_note(outcome)}
               for call, outcome in torch_primitives_on_cpu().items()],
              title="torch.nn.parallel primitives with CPU tensors")
        # The rest runs the homework's four steps: each part is skipped with a notice while a
        # step is still a stub (student edition).
        parts = {
            "ThreadDataParallel vs nn.DataParallel":
                lambda: [ours_vs_dataparallel(c.width, 2, c.batch_size)],
            "ThreadDataParallel: median seconds per phase of one training step":
                lambda: phase_times(c.phase_width, 3, c.batch_size, [1, 2, 4], steps=c.phase_steps),
            "bytes held per replica (2 replicas, wide output layer)":
                lambda: memory_by_replica(c.memory_width, c.memory_classes, c.memory_batch, 2),
            "bytes replica 0 sent and received per training step":
                lambda: [{k: r[k] for k in ("replicas", "sent", "received", "C*(N-1)")}
                         for r in traffic_vs_replicas(c.width, 2, c.traffic_batch,
                                                      [1, 2, 4, 8])],
            "2 replicas: Python threads vs a serial loop (torch uses 1 thread)":
                lambda: threads_vs_serial({"small": dict(width=32, depth=16, batch_size=16),
                                           "large": dict(width=c.gil_width, depth=2,
                                                         batch_size=c.gil_batch)},
                                          repeats=c.gil_repeats),
        }
        columns = {"ThreadDataParallel: median seconds per phase of one training step":
                   ["replicas", *FORWARD_PHASES, "loss + backward", "step"]}
        for title, part in parts.items():
            rows = attempt(part)
            if isinstance(rows, list):
                table(rows, columns.get(title), title=title)


if __name__ == "__main__":
    main()
