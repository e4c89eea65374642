"""Lab 14 (the exercise): DiLoCo's outer step by hand, and checked step by step against torchft's
DiLoCo on the same run.

Run:  ./run.sh 14      (alone: NPROC=2 ./run.sh labs/lab14_diloco.py; every rank is a replica)
Check your exercise:  ./run.sh check 14

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models", arXiv:2311.08105, Algorithm 1): every replica starts a round from the same global
parameters theta, takes H steps of its inner optimizer (AdamW) on its own data, then

    delta_r   = theta - theta_r            (the pseudo-gradient: where the replica went, as a gradient)
    delta     = mean over replicas of delta_r        (one all-reduce)
    theta     = OuterOpt(theta, delta)     (SGD with Nesterov momentum, lr 0.7, momentum 0.9)

and every replica continues from the new theta with its inner optimizer's state as it was.
`DiLoCo` below does the bookkeeping (the round's starting parameters, counting inner steps);
`outer_step` is the exercise. `compare_with_torchft` trains one model with torchft's
`torchft.local_sgd.DiLoCo` and one with yours, side by side on the same batches, and reports how
far apart they are after every step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from helpers import runs
from helpers.dist import DistContext, distributed
from labs.lab14_replicas import in_one_launch   # before torchft: it quiets torchft's servers

OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}   # Douillard et al.'s outer SGD
INNER_LR = 1e-2


class DiLoCo:
    """DiLoCo on one replica: `step()` after each backward pass steps the inner optimizer, and
    every `sync_every`-th call runs the outer step (`outer_step`, the exercise).

        diloco = DiLoCo(model, torch.optim.AdamW(model.parameters()),
                        torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True),
                        sync_every=H)
        for x, y in batches:
            loss_fn(model(x), y).backward()
            diloco.step()                # True when it ran the outer step
            diloco.inner_optimizer.zero_grad()

    `group` is the process group whose ranks are the replicas (None: every rank). Every replica
    must start from the same parameters (build the model the same way everywhere).
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: torch.optim.Optimizer, sync_every: int,
                 group: dist.ProcessGroup | None = None):
        if sync_every < 1:
            raise ValueError(f"sync_every must be at least 1 inner step, got {sync_every}")
        self.model, self.group, self.sync_every = model, group, sync_every
        self.inner_optimizer, self.outer_optimizer = inner_optimizer, outer_optimizer
        # the round's global parameters theta, in model.parameters() order (plain tensors)
        self.anchor = [p.detach().clone() for p in model.parameters()]
        self.inner_steps = 0
        self.rounds = 0

    def step(self) -> bool:
        """One inner step; the outer step after every `sync_every` of them (returns True then)."""
        self.inner_optimizer.step()
        self.inner_steps += 1
        if self.inner_steps < self.sync_every:
            return False
        self.outer_step()
        self.inner_steps = 0
        self.rounds += 1
        return True

    def outer_step(self) -> None:
        """DiLoCo's outer step: average the pseudo-gradients over the replicas, step the outer optimizer.

        On entry the model holds this replica's parameters theta_r after its inner steps, and
        `self.anchor` the round's global parameters theta (the same on every replica). Then:

        - the pseudo-gradient of each parameter is theta - theta_r (the anchor minus the
          replica's: it points where a gradient would, uphill);
        - it is averaged over the replicas of `self.group`: all-reduces of the pseudo-gradients
          and nothing else, each element sent once (per parameter or in one flat buffer, as you
          like: 4 bytes x the parameter count in all);
        - the outer optimizer (an optimizer over `self.model.parameters()`, e.g. SGD with Nesterov
          momentum) takes one step from the anchor, with the averaged pseudo-gradient as the
          gradient. Its state (the momentum) carries over from round to round;
        - on return the model's parameters and `self.anchor` both hold the new global
          parameters, identical (bitwise) on every replica, and the inner optimizer's state
          (AdamW's moments and step count) is as the inner steps left it.

        The tests compare, after every inner and outer step over several rounds, your parameters,
        anchor, outer momentum and inner optimizer state with torchft's `DiLoCo` (torchft 0.2.0)
        trained on the same batches (atol 1e-6); they check that every replica holds the same
        parameters and count what one outer step sends. Other H, replica counts and outer
        optimizers in the grader's tests.
        """
        ### BEGIN SOLUTION
        params = list(self.model.parameters())
        with torch.no_grad():
            flat = torch.cat([(a - p).reshape(-1) for a, p in zip(self.anchor, params)])
            dist.all_reduce(flat, group=self.group)
            flat /= dist.get_world_size(self.group)
            offset = 0
            for p, a in zip(params, self.anchor):
                p.copy_(a)                                   # back to the round's start
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad()
        with torch.no_grad():
            for a, p in zip(self.anchor, params):
                a.copy_(p)
        ### END SOLUTION


# ================================================================ side by side with torchft
def toy_model(width: int = 16, seed: int = 0) -> nn.Module:
    """A small MLP (16 -> width -> width -> 4), the same on every rank."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                             nn.Linear(width, 4))


def toy_batch(step: int, replica: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica `replica`'s batch at step `step`: its own data (a different draw per replica)."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(rows, 16, generator=g)
    return x, torch.sin(x[:, :4] * 2) + 0.1 * torch.randn(rows, 4, generator=g)


def flat_state(optimizer: torch.optim.Optimizer, params) -> torch.Tensor:
    """Every tensor of an optimizer's state for `params`, flattened in order (empty: no state)."""
    parts = [v.reshape(-1).float() for p in params for k, v in sorted(optimizer.state.get(p, {}).items())
             if torch.is_tensor(v)]
    return torch.cat(parts) if parts else torch.zeros(0)


