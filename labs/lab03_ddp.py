"""Lab 03: data parallelism by hand, from gradient averaging to buckets with overlap.

Run:  ./run.sh 03      (or: ./run.sh labs/lab03_ddp.py)

Every rank holds a full copy of the model and trains on its own slice of the global batch. After
backward, rank r's gradient is the mean over its slice; averaging the gradients over the N ranks
gives the mean over the whole batch, so N ranks with local batch B take exactly the steps one
process takes with batch N*B. The path, each step a small change to the one before:

1. `average_gradients`: after backward, one blocking all-reduce per parameter (naive).
2. `average_gradients_flat`: after backward, one all-reduce of every gradient packed into a single
   flat tensor (one large message instead of many small ones, but still after backward).
3. `OverlappedDDP`: a hook on each parameter launches an asynchronous all-reduce of its gradient
   as soon as backward has produced it, while backward computes the earlier layers (overlap, but
   one small message per parameter).
4. `BucketedDDP` (homework): the hooks copy gradients into buckets of about `bucket_cap_mb`; each
   full bucket is all-reduced asynchronously while backward goes on: few large messages *and*
   overlap. This is the design of `torch.nn.parallel.DistributedDataParallel` (Li et al. 2020,
   "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", arXiv:2006.15704).

Every method counts its collectives and bytes in a `CountingComm` (helpers/comm_count.py) and times them (the timeline of
labs/lab03_ddp_bench.py). Running this file shows the buckets torch's DDP all-reduces per step, next
to BucketedDDP's: in torch 2.13 (`compute_bucket_size_limits`, torch/nn/parallel/distributed.py)
step 0 sends one bucket (unless `find_unused_parameters=True`), later steps buckets rebuilt in the
order the gradients arrived; only `bucket_cap_mb=None` caps the first bucket at 1 MiB (25 MiB after).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import runs
from helpers.comm_count import CountedWork, CountingComm, mark_finish
from helpers.dist import DistContext, distributed
from helpers.notice import attempt
from helpers.show import table
from helpers.tensors import ddp_device_ids, divide, seeded

def broadcast_parameters(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Copy the parameters and buffers of the group's first rank to every rank of `group`.

    Replicas must start equal: averaged gradients keep equal parameters equal, but never make
    different ones equal.
    """
    src = 0 if group is None else dist.get_global_rank(group, 0)  # broadcast takes a global rank
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        dist.broadcast(tensor.detach(), src=src, group=group)


# --- 1. naive: one blocking all-reduce per parameter, after backward ------------------------------

def average_gradients(module: nn.Module, comm: CountingComm) -> None:
    for param in module.parameters():
        if param.grad is not None:
            comm.all_reduce_sum(param.grad)
            param.grad.div_(comm.world_size)


# --- 2. flat: one all-reduce of every gradient packed together, after backward --------------------

def average_gradients_flat(module: nn.Module, comm: CountingComm) -> None:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])  # (total_numel,): one copy, one message
    comm.all_reduce_sum(flat)
    flat.div_(comm.world_size)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


# --- 3. overlapped: one async all-reduce per parameter, launched from its gradient hook -----------

