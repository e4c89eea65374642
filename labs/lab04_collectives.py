"""Lab 04: the collective operations and the stores under them, each shown on every rank.

Run:  ./run.sh 04      (this file alone: ./run.sh labs/lab04_collectives.py)

Every rank runs a tour: key-value stores (TCPStore, FileStore, HashStore), point-to-point
send/recv and isend/irecv, then broadcast, scatter, gather, reduce, all-gather, reduce-scatter,
all-reduce and barrier on small integer tensors, recording its tensor before and after each one.
Rank 0 gathers the records and prints one table per operation (the notebook draws the same tables
from the launch's reports). Then it checks all-reduce == reduce-scatter + all-gather (and MPI's
Allreduce == Reduce + Bcast), times the pickle-based `*_object` collectives, and probes which
reduction ops and dtypes this backend accepts.

The homework of notebook 04, `ring_all_reduce`, lives in labs/lab04_ring.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import datetime
import os
import shutil
import socket
import tempfile
import time

import torch
import torch.distributed as dist

from helpers import runs
from helpers.comm_bench import all_gather_single, reduce_scatter_single
from helpers.dist import DistContext, distributed
from helpers.show import table


# ============================================================================ key-value stores
def store_demo(rank: int, world_size: int, device: torch.device, timeout_s: float) -> dict:
    """TCPStore, FileStore and HashStore: the rendezvous layer under every process group.

    Returns what this rank saw. A TCPStore is a server (hosted by rank 0 here) that every rank
    reaches over TCP; a FileStore is a file on a file system every rank can see; a HashStore
    lives in one process's memory (threads only; helpers.dist uses one for world size 1).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    # Rank 0 hosts a server on a free port; the port reaches the others over the process group
    # we already have (torchrun passes MASTER_ADDR / MASTER_PORT the same way, in the environment).
    if rank == 0:
        tcp = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout, wait_for_workers=False)
    port = torch.tensor([tcp.port if rank == 0 else 0], device=device)
    dist.broadcast(port, src=0)
    if rank != 0:
        tcp = dist.TCPStore("127.0.0.1", int(port.item()), world_size, False, timeout)

    arrival = tcp.add("arrived", 1)  # atomic counter: its value is this rank's arrival order
    if rank == 0:
        tcp.set("config/lr", "0.1")
    lr_read = tcp.get("config/lr").decode()  # get() waits until some rank has set the key
    tcp.set(f"host/{rank}", socket.gethostname())
    tcp.wait([f"host/{r}" for r in range(world_size)])  # a barrier made of keys
    # compare_set: set only if the key is absent (expected ""): the first rank to try wins
    leader = tcp.compare_set("leader", "", str(rank)).decode()

    # FileStore: a path every rank can see (here /tmp; on a cluster, a shared file system)
    if rank == 0:
        tcp.set("filestore/path", os.path.join(tempfile.mkdtemp(prefix="lab04-"), "store"))
    path = tcp.get("filestore/path").decode()
    files = dist.FileStore(path, world_size)
    file_count = files.add("visits", 1)
    files.set(f"hello/{rank}", f"from rank {rank}")
    files.wait([f"hello/{r}" for r in range(world_size)])
    neighbour_note = files.get(f"hello/{(rank + 1) % world_size}").decode()

    # HashStore: private to this process, so the other ranks' keys never show up here
    local = dist.HashStore()
    local.set(f"hello/{rank}", "only I can see this")
    others_visible = any(local.check([f"hello/{r}"]) for r in range(world_size) if r != rank)

    hashstore_keys = local.num_keys()
    # A FileStore's destructor reopens its file (the last one out deletes it) and waits, up to the
    # timeout, for the file to exist: every rank closes its FileStore before rank 0 removes the
    # folder, and the TCPStore clients disconnect before rank 0's server goes away.
    del files
    if rank != 0:
        del tcp
    dist.barrier()
    if rank == 0:
        del tcp
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return {"tcp_port": int(port.item()), "arrival": arrival, "lr_read": lr_read,
            "leader": int(leader), "filestore_path": path, "file_count": file_count,
            "neighbour_note": neighbour_note, "hashstore_sees_others": others_visible,
            "hashstore_keys": hashstore_keys}


