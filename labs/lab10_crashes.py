"""Lab 10: crashes that appear only at scale, and what torchrun prints about each.

Run:  ./run.sh 10      (this file alone: ./run.sh labs/lab10_crashes.py)

Run by itself the lab trains a few steps and survives a recoverable out-of-memory error on one
rank the only safe way: the rank that failed tells the others (an all-reduce of a flag) and every
rank skips that batch together; a rank that skipped alone would leave the others waiting in the
next all-reduce. `crash_drills()` (the notebook calls it) launches it four more times, each with
one failure planted, at once (the four launches overlap, so their start-up costs do too):
- `--crash oom`: rank 1 runs out of memory (its batch holds a sequence whose attention scores need
  more memory than exists): a Python traceback on rank 1;
- `--crash kill`: rank 1 is killed mid-step by SIGKILL (what the Linux OOM killer or a
  preempting scheduler does): no traceback at all, only an exit code, and the other rank's error
  blames the network;
- a port in use: node 0 of a two-node job cannot host the rendezvous on MASTER_PORT;
- a rendezvous that never completes: node 0 of a two-node job waits for a node that never comes.
`main` is wrapped in torch's `@record`, so torchrun's failure summary shows the root cause's
traceback instead of "error_file: <N/A>".
"""
from __future__ import annotations

import os
import re
import signal
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from helpers import runs
from helpers.dist import distributed
from helpers.launch import LaunchError, launch

CRASH_STEP = 2
WHERE_TO_LOOK = {
    "out of memory": "the failing rank's traceback (the launcher names it; torchrun's 'Root Cause'); "
                     "then its batch: which input was largest on that rank",
    "killed mid-step": "torchrun's 'Root Cause': exitcode -9 (SIGKILL) and no traceback; then the "
                       "kernel log (dmesg / journalctl -k: 'Out of memory: Killed process PID') or "
                       "the scheduler's log. The other ranks' errors ('Connection closed/reset by "
                       "peer') are consequences",
    "port in use": "torchrun's own traceback (no worker started): EADDRINUSE on MASTER_PORT. Pick "
                   "another port, or --standalone on one node; `ss -ltnp | grep PORT` shows who holds it",
    "rendezvous never completes": "torchrun's own traceback: 'n/N clients joined' says how many "
                                  "nodes arrived; check the other nodes' commands (NNODES, "
                                  "MASTER_ADDR, MASTER_PORT, a firewall) and their logs",
}


def sequence_length(rank: int, step: int, crash: str) -> int:
    """Tokens in this rank's longest sequence: rank 1 draws a huge one at CRASH_STEP."""
    if crash in ("oom", "recoverable") and rank == 1 and step == CRASH_STEP:
        return 2 ** 23
    return 16


def forward(rank: int, step: int, crash: str, device) -> torch.Tensor | None:
    """A toy attention layer's forward; None if this rank's batch did not fit in memory and
    `crash` is "recoverable" (otherwise the error propagates)."""
    tokens = sequence_length(rank, step, crash)
    x = torch.randn(4, min(tokens, 16), 8, device=device)  # (B, T, D)
    out_of_memory = torch.OutOfMemoryError if device.type == "cuda" else RuntimeError
    try:
        # (B, T, T) attention scores: for T = 2^23 that is 4 * 2^46 floats, 1 PiB: more than exists
        scores = torch.empty(4, tokens, tokens, device=device) if tokens > 16 else x @ x.transpose(1, 2)
    except out_of_memory:
        if crash != "recoverable":
            raise
        return None
    if crash == "kill" and rank == 1 and step == CRASH_STEP:
        os.kill(os.getpid(), signal.SIGKILL)  # no Python code runs after this, not even `finally`
    return scores.mean().reshape(1)


@dataclass(frozen=True)
class Run(runs.Run):
    """Which crash to plant: none (rank 1's out-of-memory error is caught, the step skipped),
    oom (not caught) or kill (SIGKILL mid-step)."""
    crash: str = "none"

    def __post_init__(self):
        if self.crash not in ("none", "oom", "kill"):
            raise ValueError(f"--crash must be none, oom or kill, got {self.crash!r}")


@record  # torchrun's summary then shows this rank's traceback (TORCHELASTIC_ERROR_FILE)
def main(argv: list[str] | None = None) -> None:
    args = Run.from_argv(argv)
    crash = "recoverable" if args.crash == "none" else args.crash
    with distributed() as ctx:
        skipped = []
        for step in range(5):
            grad = forward(ctx.rank, step, crash, ctx.device)
            # Agree before the step's first collective: a rank that skipped alone would leave the
            # others waiting in the all-reduce below (or pair with it: see lab10_hangs).
            everyone_ok = torch.tensor([0.0 if grad is None else 1.0], device=ctx.device)
            dist.all_reduce(everyone_ok, op=dist.ReduceOp.MIN)
            if everyone_ok.item() < 1:
                skipped.append(step)  # every rank skips the same step together
                continue
            dist.all_reduce(grad)  # the gradient average of the step
        ctx.report(skipped_steps=skipped)
        ctx.print0(f"steps skipped together after an out-of-memory error on one rank: {skipped}")


