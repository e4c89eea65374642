"""What a rank sends, seen where torch dispatches it: every collective and point-to-point call, by
mesh dimension or named group, with bytes. The course's one traffic instrument.

    with TrafficMeter(mesh) as meter:          # mesh: optional, names the groups by its dimensions
        step()
    meter.calls["tp"]["all_gather"], meter.bytes["dp"]["reduce_scatter"], meter.sent["pp"]
    meter.records                              # one `Call` per call, in the order issued
    meter.summary()                            # {dim: {"calls": {...}, "bytes": {...}, "sent_bytes": x}}

How it sees them. Every route into torch.distributed ends in an operator of torch's dispatcher:
`dist.all_reduce`, FSDP2's gathers, the pipeline's messages and DDP's C++ reducer in `c10d::*`
(`c10d::allreduce_`, `c10d::send`...), DTensor's redistributions, `loss_parallel`, a norm over a
`Shard(0)` DTensor and other functional collectives in `_c10d_functional::*`. The meter is a
`TorchDispatchMode`, so it sees each of them once, as it is issued. A mode runs before a tensor
subclass: for an operator on DTensors it returns `NotImplemented`, so DTensor's own dispatch runs
first and the collectives it issues inside come back through the mode (torch's `CommDebugMode`,
torch/distributed/tensor/debug/_comm_mode.py, does the same). A mode that handled DTensor's
operators itself would never see them: DTensor runs with the mode switched off, and such a counter
records nothing for the three probes tests/test_traffic.py keeps (`get_total_norm` over a
`Shard(0)` DTensor, `loss_parallel` cross-entropy, `Shard(0) @ Shard(0)`).

What it sees, measured in tests/test_traffic.py on 2 to 8 gloo ranks (torch 2.13, CPU):
- explicit calls (all_reduce, all_gather[_into_tensor], reduce_scatter_tensor, broadcast, reduce,
  gather, scatter, all_to_all_single, barrier, monitored_barrier, the *_object collectives as the
  tensor collectives they are made of), send/recv/isend/irecv/batch_isend_irecv (recv from any
  source too), on any group;
- DTensor's collectives (implicit redistributions, loss_parallel, norms, full_tensor), FSDP2's
  all-gathers and reduce-scatters, the pipeline's send/recv, clipping's and the optimizer's;
- DDP's C++ reducer: its bucket all-reduces (and the broadcast of the bucket order after the
  first step) go through the dispatcher from autograd's hooks, on the thread that runs backward,
  and are seen (on CPU; on a GPU, autograd runs backward on a thread of its own, which carries the
  calling thread's dispatch modes; not measured here, no GPU).
What it does not see: calls made on another Python thread (a mode belongs to the thread that
entered it), calls on fake or meta tensors (nothing is sent; not recorded), and what a backend does
inside a call (gloo carries out a reduce-scatter as an all-reduce of the whole input, monitored
barriers as messages): a `Call` is what the rank asked for.

Against torch's own, on the same runs (tests/test_traffic.py): the counts per collective kind equal
`CommDebugMode`'s, and in order, group by group, the flight recorder's entries, with two
differences that are the tools', not the meter's: CommDebugMode counts neither point-to-point
messages nor barriers; gloo's flight recorder records no point-to-point message and no monitored
barrier, and names a reduce-scatter "all_reduce" (what gloo runs). Checked on gloo only: nccl's
flight recorder names and records its entries its own way, and `compare` says it did not check them.

Dimension names: `names` first ({"name": group or ranks}); then the mesh's dimensions (and the
dimensions flattened from it), told by their ranks, not by the group object (DTensor caches what
it worked out by the mesh's layout, and may use an earlier mesh's group of the same ranks); then
"world" for the default group; then the group's description (`group_desc`: what
`helpers.dist.new_group(name=...)` gives; a mesh's groups are "mesh_<dim>", named <dim>); else the
group's ranks ("ranks 0,2").

Sizes follow nccl-tests (and helpers.comm_count): an all-gather's is its output, a
reduce-scatter's its input, an all-reduce's or broadcast's the tensor, a message's its tensor.
`sent` is what a bandwidth-optimal ring would send from this rank (`RING_SHARE`), the input where
no ring share is defined (gather, scatter, all-to-all, reduce), a message's bytes for a send and
nothing for a receive or a barrier.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# Bytes each rank sends, per byte of the collective's size, with ring (or pipelined) algorithms.
RING_SHARE: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,   # a reduce-scatter, then an all-gather
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
}
P2P_KINDS = ("send", "recv")
NOTHING_SENT = ("recv", "barrier")


def ring_bytes_sent(kind: str, size_bytes: float, world_size: int) -> float:
    """Bytes each of `world_size` ranks sends for one ring collective of `size_bytes`."""
    return RING_SHARE[kind](world_size) * size_bytes


# Operator -> (kind, the argument holding its size, the argument holding this rank's input,
# the argument naming the peer). A "*" after the size argument: times the group's size (a
# functional all-gather is given its input).
_C10D = {
    "allreduce_": ("all_reduce", "tensors", "tensors", None),
    "allreduce_coalesced_": ("all_reduce", "tensors", "tensors", None),
    "broadcast_": ("broadcast", "tensors", "tensors", None),
    "reduce_": ("reduce", "tensors", "tensors", None),
    "allgather_": ("all_gather", "output_tensors", "input_tensors", None),
    "_allgather_base_": ("all_gather", "output_tensor", "input_tensor", None),
    "allgather_coalesced_": ("all_gather", "output_lists", "input_list", None),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs", "inputs", None),
    "reduce_scatter_": ("reduce_scatter", "input_tensors", "input_tensors", None),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor", "input_tensor", None),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs", "inputs", None),
    "gather_": ("gather", "input_tensors", "input_tensors", None),
    "scatter_": ("scatter", "input_tensors", "input_tensors", None),
    "alltoall_": ("all_to_all", "input_tensors", "input_tensors", None),
    "alltoall_base_": ("all_to_all", "input", "input", None),
    "barrier": ("barrier", None, None, None),
    "monitored_barrier_": ("barrier", None, None, None),
    "send": ("send", "tensors", "tensors", "dst"),
    "recv_": ("recv", "tensors", "tensors", "src"),
    "recv_any_source_": ("recv", "tensors", "tensors", None),
}
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", "input", "input", None),
    "all_reduce_": ("all_reduce", "input", "input", None),
    "all_reduce_coalesced": ("all_reduce", "inputs", "inputs", None),
    "all_reduce_coalesced_": ("all_reduce", "inputs", "inputs", None),
    "all_gather_into_tensor": ("all_gather", "input*", "input", None),
    "all_gather_into_tensor_out": ("all_gather", "input*", "input", None),
    "all_gather_into_tensor_coalesced": ("all_gather", "inputs*", "inputs", None),
    "reduce_scatter_tensor": ("reduce_scatter", "input", "input", None),
    "reduce_scatter_tensor_out": ("reduce_scatter", "input", "input", None),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs", "inputs", None),
    "all_to_all_single": ("all_to_all", "input", "input", None),
    "shard_dim_alltoall": ("all_to_all", "input", "input", None),
    "broadcast": ("broadcast", "input", "input", None),
    "broadcast_": ("broadcast", "input", "input", None),
    "isend": ("send", "tensor", "tensor", "dst"),
    "irecv": ("recv", "tensor", "tensor", "src"),
}
# the legacy functional collectives name their group by its ranks (c10d_functional::*)
_LEGACY = {"all_reduce": ("all_reduce", "self", "self", None),
           "all_reduce_coalesced": ("all_reduce", "self", "self", None),
           "all_gather_into_tensor": ("all_gather", "shard*", "shard", None),
           "all_gather_into_tensor_coalesced": ("all_gather", "input*", "input", None),
           "reduce_scatter_tensor": ("reduce_scatter", "input", "input", None),
           "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs", "inputs", None),
           "all_to_all_single": ("all_to_all", "input", "input", None),
           "broadcast": ("broadcast", "self", "self", None)}
OPERATORS: dict[str, dict[str, tuple]] = {
    "c10d": _C10D, "_c10d_functional": _FUNCTIONAL, "_c10d_functional_autograd": _FUNCTIONAL,
    "_dtensor": _FUNCTIONAL, "c10d_functional": _LEGACY}


@dataclass(frozen=True)
class Call:
    """One collective or point-to-point call this rank issued."""
    op: str               # the operator, e.g. "c10d.allreduce_", "_c10d_functional.all_gather_into_tensor"
    kind: str             # all_reduce, all_gather, reduce_scatter, broadcast, reduce, gather,
    #                       scatter, all_to_all, barrier, send, recv
    dim: str              # the mesh dimension or group name (see the module docstring)
    group: str            # torch's name of the process group (the flight recorder's), "" if none
    group_size: int
    group_rank: int       # this rank in that group
    nbytes: int           # the call's size (nccl-tests' convention)
    input_bytes: int      # this rank's input tensors
    peer: int | None = None         # a message's other end, as a rank of the group (None: any)
    global_peer: int | None = None  # the same rank in the default group

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank sends (the module docstring's convention)."""
        if self.kind in RING_SHARE:
            return ring_bytes_sent(self.kind, self.nbytes, self.group_size)
        return 0.0 if self.kind in NOTHING_SENT else float(self.input_bytes)

    @property
    def functional(self) -> bool:
        """Issued as a functional collective (DTensor, loss_parallel, funcol), not a c10d call."""
        return not self.op.startswith("c10d.")

    @property
    def method(self) -> str:
        """The ProcessGroup method a c10d call comes from ("allreduce", "_allgather_base"...);
        a functional collective's operator name."""
        name = self.op.split(".", 1)[1]
        return name.rstrip("_") if not self.functional else name

    def as_dict(self) -> dict:
        return {**asdict(self), "sent_bytes": self.sent_bytes}


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in `obj` (a tensor or nested lists/tuples of them); a DTensor counts
    its local shard."""
    if isinstance(obj, torch.Tensor):
        return (obj.to_local() if hasattr(obj, "to_local") else obj).nbytes
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o) for o in obj)
    return 0


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)


def _unreal(obj: Any) -> bool:
    """Fake or meta tensors (shape inference, tracing): nothing is sent."""
    from torch._subclasses.fake_tensor import is_fake

    return any(t.is_meta or is_fake(t) for t in _tensors(obj))


class _Group(NamedTuple):
    pg: Any            # the ProcessGroup, None for the legacy functional collectives
    name: str          # torch's name for it (the flight recorder's)
    size: int
    rank: int          # this rank in it
    dim: str           # what the meter calls it


def group_ranks(group) -> tuple[int, ...]:
    return tuple(sorted(dist.get_process_group_ranks(group)))


class TrafficMeter(TorchDispatchMode):
    """While active, every collective and point-to-point call this thread issues (see the module
    docstring), by dimension: `calls[dim][kind]`, `bytes[dim][kind]` (sizes), `sent[dim]` (ring
    bytes), `records` (one `Call` each, in order). `mesh` names groups by its dimensions; `names`
    ({"name": process group or list of ranks}) names others. `on_call(call)` runs before each call
    is issued (it may raise to forbid it: helpers.comm_count.count_p2p does). Meters nest: each
    sees every call."""

    def __init__(self, mesh=None, names: Mapping[str, Any] | None = None,
                 on_call: Callable[[Call], None] | None = None):
        super().__init__()
        self.supports_higher_order_operators = True
        self.on_call = on_call
        self._by_ranks: dict[tuple[int, ...], str] = {}
        for name, group in (names or {}).items():
            ranks = tuple(sorted(group)) if isinstance(group, (list, tuple, range)) else group_ranks(group)
            self._by_ranks[ranks] = name
        if mesh is not None:
            for ranks, dim in mesh_dimensions(mesh).items():
                self._by_ranks.setdefault(ranks, dim)
        self._dims: dict[str, str] = {}           # group name -> dimension, as met
        self.counting = True
        self.reset()

    def reset(self) -> None:
        self.records: list[Call] = []
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.bytes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.sent: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing in the block (the calls still run)."""
        before, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = before

    # ------------------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented                 # DTensor's dispatch first; its collectives come back here
        table = OPERATORS.get(func.namespace)
        name = func._schema.name.split("::")[-1]
        calls: list[Call] = []
        if self.counting and table is not None and (name in table or name == "batch_p2p_ops"):
            calls = self._calls(func, name, table, args, kwargs)
            for call in calls:
                if self.on_call is not None:
                    self.on_call(call)
                self._add(call)
        return self.issue(func, args, kwargs, calls)

    def issue(self, func, args, kwargs, calls: list[Call]):
        """Run the operator; `calls` are the calls it makes (none for most operators). A subclass
        may wrap it (labs/lab12_trace.py labels each call for the profiler)."""
        return func(*args, **kwargs)

    def _add(self, call: Call) -> None:
        self.records.append(call)
        self.calls[call.dim][call.kind] += 1
        self.bytes[call.dim][call.kind] += call.nbytes
        self.sent[call.dim] += call.sent_bytes

    def _calls(self, func, name: str, table: dict, args, kwargs) -> list[Call]:
        schema = func._schema.arguments
        given = {a.name: v for a, v in zip(schema, args)}
        given.update(kwargs)
        op = f"{func.namespace}.{name}"
        if _unreal([v for v in given.values() if isinstance(v, (torch.Tensor, list, tuple))]):
            return []
        group = self._group(given)
        if name == "batch_p2p_ops":               # (op_list, peer_list, tag_list, tensors, group_name)
            return [self._call(op, "send" if "send" in what else "recv", group, t.nbytes, t.nbytes, peer)
                    for what, peer, t in zip(given["op_list"], given["peer_list"], given["tensors"])]
        kind, size_arg, input_arg, peer_arg = table[name]
        size = 0
        if size_arg is not None:
            size = tensor_bytes(given[size_arg.rstrip("*")])
            if size_arg.endswith("*"):
                size *= given.get("group_size") or group.size
        inputs = tensor_bytes(given[input_arg]) if input_arg is not None else 0
        peer = given.get(peer_arg) if peer_arg else None
        return [self._call(op, kind, group, size, inputs, peer)]

    def _call(self, op: str, kind: str, group: "_Group", size: int, inputs: int, peer) -> Call:
        global_peer = None
        if peer is not None and group.pg is not None:
            try:
                global_peer = dist.get_global_rank(group.pg, peer)
            except (RuntimeError, ValueError):
                pass
        return Call(op, kind, group.dim, group.name, group.size, group.rank, int(size), int(inputs),
                    peer, global_peer)

    # -------------------------------------------------------------------------- groups, named
    def _group(self, given: dict) -> "_Group":
        pg = None
        if "process_group" in given:
            pg = dist.ProcessGroup.unbox(given["process_group"])
        elif "group_name" in given:
            from torch.distributed.distributed_c10d import _resolve_process_group

            pg = _resolve_process_group(given["group_name"])
        elif "ranks" in given:                    # the legacy functional collectives
            ranks, me = tuple(sorted(given["ranks"])), dist.get_rank()
            return _Group(None, "", len(ranks), ranks.index(me) if me in ranks else -1, self._name(ranks, None))
        if pg is None:
            return _Group(None, "", 1, 0, "other")
        if pg.group_name not in self._dims:
            self._dims[pg.group_name] = self._name(group_ranks(pg), pg)
        return _Group(pg, pg.group_name, pg.size(), pg.rank(), self._dims[pg.group_name])

    def _name(self, ranks: tuple[int, ...], pg) -> str:
        if ranks in self._by_ranks:
            return self._by_ranks[ranks]
        if pg is not None and pg == dist.group.WORLD:
            return "world"
        desc = getattr(pg, "group_desc", "") if pg is not None else ""
        if desc and desc not in ("undefined", "default_pg", "mesh_default"):
            return desc[len("mesh_"):] if desc.startswith("mesh_") else desc
        if ranks == tuple(range(dist.get_world_size())):
            return "world"
        return "ranks " + ",".join(map(str, ranks))

    # -------------------------------------------------------------------------------- reading
    def summary(self) -> dict:
        """{dim: {"calls": {kind: n}, "bytes": {kind: size}, "sent_bytes": ring bytes}}, plain
        dicts, dimensions and kinds in the order first met."""
        return {dim: {"calls": dict(self.calls[dim]), "bytes": dict(self.bytes[dim]),
                      "sent_bytes": self.sent[dim]} for dim in self.calls}

    def counts(self, *, functional: bool | None = None) -> dict[str, int]:
        """Calls per kind over every dimension (only the functional ones, or only the others)."""
        out: dict[str, int] = {}
        for c in self.records:
            if functional is None or c.functional == functional:
                out[c.kind] = out.get(c.kind, 0) + 1
        return out


