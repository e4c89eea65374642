"""Lab 03: fault tolerance with torchrun's elasticity: checkpoint, crash, restart, resume, lose nothing.

Run:  ./run.sh 03      (or: ./run.sh labs/lab03_fault_tolerance.py): trains without a failure.
With a failure: rank 1 sends itself SIGKILL at step 13, torchrun (`--max-restarts=1`) restarts
every rank, and they resume from the last checkpoint:

    .venv/bin/python -c "from helpers.launch import launch; launch('labs/lab03_fault_tolerance.py',
        '--kill-rank', 1, '--kill-at-step', 13, nproc=2, torchrun_args=['--max-restarts=1'],
        env={'TORCH_DISABLE_SHARE_RDZV_TCP_STORE': '1'})"

(The variable gives every attempt a fresh key-value store: with torchrun's shared store, the
restarted workers read the dead workers' gloo addresses and cannot connect, pytorch/pytorch#135712.)

When a worker dies, torchrun's agent stops the others and, while restarts remain, starts the whole
group again with TORCHELASTIC_RESTART_COUNT incremented. Everything in memory is gone; what
survives is what was written to disk. So the script checkpoints every few steps (model, optimizer
state with its momentum, step count; atomically, by rank 0) and, at start, resumes from the
checkpoint if there is one. The data order is a function of (seed, epoch, step), so the resumed
run sees exactly the batches the lost steps would have seen, and the final parameters equal those
of a run that never failed (here: of one process on the global batch, `reference_run`).
"""
from __future__ import annotations

import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

from helpers import runs
from helpers.dist import DistContext, distributed
from helpers.tensors import ddp_device_ids, divide
from labs.lab03_ddp import flat_params, make_mlp
from labs.lab03_training import load_checkpoint, mean_over_ranks, run_dir, save_checkpoint

SIZES = [16, 64, 4]
LR, MOMENTUM, SEED = 0.05, 0.9, 0


