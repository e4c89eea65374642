"""The course's traffic instrument (helpers/traffic.py's TrafficMeter) against torch's own, on the
same calls: CommDebugMode's counts per collective and the flight recorder's entries, in order,
group by group (`MeterCheck.differences()` is [] when all three agree; where the tools
legitimately differ, `helpers.traffic.compare` says why, and a test below feeds it each case).

In one 4-rank launch (smoke sizes):
- the three probes a mode that handles DTensor's operators itself records as nothing (the
  instrument lab 12 had): a norm over a Shard(0) DTensor, `loss_parallel` cross-entropy, an implicit
  redistribution in Shard(0) @ Shard(0); the meter sees each, on the right dimension, with bytes;
- every explicit call (collectives, object collectives, messages, barriers) on the world, a named
  group and an unnamed one, and DDP's C++ reducer; lab 03's CountingComm agrees with the meter;
- notebook 05's layers (the course's own, whose CommLog agrees with the meter, and DTensor's);
- notebook 09's dp x tp mesh step (the course's sequence-parallel layers under DDP, DTensor's
  SequenceParallel block);
- notebook 12's composed step on a (1, 2, 2) and a (2, 1, 2) mesh: FSDP2, tensor and sequence
  parallelism, loss parallel, clipping, and the pipeline's messages.

Run:  .venv/bin/python -m pytest tests/test_traffic.py -q
"""
from __future__ import annotations

import sys

import pytest
import torch

from helpers.notice import solved
from helpers.traffic import Call, compare, ring_bytes_sent
from tests.harness import launch_ranks

NPROC = 4
F32 = 4


# ============================================================================ in this process
def call(kind, group="0", op="c10d.allreduce_", nbytes=16, size=2, dim="world"):
    return Call(op, kind, dim, group, size, 0, nbytes, nbytes)


def test_compare_allows_for_what_each_tool_leaves_out():
    """Messages and barriers: CommDebugMode counts neither; gloo's flight recorder records no message
    and no monitored barrier, and names a reduce-scatter all_reduce."""
    records = [call("all_reduce"), call("send", op="c10d.send"), call("recv", op="c10d.recv_"),
               call("reduce_scatter", op="_c10d_functional.reduce_scatter_tensor", group="3", dim="tp"),
               call("barrier", op="c10d.barrier"), call("barrier", op="c10d.monitored_barrier_")]
    comm_debug = {"all_reduce": 1, "reduce_scatter": 1}
    flight = [("0", "gloo:all_reduce"), ("3", "gloo:all_reduce"), ("0", "gloo:barrier")]
    assert compare(records, comm_debug, flight) == []


def test_compare_flags_a_missed_call_and_a_wrong_order():
    records = [call("all_reduce"), call("all_gather", op="c10d._allgather_base_")]
    missed = compare(records[:1], {"all_reduce": 1, "all_gather": 1},
                     [("0", "gloo:all_reduce"), ("0", "gloo:all_gather")])
    assert len(missed) == 2 and "CommDebugMode counted" in missed[0] and "group 0" in missed[1], missed
    swapped = compare(records, {"all_reduce": 1, "all_gather": 1}, [("0", "gloo:all_gather"), ("0", "gloo:all_reduce")])
    assert swapped == ["group 0: the flight recorder has 2 entries, the meter 2 calls; first difference at call 0: "
                       "recorder all_gather, meter all_reduce"]
    other = compare(records, {"all_reduce": 1, "all_gather": 1}, [("0", "nccl:all_reduce")])
    assert other == ["flight-recorder entries of nccl not compared (checked on gloo only)"]


def test_call_bytes_follow_the_ring_convention():
    assert Call("c10d.allreduce_", "all_reduce", "tp", "1", 4, 0, 1000, 1000).sent_bytes == ring_bytes_sent("all_reduce", 1000, 4) == 1500
    assert Call("c10d._allgather_base_", "all_gather", "tp", "1", 4, 0, 1000, 250).sent_bytes == 750
    assert Call("c10d.send", "send", "pp", "2", 2, 0, 64, 64, 1, 3).sent_bytes == 64
    assert Call("c10d.recv_", "recv", "pp", "2", 2, 1, 64, 64, 0, 1).sent_bytes == 0
    assert Call("c10d.alltoall_base_", "all_to_all", "ep", "2", 4, 0, 64, 64).sent_bytes == 64
    c = Call("_c10d_functional.all_reduce", "all_reduce", "tp", "1", 2, 0, 8, 8)
    assert c.functional and c.method == "all_reduce"
    assert Call("c10d.allreduce_", "all_reduce", "w", "0", 2, 0, 8, 8).method == "allreduce"