class OverlappedDDP(nn.Module):
    """Each parameter's all-reduce starts the moment backward has accumulated its gradient.

    Backward runs from the last layer to the first, so the last layer's all-reduce travels while
    the earlier layers' gradients are being computed. Call `finish_gradient_synchronization()`
    after `loss.backward()` and before `optimizer.step()`.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.module = module
        self.comm = CountingComm(group)
        broadcast_parameters(module, group)
        self._pending: list[tuple[torch.Tensor, CountedWork]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for p in module.parameters() if p.requires_grad]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        # Called by autograd inside loss.backward(), once param.grad holds this step's gradient.
        self._pending.append((param, self.comm.all_reduce_sum(param.grad, async_op=True)))

    def finish_gradient_synchronization(self) -> None:
        for param, work in self._pending:
            work.wait()
            param.grad.div_(self.comm.world_size)
        self._pending.clear()


# --- 4. bucketed with overlap (homework) ---------------------------------------------------------

def plan_buckets(params: Sequence[torch.Tensor], bucket_cap_bytes: int) -> list[list[int]]:
    """Group parameters into buckets, in the order backward produces their gradients.

    Backward computes gradients from the last layer to the first, so walk `params` from the LAST
    index to the first, adding each parameter to the current bucket; start a new bucket when
    adding the parameter would take the bucket's size (the sum of `Tensor.nbytes`, in bytes)
    above `bucket_cap_bytes`, or when its dtype or device differs from the bucket's (one flat
    buffer per bucket). A parameter larger than the cap gets a bucket of its own; a bucket is
    never empty.

    Returns a list of buckets, each a list of indices into `params`. Examples: four float32
    parameters of 25 elements (100 bytes each) with a cap of 250 bytes give [[3, 2], [1, 0]], and
    so does a cap of 200 (a bucket may fill the cap exactly); with a cap of 0 every parameter is
    alone: [[3], [2], [1], [0]]; with a cap of 10**9 they all share one: [[3, 2, 1, 0]]. The tests
    check these rules on several layouts.
    """
    ### BEGIN SOLUTION
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index in reversed(range(len(params))):
        param = params[index]
        size = param.nbytes
        if current:
            first = params[current[0]]
            same_kind = param.dtype == first.dtype and param.device == first.device
            if not same_kind or current_bytes + size > bucket_cap_bytes:
                buckets.append(current)
                current, current_bytes = [], 0
        current.append(index)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets
    ### END SOLUTION


@dataclass
class Bucket:
    """One flat buffer that carries several gradients in one all-reduce."""

    param_indices: list[int]   # indices into BucketedDDP.params, in the order grads become ready
    offsets: list[int]         # where each of those parameters' gradient starts in `buffer`
    buffer: torch.Tensor       # (sum of their numel,), same dtype and device as the parameters
    num_ready: int = 0         # gradients copied in during this backward
    work: CountedWork | None = field(default=None)  # the in-flight all-reduce, once launched


class BucketedDDP(nn.Module):
    """Data parallelism with gradient buckets whose all-reduces overlap the backward pass.

    At construction: rank 0's parameters are broadcast to every rank of `group`; the trainable
    parameters (`self.params`) are split into `self.buckets` by `plan_buckets`; a hook on each
    parameter calls `self._on_grad_ready(index)` when its gradient is ready during backward.

        ddp = BucketedDDP(model, bucket_cap_mb=25.0)
        loss = loss_fn(ddp(x), y)
        loss.backward()                        # full buckets are all-reduced while this runs
        ddp.finish_gradient_synchronization()  # wait, average, write the averages into .grad
        optimizer.step()

    `self.comm` counts collectives, bytes and waits: every all-reduce must go through
    `self.comm.all_reduce_sum(...)`.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0,
                 group: dist.ProcessGroup | None = None):
        super().__init__()
        if bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.comm = CountingComm(group)
        broadcast_parameters(module, group)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buckets: list[Bucket] = []
        for indices in plan_buckets(self.params, int(bucket_cap_mb * 2**20)):
            numels = [self.params[i].numel() for i in indices]
            first = self.params[indices[0]]
            self.buckets.append(Bucket(
                param_indices=list(indices),
                offsets=list(itertools.accumulate([0] + numels[:-1])),
                buffer=torch.zeros(sum(numels), dtype=first.dtype, device=first.device),
            ))
        # bucket_of[param index] = (bucket index, position of the parameter in that bucket)
        self.bucket_of = {i: (b, pos) for b, bucket in enumerate(self.buckets)
                          for pos, i in enumerate(bucket.param_indices)}
        if sorted(self.bucket_of) != list(range(len(self.params))) or \
                sum(len(b.param_indices) for b in self.buckets) != len(self.params):
            raise ValueError("plan_buckets must place every parameter in exactly one bucket")
        self.next_bucket = 0  # buckets launch in order 0, 1, 2...: the same order on every rank
        self.require_backward_grad_sync = True
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._grad_hook, i))
                       for i, p in enumerate(self.params)]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate into .grad (gradient accumulation); the first
        backward after it all-reduces the accumulated gradients."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _grad_hook(self, index: int, param: torch.Tensor) -> None:
        if self.require_backward_grad_sync:
            self._on_grad_ready(index)

    def _on_grad_ready(self, index: int) -> None:
        """Autograd has accumulated the gradient of `self.params[index]` (inside loss.backward()).

        Copy that gradient, flattened, into its bucket's buffer at its offset (`self.bucket_of`
        says which bucket and position), and count it as ready. Then launch, in bucket order,
        every bucket that is complete: while bucket `self.next_bucket` has all its gradients,
        start `work = self.comm.all_reduce_sum(bucket.buffer, async_op=True)`, keep it in
        `bucket.work` and move `self.next_bucket` on. Do not wait here: waiting inside backward
        would remove the overlap. Launching only in bucket order keeps the sequence of
        collectives identical on every rank, which all-reduce requires.

        The tests check the overlap itself: when the step's last gradient (in the last bucket)
        becomes ready, every earlier bucket must already be on its way; every bucket is launched
        before `loss.backward()` returns, and nothing inside backward waits for an all-reduce to
        complete (no `.wait()`, no loop on `.is_completed()`: in one step another rank holds its
        gradients back, and backward must return all the same). They also use a model whose
        gradients complete a later bucket before an earlier one: the launches stay in bucket order.
        """
        ### BEGIN SOLUTION
        bucket_index, position = self.bucket_of[index]
        bucket = self.buckets[bucket_index]
        grad = self.params[index].grad
        offset = bucket.offsets[position]
        bucket.buffer[offset:offset + grad.numel()].copy_(grad.reshape(-1))
        bucket.num_ready += 1
        while self.next_bucket < len(self.buckets):
            ready = self.buckets[self.next_bucket]
            if ready.num_ready < len(ready.param_indices):
                break
            ready.work = self.comm.all_reduce_sum(ready.buffer, async_op=True)
            self.next_bucket += 1
        ### END SOLUTION

    def finish_gradient_synchronization(self) -> None:
        """Call after loss.backward(), before optimizer.step().

        For every bucket: wait for its all-reduce (the handle's `.wait()`, once per bucket: the
        tests count them), divide the summed buffer by the world size, and copy each parameter's
        slice back into its `.grad` (same shape as the parameter). Then reset the per-step state
        (`num_ready`, `work`, `self.next_bucket`) so the next backward starts afresh. Afterwards
        every rank's .grad equals the gradient of one process that saw the whole global batch.
        """
        missing = [i for bucket in self.buckets if bucket.work is None for i in bucket.param_indices]
        if missing:
            names = dict((id(p), n) for n, p in self.module.named_parameters())
            raise RuntimeError(
                "these parameters' buckets were not all-reduced (no gradient this step, or the "
                f"bucket was never launched): {[names.get(id(self.params[i])) for i in missing]}")
        ### BEGIN SOLUTION
        for bucket in self.buckets:
            bucket.work.wait()
            for index, offset in zip(bucket.param_indices, bucket.offsets):
                grad = self.params[index].grad
                # divide and copy back in one pass: summed slice / world size -> .grad
                torch.div(bucket.buffer[offset:offset + grad.numel()].view_as(grad),
                          self.world_size, out=grad)
            bucket.num_ready = 0
            bucket.work = None
        self.next_bucket = 0
        ### END SOLUTION


