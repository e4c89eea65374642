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
fresh worker process cannot import), and `parallel_map` is the homework exercise. The 1-process and
the processes measurements need no exercise; the threads one runs through `parallel_map` and, while
that is a stub (student edition), is reported as not done yet. The machine itself (cores, SMT, how
processes start) is `labs/lab01_machine.py`.
"""
from __future__ import annotations

import concurrent.futures as futures
import os
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from helpers import runs
from helpers.bench import intra_op_threads, measure
from helpers.dist import DistContext, distributed
from helpers.notice import attempt
from labs.lab01_machine import available_cores, compute_cores, gil_status, worker_context

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
class Run(runs.Run):
    """The total work of each workload, the same for any number of workers (pure-Python loop
    iterations, 512x512 matmuls, steps of two tiny ops, seconds of waiting); the timing rounds;
    and the torchrun lab's pure-Python iterations (~1.2 s of pure Python at full size)."""
    python: int = 12_000_000
    matmul: int = 192
    tiny_ops: int = 100_000
    io: float = 0.8
    repeats: int = 3
    lab_iterations: int = 16_000_000
    SMOKE = dict(python=1_000_000, matmul=24, tiny_ops=10_000, io=0.1, repeats=1,
                 lab_iterations=1_000_000)


@dataclass(frozen=True)
class Workload:
    name: str              # also its total work's field in Run
    fn: Callable[[Any], Any]
    whole: bool = True     # the work comes in whole units (not seconds)
    extra: tuple = ()      # appended to every item, e.g. the matmul size

    def total(self, cfg: Run | None = None) -> float:
        """This workload's total work in `cfg` (default: the run mode's preset)."""
        return getattr(cfg or Run.preset(), self.name)

    def items(self, n_items: int, total: float | None = None) -> list[tuple]:
        """Split the total work (default: `self.total()`) into `n_items` items (the same total for
        any worker count)."""
        if n_items < 1:
            raise ValueError(f"n_items must be >= 1, got {n_items}")
        total = self.total() if total is None else total
        share = max(1, round(total / n_items)) if self.whole else total / n_items
        return [(seed, share, *self.extra) for seed in range(n_items)]


WORKLOADS = {
    w.name: w for w in (
        Workload("python", python_work),                  # loop iterations
        Workload("matmul", matmul_work, extra=(512,)),     # 512x512 matmuls
        Workload("tiny_ops", tiny_ops_work),               # steps of 2 tiny ops
        Workload("io", io_work, whole=False),              # seconds of waiting
    )
}


# --- the exercise ------------------------------------------------------------------------------

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

def ideal_speedup(workload: str, workers: int) -> int:
    """The best speed-up `workers` can reach: one per core for computing, any number for waiting."""
    return workers if workload == "io" else min(workers, compute_cores())


def speedup_table(workload: str, workers: int, kinds: Sequence[str] = ("thread", "process"),
                  total: float | None = None, repeats: int | None = None,
                  cfg: Run | None = None) -> list[dict[str, Any]]:
    """Time `workload` run serially and with `workers` threads/processes: one row per kind.

    Every row does the same total work, split into 4 * workers items; speedup = serial seconds /
    seconds (medians). `overhead_s` is the time of the same call on trivial items: starting and
    stopping the pool. The parallel results are checked against the serial ones (RuntimeError if
    they differ), so a fast wrong answer never shows up as a speed-up. `total` and `repeats` left
    out are `cfg`'s (default: the run mode's preset).
    """
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {workload!r}")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"kinds must be among {KINDS}, got {bad}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    spec = WORKLOADS[workload]
    cfg = cfg or Run.preset()
    items = spec.items(4 * workers, spec.total(cfg) if total is None else total)
    repeats = cfg.repeats if repeats is None else repeats
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


# --- the torchrun part: 1 process vs 2 threads vs 2 processes ---------------------------------

def rank_shard(items: Sequence[Any], rank: int, world_size: int) -> list[Any]:
    """This rank's items: every world_size-th one, starting at `rank` (disjoint, covering all)."""
    return list(items[rank::world_size])


def timed(run: Callable[[], list[Any]], after: Callable[[], None] = lambda: None,
          **measure_args: Any) -> tuple[float, list[Any]]:
    """(seconds, results) of one `run()` followed by `after()`."""
    results: list[Any] = []

    def once() -> None:
        results[:] = run()
        after()

    # warmup=0: pure-Python work has no first-call cost worth discarding
    return measure(once, warmup=0, repeats=1, **measure_args).median, results


