"""The mystery jobs of notebook 10's `diagnose` exercise: a small training job with one bug
planted from a seed, many of them run at once, and what each left behind (`JobOutputs`).

    jobs = [(plant(seed), seed, world_size) for seed in seeds]     # (bug, seed, job's ranks)
    outputs = gather_outputs(run_jobs(jobs, ctx.rank, ctx.world_size), ctx.world_size)
    job = outputs_from_dict(outputs[0])                            # rank 0: what diagnose() reads

The job: a small regression (Linear -> BatchNorm -> ReLU -> Linear) trained for 2 or 3 epochs with
a shuffling DistributedSampler, hand-written gradient averaging and plain SGD; step 0 also logs the
gradient norm one process would get on that step's global batch, as a sanity check. The seed
varies the job (batch, steps, epochs, the step a bug strikes) and the bug's form: which rank acts
alone, which collectives, whether one rank or every rank goes its own way (`job_config`). Many
jobs run in one launch, side by side in threads, each on a process group of its own (a hung job
then times out on its own group and the others go on); a job may use fewer ranks than the launch
has (its group is then the first `world_size` ranks).

The course's instrument, not the lesson: labs/lab10_diagnose.py (the exercise) and the tests use
it, and it lives here so that what the tests see does not depend on a student's lab file.
"""
from __future__ import annotations

import os

# The flight recorder keeps the last 2000 collectives of the process by default (all groups
# together); the mystery jobs issue about 100 each per rank, and a job whose oldest records fell
# out of the ring would show the wrong count. torch reads this at its first collective.
os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "50000")

import copy
import datetime
import hashlib
import pickle
import random
import time  # noqa: E402  (after the flight recorder's size)
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.utils.data.distributed import DistributedSampler

from helpers.dist import error_line, new_group, timeout_seconds
from helpers.flight_recorder import flight_recorder_size, flight_records

BUGS = {
    "healthy": "nothing planted",
    "collective_on_one_rank": "after training one rank alone issues a collective (to log the final loss, "
                              "or to wait before saving)",
    "collectives_in_different_orders": "at one step one rank issues two collectives in one order, the "
                                       "others in the other",
    "different_initialisation": "one rank, or every rank, builds the model from its own seed, and nothing "
                                "broadcasts it",
    "random_state": "at one step one rank, or every rank, re-initialises a few weights from its own "
                    "random generator",
    "buffer_not_synchronised": "BatchNorm's running statistics are never averaged over the ranks",
    "no_set_epoch": "sampler.set_epoch(epoch) is never called",
    "no_distributed_sampler": "every rank reads the same samples (no DistributedSampler, or one given the "
                              "same rank everywhere)",
    "loss_logged_from_one_rank": "the logged loss is one rank's own (each rank's, or one rank's sent to "
                                 "all), not the mean over the ranks",
    "gradients_summed": "gradients are all-reduced (summed) and never divided by the world size",
    "gradients_averaged_twice": "the loss is divided by the world size before the gradients are averaged",
}
HANG_TIMEOUT_S = 2.0  # a hung job's group gives up after this long
JOB_TIMEOUT_S = 300.0  # a job's group before its planted hang (see run_jobs)
IN, HIDDEN, LR = 8, 16, 0.05
# the collectives a hang bug plants (`issue` gives each a size no other one sends, so that two
# different ops never pair up as one)
LONE_OPS = ("all_reduce", "all_gather", "barrier")         # collective_on_one_rank
ORDER_PAIRS = (("all_reduce", "all_gather"), ("all_gather", "barrier"), ("barrier", "all_reduce"),
               ("all_reduce", "broadcast"))                # collectives_in_different_orders


@dataclass
class JobOutputs:
    """Everything a finished (or failed) job left behind."""
    world_size: int
    error_rank: int | None     # the rank that failed first (the launcher blames it); None: no error
    error: str                 # its error, one line ("RuntimeError: ..."); "" when the job succeeded
    reports: dict[int, dict]   # rank -> what it logged (see run_job)



def plant(seed: int) -> str:
    """The bug a job with this seed gets (seeded, so a job can be rerun)."""
    return random.Random(seed).choice(sorted(BUGS))


def job_config(seed: int, world_size: int) -> dict:
    """The job's shape and its bug's form, from the seed. `odd_rank` is the rank that goes its own
    way (the lone collective; the other order; its own seed, generator or logged loss) and, where
    `every_rank`, each rank goes its own way instead. A broadcast's root is group rank 0, so a
    broadcast is planted only where rank 0 is the odd one (elsewhere gloo may deliver it early
    and nothing would hang)."""
    rng = random.Random(seed * 7919 + 1)
    local_batch, steps_per_epoch, epochs = rng.choice([4, 6, 8]), rng.choice([2, 3, 4]), rng.choice([2, 3])
    odd_rank = rng.randrange(world_size)
    pairs = [p for p in ORDER_PAIRS if "broadcast" not in p or odd_rank == 0]
    return {"local_batch": local_batch, "steps_per_epoch": steps_per_epoch, "epochs": epochs,
            "size": local_batch * steps_per_epoch * world_size,
            "bug_step": rng.randrange(1, epochs * steps_per_epoch - 1),
            "odd_rank": odd_rank, "every_rank": rng.random() < 0.5,
            "lone_op": rng.choice(LONE_OPS), "order": rng.choice(pairs)}


