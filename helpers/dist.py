"""Process-group setup: the one place that chooses the backend and the device.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE for every worker. `setup()` reads
them, picks nccl + one GPU per rank when this node has a GPU for every local rank and gloo + CPU
otherwise (saying why), and initialises the default process group with a short timeout
(`DIST_TIMEOUT` seconds, default 60) so a broken exercise fails instead of hanging for torch's
default 30 minutes. Without torchrun's variables it runs as one process (world size 1), so labs
and notebooks can call the same code in-process.

    with distributed() as ctx:          # setup, error record, teardown
        x = torch.ones(3, device=ctx.device)
        dist.all_reduce(x)
        ctx.print0(x)                   # printed by rank 0 only
        ctx.report(total=x.tolist())    # returned to the launcher (helpers.launch)

Nothing else in the course touches `torch.cuda` unguarded: ask `ctx.device`, `gpu_count()` or
`synchronize(device)` here.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
# Before any group exists: torch.distributed.nn's functions take `group=group.WORLD` as a default,
# evaluated when it is first imported. Imported after init_process_group (torch._dynamo imports it,
# and building the first optimizer imports torch._dynamo), every one of those defaults holds the
# default group, so destroy_process_group() cannot free it: gloo's worker and transport threads
# then live on into the interpreter's exit, which now and then aborts ("terminate called without
# an active exception"). Imported here, the defaults are None and the group dies at teardown.
import torch.distributed.nn  # noqa: F401,E402

from helpers.config import settings

RESULTS_ENV = "COURSE_RESULTS_DIR"  # set by helpers.launch: where ranks write their reports
FINISHED = "_finished"  # reported by distributed() when a rank's body completed without error


@dataclass(frozen=True)
class BackendChoice:
    backend: str      # "nccl" or "gloo"
    device_type: str  # "cuda" or "cpu"
    reason: str


def gpu_count() -> int:
    """GPUs this process can see (0 on a CPU-only build or machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(num_gpus: int, local_world_size: int, force_cpu: bool = False) -> BackendChoice:
    """nccl with one GPU per local rank when there are enough GPUs, else gloo on the CPU."""
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
    if num_gpus < 0:
        raise ValueError(f"num_gpus must be >= 0, got {num_gpus}")
    if force_cpu:
        return BackendChoice("gloo", "cpu", "COURSE_DEVICE=cpu asks for the CPU")
    if num_gpus >= local_world_size:
        return BackendChoice(
            "nccl", "cuda", f"{num_gpus} GPU(s) for {local_world_size} local rank(s): one GPU per rank"
        )
    if num_gpus == 0:
        return BackendChoice("gloo", "cpu", "no GPU visible: gloo on the CPU")
    return BackendChoice(
        "gloo",
        "cpu",
        f"{num_gpus} GPU(s) for {local_world_size} local ranks: nccl needs one GPU per rank, "
        "so gloo on the CPU",
    )


def timeout_seconds() -> float:
    """DIST_TIMEOUT (helpers.config: 60 s unless set)."""
    return settings().dist_timeout


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels on `device` (CUDA runs asynchronously); a no-op on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    reason: str
    timeout_s: float

    def print0(self, *args: Any, **kwargs: Any) -> None:
        """print() on rank 0 only, flushed so launcher output streams in order."""
        if self.rank == 0:
            print(*args, **kwargs, flush=True)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def report(self, **values: Any) -> None:
        """Merge `values` into this rank's JSON report, which `helpers.launch` returns.

        Tensors become lists. Outside a launch (no COURSE_RESULTS_DIR) the values are kept in
        `last_report` only, so the same lab code runs in-process.
        """
        clean = {k: _jsonable(v) for k, v in values.items()}
        _LAST_REPORT.update(clean)
        path = results_path(self.rank)
        if path is None:
            return
        data = json.loads(path.read_text()) if path.exists() else {}
        data.update(clean)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)


_LAST_REPORT: dict[str, Any] = {}


def last_report() -> dict[str, Any]:
    """What `report()` recorded in this process (for in-process, world-size-1 runs)."""
    return dict(_LAST_REPORT)


def results_path(rank: int) -> Path | None:
    folder = settings().results_dir
    return Path(folder) / f"rank{rank}.json" if folder else None


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw not in (None, "") else default


