"""Lab 06: pipeline parallelism by hand: an executor over send/recv, measured timelines, the bubble.

Run:  ./run.sh 06      (labs/lab06_pipeline.py, lab06_pipelining_api.py, lab06_schedules.py;
                        2 ranks = 2 stages)

A model too large for one device is cut into consecutive stages, one per rank. Each batch is cut
into micro-batches, and a *schedule* (labs/lab06_schedules.py: GPipe, 1F1B, as data) says in
which order every stage runs the forward ("F", i) and the backward ("B", i) of micro-batch i.

`StageExecutor` runs any such schedule on its rank: activations go forward and gradients go back
with point-to-point sends. The main checks training with every schedule against single-process
training, then measures real per-action timelines on every rank and gathers them on rank 0 for a
Gantt chart and the bubble, next to the simulation of the same schedule with the measured action
times (what the bubble would be if messages cost nothing).

Exercises (homework): `StageExecutor.backward_step` (here), then `one_f_one_b_schedule`
(labs/lab06_schedules.py). In the student edition the parts that need an unsolved exercise
report it (helpers.notice.attempt) and the rest runs.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers import runs
from helpers.bench import measure
from helpers.dist import distributed, synchronize
from helpers.notice import attempt
from helpers.show import table
from helpers.tensors import divide, seeded
from labs.lab06_schedules import (SCHEDULES, Action, TimedAction, bubble_conclusion,  # noqa: F401
                                  bubble_formula, bubble_fraction, bubble_ratio, gpipe_schedule,
                                  make_schedule, makespan, mean_durations, one_f_one_b_schedule,
                                  simulate_schedule, stage_mean_durations)


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
    with seeded(config.seed):
        blocks = {i: nn.Sequential(nn.Linear(config.width, config.width), nn.ReLU())
                  for i in range(config.num_blocks)}
        blocks[config.num_blocks] = nn.Linear(config.width, config.num_classes)
    return StageModule(blocks)


def stage_block_ids(config: PipeConfig, num_stages: int, stage: int) -> list[int]:
    per_stage = divide(config.num_blocks, num_stages, "the blocks over the pipeline stages")
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
                saved[tensor.data_ptr()] = tensor.nbytes
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
                    if input_grad is None:
                        raise RuntimeError(f"backward_step returned None on stage {self.stage}: "
                                           f"stage {self.stage - 1} needs dL/d(input) to go on")
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
        empty = [n for n, p in executor.module.named_parameters() if p.grad is None]
        if empty:  # sgd_step and the checks need every weight's gradient
            raise RuntimeError(f"after a training step, {empty[0]}.grad is empty on stage {rank}: "
                               "backward_step must run autograd through the stage so that the "
                               "weights' .grad fill (torch.autograd.grad leaves .grad alone)")
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

    Returns per rank its peak activations held; on rank 0 also the median-bubble timeline, its
    bubble (both definitions), the mean F and B times, and the same schedule simulated with those
    times: the bubble if messages and waiting for them cost nothing.
    """
    executor = _executor(config, rank, world_size, device, group)
    schedule = make_schedule(schedule_name, world_size, config.num_microbatches)
    inputs, targets = _microbatches(config, 0, device)
    runs: list[StepResult] = []

    def step() -> None:
        origin = time.perf_counter()  # measure() just left a barrier: the ranks start together
        runs.append(executor.run(schedule[rank], config.num_microbatches, inputs, targets, origin))
        executor.module.zero_grad(set_to_none=True)

    timing = measure(step, warmup=1, repeats=repeats, device=device, barrier=True)
    timelines = gather_records([r.records for r in runs[1:]], rank=rank, world_size=world_size,
                               device=device, group=group)
    out = {"step_seconds": timing.median, "peak_held": runs[-1].peak_held,
           "peak_held_bytes": runs[-1].peak_held_bytes}
    if timelines is not None:
        bubbles = [bubble_fraction(t) for t in timelines]
        median = timelines[sorted(range(len(bubbles)), key=bubbles.__getitem__)[len(bubbles) // 2]]
        seconds = mean_durations(median)
        simulated = simulate_schedule(schedule, stage_durations=stage_mean_durations(median))
        out.update(bubble=bubble_fraction(median), bubbles=bubbles, ratio=bubble_ratio(median),
                   forward_seconds=seconds["F"], backward_seconds=seconds["B"],
                   span_seconds=makespan(median), simulated_bubble=bubble_fraction(simulated),
                   simulated_span_seconds=makespan(simulated),
                   timeline=[[[a.kind, a.microbatch, a.start, a.end] for a in stage]
                             for stage in median])
    return out


CHECK_CONFIG = PipeConfig(width=32, num_blocks=4, microbatch_size=8, num_microbatches=4, lr=1.0)
CHECK_STEPS = 5


def check_schedule(name: str, reference: dict, **kw) -> dict:
    """Pipeline training with schedule `name` vs single-process training, on this rank's stage."""
    run = train_pipeline(CHECK_CONFIG, name, CHECK_STEPS, **kw)
    check = {"max_grad_diff": max_diff(run["grads"], reference["grads"]),
             "max_param_diff": max_diff(run["params"], reference["params"]),
             "losses": run["losses"], "param_names": sorted(run["params"])}
    if run["losses"]:   # the last stage
        check["max_loss_diff"] = max(abs(a - b) for a, b in zip(run["losses"], reference["losses"]))
        print(f"{name:5s}: {CHECK_STEPS} steps, loss {run['losses'][0]:.4f} -> "
              f"{run['losses'][-1]:.4f}; vs single process: max |loss diff| "
              f"{check['max_loss_diff']:.1e}, max |param diff| (last stage) "
              f"{check['max_param_diff']:.1e}", flush=True)
    return check


def probe(name: str, device: torch.device) -> None:
    """One step of a one-stage pipeline with schedule `name`, in this process (no messages): it
    raises an unsolved exercise's stub error on every rank alike, before any rank waits for
    another."""
    train_pipeline(CHECK_CONFIG, name, 1, rank=0, world_size=1, device=device)


def is_unsolved(value) -> bool:
    """True for an attempt(...) record of an unsolved exercise."""
    return isinstance(value, dict) and set(value) == {"unsolved"}


@dataclass(frozen=True)
class Run(runs.Run):
    """The model whose timelines are measured (blocks of Linear(width, width), micro-batches of
    microbatch_size rows) and the micro-batch counts measured; training is checked on
    CHECK_CONFIG whatever the size."""
    width: int = 768
    num_blocks: int = 8
    microbatch_size: int = 96
    microbatch_counts: tuple[int, ...] = (1, 2, 4, 8, 16)
    SMOKE = dict(width=64, num_blocks=4, microbatch_size=8, microbatch_counts=(1, 2, 4))


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    measure_config = PipeConfig(width=cfg.width, num_blocks=cfg.num_blocks,
                                microbatch_size=cfg.microbatch_size)
    microbatch_counts = list(cfg.microbatch_counts)
    with distributed() as ctx:
        kw = dict(rank=ctx.rank, world_size=ctx.world_size, device=ctx.device)
        ctx.print0(f"{ctx.world_size} stages on {ctx.backend} ({ctx.device})")
        # per schedule: training vs one process, then timelines, bubble and activations held
        reference = train_reference(CHECK_CONFIG, CHECK_STEPS)
        check, measured = {}, {}
        for name in SCHEDULES:
            ready = attempt(probe, name, ctx.device)
            if is_unsolved(ready):   # this schedule needs an exercise that is still a stub
                check[name] = ready
                measured.update({f"{name}/m={m}": ready for m in microbatch_counts})
                continue
            check[name] = check_schedule(name, reference, **kw)
            for m in microbatch_counts:
                result = measure_schedule(replace(measure_config, num_microbatches=m), name, **kw)
                measured[f"{name}/m={m}"] = {"num_microbatches": m, **result}
        ctx.report(check=check, reference_losses=reference["losses"], measured=measured,
                   measure_config=asdict(measure_config))
        done = [name for name in SCHEDULES if not is_unsolved(check[name])]
        if ctx.rank == 0 and done:
            ctx.print0(f"measured: {measure_config.num_blocks} blocks of width "
                       f"{measure_config.width}, micro-batches of {measure_config.microbatch_size}")
            rows = [{"schedule": name, "m": m, "measured bubble": r["bubble"],
                     "simulated, measured F/B times": r["simulated_bubble"],
                     "(p-1)/(m+p-1)": bubble_formula(ctx.world_size, m),
                     "step ms": 1e3 * r["step_seconds"]}
                    for name in done for m in microbatch_counts
                    for r in [measured[f"{name}/m={m}"]]]
            table(rows, title="bubble fraction: measured vs formula", floatfmt=".2f")
        m = microbatch_counts[-1]
        held = [f"{name} {measured[f'{name}/m={m}']['peak_held']} micro-batches "
                f"({measured[f'{name}/m={m}']['peak_held_bytes'] / 2**10:.0f} KiB)" for name in done]
        if held:
            print(f"stage {ctx.rank}, m={m}: peak activations held: {', '.join(held)}", flush=True)


if __name__ == "__main__":
    main()
