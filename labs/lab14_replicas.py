"""Lab 14 (per-step fault tolerance with torchft): replica groups that keep training when one of
them dies, and a restarted group that heals from a peer's live state.

Run:  ./run.sh 14      (labs/lab14_failures.py starts the lighthouse and the replica groups)

The pieces (torchft 0.2.0, https://github.com/pytorch/torchft):
- A *replica group* is one torchrun job: its ranks shard the model with FSDP2 over their own mesh
  (HSDP's dp_shard), and the groups hold the same model (HSDP's dp_replicate). torchrun restarts
  a group whose rank died (`--max-restarts`), and only that group.
- The *lighthouse* (`torchft.coordination.LighthouseServer`, here bound to 127.0.0.1) is the one
  process every group asks, each step, who is alive: the *quorum*. A group that stops
  heartbeating is dropped after `heartbeat_timeout_ms`.
- Each group's *Manager* (`torchft.manager.Manager`; a server on the group's rank 0) does, every
  step: `start_quorum()` (ask the lighthouse; if the members changed, reconfigure the cross-group
  process group; a group behind the others *heals*: it fetches a peer's model and optimizer state
  over HTTP and loads it), `allreduce()` across the groups (the gradients: dp_replicate), and
  `should_commit()` (a vote: the step counts only if every rank of the group had no error; an
  all-reduce that met a dead peer fails and the step is discarded, not applied).
- Gradients: FSDP2 reduce-scatters them within a group (averaging over its ranks), the manager
  all-reduces each rank's shard with the same rank of every other group (averaging over the
  groups that took part in this step): one process's gradient of the global batch, or, while a
  group is down, of the batches of those that are up.

A group trains on its rows of each step's global batch (`rank_batch`, shared with the restart run
of labs/lab14_restart.py); the step is torchft's committed step count, so a healed group continues
with the data of the step it healed to. The run ends when `steps` steps are done *and* every group
is back in the quorum: the others train on while a group is down, up to `steps`, then wait for
it (without training), and a group that stays away longer than `patience_s` fails the run.
`in_one_launch` makes every rank of an ordinary launch its own replica group (lighthouse on rank 0):
labs/lab14_lowcomm.py and lab14_diloco.py use it for torchft's DiLoCo.
"""
from __future__ import annotations

import datetime
import logging
import os
import time
import warnings
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from helpers.comm_count import count_collectives
from helpers.dist import DistContext, distributed, timeout_seconds
from labs.lab14_restart import (Task, kill_myself, lm_loss, make_model, on_the_cpu, rank_batch, task_config,
                                train_text)

LIGHTHOUSE = {"heartbeat_timeout_ms": 1000, "join_timeout_ms": 500, "quorum_tick_ms": 20}
MAX_DISCARDED = 5      # steps in a row a group may discard before it calls the run broken


def quiet_torchft() -> None:
    """torchft's Rust servers log every quorum at INFO, its checkpoint server every request and its
    manager every failed all-reduce with a traceback: keep the servers' warnings only (RUST_LOG
    must be set before torchft is imported)."""
    os.environ.setdefault("RUST_LOG", "warn")
    # its Python loggers: a failed all-reduce is logged with a traceback once per tensor; the
    # replicas print one line per event themselves
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    import http.server

    http.server.BaseHTTPRequestHandler.log_message = lambda *args, **kwargs: None


quiet_torchft()    # before any torchft import of the process: its Rust logger reads RUST_LOG once


def start_lighthouse(min_replicas: int = 1):
    """torchft's lighthouse in this process, listening on loopback only; returns (server, address)."""
    quiet_torchft()
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, **LIGHTHOUSE)
    port = server.address().rsplit(":", 1)[1]   # it names this machine's hostname; use loopback
    return server, f"http://127.0.0.1:{port}"


def make_manager(lighthouse: str, replica_id: str, group_rank: int, group_size: int, store_port: int,
                 state_dict, load_state_dict, min_replicas: int = 1):
    """A torchft Manager for one rank of one replica group, with the course's short timeouts."""
    quiet_torchft()
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    timeout = datetime.timedelta(seconds=timeout_seconds())
    return Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
                   state_dict=state_dict, min_replica_size=min_replicas, use_async_quorum=False,
                   replica_id=replica_id, rank=group_rank, world_size=group_size,
                   store_addr="127.0.0.1", store_port=store_port, lighthouse_addr=lighthouse,
                   hostname="127.0.0.1", timeout=timeout, quorum_timeout=timeout,
                   connect_timeout=timeout, init_sync=False)


