"""Lab 10: hangs, planted on purpose and found with the tools practitioners use.

Run:  ./run.sh 10      (this file alone: ./run.sh labs/lab10_hangs.py)

A collective that only some ranks call, or that ranks call in different orders, raises nothing
where the bug is: the ranks that called it wait for the others. This lab plants such bugs, each on
a process group of its own with a short timeout (so the job survives them), and records what each
tool says about them:
- the timeout error alone (gloo: "Timed out waiting 1500ms for recv operation to complete");
- a missing collective that silently pairs with the next one of the same shape (wrong numbers,
  and the hang comes one collective later);
- TORCH_DISTRIBUTED_DEBUG=DETAIL, which compares every collective's op, shapes and dtypes across
  ranks before running it, and what that costs (measured);
- `dist.monitored_barrier`, which names the ranks that did not arrive;
- torch's flight recorder (on by default in torch 2.13, gloo included: the last 2000 collectives,
  `TORCH_FR_BUFFER_SIZE`): each rank's last collectives, numbered per process group, with op and
  sizes (and, on request, the Python line that issued each one).
The cases run side by side in threads, each on its own group, so their timeouts overlap.

With `--end-with-hang S` the job then plants a real hang on the default group (rank 0 logs the
final loss with an all-reduce the other ranks never call) whose timeout is S seconds. The notebook
runs it through `launch_hung_job()`, which takes a stack dump of every rank while they wait
(`py-spy dump`, and faulthandler on SIGUSR1, which needs no ptrace permission) and returns the
launcher's error once the timeout ends the job.
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from helpers import runs
from helpers.dist import distributed, error_line, new_group
from helpers.flight_recorder import flight_recorder_size, flight_records
from helpers.launch import LaunchError, LaunchResult, launch
from helpers.show import table

CASE_TIMEOUT_S = 1.5   # every planted hang's group gives up after this long
MARKS_ENV = "LAB10_HANG_MARKS"  # launch_hung_job(): where ranks write their pid before hanging


# ============================================================================ the planted bugs
def collective_on_one_rank(rank: int, group) -> dict:
    """Only rank 0 all-reduces the loss (to log it); then every rank receives the next epoch's
    data-order seeds from rank 0."""
    grads = torch.ones(8)
    dist.all_reduce(grads, group=group)            # every rank: the gradient average
    if rank == 0:
        dist.all_reduce(torch.ones(1), group=group)  # the bug: rank 0 alone logs the mean loss
    seeds = torch.zeros(8)
    dist.broadcast(seeds, src=dist.get_global_rank(group, 0), group=group)  # every rank
    return {}


def collective_on_one_rank_same_shape(rank: int, group) -> dict:
    """The same bug where the next collective has the same shape: it does not hang there."""
    loss = torch.full((4,), 100.0)
    grads = torch.full((4,), float(rank + 1))      # the correct sum over ranks: 1 + 2 + ... + N
    if rank == 0:
        dist.all_reduce(loss, group=group)         # the bug; pairs with the others' gradients
    seen = {"loss after": loss[0].item()}
    dist.all_reduce(grads, group=group)
    seen["gradient sum"] = grads[0].item()
    return seen


def collectives_in_different_orders(rank: int, group) -> dict:
    """Rank 0 all-reduces then broadcasts; the other ranks broadcast then all-reduce."""
    if rank == 0:
        dist.all_reduce(torch.ones(4), group=group)
        dist.broadcast(torch.ones(8), src=dist.get_global_rank(group, 0), group=group)
    else:
        dist.broadcast(torch.ones(8), src=dist.get_global_rank(group, 0), group=group)
        dist.all_reduce(torch.ones(4), group=group)
    return {}


def late_rank(rank: int, group) -> dict:
    """The last rank is stuck elsewhere (here: asleep) while the others wait in a monitored barrier."""
    if rank == dist.get_world_size(group) - 1:
        time.sleep(CASE_TIMEOUT_S + 0.2)
        return {}  # it never arrives within the timeout
    dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=CASE_TIMEOUT_S),
                           wait_all_ranks=True)
    return {}


# name: (bug, debug level of its group)
CASES = {
    "one rank calls it, plain": (collective_on_one_rank, "OFF"),
    "one rank calls it, same shape next, plain": (collective_on_one_rank_same_shape, "OFF"),
    "different orders, plain": (collectives_in_different_orders, "OFF"),
    "one rank calls it, DETAIL": (collective_on_one_rank, "DETAIL"),
    "one rank calls it, same shape next, DETAIL": (collective_on_one_rank_same_shape, "DETAIL"),
    "different orders, DETAIL": (collectives_in_different_orders, "DETAIL"),
    "a late rank, monitored_barrier": (late_rank, "OFF"),
}


FLIGHT_CASE = "one rank calls it, plain"  # the case whose flight records the lab prints


def flight_table(records_by_rank: dict[int, list[dict]], last: int = 4) -> list[dict]:
    """The last `last` collectives, one row per sequence number, one column per rank: the first
    row where the columns differ is where the ranks parted."""
    seqs = sorted({r["seq"] for recs in records_by_rank.values() for r in recs})[-last:]
    rows = []
    for seq in seqs:
        row = {"#": seq}
        for rank, recs in sorted(records_by_rank.items()):
            hit = next((r for r in recs if r["seq"] == seq), None)
            where = f" at {hit['where']}" if hit and "where" in hit else ""
            row[f"rank {rank}"] = f"{hit['op']}{hit['sizes'][0] if hit['sizes'] else ''}{where}" \
                if hit else "(never issued)"
        rows.append(row)
    return rows


def first_parting(records_by_rank: dict[int, list[dict]]) -> tuple[int, dict[int, dict | None]] | None:
    """The first sequence number at which the ranks' records differ (op or sizes, or a rank that
    never issued it), with each rank's record there; None if they all agree."""
    seqs = sorted({r["seq"] for recs in records_by_rank.values() for r in recs})
    for seq in seqs:
        here = {rank: next((r for r in recs if r["seq"] == seq), None) for rank, recs in records_by_rank.items()}
        if len({repr((r["op"], r["sizes"]) if r else None) for r in here.values()}) > 1:
            return seq, here
    return None