# ======================================================================= the launch (4 ranks)
@pytest.fixture(scope="module")
def run():
    # gloo on the CPU even where there are GPUs: the flight recorder's names and what it leaves
    # out are gloo's (helpers/traffic.py's compare; nccl's are not checked here)
    return launch_ranks(__file__, "worker", nproc=NPROC, timeout=300, env={"COURSE_DEVICE": "cpu"})


def check(report: dict, rank: int, case: str) -> None:
    assert report["differences"] == [], f"rank {rank}, {case}: the meter and torch's own disagree: {report['differences']}"


def test_probes_are_seen_where_a_plain_mode_sees_nothing(run):
    """get_total_norm over Shard(0), loss_parallel's cross-entropy, Shard(0) @ Shard(0): one all-reduce,
    three all-reduces and one all-gather on tp, with their bytes; the counter lab 12 had records {}."""
    for rank, rep in run.items():
        p = rep["probes"]
        for name, expected in {"norm": {"all_reduce": 1}, "loss_parallel": {"all_reduce": 3},
                               "matmul": {"all_gather": 1}}.items():
            case = p[name]
            check(case, rank, name)
            assert case["summary"] == {"tp": {"calls": expected, "bytes": case["expected_bytes"],
                                              "sent_bytes": case["expected_sent"]}}, (rank, name, case["summary"])
            assert case["plain_mode"] == {}, f"rank {rank}, {name}: a mode without NotImplemented saw {case['plain_mode']}"
            assert case["all_functional"], (rank, name)
        assert p["norm"]["value_error"] < 1e-6 and p["matmul"]["value_error"] < 1e-5


def test_every_explicit_call_with_its_group_size_and_peer(run):
    """Each torch.distributed call once, on the world, a named group ("evens"/"odds") and an unnamed one."""
    for rank, rep in run.items():
        e = rep["explicit"]
        check(e, rank, "explicit calls")
        assert e["records"] == e["expected"], f"rank {rank}:\n{e['records']}\n!=\n{e['expected']}"


def test_ddp_reducer_is_seen_and_counting_comm_agrees(run):
    """DDP's C++ reducer's bucket all-reduces reach the meter; lab 03's CountingComm (a comm hook)
    counts the same calls and bytes as the meter sees."""
    for rank, rep in run.items():
        d = rep["ddp"]
        check(d["plain"], rank, "DDP")
        check(d["hooked"], rank, "DDP with CountingComm")
        assert d["plain"]["counts"]["all_reduce"] >= 2, d["plain"]["counts"]   # one bucket a step, 2 steps
        assert d["comm"] == d["hooked"]["all_reduces"], f"rank {rank}: CountingComm {d['comm']} vs meter {d['hooked']}"


def test_notebook05_layers(run):
    """The course's Megatron and all-gather MLPs (CommLog agrees with the meter, call by call) and DTensor's."""
    for rank, rep in run.items():
        n = rep["lab05"]
        for scheme in ("megatron", "allgather"):
            s = solved(n[scheme])
            check(s, rank, scheme)
            assert s["commlog"] == s["meter"], f"rank {rank}, {scheme}: CommLog {s['commlog']} vs the meter {s['meter']}"
        d = n["dtensor"]
        check(d, rank, "DTensor MLP")
        assert d["counts"] == {"all_reduce": 2} and d["all_functional"], d


def test_notebook09_mesh_step(run):
    """dp2 x tp2 with sequence parallelism (the course's layers, DDP over dp) and DTensor's SequenceParallel block."""
    for rank, rep in run.items():
        n = rep["lab09"]
        ours = solved(n["dp2 x tp2 + sp"])
        check(ours, rank, "dp2 x tp2 + sp")
        assert set(ours["summary"]) == {"dp", "tp"}, ours["summary"]
        assert ours["summary"]["dp"]["calls"] == {"all_reduce": 1}     # DDP's one bucket (the reducer)
        d = n["dtensor"]
        check(d, rank, "DTensor SequenceParallel")
        assert set(d["summary"]) == {"tp"} and d["counts"]["all_gather"] > 0 and d["counts"]["reduce_scatter"] > 0