# --- torch DDP, instrumented, and the data every lab of notebook 03 trains on ------------------

def count_ddp_comm(ddp: DDP, comm: CountingComm) -> None:
    """Count torch DDP's bucket all-reduces (and time them) with a comm hook that calls DDP's
    default all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):  # no annotations: DDP checks them, and they are strings here
        event = state.record(bucket.buffer())
        future = allreduce_hook(state.group, bucket)
        mark_finish(future, event)
        return future

    ddp.register_comm_hook(comm, hook)


def make_mlp(sizes: Sequence[int], seed: int, device: torch.device | str = "cpu") -> nn.Sequential:
    """Linear layers of the given widths with ReLU between, initialised from `seed` (the caller's
    random stream is left as it was)."""
    layers: list[nn.Module] = []
    with seeded(seed):
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(fan_in, fan_out))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
    return nn.Sequential(*layers).to(device)


def global_batch(step: int, global_batch_size: int, in_features: int, out_features: int,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The same (x, y) on every rank for a given step: x (N*B, in), y (N*B, out)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(global_batch_size, in_features, generator=gen)
    y = torch.randn(global_batch_size, out_features, generator=gen)
    return x.to(device), y.to(device)


def local_shard(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous slice of the global batch (dim 0): (N*B, ...) -> (B, ...)."""
    local = divide(tensor.shape[0], world_size, "the global batch over the data-parallel ranks")
    return tensor[rank * local:(rank + 1) * local]


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def flat_grads(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1) for p in module.parameters()])