# ============================================================================ point-to-point
def p2p_demo(rank: int, world_size: int, device: torch.device) -> dict:
    """Blocking send/recv (a token passed once around the ring), then isend/irecv (every rank
    shifts its tensor to the next rank at the same time)."""
    if world_size == 1:
        return {"token_received": None, "token_sent": None, "shift_before": [], "shift_after": []}
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    # send/recv block: rank 0 starts, everyone else waits for the token first. Had every rank
    # called send first, all of them would wait for a receive that never comes.
    token = torch.zeros(1, dtype=torch.int64, device=device)
    if rank == 0:
        dist.send(token + 1, dst=nxt)
        dist.recv(token, src=prv)
        received, sent = token.item(), 1
    else:
        dist.recv(token, src=prv)
        received = token.item()
        sent = received + rank + 1  # each rank adds rank + 1
        dist.send(token + rank + 1, dst=nxt)
    # isend/irecv return at once with a Work handle: post both, then wait on both.
    mine = torch.arange(3, device=device) + 10 * rank
    theirs = torch.empty_like(mine)
    works = [dist.isend(mine, dst=nxt), dist.irecv(theirs, src=prv)]
    for work in works:
        work.wait()
    return {"token_received": received, "token_sent": sent, "shift_before": mine.tolist(),
            "shift_after": theirs.tolist()}


# ============================================================================ the collectives
def collectives_demo(rank: int, world_size: int, device: torch.device) -> dict[str, dict]:
    """Every collective on small int64 tensors: {op: {"before": ..., "after": ..., "note": ...}}.

    Values are 10 * rank + position, so each number says where it came from.
    """
    n, out = world_size, {}

    def mine(k: int = 4) -> torch.Tensor:
        return torch.arange(k, device=device) + 10 * rank

    x = mine()
    before = x.tolist()
    dist.broadcast(x, src=0)
    out["broadcast"] = {"before": before, "after": x.tolist(),
                        "note": "src=0: rank 0's tensor everywhere"}

    # scatter: rank 0 holds one piece per rank, (2,) each; every rank receives its piece
    pieces = [torch.arange(2, device=device) + 100 * r for r in range(n)] if rank == 0 else None
    piece = torch.full((2,), -1, device=device)
    dist.scatter(piece, scatter_list=pieces, src=0)
    out["scatter"] = {"before": [p.tolist() for p in pieces] if rank == 0 else "(receives only)",
                      "after": piece.tolist(), "note": "src=0: piece r of rank 0's list to rank r"}

    x = mine(2)
    bucket = [torch.empty_like(x) for _ in range(n)] if rank == 0 else None
    dist.gather(x, gather_list=bucket, dst=0)
    out["gather"] = {"before": x.tolist(),
                     "after": [b.tolist() for b in bucket] if rank == 0 else "(sends only)",
                     "note": "dst=0: every rank's tensor in rank 0's list"}

    x = mine()
    before = x.tolist()
    dist.reduce(x, dst=0, op=dist.ReduceOp.SUM)
    out["reduce"] = {"before": before,
                     "after": x.tolist() if rank == 0 else "(undefined: scratch space)",
                     "note": "dst=0: the sum lands on rank 0 only"}

    x = mine(2)
    gathered = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(gathered, x)
    out["all_gather"] = {"before": x.tolist(), "after": [g.tolist() for g in gathered],
                         "note": "every rank gets every rank's tensor"}

    # reduce-scatter: each rank holds n pieces; rank r gets the sum over ranks of piece r
    inputs = [torch.arange(2, device=device) + 10 * rank + 100 * r for r in range(n)]
    result = torch.empty(2, dtype=torch.int64, device=device)
    dist.reduce_scatter(result, inputs, op=dist.ReduceOp.SUM)
    out["reduce_scatter"] = {"before": [t.tolist() for t in inputs], "after": result.tolist(),
                             "note": "rank r gets the sum of everyone's piece r"}

    x = mine()
    before = x.tolist()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    out["all_reduce"] = {"before": before, "after": x.tolist(), "note": "the sum on every rank"}

    # barrier: rank r arrives r * 50 ms late; nobody leaves before the last one arrives
    time.sleep(0.05 * rank)
    arrived = time.time()
    dist.barrier()
    left = time.time()
    out["barrier"] = {"arrived": arrived, "left": left,  # seconds since the epoch (one clock)
                      "note": "rank r sleeps 50*r ms first; nobody leaves before all arrive"}
    return out