def mesh_dimensions(mesh) -> dict[tuple[int, ...], str]:
    """{ranks of this rank's group: dimension name} for each dimension of `mesh` and each
    dimension flattened from its root mesh (among dimensions of the same ranks, size-1 ones,
    the first name wins)."""
    out: dict[tuple[int, ...], str] = {}
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    for i, dim in enumerate(names):
        out.setdefault(group_ranks(mesh.get_group(i)), dim)
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    for dim, flat in getattr(root, "_flatten_mapping", {}).items():
        out.setdefault(group_ranks(flat.get_group()), dim)
    return out


def by_kind(records: Sequence[Call]) -> dict[str, int]:
    """Calls per kind in `records`."""
    out: dict[str, int] = {}
    for c in records:
        out[c.kind] = out.get(c.kind, 0) + 1
    return out


# ============================================================== against torch's own, same calls
# CommDebugMode's keys (operator packets) -> kinds. It counts collectives only: no messages, no
# barriers.
COMM_DEBUG_KINDS = {
    "all_reduce": "all_reduce", "allreduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "allreduce_coalesced_": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "_allgather_base_": "all_gather",
    "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast": "broadcast", "broadcast_": "broadcast", "reduce_": "reduce", "gather_": "gather",
    "scatter_": "scatter", "all_to_all_single": "all_to_all", "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all", "shard_dim_alltoall": "all_to_all"}