# ============================================================================ running the cases
def short_error(text: str) -> str:
    """One readable line: DETAIL's fingerprints cut to op and shapes, other errors to one sentence."""
    if "Detected mismatch between collectives" in text:
        parts = re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\(([^\n]*?)(?=, but Rank|\.?$)", text)
        said = []
        for rank, fingerprint in parts:
            op = re.search(r"OpType=(\w+)", fingerprint)
            shape = re.search(r"TensorShape=(\[[^\]]*\])", fingerprint)
            said.append(f"rank {rank} runs {op.group(1) if op else '?'}{shape.group(1) if shape else ''}")
        return "mismatch: " + " but ".join(said)
    return re.split(r"(?<=[a-z0-9\]])\. ", text, maxsplit=1)[0]


def run_case(rank: int, fn, group) -> dict:
    start = time.perf_counter()
    try:
        seen, error = fn(rank, group), None
    except Exception as exc:  # the planted failure: record it and carry on
        seen, error = {}, error_line(exc)
    return {"error": error, "said": short_error(error) if error else None,
            "seconds": round(time.perf_counter() - start, 2), "seen": seen,
            "flight": flight_records(group)}


def make_group(name: str, level: str):
    """A fresh gloo group of every rank that gives up after CASE_TIMEOUT_S. DETAIL wraps the group
    in a checker (at creation: the debug level is read then), whose own barrier uses the group's
    timeout. Gloo and CPU tensors even on a GPU machine: on nccl a timed-out collective makes the
    watchdog tear the whole process down (TORCH_NCCL_ASYNC_ERROR_HANDLING), so no job survives it."""
    if level == "DETAIL":
        dist.set_debug_level(dist.DebugLevel.DETAIL)
        try:
            return new_group(name=name, backend="gloo", timeout_s=CASE_TIMEOUT_S)
        finally:
            dist.set_debug_level(dist.DebugLevel.OFF)
    group = new_group(name=name, backend="gloo")  # connects within DIST_TIMEOUT (a busy machine)
    _set_pg_timeout(datetime.timedelta(seconds=CASE_TIMEOUT_S), group)  # then short, for the hang
    return group


def hang_clinic(rank: int) -> dict:
    """Every case at once, each in a thread on its own group; returns this rank's record per case."""
    groups = {name: make_group(name, level) for name, (_, level) in CASES.items()}  # same order everywhere
    dist.barrier()
    with ThreadPoolExecutor(len(CASES)) as pool:
        futures = {name: pool.submit(run_case, rank, CASES[name][0], groups[name]) for name in CASES}
        records = {name: future.result() for name, future in futures.items()}
    dist.barrier()  # every case over on every rank before anyone goes on
    return records


def detail_overhead(calls: int) -> dict:
    """Seconds per small all-reduce on a plain group and on a DETAIL group (median of 3 rounds)."""
    plain = new_group(name="plain", backend="gloo")
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        checked = new_group(name="DETAIL", backend="gloo")
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)
    x = torch.ones(16)
    out = {}
    for name, group in (("plain", plain), ("DETAIL", checked)):
        rounds = []
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                dist.all_reduce(x, group=group)
            rounds.append((time.perf_counter() - start) / calls)
        out[name] = sorted(rounds)[1]
    return out


