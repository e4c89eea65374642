"""Lab 01: the GIL, threads and processes, measured with the same total work.

Run:  ./run.sh 01
      (or: python -c "from helpers.launch import launch; launch('labs/lab01_gil_threads.py')")

Every rank runs pure-Python CPU work. Rank 0 measures, in one run, the throughput of
  1 process  (rank 0 alone does all the work, the other ranks wait),
  2 threads  (rank 0 splits the same work over 2 threads of its one process),
  2 processes (every rank does its share at the same time, as DDP's ranks do),
and reports the ratios. CPython's Global Interpreter Lock lets one thread at a time run bytecode, so
the threads take turns while the processes, each with its own interpreter and GIL, run side by
side. That is why DistributedDataParallel runs one process per device (notebook 03).

The module is also the notebook's toolbox: the workloads below are top-level functions so that a
process pool can pickle them by name (a function defined in a notebook lives in `__main__`, which a
fresh worker process cannot import), and `parallel_map` is the homework exercise.
"""
from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os
import statistics
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import psutil
import torch
import torch.distributed as dist

from helpers import pick
from helpers.bench import intra_op_threads, measure
from helpers.dist import DistContext, distributed

KINDS = ("serial", "thread", "process")


# --- workloads: each takes one item, returns a deterministic result --------------------------

def python_work(item: tuple[int, int]) -> int:
    """Pure-Python CPU work: `iterations` rounds of integer arithmetic in the interpreter.

    item = (seed, iterations). Every round runs a handful of bytecodes while holding the GIL.
    """
    seed, iterations = item
    total = seed
    for i in range(iterations):
        total = (total * 31 + i) % 1_000_003
    return total


def matmul_work(item: tuple[int, int, int]) -> float:
    """Large matrix products on one intra-op thread: item = (seed, n_matmuls, size).

    Each `a @ b` is (size, size) @ (size, size), about 2 * size**3 flops in one C++ kernel call,
    which releases the GIL while it runs.
    """
    seed, n_matmuls, size = item
    with intra_op_threads(1):
        gen = torch.Generator().manual_seed(seed)
        a = torch.randn(size, size, generator=gen)  # (size, size)
        b = torch.randn(size, size, generator=gen) / size**0.5
        total = 0.0
        for _ in range(n_matmuls):
            total += float((a @ b)[0, 0])
        return total


def tiny_ops_work(item: tuple[int, int]) -> float:
    """Many tiny torch ops: item = (seed, steps); each step is two ops on a 4-element tensor.

    The arithmetic takes nanoseconds; the microseconds go to Python and the dispatcher (argument
    parsing, dispatch, allocation), which run while holding the GIL: dispatch bound.
    """
    seed, steps = item
    with intra_op_threads(1):
        x = torch.full((4,), float(seed))  # (4,)
        for _ in range(steps):
            x = (x + 1.0) - 0.5  # exact in float32: x = seed + steps / 2
        return float(x.sum())


def io_work(item: tuple[int, float]) -> int:
    """IO-bound work: wait `seconds` (a stand-in for a disk read or a network reply), return seed.

    CPython releases the GIL around blocking calls (sleep, read, recv), so waiting threads overlap.
    """
    seed, seconds = item
    time.sleep(seconds)
    return seed


def where_am_i(item: Any) -> tuple[Any, int, str]:
    """(item, process id, thread name) of the worker that ran this item."""
    return item, os.getpid(), threading.current_thread().name


@dataclass(frozen=True)
class Workload:
    name: str
    fn: Callable[[Any], Any]
    total_full: float      # total work: loop iterations, matmuls, op steps or seconds of waiting
    total_smoke: float
    whole: bool = True     # the work comes in whole units (not seconds)
    extra: tuple = ()      # appended to every item, e.g. the matmul size

    def items(self, n_items: int, total: float | None = None) -> list[tuple]:
        """Split the total work into `n_items` items (the same total for any worker count)."""
        if n_items < 1:
            raise ValueError(f"n_items must be >= 1, got {n_items}")
        total = pick(self.total_full, self.total_smoke) if total is None else total
        share = max(1, round(total / n_items)) if self.whole else total / n_items
        return [(seed, share, *self.extra) for seed in range(n_items)]