def setup(timeout_s: float | None = None) -> DistContext:
    """Initialise the default process group from torchrun's environment (or as one process)."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = _env_int("RANK", 0) if launched else 0
    world_size = _env_int("WORLD_SIZE", 1) if launched else 1
    local_rank = _env_int("LOCAL_RANK", 0) if launched else 0
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size) if launched else 1
    timeout_s = timeout_seconds() if timeout_s is None else timeout_s
    choice = choose_backend(
        gpu_count(), local_world_size, force_cpu=settings().device == "cpu"
    )
    device = torch.device("cuda", local_rank) if choice.device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        _short_default_timeout(timeout)
        if launched:
            dist.init_process_group(choice.backend, rank=rank, world_size=world_size, timeout=timeout)
        else:  # one process, no rendezvous: an in-memory store is enough
            dist.init_process_group(
                choice.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    ctx = DistContext(
        rank, world_size, local_rank, local_world_size, choice.backend, device, choice.reason, timeout_s
    )
    ctx.report(
        rank=rank, world_size=world_size, local_rank=local_rank, backend=choice.backend,
        device=str(device), reason=choice.reason, pid=os.getpid(), hostname=os.uname().nodename,
    )
    return ctx


# ----------------------------------------------------------------------------- groups and meshes
# The names a device mesh's dimensions may have, in torchtitan's order
# (torchtitan/distributed/parallel_dims.py: [pp, dp_replicate, dp_shard, cp, tp]), with "dp" for a
# single data-parallel dimension and "ep" for the experts' sub-mesh. Every lab names its axes from
# here, so a table of calls per dimension reads the same in every notebook.
MESH_AXES: dict[str, str] = {
    "pp": "pipeline stages",
    "dp_replicate": "data parallel, replicated (HSDP's outer dimension)",
    "dp_shard": "data parallel, sharded (FSDP)",
    "dp": "data parallel (one dimension)",
    "cp": "context parallel: the sequence split over ranks",
    "ep": "expert parallel: the experts split over ranks",
    "tp": "tensor (and sequence) parallel",
}


def new_group(ranks: list[int] | None = None, *, name: str, backend: str | None = None,
              timeout_s: float | None = None) -> dist.ProcessGroup:
    """`dist.new_group` with DIST_TIMEOUT (or `timeout_s`: lab 10's planted hangs give up sooner)
    and `name` as its description (torch's `group_desc`, which the flight recorder keeps and a
    timeout's message names: see `explain_timeout`). Every rank of the default group must call
    it, in the same order, even ranks that are not in `ranks`."""
    if not name or not isinstance(name, str):
        raise ValueError("a group needs a name (e.g. name=\"checksums\"): a timeout's message names it")
    seconds = timeout_seconds() if timeout_s is None else timeout_s
    return dist.new_group(ranks, timeout=datetime.timedelta(seconds=seconds), backend=backend,
                          group_desc=name)


def device_mesh(device_type: str | torch.device, **sizes: int):
    """A DeviceMesh over every rank, its dimensions named and sized by `sizes` in order, e.g.
    `device_mesh("cpu", pp=2, dp=2, tp=2)`; names from MESH_AXES. Its groups time out after
    DIST_TIMEOUT: `init_device_mesh` makes them with torch's default timeout, which `setup()` sets
    to DIST_TIMEOUT (and this sets again while the mesh is made, for a group set up elsewhere).
    torch names each dimension's groups `mesh_<dim>`, which a timeout's message shows."""
    from unittest import mock

    from torch.distributed.device_mesh import init_device_mesh

    unknown = [n for n in sizes if n not in MESH_AXES]
    if unknown:
        raise ValueError(f"mesh dimension(s) {unknown} are not among helpers.dist.MESH_AXES "
                         f"({', '.join(MESH_AXES)})")
    bad = {n: s for n, s in sizes.items() if not isinstance(s, int) or s < 1}
    if bad:
        raise ValueError(f"mesh dimensions must be positive whole numbers, got {bad}")
    total = 1
    for s in sizes.values():
        total *= s
    world = dist.get_world_size()
    if total != world:
        shape = " x ".join(f"{n} {s}" for n, s in sizes.items())
        raise ValueError(f"a {shape} mesh needs {total} ranks, this run has {world}")
    device_type = torch.device(device_type).type if isinstance(device_type, torch.device) else device_type
    timeout = datetime.timedelta(seconds=timeout_seconds())
    c10d = dist.distributed_c10d
    with mock.patch.object(c10d, "default_pg_timeout", timeout), \
            mock.patch.object(c10d, "default_pg_nccl_timeout", timeout):
        return init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))


# torch's default timeout for groups made without one (`distributed_c10d.default_pg_timeout`, read
# each time a group is made: 30 minutes on gloo, 10 on nccl) as it was before setup() shortened it.
_TORCH_DEFAULT_TIMEOUTS: tuple | None = None


def _short_default_timeout(timeout: datetime.timedelta) -> None:
    """Make DIST_TIMEOUT torch's default for every group made without a timeout of its own: those
    torch makes itself (a DeviceMesh's dimensions and `_flatten`, FSDP's, pipelining's) and those
    code outside the course makes with a bare `dist.new_group(ranks)`. A group made with an
    explicit timeout keeps it (lab 10's planted hangs)."""
    global _TORCH_DEFAULT_TIMEOUTS
    c10d = dist.distributed_c10d
    if _TORCH_DEFAULT_TIMEOUTS is None:
        _TORCH_DEFAULT_TIMEOUTS = (c10d.default_pg_timeout, c10d.default_pg_nccl_timeout)
    c10d.default_pg_timeout = timeout
    if c10d.default_pg_nccl_timeout is not None:  # None on a build without nccl
        c10d.default_pg_nccl_timeout = timeout


def teardown() -> None:
    """Destroy every process group (their gloo threads are joined then, while Python is whole)
    and put torch's default timeout back."""
    global _TORCH_DEFAULT_TIMEOUTS
    if dist.is_initialized():
        dist.destroy_process_group()
    if _TORCH_DEFAULT_TIMEOUTS is not None:
        c10d = dist.distributed_c10d
        c10d.default_pg_timeout, c10d.default_pg_nccl_timeout = _TORCH_DEFAULT_TIMEOUTS
        _TORCH_DEFAULT_TIMEOUTS = None


# ----------------------------------------------------------------------------- a timeout, named
def waited_collectives() -> list[dict]:
    """The collectives this process may be waiting in, from torch's flight recorder (on by
    default, gloo included, in torch 2.13: helpers/flight_recorder.py), as
    [{"op", "seq", "group", "desc", "ranks", "timeout_s", "sizes"}, ...]: those not completed,
    oldest first (it keeps, per process group, the last collective enqueued and the last
    completed); or, when there is none (gloo marks a collective that timed out as completed, at
    times before its waiter hears of it), the last one this thread issued. Each names its group by
    its `group_desc` (`new_group(name=...)`, `mesh_tp` for a mesh's tp dimension, `default_pg`), so
    groups torch makes itself are named too. gloo's send and recv are not recorded. Empty when
    the recorder is off (TORCH_FR_BUFFER_SIZE=0)."""
    import pickle
    import threading

    try:
        dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False, False))
    except Exception:  # noqa: BLE001  (recorder off, or a torch without it: nothing to say)
        return []
    ranks_of = {}
    with contextlib.suppress(Exception):
        ranks_of = {pg.group_name: sorted(r) for pg, r in dist.distributed_c10d._world.pg_group_ranks.items()
                    if isinstance(pg, dist.ProcessGroup)}

    def described(entry: dict) -> dict:
        name, desc = entry["process_group"]
        return {"op": entry["profiling_name"].split(":")[-1], "seq": entry["collective_seq_id"],
                "group": name, "desc": desc, "ranks": ranks_of.get(name),
                "timeout_s": entry["timeout_ms"] / 1000, "sizes": entry["input_sizes"]}

    entries = [e for e in dump.get("entries", []) if not e.get("is_p2p")]
    unfinished = []
    for pg_id, status in dump.get("pg_status", {}).items():
        first = status.get("last_completed_collective", -1) + 1
        if status.get("last_enqueued_collective", -1) >= first:
            unfinished += [e for e in entries
                           if str(e["pg_id"]) == str(pg_id) and e["collective_seq_id"] == first]
    if unfinished:
        return [described(e) for e in sorted(unfinished, key=lambda e: e["time_created_ns"])]
    mine = [e for e in entries if str(e.get("thread_id")) == str(threading.get_ident())]
    return [described(mine[-1])] if mine else []


def describe_group(desc: str, ranks: list[int] | None) -> str:
    """"group 'checksums' (ranks [1, 2])", "the mesh's 'tp' dimension (ranks [2, 3])"."""
    where = f"the mesh's '{desc[5:]}' dimension" if desc.startswith("mesh_") else f"group '{desc}'"
    return where + (f" (ranks {ranks})" if ranks is not None else "")


# How a collective's timeout reads: gloo's wait ("Timed out waiting 60000ms for recv operation to
# complete"), nccl's watchdog ("Watchdog caught collective operation timeout").
_TIMED_OUT = ("timed out waiting", "operation timeout")


def explain_timeout(exc: BaseException, rank: int) -> BaseException:
    """A collective's timeout (gloo: "Timed out waiting 60000ms for recv operation to complete",
    which names no group) gets the rank and the collective it waited in written into its message:
    "rank 2 waited 60 s in all_reduce #3 of the mesh's 'tp' dimension (ranks [2, 3]), which another
    rank of it has not joined; gloo: Timed out ...". The exception keeps its type and
    traceback (the launcher locates it in the labs); any other exception is returned as it was."""
    text = str(exc)
    if not isinstance(exc, RuntimeError) or not any(t in text.lower() for t in _TIMED_OUT) \
            or text.startswith(f"rank {rank} waited"):  # explained already
        return exc
    backend = "gloo" if "gloo" in text or "unbound_buffer" in text else "torch"
    said = f"{backend}: {error_line(exc).split(': ', 1)[1]}"
    waiting = waited_collectives()
    if not waiting:  # gloo's send and recv are not in the flight recorder
        if "operation to complete" not in text:  # not gloo's wait: nothing sure to add
            return exc
        with contextlib.suppress(Exception):
            exc.args = (f"rank {rank} waited in no collective the flight recorder saw (a send or recv, "
                        f"which it does not record on gloo?); {said}", *exc.args[1:])
        return exc
    first = waiting[0]
    line = (f"rank {rank} waited {first['timeout_s']:g} s in {first['op']} #{first['seq']} of "
            f"{describe_group(first['desc'], first['ranks'])}, which another rank of it has not "
            "joined")
    others = [f"{w['op']} #{w['seq']} of {describe_group(w['desc'], w['ranks'])}" for w in waiting[1:]]
    if others:
        line += f" (also unfinished: {'; '.join(others)})"
    with contextlib.suppress(Exception):
        exc.args = (f"{line}; {said}", *exc.args[1:])
    return exc


def record_error(rank: int, exc: BaseException) -> None:
    """Leave this rank's traceback where the launcher finds it, so its message names the rank."""
    folder = settings().results_dir
    if not folder:
        return
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    path = Path(folder) / f"error.rank{rank}.txt"
    tmp = path.with_suffix(".tmp")  # whole or not at all: the launcher may read it while we die
    tmp.write_text(f"{time.time()}\n{text}")
    tmp.replace(path)


@contextlib.contextmanager
def distributed(timeout_s: float | None = None) -> Iterator[DistContext]:
    """setup() ... teardown(), recording this rank's error for the launcher if the body raises."""
    try:
        ctx = setup(timeout_s)
    except BaseException as exc:  # e.g. a rendezvous timeout: still tell the launcher who failed
        record_error(_env_int("RANK", 0), exc)
        raise
    try:
        yield ctx
    except BaseException as exc:
        explain_timeout(exc, ctx.rank)  # names the rank and the group a collective timed out in
        record_error(ctx.rank, exc)
        print(f"[rank {ctx.rank}] failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise
    else:
        # Mark this rank's work done *before* the barrier, so every mark is on disk before any rank
        # can exit; then no rank tears its group down while another still talks to it. (The
        # launcher uses the marks: see FINISHED in helpers/launch/torchrun.py.)
        ctx.report(**{FINISHED: True})
        ctx.barrier()
        _record_later_errors(ctx.rank)
    finally:
        teardown()


def _record_later_errors(rank: int) -> None:
    """An exception raised after the block (every rank finished) is still this rank's failure:
    record it too, so the launcher does not mistake it for gloo's crash at exit."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        record_error(rank, exc)
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def error_line(exc: BaseException) -> str:
    """The exception's first line, without gloo's source path prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[/") and "] " in text:  # "[/__w/.../unbound_buffer.cc:78] Timed out ..."
        text = text.split("] ", 1)[1]
    return f"{type(exc).__name__}: {text}"
