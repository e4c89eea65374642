"""Lab 10: silent divergence. Replicas that drift apart, and a cheap check that finds where.

Run:  ./run.sh 10      (this file alone: ./run.sh labs/lab10_divergence.py)

Data parallelism is correct only while every rank holds the same model. Nothing checks that for
you: replicas that drift apart keep training, each on its own model, with no error. This lab trains
one small model (Linear -> BatchNorm -> ReLU -> Dropout -> Linear) with hand-written gradient
averaging, healthy and with one bug planted per variant:
- the model built after seeding each rank differently (different initialisation);
- a pretrained backbone loaded on rank 0 only, never broadcast (a forgotten broadcast);
- a random re-initialisation at step k drawn from each rank's own RNG (random state);
- BatchNorm's running statistics never averaged (a buffer not synchronised);
- gradient clipping whose total norm adds the per-tensor norms in a rank-dependent order, as an
  atomic-add reduction on a GPU would (a non-deterministic op: the ranks differ in the last bits).
Dropout masks differ across ranks in every variant, the healthy one included: that is harmless,
since the averaged gradient is the same on every rank.

Each variant runs twice: once under a naive check that all-gathers every tensor of the model every
step (exact, and it sends the whole model), once under the homework, `find_divergence`, which sends
a few bytes per tensor and names the first step and the tensors where the ranks disagree.

Homework: `find_divergence` below. Check it with `./run.sh check 10`.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from helpers import runs
from helpers.comm_count import count_collectives
from helpers.dist import DistContext, distributed
from helpers.notice import attempt
from helpers.show import table
from helpers.tensors import seeded

SEED, LOCAL_BATCH, LR = 0, 8, 0.2
SIZES = (16, 32, 4)
CLIP_NORM = 0.05  # small enough that clipping acts at every step


# ============================================================================ the homework
@dataclass(frozen=True)
class Divergence:
    """Where the ranks' copies of a model were first seen to disagree."""
    step: int                  # training steps done when the disagreement was seen (0: before any)
    last_agreed: int | None    # the last checked step at which every rank agreed (None: none did)
    names: tuple[str, ...]     # the state_dict entries that differ, in state_dict order
    ranks: tuple[int, ...]     # the ranks of `group` whose copy differs from group rank 0's


def find_divergence(model: nn.Module, train_step: Callable[[int], Any], steps: int, every: int = 1,
                    group=None) -> Divergence | None:
    """Train and return where the ranks' copies of `model` first disagree (None if they never do).

    Exercise. Call it on every rank of `group` (default: all ranks) with that rank's replica.
    It checks that every rank holds bitwise the same `model.state_dict()` (parameters and buffers)
    before the first step and after every `every` training steps, and after the last one; between
    checks it calls `train_step(s)` for s = 0, 1, ..., steps - 1, in order. At the first check
    that fails it stops training and returns a `Divergence`: `step`, the number of steps done at
    that check; `last_agreed`, the step of the check before it (None when the first check fails);
    `names`, every state_dict key whose tensor differs on some rank, in state_dict order; `ranks`,
    the group ranks whose copy differs from group rank 0's, ascending (all the others when group
    rank 0 is the odd one). Every rank returns the same answer. If every check passes, it returns
    None after `steps` steps. `every` must be >= 1 and `steps` >= 0 (ValueError otherwise).

    A check must be cheap: each rank sends a fixed few bytes per tensor (at most 64, e.g. a few
    int64 checksums per tensor, every tensor's in one all-gather), never the tensors. And it must
    see the differences training bugs make, in tensors of any size, dtype and byte count: the last
    bit of one element; two elements changed by +d and -d (a plain sum does not see it); two
    elements swapped (nothing that ignores positions sees it: a sum, a sum of squares, a
    histogram); two such changes far apart (position weights that repeat, e.g. modulo 65,521,
    give both the same weight). The tests plant each of these on one rank and check the answer.
    Hint: view the tensor's bytes as integers (`t.detach().contiguous().view(-1).view(torch.uint8)`)
    and combine them with position weights that never repeat within a tensor. Compute on the
    tensors' device (nccl moves only tensors on the rank's GPU).
    """
    ### BEGIN SOLUTION
    if every < 1 or steps < 0:
        raise ValueError(f"find_divergence needs every >= 1 and steps >= 0, got every={every}, steps={steps}")
    world_size = dist.get_world_size(group)
    names = list(model.state_dict().keys())

    def checksum(tensor: torch.Tensor) -> torch.Tensor:
        """Three int64 sums over the tensor's bytes read as 32-bit words w_1, w_2, ...:
        sum w_i sees any change within one word; sum i * w_i any two words changed by +d and -d,
        so any swap of two elements of 4 bytes or less; sum (i^2 mod p) * w_i most of what the
        first two miss (two 8-byte elements swapped, changes spread over many words). No product
        overflows for tensors under 8 GiB (i < 2^31, w_i < 2^32); the sums wrap modulo 2^64,
        which keeps the first two guarantees (a product d * (i - j) is never a multiple of 2^64)."""
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
        raw = torch.cat([raw, raw.new_zeros(-raw.numel() % 4)])  # a copy: aligned, whole words
        words = raw.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # (nbytes / 4,) in [0, 2^32)
        index = torch.arange(1, words.numel() + 1, device=words.device)
        return torch.stack([words.sum(), (index * words).sum(), (index * index % 2147483647 * words).sum()])

    def checksums() -> torch.Tensor:
        return torch.stack([checksum(t) for t in model.state_dict().values()])  # (n_tensors, 3): 24 bytes each

    def disagreement() -> tuple[tuple[str, ...], tuple[int, ...]]:
        mine = checksums()
        everyone = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(everyone, mine, group=group)
        differs = (torch.stack(everyone) != everyone[0]).any(dim=2)  # (world_size, n_tensors)
        tensors = differs.any(dim=0).nonzero().flatten().tolist()
        ranks = differs.any(dim=1).nonzero().flatten().tolist()
        return tuple(names[i] for i in tensors), tuple(ranks)

    done, last_agreed = 0, None
    while True:
        bad_names, bad_ranks = disagreement()
        if bad_names:
            return Divergence(done, last_agreed, bad_names, bad_ranks)
        if done >= steps:
            return None
        last_agreed = done
        for step in range(done, min(done + every, steps)):
            train_step(step)
        done = min(done + every, steps)
    ### END SOLUTION


