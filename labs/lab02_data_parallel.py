"""Lab 02: nn.DataParallel built by hand (one process, a thread per replica); the bridge to DDP.

Run:  ./run.sh 02      (or: ./run.sh labs/lab02_data_parallel.py)

`torch.nn.DataParallel` runs four steps on every forward: scatter the batch across devices,
replicate the module onto them, run the replicas in Python threads (`parallel_apply`), and gather
the outputs on device 0, where the loss is computed; backward sums every replica's gradients into
the master parameters on device 0. Its CUDA primitives refuse CPU tensors and on a CPU-only machine
`nn.DataParallel` is a pass-through, so `ThreadDataParallel` below runs the same pipeline over
replicas on one device, which works everywhere and can be measured.

Homework (`./run.sh check 02`; tests: tests/public/test_lab02_data_parallel.py): `scatter`,
`replicate`, `parallel_apply` and `gather`.

Under torchrun, `main()` trains the same model for the same steps three ways in one run and prints
the throughput of each: one process; ThreadDataParallel with world_size replicas (threads) in one
process; world_size processes that average gradients with all_reduce (what DDP does, notebook 03).
The first and the last need no exercise; while the four steps are stubs (student edition) the
threads way is reported as not done yet and the others still run.
"""
from __future__ import annotations

import copy
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers import runs
from helpers.bench import measure
from helpers.dist import DistContext, distributed, gpu_count, synchronize
from helpers.notice import attempt
from helpers.tensors import divide, nbytes, seeded

# ----------------------------------------------------------------------------------------------
# The four steps of DataParallel (the exercises)
# ----------------------------------------------------------------------------------------------


def scatter(batch: torch.Tensor, num_replicas: int) -> list[torch.Tensor]:
    """Split `batch` along dim 0 into at most `num_replicas` pieces, with `torch.chunk` semantics.

    batch: (B, ...). Returns a list of tensors (B_i, ...) whose concatenation is `batch`: every
    piece has ceil(B / num_replicas) rows except possibly the last, so a small batch gives FEWER
    pieces than replicas (B=4, 3 replicas -> sizes [2, 2]; B=2, 3 replicas -> [1, 1]), exactly as
    `torch.chunk(batch, num_replicas)` does and as nn.DataParallel's scatter does. The pieces may be
    views of `batch` (all replicas live on one device here); gradients must flow back to `batch`.
    Tests compare the sizes with torch.chunk for many (B, num_replicas) and check the values.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if batch.dim() == 0 or batch.size(0) == 0:
        raise ValueError(f"cannot scatter a batch of shape {tuple(batch.shape)}: need >= 1 row")
    ### BEGIN SOLUTION
    return list(torch.chunk(batch, num_replicas, dim=0))
    ### END SOLUTION


def replicate(module: nn.Module, num_replicas: int) -> list[nn.Module]:
    """Return `num_replicas` replicas of `module` whose weights are autograd-connected to its own.

    Each replica is an nn.Module with the same structure and forward as `module`; for every
    parameter name of `module` (e.g. "layers.0.weight") the replica holds, under the same attribute
    path, a tensor equal to the master parameter and computed from it by a differentiable op
    (`p.clone()` copies, `p.view_as(p)` aliases). It must NOT be a new leaf Parameter (a plain
    `copy.deepcopy(module)`): then backward would stop at the copy and the master's `.grad` would
    never change. With differentiable copies, `loss.backward()` sums every replica's gradient into
    the master parameter's `.grad`: the reduction DataParallel does onto device 0.

    As on GPUs, replicas 1..N-1 must hold COPIES (their own storage: on another device they could
    not share memory); replica 0 may share the master's storage. Buffers may be shared by reference.
    Replicas are made on every forward, so keep it cheap: don't copy each parameter twice.
    Hints: `copy.deepcopy(module, memo={id(t): t for t in tensors})` copies the module structure
    but reuses the tensors listed in the memo; nn.Module refuses a plain tensor under the name of a
    registered parameter, so `delattr(owner, "weight")` before `setattr(owner, "weight", tensor)`
    (`replica.get_submodule("layers.0")` finds the owner of "layers.0.weight").
    Tests: structure and values, copies vs sharing, gradients reaching the master, the master
    itself unchanged.
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    ### BEGIN SOLUTION
    replicas = []
    master = dict(module.named_parameters(remove_duplicate=False))
    # deepcopy copies the module structure; the memo maps every parameter and buffer to itself,
    # so their data is not copied here (each parameter is replaced by a differentiable copy below).
    shared = [*module.parameters(), *module.buffers()]
    for index in range(num_replicas):
        replica = copy.deepcopy(module, memo={id(t): t for t in shared})
        copies: dict[int, torch.Tensor] = {}  # tied weights stay tied: one copy per Parameter
        for name, param in master.items():
            if id(param) not in copies:
                # replica 0 sits on the master's device and may alias it; the others get a copy
                copies[id(param)] = param.view_as(param) if index == 0 else param.clone()
            owner_name, _, leaf = name.rpartition(".")
            owner = replica.get_submodule(owner_name)
            delattr(owner, leaf)                  # drop the (shared) leaf Parameter ...
            setattr(owner, leaf, copies[id(param)])  # ... for a plain, non-leaf tensor
        replicas.append(replica)
    return replicas
    ### END SOLUTION


