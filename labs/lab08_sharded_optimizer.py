"""Lab 08 (the homework): `ShardedOptimizer`, ZeRO stage 1 as a wrapper around any torch optimizer.

Run:  ./run.sh 08      (this file alone: ./run.sh labs/lab08_sharded_optimizer.py)

Each rank keeps the optimizer state of only its share of the parameters: whole parameters,
assigned so that every rank gets about 1/N of the elements. After the gradients have been
averaged (by DDP, or by an all-reduce as below), every rank's wrapped optimizer updates its own
parameters and each parameter is then broadcast from its owner, so every rank ends the step with
the same, complete model. This is the design of `torch.distributed.optim.ZeroRedundancyOptimizer`
and of CS336's sharded optimizer; sharding whole parameters lets the wrapped optimizer run
unchanged, even one that needs a whole tensor at once (a norm per tensor, as LAMB does).

The run trains the model of labs/lab08_zero.py with Adam three ways on every rank: an all-reduce
of the gradients + ShardedOptimizer; ShardedOptimizer.reduce_gradients (the stretch: ZeRO-2's
reduce-scatter) + ShardedOptimizer; DDP + ZeroRedundancyOptimizer. Each is compared with one
process on the whole batch; every rank reports the bytes its optimizer holds and the collectives
of one step.

Homework: ShardedOptimizer below (`__init__`, `add_param_group`, `step`; stretch:
`reduce_gradients`). Check it with ./run.sh check 08 (tests/public/test_lab08_sharded_optimizer.py).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers import runs
from helpers.accounting import held_bytes, tensors_held_by
from helpers.comm_count import count_collectives, summarize
from helpers.comm_bench import reduce_scatter_single
from helpers.dist import DistContext, distributed
from helpers.notice import attempt
from helpers.show import table
from labs.lab08_zero import LR, PROBLEM_SMOKE, Problem, max_diff, my_rows, problem, spread_over_ranks


# ============================================================================ the homework
class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 around any torch optimizer: each rank keeps the state of its share of the parameters.

    `ShardedOptimizer(params, optimizer_cls, **kwargs)` takes what a torch optimizer takes
    (`params`: an iterable of tensors, or of dicts, parameter groups with hyper-parameters of
    their own), the optimizer class to wrap (torch.optim.SGD, Adam, AdamW, ...) and that class's
    keyword arguments, the defaults of every group. Every rank of the default process group
    builds it with the same parameters, in the same order.

    - Owners. Each parameter belongs to exactly one rank, and only that rank's wrapped optimizer
      ever sees it, so only that rank holds its state (Adam's two moments...). Balance the ranks
      by element count: take each group's parameters largest first (ties: in the group's order)
      and give each to the rank with the fewest elements so far (ties: the lowest rank), counting
      on from earlier groups. This is ZeroRedundancyOptimizer's rule; the same order gives the
      same owners on every rank with no communication.
    - One wrapped optimizer per rank, `optimizer_cls(..., **kwargs)`, with one group for each of
      this optimizer's groups, in the same order and with the same hyper-parameters, holding
      this rank's parameters of the group (possibly none: keep the group anyway).
    - `self.param_groups` (as every torch optimizer has) lists every parameter, on every rank,
      so zero_grad() (inherited, unchanged) clears every gradient and an LR scheduler can set a
      group's "lr" here: step() must hand such changes on to the wrapped optimizer.
    - step(closure=None): the gradients are already averaged over the ranks (DDP or an
      all-reduce did it); do not communicate them. The wrapped optimizer updates this rank's
      parameters (it calls `closure`, once, if given; return what it returns); then every
      parameter is broadcast from its owner (`dist.broadcast(p.detach(), src=owner)`, every rank
      in the same order), so all ranks end the step with identical parameters.
    - add_param_group(group) works as torch's (it is also how torch's __init__ adds each group):
      new parameters get owners by the rule above.

    The tests check the parameters against the unsharded optimizer in one process after several
    steps (Adam, AdamW, SGD with momentum, groups with different hyper-parameters, a group added
    later, an LR scheduler, tied and uneven parameters, a parameter count that the number of
    ranks does not divide, a rank that owns nothing; 2 to 4 ranks), that every rank ends with
    the same parameters, that `param_groups` lists every parameter and `zero_grad()` clears
    every gradient, that step() sends nothing but one broadcast of each parameter, and that
    each rank's optimizer holds the state of the elements the owner rule gives it: they add up
    every tensor reachable from your optimizer object (whatever you call the attributes) apart
    from the parameters themselves. A "sharded" optimizer that keeps the full state on every
    rank fails.
    """

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer],
                 **kwargs: Any):
        """Decide who owns what and build this rank's wrapped optimizer (see the class docstring)."""
        ### BEGIN SOLUTION
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.optimizer_cls, self.optimizer_kwargs = optimizer_cls, kwargs
        self.owner: dict[torch.Tensor, int] = {}   # parameter -> the rank that updates it
        self.numel_per_rank = [0] * self.world_size  # elements owned by each rank so far
        self.local: torch.optim.Optimizer | None = None  # the wrapped optimizer, this rank's share
        super().__init__(params, kwargs)  # calls self.add_param_group for every group
        ### END SOLUTION

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: give each new parameter an owner, hand this rank's to the wrapped optimizer."""
        ### BEGIN SOLUTION
        super().add_param_group(param_group)  # torch's checks and defaults; every parameter kept
        group = self.param_groups[-1]
        for p in sorted(group["params"], key=lambda p: p.numel(), reverse=True):  # stable sort
            rank = min(range(self.world_size), key=lambda r: self.numel_per_rank[r])
            self.owner[p] = rank
            self.numel_per_rank[rank] += p.numel()
        local_group = {**group, "params": [p for p in group["params"] if self.owner[p] == self.rank]}
        if self.local is None:
            self.local = self.optimizer_cls([local_group], **self.optimizer_kwargs)
        else:
            self.local.add_param_group(local_group)
        for key, value in self.local.param_groups[-1].items():  # the wrapped class's own defaults
            group.setdefault(key, value)
        ### END SOLUTION

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Update this rank's parameters (wrapped optimizer), then broadcast each from its owner."""
        ### BEGIN SOLUTION
        for group, local_group in zip(self.param_groups, self.local.param_groups):
            local_group.update({k: v for k, v in group.items() if k != "params"})  # e.g. a new lr
        loss = self.local.step(closure)  # torch optimizers run the closure with grad enabled
        for group in self.param_groups:
            for p in group["params"]:
                dist.broadcast(p.detach(), src=self.owner[p])
        return loss
        ### END SOLUTION

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Stretch (ZeRO-2): average the gradients with one reduce-scatter; keep only your own.

        Call it instead of the all-reduce, after backward and before step(). Pack every
        gradient into one flat buffer of N equal parts, part r holding (in parameter order) the
        gradients of rank r's parameters, zero-padded to the largest rank's element count; one
        `reduce_scatter_single` (helpers.comm_bench) sums part r into rank r; divide by N. Then
        the parameters this rank owns get their averaged gradients (views into the received
        part are fine) and every other parameter's `.grad` becomes None: this rank never needs
        it. A gradient that is None counts as zeros; all gradients share one dtype and device.

        Sent per rank: (N-1)/N of the buffer, half of what an all-reduce of the gradients sends
        when the ranks' parts are equal (the padding costs more when one parameter dominates).
        The tests count it, so an all-reduce followed by dropping the others' gradients fails.
        Memory: from this call to the next backward a rank holds its own part of the gradients,
        about 1/N. The peak
        is not lower: every full gradient exists at the end of backward (and the packed buffer
        next to them during this call). ZeRO-2 proper lowers the peak too by reduce-scattering
        each bucket of gradients while backward still runs and freeing it at once (notebook 08,
        section 3: at most one unit's full gradients alive).
        """
        ### BEGIN SOLUTION
        params = [p for group in self.param_groups for p in group["params"]]
        part = max(self.numel_per_rank)  # elements in each rank's part of the buffer
        send = torch.zeros(self.world_size * part, dtype=params[0].dtype, device=params[0].device)
        offsets = [r * part for r in range(self.world_size)]
        mine = []  # (parameter, offset in this rank's part)
        for p in params:
            rank = self.owner[p]
            if p.grad is not None:  # (None: zeros, already there)
                send[offsets[rank]:offsets[rank] + p.numel()] = p.grad.reshape(-1)
            if rank == self.rank:
                mine.append((p, offsets[rank] - rank * part))
            else:
                p.grad = None  # not ours: dropped
            offsets[rank] += p.numel()
        received = torch.empty(part, dtype=send.dtype, device=send.device)  # (part,)
        reduce_scatter_single(received, send)
        received.div_(self.world_size)
        for p, offset in mine:
            p.grad = received[offset:offset + p.numel()].view_as(p)
        ### END SOLUTION


# ============================================================================ the run
def average_gradients(model: nn.Module) -> None:
    """What DDP does for ShardedOptimizer: all-reduce every gradient, divide by N."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())


def optimizer_held(optimizer: torch.optim.Optimizer, model: nn.Module) -> int:
    """Bytes of every tensor `optimizer` keeps, wherever it keeps it, apart from the parameters
    and their gradients (the model's)."""
    params = list(model.parameters())
    owned_by_model = params + [p.grad for p in params if p.grad is not None]
    held = held_bytes({"model": owned_by_model,
                       "optimizer": tensors_held_by(optimizer, exclude=owned_by_model)})
    return held["optimizer"]


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of the storages behind the model's gradients (a shared buffer counted once)."""
    return held_bytes({"gradients": [p.grad for p in model.parameters()]})["gradients"]


def train_sharded(model: nn.Module, batches: list, device: torch.device, stretch: bool) -> dict:
    """Adam through ShardedOptimizer; gradients averaged by all-reduce, or by reduce_gradients.
    Reports the last step's collectives (and the bytes sent per kind), and the gradient bytes
    this rank holds right after backward and after the averaging."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = copy.deepcopy(model).to(device)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=LR)
    for x, y in batches:
        with count_collectives() as log:
            optimizer.zero_grad()
            F.mse_loss(model(my_rows(x, rank, world_size).to(device)),
                       my_rows(y, rank, world_size).to(device)).backward()
            after_backward = gradient_bytes(model)
            if stretch:
                optimizer.reduce_gradients()  # ZeRO-2: each rank receives its own gradients only
            else:
                average_gradients(model)
            after_averaging = gradient_bytes(model)
            optimizer.step()
    sent_by_kind: dict[str, float] = {}
    for c in log:
        sent_by_kind[c.kind] = sent_by_kind.get(c.kind, 0.0) + c.sent_bytes
    return {"params": [p.detach().clone() for p in model.parameters()],
            "optimizer_bytes": optimizer_held(optimizer, model), "collectives": summarize(log),
            "sent_by_kind": sent_by_kind, "gradient_bytes_after_backward": after_backward,
            "gradient_bytes_after_averaging": after_averaging}


def train_zero_redundancy(model: nn.Module, batches: list, device: torch.device) -> dict:
    """DDP + ZeroRedundancyOptimizer (labs/lab08_torch_sharding.py), measured as ours is."""
    from labs.lab08_torch_sharding import train_zero_redundancy as train  # FSDP2 & co: only here
    result = train(model, batches, device)
    return {"params": result["params"], "collectives": result["collectives"],
            "optimizer_bytes": optimizer_held(result["optimizer"], result["model"])}


@dataclass(frozen=True)
class Run(runs.Run, Problem):
    """Lab 08's problem (labs/lab08_zero.py)."""
    SMOKE = PROBLEM_SMOKE


def run(ctx: DistContext, cfg: Run) -> dict:
    model, batches, reference, shape = problem(cfg)
    num_params = sum(p.numel() for p in reference)
    unsharded = copy.deepcopy(model)
    full_state = optimizer_held(_one_adam_step(unsharded, batches[0]), unsharded)
    out = {"num_params": num_params, "world_size": ctx.world_size,
           "unsharded_optimizer_bytes": full_state}
    for name, fn, args in (("sharded", train_sharded, (False,)), ("stretch", train_sharded, (True,)),
                           ("zero_redundancy", train_zero_redundancy, ())):
        result = attempt(fn, model, batches, ctx.device, *args)
        if "params" in result:
            params = result.pop("params")
            result.update(max_diff_vs_one_process=max_diff(params, reference),
                          max_diff_across_ranks=spread_over_ranks(params))
        out[name] = result
    ctx.report(**out)
    return out


def _one_adam_step(model: nn.Module, batch) -> torch.optim.Optimizer:
    """An unsharded Adam after one step (its state exists from the first step on)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    F.mse_loss(model(batch[0]), batch[1]).backward()
    optimizer.step()
    return optimizer


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        out = run(ctx, cfg)
        if ctx.rank != 0:
            return
        rows = []
        for name, label in (("sharded", "all-reduce + ShardedOptimizer"),
                            ("stretch", "reduce_gradients + ShardedOptimizer (ZeRO-2)"),
                            ("zero_redundancy", "DDP + ZeroRedundancyOptimizer")):
            r = out[name]
            if "unsolved" in r:
                rows.append({"run": label, "result": "exercise not done yet"})
                continue
            rows.append({"run": label, "optimizer MiB (rank 0)": r["optimizer_bytes"] / 2**20,
                         "of unsharded Adam": r["optimizer_bytes"] / out["unsharded_optimizer_bytes"],
                         "sent MiB/step": r["collectives"]["sent_bytes"] / 2**20,
                         "max diff vs 1 process": r["max_diff_vs_one_process"]})
        table(rows, floatfmt=".3g", title=f"Sharded optimizers on {ctx.world_size} ranks, "
              f"{out['num_params']:,} parameters, Adam")


if __name__ == "__main__":
    main()