# ============================================================================ the drills
@dataclass
class Drill:
    name: str
    seconds: float
    failed_rank: int | None        # the rank the launcher blames (the first that recorded an error)
    error: str                     # the last exception line in the output
    root_cause: dict               # torchrun's "Root Cause" entry: rank, exitcode, traceback
    output: str


_HANDED_OUT: set[int] = set()  # ports given to a job that may not have bound them yet


def bound_socket() -> socket.socket:
    """A listening socket on a port no drill of this process was handed (the OS can give a just-
    closed port again, and the drills run at once)."""
    while True:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        if s.getsockname()[1] not in _HANDED_OUT:
            s.listen()
            return s
        s.close()


def free_port() -> int:
    """A port for a job to bind (closed here; the job binds it a moment later)."""
    with bound_socket() as s:
        port = s.getsockname()[1]
    _HANDED_OUT.add(port)
    return port


def last_exception_line(output: str) -> str:
    """The last "SomeError: message" line of the output (torchrun's own ChildFailedError aside)."""
    lines = re.findall(r"^(?:\[rank\d+\]:)?((?:[\w.]+\.)?\w*(?:Error|Exception)\b: .*)$", output, re.M)
    lines = [ln.strip() for ln in lines if "ChildFailedError" not in ln]
    return lines[-1] if lines else ""


def root_cause(output: str) -> dict:
    """torchrun's 'Root Cause (first observed failure)' entry as a dict (empty if there is none)."""
    block = output.split("Root Cause (first observed failure):", 1)
    if len(block) < 2:
        return {}
    entry, key = {}, None
    for line in block[1].splitlines()[1:]:
        if line.startswith("===="):
            break
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("time", "host", "rank", "exitcode", "error_file", "traceback"):
            key = name.strip()
            entry[key] = value.strip()
        elif key == "traceback" and line.strip():  # a traceback goes on over several lines:
            entry[key] = line.strip()              # keep its last, the exception
    entry.pop("time", None)
    entry.pop("host", None)
    return entry


SIGNATURES = {  # what each drill's failure must look like; run_drill checks it
    "out of memory": lambda d: d.failed_rank == 1 and "allocate" in d.error.lower(),
    "killed mid-step": lambda d: "(SIGKILL)" in d.output and d.failed_rank != 1,
    "port in use": lambda d: "EADDRINUSE" in d.error,
    "rendezvous never completes": lambda d: "clients joined" in d.error,
}


def run_drill(name: str, nproc: int, timeout: float) -> Drill:
    """Launch one planted crash; return what it looked like (AssertionError if it looked wrong)."""
    here = os.path.abspath(__file__)
    holder = None
    if name == "port in use":  # someone else (a previous job) holds MASTER_PORT
        holder = bound_socket()  # held from here on: no other run can take it
    if name in ("out of memory", "killed mid-step"):
        kwargs = dict(nproc=nproc)
        args = ["--crash", "oom" if name == "out of memory" else "kill"]
    else:  # node 0 of a two-node job; node 1 never starts
        port = holder.getsockname()[1] if holder else free_port()
        kwargs = dict(nproc=1, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port,
                      torchrun_args=["--rdzv-conf", "timeout=3"])  # give up waiting after 3 s
        args = []
    try:
        launch(here, *args, timeout=timeout, stream=False, **kwargs)
        raise AssertionError(f"drill {name!r}: the job did not fail")
    except LaunchError as err:
        result = err.result
        output = result.output if result else ""
        error = err.summary if err.rank is not None else last_exception_line(output)
        drill = Drill(name, result.seconds if result else 0.0, err.rank, error, root_cause(output), output)
    finally:
        if holder is not None:
            holder.close()
    if not SIGNATURES[name](drill):
        raise AssertionError(f"drill {name!r} did not fail as planted: rank {drill.failed_rank}, "
                             f"{drill.error!r}\n{drill.output[-2000:]}")
    return drill


def crash_drills(nproc: int = 2, timeout: float = 120.0) -> dict[str, Drill]:
    """The four planted crashes, launched at once; {name: what the failure looked like}."""
    with ThreadPoolExecutor(len(WHERE_TO_LOOK)) as pool:
        futures = {name: pool.submit(run_drill, name, nproc, timeout) for name in WHERE_TO_LOOK}
        return {name: f.result() for name, f in futures.items()}


if __name__ == "__main__":
    main()