def in_one_launch(ctx: DistContext, state_dict, load_state_dict):
    """Every rank of this launch its own replica group of one rank: rank 0 starts a lighthouse,
    each rank a store and a Manager. Returns (manager, lighthouse or None); shut both down after."""
    lighthouse, address = start_lighthouse(ctx.world_size) if ctx.rank == 0 else (None, None)
    box = [address]
    dist.broadcast_object_list(box, src=0)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = make_manager(box[0], f"replica{ctx.rank}", 0, 1, store.port, state_dict, load_state_dict,
                           min_replicas=ctx.world_size)
    manager._course_store = store      # the manager's store lives as long as the manager
    return manager, lighthouse


# ==================================================================== state a peer can send
def local(t):
    """This rank's part of a tensor (a DTensor's local shard), as a plain tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def plain_state(model, optimizer) -> dict:
    """Model and optimizer state as plain tensors (a DTensor's local shard): what a healthy
    group's rank sends to the same rank of a group that heals."""
    state = {i: {k: local(v).clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for i, s in enumerate(optimizer.state[p] for p in model.parameters())}
    return {"model": [local(p.detach()).clone() for p in model.parameters()], "optimizer": state}


def load_plain_state(model, optimizer, state: dict) -> None:
    """Copy a peer's `plain_state` into this rank's model and optimizer, in place (a group that
    heals before its first step has no optimizer state yet: it is made, shaped like the parameter)."""
    with torch.no_grad():
        for p, value in zip(model.parameters(), state["model"]):
            local(p).copy_(value)
        for i, p in enumerate(model.parameters()):
            mine = optimizer.state[p]
            for key, value in state["optimizer"][i].items():
                if not torch.is_tensor(value):
                    mine[key] = value
                elif value.dim() == 0:      # AdamW's step count: a plain scalar tensor
                    mine[key] = value.clone()
                else:
                    if key not in mine:
                        mine[key] = torch.zeros_like(p)
                    local(mine[key]).copy_(value)


# =============================================================================== a replica
def wait_for_every_group(manager, replicas: int, patience_s: float = 120.0) -> None:
    """Ask for quorums until every group is in one: the lighthouse forms a quorum of the groups
    that are up, and at the start the first group up would otherwise train alone."""
    deadline = time.monotonic() + patience_s
    while True:
        manager.start_quorum()
        if manager.num_participants() >= replicas:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {manager.num_participants()} of {replicas} replica groups "
                               f"joined within {patience_s:.0f} s")
        time.sleep(0.05)


def replica_run(ctx: DistContext, replica: int, replicas: int, lighthouse: str, steps: int,
                kill_at: int = -1, patience_s: float = 600.0, task: Task | None = None) -> dict:
    """Train as replica group `replica` of `replicas` until `steps` committed steps are done and
    every group is in the quorum (while a group is down the others train on up to `steps`, then
    wait for it, for at most `patience_s` seconds). On its first attempt, group `replica` kills its rank 0 in the middle of
    step `kill_at` (after the backward, before the cross-group all-reduce). `task`: the model's
    sizes (None: the Task's preset)."""
    from helpers.dist import device_mesh

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    born = __import__("psutil").Process().create_time()
    config, data = task_config(task), train_text()
    mesh = device_mesh("cpu", dp_shard=ctx.world_size) if ctx.world_size > 1 else None
    model, optimizer = make_model(config, mesh)
    counts: Counter = Counter()

    def state_dict():
        counts["state sent to a healing group"] += 1
        return plain_state(model, optimizer)

    def load_state_dict(state):
        counts["healed from a peer"] += 1
        load_plain_state(model, optimizer, state)

    store_port = int(os.environ["MASTER_PORT"])   # torchrun's store for this group (this attempt)
    manager = make_manager(lighthouse, f"replica{replica}", ctx.rank, ctx.world_size, store_port,
                           state_dict, load_state_dict)
    events = {"born": born, "ready": time.time(), "steps": [], "heals": []}
    quorum_ids, traffic, missing_since, discarded_in_a_row = set(), Counter(), None, 0
    try:
        if attempt == 0:
            wait_for_every_group(manager, replicas)
        while True:
            t0 = time.time()
            healed_before, sent_before = counts["healed from a peer"], counts["state sent to a healing group"]
            manager.start_quorum()
            t_quorum = time.time()
            counts["quorums"] += 1
            step, participants = manager.current_step(), manager.num_participants()
            quorum_ids.add(manager._quorum_id)
            healed = counts["healed from a peer"] > healed_before
            moved = healed or counts["state sent to a healing group"] > sent_before
            if healed:
                events["heals"].append([t0, t_quorum, step])
                print(f"replica {replica}: healed from a peer's live state at step {step}", flush=True)
            # done: every group back, at the same step (nobody healed in this quorum)
            if step >= steps and participants == replicas and not moved:
                break
            missing_since = missing_since or time.monotonic() if participants < replicas else None
            if missing_since is not None and time.monotonic() - missing_since > patience_s:
                raise RuntimeError(f"replica {replica}: {participants} of {replicas} groups for "
                                   f"{patience_s:.0f} s: the failed group never rejoined")
            if step >= steps and participants < replicas:
                # this short run's end: wait, without training, for the failed group to rejoin
                # (a long job would train on; here the steps stay `steps` + 1 for the reference)
                counts["quorums while waiting at the end"] += 1
                time.sleep(0.05)
                continue
            x, y = rank_batch(data, step, config, replica * ctx.world_size + ctx.rank,
                              replicas * ctx.world_size)
            with count_collectives() as log:
                loss = lm_loss(model(x), y)
                loss.backward()
                if attempt == 0 and step == kill_at and ctx.rank == 0:
                    ctx.report(**{f"attempt{attempt}": events})
                    kill_myself(ctx, step, when="in the middle of")
                # one flat buffer (DDP's bucket): every gradient shard and the loss, averaged
                # over the groups in the quorum in one all-reduce
                grads = [local(p.grad) for p in model.parameters()]
                flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])
                manager.allreduce(flat).wait()
                offset = 0
                for g in grads:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
                mean = flat[-1:].clone()    # this rank's loss, averaged over the groups
                t_sync = time.time()
                committed = manager.should_commit()
                t_commit = time.time()
            if ctx.world_size > 1:     # for the record: over the group's ranks too (not counted)
                dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            for c in log:
                traffic[f"{c.kind} calls"] += 1
                traffic[f"{c.kind} bytes"] += c.nbytes
            if committed:
                optimizer.step()
                discarded_in_a_row = 0
            else:
                failure = manager.errored()
                failure = getattr(failure, "original_exception", failure)
                error = f"{type(failure).__name__}: {failure}"[:160] if failure else "not enough groups"
                print(f"replica {replica}: step {step} discarded (should_commit: no): {error}", flush=True)
                discarded_in_a_row += 1
                if discarded_in_a_row >= MAX_DISCARDED:   # a bug, not a peer's failure: stop
                    raise RuntimeError(f"replica {replica}: {MAX_DISCARDED} steps in a row discarded; "
                                       f"the last: {error}")
            optimizer.zero_grad()
            counts["should_commit: yes" if committed else "should_commit: no"] += 1
            # [step, start, quorum done, all-reduces done, vote done, end, committed, groups, loss]
            events["steps"].append([step, t0, t_quorum, t_sync, t_commit, time.time(), committed,
                                    participants, mean.item()])
            if len(events["steps"]) % 10 == 0 or not committed or healed:
                ctx.report(**{f"attempt{attempt}": events})     # what a dead rank leaves behind
        ctx.report(**{f"attempt{attempt}": events})
    finally:
        manager.shutdown(wait=False)
    counts["reconfigurations"] = len(quorum_ids)
    return {"attempt": attempt, "counts": dict(counts), "traffic": dict(traffic),
            "final_step": manager.current_step(), "batches_committed": manager.batches_committed(),
            "params": [local(p.detach()).double().sum().item() for p in model.parameters()],
            "pid": os.getpid()}