# ============================================================================ a real hang
def log_final_loss(rank: int, loss: torch.Tensor) -> None:
    if rank == 0:
        dist.all_reduce(loss)  # the bug: the other ranks never call this all-reduce


def finish_training(rank: int, hang_s: float, device) -> None:
    """A few training steps, then the planted hang on the default group (timeout `hang_s`)."""
    for _ in range(3):
        dist.all_reduce(torch.ones(8, device=device))  # the gradient average of a step
    _set_pg_timeout(datetime.timedelta(seconds=hang_s))  # what DIST_TIMEOUT=hang_s would do for the job
    marks = os.environ.get(MARKS_ENV)
    if marks:  # tell launch_hung_job() who we are: it dumps our stacks while we wait
        Path(marks, f"rank{rank}.pid").write_text(str(os.getpid()))
    log_final_loss(rank, torch.ones(1, device=device))
    dist.barrier()  # end of training: every rank waits here before saving a checkpoint


@dataclass
class HungJob:
    """What `launch_hung_job()` saw: the launcher's error, and a stack dump of every rank."""
    error: LaunchError | None
    result: LaunchResult | None
    py_spy: dict[int, str] = field(default_factory=dict)         # rank -> `py-spy dump` output
    faulthandler: dict[int, str] = field(default_factory=dict)   # rank -> faulthandler's dump
    pids: dict[int, int] = field(default_factory=dict)


def py_spy_path() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def py_spy_dump(pid: int, timeout: float = 20.0) -> str:
    """`py-spy dump --pid PID`: every thread's Python stack of a running process, read from outside
    (it needs ptrace permission: root, or kernel.yama.ptrace_scope=0; on macOS sudo)."""
    exe = py_spy_path()
    if exe is None:
        return "py-spy is not installed (pip install py-spy)"
    done = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        return f"py-spy could not attach: {done.stderr.strip()}"
    return re.sub(r"\x1b\[[0-9;]*m", "", done.stdout)  # py-spy colours its output even into a pipe


def main_thread_stack(dump: str) -> str:
    """The main thread's part of a py-spy or faulthandler dump, innermost call first."""
    lines, keep = dump.splitlines(), []
    for i, line in enumerate(lines):
        if ("MainThread" in line) or line.startswith("Current thread") or \
                (line.startswith("Thread 0x") and not keep and i + 1 < len(lines)):
            keep = [line]
            continue
        if keep:
            if not line.strip() or line.startswith(("Thread ", "Current thread")):
                break
            keep.append(line)
    return "\n".join(keep) or dump


def waiting_in(dump: str) -> tuple[str, str] | None:
    """(collective, lab function that called it) at the top of a rank's stack dump, from
    faulthandler ('File "...", line N in f', innermost first) or py-spy ('f (file:N)')."""
    frames = re.findall(r'File "([^"]+)", line \d+ in (\w+)', dump) or \
        [(f, name) for name, f in re.findall(r"^\s+(\w+) \(([^():]+):\d+\)", dump, flags=re.M)]
    collective = next((name for f, name in frames if f.endswith("distributed_c10d.py")
                       and not name.startswith("_") and name != "wrapper"), None)
    caller = next((name for f, name in frames if f.endswith(Path(__file__).name)), None)
    return (collective, caller) if collective and caller else None


