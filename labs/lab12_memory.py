"""Lab 12 (memory during a step): what a rank of the composed run holds while a step runs, not
only after it, and what FSDP2's `reshard_after_forward` changes under pipelining.

Run:  ./run.sh 12      (this lab's `run` in the notebook's launch; alone: NPROC=4 ./run.sh labs/lab12_memory.py)

Notebook 08's FSDP gathers a unit's parameters before the unit runs and frees them after: with one
unit per block, a block or two is whole at a time. A pipeline changes that. torch's
`PipelineStage` calls `set_reshard_after_backward(False)` and `set_requires_gradient_sync(False)`
on the stage's FSDP module before every micro-batch's backward, and reduce-scatters and reshards
only after the step's last backward (`perform_reduce_grad`, torch/distributed/pipelining/
stage.py), so once a micro-batch's backward has gathered a unit, it stays gathered until the
step's end: between micro-batches every unit of the stage is whole. Resharding after
each forward (FSDP2's default, `reshard_after_forward=True`) then frees what the next backward
gathers again: more all-gathers, and a peak that the backward sets anyway. torchtitan therefore
sets `reshard_after_forward = not pp_enabled` (torchtitan/models/llama3/infra/parallelize.py).

Measured here on every rank, with the course's instruments: the peak allocated during a step
above the level before it (helpers.memory.peak_allocated: the profiler's allocations on the CPU),
the most FSDP units whole at once (`UnitWatch`: sampled before each unit's forward and backward),
and the step's all-gathers and reduce-scatters on dp (helpers.traffic.TrafficMeter): with a
pipeline, each setting of `reshard_after_forward`, and without a pipeline beside them.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from helpers.dist import DistContext, distributed
from helpers.memory import peak_allocated
from helpers.traffic import TrafficMeter
from labs.lab12_train import Trainer

LAB_NPROC = 4


# ============================================================================ FSDP units, watched
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


# ============================================================================== one step, measured
@dataclass(frozen=True)
class StepMemory:
    """One training step on one rank: the peak allocated during it above the level before it, the
    most FSDP units whole at once, and the step's FSDP calls on dp."""
    peak_bytes: int
    most_whole_units: int
    units: int
    unit_bytes: int            # the largest unit's parameters, gathered over dp (this rank's tp shard)
    all_gathers: int
    reduce_scatters: int
    microbatches: int
    pp: int

    def as_dict(self) -> dict:
        return asdict(self)


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


def measure_step(trainer, x: torch.Tensor, y: torch.Tensor, reshard: bool | None = None) -> StepMemory:
    """`trainer.step(x, y)` once with `reshard_after_forward` set to `reshard` (None: as
    parallelized), measured: its peak, the most units whole at once, its dp all-gathers and
    reduce-scatters."""
    with reshard_after_forward(trainer.model, reshard), UnitWatch(trainer.model) as watch, \
            TrafficMeter(trainer.mesh) as meter:
        peak = peak_allocated(lambda: trainer.step(x, y), trainer.ctx.device)
    dp = meter.calls.get("dp", {})
    return StepMemory(peak, watch.most_whole, len(watch.units),
                      max((gathered_bytes(u) for u in watch.units), default=0),
                      dp.get("all_gather", 0), dp.get("reduce_scatter", 0), trainer.microbatches, trainer.pp)


# ======================================================================================== verdicts
@dataclass(frozen=True)
class WholeUnitsVerdict:
    """Does a step keep every FSDP unit of the stage whole at once, or a few at a time?"""
    every_unit_whole: bool
    most_whole_units: int
    units: int
    text: str


def whole_units_verdict(m: StepMemory) -> WholeUnitsVerdict:
    """Every unit whole at once (what a pipeline does to FSDP) or at most two (notebook 08's FSDP:
    the unit that runs and the root, which FSDP2 never reshards after its forward)."""
    every = m.units > 2 and m.most_whole_units == m.units
    what = (f"all {m.units} FSDP units of the stage were whole at once" if every else
            f"at most {m.most_whole_units} of the stage's {m.units} FSDP units were whole at once")
    return WholeUnitsVerdict(every, m.most_whole_units, m.units,
                             f"{what} ({m.microbatches} micro-batch{'es' if m.microbatches > 1 else ''}, "
                             f"{m.pp} stage{'s' if m.pp > 1 else ''})")