@dataclass(frozen=True)
class Run(Task):
    """This launch is replica group `replica` of `replicas` (its ranks: the group's), training
    `steps` committed steps; `lighthouse`: the lighthouse's address (empty: start one here, for
    one group alone); `patience_s`: how long a group may stay away; `kill_at`: the step in which
    this group's rank 0 dies on its first attempt (-1: none)."""
    replica: int = 0
    replicas: int = 1
    lighthouse: str = ""
    steps: int = 40
    patience_s: float = 600.0
    kill_at: int = -1
    SMOKE = dict(Task.SMOKE, steps=12)
    TOUR = dict(SMOKE, steps=8)

    def __post_init__(self):
        if not 0 <= self.replica < self.replicas:
            raise ValueError(f"--replica must lie in 0..{self.replicas - 1}, got {self.replica}")


def run(ctx: DistContext, cfg: Run) -> dict:
    """One replica group's run (alone, without a lighthouse address: one group with its own)."""
    lighthouse, address = None, [cfg.lighthouse]
    if not cfg.lighthouse:    # alone (./run.sh 14): one group, its lighthouse on rank 0
        if ctx.rank == 0:
            lighthouse, address[0] = start_lighthouse()
        dist.broadcast_object_list(address, src=0)
    try:
        result = replica_run(ctx, cfg.replica, cfg.replicas, address[0], cfg.steps, cfg.kill_at,
                             cfg.patience_s, task=cfg)
        ctx.barrier()      # the lighthouse stays until every rank is done with it
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
    return result


def main(argv=None) -> None:
    cfg = Run.from_argv(argv)
    on_the_cpu()
    with distributed() as ctx:
        result = run(ctx, cfg)
        ctx.report(result=result)
        ctx.print0(f"replica {cfg.replica}: {result['final_step']} steps, attempt "
                   f"{result['attempt']}, {result['counts']}")


if __name__ == "__main__":
    main()