def parallel_apply(replicas: Sequence[nn.Module], inputs: Sequence[torch.Tensor]) -> list[Any]:
    """Run `replicas[i](inputs[i])` for every i, each in a Python thread of its own, concurrently.

    Returns the outputs in replica order. Start one `threading.Thread` per replica, start them all
    before joining any, and join them all. Two details that threads get wrong by default:
    - grad mode is thread-local in PyTorch: a new thread starts with gradients enabled, so record
      `torch.is_grad_enabled()` in the caller and set it inside each thread (under `torch.no_grad()`
      the outputs must not require grad);
    - an exception in a thread is not seen by the caller: catch it in the thread and re-raise it
      (the same exception object; the lowest-index one if several fail) in the caller after joining.
    Tests check the outputs, that the replicas ran in distinct threads at the same time, grad mode
    and error propagation.
    """
    if len(replicas) != len(inputs):
        raise ValueError(f"{len(replicas)} replicas for {len(inputs)} inputs: need one each")
    ### BEGIN SOLUTION
    grad_enabled = torch.is_grad_enabled()
    results: list[Any] = [None] * len(inputs)
    errors: list[BaseException | None] = [None] * len(inputs)

    def work(index: int) -> None:
        try:
            with torch.set_grad_enabled(grad_enabled):
                results[index] = replicas[index](inputs[index])
        except BaseException as exc:  # handed to the caller below
            errors[index] = exc

    threads = [threading.Thread(target=work, args=(i,), name=f"replica-{i}")
               for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error
    return results
    ### END SOLUTION


def gather(outputs: Sequence[Any]) -> Any:
    """Concatenate the replicas' outputs along dim 0 on replica 0's device (the output device).

    `outputs[i]` is replica i's output: a tensor (B_i, ...), or a tuple/list/dict of such (a model
    may return several things); the result has the same structure with every tensor concatenated
    in replica order and placed on the device of replica 0's tensor. It must stay differentiable:
    backward sends each replica's slice of the gradient back to it (gather's backward is a scatter).
    Tests: tensors, nested tuples and dicts, gradients, the device.
    """
    if len(outputs) == 0:
        raise ValueError("nothing to gather: no outputs")
    ### BEGIN SOLUTION
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([out.to(first.device) for out in outputs], dim=0)
    if isinstance(first, dict):
        return {key: gather([out[key] for out in outputs]) for key in first}
    if isinstance(first, (tuple, list)):
        return type(first)(gather(parts) for parts in zip(*outputs))
    raise TypeError(f"cannot gather outputs of type {type(first).__name__}")
    ### END SOLUTION


# ----------------------------------------------------------------------------------------------
# ThreadDataParallel: the four steps, timed, with every byte that crosses replica 0 counted
# ----------------------------------------------------------------------------------------------

FORWARD_PHASES = ("scatter", "replicate", "apply", "gather")
# What crosses replica 0's link in one step, by direction (device 0's link on GPUs)
SENT_BY_REPLICA0 = ("scatter inputs", "broadcast params", "scatter output grads")
RECEIVED_BY_REPLICA0 = ("gather outputs", "reduce param grads", "gather input grads")


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) output: a tensor, or tuples/lists/dicts of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    return []


