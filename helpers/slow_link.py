"""A slow link between replicas, imposed: inside `slow_link(...)` every collective a process issues
is delivered no earlier than a link of the given bandwidth and latency would deliver it.

    with slow_link(bytes_per_s=20e6, latency_s=0.002) as link:
        dist.all_reduce(x)                    # returns once the bytes would have crossed the link
    link.calls, link.sent_bytes, link.imposed_s, link.waited_s

Notebook 14 uses it to put the replicas of a run in different "data centres" on one machine. How:
like `helpers.comm_count.count_collectives`, it wraps the ProcessGroup methods for the block
(`helpers.comm_count.patched`); each call really runs, and the Work it returns is wrapped so that
`wait()` (and its future) completes no earlier than

    ready = max(now, when the link is free) + latency + bytes sent / bandwidth

One link per process, so transfers queue behind each other; bytes sent are the ring algorithm's
(`helpers.comm_count.Collective.sent_bytes`, notebook 04). An asynchronous call (`async_op=True`,
torchft's all-reduces) waited on later overlaps with whatever the process did in between, as a
real transfer would: `waited_s` counts only the time `wait()` really slept, `imposed_s` the link
time of every call. The link's own real time (here: loopback) is not subtracted: the imposed time
is a floor, and the measured time per step says what the run paid.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from helpers.comm_count import Collective, patched, tensor_bytes

# ProcessGroup method -> (kind, argument holding the size, argument holding this rank's input):
# the calls a slowed link delays, with their bytes sent as helpers.comm_count counts them.
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


@dataclass
class Link:
    """What the slowed link carried inside one `slow_link()` block, on this process."""
    bytes_per_s: float
    latency_s: float
    calls: int = 0
    sent_bytes: float = 0.0
    imposed_s: float = 0.0          # the link time of every call, summed
    waited_s: float = 0.0           # time wait() slept on top of the real collective
    free_at: float = 0.0            # time.perf_counter() when the link is idle again
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def transfer(self, sent: float) -> float:
        """Book `sent` bytes on the link now; returns when they arrive (perf_counter time)."""
        with self.lock:
            cost = self.latency_s + sent / self.bytes_per_s
            start = max(time.perf_counter(), self.free_at)
            self.free_at = start + cost
            self.calls += 1
            self.sent_bytes += sent
            self.imposed_s += cost
            return self.free_at

    def sleep_until(self, ready: float) -> None:
        left = ready - time.perf_counter()
        if left > 0:
            time.sleep(left)
            with self.lock:
                self.waited_s += left


class SlowWork(dist.Work):
    """A collective's Work that completes once the link has delivered its bytes."""

    def __init__(self, work: dist.Work, link: Link, ready: float):
        super().__init__()
        self._work, self._link, self._ready = work, link, ready

    def wait(self, timeout=None) -> bool:
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._link.sleep_until(self._ready)
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed() and time.perf_counter() >= self._ready

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self):
        return self._work.exception()

    def result(self):
        return self._work.result()

    def get_future(self) -> torch.futures.Future:
        link, ready = self._link, self._ready

        def delivered(fut):
            link.sleep_until(ready)
            return fut.value()

        return self._work.get_future().then(delivered)


@contextlib.contextmanager
def slow_link(bytes_per_s: float, latency_s: float = 0.0,
              only: Callable[[dist.ProcessGroup], bool] | None = None) -> Iterator[Link]:
    """Slow every collective issued inside the block (on process groups for which `only(group)` is
    true, if given) to `latency_s` + bytes sent / `bytes_per_s`. Bad values fail here."""
    if not bytes_per_s > 0:
        raise ValueError(f"a link needs a positive bandwidth in bytes per second, got {bytes_per_s!r}")
    if latency_s < 0:
        raise ValueError(f"a link's latency cannot be negative, got {latency_s!r}")
    link = Link(bytes_per_s, latency_s)

    def make(method: str):
        kind, size_arg, input_arg = COLLECTIVE_METHODS[method]

        def wrap(original):
            def slowed(self, *args, **kwargs):
                work = original(self, *args, **kwargs)
                if only is not None and not only(self):
                    return work

                def arg(i):
                    return tensor_bytes(args[i]) if i is not None and len(args) > i else 0

                sent = Collective(method, kind, arg(size_arg), arg(input_arg), self.size()).sent_bytes
                ready = link.transfer(sent)
                if work is None:  # a backend that completed the call already
                    link.sleep_until(ready)
                    return work
                return SlowWork(work, link, ready)
            return slowed
        return wrap

    with patched({method: make(method) for method in COLLECTIVE_METHODS}):
        yield link