def make_model(seed: int) -> nn.Sequential:
    """Weights from an explicit generator: jobs run in threads, so no global random state."""
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (model[0].weight, model[0].bias, model[3].weight, model[3].bias):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def job_data(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(size, IN, generator=gen)
    return x, x @ torch.randn(IN, 1, generator=gen)


def digest(tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:12]


def issue(op: str, group, root: int, device) -> None:
    """One collective of a planted bug; each op sends a size no other op sends."""
    if op == "all_reduce":
        dist.all_reduce(torch.ones(4, device=device), group=group)
    elif op == "all_gather":
        out = [torch.empty(3, device=device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, torch.ones(3, device=device), group=group)
    elif op == "broadcast":
        dist.broadcast(torch.ones(8, device=device), src=root, group=group)
    else:
        dist.barrier(group=group)


def run_job(bug: str, seed: int, rank: int, world_size: int, group, device) -> dict:
    """One job on `group` (this rank is `rank` of `world_size` there), with `bug` planted; returns
    this rank's log (and its error, if any)."""
    cfg = job_config(seed, world_size)
    x, y = job_data(cfg["size"])
    log = {"local_loss": [], "logged_loss": [], "grad_norm": [], "samples": [],
           "param_digest": [], "buffer_digest": []}
    root = dist.get_global_rank(group, 0)
    odd = cfg["every_rank"] or rank == cfg["odd_rank"]  # this rank goes its own way (rank-local bugs)
    try:
        if bug == "different_initialisation":  # no broadcast follows
            model = make_model(seed + 1000 + rank if odd else seed).to(device)
        else:
            model = make_model(seed).to(device)
            for p in model.parameters():
                dist.broadcast(p.data, src=root, group=group)  # the same start everywhere
        params, buffers = list(model.parameters()), [model[1].running_mean, model[1].running_var]
        log["param_digest"].append(digest(params))
        log["buffer_digest"].append(digest(buffers))
        if bug == "no_distributed_sampler":  # the whole dataset, or the same shard, on every rank
            replicas, shard = (1, 0) if cfg["every_rank"] else (world_size, cfg["odd_rank"])
        else:
            replicas, shard = world_size, rank
        sampler = DistributedSampler(range(cfg["size"]), num_replicas=replicas, rank=shard, shuffle=True, seed=seed)
        own_random = torch.Generator().manual_seed(seed * 100 + rank)
        step = 0
        for epoch in range(cfg["epochs"]):
            if bug != "no_set_epoch":
                sampler.set_epoch(epoch)
            order = list(sampler)
            log["samples"].append(order[:cfg["local_batch"] * cfg["steps_per_epoch"]])
            for i in range(cfg["steps_per_epoch"]):
                idx = order[i * cfg["local_batch"]:(i + 1) * cfg["local_batch"]]
                xb, yb = x[idx].to(device), y[idx].to(device)
                if step == 0:  # sanity check: one process on every rank's batch of this step
                    everyone = [None] * world_size
                    dist.all_gather_object(everyone, idx, group=group)
                    if rank == 0:
                        log["reference_grad_norm"] = reference_grad_norm(model, x, y, everyone, device)
                loss = nn.functional.mse_loss(model(xb), yb)
                for p in params:
                    p.grad = None
                (loss / world_size if bug == "gradients_averaged_twice" else loss).backward()
                for p in params:
                    dist.all_reduce(p.grad, group=group)
                    if bug != "gradients_summed":
                        p.grad.div_(world_size)
                log["grad_norm"].append(torch.cat([p.grad.flatten() for p in params]).norm().item())
                with torch.no_grad():  # plain SGD, by hand
                    for p in params:
                        p.sub_(LR * p.grad)
                if bug == "random_state" and step == cfg["bug_step"] and odd:
                    with torch.no_grad():  # "re-initialise dead units" with this rank's generator
                        model[0].weight[:2].copy_(torch.randn(2, IN, generator=own_random))
                if bug != "buffer_not_synchronised":
                    for b in buffers:
                        dist.all_reduce(b, group=group)
                        b.div_(world_size)
                logged = loss.detach().clone()
                if bug != "loss_logged_from_one_rank":
                    dist.all_reduce(logged, group=group)
                    logged /= world_size
                elif not cfg["every_rank"]:  # one rank's loss, sent to every rank
                    dist.broadcast(logged, src=dist.get_global_rank(group, cfg["odd_rank"]), group=group)
                if bug == "collectives_in_different_orders" and step == cfg["bug_step"]:
                    give_up_soon(group)
                    first, second = cfg["order"]
                    for op in ((first, second) if rank == cfg["odd_rank"] else (second, first)):
                        issue(op, group, root, device)
                log["local_loss"].append(loss.item())
                log["logged_loss"].append(logged.item())
                log["param_digest"].append(digest(params))
                log["buffer_digest"].append(digest(buffers))
                step += 1
        if bug == "collective_on_one_rank" and rank == cfg["odd_rank"]:
            give_up_soon(group)
            issue(cfg["lone_op"], group, root, device)  # alone: the others have finished
    except Exception as exc:
        log["error"], log["error_time"] = error_line(exc), time.time()
    log["flight"] = flight_records(group)
    return log


def give_up_soon(group) -> None:
    """From here on, `group` times out after HANG_TIMEOUT_S (as DIST_TIMEOUT would for a whole job;
    set only now so that a busy machine cannot time out the job's healthy part)."""
    _set_pg_timeout(datetime.timedelta(seconds=HANG_TIMEOUT_S), group)


def reference_grad_norm(model: nn.Module, x, y, batches: list[list[int]], device) -> float:
    """The gradient norm of one process that runs every rank's batch through a copy of `model` and
    averages the losses (each batch keeps its own BatchNorm statistics, as on its rank)."""
    twin = copy.deepcopy(model)
    loss = sum(nn.functional.mse_loss(twin(x[idx].to(device)), y[idx].to(device)) for idx in batches) / len(batches)
    grads = torch.autograd.grad(loss, list(twin.parameters()))
    return torch.cat([g.flatten() for g in grads]).norm().item()


def run_jobs(jobs: list[tuple[str, int, int]], rank: int, world_size: int) -> list[dict | None]:
    """Run every (bug, seed, job_world_size) job at once, each in a thread on a group of its own
    (the first job_world_size ranks); returns this rank's log of each (None where it takes no
    part). Call on every rank with the same list. Gloo and the CPU even on a GPU machine: on nccl
    a hung job's watchdog would tear the whole process down, and collectives issued from several
    threads on several communicators can deadlock each other."""
    for bug, seed, job_world in jobs:
        if bug not in BUGS or not 2 <= job_world <= world_size:
            raise ValueError(f"job {(bug, seed, job_world)}: the bug must be one of BUGS and the job's "
                             f"world size within 2..{world_size}")
    # Same order everywhere. Every job's group waits up to JOB_TIMEOUT_S (DIST_TIMEOUT if longer):
    # the jobs run at once, in threads, and a healthy job's collective can wait behind the others
    # on a busy machine; a planted hang gives up after HANG_TIMEOUT_S (give_up_soon).
    seconds = max(timeout_seconds(), JOB_TIMEOUT_S)
    groups = [new_group(list(range(job_world)), name=f"job {i}", backend="gloo", timeout_s=seconds)
              for i, (_, _, job_world) in enumerate(jobs)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(run_job, bug, seed, rank, job_world, group, torch.device("cpu"))
                   if rank < job_world else None for (bug, seed, job_world), group in zip(jobs, groups)]
        logs = [f.result() if f else None for f in futures]
    entries = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False, False)).get("entries", [])
    if entries and min(e["record_id"] for e in entries) > 0:  # ids count from 0 in each process
        raise RuntimeError(f"the flight recorder's ring buffer ({flight_recorder_size()} entries) overflowed, "
                           "so the oldest jobs' records may be cut short: set TORCH_FR_BUFFER_SIZE higher")
    dist.barrier()
    return logs


def job_outputs(logs_by_rank: dict[int, dict]) -> JobOutputs:
    """One job's outputs from every rank's log: the first error by time is the one blamed."""
    failed = sorted((log["error_time"], rank) for rank, log in logs_by_rank.items() if "error" in log)
    reports = {rank: {k: v for k, v in log.items() if k not in ("error", "error_time")}
               for rank, log in logs_by_rank.items()}
    first = failed[0][1] if failed else None
    return JobOutputs(len(logs_by_rank), first, logs_by_rank[first]["error"] if failed else "", reports)


def gather_outputs(logs: list[dict | None], world_size: int) -> list[dict] | None:
    """Rank 0 gets every job's JobOutputs (as dicts, ready for ctx.report); other ranks None."""
    everyone = [None] * world_size
    dist.gather_object(logs, everyone if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    return [asdict(job_outputs({r: everyone[r][j] for r in range(world_size) if everyone[r][j] is not None}))
            for j in range(len(logs))]


def outputs_from_dict(data: dict) -> JobOutputs:
    """A JobOutputs back from its report (JSON turns the rank keys into strings)."""
    return JobOutputs(data["world_size"], data["error_rank"], data["error"],
                      {int(r): rep for r, rep in data["reports"].items()})