@dataclass(frozen=True)
class ReshardVerdict:
    """What resharding after each forward buys under pipelining, against keeping the units whole."""
    saved_bytes: int           # peak with reshard_after_forward=False minus with True
    extra_all_gathers: int     # all-gathers per step with True minus with False
    unit_bytes: int
    saves_memory: bool
    text: str


def reshard_verdict(resharded: StepMemory, kept: StepMemory) -> ReshardVerdict:
    """Resharding "saves memory" when the peak falls by at least half of the largest unit's
    gathered parameters (the CPU's allocations are counted exactly: no noise to allow for);
    either way it costs the extra all-gathers measured."""
    saved = kept.peak_bytes - resharded.peak_bytes
    extra = resharded.all_gathers - kept.all_gathers
    saves = resharded.unit_bytes > 0 and saved >= resharded.unit_bytes / 2
    text = (f"reshard_after_forward=True {'lowers' if saved > 0 else 'raises'} the step's peak by {abs(saved):,} bytes "
            f"({abs(saved) / max(resharded.unit_bytes, 1):.2f} of the largest unit's gathered parameters) and costs "
            f"{extra:+d} all-gathers per step: "
            + ("it saves memory" if saves else "it saves no memory worth a unit, only adds all-gathers "
               "(torchtitan: reshard_after_forward = not pp_enabled)"))
    return ReshardVerdict(saved, extra, resharded.unit_bytes, saves, text)


# ======================================================================================= the lab's run
def study_shapes(world_size: int) -> dict[str, tuple[int, int, int]]:
    """The meshes the study needs dp > 1 on: a pipeline of 2 stages and the same ranks without one."""
    from helpers.tensors import divide

    if world_size < 4:
        return {}
    dp_tp = divide(world_size, 2, "the ranks over 2 pipeline stages")
    tp = 2 if dp_tp >= 4 else 1
    return {"pipelined": (2, dp_tp // tp, tp), "no pipeline": (1, world_size // tp, tp)}


def run(ctx: DistContext, *, config=None, steps: int = 1) -> dict:
    """Each rank's StepMemory with a pipeline (FSDP2's default and reshard_after_forward=False)
    and without one (the default), after a warm-up step each; {} on fewer than 4 ranks. Needs
    `parallelize` (a notice while it is a stub)."""
    from helpers.notice import attempt
    from labs.lab12_model import batch_at, corpus, default_config, split

    config = config or default_config()
    data = split(corpus())[0]
    x, y = batch_at(data, 0, config.batch, config.seq)

    def study(shape):
        trainer = Trainer(ctx, config, shape)
        trainer.step(x, y)
        out = {"shape": list(shape), "coordinate": {"pp": trainer.pp_rank, "dp": trainer.dp_rank, "tp": trainer.tp_rank},
               "default": measure_step(trainer, x, y).as_dict()}
        if shape[0] > 1:
            out["reshard_after_forward=False"] = measure_step(trainer, x, y, reshard=False).as_dict()
        return out

    return {name: attempt(study, shape) for name, shape in study_shapes(ctx.world_size).items()}


def main() -> None:
    from helpers.notice import notice_if_unsolved, solved

    with distributed() as ctx:
        out = run(ctx)
        ctx.report(memory=out)
        if ctx.rank != 0 or not out:
            return
        with notice_if_unsolved():
            piped, plain = solved(out["pipelined"]), solved(out["no pipeline"])
            resharded, kept = StepMemory(**piped["default"]), StepMemory(**piped["reshard_after_forward=False"])
            print(whole_units_verdict(resharded).text, "| without a pipeline:",
                  whole_units_verdict(StepMemory(**plain["default"])).text, flush=True)
            print(reshard_verdict(resharded, kept).text, flush=True)


if __name__ == "__main__":
    main()
