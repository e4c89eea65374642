"""Lab 10: diagnose this job. A training job with one bug planted at random; name it from its outputs.

Run:  ./run.sh 10      (this file alone: ./run.sh labs/lab10_diagnose.py)

The jobs come from helpers/mystery_jobs.py: `plant(seed)` picks one of BUGS (or none) from a seed;
`run_jobs(...)` runs such jobs, each in a thread on a process group of its own, and returns what
each one left behind, a `JobOutputs`: the error that ended it (if any) and the rank the launcher
would blame (the first to fail), and what every rank logged: losses, gradient norms, the samples
it trained on, digests of its parameters and buffers, its flight recorder's collectives.

Homework: `diagnose` below. Check it with `./run.sh check 10`.
With `--lessons` (the notebook uses it) the launch also runs lab10_divergence and lab10_data, whose
bugs these jobs plant, so one launch serves three sections of the notebook.
"""
from __future__ import annotations

from dataclasses import dataclass

from helpers import runs
from helpers.config import settings
from helpers.dist import distributed
from helpers.notice import attempt
from helpers.mystery_jobs import BUGS, JobOutputs, gather_outputs, outputs_from_dict, plant, run_jobs
from helpers.show import table

__all__ = ["BUGS", "JobOutputs", "diagnose", "plant", "run_jobs", "verdicts"]


# ============================================================================ the homework
def diagnose(job: JobOutputs) -> str:
    """Name the bug planted in `job` from its outputs: one of the keys of BUGS ("healthy" if none).

    Exercise. `job.reports[rank]` holds what each rank logged (lists are in step order; a job
    that failed has logged only the steps it finished):
      "local_loss":     its own loss at each step;
      "logged_loss":    the loss the job printed at each step (meant: the mean over the ranks);
      "grad_norm":      the norm of its gradient after synchronisation, at each step;
      "reference_grad_norm": (rank 0, step 0) the gradient norm one process gets from rank 0's
                        weights and every rank's batch of that step (the mean of their losses);
      "samples":        per epoch, the dataset indices it trained on, in order;
      "param_digest", "buffer_digest": digests of its parameters / of its BatchNorm buffers,
                        before training (index 0) and after each step (index s + 1);
      "flight":         its flight recorder's collectives for the job's group, oldest first, as
                        {"seq", "op", "sizes"} dicts.
    Each bug leaves a signature: an error (which ranks' flight records hold more collectives, or
    the same number in a different order); replicas whose parameters or buffers differ (from the
    start, or from a later step); samples (the same across ranks, or an epoch that repeats the
    first one's order); gradients off by a factor of the world size against the reference; a
    logged loss that is not the mean of the ranks' losses. Compare with tolerances (e.g. relative
    1e-4) where floats are computed in different orders; digests are exact.
    """
    ### BEGIN SOLUTION
    ranks = sorted(job.reports)
    reps = [job.reports[r] for r in ranks]
    if job.error:
        counts = [len(rep["flight"]) for rep in reps]
        return "collective_on_one_rank" if len(set(counts)) > 1 else "collectives_in_different_orders"

    def first_disagreement(key: str) -> int | None:
        for i, digests in enumerate(zip(*(rep[key] for rep in reps))):
            if len(set(digests)) > 1:
                return i
        return None

    params_differ = first_disagreement("param_digest")
    if params_differ is not None:
        return "different_initialisation" if params_differ == 0 else "random_state"
    if first_disagreement("buffer_digest") is not None:
        return "buffer_not_synchronised"
    if all(rep["samples"] == reps[0]["samples"] for rep in reps):
        return "no_distributed_sampler"
    if any(epoch == rep["samples"][0] for rep in reps for epoch in rep["samples"][1:]):
        return "no_set_epoch"
    ratio = job.reports[0]["grad_norm"][0] / job.reports[0]["reference_grad_norm"]
    n = job.world_size
    if abs(ratio - n) < 1e-3 * n:
        return "gradients_summed"
    if abs(ratio - 1 / n) < 1e-3:
        return "gradients_averaged_twice"
    for step, logged in enumerate(reps[0]["logged_loss"]):
        mean = sum(rep["local_loss"][step] for rep in reps) / n
        if abs(logged - mean) > 1e-4 * max(1.0, abs(mean)):
            return "loss_logged_from_one_rank"
    return "healthy"
    ### END SOLUTION


def verdicts(jobs: list[tuple[str, int, int]], outputs: list[dict]) -> list[dict]:
    rows, unsolved = [], None
    for (bug, seed, job_world), out in zip(jobs, outputs):
        said = unsolved or attempt(diagnose, outputs_from_dict(out))
        if isinstance(said, dict):  # the exercise's stub record: one notice is enough
            unsolved = said
        rows.append({"seed": seed, "ranks": job_world, "diagnose says": said if isinstance(said, str)
                     else "not done yet", "planted": bug, "right": said == bug})
    return rows


@dataclass(frozen=True)
class Run(runs.Run):
    """Mystery jobs to diagnose; with `lessons` (the notebook's launch) lab10_divergence's and
    lab10_data's runs come first, on their presets."""
    jobs: int = 6
    lessons: bool = False
    SMOKE = dict(jobs=4)


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    seed = settings().lab10_seed or 0
    with distributed() as ctx:
        # on 3 ranks or more, every other job uses 2 of them
        jobs = [(plant(seed + i), seed + i, ctx.world_size if i % 2 == 0 or ctx.world_size == 2 else 2)
                for i in range(cfg.jobs)]
        lessons = {}
        if cfg.lessons:
            from labs import lab10_data, lab10_divergence
            lessons = {"divergence": runs.run_lab(lab10_divergence, ctx),
                       "data": runs.run_lab(lab10_data, ctx)}
        outputs = gather_outputs(run_jobs(jobs, ctx.rank, ctx.world_size), ctx.world_size)
        if ctx.rank == 0:
            ctx.report(jobs=jobs, outputs=outputs, **lessons)
            table(verdicts(jobs, outputs), title=f"{len(jobs)} mystery jobs on {ctx.world_size} ranks")
        else:
            ctx.report(**lessons)


if __name__ == "__main__":
    main()
