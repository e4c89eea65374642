"""Lab 06: pipeline parallelism by hand: schedules as data, an executor over send/recv, the bubble.

Run:  ./run.sh 06      (this lab, then labs/lab06_pipelining_api.py; 2 ranks = 2 stages)

A model too large for one device is cut into consecutive stages, one per rank. Each batch is cut
into micro-batches, and a *schedule* says in which order every stage runs the forward ("F", i) and
the backward ("B", i) of micro-batch i:

    gpipe_schedule(2, 3)        stage 0: F0 F1 F2 B0 B1 B2   stage 1: F0 F1 F2 B0 B1 B2
    one_f_one_b_schedule(2, 3)  stage 0: F0 F1 B0 F2 B1 B2   stage 1: F0 B0 F1 B1 F2 B2

GPipe: Huang et al. 2019, arXiv:1811.06965. 1F1B: PipeDream (Narayanan et al. 2019, SOSP), in the
synchronous form with a flush used by Megatron-LM (Narayanan et al. 2021, arXiv:2104.04473).

`StageExecutor` runs any such schedule on its rank: activations go forward and gradients go back
with point-to-point sends. `simulate_schedule` replays a schedule with unit-time actions (no
processes) and `bubble_fraction` compares its idle time with (p-1)/(m+p-1). The main measures real
per-action timelines on every rank and gathers them on rank 0 for a Gantt chart.

Exercises (homework): `StageExecutor.backward_step`, then `one_f_one_b_schedule`.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers import pick
from helpers.bench import measure
from helpers.dist import distributed, gpu_count, synchronize
from helpers.show import table

Action = tuple[str, int]     # ("F", i) or ("B", i): forward / backward of micro-batch i
Schedule = list[list[Action]]  # schedule[stage] = that stage's actions, in the order it runs them


def divide(numerator: int, denominator: int) -> int:
    if denominator <= 0 or numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(f"need num_stages >= 1 and num_microbatches >= 1, "
                         f"got {num_stages} and {num_microbatches}")


# ----------------------------------------------------------------------------- schedules as data
def gpipe_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe (fill-drain): every stage runs all forwards, then all backwards, in micro-batch order.

    Stage s holds the activations of all m micro-batches before its first backward.
    """
    _check_sizes(num_stages, num_microbatches)
    forwards = [("F", i) for i in range(num_microbatches)]
    backwards = [("B", i) for i in range(num_microbatches)]
    return [forwards + backwards for _ in range(num_stages)]


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (one forward, one backward): return schedule[stage] = list of ("F", i) / ("B", i).

    For p = num_stages, m = num_microbatches, stage s (0-based) runs:
      1. warm-up: the forwards of micro-batches 0 .. w-1, where w = min(p - s - 1, m);
      2. steady state: while forwards are left, one forward (next micro-batch) then one backward
         (oldest micro-batch not yet backwarded);
      3. cool-down: the remaining backwards, in micro-batch order.
    Forwards and backwards each go in increasing micro-batch order, as in GPipe, so consecutive
    stages send and receive in the same order. Example, p = 2, m = 3:
      stage 0: F0 F1 B0 F2 B1 B2        stage 1: F0 B0 F1 B1 F2 B2

    Tests check: the exact lists for small cases; `validate_schedule` accepts it for p = 1..4,
    m = 1..8; stage s never holds more than min(p - s, m) micro-batches' activations
    (`peak_in_flight`); with unit-time actions it finishes as early as GPipe.
    """
    _check_sizes(num_stages, num_microbatches)  # ValueError for p < 1 or m < 1
    ### BEGIN SOLUTION
    schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        actions: list[Action] = [("F", i) for i in range(warmup)]
        next_forward, next_backward = warmup, 0
        while next_forward < num_microbatches:
            actions += [("F", next_forward), ("B", next_backward)]
            next_forward += 1
            next_backward += 1
        actions += [("B", i) for i in range(next_backward, num_microbatches)]
        schedule.append(actions)
    return schedule
    ### END SOLUTION


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "GPipe": gpipe_schedule, "1F1B": one_f_one_b_schedule}


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](num_stages, num_microbatches)


# ------------------------------------------------------------- simulating and checking schedules
@dataclass(frozen=True)
class TimedAction:
    stage: int
    kind: str         # "F" or "B"
    microbatch: int
    start: float      # seconds (measured) or time units (simulated)
    end: float


class ScheduleDeadlock(ValueError):
    """Every stage that has work left waits for an action that can never run."""


def _dependencies(kind: str, stage: int, microbatch: int, num_stages: int) -> list[tuple]:
    """What (kind, stage, microbatch) must finish first: the chain rule across stages."""
    if kind == "F":  # needs the activation of the previous stage
        return [("F", stage - 1, microbatch)] if stage > 0 else []
    deps = [("F", stage, microbatch)]        # its own forward (saved activations)
    if stage < num_stages - 1:               # and dL/d(output) from the next stage
        deps.append(("B", stage + 1, microbatch))
    return deps


def simulate_schedule(schedule: Schedule, forward_time: float = 1.0,
                      backward_time: float = 1.0) -> list[list[TimedAction]]:
    """Replay `schedule`: each stage runs its actions in order, each as soon as its inputs exist.

    Pure function, no processes; communication takes no time. Raises ScheduleDeadlock when some
    stage can never make progress (e.g. a backward listed before its own forward).
    """
    duration = {"F": forward_time, "B": backward_time}
    num_stages = len(schedule)
    finished: dict[tuple, float] = {}        # (kind, stage, microbatch) -> end time
    position = [0] * num_stages
    stage_free = [0.0] * num_stages
    timeline: list[list[TimedAction]] = [[] for _ in range(num_stages)]
    while any(position[s] < len(schedule[s]) for s in range(num_stages)):
        progressed = False
        for stage, actions in enumerate(schedule):
            while position[stage] < len(actions):
                kind, microbatch = actions[position[stage]]
                deps = _dependencies(kind, stage, microbatch, num_stages)
                if any(dep not in finished for dep in deps):
                    break
                start = max([stage_free[stage]] + [finished[dep] for dep in deps])
                end = start + duration[kind]
                finished[(kind, stage, microbatch)] = end
                stage_free[stage] = end
                timeline[stage].append(TimedAction(stage, kind, microbatch, start, end))
                position[stage] += 1
                progressed = True
        if not progressed:
            stuck = "; ".join(f"stage {s} waits at {schedule[s][position[s]]}"
                              for s in range(num_stages) if position[s] < len(schedule[s]))
            raise ScheduleDeadlock(f"schedule deadlocks: {stuck}")
    return timeline


def validate_schedule(schedule: Schedule, num_microbatches: int) -> None:
    """Raise ValueError unless `schedule` can run on the executor without losing or hanging.

    Per stage: every micro-batch exactly once forward and once backward, backward after forward.
    Across stages: neighbours forward (and backward) micro-batches in the same order, because
    messages between two ranks are matched in the order they are posted; and the dependencies are
    satisfiable (`simulate_schedule` finishes).
    """
    if not schedule:
        raise ValueError("a schedule needs at least one stage")
    expected = sorted((kind, i) for kind in "FB" for i in range(num_microbatches))
    for stage, actions in enumerate(schedule):
        for action in actions:
            if (not isinstance(action, tuple) or len(action) != 2 or action[0] not in ("F", "B")
                    or not isinstance(action[1], int)):
                raise ValueError(f"stage {stage}: {action!r} is not ('F', i) or ('B', i)")
        if sorted(actions) != expected:
            raise ValueError(f"stage {stage} must run F and B of micro-batches "
                             f"0..{num_microbatches - 1} exactly once each; it runs {actions}")
        for i in range(num_microbatches):
            if actions.index(("B", i)) < actions.index(("F", i)):
                raise ValueError(f"stage {stage} runs ('B', {i}) before ('F', {i})")
    for stage in range(len(schedule) - 1):
        for kind in "FB":
            here = [i for k, i in schedule[stage] if k == kind]
            there = [i for k, i in schedule[stage + 1] if k == kind]
            if here != there:
                raise ValueError(f"stages {stage} and {stage + 1} run {kind} in different "
                                 f"micro-batch orders ({here} vs {there}): their sends and "
                                 f"receives would not match")
    simulate_schedule(schedule)  # raises ScheduleDeadlock (a ValueError)


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per stage: the most micro-batches forwarded but not yet backwarded (activations held)."""
    peaks = []
    for actions in schedule:
        held = peak = 0
        for kind, _ in actions:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def bubble_formula(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of a fill-drain pipeline with equal stages: (p - 1) / (m + p - 1)."""
    _check_sizes(num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def bubble_fraction(timeline: list[list[TimedAction]]) -> float:
    """1 - (time spent computing) / (stages * span from first start to last end)."""
    actions = [a for stage in timeline for a in stage]
    if not actions:
        raise ValueError("empty timeline")
    span = max(a.end for a in actions) - min(a.start for a in actions)
    busy = sum(a.end - a.start for a in actions)
    return 1.0 - busy / (len(timeline) * span) if span > 0 else 0.0


def explore_schedule(num_stages: int, num_microbatches: int, schedule_name: str,
                     backward_time: float = 2.0) -> dict:
    """What the notebook's explorer shows: simulated timeline, bubble vs formula, peak held."""
    schedule = make_schedule(schedule_name, num_stages, num_microbatches)
    timeline = simulate_schedule(schedule, forward_time=1.0, backward_time=backward_time)
    return {"schedule": schedule, "timeline": timeline, "bubble": bubble_fraction(timeline),
            "formula": bubble_formula(num_stages, num_microbatches),
            "peak_in_flight": peak_in_flight(schedule),
            "makespan": max(a.end for stage in timeline for a in stage)}


def plot_gantt(timeline: list[list[TimedAction]], *, title: str, time_unit: str = "forward = 1",
               scale: float = 1.0, ax=None):
    """Stages top to bottom, forwards blue, backwards orange, micro-batch index on each bar."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 * len(timeline) + 1.4))
    origin = min(a.start for stage in timeline for a in stage)
    colors = {"F": "tab:blue", "B": "tab:orange"}
    for stage in timeline:
        for a in stage:
            left, width = (a.start - origin) * scale, (a.end - a.start) * scale
            ax.barh(a.stage, width, left=left, color=colors[a.kind], edgecolor="white", height=0.7)
            ax.text(left + width / 2, a.stage, f"{a.kind}{a.microbatch}", ha="center",
                    va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(timeline)), [f"stage {s}" for s in range(len(timeline))])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({time_unit})")
    ax.set_title(title)
    ax.figure.tight_layout()
    return ax


# --------------------------------------------------------------------------- the model and data
@dataclass(frozen=True)
class PipeConfig:
    width: int = 256            # features in and between blocks: a stage boundary is (mb, width)
    num_blocks: int = 8         # Linear(width, width) + ReLU blocks, split evenly over the stages
    num_classes: int = 10       # the classifier head sits on the last stage
    microbatch_size: int = 64
    num_microbatches: int = 4
    lr: float = 0.2
    seed: int = 0

    @property
    def batch_size(self) -> int:
        return self.microbatch_size * self.num_microbatches


class StageModule(nn.Module):
    """Consecutive blocks, keyed by their index in the whole model so parameter names match it."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): block for i, block in blocks.items()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


def build_full_model(config: PipeConfig) -> StageModule:
    """The whole model, initialised from config.seed (identical on every rank)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        blocks = {i: nn.Sequential(nn.Linear(config.width, config.width), nn.ReLU())
                  for i in range(config.num_blocks)}
        blocks[config.num_blocks] = nn.Linear(config.width, config.num_classes)
    return StageModule(blocks)


def stage_block_ids(config: PipeConfig, num_stages: int, stage: int) -> list[int]:
    per_stage = divide(config.num_blocks, num_stages)
    ids = list(range(stage * per_stage, (stage + 1) * per_stage))
    return ids + [config.num_blocks] if stage == num_stages - 1 else ids  # + the head


def build_stage_module(config: PipeConfig, num_stages: int, stage: int) -> StageModule:
    """This stage's slice of the whole model (built whole from the seed, then sliced)."""
    full = build_full_model(config)
    return StageModule({i: full.blocks[str(i)] for i in stage_block_ids(config, num_stages, stage)})


def make_batch(config: PipeConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic batch `step`: x (batch, width) ~ N(0, 1), labels of a fixed random teacher."""
    data_rng = torch.Generator().manual_seed(1000 * config.seed + step)
    teacher_rng = torch.Generator().manual_seed(config.seed + 12345)
    x = torch.randn(config.batch_size, config.width, generator=data_rng)
    teacher = torch.randn(config.width, config.num_classes, generator=teacher_rng)
    return x, (x @ teacher).argmax(dim=1)


def sgd_step(module: nn.Module, lr: float) -> None:
    """Plain SGD, w -= lr * dL/dw, then clear the gradients (torch.optim.SGD without momentum;
    written out because creating a torch.optim optimizer imports the compiler stack: seconds)."""
    with torch.no_grad():
        for param in module.parameters():
            param -= lr * param.grad
            param.grad = None


def train_reference(config: PipeConfig, steps: int) -> dict:
    """Single-process training of the whole model on whole batches (mean loss): the ground truth."""
    model = build_full_model(config)
    losses, first_grads = [], {}
    for step in range(steps):
        x, y = make_batch(config, step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        sgd_step(model, config.lr)
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": first_grads, "params": params}


# --------------------------------------------------------------------- model sharding (1 process)
def shard_devices(num_shards: int) -> list[torch.device]:
    """One GPU per shard when there are enough GPUs, else every shard on the CPU (same code)."""
    if gpu_count() >= num_shards:
        return [torch.device("cuda", i) for i in range(num_shards)]
    return [torch.device("cpu")] * num_shards


class ShardedModel(nn.Module):
    """Stages on different devices in one process: `.to(device)` moves the activation forward, and
    autograd moves dL/d(activation) back, because `.to` is differentiable."""

    def __init__(self, stages: list[nn.Module], devices: list[torch.device]):
        super().__init__()
        self.devices = list(devices)
        self.stages = nn.ModuleList(stage.to(d) for stage, d in zip(stages, self.devices))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, device in zip(self.stages, self.devices):
            x = stage(x.to(device))   # device i waits for device i-1: only one works at a time
        return x


def sharded_gradient_check(config: PipeConfig, num_shards: int = 2) -> dict:
    """One forward/backward of the sharded model vs the whole model: same loss and gradients."""
    devices = shard_devices(num_shards)
    sharded = ShardedModel([build_stage_module(config, num_shards, s) for s in range(num_shards)],
                           devices)
    whole = build_full_model(config)
    x, y = make_batch(config, 0)
    sharded_loss = F.cross_entropy(sharded(x), y.to(devices[-1]))
    whole_loss = F.cross_entropy(whole(x), y)
    sharded_loss.backward()
    whole_loss.backward()
    sharded_grads = {n.split(".", 2)[2]: p.grad.cpu() for n, p in sharded.named_parameters()}
    return {"devices": [str(d) for d in devices],
            "loss_diff": abs(sharded_loss.item() - whole_loss.item()),
            "max_grad_diff": max((sharded_grads[n] - p.grad).abs().max().item()
                                 for n, p in whole.named_parameters())}


# ------------------------------------------------------------------------------- the executor
@dataclass
class StepResult:
    loss: float | None            # whole-batch mean loss (last stage only)
    records: list[tuple]          # (kind, microbatch, start, end), seconds since time_origin
    peak_held: int                # most micro-batches whose activations were held at once
    peak_held_bytes: int          # most bytes autograd kept saved for backward at once


class StageExecutor:
    """Runs one pipeline stage (this rank) through a schedule, micro-batch by micro-batch.

    Stage s receives activations from stage s-1 (rank s-1 of `group`) and gradients from stage s+1.
    Every stage boundary carries tensors of `boundary_shape` (micro-batch, features).
    """

    def __init__(self, module: nn.Module, *, stage: int, num_stages: int,
                 boundary_shape: tuple[int, ...], device: torch.device,
                 loss_fn: Callable = F.cross_entropy, group: dist.ProcessGroup | None = None):
        self.module, self.stage, self.num_stages = module, stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.boundary_shape, self.device = boundary_shape, device
        self.loss_fn, self.group = loss_fn, group
        self.prev_rank = None if self.is_first else self._global_rank(stage - 1)
        self.next_rank = None if self.is_last else self._global_rank(stage + 1)
        self.loss_scale = 1.0
        # micro-batch -> (stage_input, stage_output) kept from forward until its backward
        self.stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.stash_bytes: dict[int, int] = {}
        self._param_ptrs = {p.data_ptr() for p in module.parameters()}
        self.peak_held, self.peak_held_bytes = 0, 0

    def _global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def forward_step(self, microbatch: int, stage_input: torch.Tensor,
                     target: torch.Tensor | None = None) -> torch.Tensor:
        """Forward one micro-batch; keep (input, output) in self.stash for its backward.

        On the last stage the output kept is the micro-batch's mean loss times self.loss_scale
        (1 / num_microbatches), so the gradients summed over micro-batches are those of the mean
        loss over the whole batch.
        """
        if not self.is_first:  # a leaf whose .grad becomes dL/d(input), sent back to stage - 1
            stage_input.requires_grad_(True)
        saved: dict[int, int] = {}

        def count_saved(tensor: torch.Tensor) -> torch.Tensor:  # activations only, not weights
            if tensor.data_ptr() not in self._param_ptrs:
                saved[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(count_saved, lambda tensor: tensor):
            output = self.module(stage_input)
            if self.is_last:
                output = self.loss_fn(output, target) * self.loss_scale
        self.stash[microbatch] = (stage_input, output)
        self.stash_bytes[microbatch] = sum(saved.values())
        self.peak_held = max(self.peak_held, len(self.stash))
        held_bytes = sum(self.stash_bytes[i] for i in self.stash)
        self.peak_held_bytes = max(self.peak_held_bytes, held_bytes)
        return output

    def backward_step(self, microbatch: int,
                      output_grad: torch.Tensor | None) -> torch.Tensor | None:
        """Backward one micro-batch through this stage; return dL/d(stage input) for stage - 1.

        self.stash[microbatch] = (stage_input, stage_output), kept by forward_step:
          - stage_input: (mb, features); on stages > 0 a leaf with requires_grad=True (the
            activation received from stage - 1); on stage 0 the raw input (no grad needed).
          - stage_output: on the last stage the scalar loss (already scaled by 1 / m), elsewhere
            the (mb, features) activation that was sent to stage + 1.
        output_grad: dL/d(stage_output), (mb, features), received from stage + 1; None on the last
        stage (the loss is where the chain rule starts).
        Do:
          1. remove the entry from self.stash (that frees the activations; the executor's memory
             accounting counts what is left in self.stash, and it must be empty after a step);
          2. run autograd from stage_output, seeded with output_grad except on the last stage;
             parameter gradients accumulate into .grad over micro-batches (do not zero them);
          3. return the gradient w.r.t. stage_input, or None on stage 0 (nothing to send).
        Tests check: pipeline training with GPipe and 1F1B equals single-process training (losses,
        gradients, parameters after several steps), and self.stash is empty after each step.
        """
        ### BEGIN SOLUTION
        stage_input, stage_output = self.stash.pop(microbatch)
        if self.is_last:
            stage_output.backward()
        else:
            torch.autograd.backward(stage_output, grad_tensors=output_grad)
        return None if self.is_first else stage_input.grad
        ### END SOLUTION

    def _recv_ops(self, action: Action, received: dict) -> list[dist.P2POp]:
        """The receive `action` needs: an activation for a forward, a gradient for a backward."""
        kind, microbatch = action
        peer = self.prev_rank if kind == "F" else self.next_rank
        if peer is None:
            return []
        buffer = torch.empty(self.boundary_shape, device=self.device)
        received[action] = buffer
        return [dist.P2POp(dist.irecv, buffer, peer, self.group)]

    def _post(self, ops: list[dist.P2POp]) -> list[dist.Work]:
        """Post sends and receives together, without waiting. On nccl the ops between two ranks
        share one stream: a send posted alone would wait for the peer's matching receive, queued
        behind the peer's own send to us: a deadlock. batch_isend_irecv lets them progress
        together."""
        return dist.batch_isend_irecv(ops) if ops else []

    def run(self, actions: list[Action], num_microbatches: int,
            inputs: list[torch.Tensor] | None = None, targets: list[torch.Tensor] | None = None,
            time_origin: float | None = None) -> StepResult:
        """One training step's forwards and backwards on this stage (no optimizer step).

        inputs[i] (stage 0) and targets[i] (last stage) are micro-batch i, on self.device.
        """
        origin = time.perf_counter() if time_origin is None else time_origin
        self.loss_scale = 1.0 / num_microbatches
        self.peak_held = self.peak_held_bytes = 0
        received: dict[Action, torch.Tensor] = {}
        send_works: list[tuple[dist.Work, torch.Tensor]] = []  # keep tensors alive until sent
        records, loss = [], 0.0
        pending = self._post(self._recv_ops(actions[0], received)) if actions else []
        for index, (kind, microbatch) in enumerate(actions):
            for work in pending:   # the input of this action has arrived
                work.wait()
            synchronize(self.device)   # on a GPU, wait() only orders the stream: wait for real
            start = time.perf_counter()
            sends = []
            if kind == "F":
                x = inputs[microbatch] if self.is_first else received.pop((kind, microbatch))
                target = targets[microbatch] if self.is_last else None
                output = self.forward_step(microbatch, x, target)
                if self.is_last:
                    loss += output.item()
                else:   # activation (mb, features) to stage + 1
                    activation = output.detach()
                    sends.append(dist.P2POp(dist.isend, activation, self.next_rank, self.group))
            else:
                output_grad = None if self.is_last else received.pop((kind, microbatch))
                input_grad = self.backward_step(microbatch, output_grad)
                if not self.is_first:   # dL/d(input) (mb, features) to stage - 1
                    sends.append(dist.P2POp(dist.isend, input_grad, self.prev_rank, self.group))
            synchronize(self.device)   # so the recorded end time is when the kernels finished
            records.append((kind, microbatch, start - origin, time.perf_counter() - origin))
            has_next = index + 1 < len(actions)
            next_recvs = self._recv_ops(actions[index + 1], received) if has_next else []
            works = self._post(sends + next_recvs)
            if len(works) == len(sends) + len(next_recvs):  # gloo: one work per op
                send_works += [(w, op.tensor) for w, op in zip(works[:len(sends)], sends)]
                pending = works[len(sends):]
            else:                                           # nccl: one work for the whole group
                pending = works
        for work, _ in send_works:
            work.wait()
        return StepResult(loss if self.is_last else None, records, self.peak_held,
                          self.peak_held_bytes)


# ------------------------------------------------------------------- training and measurements
def _executor(config: PipeConfig, rank: int, world_size: int, device: torch.device, group):
    if world_size > 1:  # nccl: the first batched send/recv of a group must involve every rank
        dist.barrier(group=group)
    module = build_stage_module(config, world_size, rank).to(device)
    return StageExecutor(module, stage=rank, num_stages=world_size, device=device, group=group,
                         boundary_shape=(config.microbatch_size, config.width))


def _microbatches(config: PipeConfig, step: int, device: torch.device):
    x, y = make_batch(config, step)
    return (list(x.to(device).split(config.microbatch_size)),
            list(y.to(device).split(config.microbatch_size)))


def train_pipeline(config: PipeConfig, schedule_name: str, steps: int, *, rank: int,
                   world_size: int, device: torch.device, group=None) -> dict:
    """Train this rank's stage for `steps` steps with the named schedule (same optimizer as the
    reference). Returns this stage's losses (last stage), first-step grads, final params."""
    executor = _executor(config, rank, world_size, device, group)
    actions = make_schedule(schedule_name, world_size, config.num_microbatches)[rank]
    losses, first_grads, stash_left = [], {}, 0
    for step in range(steps):
        inputs, targets = _microbatches(config, step, device)
        result = executor.run(actions, config.num_microbatches, inputs, targets)
        stash_left = max(stash_left, len(executor.stash))
        if step == 0:
            first_grads = {n: p.grad.detach().cpu().clone()
                           for n, p in executor.module.named_parameters()}
        sgd_step(executor.module, config.lr)
        if result.loss is not None:
            losses.append(result.loss)
    params = {n: p.detach().cpu().clone() for n, p in executor.module.named_parameters()}
    return {"losses": losses, "grads": first_grads, "params": params, "stash_left": stash_left,
            "peak_held": result.peak_held, "peak_held_bytes": result.peak_held_bytes}


def max_diff(mine: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max((mine[n] - reference[n]).abs().max().item() for n in mine)


def gather_records(records_per_repeat: list[list[tuple]], *, rank: int, world_size: int,
                   device: torch.device, group=None) -> list[list[list[TimedAction]]] | None:
    """Rank 0 receives every rank's records: result[repeat][stage] = that stage's TimedActions."""
    rows = [[0.0 if kind == "F" else 1.0, float(mb), start, end]
            for records in records_per_repeat for kind, mb, start, end in records]
    local = torch.tensor(rows, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(world_size)] if rank == 0 else None
    dist.gather(local, gathered, dst=dist.get_global_rank(group, 0) if group else 0, group=group)
    if rank != 0:
        return None
    per_repeat = len(records_per_repeat[0])
    result = []
    for repeat in range(len(records_per_repeat)):
        stages = []
        for stage, tensor in enumerate(gathered):
            chunk = tensor[repeat * per_repeat:(repeat + 1) * per_repeat].tolist()
            stages.append([TimedAction(stage, "FB"[int(k)], int(mb), start, end)
                           for k, mb, start, end in chunk])
        result.append(stages)
    return result


def measure_schedule(config: PipeConfig, schedule_name: str, *, rank: int, world_size: int,
                     device: torch.device, group=None, repeats: int = 3) -> dict:
    """Time training steps (no optimizer step) and record every action; rank 0 gets the timelines.

    Returns per rank its peak activations held; on rank 0 also the median-bubble timeline.
    """
    executor = _executor(config, rank, world_size, device, group)
    actions = make_schedule(schedule_name, world_size, config.num_microbatches)[rank]
    inputs, targets = _microbatches(config, 0, device)
    runs: list[StepResult] = []

    def step() -> None:
        origin = time.perf_counter()  # measure() just left a barrier: the ranks start together
        runs.append(executor.run(actions, config.num_microbatches, inputs, targets, origin))
        executor.module.zero_grad(set_to_none=True)

    timing = measure(step, warmup=1, repeats=repeats, device=device, barrier=True)
    timelines = gather_records([r.records for r in runs[1:]], rank=rank, world_size=world_size,
                               device=device, group=group)
    out = {"step_seconds": timing.median, "peak_held": runs[-1].peak_held,
           "peak_held_bytes": runs[-1].peak_held_bytes}
    if timelines is not None:
        bubbles = [bubble_fraction(t) for t in timelines]
        median = sorted(range(len(bubbles)), key=bubbles.__getitem__)[len(bubbles) // 2]
        out.update(bubble=bubbles[median], bubbles=bubbles,
                   timeline=[[[a.kind, a.microbatch, a.start, a.end] for a in stage]
                             for stage in timelines[median]])
    return out


def timeline_from_report(rows: list[list[list]]) -> list[list[TimedAction]]:
    """TimedActions from measure_schedule's JSON: rows[stage] = [[kind, mb, start, end], ...]."""
    return [[TimedAction(stage, k, int(mb), s, e) for k, mb, s, e in actions]
            for stage, actions in enumerate(rows)]


CHECK_CONFIG = PipeConfig(width=32, num_blocks=4, microbatch_size=8, num_microbatches=4, lr=1.0)
CHECK_STEPS = 5


def main() -> None:
    measure_config = PipeConfig(width=pick(768, 64), num_blocks=pick(8, 4),
                                microbatch_size=pick(96, 8))
    microbatch_counts = pick([1, 2, 4, 8], [1, 2, 4])
    with distributed() as ctx:
        kw = dict(rank=ctx.rank, world_size=ctx.world_size, device=ctx.device)
        is_last = ctx.rank == ctx.world_size - 1
        ctx.print0(f"{ctx.world_size} stages on {ctx.backend} ({ctx.device})")
        # 1. correctness: each rank compares its stage with single-process training of the model
        reference = train_reference(CHECK_CONFIG, CHECK_STEPS)
        check = {}
        for name in SCHEDULES:
            run = train_pipeline(CHECK_CONFIG, name, CHECK_STEPS, **kw)
            check[name] = {"max_grad_diff": max_diff(run["grads"], reference["grads"]),
                           "max_param_diff": max_diff(run["params"], reference["params"]),
                           "losses": run["losses"], "param_names": sorted(run["params"])}
            if is_last:
                loss_diff = max(abs(a - b) for a, b in zip(run["losses"], reference["losses"]))
                check[name]["max_loss_diff"] = loss_diff
                print(f"{name:5s}: {CHECK_STEPS} steps, loss {run['losses'][0]:.4f} -> "
                      f"{run['losses'][-1]:.4f}; vs single process: max |loss diff| "
                      f"{loss_diff:.1e}, max |param diff| (last stage) "
                      f"{check[name]['max_param_diff']:.1e}", flush=True)
        ctx.report(check=check, reference_losses=reference["losses"])
        # 2. timelines, bubble and activation memory for m = 1, 2, 4, 8 micro-batches
        ctx.print0(f"measuring: {measure_config.num_blocks} blocks of width "
                   f"{measure_config.width}, micro-batches of {measure_config.microbatch_size}")
        measured = {}
        for name in SCHEDULES:
            for m in microbatch_counts:
                result = measure_schedule(replace(measure_config, num_microbatches=m), name, **kw)
                measured[f"{name}/m={m}"] = {"num_microbatches": m, **result}
        ctx.report(measured=measured, measure_config=asdict(measure_config))
        if ctx.rank == 0:
            rows = [{"schedule": name, "m": m, "measured bubble": r["bubble"],
                     "(p-1)/(m+p-1)": bubble_formula(ctx.world_size, m),
                     "step ms": 1e3 * r["step_seconds"]}
                    for name in SCHEDULES for m in microbatch_counts
                    for r in [measured[f"{name}/m={m}"]]]
            table(rows, title="bubble fraction: measured vs formula", floatfmt=".2f")
        m = microbatch_counts[-1]
        held = [f"{name} {measured[f'{name}/m={m}']['peak_held']} micro-batches "
                f"({measured[f'{name}/m={m}']['peak_held_bytes'] / 2**10:.0f} KiB)"
                for name in SCHEDULES]
        print(f"stage {ctx.rank}, m={m}: peak activations held: {', '.join(held)}", flush=True)


if __name__ == "__main__":
    main()