WORKLOADS = {
    w.name: w for w in (
        Workload("python", python_work, 12_000_000, 2_000_000),       # loop iterations
        Workload("matmul", matmul_work, 192, 48, extra=(512,)),        # 512x512 matmuls
        Workload("tiny_ops", tiny_ops_work, 100_000, 20_000),          # steps of 2 tiny ops
        Workload("io", io_work, 0.8, 0.2, whole=False),                # seconds of waiting
    )
}


# --- the exercise ------------------------------------------------------------------------------

def worker_context() -> multiprocessing.context.BaseContext:
    """How new worker processes start: quickly and safely.

    Not `fork`: forking a process that already runs threads (a notebook kernel, torch's OpenMP
    pool) can deadlock the child, and Python 3.14 stopped using it by default. `forkserver` forks
    each worker from a clean server process; preloading torch there makes a worker start in
    milliseconds instead of importing torch (~1.5 s) again. `spawn` where forkserver is missing.
    The function and the items travel to the workers pickled, functions by module and name, so a
    worker must be able to import them: top-level functions of a module, not of a notebook.
    """
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch"])  # only takes effect before the server starts
        return context
    return multiprocessing.get_context("spawn")


def process_pool(workers: int) -> futures.ProcessPoolExecutor:
    """A pool of `workers` worker processes started by `worker_context()`."""
    return futures.ProcessPoolExecutor(max_workers=workers, mp_context=worker_context())