def replica_weight(replica: nn.Module, name: str) -> torch.Tensor:
    """The tensor a replica uses for the master parameter `name` ("layers.0.weight")."""
    return functools.reduce(getattr, name.split("."), replica)


@dataclass
class StepRecord:
    """What one ThreadDataParallel forward (and the backward that follows it) did.

    `moved`: bytes sent to or from replica 0 (device 0 on GPUs), by what they are; the backward
    entries fill in while backward runs (hooks on the tensors that cross replicas). `held`: bytes of
    tensors each replica holds, by kind (module outputs only: activations inside are not counted).
    """
    num_replicas: int
    seconds: dict[str, float] = field(default_factory=dict)
    moved: dict[str, int] = field(default_factory=dict)
    held: list[dict[str, int]] = field(default_factory=list)

    @property
    def moved_total(self) -> int:
        return sum(self.moved.values())

    @property
    def sent(self) -> int:
        """Bytes replica 0 sent out: input pieces, parameter copies, output gradients."""
        return sum(self.moved[k] for k in SENT_BY_REPLICA0)

    @property
    def received(self) -> int:
        """Bytes replica 0 received: outputs, parameter gradients, input gradients."""
        return sum(self.moved[k] for k in RECEIVED_BY_REPLICA0)


class ThreadDataParallel(nn.Module):
    """nn.DataParallel's pipeline with `num_replicas` replicas on the batch's device, in threads.

    Every forward: scatter -> replicate (again: the master may have changed since the last step)
    -> parallel_apply -> gather. The output lives on replica 0; compute the loss there and call
    backward: the gradients of all replicas add up in `self.module`'s parameters. `last_step`
    records phase times and the bytes that crossed replica 0.
    """

    def __init__(self, module: nn.Module, num_replicas: int):
        super().__init__()
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.module = module
        self.num_replicas = num_replicas
        self.last_step: StepRecord | None = None

    def forward(self, batch: torch.Tensor) -> Any:
        device = batch.device
        seconds: dict[str, float] = {}

        def timed(phase, fn, *args):
            synchronize(device)  # CUDA is asynchronous: wait, or the time lands in a later phase
            start = time.perf_counter()
            value = fn(*args)
            synchronize(device)
            seconds[phase] = time.perf_counter() - start
            return value

        chunks = timed("scatter", scatter, batch, self.num_replicas)
        # a small batch gives fewer chunks than replicas: replicate only as many as are used
        replicas = timed("replicate", replicate, self.module, len(chunks))
        outputs = timed("apply", parallel_apply, replicas, chunks)
        gathered = timed("gather", gather, outputs)
        self.last_step = self._account(seconds, chunks, replicas, outputs, gathered)
        return gathered

    def _account(self, seconds, chunks, replicas, outputs, gathered) -> StepRecord:
        record = StepRecord(len(chunks), seconds)
        names = [n for n, _ in self.module.named_parameters()]
        param_bytes = nbytes(self.module.parameters())
        grad_bytes = nbytes(p for p in self.module.parameters() if p.requires_grad)
        moved = record.moved
        moved.update({"scatter inputs": nbytes(chunks[1:]),
                      "broadcast params": 0, "gather outputs": 0,
                      "scatter output grads": 0, "reduce param grads": 0, "gather input grads": 0})

        def count(key, held=None):
            def hook(grad):  # runs during backward, with the gradient that crosses replica 0
                moved[key] += grad.nbytes
                if held is not None:
                    held["gradients"] = held.get("gradients", 0) + grad.nbytes
            return hook

        for index, (chunk, replica, out) in enumerate(zip(chunks, replicas, outputs)):
            weights = [replica_weight(replica, n) for n in names]
            held = {"parameters": param_bytes if index == 0 else nbytes(weights),
                    "gradients": grad_bytes if index == 0 and torch.is_grad_enabled() else 0,
                    "input chunk": chunk.nbytes,
                    "output chunk": nbytes(tensors_in(out))}
            record.held.append(held)
            if index == 0:
                continue
            moved["broadcast params"] += nbytes(weights)
            moved["gather outputs"] += held["output chunk"]
            for w in weights:
                if w.requires_grad:
                    w.register_hook(count("reduce param grads", held))
            for t in tensors_in(out):
                if t.requires_grad:
                    t.register_hook(count("scatter output grads"))
            if chunk.requires_grad:
                chunk.register_hook(count("gather input grads"))
        record.held[0]["gathered outputs"] = nbytes(tensors_in(gathered))
        for t in tensors_in(gathered):
            if t.requires_grad:  # d loss / d output is materialised on replica 0 too
                def on_replica0(grad, held=record.held[0]):
                    held["output grads"] = held.get("output grads", 0) + grad.nbytes
                t.register_hook(on_replica0)
        return record


