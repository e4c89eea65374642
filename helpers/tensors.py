"""Small helpers every lab needs, defined once: even splits, seeded construction, DDP's device ids.

    local_batch = divide(global_batch, world_size, "the global batch over the data-parallel ranks")
    with seeded(0):
        model = make_model()          # the same weights on every rank; the global RNG is untouched
    ddp = DDP(model, device_ids=ddp_device_ids(ctx.device))

Byte counts use `Tensor.nbytes` (numel * element_size) directly; `nbytes(tensors)` sums them.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator as an int; a ValueError naming `what` when it does not split evenly.

    `what` says what is being split and over what, e.g. "hidden size 10 over the tensor-parallel
    ranks": the message then reads "hidden size 10 over the tensor-parallel ranks: 10 is not
    divisible by 4"."""
    if denominator < 1:
        raise ValueError(f"{what}: cannot split over {denominator} parts")
    if numerator % denominator:
        raise ValueError(f"{what}: {numerator} is not divisible by {denominator}")
    return numerator // denominator


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with torch's global RNG seeded to `seed`, then restore the RNG as it was
    (`torch.random.fork_rng`), so building a model does not change what the caller draws next."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def ddp_device_ids(device: torch.device) -> list[int] | None:
    """`DistributedDataParallel(device_ids=...)`: the rank's one GPU on CUDA, None on the CPU."""
    return [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else None


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by `tensors` (parameters, gradients, optimizer state...)."""
    return sum(t.nbytes for t in tensors)
