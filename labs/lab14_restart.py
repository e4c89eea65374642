"""Lab 14 (whole-job restart): notebook 12's way of surviving a failure, timed. A job of W ranks
(FSDP2 over all of them) trains a small byte-level language model, writes a sharded checkpoint
(torch.distributed.checkpoint, labs/lab12_checkpoint.py) every few steps, and loses a rank at
planted steps: torchrun (`--max-restarts`) stops every rank and starts them all again, each
reloads the last checkpoint and the steps since it are done again.

Run:  ./run.sh 14      (labs/lab14_failures.py runs this with planted failures, beside torchft)
Alone, without a failure:  NPROC=2 ./run.sh labs/lab14_restart.py   (--help: its sizes)
With two failures (rank 1 dies before step 7 of the first attempt and before step 15 of the
second):

    .venv/bin/python -c "from helpers.launch import launch; launch('labs/lab14_restart.py',
        '--kills', '7,15', nproc=2, torchrun_args=['--max-restarts=2'])"

Every rank records when each step, checkpoint and load began and ended (wall-clock time, so the
attempts line up); labs/lab14_failures.py turns that into where the time went. The batches are a
function of the step (`rank_batch`), so the resumed run repeats the lost steps exactly and its
losses are one process's (`reference_losses`). The task (model, data, reference) is shared with
the torchft replicas of labs/lab14_replicas.py.
"""
from __future__ import annotations

import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from helpers import runs
from helpers.dist import DistContext, distributed
from helpers.tensors import divide
from labs.lab12_checkpoint import latest, load, save
from labs.lab12_model import LMConfig, batch_at, build_model, corpus, lm_loss, split

LR = 3e-3


# ============================================================================ the shared task
@dataclass(frozen=True)
class Task(runs.Run):
    """Lab 14's model (a byte-level transformer of 2 layers, 4 heads) and its global batch of 8
    sequences: the base of every lab 14 run description that trains it."""
    dim: int = 64
    ffn: int = 128
    seq: int = 64
    SMOKE = dict(dim=32, ffn=64, seq=32)


def task_config(cfg: Task | None = None) -> LMConfig:
    """Lab 14's model and global batch, as `cfg` sizes them (None: the Task's preset, smoke under
    COURSE_SMOKE=1)."""
    cfg = Task.preset() if cfg is None else cfg
    return LMConfig(dim=cfg.dim, heads=4, layers=2, ffn=cfg.ffn, seq=cfg.seq, batch=8)


def train_text() -> torch.Tensor:
    return split(corpus())[0]


def rank_batch(data: torch.Tensor, step: int, config: LMConfig, part: int, parts: int):
    """Rows part*b ... (part+1)*b of step `step`'s global batch (b = batch / parts): what one of
    `parts` equal data-parallel workers trains on. All parts together are the global batch."""
    rows = divide(config.batch, parts, "the global batch over the data-parallel workers")
    x, y = batch_at(data, step, config.batch, config.seq)
    return x[part * rows:(part + 1) * rows], y[part * rows:(part + 1) * rows]


def make_model(config: LMConfig, mesh=None):
    """The model (initialised by parameter name: the same on every process) and its AdamW;
    sharded with FSDP2 over `mesh` when there is one with more than one rank."""
    model = build_model(config, "cpu")
    if mesh is not None and mesh.size() > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)


def reference_losses(config: LMConfig, steps: int) -> list[float]:
    """One process on whole global batches: the losses of a run that never failed."""
    data = train_text()
    model, optimizer = make_model(config)
    losses = []
    for step in range(steps):
        x, y = batch_at(data, step, config.batch, config.seq)
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def on_the_cpu() -> None:
    """Lab 14 runs on the CPU with gloo even where there are GPUs (torchft's process groups here
    are gloo's, the models small): COURSE_DEVICE=cpu for this process and every rank it starts."""
    os.environ["COURSE_DEVICE"] = "cpu"


