"""What a process sends, counted: point-to-point messages and built-in collectives.

    with count_p2p() as traffic:              # a hand-written collective (notebook 04)
        ring_all_reduce(x)
    traffic.sent_bytes, traffic.send_peers    # and any built-in collective inside raised

    with count_collectives() as log:          # a training step (notebooks 08-10)
        step()
    summarize(log)                            # {"calls": {"all_gather": 8, ...}, "sent_bytes": ...}
    log.ops                                   # [(ProcessGroup method, input bytes), ...] in order

    comm = CountingComm(group)                # code that calls its all-reduces through us (lab 03)
    comm.all_reduce_sum(bucket, async_op=True).wait(); comm.bytes, comm.timeline
    log = CommLog(); log.record("all_gather", out, n)   # notebook 05's layers, by pass

Every route into torch.distributed ends in a method of `ProcessGroup`: `dist.send` and
`batch_isend_irecv` in `send`/`recv`, `dist.all_reduce` in `allreduce`, `all_gather_into_tensor`
in `all_gather_single` (or `_allgather_base`), and so on. `patched()` wraps such methods on the
class for the length of a block and puts them back after; the operations really run: this counts,
it does not fake. Code that calls the backend from C++ (DDP's reducer) is not seen. Not thread-safe
against other threads using torch.distributed meanwhile.

Bytes sent by a collective are those of a bandwidth-optimal ring (notebook 04): `RING_SHARE[kind]`
bytes per byte of its size, the size being nccl-tests' (all-gather: its output; reduce-scatter:
its input; all-reduce and broadcast: the tensor).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

# Bytes each rank sends, per byte of the collective's size, with ring (or pipelined) algorithms.
RING_SHARE: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,   # a reduce-scatter, then an all-gather
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
}


def ring_bytes_sent(kind: str, size_bytes: float, world_size: int) -> float:
    """Bytes each of `world_size` ranks sends for one ring collective of `size_bytes`."""
    return RING_SHARE[kind](world_size) * size_bytes


# ProcessGroup method -> (kind, argument holding the size, argument holding this rank's input).
# A kind outside RING_SHARE (gather, alltoall...) is counted with its input bytes as sent.
COLLECTIVE_METHODS: dict[str, tuple[str, int | None, int | None]] = {
    "allreduce": ("all_reduce", 0, 0), "allreduce_coalesced": ("all_reduce", 0, 0),
    "broadcast": ("broadcast", 0, 0), "reduce": ("reduce", 0, 0),
    "allgather": ("all_gather", 0, 1), "_allgather_base": ("all_gather", 0, 1),
    "all_gather_single": ("all_gather", 0, 1), "allgather_coalesced": ("all_gather", 0, 1),
    "all_gather_single_coalesced": ("all_gather", 0, 1),
    "allgather_into_tensor_coalesced": ("all_gather", 0, 1),
    "reduce_scatter": ("reduce_scatter", 1, 1), "_reduce_scatter_base": ("reduce_scatter", 1, 1),
    "reduce_scatter_single": ("reduce_scatter", 1, 1),
    "reduce_scatter_single_coalesced": ("reduce_scatter", 1, 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1, 1),
    "gather": ("gather", 1, 1), "scatter": ("scatter", 1, 1),
    "alltoall": ("all_to_all", 1, 1), "alltoall_base": ("all_to_all", 1, 1),
    "all_to_all_single": ("all_to_all", 1, 1),
    "barrier": ("barrier", None, None), "monitored_barrier": ("barrier", None, None),
}


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in `obj` (a tensor or nested lists/tuples of them); a DTensor counts
    its local shard."""
    if isinstance(obj, torch.Tensor):
        return (obj.to_local() if hasattr(obj, "to_local") else obj).nbytes
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o) for o in obj)
    return 0


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
    """Raised inside `count_p2p()` when code calls a built-in collective."""


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


def _global_rank(group, group_rank: int) -> int | None:
    try:
        return dist.get_global_rank(group, group_rank)
    except (RuntimeError, ValueError):
        return None


@contextlib.contextmanager
def count_p2p(forbid_collectives: bool = True) -> Iterator[Traffic]:
    """Record this process's point-to-point messages (send, recv, isend, irecv,
    batch_isend_irecv, on any group and backend); optionally make collectives raise."""
    traffic = Traffic()

    def record(direction: str, group, peer: int | None, tensors) -> None:
        global_peer = None if peer is None else _global_rank(group, peer)
        traffic.messages.append(Message(direction, peer, global_peer, tensor_bytes(tensors),
                                        group.rank(), group.size()))

    def make_send(original):
        def send(self, tensors, dst, tag=0):
            record("send", self, dst, tensors)
            return original(self, tensors, dst, tag)
        return send

    def make_recv(original):
        def recv(self, tensors, src, tag=0):
            record("recv", self, src, tensors)
            return original(self, tensors, src, tag)
        return recv

    def make_recv_anysource(original):
        def recv_anysource(self, tensors, tag=0):
            record("recv", self, None, tensors)
            return original(self, tensors, tag)
        return recv_anysource

    def make_forbidden(name):
        def make(_original):
            def forbidden(self, *args, **kwargs):
                raise CollectiveUsed(f"a built-in collective ({name}) was called inside count_p2p();"
                                     " only point-to-point operations are allowed here")
            return forbidden
        return make

    makers = {"send": make_send, "recv": make_recv, "recv_anysource": make_recv_anysource}
    if forbid_collectives:
        makers.update({name: make_forbidden(name) for name in COLLECTIVE_METHODS})
    with patched(makers, required=("send", "recv", "recv_anysource")):
        yield traffic


# ----------------------------------------------------------------------------- collectives
@dataclass(frozen=True)
class Collective:
    method: str        # the ProcessGroup method called
    kind: str          # all_reduce, all_gather, reduce_scatter, broadcast, gather, barrier...
    nbytes: int        # its size (nccl-tests' convention)
    input_bytes: int   # this rank's input tensors
    world_size: int

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank sends (a ring; the input where no ring share is defined)."""
        if self.kind in RING_SHARE:
            return ring_bytes_sent(self.kind, self.nbytes, self.world_size)
        return float(self.input_bytes)


class CollectiveLog(list):
    """The `Collective`s issued inside `count_collectives()`, in order."""

    counting = True

    @property
    def ops(self) -> list[tuple[str, int]]:
        """(ProcessGroup method, input bytes) of each call, in order."""
        return [(c.method, c.input_bytes) for c in self]

    @property
    def input_bytes(self) -> int:
        """Bytes this rank handed to the collectives (what a check "costs" before any algorithm)."""
        return sum(c.input_bytes for c in self)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Stop counting for a nested block (e.g. a training step inside a checker)."""
        before, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = before


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """Record every built-in collective this process issues from Python inside the block
    (hand-written code, ZeroRedundancyOptimizer, FSDP2, object collectives...)."""
    log = CollectiveLog()

    def make(method: str):
        kind, size_arg, input_arg = COLLECTIVE_METHODS[method]

        def wrap(original):
            def counted(self, *args, **kwargs):
                if log.counting:
                    def arg(i):
                        return tensor_bytes(args[i]) if i is not None and len(args) > i else 0
                    log.append(Collective(method, kind, arg(size_arg), arg(input_arg), self.size()))
                return original(self, *args, **kwargs)
            return counted
        return wrap

    with patched({method: make(method) for method in COLLECTIVE_METHODS}):
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