def compare_threads_and_processes(ctx: DistContext, items: Sequence[tuple[int, int]],
                                  repeats: int) -> dict[str, Any]:
    """Throughput (items/s) of the same pure-Python work: 1 process, `world_size` threads in rank
    0, and `world_size` processes (the ranks) working at the same time. Returns rank 0's numbers
    (medians over `repeats` rounds) and every rank's checksums (sums of results), so a test can
    check that the shards add up. The threads run through the exercise `parallel_map`: while it is
    a stub, `report["threads"]` is an `{"unsolved": message}` record and the rest still runs."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    world_size = ctx.world_size
    shard = rank_shard(items, ctx.rank, world_size)
    samples: dict[str, list[float]] = {"serial": [], "threads": [], "processes": []}
    report: dict[str, Any] = {}
    threads: dict[str, Any] = {}
    for _ in range(repeats):  # each round runs all three, so a burst of load hits them alike
        # 1 process, then `world_size` threads in one process: rank 0 works, the others wait.
        if ctx.rank == 0:
            seconds, serial = timed(lambda: [python_work(item) for item in items])
            samples["serial"].append(seconds)
            report["serial_checksum"] = sum(serial)
            if "unsolved" not in threads:
                run = lambda: parallel_map(python_work, items, world_size, "thread")
                outcome = attempt(timed, run)
                if isinstance(outcome, dict):  # the exercise is not done: no threads row
                    threads = outcome
                else:
                    samples["threads"].append(outcome[0])
                    threads = {"checksum": sum(outcome[1]), "match_serial": outcome[1] == serial}
        ctx.barrier()
        # `world_size` processes: every rank does its shard at the same time; the barrier after
        # the work makes every rank's time the slowest rank's, as in a training step.
        seconds, shard_results = timed(lambda: [python_work(item) for item in shard],
                                       after=ctx.barrier, barrier=True, device=ctx.device)
        samples["processes"].append(seconds)
    total = torch.tensor([sum(shard_results)], dtype=torch.int64, device=ctx.device)
    report["shard_checksum"] = int(total.item())
    dist.all_reduce(total)  # the shards' sums add up to the serial sum when the shards cover all
    report["processes_checksum"] = int(total.item())
    if ctx.rank == 0:
        n = len(items)
        serial_s, processes_s = (statistics.median(samples[k]) for k in ("serial", "processes"))
        report.update(
            items=n, workers=world_size, seconds_1_process=serial_s,
            seconds_processes=processes_s, throughput_1_process=n / serial_s,
            throughput_processes=n / processes_s, speedup_processes=serial_s / processes_s)
        if samples["threads"]:
            threads_s = statistics.median(samples["threads"])
            threads.update(seconds=threads_s, throughput=n / threads_s,
                           speedup=serial_s / threads_s, processes_vs_threads=threads_s / processes_s)
        report["threads"] = threads
    return report


def design_note(speedup_processes: float, speedup_threads: float | None) -> str:
    """The lab's closing sentence, chosen from the measured speed-ups (threads: None if not run)."""
    design = ("DistributedDataParallel runs one process per device, not one thread per device as "
              "DataParallel does: see notebook 03.")
    if speedup_threads is None:
        return f"The threads were not run (parallel_map is not written yet). {design}"
    if speedup_processes > 1.25 * speedup_threads:
        return (f"Processes beat threads here ({speedup_processes:.2f}x against "
                f"{speedup_threads:.2f}x): this is why {design}")
    return (f"Not on this run: processes ({speedup_processes:.2f}x) did not beat threads "
            f"({speedup_threads:.2f}x) by more than 1.25x (was the machine busy? re-run). The "
            f"design reason stands: {design}")


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        iterations = cfg.lab_iterations
        n_items = 4 * ctx.world_size
        items = WORKLOADS["python"].items(n_items, iterations)
        ctx.print0(f"{ctx.world_size} ranks, pure-Python work: {n_items} items, "
                   f"{iterations:,} loop iterations in all, on {ctx.device} ({ctx.backend})")
        result = compare_threads_and_processes(ctx, items, repeats=cfg.repeats)
        ctx.report(**result)
        if ctx.rank != 0:
            return
        threads, n = result["threads"], ctx.world_size
        if result["processes_checksum"] != result["serial_checksum"] or \
                not threads.get("match_serial", True):
            raise RuntimeError("threads or processes computed other results than one process")
        print(f"1 process           : {result['throughput_1_process']:6.2f} items/s", flush=True)
        if "throughput" in threads:
            print(f"{n} threads, 1 process: {threads['throughput']:6.2f} items/s "
                  f"({threads['speedup']:.2f}x)", flush=True)
        print(f"{n} processes         : {result['throughput_processes']:6.2f} items/s "
              f"({result['speedup_processes']:.2f}x)", flush=True)
        gil_enabled = gil_status()["gil_enabled"]
        for kind, speedup in (("thread", threads.get("speedup")),
                              ("process", result["speedup_processes"])):
            if speedup is not None:
                row = {"workload": "python", "kind": kind, "workers": n, "seconds": 0.0,
                       "speedup": speedup, "ideal": ideal_speedup("python", n)}
                print(lesson(row, gil_enabled), flush=True)
        print(design_note(result["speedup_processes"], threads.get("speedup")), flush=True)


if __name__ == "__main__":
    main()
