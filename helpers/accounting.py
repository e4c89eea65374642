"""Bytes a process really holds: storages counted once, every tensor an object keeps (what it
sends is counted in helpers.comm_count).

    held_bytes({"parameters": params, "gradients": grads, "optimizer state": states})
    tensors_held_by(optimizer, exclude=params)   # what an optimizer keeps, wherever it keeps it

A view (a parameter that lives inside a flat buffer, the shard of one, `W.t()`) shares its base's
storage, so adding up `Tensor.nbytes` counts shared bytes twice and misses the rest of a buffer;
`held_bytes` counts each `untyped_storage()` once instead. DTensors (FSDP2's parameters,
gradients and optimizer states) count their local shard.
"""
from __future__ import annotations

import time
import types
from typing import Any, Iterable

import torch


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
    CPU tensors only: on a GPU, NCCL holds the tensor until its kernel has run on the stream, and
    that is when the memory really becomes free (and the caching allocator keeps it anyway).
    """
    use_count = getattr(tensor, "_use_count", None) if tensor.device.type == "cpu" else None
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