def kill_myself(ctx: DistContext, step: int, when: str = "before") -> None:
    """SIGKILL this process: no cleanup, no goodbye, like a machine that lost power."""
    ctx.report(killed={"step": step, "time": time.time()})
    print(f"rank {ctx.rank}: SIGKILL to myself {when} step {step} (pid {os.getpid()})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


# ============================================================================== the run
def train(ctx: DistContext, config: LMConfig, steps: int, ckpt_every: int, root: Path,
          kills: tuple[int, ...], kill_rank: int = 1) -> dict:
    """Train `steps` steps on this rank's part of each global batch, checkpointing every
    `ckpt_every`; resume from the newest complete checkpoint if there is one. On attempt a (torchrun's
    restart count), rank `kill_rank` kills itself before step kills[a]. Reports this attempt's events."""
    from helpers.dist import device_mesh

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    born = __import__("psutil").Process().create_time()
    data = train_text()
    mesh = device_mesh("cpu", dp=ctx.world_size) if ctx.world_size > 1 else None
    model, optimizer = make_model(config, mesh)
    trainer = SimpleNamespace(model=model, optimizer=optimizer)
    events = {"born": born, "ready": time.time(), "steps": [], "checkpoints": [], "load": None}
    start, found = 0, latest(root)
    if found is not None:
        t = time.time()
        start = found[0]
        load(trainer, found[1])
        events["load"] = [t, time.time(), start]
    ctx.print0(f"attempt {attempt}: starting at step {start} of {steps}")
    kill_at = kills[attempt] if attempt < len(kills) else -1
    for step in range(start, steps):
        if ctx.rank == kill_rank and step == kill_at:
            ctx.report(**{f"attempt{attempt}": events})
            kill_myself(ctx, step)
        t0 = time.time()
        x, y = rank_batch(data, step, config, ctx.rank, ctx.world_size)
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if ctx.world_size > 1:
            torch.distributed.all_reduce(mean, op=torch.distributed.ReduceOp.AVG)
        events["steps"].append([step, t0, time.time(), mean.item()])
        if (step + 1) % ckpt_every == 0:
            t1 = time.time()
            save(trainer, root, step + 1)
            events["checkpoints"].append([step + 1, t1, time.time()])
        ctx.report(**{f"attempt{attempt}": events})
    return {"attempts": attempt + 1, "steps": steps, "ckpt_every": ckpt_every, "kills": list(kills),
            "world_size": ctx.world_size}


@dataclass(frozen=True)
class Run(Task):
    """Steps, a checkpoint every `ckpt_every` steps, the steps rank 1 dies before (one per
    attempt: `--kills 7,15`) and the checkpoints' folder (empty: runs/lab14/restart, emptied first)."""
    steps: int = 40
    ckpt_every: int = 8
    kills: tuple[int, ...] = ()
    ckpt_dir: str = ""
    SMOKE = dict(Task.SMOKE, steps=12, ckpt_every=4)
    TOUR = dict(SMOKE, steps=8)

    def __post_init__(self):
        if self.steps < 1 or self.ckpt_every < 1:
            raise ValueError(f"--steps and --ckpt-every must be at least 1, got {self.steps}, {self.ckpt_every}")
        if any(k < 0 or k >= self.steps for k in self.kills):
            raise ValueError(f"--kills must lie in 0..{self.steps - 1}, got {list(self.kills)}")


def run(ctx: DistContext, cfg: Run) -> dict:
    """Train (resuming from the newest checkpoint on a restart); this attempt's summary."""
    root = Path(cfg.ckpt_dir) if cfg.ckpt_dir else \
        Path(__file__).resolve().parent.parent / "runs" / "lab14" / "restart"
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 and ctx.rank == 0 and root.exists():
        shutil.rmtree(root)    # a fresh run starts from nothing
    ctx.barrier()
    return train(ctx, task_config(cfg), cfg.steps, cfg.ckpt_every, root, cfg.kills)


def main(argv=None) -> None:
    cfg = Run.from_argv(argv)
    on_the_cpu()
    with distributed() as ctx:
        summary = run(ctx, cfg)
        ctx.report(summary=summary)
        ctx.print0(f"done: {cfg.steps} steps in {summary['attempts']} attempt(s)")


if __name__ == "__main__":
    main()
