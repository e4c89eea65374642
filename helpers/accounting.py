"""Bytes a process really holds and bytes it sends: storages counted once, every tensor an object
keeps, every collective it issues.

    held_bytes({"parameters": params, "gradients": grads, "optimizer state": states})
    tensors_held_by(optimizer, exclude=params)   # what an optimizer keeps, wherever it keeps it
    with count_collectives() as log:             # what one training step sends
        step()
    summarize(log)                               # {"calls": {"all_gather": 8, ...}, "sent_bytes": ...}

A view (a parameter that lives inside a flat buffer, the shard of one, `W.t()`) shares its base's
storage, so adding up `Tensor.nbytes` counts shared bytes twice and misses the rest of a buffer;
`held_bytes` counts each `untyped_storage()` once instead. DTensors (FSDP2's parameters,
gradients and optimizer states) count their local shard.
"""
from __future__ import annotations

import contextlib
import time
import types
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def backend_released(tensor: torch.Tensor, timeout: float = 5.0) -> torch.Tensor:
    """`tensor` once no C++ work object refers to it any more; returns it.

    gloo runs each collective on a worker thread that keeps the finished work, and the tensors in
    it, for a moment after `wait()` returns (measured: right after an all-gather on a busy machine,
    40% of output tensors still had 3 references). While it does, a tensor whose last Python
    reference goes is kept alive by PyTorch, so memory freed "now" is freed a little later, at a
    time that depends on the machine's load. Waiting here makes lifetimes depend on our code only.
    """
    use_count = getattr(tensor, "_use_count", None)  # private; absent means: do not wait
    deadline = time.monotonic() + timeout
    while use_count is not None and use_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.0001)
    return tensor


def held_bytes(parts: dict[str, Iterable[torch.Tensor | None]]) -> dict[str, int]:
    """Bytes of the storages behind each part's tensors (None entries skipped), every storage
    counted once, in the first part that holds it, plus "total"."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for name, tensors in parts.items():
        total = 0
        for t in tensors:
            if t is None:
                continue
            storage = local_tensor(t).untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        out[name] = total
    out["total"] = sum(out.values())
    return out


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.MethodType, str, bytes, int, float, complex, bool, type(None))


def tensors_held_by(obj: Any, exclude: Iterable[torch.Tensor] = ()) -> list[torch.Tensor]:
    """Every tensor reachable from `obj` through object attributes, dicts (keys and values),
    lists, tuples and sets, except the tensors in `exclude` (compared by identity). For an
    optimizer: its state, a wrapped optimizer's state, and any buffer it keeps, whatever the
    attribute is called. Tensors are leaves: their own attributes (`.grad`) are not followed."""
    skip = {id(t) for t in exclude}
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, _OPAQUE):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if id(item) not in skip:
                found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif hasattr(item, "__dict__"):
            stack.extend(vars(item).values())
    return found


# ------------------------------------------------------------------------------------ collectives
# Bytes each rank sends, on average, per byte of a collective's size (nccl-tests' size convention:
# all-gather's output, reduce-scatter's input) with bandwidth-optimal ring/pipeline algorithms.
RING_SHARE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: (n - 1) / n}
# ProcessGroup methods behind torch.distributed's collectives: (kind, which argument is the size)
_PG_METHODS = {
    "allreduce": ("all_reduce", 0), "allreduce_coalesced": ("all_reduce", 0),
    "broadcast": ("broadcast", 0),
    "all_gather_single": ("all_gather", 0), "_allgather_base": ("all_gather", 0),
    "allgather": ("all_gather", 0), "all_gather_single_coalesced": ("all_gather", 0),
    "allgather_into_tensor_coalesced": ("all_gather", 0),
    "reduce_scatter_single": ("reduce_scatter", 1), "_reduce_scatter_base": ("reduce_scatter", 1),
    "reduce_scatter": ("reduce_scatter", 1), "reduce_scatter_single_coalesced": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 1),
}


def _size(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return local_tensor(x).nbytes
    return sum(_size(item) for item in x) if isinstance(x, (list, tuple)) else 0


@dataclass(frozen=True)
class Collective:
    kind: str        # all_reduce, all_gather, reduce_scatter or broadcast
    nbytes: int      # its size (nccl-tests' convention)
    world_size: int

    @property
    def sent_bytes(self) -> float:
        return self.nbytes * RING_SHARE[self.kind](self.world_size)


@contextlib.contextmanager
def count_collectives() -> Iterator[list[Collective]]:
    """Record every collective this process issues from Python inside the block (hand-written
    code, ZeroRedundancyOptimizer, FSDP2: all call `ProcessGroup` methods). DDP's reducer calls
    them from C++ and is not seen. Like helpers.comm_bench.count_p2p, it wraps the methods on the
    class for the block and puts them back after; the collectives really run."""
    pg_class, log, saved = dist.ProcessGroup, [], {}

    def make(kind: str, size_arg: int, original):
        def counted(self, *args, **kwargs):
            log.append(Collective(kind, _size(args[size_arg]), self.size()))
            return original(self, *args, **kwargs)
        return counted

    try:
        for name, (kind, size_arg) in _PG_METHODS.items():
            if name in pg_class.__dict__:
                saved[name] = pg_class.__dict__[name]
                setattr(pg_class, name, make(kind, size_arg, getattr(pg_class, name)))
        yield log
    finally:
        for name, raw in saved.items():
            setattr(pg_class, name, raw)


def summarize(log: list[Collective]) -> dict:
    """Calls per kind, their total size and the bytes this rank sent (ring algorithms)."""
    calls: dict[str, int] = {}
    for c in log:
        calls[c.kind] = calls.get(c.kind, 0) + 1
    return {"calls": calls, "bytes": sum(c.nbytes for c in log),
            "sent_bytes": sum(c.sent_bytes for c in log)}