# ============================================================================ the model and a step
def make_model(seed: int = SEED) -> nn.Sequential:
    with seeded(seed):
        return nn.Sequential(OrderedDict(
            backbone=nn.Linear(SIZES[0], SIZES[1]), norm=nn.BatchNorm1d(SIZES[1]), act=nn.ReLU(),
            drop=nn.Dropout(0.2), head=nn.Linear(SIZES[1], SIZES[2])))


def batch(step: int, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step `step`'s batch: x (B, 16), y (B, 4) from a fixed linear teacher."""
    teacher = torch.randn(SIZES[0], SIZES[2], generator=torch.Generator().manual_seed(99))
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(LOCAL_BATCH, SIZES[0], generator=gen)
    return x.to(device), (x @ teacher).to(device)


def average_(tensors, world_size: int) -> None:
    for t in tensors:
        dist.all_reduce(t)
        t.div_(world_size)


def total_norm_in_rank_order(grads: list[torch.Tensor], rank: int) -> torch.Tensor:
    """sqrt(sum of squared per-tensor norms), added up starting at tensor `rank`: float addition
    is not associative, so each rank gets a slightly different total (as an atomic-add reduction
    on a GPU would, whose order depends on thread timing)."""
    squares = [g.float().pow(2).sum() for g in grads]
    start = rank % len(squares)
    total = torch.zeros((), device=grads[0].device)
    for s in squares[start:] + squares[:start]:
        total = total + s
    return total.sqrt()


class Replica:
    """One rank's copy of the model, its optimizer and the step the variant `bug` plants."""

    def __init__(self, bug: str, rank: int, world_size: int, device, reinit_step: int):
        self.bug, self.rank, self.world_size, self.device = bug, rank, world_size, device
        self.reinit_step = reinit_step
        self.model = make_model(SEED + rank if bug == "different initialisation" else SEED).to(device)
        if bug == "forgotten broadcast" and rank == 0:
            # a "pretrained" backbone loaded from a checkpoint on rank 0 only; no broadcast follows
            self.model.backbone.load_state_dict(make_model(SEED + 7).backbone.state_dict())
        self.model.train()
        torch.manual_seed(1234 + rank)  # dropout masks differ across ranks, as they would anyway

    def step(self, step: int) -> float:
        x, y = batch(step, self.rank, self.device)
        loss = nn.functional.mse_loss(self.model(x), y)
        for p in self.model.parameters():
            p.grad = None
        loss.backward()
        grads = [p.grad for p in self.model.parameters()]
        average_(grads, self.world_size)
        if self.bug == "non-deterministic reduction":
            scale = (CLIP_NORM / (total_norm_in_rank_order(grads, self.rank) + 1e-6)).clamp(max=1.0)
        else:
            scale = (CLIP_NORM / (total_norm_in_rank_order(grads, 0) + 1e-6)).clamp(max=1.0)
        with torch.no_grad():  # plain SGD on the clipped gradient
            for p, g in zip(self.model.parameters(), grads):
                p.sub_(LR * scale * g)
        if self.bug == "random state" and step == self.reinit_step:
            with torch.no_grad():  # "re-initialise dead units", with this rank's own random numbers
                self.model.backbone.weight[:4].normal_(0.0, 0.1)
        if self.bug != "buffer not synchronised":
            norm = self.model.norm
            average_([norm.running_mean, norm.running_var], self.world_size)
        return loss.item()


VARIANTS = ("healthy", "different initialisation", "forgotten broadcast", "random state",
            "buffer not synchronised", "non-deterministic reduction")


# ============================================================================ the naive check
def naive_differences(model: nn.Module, rank: int, world_size: int) -> tuple[dict[str, float], int]:
    """All-gather every state tensor (as float64) and return, per tensor, the largest absolute
    difference of any rank from rank 0; and the bytes this rank sent to do it."""
    state = model.state_dict()
    flat = torch.cat([t.detach().double().reshape(-1) for t in state.values()])  # the whole model
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    gap = (torch.stack(everyone) - everyone[0]).abs().amax(dim=0)  # (n_elements,)
    out, start = {}, 0
    for name, t in state.items():
        out[name] = gap[start:start + t.numel()].max().item() if t.numel() else 0.0
        start += t.numel()
    return out, flat.nbytes


def naive_run(bug: str, rank: int, world_size: int, device, steps: int, reinit_step: int) -> dict:
    replica = Replica(bug, rank, world_size, device, reinit_step)
    curve, first = [], None
    for step in range(steps + 1):  # check, then train: step = steps done
        gaps, sent = naive_differences(replica.model, rank, world_size)
        curve.append(max(gaps.values()))
        if first is None and curve[-1] > 0:
            first = {"step": step, "names": [n for n, g in gaps.items() if g > 0]}
        if step < steps:
            replica.step(step)
    return {"max_diff": curve, "first": first, "bytes_per_check": sent,
            "model_bytes": sum(t.nbytes for t in replica.model.state_dict().values())}


def checked_run(bug: str, rank: int, world_size: int, device, steps: int, every: int,
                reinit_step: int) -> dict:
    """find_divergence on a fresh replica, with the bytes its checks sent (training's own
    all-reduces not counted)."""
    replica = Replica(bug, rank, world_size, device, reinit_step)
    with count_collectives() as log:
        def train_step(step: int) -> None:
            with log.paused():
                replica.step(step)
        found = find_divergence(replica.model, train_step, steps, every)
    checks = len(range(0, found.step if found else steps, every)) + 1  # + the one that failed, or the last
    return {"found": asdict(found) if found else None, "check_bytes": log.input_bytes,
            "checks": checks, "bytes_per_check": log.input_bytes / checks}


@dataclass(frozen=True)
class Run(runs.Run):
    """Steps trained, how often replicas are compared, and the step a planted re-initialisation
    hits."""
    steps: int = 12
    every: int = 1
    reinit_step: int = 5
    SMOKE = dict(steps=8, reinit_step=3)


def run(ctx: DistContext, cfg: Run) -> dict:
    rank, world_size, device = ctx.rank, ctx.world_size, ctx.device
    steps, every, reinit_step = cfg.steps, cfg.every, cfg.reinit_step
    out = {"steps": steps, "reinit_step": reinit_step, "variants": {}}
    unsolved = None  # the exercise's stub record, once seen (one notice, not one per variant)
    for bug in VARIANTS:
        record = naive_run(bug, rank, world_size, device, steps, reinit_step)
        record["check"] = unsolved or attempt(checked_run, bug, rank, world_size, device, steps,
                                              every, reinit_step)
        if "unsolved" in record["check"]:
            unsolved = record["check"]
        out["variants"][bug] = record
    return out


def summary_rows(out: dict) -> list[dict]:
    rows = []
    for bug, rec in out["variants"].items():
        check = rec["check"]
        found = check.get("found") if "unsolved" not in check else None
        rows.append({
            "variant": bug,
            "naive: first step": rec["first"]["step"] if rec["first"] else "never",
            "naive: max |diff| at the end": rec["max_diff"][-1],
            "find_divergence": "not done yet" if "unsolved" in check else
            (f"step {found['step']}: {', '.join(found['names'])} on ranks {found['ranks']}" if found else "never"),
            "bytes per check (naive / find_divergence)":
            f"{rec['bytes_per_check']} / " + ("-" if "unsolved" in check else
                                              f"{check['bytes_per_check']:.0f}"),
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        out = run(ctx, cfg)
        ctx.report(divergence=out)
        if ctx.rank == 0:
            table(summary_rows(out), title=f"{ctx.world_size} replicas, {out['steps']} steps, "
                                           "checked every step")


if __name__ == "__main__":
    main()