def faulthandler_dumps(output: str, nproc: int) -> dict[int, str]:
    """Each rank's SIGUSR1 dump from the launch's output (lines labelled "[rankN]:")."""
    dumps: dict[int, list[str]] = {}
    for rank in range(nproc):
        prefix = f"[rank{rank}]:"
        lines = [ln[len(prefix):] for ln in output.splitlines() if ln.startswith(prefix)]
        start = next((i for i, ln in enumerate(lines) if ln.startswith(("Current thread", "Thread 0x"))), None)
        if start is None:
            continue
        block = []
        for ln in lines[start:]:
            if ln.startswith(("Current thread", "Thread 0x", "  File")) or not ln.strip():
                block.append(ln)
            else:
                break
        dumps[rank] = "\n".join(block).strip()
    return dumps


def launch_hung_job(nproc: int = 2, hang_s: float = 4.0, timeout: float = 180.0,
                    env: dict[str, str] | None = None) -> HungJob:
    """Launch this lab with `--end-with-hang hang_s`; while its ranks hang, dump every rank's stack
    (py-spy from outside, then SIGUSR1 to faulthandler); return the error the timeout ends it with."""
    marks = tempfile.mkdtemp(prefix="lab10-hang-")
    job = HungJob(None, None)
    try:
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(launch, __file__, "--end-with-hang", "--hang-s", hang_s, nproc=nproc,
                                 timeout=timeout, stream=False, env={**(env or {}), MARKS_ENV: marks})
            while not future.done() and len(list(Path(marks).glob("rank*.pid"))) < nproc:
                time.sleep(0.05)
            if not future.done():
                time.sleep(0.3)  # every rank wrote its pid just before its blocking call
                job.pids = {int(p.stem[4:]): int(p.read_text()) for p in Path(marks).glob("rank*.pid")}
                for pid in job.pids.values():
                    try:
                        os.kill(pid, signal.SIGUSR1)  # faulthandler prints the stacks to stderr
                    except ProcessLookupError:
                        pass
                job.py_spy = {rank: py_spy_dump(pid) for rank, pid in sorted(job.pids.items())}
            try:
                job.result = future.result()
            except LaunchError as err:
                job.error, job.result = err, err.result
    finally:
        shutil.rmtree(marks, ignore_errors=True)
    if job.result is not None:
        job.faulthandler = faulthandler_dumps(job.result.output, nproc)
    return job


# ============================================================================ the lab
def clinic_rows(records: dict[int, dict]) -> list[dict]:
    rows = []
    for name in CASES:
        row = {"case": name}
        for rank, rec in sorted(records.items()):
            case = rec["clinic"][name]
            said = case["said"] or "no error"
            seen = ", ".join(f"{k} {v:g}" for k, v in case["seen"].items())
            row[f"rank {rank}"] = f"{said} ({case['seconds']:.1f} s{'; ' + seen if seen else ''})"
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Run(runs.Run):
    """Small all-reduces timed per group to price DETAIL; with `end_with_hang` the job then
    plants a real hang on the default group, whose timeout is `hang_s`."""
    detail_calls: int = 200
    end_with_hang: bool = False
    hang_s: float = 8.0
    SMOKE = dict(detail_calls=50, hang_s=4.0)


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints the stacks
    with distributed() as ctx:
        clinic = hang_clinic(ctx.rank)
        overhead = detail_overhead(cfg.detail_calls)
        ctx.report(clinic=clinic, detail_overhead=overhead, torch_version=torch.__version__,
                   fr_buffer=flight_recorder_size())
        records = [None] * ctx.world_size
        dist.all_gather_object(records, {"clinic": clinic})
        if ctx.rank == 0:
            table(clinic_rows(dict(enumerate(records))), title="what each rank was told")
            flight = {r: rec["clinic"][FLIGHT_CASE]["flight"] for r, rec in enumerate(records)}
            table(flight_table(flight), title="flight recorder, 'one rank calls it': last collectives")
            print(f"DETAIL: {overhead['DETAIL'] * 1e6:.0f} us per small all-reduce vs "
                  f"{overhead['plain'] * 1e6:.0f} us plain ({overhead['DETAIL'] / overhead['plain']:.1f}x)")
        if cfg.end_with_hang:
            finish_training(ctx.rank, cfg.hang_s, ctx.device)


if __name__ == "__main__":
    main()
