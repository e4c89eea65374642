"""FSDP2's units, watched: which modules `fully_shard` made units, how many hold their parameters
gathered (unsharded) at once during a step, what a unit holds once gathered, and its
`reshard_after_forward` set for a block. The memory instruments of notebook 12 (labs/
lab12_memory.py) and of the graded tests of its `parallelize` exercise (tests/public/
test_lab12_parallelize.py), kept out of the lab files students hand in.

    with UnitWatch(model) as watch:       # sampled before every unit's forward and backward
        loss.backward()
    watch.most_whole, len(watch.units)    # the most units whole at once, out of all of them
"""
from __future__ import annotations

import contextlib

import torch.nn as nn


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 units of `model` (modules `fully_shard` was applied to), outermost first."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _param_groups(unit) -> list:
    return list(unit._get_fsdp_state()._fsdp_param_groups)


def whole_units(model: nn.Module) -> int:
    """How many of `model`'s FSDP units hold their parameters gathered (unsharded) now."""
    return sum(any(g.is_unsharded for g in _param_groups(u)) for u in fsdp_units(model))


class UnitWatch:
    """While active: the most FSDP units of `model` whole at once, sampled before every unit's
    forward (each micro-batch's) and before its backward (`most_whole`), out of `units`."""

    def __init__(self, model: nn.Module):
        self.model, self.units, self.most_whole, self.handles = model, fsdp_units(model), 0, []

    def _sample(self, *_):
        self.most_whole = max(self.most_whole, whole_units(self.model))

    def __enter__(self):
        for unit in self.units:
            self.handles += [unit.register_forward_pre_hook(self._sample),
                             unit.register_full_backward_pre_hook(self._sample)]
        return self

    def __exit__(self, *exc):
        self._sample()
        for handle in self.handles:
            handle.remove()


@contextlib.contextmanager
def reshard_after_forward(model: nn.Module, value: bool | None):
    """FSDP2's `reshard_after_forward` set to `value` on every unit of `model` for the block, and
    put back as `parallelize` left it after (None: left as it is)."""
    if value is None:
        yield
        return
    states = [u._get_fsdp_state() for u in fsdp_units(model)]
    saved = [(s, s._auto_reshard_after_forward, [(g, g.post_forward_mesh_info) for g in s._fsdp_param_groups])
             for s in states]
    model.set_reshard_after_forward(value)
    try:
        yield
    finally:
        for state, auto, groups in saved:
            state._auto_reshard_after_forward = auto
            for group, info in groups:
                group.post_forward_mesh_info = info


def gathered_bytes(unit: nn.Module) -> int:
    """Bytes of a unit's own parameters once gathered over dp: each parameter's local shard times
    the dp ranks it is split over (its mesh's "dp" dimension), its child units' left out."""
    children = {id(p) for u in fsdp_units(unit)[1:] for p in u.parameters()}
    total = 0
    for p in unit.parameters():
        if id(p) in children:
            continue
        local = p.to_local() if hasattr(p, "to_local") else p
        names = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()
        dp = p.device_mesh.size(names.index("dp")) if "dp" in names else 1
        total += local.nbytes * dp
    return total