def tour_rows(records: dict[int, dict], op: str) -> list[dict]:
    """One table row per rank for collective `op`, from {rank: collectives_demo(...)}."""
    rows = []
    if op == "barrier":  # times in ms after the first arrival: processes on one machine share a clock
        start = min(rec["barrier"]["arrived"] for rec in records.values())
        for rank in sorted(records):
            rec = records[rank]["barrier"]
            rows.append({"rank": rank, "before": f"arrives at +{(rec['arrived'] - start) * 1e3:.0f} ms",
                         "after": f"leaves at +{(rec['left'] - start) * 1e3:.0f} ms"})
        return rows
    for rank in sorted(records):
        rec = records[rank][op]
        rows.append({"rank": rank, "before": _short(rec["before"]), "after": _short(rec["after"])})
    return rows


def barrier_spread(records: dict[int, dict]) -> tuple[float, float]:
    """(spread of arrival times, spread of departure times) in seconds across ranks."""
    arrived = [r["barrier"]["arrived"] for r in records.values()]
    left = [r["barrier"]["left"] for r in records.values()]
    return max(arrived) - min(arrived), max(left) - min(left)


def _short(value) -> str:
    return value if isinstance(value, str) else str(value).replace(" ", "")


# ============================================================================ identities
def decomposition_demo(rank: int, world_size: int, device: torch.device, numel_per_rank: int = 4,
                       seed: int = 0) -> dict:
    """all-reduce == reduce-scatter + all-gather, and MPI's Allreduce == Reduce + Bcast, run both
    ways on the same input (int64: exactly equal; float32: equal up to summation order)."""
    n = world_size
    generator = torch.Generator().manual_seed(seed + rank)
    ints = torch.randint(-50, 50, (n * numel_per_rank,), generator=generator).to(device)
    floats = torch.randn(n * numel_per_rank, generator=generator).to(device)
    out = {"input": ints.tolist()}
    for name, x in (("int64", ints), ("float32", floats)):
        reference = x.clone()
        dist.all_reduce(reference)
        # reduce-scatter then all-gather: (n*k,) -> my reduced (k,) piece -> (n*k,) everywhere
        piece = torch.empty(numel_per_rank, dtype=x.dtype, device=device)
        reduce_scatter_single(piece, x.clone())
        two_step = torch.empty_like(x)
        all_gather_single(two_step, piece)
        # Reduce to rank 0, then broadcast from it
        via_root = x.clone()
        dist.reduce(via_root, dst=0)
        dist.broadcast(via_root, src=0)
        out[name] = {"all_reduce": reference.tolist(), "rs_ag": two_step.tolist(),
                     "rs_ag_max_diff": (reference - two_step).abs().max().item(),
                     "reduce_bcast_max_diff": (reference - via_root).abs().max().item()}
    return out


# ============================================================================ *_object and backends
def object_demo(rank: int, world_size: int, device: torch.device, numel: int = 20_000,
                repeats: int = 5) -> dict:
    """all_gather_object gathers any picklable object; time it against all_gather of a tensor
    carrying the same numbers. Under the hood: pickle, a tensor of bytes, one collective for the
    sizes and one for the bytes, then unpickling (on nccl, also copies to and from the GPU)."""
    from helpers.bench import measure

    note = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname()}
    notes = [None] * world_size
    dist.all_gather_object(notes, note)
    values = torch.arange(numel, dtype=torch.float32, device=device) + rank
    as_list = values.tolist()
    gathered = [torch.empty_like(values) for _ in range(world_size)]
    objects = [None] * world_size
    t_tensor = measure(lambda: dist.all_gather(gathered, values), repeats=repeats, device=device,
                       barrier=True).median
    t_object = measure(lambda: dist.all_gather_object(objects, as_list), repeats=repeats,
                       device=device, barrier=True).median
    same = all(objects[r] == gathered[r].tolist() for r in range(world_size))
    return {"notes": notes, "numel": numel, "tensor_s": t_tensor, "object_s": t_object,
            "object_over_tensor": t_object / t_tensor, "same_values": same}