def torch_ddp_buckets(ctx: DistContext, sizes: Sequence[int], bucket_cap_mb: float | None,
                      steps: int, local_batch_size: int = 8, **ddp_kwargs) -> list[list[int]]:
    """The bytes of each bucket torch DDP all-reduces, per step: [[step 0's buckets], ...]."""
    model = make_mlp(sizes, seed=0, device=ctx.device)
    ddp = DDP(model, device_ids=ddp_device_ids(ctx.device), bucket_cap_mb=bucket_cap_mb, **ddp_kwargs)
    comm = CountingComm()
    count_ddp_comm(ddp, comm)
    per_step = []
    for step in range(steps):
        x, _ = global_batch(step, local_batch_size, sizes[0], sizes[-1], ctx.device)
        start = len(comm.timeline)
        ddp(x).square().mean().backward()
        per_step.append([event["bytes"] for event in comm.timeline[start:]])
    return per_step


def bucketed_ddp_buckets(sizes: Sequence[int], bucket_cap_mb: float) -> list[int]:
    """The bytes of each bucket BucketedDDP's `plan_buckets` makes (the same on every step)."""
    params = list(make_mlp(sizes, seed=0).parameters())
    return [sum(params[i].nbytes for i in bucket)
            for bucket in plan_buckets(params, int(bucket_cap_mb * 2**20))]


@dataclass(frozen=True)
class Run(runs.Run):
    """The MLP whose buckets are compared: depth x Linear(width, width), above 1 MiB of gradients
    even in smoke mode (torch DDP's first-bucket cap), and the small cap compared, in MiB."""
    width: int = 256
    depth: int = 24
    steps: int = 3
    small_cap_mb: float = 1.0
    SMOKE = dict(depth=6, small_cap_mb=0.5)


def run(ctx: DistContext, cfg: Run) -> dict:
    """Which buckets each wrapper all-reduces, step by step: torch DDP's rule vs BucketedDDP's."""
    width, depth, steps, small_cap = cfg.width, cfg.depth, cfg.steps, cfg.small_cap_mb
    sizes = [width] * (depth + 1)
    model_bytes = depth * (width * width + width) * 4
    ctx.print0(f"MLP {depth} x Linear({width}, {width}): {model_bytes / 2**20:.2f} MiB of gradients")
    configs = {"torch DDP, bucket_cap_mb=None (its default)": dict(bucket_cap_mb=None),
               "torch DDP, bucket_cap_mb=25": dict(bucket_cap_mb=25.0),
               f"torch DDP, bucket_cap_mb={small_cap:g}": dict(bucket_cap_mb=small_cap),
               f"torch DDP, bucket_cap_mb={small_cap:g}, find_unused_parameters=True":
                   dict(bucket_cap_mb=small_cap, find_unused_parameters=True)}
    buckets = {name: torch_ddp_buckets(ctx, sizes, steps=steps, **kwargs)
               for name, kwargs in configs.items()}
    ours = attempt(bucketed_ddp_buckets, sizes, small_cap)
    buckets[f"BucketedDDP, bucket_cap_mb={small_cap:g}"] = ours if "unsolved" in ours else [ours] * steps
    rule = {"buckets_per_step": buckets, "model_bytes": model_bytes, "width": width,
            "depth": depth, "small_cap_mb": small_cap}
    ctx.report(bucket_rule=rule)
    if ctx.rank == 0:
        table([{"wrapper": name, **{f"step {s}: buckets (KiB)": [round(b / 1024) for b in per[s]]
                                    for s in (0, 1)}}
               for name, per in buckets.items() if "unsolved" not in per],
              title="The buckets all-reduced in each step")
    return {"bucket_rule": rule}


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        run(ctx, cfg)


if __name__ == "__main__":
    main()