def test_notebook12_composed_step(run):
    """The composed step: the meter equals CommDebugMode and the flight recorder; it sees the loss's and
    the clip's all-reduces that lab 12's old counter missed, and the pipeline's messages."""
    for rank, rep in run.items():
        for shape, r in rep["lab12"].items():
            r = solved(r)
            check(r, rank, f"lab 12 on {shape}")
            s = r["summary"]
            if shape == "(1, 2, 2)":
                assert s["dp"]["calls"]["reduce_scatter"] > 0 and s["dp"]["calls"]["all_reduce"] == 1, s   # the clip's dp part
                assert s["tp"]["calls"]["all_reduce"] > r["plain_mode"]["tp"]["all_reduce"], (s, r["plain_mode"])
            else:
                assert s["pp"]["calls"]["send"] == s["pp"]["calls"]["recv"] > 0, s
                assert s["pp"]["calls"]["all_reduce"] >= 1, s      # the clip's sum over the stages


# ---------------------------------------------------------------------------------------- worker
def checked(report_of, fn, mesh=None, names=None) -> dict:
    from helpers.traffic import MeterCheck

    with MeterCheck(mesh, names) as c:
        out = fn()
    return {"differences": c.differences(), "summary": c.meter.summary(), "counts": c.meter.counts(),
            "all_functional": all(x.functional for x in c.meter.records), **(report_of(c, out) if report_of else {})}