def support_probe(device: torch.device) -> dict[str, str]:
    """Try the reductions and dtypes whose support differs between gloo and nccl, on this
    backend. Each probe fails (or not) the same way on every rank, before any data moves."""
    def outcome(fn) -> str:
        try:
            fn()
            return "works"
        except (RuntimeError, ValueError, TypeError, AttributeError) as exc:
            return "fails: " + str(exc).strip().splitlines()[0][:70]

    def reduce(name, dtype=torch.float32):
        def run():
            # PREMUL_SUM carries its factor (made inside the probe: the helper is nccl-flavoured)
            if name == "PREMUL_SUM":
                op = dist._make_nccl_premul_sum(0.5)
            else:
                op = getattr(dist.ReduceOp, name)
            dist.all_reduce(torch.ones(4, device=device).to(dtype), op=op)
        return run

    rank = dist.get_rank()
    return {
        "all_reduce SUM, float32": outcome(reduce("SUM")),
        "all_reduce AVG": outcome(reduce("AVG")),
        "all_reduce BAND (bitwise and), int64": outcome(reduce("BAND", torch.int64)),
        "all_reduce PREMUL_SUM": outcome(reduce("PREMUL_SUM")),
        "all_reduce bfloat16": outcome(reduce("SUM", torch.bfloat16)),
        "all_reduce float8_e4m3fn": outcome(reduce("SUM", torch.float8_e4m3fn)),
        "all_gather, uneven sizes": outcome(lambda: dist.all_gather(
            [torch.empty(1 + r, device=device) for r in range(dist.get_world_size())],
            torch.ones(1 + rank, device=device))),
    }


# What the documentation says about the other backend (torch.distributed docs, "Backends" and
# ReduceOp); the column for the backend in use is measured by support_probe.
DOCUMENTED_SUPPORT = {
    "gloo": {
        "tensors on": "CPU (GPU tensors only for broadcast and all_reduce)",
        "recv from any source (src=None)": "yes",
        "tag on send/recv": "yes",
    },
    "nccl": {
        "tensors on": "GPU only (one device per rank)",
        "recv from any source (src=None)": "no",
        "tag on send/recv": "no (ignored)",
    },
}
DOCUMENTED_REDUCTIONS_NCCL = {
    "all_reduce AVG": "works (NCCL >= 2.10)",
    "all_reduce BAND (bitwise and), int64": "fails: BAND/BOR/BXOR not available with NCCL",
    "all_reduce PREMUL_SUM": "works (NCCL >= 2.11)",
    "all_reduce bfloat16": "works",
}


@dataclass(frozen=True)
class Run(runs.Run):
    """Floats in the object-collective comparison."""
    object_numel: int = 20_000
    SMOKE = dict(object_numel=2_000)


def run(ctx: DistContext, cfg: Run) -> dict:
    """Run the whole tour on this rank; returns this rank's record."""
    rank, world_size, device = ctx.rank, ctx.world_size, ctx.device
    return {"stores": store_demo(rank, world_size, device, ctx.timeout_s),
            "p2p": p2p_demo(rank, world_size, device),
            "collectives": collectives_demo(rank, world_size, device),
            "decomposition": decomposition_demo(rank, world_size, device),
            "objects": object_demo(rank, world_size, device, numel=cfg.object_numel),
            "support": support_probe(device)}


def print_summary(ctx: DistContext, record: dict) -> None:
    """Rank 0 prints every table; the other ranks' records arrive by gather_object."""
    records = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(record, records, dst=0)
    if ctx.rank != 0:
        return
    by_rank = {r: rec["collectives"] for r, rec in enumerate(records)}
    for op in ("broadcast", "scatter", "gather", "reduce", "all_gather", "reduce_scatter",
               "all_reduce", "barrier"):
        table(tour_rows(by_rank, op), title=f"{op}: {by_rank[0][op]['note']}")
    arrive, leave = barrier_spread(by_rank)
    print(f"barrier: arrivals spread over {arrive * 1e3:.0f} ms, departures over {leave * 1e3:.1f} ms")
    dec = records[0]["decomposition"]
    print(f"all_reduce vs reduce_scatter + all_gather: int64 max diff {dec['int64']['rs_ag_max_diff']},"
          f" float32 max diff {dec['float32']['rs_ag_max_diff']:.2g}")
    obj = records[0]["objects"]
    print(f"all_gather_object took {obj['object_over_tensor']:.1f}x as long as all_gather of the "
          f"same {obj['numel']} floats as a tensor")


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        record = run(ctx, cfg)
        print_summary(ctx, record)
        ctx.report(tour=record)


if __name__ == "__main__":
    main()