# ----------------------------------------------------------------------------------------------
# The lab: one training step three ways (one process, threads, processes)
# ----------------------------------------------------------------------------------------------


def make_mlp(width: int, depth: int, num_classes: int, seed: int = 0) -> nn.Module:
    """A ReLU MLP, (B, width) -> (B, num_classes), initialised identically for a given seed."""
    with seeded(seed):
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, num_classes))
        return nn.Sequential(*layers)


def make_batch(batch_size: int, width: int, num_classes: int, seed: int = 1):
    """A fixed synthetic classification batch: x (B, width) float32, y (B,) int64."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, width, generator=generator)
    y = torch.randint(0, num_classes, (batch_size,), generator=generator)
    return x, y


def average_gradients(model: nn.Module, world_size: int, group=None) -> None:
    """all_reduce(SUM) every gradient, then divide: the mean over ranks (what DDP computes).

    SUM then divide rather than ReduceOp.AVG, which older gloo versions lack.
    """
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)
            param.grad.div_(world_size)


def sgd_step(model: nn.Module, forward_loss, optimizer: torch.optim.Optimizer, after_backward=None):
    optimizer.zero_grad(set_to_none=True)
    loss = forward_loss(model)
    loss.backward()
    if after_backward is not None:
        after_backward()
    optimizer.step()
    return loss


def run_way(name: str, model: nn.Module, forward_loss, *, steps: int, warmup: int, lr: float,
            device, samples_per_step: int, after_backward=None, barrier: bool = False) -> dict:
    """Train for warmup + steps SGD steps; throughput from the median step time."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses: list[float] = []
    step = lambda: losses.append(sgd_step(model, forward_loss, optimizer, after_backward).item())
    timing = measure(step, warmup=warmup, repeats=steps, device=device, barrier=barrier)
    return {"way": name, "step_s": timing.median, "samples_per_s": samples_per_step / timing.median,
            "final_loss": losses[-1]}


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max((pa.detach().cpu() - pb.detach().cpu()).abs().max().item()
               for pa, pb in zip(a.parameters(), b.parameters()))