# What gloo's flight recorder calls each kind: gloo runs a reduce-scatter as an all-reduce of the
# whole input (its entry's output size is the input's), and it records no point-to-point message
# and no monitored barrier (measured, torch 2.13).
GLOO_RECORDED_AS = {"reduce_scatter": "all_reduce"}
GLOO_UNRECORDED = ("send", "recv")


def _flight_entries() -> list[dict]:
    import pickle

    return pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False, False)).get("entries", [])


class _NoModules:
    """Stands in for CommDebugMode's module tracker, which counting does not need: torch 2.13's
    registers a forward hook each time a module runs and keeps only the last handle, so a module
    run twice in the block (a pipeline's micro-batches) leaves a hook behind that breaks the next
    forward with an IndexError (pytorch/pytorch#191392, fixed after 2.13 by #191452)."""
    name, is_bw, activation_checkpointing = "Global", False, False

    def __init__(self):
        self.module_parents_dict = {"Global": set()}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class MeterCheck:
    """A TrafficMeter with torch's two counters on the same calls: `CommDebugMode` (its counts
    per operator) and the flight recorder (the entries it added meanwhile, every group).

        with MeterCheck(mesh) as check:
            step()
        check.meter.summary(); check.comm_debug; check.flight; check.differences()  # [] when they agree
    """

    def __init__(self, mesh=None, names: Mapping[str, Any] | None = None):
        from torch.distributed.tensor.debug import CommDebugMode

        self.meter = TrafficMeter(mesh, names)
        self._comm_mode = CommDebugMode()
        self._comm_mode.advanced_module_tracker = _NoModules()
        self.comm_debug: dict[str, int] = {}
        self.flight: list[tuple[str, str]] = []     # (group name, "backend:op") in order
        self._mark = -1

    def __enter__(self) -> "MeterCheck":
        from helpers.flight_recorder import flight_recorder_size

        if flight_recorder_size() <= 0:
            raise RuntimeError("the flight recorder is off (TORCH_FR_BUFFER_SIZE=0): nothing to check against")
        entries = _flight_entries()
        self._mark = entries[-1]["record_id"] if entries else -1
        self._comm_mode.__enter__()
        self.meter.__enter__()
        return self

    def __exit__(self, *exc):
        self.meter.__exit__(*exc)
        self._comm_mode.__exit__(*exc)
        self.comm_debug = {}
        for op, n in self._comm_mode.get_comm_counts().items():
            kind = COMM_DEBUG_KINDS.get(str(op).split(".")[-1], str(op))
            self.comm_debug[kind] = self.comm_debug.get(kind, 0) + n
        new = [e for e in _flight_entries() if e["record_id"] > self._mark]
        self.overflowed = bool(new) and new[0]["record_id"] != self._mark + 1
        self.flight = [(e["process_group"][0], e["profiling_name"]) for e in new]
        return None

    def differences(self) -> list[str]:
        """What the meter saw that torch's counters did not, or the reverse (see `compare`)."""
        out = compare(self.meter.records, self.comm_debug, self.flight)
        return out + (["the flight recorder's buffer overflowed in the block"] if self.overflowed else [])


