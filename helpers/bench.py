"""Timing done right: warm up, synchronise the device, line ranks up, take the median.

    t = measure(lambda: x @ x, device=ctx.device, warmup=2, repeats=5)
    t.median   # seconds

Timings on shared machines vary a lot: compare ratios measured side by side in one run, never a
timing against a typed-in number.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from helpers.dist import synchronize


@dataclass(frozen=True)
class Timing:
    samples: tuple[float, ...]  # seconds, one per repeat

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        return min(self.samples)


def measure(
    fn: Callable[[], object],
    *,
    warmup: int = 1,
    repeats: int = 5,
    device: torch.device | str = "cpu",
    barrier: bool = False,
) -> Timing:
    """Time `fn()` `repeats` times after `warmup` untimed calls.

    `barrier=True` (inside a process group) starts every repeat on all ranks together, so the
    slowest rank sets the time, as it does in training.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        if barrier and dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return Timing(tuple(samples))


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """Use `n` intra-op (OpenMP) threads for torch ops in this thread, then restore the old count.

    With OpenMP the setting belongs to the calling thread, so each worker sets its own. N workers
    that each kept the default (one thread per core) would oversubscribe the cores N times.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