def plain_mode_counts(fn, mesh) -> dict:
    """What a mode that handles DTensor's operators itself (no NotImplemented: lab 12's old
    MeshTraffic) records: {dimension: {kind: calls}}."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from helpers.traffic import OPERATORS, mesh_dimensions

    dims = mesh_dimensions(mesh)

    class Plain(TorchDispatchMode):
        seen: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import torch.distributed as dist

            name = func._schema.name.split("::")[-1]
            table = OPERATORS.get(func.namespace, {})
            if name in table and func.namespace in ("c10d", "_c10d_functional"):
                given = {a.name: v for a, v in zip(func._schema.arguments, args)}
                pg = dist.ProcessGroup.unbox(given["process_group"]) if "process_group" in given else \
                    dist.distributed_c10d._resolve_process_group(given["group_name"])
                dim = dims.get(tuple(sorted(dist.get_process_group_ranks(pg))), "other")
                self.seen.setdefault(dim, {}).setdefault(table[name][0], 0)
                self.seen[dim][table[name][0]] += 1
            return func(*args, **(kwargs or {}))

    mode = Plain()
    mode.seen = {}
    with mode:
        fn()
    return mode.seen


def probes(ctx) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.nn.utils import get_total_norm

    from helpers.dist import device_mesh

    mesh = device_mesh("cpu", dp=2, tp=2)
    tp = mesh["tp"]
    g = torch.Generator().manual_seed(0)
    w_full, a_full, b_full = torch.randn(8, 4, generator=g), torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    logits_full, target = torch.randn(6, 10, generator=g), torch.randint(0, 10, (6,), generator=g)
    w = distribute_tensor(w_full, tp, [Shard(0)])
    a, b = distribute_tensor(a_full, tp, [Shard(0)]), distribute_tensor(b_full, tp, [Shard(0)])
    logits = distribute_tensor(logits_full, tp, [Shard(1)])

    def ce():
        with loss_parallel():
            return torch.nn.functional.cross_entropy(logits, target)

    cases = {"norm": (lambda: get_total_norm([w]), {"all_reduce": F32}),
             "loss_parallel": (ce, {"all_reduce": 3 * 6 * F32}),
             "matmul": (lambda: a @ b, {"all_gather": 8 * 8 * F32})}
    out = {}
    for name, (fn, expected) in cases.items():
        kind, size = next(iter(expected.items()))
        ring = ring_bytes_sent(kind, size / (3 if name == "loss_parallel" else 1), 2) * (3 if name == "loss_parallel" else 1)
        holder = {}
        out[name] = checked(lambda c, v: {}, lambda: holder.setdefault("value", fn()), mesh)
        out[name].update(expected_bytes=expected, expected_sent=ring, plain_mode=plain_mode_counts(fn, mesh))
        value = holder["value"]
        if name == "norm":
            out[name]["value_error"] = abs(value.full_tensor().item() - w_full.norm().item())
        elif name == "matmul":
            out[name]["value_error"] = (value.full_tensor() - a_full @ b_full).abs().max().item()
    return out


def explicit(ctx) -> dict:
    import torch.distributed as dist

    from helpers.dist import new_group

    r, n = ctx.rank, ctx.world_size
    evens, odds = new_group([0, 2], name="evens"), new_group([1, 3], name="odds")
    unnamed = dist.new_group([0, 1])   # ranks 2 and 3 call it too, and use none of it
    mine, mine_name = (evens, "evens") if r % 2 == 0 else (odds, "odds")
    x = torch.full((4,), float(r))
    expected = []

    def expect(kind, dim, nbytes, peer=None):
        expected.append([kind, dim, nbytes, peer])

    def calls():
        dist.all_reduce(x); expect("all_reduce", "world", 16)                               # noqa: E702
        dist.all_gather_into_tensor(torch.empty(4 * n), x); expect("all_gather", "world", 16 * n)  # noqa: E702
        dist.all_gather([torch.empty(4) for _ in range(n)], x); expect("all_gather", "world", 16 * n)  # noqa: E702
        dist.reduce_scatter_tensor(torch.empty(1), x); expect("reduce_scatter", "world", 16)  # noqa: E702
        dist.broadcast(x, src=0); expect("broadcast", "world", 16)                           # noqa: E702
        dist.reduce(x, dst=0); expect("reduce", "world", 16)                                 # noqa: E702
        dist.gather(x, [torch.empty(4) for _ in range(n)] if r == 0 else None, dst=0)
        expect("gather", "world", 16)
        dist.scatter(torch.empty(4), [torch.ones(4)] * n if r == 0 else None, src=0)
        expect("scatter", "world", 16 * n if r == 0 else 0)
        dist.all_to_all_single(torch.empty(4), x); expect("all_to_all", "world", 16)         # noqa: E702
        dist.barrier(); expect("barrier", "world", 0)                                        # noqa: E702
        dist.all_gather_object([None] * n, {"rank": r})       # sizes first, then the pickles
        expect("all_gather", "world", 8 * n)
        expected.append(["all_gather", "world", "pickles", None])
        dist.all_reduce(x, group=mine); expect("all_reduce", mine_name, 16)                 # noqa: E702
        if r in (0, 1):
            dist.all_reduce(x, group=unnamed)
            expect("all_reduce", "ranks 0,1", 16)
        right, left = (r + 1) % n, (r - 1) % n
        ops = [dist.P2POp(dist.isend, x, right), dist.P2POp(dist.irecv, torch.empty(4), left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        expect("send", "world", 16, right)
        expect("recv", "world", 16, left)
        if r == 0:
            for _ in range(n - 1):
                dist.recv(torch.empty(2))                       # from any rank
                expect("recv", "world", 8)
        else:
            dist.send(torch.ones(2), dst=0)
            expect("send", "world", 8, 0)
        dist.monitored_barrier(); expect("barrier", "world", 0)                              # noqa: E702

    def report(c, _):
        records = [[x.kind, x.dim, x.nbytes, x.peer] for x in c.meter.records]
        pickles = [i for i, e in enumerate(expected) if e[2] == "pickles"]
        for i in pickles:                                       # the pickles' size: whatever pickle made
            expected[i][2] = records[i][2] if len(records) > i else None
        return {"records": records, "expected": expected}

    return checked(report, calls)


def ddp(ctx) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from helpers.comm_count import CountingComm
    from labs.lab03_ddp import count_ddp_comm, make_mlp

    out = {}
    for name in ("plain", "hooked"):
        model = DDP(make_mlp([8, 16, 4], seed=0))
        comm = CountingComm()
        if name == "hooked":
            count_ddp_comm(model, comm)

        def steps():
            for step in range(2):
                model(torch.randn(4, 8)).sum().backward()

        out[name] = checked(lambda c, _: {"all_reduces": [c.meter.calls["world"]["all_reduce"],
                                                          c.meter.bytes["world"]["all_reduce"]]}, steps)
        if name == "hooked":
            out["comm"] = [comm.collectives, comm.bytes]
    return out


def lab05(ctx) -> dict:
    from helpers.comm_count import CommLog
    from helpers.dist import device_mesh
    from helpers.notice import attempt
    from labs import lab05_tensor_parallel as tp_lab
    from labs.lab05_tp_dtensor import dtensor_mlp

    dense = tp_lab.dense_mlp(16, 64)
    x, _ = tp_lab.sample_batch(2, 4, 16, seed=1, dtype=torch.float32, device=ctx.device)
    out = {}
    for scheme, build in (("megatron", tp_lab.megatron_mlp), ("allgather", tp_lab.allgather_mlp)):
        log = CommLog()
        model = build(dense, None, log)

        def step(model=model, log=log):
            return tp_lab.step_collectives(model, log, x)

        def report(c, calls):
            return {"commlog": [[k.op, k.payload_bytes] for k in calls],
                    "meter": [[k.kind, k.nbytes] for k in c.meter.records]}

        out[scheme] = attempt(checked, report, step)        # the backward is notebook 05's homework
    mesh = device_mesh("cpu", tp=ctx.world_size)
    theirs = dtensor_mlp(dense, mesh)
    out["dtensor"] = checked(None, lambda: theirs(x.clone().requires_grad_(True)).square().mean().backward(), mesh)
    return out


def lab09(ctx) -> dict:
    from torch.distributed.tensor.parallel import parallelize_module

    from helpers.notice import attempt
    from labs import lab09_mesh as mesh_lab
    from labs.lab09_sequence_parallel import dense_stack, local_loss, sample, sequence_shard

    sizes = dict(layers=1, d_model=16, heads=4, seq=8, batch=4)
    x, target = sample(sizes["batch"], sizes["seq"], sizes["d_model"], seed=3)

    def ours():
        replica = mesh_lab.Replica(ctx, sizes, 2, 2, True)
        for _ in range(2):      # DDP's second step rebuilds its buckets and broadcasts their order
            replica.step(x, target)
        return checked(None, lambda: replica.step(x, target), replica.mesh)

    out = {"dp2 x tp2 + sp": attempt(ours)}                      # notebook 05's f/g backward
    mesh, _, tp_group = mesh_lab.make_mesh(ctx, 2, 2)
    block = parallelize_module(dense_stack(1, 16, 4)[0], mesh["tp"], mesh_lab.dtensor_plan())
    xs = sequence_shard(x[:2] if mesh.get_coordinate()[0] == 0 else x[2:], tp_group).requires_grad_(True)

    def step():
        y = block(xs)
        local_loss(y.to_local() if hasattr(y, "to_local") else y, torch.zeros_like(xs), 2 * 8).backward()

    out["dtensor"] = checked(None, step, mesh)
    return out


def lab12(ctx) -> dict:
    from helpers.notice import attempt
    from labs.lab12_model import LMConfig, batch_at, corpus, split
    from labs.lab12_train import Trainer

    config = LMConfig(dim=32, heads=4, layers=2, ffn=64, seq=16, batch=4)
    data = split(corpus(200_000))[0]
    x, y = batch_at(data, 0, config.batch, config.seq)

    def one(shape):
        trainer = Trainer(ctx, config, shape)
        trainer.step(x, y)                                       # the first step builds what it caches
        plain = plain_mode_counts(lambda: trainer.step(x, y), trainer.mesh)
        return {**checked(None, lambda: trainer.step(x, y), trainer.mesh), "plain_mode": plain}

    return {str(shape): attempt(one, shape) for shape in ((1, 2, 2), (2, 1, 2))}


def worker() -> None:
    from helpers.dist import distributed

    with distributed() as ctx:
        ctx.report(probes=probes(ctx), explicit=explicit(ctx), ddp=ddp(ctx), lab05=lab05(ctx), lab09=lab09(ctx),
                   lab12=lab12(ctx))


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker()
