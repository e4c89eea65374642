"""What a process holds in memory, counted and measured: the course's memory instruments.

    with SavedTensorBytes(exclude=params) as saved:     # what autograd keeps for the backward
        loss = model(x).sum()
    saved.bytes, graph_saved_bytes(loss, params)        # the same, read from the autograd graph
    peak_allocated(step, device)                         # the highest level of allocated bytes during step()

Two ways to see memory (notebook 07): *counting* what autograd saves for the backward
(`SavedTensorBytes`, a saved-tensors hook: exact, and what the formulas talk about), and
*measuring* every allocation (`peak_allocated`: torch.profiler with profile_memory=True on the CPU,
the caching allocator's peak on a GPU), which also sees temporaries, recomputation, and FSDP's
gathered parameters while they are alive. `graph_saved_bytes` reads torch's own record of the
saved tensors (each autograd node's `_saved_*` fields) and is what tests/test_memory.py holds
`SavedTensorBytes` against on the same forward.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterable, Iterator

import torch
import torch.nn as nn


# =============================================================== counting: saved for the backward
class SavedTensorBytes:
    """Counts the bytes autograd saves for the backward while the context is active.

    `torch.autograd.graph.saved_tensors_hooks` sees every tensor an operator stashes for its
    backward. Every storage is counted once; a DTensor counts its local shard; fake tensors (a
    pipeline's shape inference) are not counted. Storages of `exclude` (e.g. the parameters, which
    exist anyway) are not counted; `weight_copy_bytes` is the part that are copies of `exclude`'s
    tensors (under autocast, the bf16 casts of the weights, found through their grad_fn chain).
    With `skip_parameters`, no parameter, nor a view or cast of one made by autograd-tracked
    operators (FSDP's gathered weights, their transposes and casts), is counted: the parameters'
    memory, not activations, wherever the parameters are not at hand to `exclude`. Counters do not
    nest: torch packs with the innermost saved-tensors hooks only.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), *, skip_parameters: bool = False):
        exclude = list(exclude)
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.parameters = {id(t) for t in exclude}
        self.skip_parameters = skip_parameters
        self.storages: dict[int, int] = {}       # storage address -> bytes
        self.weight_copies: set[int] = set()     # storage addresses that hold parameter casts
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.skip_parameters and is_parameter(t):
            return t
        local = t.to_local() if hasattr(t, "to_local") else t
        try:
            storage = local.untyped_storage()
            address = storage.data_ptr()
        except RuntimeError:    # a fake tensor: the pipeline infers its shapes with fake ones
            return t
        if address not in self.excluded:
            self.storages[address] = storage.nbytes()
            if self._is_parameter_copy(t):
                self.weight_copies.add(address)
        return t

    def _is_parameter_copy(self, t: torch.Tensor) -> bool:
        """t = (view of) a cast of an excluded tensor: grad_fn chain like TBackward0 ->
        ToCopyBackward0 -> AccumulateGrad(parameter)."""
        fn = t.grad_fn
        for _ in range(4):
            if fn is None:
                return False
            if type(fn).__name__ == "AccumulateGrad":
                return id(fn.variable) in self.parameters
            inputs = [f for f, _ in fn.next_functions if f is not None]
            fn = inputs[0] if len(inputs) == 1 else None
        return False

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    @property
    def weight_copy_bytes(self) -> int:
        return sum(self.storages[s] for s in self.weight_copies)

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


_VIEWS_AND_CASTS = ("ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0",
                    "PermuteBackward0", "ExpandBackward0")


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter, a view of one, or a cast or view of one made by autograd-tracked operators."""
    while t._base is not None and not isinstance(t, nn.Parameter):
        t = t._base
    if isinstance(t, nn.Parameter) or (t.grad_fn is None and t.requires_grad):
        return True
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _VIEWS_AND_CASTS:
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if len(inputs) != 1:
            return False
        fn = inputs[0]
    return fn is not None and type(fn).__name__ == "AccumulateGrad"


def graph_saved_bytes(output: torch.Tensor, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the tensors autograd's graph behind `output` holds for the backward, read from
    torch's own record (each node's `_saved_*` fields; a custom Function's `saved_tensors`), every
    storage once, storages of `exclude` left out: what `SavedTensorBytes` counts, seen from the
    graph instead of the hook. Call it before the backward frees them."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    seen_nodes, storages, stack = set(), {}, [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        names = [n for n in dir(node) if n.startswith("_saved_")]
        values = [getattr(node, n) for n in names]
        if hasattr(node, "saved_tensors") and not names:
            values.append(node.saved_tensors)
        for value in values:
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in excluded:
                        storages[storage.data_ptr()] = storage.nbytes()
        stack.extend(f for f, _ in node.next_functions)
    return sum(storages.values())


# ============================================================ measuring: every allocation, peak
@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 for the block: the profiler's C++ side (kineto) prints a
    "profiler_start" / "profiler_stop" line there that no setting turns off."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def allocations(prof) -> list[tuple[int, int]]:
    """(time ns, bytes: + allocated / - freed) of every CPU allocation the profiler recorded."""
    from torch._C._profiler import _EventType

    found, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            found.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    return sorted(found)


def event_start(prof, name: str) -> int:
    """When the profiled event `name` (e.g. a record_function label) started, in ns."""
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.name == name:
            return node.start_time_ns
        stack.extend(node.children)
    raise ValueError(f"no event {name!r} in the profile")


@contextlib.contextmanager
def memory_profile() -> Iterator[object]:
    """torch.profiler with profile_memory=True on the CPU for the block, quietly; the profile
    (read it with `allocations`, `event_start`) once the block is over."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_stderr():
        prof.start()
    try:
        yield prof
    finally:
        with quiet_stderr():
            prof.stop()


def peak_allocated(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Run fn(); the highest number of bytes allocated meanwhile above the level before it: on the
    CPU from the allocations torch.profiler records, on a GPU from the allocator's peak."""
    from helpers.dist import synchronize

    device = torch.device(device)
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with memory_profile() as prof:
        fn()
    level = peak = 0
    for _, size in allocations(prof):
        level += size
        peak = max(peak, level)
    return peak