def parallel_map(fn: Callable[[Any], Any], items: Iterable[Any], workers: int,
                 kind: str) -> list[Any]:
    """Apply `fn` to every item and return the results as a list, in the order of `items`.

    kind:
      "serial"  : one call after another in this thread (`workers` is checked but unused);
      "thread"  : a pool of `workers` threads in this process
                  (concurrent.futures.ThreadPoolExecutor);
      "process" : a pool of `workers` processes, made with `process_pool(workers)` above
                  (`fn` and the items must be picklable: top-level functions of a module).
    Raise ValueError if `kind` is not one of KINDS or `workers` is not an int >= 1, before any
    work starts. An exception raised by `fn` on any item propagates to the caller (with its
    own type). Results come back in input order even when later items finish first.
    The tests check that every kind returns exactly the serial results, the order, the errors,
    and that "thread" runs in threads of this process and "process" in other processes, with
    up to `workers` items running at the same time.
    """
    ### BEGIN SOLUTION
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    items = list(items)
    if kind == "serial":
        return [fn(item) for item in items]
    if kind == "thread":
        with futures.ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(fn, items))  # map yields in submission order
    # A few items per task message amortises the pickling and pipe round trip per item.
    chunksize = max(1, len(items) // (4 * workers))
    with process_pool(workers) as pool:
        return list(pool.map(fn, items, chunksize=chunksize))
    ### END SOLUTION


# --- measurements for the notebook -------------------------------------------------------------

def available_cores() -> int:
    """Logical cores this process may run on (the affinity mask, not the machine's total)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def compute_cores() -> int:
    """How many CPU-bound workers can run side by side: the usable logical cores, capped at the
    physical cores (two SMT siblings share one core's execution units)."""
    physical = psutil.cpu_count(logical=False) or available_cores()
    return max(1, min(available_cores(), physical))


def ideal_speedup(workload: str, workers: int) -> int:
    """The best speed-up `workers` can reach: one per core for computing, any number for waiting."""
    return workers if workload == "io" else min(workers, compute_cores())


def gil_status() -> dict[str, Any]:
    """Is this a free-threaded build (PEP 703), and is the GIL on right now?"""
    return {
        "python": sys.version.split()[0],
        "free_threaded_build": bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
        # Python < 3.13 has no _is_gil_enabled: the GIL is always on there.
        "gil_enabled": getattr(sys, "_is_gil_enabled", lambda: True)(),
    }


def speedup_table(workload: str, workers: int, kinds: Sequence[str] = ("thread", "process"),
                  total: float | None = None, repeats: int | None = None) -> list[dict[str, Any]]:
    """Time `workload` run serially and with `workers` threads/processes: one row per kind.

    Every row does the same total work, split into 4 * workers items; speedup = serial seconds /
    seconds (medians). `overhead_s` is the time of the same call on trivial items: starting and
    stopping the pool. The parallel results are checked against the serial ones (RuntimeError if
    they differ), so a fast wrong answer never shows up as a speed-up.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {workload!r}")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"kinds must be among {KINDS}, got {bad}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    spec = WORKLOADS[workload]
    items = spec.items(4 * workers, total)
    repeats = pick(3, 2) if repeats is None else repeats
    runs = [("serial", 1)] + [(k, workers) for k in dict.fromkeys(kinds) if k != "serial"]
    expected = parallel_map(spec.fn, items, 1, "serial")
    for kind, n in runs[1:]:  # correctness first; this also warms up (starts the forkserver)
        if parallel_map(spec.fn, items, n, kind) != expected:
            raise RuntimeError(f"{workload} with {n} {kind} worker(s) gave other results "
                               "than serial")
    samples: dict[str, list[float]] = {kind: [] for kind, _ in runs}
    for _ in range(repeats):  # interleave the kinds: a burst of load elsewhere hits them alike
        for kind, n in runs:
            timing = measure(lambda: parallel_map(spec.fn, items, n, kind), warmup=0, repeats=1)
            samples[kind].append(timing.median)
    trivial = [(i, 0) for i in range(len(items))]
    rows = []
    for kind, n in runs:
        overhead = measure(lambda: parallel_map(where_am_i, trivial, n, kind), warmup=0,
                           repeats=repeats).median
        rows.append({"workload": workload, "kind": kind, "workers": n,
                     "seconds": statistics.median(samples[kind]), "overhead_s": overhead,
                     "ideal": ideal_speedup(workload, n)})
    for row in rows:
        row["speedup"] = rows[0]["seconds"] / row["seconds"]
    return rows


def verdict(speedup: float, ideal: float) -> str:
    """'parallel' (>= 75% of the ideal speed-up), 'serialised' (<= 1.25x) or 'partly parallel'."""
    if ideal > 1 and speedup >= 0.75 * ideal:
        return "parallel"
    if speedup <= 1.25:
        return "serialised"
    return "partly parallel"


_WHY = {  # (workload, kind) -> why it behaves as it does with the GIL on
    ("python", "thread"): ("serialised", "the GIL lets one thread at a time run bytecode, so the "
                           "threads took turns"),
    ("python", "process"): ("parallel", "each process has its own interpreter and its own GIL"),
    ("matmul", "thread"): ("parallel", "the matmul kernel releases the GIL while it computes"),
    ("matmul", "process"): ("parallel", "each process has its own interpreter and its own GIL"),
    ("tiny_ops", "thread"): ("serialised", "each op spends its microseconds in Python and the "
                             "dispatcher, holding the GIL; the kernel that releases it is too "
                             "short"),
    ("tiny_ops", "process"): ("parallel", "each process dispatches its own ops under its own GIL"),
    ("io", "thread"): ("parallel", "a blocked thread releases the GIL, so the waits overlap"),
    ("io", "process"): ("parallel", "the waits overlap in separate processes too (but cost more "
                        "to start)"),
}


def lesson(row: dict[str, Any], gil_enabled: bool = True) -> str:
    """One sentence drawn from a measured row: what it measured, and why (or that it surprised).

    row: workload, kind, workers, seconds, speedup, and optionally overhead_s and ideal (the best
    speed-up possible on this machine, `ideal_speedup`; the worker count if absent).
    """
    kind, workers, speedup = row["kind"], row["workers"], row["speedup"]
    if kind == "serial":
        return f"{row['workload']}: the serial baseline, {row['seconds']:.3f} s"
    ideal = row.get("ideal", workers)
    got = verdict(speedup, ideal)
    plural = {"thread": "threads", "process": "processes"}[kind]
    head = f"{row['workload']}: {workers} {plural} gave {speedup:.2f}x (ideal {ideal}x) -> {got}"
    expected, why = _WHY[(row["workload"], kind)]
    if not gil_enabled and (row["workload"], kind) == ("python", "thread"):
        expected, why = "parallel", "this interpreter runs without a GIL (PEP 703)"
    if ideal == 1 and expected == "parallel":
        expected, why = "serialised", "one worker (or one core) cannot run anything side by side"
    if got == expected:
        slower = (" (slower than serial: handing the GIL back and forth between cores costs "
                  "extra)" if speedup < 0.9 else "")
        return f"{head}: {why}{slower}."
    overhead, seconds = row.get("overhead_s", 0.0), row["seconds"]
    if expected == "parallel" and overhead > 0.2 * seconds:
        net = speedup * seconds / max(seconds - overhead, 1e-9)
        return (f"{head}; starting and stopping the pool took {overhead:.3f} s of the "
                f"{seconds:.3f} s (measured on trivial items), too much for this little work; "
                f"without it, about {net:.2f}x ({why}).")
    return f"{head}; expected {expected} ({why}). {_load_note()}Re-run to check."


def _load_note() -> str:
    """The 1-minute load average against the core count: are other programs competing?"""
    if not hasattr(os, "getloadavg"):
        return ""
    load, cores = os.getloadavg()[0], available_cores()
    busy = ": programs were waiting for a core, so this run was disturbed" if load > cores else ""
    return f"Load average {load:.1f} on {cores} cores{busy}. "


def creation_cost(kind: str, count: int = 5) -> float:
    """Median seconds to start and join one thread or one process that does nothing."""
    if kind == "thread":
        make = lambda: threading.Thread(target=int)
    elif kind == "process":
        context = worker_context()  # the start method parallel_map's process pools use
        make = lambda: context.Process(target=int)
    else:
        raise ValueError(f"kind must be 'thread' or 'process', got {kind!r}")

    def start_and_join() -> None:
        worker = make()
        worker.start()
        worker.join()

    # warmup=1: the forkserver starts once per session; keep that out of the per-process cost
    return measure(start_and_join, warmup=1, repeats=count).median


# --- the torchrun part: 1 process vs 2 threads vs 2 processes ---------------------------------

def rank_shard(items: Sequence[Any], rank: int, world_size: int) -> list[Any]:
    """This rank's items: every world_size-th one, starting at `rank` (disjoint, covering all)."""
    return list(items[rank::world_size])


def timed_map(fn: Callable[[Any], Any], items: Sequence[Any], workers: int, kind: str,
              after: Callable[[], None] = lambda: None,
              **measure_args: Any) -> tuple[float, list[Any]]:
    """(seconds, results) of one `parallel_map(fn, items, workers, kind)` followed by `after()`."""
    results: list[Any] = []

    def run() -> None:
        results[:] = parallel_map(fn, items, workers, kind)
        after()

    # warmup=0: pure-Python work has no first-call cost worth discarding
    return measure(run, warmup=0, repeats=1, **measure_args).median, results


def compare_threads_and_processes(ctx: DistContext, items: Sequence[tuple[int, int]],
                                  repeats: int) -> dict[str, Any]:
    """Throughput (items/s) of the same pure-Python work: 1 process, `world_size` threads in rank
    0, and `world_size` processes (the ranks) working at the same time. Returns rank 0's numbers
    (medians over `repeats` rounds) and every rank's checksums (sums of results), so a test can
    check that the shards add up."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    world_size = ctx.world_size
    shard = rank_shard(items, ctx.rank, world_size)
    samples: dict[str, list[float]] = {"serial": [], "threads": [], "processes": []}
    report: dict[str, Any] = {}
    for _ in range(repeats):  # each round runs all three, so a burst of load hits them alike
        # 1 process, then `world_size` threads in one process: rank 0 works, the others wait.
        if ctx.is_main:
            seconds, serial = timed_map(python_work, items, 1, "serial")
            samples["serial"].append(seconds)
            seconds, threaded = timed_map(python_work, items, world_size, "thread")
            samples["threads"].append(seconds)
            report.update(serial_checksum=sum(serial), threads_checksum=sum(threaded),
                          threads_match_serial=threaded == serial)
        ctx.barrier()
        # `world_size` processes: every rank does its shard at the same time; the barrier after
        # the work makes every rank's time the slowest rank's, as in a training step.
        seconds, shard_results = timed_map(python_work, shard, 1, "serial", after=ctx.barrier,
                                           barrier=True, device=ctx.device)
        samples["processes"].append(seconds)
    total = torch.tensor([sum(shard_results)], dtype=torch.int64, device=ctx.device)
    report["shard_checksum"] = int(total.item())
    dist.all_reduce(total)  # the shards' sums add up to the serial sum when the shards cover all
    report["processes_checksum"] = int(total.item())
    if ctx.is_main:
        n = len(items)
        serial_s, threads_s, processes_s = (statistics.median(samples[k])
                                            for k in ("serial", "threads", "processes"))
        report.update(
            items=n, workers=world_size,
            seconds_1_process=serial_s, seconds_threads=threads_s, seconds_processes=processes_s,
            throughput_1_process=n / serial_s, throughput_threads=n / threads_s,
            throughput_processes=n / processes_s,
            speedup_threads=serial_s / threads_s, speedup_processes=serial_s / processes_s,
            processes_vs_threads=threads_s / processes_s,
        )
    return report


def main() -> None:
    with distributed() as ctx:
        iterations = pick(16_000_000, 2_000_000)  # ~1.2 s of pure Python in one process, full size
        n_items = 4 * ctx.world_size
        items = WORKLOADS["python"].items(n_items, iterations)
        ctx.print0(f"{ctx.world_size} ranks, pure-Python work: {n_items} items, "
                   f"{iterations:,} loop iterations in all, on {ctx.device} ({ctx.backend})")
        result = compare_threads_and_processes(ctx, items, repeats=pick(3, 2))
        ctx.report(**result)
        if not ctx.is_main:
            return
        if not (result["threads_match_serial"]
                and result["processes_checksum"] == result["serial_checksum"]):
            raise RuntimeError("threads or processes computed other results than one process")
        n = ctx.world_size
        print(f"1 process           : {result['throughput_1_process']:6.2f} items/s", flush=True)
        print(f"{n} threads, 1 process: {result['throughput_threads']:6.2f} items/s "
              f"({result['speedup_threads']:.2f}x)", flush=True)
        print(f"{n} processes         : {result['throughput_processes']:6.2f} items/s "
              f"({result['speedup_processes']:.2f}x; {result['processes_vs_threads']:.2f}x the "
              f"threads)", flush=True)
        gil_enabled = gil_status()["gil_enabled"]
        for kind, key in (("thread", "speedup_threads"), ("process", "speedup_processes")):
            row = {"workload": "python", "kind": kind, "workers": n, "seconds": 0.0,
                   "speedup": result[key], "ideal": ideal_speedup("python", n)}
            print(lesson(row, gil_enabled), flush=True)
        print("This is why DistributedDataParallel runs one process per device, not one thread "
              "per device as DataParallel does: see notebook 03.", flush=True)


if __name__ == "__main__":
    main()
