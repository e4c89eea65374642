"""Lab 12 (resuming): a rank killed mid-run and the group restarted by torchrun, training resumed
from the last sharded checkpoint, and that checkpoint reloaded on another layout.

Run:  ./run.sh 12      (8 ranks, no failure; alone: NPROC=8 ./run.sh labs/lab12_resume.py)
With a failure: rank 1 sends itself SIGKILL before step 5 of the first attempt, torchrun
(`--max-restarts=1`) starts every rank again, and they resume from the last checkpoint:

    .venv/bin/python -c "from helpers.launch import launch; launch('labs/lab12_resume.py',
        '--kill-rank', 1, '--kill-at-step', 5, nproc=8, torchrun_args=['--max-restarts=1'])"

- Saving and loading: labs/lab12_checkpoint.py.
- Fault tolerance: torchrun restarts the whole group when a rank dies (labs/lab03_fault_tolerance.py);
  everything in memory is lost, each rank reloads its shards from the last complete checkpoint,
  and the batches are a function of the step (`batch_at`), so the resumed run continues the
  losses of the uninterrupted one. Restarted gloo workers need a fresh rendezvous store each
  attempt (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, pytorch/pytorch#135712); helpers.launch sets it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
from pathlib import Path

from helpers import pick
from helpers.dist import DistContext, distributed
from labs.lab12_checkpoint import checkpoint_report, latest, load, one_process_state, save
from labs.lab12_model import LMConfig, corpus, default_config, split, train_reference
from labs.lab12_parallelize import mesh_shape
from labs.lab12_train import LOSS_RTOL, Trainer

LAB_NPROC = 8


# ============================================================================= a run that dies
def train_with_restarts(ctx: DistContext, config: LMConfig, shape, steps: int, ckpt_every: int, root: Path,
                        kill_rank: int = -1, kill_at_step: int = -1) -> dict:
    """Train `steps` steps, checkpointing every `ckpt_every`; resume from the newest complete
    checkpoint if there is one (a restart). On the first attempt, rank `kill_rank` SIGKILLs
    itself before step `kill_at_step` (no cleanup, like a lost machine)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    train_data, _ = split(corpus())
    trainer = Trainer(ctx, config, shape)
    start = 0
    found = latest(root)
    if found is not None:
        start, folder = found
        load(trainer, folder)
    ctx.report(**{f"attempt{attempt}_pid": os.getpid(), f"attempt{attempt}_start": start})
    ctx.print0(f"attempt {attempt}: starting at step {start} of {steps}")
    losses = {}
    for step in range(start, steps):
        if attempt == 0 and ctx.rank == kill_rank and step == kill_at_step:
            print(f"rank {ctx.rank}: SIGKILL to myself before step {step} (pid {os.getpid()})", flush=True)
            ctx.report(killed_at_step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        losses[step] = trainer.train_step(train_data, step)[0]
        if (step + 1) % ckpt_every == 0:
            save(trainer, root, step + 1)
        ctx.report(**{f"attempt{attempt}_losses": [[s, v] for s, v in losses.items()]})
    return {"attempt": attempt, "resumed_from": start, "losses": losses, "trainer": trainer}


def reshard_check(ctx: DistContext, config: LMConfig, root: Path, step: int, losses: dict[int, float],
                  layouts: list[tuple[int, int, int]], steps_after: int = 2) -> dict:
    """Load the checkpoint written after `step` steps into each of `layouts` (other meshes of the
    same ranks) and into one process (rank 0), train `steps_after` more steps, and compare their
    losses with the original run's at those steps (`losses`)."""
    folder = root / f"step-{step:05d}"
    train_data, _ = split(corpus())
    expected = [losses[s] for s in range(step, step + steps_after)]
    out = {"step": step, "expected": expected, "layouts": {}}
    for layout in layouts:
        trainer = Trainer(ctx, config, layout)
        load(trainer, folder)
        got = [trainer.train_step(train_data, s)[0] for s in range(step, step + steps_after)]
        out["layouts"][" x ".join(map(str, layout))] = got
    if ctx.rank == 0:
        model, optimizer = one_process_state(folder, config)
        run = train_reference(config, steps_after, train_data, first_step=step,
                              start={"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        out["one process"] = run["losses"]
    worst = 0.0
    for got in [*out["layouts"].values(), out.get("one process", expected)]:
        worst = max(worst, *(abs(a - b) / abs(b) for a, b in zip(got, expected)))
    out["max_rel_diff"] = worst
    return out


def default_layouts(world_size: int) -> list[tuple[int, int, int]]:
    """Other meshes of the same ranks to reload into: no pipeline, dp x tp."""
    return {8: [(1, 4, 2)], 4: [(1, 2, 2)], 2: [(1, 2, 1)], 1: []}.get(world_size, [(1, world_size // 2, 2)])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=pick(12, 6))
    parser.add_argument("--ckpt-every", type=int, default=pick(4, 2))
    parser.add_argument("--kill-rank", type=int, default=-1, help="rank that SIGKILLs itself")
    parser.add_argument("--kill-at-step", type=int, default=-1, help="...before this step, first attempt")
    parser.add_argument("--ckpt-dir", default="", help="default: runs/lab12/checkpoints (emptied first)")
    parser.add_argument("--layouts", default="", help="pp,dp,tp;pp,dp,tp... to reload into")
    return parser.parse_args(argv)


def lab(ctx: DistContext, args: argparse.Namespace, root: Path, config: LMConfig | None = None) -> dict:
    """Train (dying and resuming if asked), then reload the checkpoint on other layouts; rank 0
    adds the uninterrupted run (one process). `config`: the model (default_config())."""
    config = config or default_config()
    shape = mesh_shape(ctx.world_size)
    layouts = ([tuple(int(v) for v in s.split(",")) for s in args.layouts.split(";")] if args.layouts
               else default_layouts(ctx.world_size))
    result = train_with_restarts(ctx, config, shape, args.steps, args.ckpt_every, root,
                                 args.kill_rank, args.kill_at_step)
    trainer = result.pop("trainer")
    report = {"shape": list(shape), "steps": args.steps, "ckpt_every": args.ckpt_every,
              "attempt": result["attempt"], "resumed_from": result["resumed_from"],
              "losses": [[s, v] for s, v in result["losses"].items()],
              "checkpoint": checkpoint_report(latest(root)[1], ctx, trainer)}
    del trainer
    reshard_step = (args.steps - 2) // args.ckpt_every * args.ckpt_every
    if reshard_step >= result["resumed_from"] and reshard_step > 0:
        report["reshard"] = reshard_check(ctx, config, root, reshard_step, result["losses"], layouts)
    if ctx.rank == 0:    # the run that never failed, in one process
        report["uninterrupted"] = train_reference(config, args.steps, split(corpus())[0])["losses"]
    return report


def main(argv=None) -> None:
    """The run, reported under "checkpoint" ({"unsolved": ...} while an exercise is a stub)."""
    from helpers.notice import attempt
    from helpers.show import table

    args = parse_args(argv)
    root = Path(args.ckpt_dir) if args.ckpt_dir else Path(__file__).resolve().parent.parent / "runs" / "lab12" / "checkpoints"
    with distributed() as ctx:
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 and ctx.rank == 0 \
                and not args.ckpt_dir and root.exists():
            shutil.rmtree(root)    # our own folder: a fresh run starts from nothing
        ctx.barrier()
        report = attempt(lab, ctx, args, root)
        ctx.report(checkpoint=report)
        if "unsolved" in report:
            return
        losses = {int(s): v for s, v in report["losses"]}
        if ctx.rank == 0:
            ref = report["uninterrupted"]
            rows = [{"step": s, "this run": v, "uninterrupted (one process)": ref[s],
                     "attempt": report["attempt"]} for s, v in losses.items()]
            table(rows, title=f"attempt {report['attempt']}, resumed from step {report['resumed_from']}",
                  floatfmt=".6g")
            ck = report["checkpoint"]
            print(f"checkpoint {ck['folder']}: {len(ck['files'])} files, "
                  f"{sum(ck['files'].values()):,} bytes ({sum(ck['payload'].values()):,} of them tensor "
                  f"data); a rank-0 full state_dict would hold {ck['full_state']['total']:,} bytes on "
                  "rank 0", flush=True)
            if "reshard" in report:
                r = report["reshard"]
                print(f"reloaded after step {r['step']}: next losses {r['expected']} on "
                      f"{' x '.join(map(str, report['shape']))}; {r['layouts']} on other meshes; one "
                      f"process {r.get('one process')}; max relative difference {r['max_rel_diff']:.1e}",
                      flush=True)
            worst = max((abs(v - ref[s]) / abs(ref[s]) for s, v in losses.items()), default=0.0)
            if worst > LOSS_RTOL:
                raise RuntimeError(f"losses differ from the uninterrupted run by {worst:.1e}")
        if report.get("reshard", {}).get("max_rel_diff", 0.0) > LOSS_RTOL:
            raise RuntimeError(f"rank {ctx.rank}: the reloaded checkpoint's losses differ")

if __name__ == "__main__":
    main()
