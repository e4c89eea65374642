"""What a process sends, counted: point-to-point messages and collectives, as views over the
course's one traffic instrument (helpers/traffic.py's TrafficMeter); and counters that the code
under study calls itself.

    with count_p2p() as traffic:              # a hand-written collective (notebook 04)
        ring_all_reduce(x)
    traffic.sent_bytes, traffic.send_peers    # and any collective inside raised

    with count_collectives() as log:          # a training step (notebooks 08-11)
        step()
    summarize(log)                            # {"calls": {"all_gather": 8, ...}, "sent_bytes": ...}
    log.ops                                   # [(ProcessGroup method, input bytes), ...] in order

    comm = CountingComm(group)                # code that calls its all-reduces through us (lab 03)
    comm.all_reduce_sum(bucket, async_op=True).wait(); comm.bytes, comm.timeline
    log = CommLog(); log.record("all_gather", out, n)   # notebook 05's layers, by pass

`count_p2p` and `count_collectives` see what a TrafficMeter sees (its docstring says what, and
what not, measured): explicit calls on any group, DTensor's own collectives, FSDP2's, the
pipeline's messages, DDP's C++ reducer, on the thread that entered the block. A collective's
"method" is the ProcessGroup method behind a c10d call ("allreduce", "_allgather_base"...) or a
functional collective's operator ("all_reduce", "all_gather_into_tensor": DTensor's).

`patched()` wraps ProcessGroup methods for a block, for code that needs a call's own arguments
(notebook 11's all-to-all recorder and ring trace); the calls really run.

Bytes sent by a collective are those of a bandwidth-optimal ring (notebook 04): `RING_SHARE[kind]`
bytes per byte of its size, the size being nccl-tests' (all-gather: its output; reduce-scatter:
its input; all-reduce and broadcast: the tensor).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from helpers.traffic import P2P_KINDS, RING_SHARE, Call, TrafficMeter, ring_bytes_sent, tensor_bytes

__all__ = ["RING_SHARE", "ring_bytes_sent", "tensor_bytes", "patched", "CollectiveUsed", "Message",
           "Traffic", "count_p2p", "Collective", "CollectiveLog", "count_collectives", "summarize",
           "CountingComm", "mark_finish", "CountedWork", "LoggedCollective", "CommLog"]


@contextlib.contextmanager
def patched(makers: dict[str, Callable[[Callable], Callable]],
            required: tuple[str, ...] = ()) -> Iterator[None]:
    """Replace each `ProcessGroup.<name>` this torch has by `make(original)` for the block.
    A name in `required` that this torch lacks is an error (counting would silently miss it)."""
    pg_class, saved = dist.ProcessGroup, {}
    missing = [name for name in required if name not in pg_class.__dict__]
    if missing:
        raise RuntimeError(f"torch {torch.__version__} has no ProcessGroup.{', '.join(missing)} to "
                           "wrap; helpers/comm_count.py needs updating for this version")
    try:
        for name, make in makers.items():
            if name in pg_class.__dict__:
                saved[name] = pg_class.__dict__[name]  # the raw attribute, put back as it was
                setattr(pg_class, name, make(getattr(pg_class, name)))
        yield
    finally:
        for name, raw in saved.items():
            setattr(pg_class, name, raw)


# ----------------------------------------------------------------------------- point-to-point
class CollectiveUsed(RuntimeError):
    """Raised inside `count_p2p()` when code calls a collective."""


@dataclass(frozen=True)
class Message:
    direction: str          # "send" or "recv"
    peer: int | None        # the other end, as a rank of the group used (None: any source)
    global_peer: int | None  # the same rank in the default group
    nbytes: int
    group_rank: int         # this process's rank in that group
    group_size: int


@dataclass
class Traffic:
    """Every point-to-point message one process sent or received inside `count_p2p()`."""
    messages: list[Message] = field(default_factory=list)
    meter: TrafficMeter | None = None   # the instrument behind it (every call, by dimension)

    def _of(self, direction: str) -> list[Message]:
        return [m for m in self.messages if m.direction == direction]

    @property
    def sent_bytes(self) -> int:
        return sum(m.nbytes for m in self._of("send"))

    @property
    def recv_bytes(self) -> int:
        return sum(m.nbytes for m in self._of("recv"))

    @property
    def sends(self) -> int:
        return len(self._of("send"))

    @property
    def recvs(self) -> int:
        return len(self._of("recv"))

    @property
    def send_peers(self) -> list[int | None]:
        return sorted({m.peer for m in self._of("send")}, key=lambda p: -1 if p is None else p)

    @property
    def recv_peers(self) -> list[int | None]:
        return sorted({m.peer for m in self._of("recv")}, key=lambda p: -1 if p is None else p)

    def summary(self) -> dict:
        return {"sent_bytes": self.sent_bytes, "recv_bytes": self.recv_bytes, "sends": self.sends,
                "recvs": self.recvs, "send_peers": self.send_peers, "recv_peers": self.recv_peers}


@contextlib.contextmanager
def count_p2p(forbid_collectives: bool = True) -> Iterator[Traffic]:
    """Record this process's point-to-point messages (send, recv, isend, irecv,
    batch_isend_irecv, on any group and backend); optionally make collectives raise
    `CollectiveUsed` before they run (explicit ones and DTensor's alike)."""
    traffic = Traffic()

    def on_call(call: Call) -> None:
        if call.kind in P2P_KINDS:
            traffic.messages.append(Message(call.kind, call.peer, call.global_peer, call.nbytes,
                                            call.group_rank, call.group_size))
        elif forbid_collectives:
            raise CollectiveUsed(f"a built-in collective ({call.method}) was called inside count_p2p();"
                                 " only point-to-point operations are allowed here")

    with TrafficMeter(on_call=on_call) as meter:
        traffic.meter = meter
        yield traffic


# ----------------------------------------------------------------------------- collectives
@dataclass(frozen=True)
class Collective:
    method: str        # the ProcessGroup method called (or the functional collective's operator)
    kind: str          # all_reduce, all_gather, reduce_scatter, broadcast, gather, barrier...
    nbytes: int        # its size (nccl-tests' convention)
    input_bytes: int   # this rank's input tensors
    world_size: int

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank sends (a ring; the input where no ring share is defined)."""
        if self.kind in RING_SHARE:
            return ring_bytes_sent(self.kind, self.nbytes, self.world_size)
        return 0.0 if self.kind == "barrier" else float(self.input_bytes)


class CollectiveLog(list):
    """The `Collective`s issued inside `count_collectives()`, in order; `meter` is the
    TrafficMeter behind it (messages too, by dimension)."""

    meter: TrafficMeter | None = None

    @property
    def counting(self) -> bool:
        return self.meter is None or self.meter.counting

    @property
    def ops(self) -> list[tuple[str, int]]:
        """(ProcessGroup method, input bytes) of each call, in order."""
        return [(c.method, c.input_bytes) for c in self]

    @property
    def input_bytes(self) -> int:
        """Bytes this rank handed to the collectives (what a check "costs" before any algorithm)."""
        return sum(c.input_bytes for c in self)

    def paused(self) -> contextlib.AbstractContextManager:
        """Stop counting for a nested block (e.g. a training step inside a checker)."""
        return self.meter.paused() if self.meter is not None else contextlib.nullcontext()


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """Record every collective this process issues inside the block (hand-written code,
    ZeroRedundancyOptimizer, FSDP2, DTensor's, DDP's reducer, object collectives...)."""
    log = CollectiveLog()

    def on_call(call: Call) -> None:
        if call.kind not in P2P_KINDS:
            log.append(Collective(call.method, call.kind, call.nbytes, call.input_bytes, call.group_size))

    with TrafficMeter(on_call=on_call) as meter:
        log.meter = meter
        yield log


def summarize(log: list[Collective]) -> dict:
    """Calls per kind, their total size and the bytes this rank sent (ring algorithms)."""
    calls: dict[str, int] = {}
    for c in log:
        calls[c.kind] = calls.get(c.kind, 0) + 1
    return {"calls": calls, "bytes": sum(c.nbytes for c in log),
            "sent_bytes": sum(c.sent_bytes for c in log)}


# ----------------------------------------------------------------------------- counted by the caller
# Where the code under study calls the collective itself, through these, instead of a patched
# ProcessGroup: lab 03's gradient buckets (each launch and wait, and when it finished) and
# notebook 05's tensor-parallel layers (each call's result, by pass).
class CountingComm:
    """SUM all-reduces on `group` that count what they send (the numbers tests and tables read).

    `collectives` and `bytes` count launches, `blocking` the launches that were not async,
    `waits` the waits on async ones; `launched_numels` lists the size of each launch in order, and
    `timeline` has one record per launch: its bytes, `launch_s` and `finish_s` (time.perf_counter();
    the finish is noted by a callback on the work's future, on the CPU when gloo completes it; on
    CUDA it is the host-side completion, use torch.profiler for the device's own timeline).
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.reset()

    def reset(self) -> None:
        self.collectives = 0
        self.bytes = 0
        self.blocking = 0
        self.waits = 0
        self.launched_numels: list[int] = []
        self.timeline: list[dict] = []

    def record(self, tensor: torch.Tensor) -> dict:
        self.collectives += 1
        self.bytes += tensor.nbytes
        self.launched_numels.append(tensor.numel())
        self.timeline.append({"bytes": tensor.nbytes, "launch_s": time.perf_counter(), "finish_s": None})
        return self.timeline[-1]

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = False):
        """In-place SUM over the group; with `async_op=True` returns a handle to `.wait()` on."""
        event = self.record(tensor)
        # SUM then divide (not ReduceOp.AVG): AVG on gloo only exists in recent torch versions.
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        if not async_op:
            self.blocking += 1
            event["finish_s"] = time.perf_counter()
            return None
        mark_finish(work.get_future(), event)
        return CountedWork(work, self)


def mark_finish(future: torch.futures.Future, event: dict) -> None:
    """Note in `event["finish_s"]` when `future` completes, without waiting for it."""
    def done(fut: torch.futures.Future) -> None:
        event["finish_s"] = time.perf_counter()
    future.then(done)


class CountedWork:
    """The handle of an async all-reduce; counts in its CountingComm when it is waited on."""

    def __init__(self, work, comm: CountingComm):
        self._work, self._comm = work, comm

    def wait(self) -> None:
        self._work.wait()  # on CUDA this orders the current stream after the all-reduce
        self._comm.waits += 1

    def is_completed(self) -> bool:
        return self._work.is_completed()


@dataclass(frozen=True)
class LoggedCollective:
    """One collective a CommLog recorded: what it carried, and in which pass."""
    op: str                 # "all_reduce" or "all_gather"
    phase: str              # "forward" or "backward": CommLog.phase when it ran
    shape: tuple[int, ...]  # the full result every rank holds afterwards
    payload_bytes: int      # bytes of that result: K in the formulas
    world_size: int

    @property
    def ring_bytes_sent(self) -> float:
        return ring_bytes_sent(self.op, self.payload_bytes, self.world_size)


@dataclass
class CommLog:
    """What the collectives of notebook 05's layers carried (labs/lab05_tensor_parallel.py:
    `all_reduce_sum`, `all_gather_last_dim` record each call). Set `phase` before a forward or a
    backward pass."""

    phase: str = "forward"
    calls: list[LoggedCollective] = field(default_factory=list)

    def record(self, op: str, result: torch.Tensor, world_size: int) -> None:
        self.calls.append(LoggedCollective(op, self.phase, tuple(result.shape), result.nbytes, world_size))

    def clear(self) -> None:
        self.calls.clear()

    def summary(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(phase, op, shape) of every call, in order: what the tests compare."""
        return [(c.phase, c.op, c.shape) for c in self.calls]