def compare(records: Sequence[Call], comm_debug: Mapping[str, int],
            flight: Sequence[tuple[str, str]]) -> list[str]:
    """The meter's `records` against CommDebugMode's counts per kind and the flight recorder's
    entries ((group name, "backend:op"), in order), allowing for what each tool leaves out (module
    docstring). Returns one line per disagreement; [] when they agree. Flight-recorder entries of a
    backend other than gloo are not compared (checked on gloo only) and say so."""
    out = []
    collectives = [c for c in records if c.kind not in P2P_KINDS]
    mine = by_kind([c for c in collectives if c.kind != "barrier"])
    if dict(sorted(mine.items())) != dict(sorted(comm_debug.items())):
        out.append(f"CommDebugMode counted {dict(sorted(comm_debug.items()))}, the meter "
                   f"{dict(sorted(mine.items()))}")
    expected: dict[str, list[str]] = {}
    for c in collectives:
        if c.op != "c10d.monitored_barrier_":
            expected.setdefault(c.group, []).append(GLOO_RECORDED_AS.get(c.kind, c.kind))
    recorded: dict[str, list[str]] = {}
    other = sorted({op.split(":")[0] for _, op in flight if not op.startswith("gloo:")})
    for group, op in flight:
        if op.startswith("gloo:"):
            recorded.setdefault(group, []).append(op.split(":", 1)[1])
    if other:
        out.append(f"flight-recorder entries of {', '.join(other)} not compared (checked on gloo only)")
        return out
    for group in sorted(set(expected) | set(recorded)):
        want, got = expected.get(group, []), recorded.get(group, [])
        if want != got:
            i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            out.append(f"group {group}: the flight recorder has {len(got)} entries, the meter {len(want)} "
                       f"calls; first difference at call {i}: recorder {got[i] if i < len(got) else None}, "
                       f"meter {want[i] if i < len(want) else None}")
    return out