def three_ways(ctx: DistContext, *, width: int, depth: int, num_classes: int, global_batch: int,
               steps: int, warmup: int = 2, lr: float = 0.05) -> dict[str, Any]:
    """The same training run three ways: {"rows": one row per way that ran (throughputs on rank
    0), "threads": {} or, while the four steps are stubs, the `{"unsolved": message}` record of
    the ThreadDataParallel way (the other ways still run)}."""
    local_batch = divide(global_batch, ctx.world_size, "the global batch over the ranks")
    x, y = make_batch(global_batch, width, num_classes)
    x, y = x.to(ctx.device), y.to(ctx.device)
    loss_on = lambda inputs, targets: (lambda model: F.cross_entropy(model(inputs), targets))
    common = dict(steps=steps, warmup=warmup, lr=lr, device=ctx.device,
                  samples_per_step=global_batch)
    rows: list[dict] = []
    trained: dict[str, nn.Module] = {}
    threads: dict[str, str] = {}

    # 1 and 2 run on rank 0 alone; the other ranks wait at the barrier (blocked, not computing)
    if ctx.rank == 0:
        single = make_mlp(width, depth, num_classes).to(ctx.device)
        rows.append(run_way("one process", single, loss_on(x, y), **common))
        trained["one process"] = single
        tdp = ThreadDataParallel(make_mlp(width, depth, num_classes).to(ctx.device), ctx.world_size)
        name = f"{ctx.world_size} threads (ThreadDataParallel)"
        row = attempt(run_way, name, tdp, loss_on(x, y), **common)
        if "unsolved" in row:
            threads = row
        else:
            rows.append(row)
            trained[name] = tdp.module
        if ctx.device.type == "cuda" and gpu_count() >= ctx.world_size >= 2:
            dp = nn.DataParallel(make_mlp(width, depth, num_classes).to(ctx.device),
                                 device_ids=list(range(ctx.world_size)))
            name = f"{ctx.world_size} GPUs, threads (nn.DataParallel)"
            rows.append(run_way(name, dp, loss_on(x, y), **common))
            trained[name] = dp.module
    ctx.barrier()

    # 3: every rank trains on its slice of the same batch and averages gradients (DDP by hand)
    lo = ctx.rank * local_batch
    replica = make_mlp(width, depth, num_classes).to(ctx.device)
    name = f"{ctx.world_size} processes (all_reduce)"
    row = run_way(name, replica, loss_on(x[lo:lo + local_batch], y[lo:lo + local_batch]),
                  after_backward=lambda: average_gradients(replica, ctx.world_size),
                  barrier=True, **common)
    # every rank must end with the same parameters: compare with rank 0's
    reference = [p.detach().clone() for p in replica.parameters()]
    for tensor in reference:
        dist.broadcast(tensor, src=0)
    row["rank_diff"] = max((p.detach() - r).abs().max().item()
                           for p, r in zip(replica.parameters(), reference))
    if ctx.rank != 0:
        return {"rows": [row], "threads": threads}
    rows.append(row)
    trained[name] = replica
    for row in rows:  # same data, same init, same steps: the parameters must agree
        row["param_diff_vs_one_process"] = max_param_diff(trained[row["way"]],
                                                          trained["one process"])
        row["speedup"] = row["samples_per_s"] / rows[0]["samples_per_s"]
    return {"rows": rows, "threads": threads}


@dataclass(frozen=True)
class Run(runs.Run):
    """The MLP trained three ways (depth x Linear(width, width), then num_classes), the global
    batch, and the SGD steps."""
    width: int = 1024
    depth: int = 3
    num_classes: int = 10
    global_batch: int = 256
    steps: int = 10
    SMOKE = dict(width=128, depth=2, global_batch=32, steps=3)


def main(argv: list[str] | None = None) -> None:
    config = Run.from_argv(argv).values()
    with distributed() as ctx:
        ctx.print0(f"lab 02: the same {config['steps']}-step SGD run three ways, "
                   f"{ctx.world_size} workers, device {ctx.device}, "
                   f"{torch.get_num_threads()} torch thread(s) per process; config {config}")
        ways = three_ways(ctx, **config)
        ctx.report(config=config, **ways, torch_threads=torch.get_num_threads())
        if ctx.rank == 0:
            from helpers.show import table
            table(ways["rows"], ["way", "step_s", "samples_per_s", "speedup",
                                 "param_diff_vs_one_process"],
                  title="one training step, three ways (throughput from the median step)")
            ctx.print0("Threads share one process and its GIL and re-replicate the model every "
                       "step; processes replicate once and only exchange gradients: notebook 03.")


if __name__ == "__main__":
    main()