def compare_with_torchft(ctx: DistContext, sync_every: int = 3, rounds: int = 3, width: int = 16) -> dict:
    """Train `toy_model` on every rank (a replica each) with torchft's DiLoCo and with `DiLoCo`
    above on the same batches; after every inner step, the largest parameter difference; after
    every outer step, the differences of the parameters, the anchor, the outer momentum and the
    inner state, and the spread between replicas. Rank 0's report."""
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    from helpers.comm_count import count_collectives

    ref, mine = toy_model(width), toy_model(width)
    ref_inner = torch.optim.AdamW(ref.parameters(), lr=INNER_LR)
    ref_outer = torch.optim.SGD(ref.parameters(), **OUTER)
    manager, lighthouse = in_one_launch(ctx, lambda: {"model": ref.state_dict()},
                                        lambda s: ref.load_state_dict(s["model"]))
    diloco = DiLoCo(mine, torch.optim.AdamW(mine.parameters(), lr=INNER_LR),
                    torch.optim.SGD(mine.parameters(), **OUTER), sync_every)
    steps, outer = [], []
    try:
        with TorchftDiLoCo(manager, [ref], ref_inner, ref_outer, sync_every=sync_every) as ft:
            for step in range(sync_every * rounds):
                for model, optimizer in ((ref, ref_inner), (mine, diloco.inner_optimizer)):
                    optimizer.zero_grad()
                    x, y = toy_batch(step, ctx.rank)
                    nn.functional.mse_loss(model(x), y).backward()
                ref_inner.step()               # torchft's hooks run its outer step
                with count_collectives() as log:
                    synced = diloco.step()
                steps.append(_max_diff(mine.parameters(), ref.parameters()))
                if synced:
                    fragment = ft._fragments[0]
                    outer.append({
                        "step": step, "params": steps[-1],
                        "anchor": _max_diff(diloco.anchor, [fragment.original_parameters[n]
                                                            for n, _ in ref.named_parameters()]),
                        "outer state": _max_diff([flat_state(diloco.outer_optimizer, list(mine.parameters()))],
                                                 [flat_state(ref_outer, list(ref.parameters()))]),
                        "inner state": _max_diff([flat_state(diloco.inner_optimizer, list(mine.parameters()))],
                                                 [flat_state(ref_inner, list(ref.parameters()))]),
                        "calls": [(c.kind, c.nbytes) for c in log],
                        "spread": _spread(mine)})
    finally:
        manager.shutdown(wait=False)
        ctx.barrier()
        if lighthouse is not None:
            lighthouse.shutdown()
    return {"sync_every": sync_every, "rounds": rounds, "replicas": ctx.world_size,
            "param_bytes": sum(4 * p.numel() for p in mine.parameters()), "steps": steps, "outer": outer}


def _max_diff(a, b) -> float:
    pairs = list(zip(list(a), list(b)))
    if any(x.shape != y.shape for x, y in pairs):
        return float("inf")
    return max((x.detach() - y.detach()).abs().max().item() if x.numel() else 0.0 for x, y in pairs)


def _spread(model: nn.Module) -> float:
    """Largest difference between this replica's parameters and replica 0's, over all replicas."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    first = flat.clone()
    dist.broadcast(first, src=0)
    diff = (flat - first).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def matches_torchft(diffs: list[float], atol: float = 1e-5) -> str:
    """The verdict on the side-by-side run: the largest parameter difference after every step."""
    worst = max(diffs)
    if worst <= atol:
        return f"your outer step is torchft's: largest difference {worst:.1e} over {len(diffs)} steps"
    step = diffs.index(worst)
    return (f"your outer step is NOT torchft's: {worst:.1e} apart (after step {step}); "
            "run ./run.sh check 14 for what differs")


@dataclass(frozen=True)
class Run(runs.Run):
    """The side-by-side run: H (`sync_every`), outer rounds, and the toy model's width."""
    sync_every: int = 4
    rounds: int = 4
    width: int = 16
    SMOKE = dict(sync_every=3, rounds=3)


def run(ctx: DistContext, cfg: Run) -> dict:
    """The side-by-side run the notebook shows."""
    return compare_with_torchft(ctx, sync_every=cfg.sync_every, rounds=cfg.rounds, width=cfg.width)


def main(argv=None) -> None:
    from helpers.notice import attempt
    from helpers.show import table
    from labs.lab14_restart import on_the_cpu

    cfg = Run.from_argv(argv)
    on_the_cpu()
    with distributed() as ctx:
        out = attempt(run, ctx, cfg)
        ctx.report(diloco=out)
        if ctx.rank == 0 and "unsolved" not in out:
            table([{k: v for k, v in row.items() if k != "calls"} for row in out["outer"]],
                  title="your outer step against torchft's DiLoCo: largest differences", floatfmt=".2g")


if __name__ == "__main__":
    main()
