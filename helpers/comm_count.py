"""Count the built-in collectives a block of code issues, and the bytes it hands them.

    with count_collectives() as log:
        dist.all_reduce(x)
        dist.all_gather_object(out, {"a": 1})
    log.calls, log.sent_bytes      # 3 calls (all_gather_object is two all-gathers), bytes put in

Every collective of torch.distributed ends in a method of `ProcessGroup` (dist.all_reduce calls
`group.allreduce`, all_gather_into_tensor `group.all_gather_single`, ...), so those methods are
wrapped on the class for the duration of the block and restored after, as `comm_bench.count_p2p`
does for point-to-point. The collectives really run: this counts, it does not fake. `sent_bytes`
is what this rank put in (the input tensors; for a scatter or broadcast, whatever the root holds),
not what travels on the wire. `log.paused()` stops counting for a nested block (e.g. a training
step inside a checker). Not thread-safe against other threads using torch.distributed meanwhile.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist

# method -> index of the positional argument that holds this rank's input tensors
INPUT_ARG = {
    "allreduce": 0, "allreduce_coalesced": 0, "broadcast": 0, "reduce": 0,
    "allgather": 1, "_allgather_base": 1, "all_gather_single": 1, "allgather_coalesced": 1,
    "allgather_into_tensor_coalesced": 1, "gather": 1, "scatter": 1, "reduce_scatter": 1,
    "_reduce_scatter_base": 1, "reduce_scatter_single": 1, "reduce_scatter_tensor_coalesced": 1,
    "alltoall": 1, "alltoall_base": 1, "barrier": None, "monitored_barrier": None,
}


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in `obj` (a tensor or nested lists/tuples of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o) for o in obj)
    return 0


@dataclass
class CollectiveLog:
    ops: list[tuple[str, int]] = field(default_factory=list)   # (method, input bytes), in order
    counting: bool = True

    @property
    def calls(self) -> int:
        return len(self.ops)

    @property
    def sent_bytes(self) -> int:
        return sum(b for _, b in self.ops)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        before, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = before


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """Record every built-in collective this process issues inside the block; see the module doc."""
    pg_class = dist.ProcessGroup
    log = CollectiveLog()
    saved = {}

    def make(name, original):
        index = INPUT_ARG[name]

        def counted(self, *args, **kwargs):
            if log.counting:
                size = tensor_bytes(args[index]) if index is not None and len(args) > index else 0
                log.ops.append((name, size))
            return original(self, *args, **kwargs)
        return counted

    try:
        for name in INPUT_ARG:
            if name in pg_class.__dict__:
                saved[name] = pg_class.__dict__[name]
                setattr(pg_class, name, make(name, getattr(pg_class, name)))
        yield log
    finally:
        for name, raw in saved.items():
            setattr(pg_class, name, raw)