def make_dataset(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression problem: x (size, 16) -> y (size, 4) from a random linear teacher."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(size, SIZES[0], generator=gen)
    teacher = torch.randn(SIZES[0], SIZES[-1], generator=gen) / SIZES[0] ** 0.5
    return x, x @ teacher + 0.1 * torch.randn(size, SIZES[-1], generator=gen)


def batch_indices(step: int, rank: int, world_size: int, dataset_size: int,
                  local_batch_size: int) -> list[int]:
    """The sample indices rank `rank` trains on at global step `step`.

    A function of the step alone: DistributedSampler shuffled with (SEED, epoch), then the
    step's slice of this rank's shard. After a restart, step 10 gets step 10's batch again.
    """
    steps_per_epoch = divide(divide(dataset_size, world_size, "the dataset over the ranks"),
                             local_batch_size, "each rank's shard into local batches")
    epoch, position = divmod(step, steps_per_epoch)
    sampler = DistributedSampler(range(dataset_size), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=SEED)
    sampler.set_epoch(epoch)
    return list(sampler)[position * local_batch_size:(position + 1) * local_batch_size]


def reference_run(steps: int, world_size: int, dataset_size: int,
                  local_batch_size: int) -> tuple[torch.Tensor, list[float]]:
    """One process, never interrupted, on the global batch (every rank's batch together).

    Returns the final parameters (flat) and the loss of every step.
    """
    x, y = make_dataset(dataset_size)
    model = make_mlp(SIZES, seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(steps):
        idx = [i for r in range(world_size)
               for i in batch_indices(step, r, world_size, dataset_size, local_batch_size)]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return flat_params(model), losses


def train(ctx: DistContext, steps: int, ckpt_every: int, dataset_size: int,
          local_batch_size: int, ckpt_path: Path, kill_rank: int = -1,
          kill_at_step: int = -1) -> dict:
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    x, y = make_dataset(dataset_size)
    x, y = x.to(ctx.device), y.to(ctx.device)
    model = make_mlp(SIZES, seed=SEED, device=ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    start_step = 0
    if ckpt_path.exists():  # a restart: continue where the last checkpoint left off
        state = load_checkpoint(ckpt_path, ctx.device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])  # the momentum buffers matter as much as weights
        start_step = state["step"]
    ddp = DDP(model, device_ids=ddp_device_ids(ctx.device))
    ctx.report(**{f"attempt{restart_count}_pid": os.getpid()})
    ctx.print0(f"attempt {restart_count}: starting at step {start_step} of {steps}")
    losses = []
    for step in range(start_step, steps):
        if restart_count == 0 and ctx.rank == kill_rank and step == kill_at_step:
            print(f"rank {ctx.rank}: SIGKILL to myself at step {step} (pid {os.getpid()})",
                  flush=True)
            ctx.report(killed_at_step=step)
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no exception: like a lost node
        idx = batch_indices(step, ctx.rank, ctx.world_size, dataset_size, local_batch_size)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(mean_over_ranks(loss, ctx.world_size))
        if (step + 1) % ckpt_every == 0:
            save_checkpoint(ckpt_path, {"step": step + 1, "model": model.state_dict(),
                                        "optimizer": opt.state_dict()}, ctx.rank)
        # (step, loss) so far in this attempt: an attempt that dies keeps what it reported
        ctx.report(**{f"attempt{restart_count}_losses": [[start_step + i, v]
                                                        for i, v in enumerate(losses)]})
    return {"restart_count": restart_count, "resumed_from_step": start_step,
            "steps_run": steps - start_step, "losses": losses,
            "final_params": flat_params(model).cpu()}


@dataclass(frozen=True)
class Run(runs.Run):
    """The training run; `kill_rank` SIGKILLs itself before step `kill_at_step` (-1: nobody);
    `ckpt_dir` "" is runs/lab03_fault_tolerance/<run id>."""
    steps: int = 40
    ckpt_every: int = 5
    dataset_size: int = 512
    local_batch_size: int = 8
    ckpt_dir: str = ""
    kill_rank: int = -1
    kill_at_step: int = -1
    SMOKE = dict(steps=16, ckpt_every=4, dataset_size=128)

    @property
    def between_checkpoints(self) -> int:
        """A step between the second and the third checkpoint: where a demo kills a rank."""
        return 2 * self.ckpt_every + (self.ckpt_every + 1) // 2


def main(argv: list[str] | None = None) -> None:
    args = Run.from_argv(argv)
    folder = Path(args.ckpt_dir) if args.ckpt_dir else run_dir("lab03_fault_tolerance")
    with distributed() as ctx:
        batch_indices(0, ctx.rank, ctx.world_size, args.dataset_size,
                      args.local_batch_size)  # fails early if the sizes do not divide
        result = train(ctx, args.steps, args.ckpt_every, args.dataset_size,
                       args.local_batch_size, folder / "checkpoint.pt", args.kill_rank,
                       args.kill_at_step)
        ctx.report(**result, steps=args.steps, ckpt_every=args.ckpt_every,
                   dataset_size=args.dataset_size, local_batch_size=args.local_batch_size)
        if ctx.rank == 0:  # the run that never failed, for comparison
            reference, reference_losses = reference_run(args.steps, ctx.world_size,
                                                        args.dataset_size, args.local_batch_size)
            diff = (result["final_params"] - reference).abs().max().item()
            ctx.report(reference_losses=reference_losses, max_diff_vs_uninterrupted=diff)
            ctx.print0(f"final parameters vs one uninterrupted process: max |diff| = {diff:.2g}")
        losses = result["losses"] or [float("nan")]
        ctx.print0(f"attempt {result['restart_count']}: trained steps "
                   f"{result['resumed_from_step']}..{args.steps - 1}; loss (mean over ranks) "
                   f"{losses[0]:.4f} -> {losses[-1]:.4f}")
        ctx.barrier()
        if ctx.rank == 0 and not args.ckpt_dir:
            shutil.rmtree(folder, ignore_errors=True)  # our own run folder: done with it


if __name__ == "__main__":
    main()
