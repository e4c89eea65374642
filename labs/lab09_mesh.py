"""Lab 09 (device mesh): data x tensor parallelism on a 2 x 2 mesh, with and without sequence
parallelism, checked against one process, timed and measured for the planner.

Run:  ./run.sh 09      (4 ranks: this lab declares LAB_NPROC = 4 below; alone:
                        NPROC=4 ./run.sh labs/lab09_mesh.py)

`init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))` lays the 4 ranks out as
a 2 x 2 grid: rank = dp_rank * tp + tp_rank. `mesh.get_group("tp")` is the process group of this
rank's row (the ranks that split each layer: {0, 1} and {2, 3}), `mesh.get_group("dp")` of its
column (the replicas that average gradients: {0, 2} and {1, 3}). The course's own layers use them
unchanged: notebook 05's column/row-parallel block (or this notebook's sequence-parallel one)
takes the tp group, `DistributedDataParallel(process_group=dp group)` the dp group.

For each configuration (4 data-parallel replicas; 2 x 2 with and without sequence parallelism;
4-way tensor parallelism with and without it) every rank trains a stack of Transformer blocks on
its rows (and sequence shard) of every global batch, and compares its parameters after the steps
with one process that trained the dense stack on the whole batch (SGD with momentum, fp32,
tolerance 1e-5). Then it times its steps (the slowest rank's, median of several rounds), and
records what it holds: parameters, gradients and optimizer state (each storage once) and the activations one
micro-batch keeps for its backward. The same run measures what the planner needs to predict those
steps (`measure_machine`, labs/lab09_machine.py: the FLOP/s of a rank's share of the step, the
all-reduce's alpha-beta fit, the fixed cost of a call inside a step), the configurations' steps
timed in the same alternating rounds, under the same load.
`lab_model`, `lab_config` and `lab_cluster` turn a run into the planner's inputs (labs/lab12_plan.py
does the same for lab 12's composed run). On the 2 x 2 mesh it also runs PyTorch's own sequence
parallelism (DTensor: `SequenceParallel`, `ColwiseParallel(input_layouts=
Shard(1))`, `RowwiseParallel(output_layouts=Shard(1))`) on the 1-D tp sub-mesh, against ours.

Tensor parallelism needs notebook 05's f/g backward passes (its homework): until they are
written, the configurations with tp > 1 report that they are not and the rest runs.
"""
from __future__ import annotations

import copy
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from helpers import pick
from helpers.accounting import held_bytes
from helpers.dist import DistContext, distributed
from helpers.notice import attempt
from helpers.show import table
from helpers.tensors import ddp_device_ids, divide
from labs.lab05_tensor_parallel import max_param_diffs
from labs.lab09_machine import LR, MOMENTUM, measure_machine
from labs.lab09_sequence_parallel import (activation_bytes, dense_stack, local_loss, parallel_stack, sample,
                                          sequence_parallel_block, sequence_shard, sync_replicated_grads)

LAB_NPROC = 4      # ./run.sh 09 launches this lab on 4 ranks (NPROC, when set, wins)
TOLERANCE = 1e-5   # max |parameter difference| after the steps, fp32, against one process
# name -> (dp, tp, sequence parallel): on 4 ranks, and what 2 ranks can run
CONFIGS = {"dp4": (4, 1, False), "dp2 x tp2": (2, 2, False), "dp2 x tp2 + sp": (2, 2, True),
           "tp4": (1, 4, False), "tp4 + sp": (1, 4, True),
           "dp2": (2, 1, False), "tp2": (1, 2, False), "tp2 + sp": (1, 2, True)}


def default_sizes() -> dict:
    """The stack and the batch (smoke mode: smaller), read when the run starts."""
    return dict(layers=2, d_model=pick(128, 32), heads=4, seq=pick(64, 16), batch=pick(8, 4),
                check_steps=pick(3, 2), timed_steps=pick(9, 5))


# ======================================================================= the mesh and its groups
def make_mesh(ctx: DistContext, dp: int, tp: int):
    """A (dp, tp) mesh over all ranks and this rank's groups along each dimension."""
    divide(ctx.world_size, dp * tp, "the ranks over the dp x tp mesh")
    mesh = init_device_mesh(ctx.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return mesh, mesh.get_group("dp"), mesh.get_group("tp")


def who_talks_to_whom(mesh) -> dict:
    """This rank's coordinate on the mesh and the global ranks of its dp and tp groups."""
    return {"coordinate": [int(c) for c in mesh.get_coordinate()],
            "dp group": dist.get_process_group_ranks(mesh.get_group("dp")),
            "tp group": dist.get_process_group_ranks(mesh.get_group("tp"))}


# ==================================================================== one configuration, trained
def reference_params(sizes: dict, batches: list, device) -> nn.Module:
    """One process: the dense stack trained on every whole global batch."""
    dense = dense_stack(sizes["layers"], sizes["d_model"], sizes["heads"], device=device)
    opt = torch.optim.SGD(dense.parameters(), lr=LR, momentum=MOMENTUM)
    for x, target in batches:
        opt.zero_grad()
        local_loss(dense(x), target, x.shape[0] * x.shape[1]).backward()
        opt.step()
    return dense


class Replica:
    """One rank's part of a configuration: its model (tp split, DDP over dp), optimizer and data."""

    def __init__(self, ctx: DistContext, sizes: dict, dp: int, tp: int, sp: bool):
        self.mesh, self.dp_group, self.tp_group = make_mesh(ctx, dp, tp)
        self.dp, self.tp, self.sp = dp, tp, sp
        dense = dense_stack(sizes["layers"], sizes["d_model"], sizes["heads"], device=ctx.device)
        self.module = parallel_stack(dense, "sp" if sp else "tp", self.tp_group) if tp > 1 else dense
        self.model = self.module if dp == 1 else nn.parallel.DistributedDataParallel(
            self.module, device_ids=ddp_device_ids(ctx.device), process_group=self.dp_group,
            gradient_as_bucket_view=True)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=LR, momentum=MOMENTUM)
        self.dp_rank = dist.get_rank(self.dp_group)

    def part(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch (its dp replica's), and with sp its sequence shard."""
        rows = divide(t.shape[0], self.dp, "the global batch over the data-parallel replicas")
        mine = t[self.dp_rank * rows:(self.dp_rank + 1) * rows]
        return sequence_shard(mine, self.tp_group) if self.sp else mine

    def step(self, x: torch.Tensor, target: torch.Tensor) -> None:
        self.opt.zero_grad()
        xs = self.part(x)
        tokens = divide(x.shape[0], self.dp, "rows") * x.shape[1]     # this replica's tokens
        local_loss(self.model(xs), self.part(target), tokens).backward()   # DDP averages over dp
        if self.sp:
            sync_replicated_grads(self.module, self.tp_group)
        self.opt.step()

    def held(self) -> dict[str, int]:
        params = list(self.module.parameters())
        return held_bytes({"parameters": params, "gradients": [p.grad for p in params],
                           "optimizer state": [v for s in self.opt.state.values() for v in s.values()
                                               if torch.is_tensor(v)]})


def run_config(ctx: DistContext, name: str, sizes: dict, batches: list, reference: nn.Module) -> tuple[dict, Replica]:
    """Train one configuration, compare it with the reference, measure its memory. Returns the
    results and the replica (`run` times its steps beside the others')."""
    dp, tp, sp = CONFIGS[name]
    replica = Replica(ctx, sizes, dp, tp, sp)
    for x, target in batches:
        replica.step(x, target)
    diff = max(max_param_diffs(replica.module, reference).values())
    x, target = batches[0]
    return ({"dp": dp, "tp": tp, "sp": sp, "max_param_diff": diff, "held": replica.held(),
             "activation_bytes": activation_bytes(replica.module, replica.part(x)),
             "groups": who_talks_to_whom(replica.mesh)}, replica)


# =================================================================== DTensor's sequence parallelism
def dtensor_plan():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {"ln1": SequenceParallel(), "attn.qkv": ColwiseParallel(input_layouts=Shard(1)),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)), "ln2": SequenceParallel(),
            "mlp.fc1": ColwiseParallel(input_layouts=Shard(1)),
            "mlp.fc2": RowwiseParallel(output_layouts=Shard(1))}


def local_grad(grad: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a gradient; a DTensor that is Partial (a sum not yet taken: what the
    layer norms' gradients are) is summed over its mesh first."""
    from torch.distributed.tensor import Partial, Replicate

    if not hasattr(grad, "to_local"):
        return grad
    if any(isinstance(pl, Partial) for pl in grad.placements):
        grad = grad.redistribute(grad.device_mesh, [Replicate()] * len(grad.placements))
    return grad.to_local()


def dtensor_cross_check(ctx: DistContext, sizes: dict, batches: list) -> dict:
    """Our sequence-parallel block and DTensor's, on the tp sub-mesh of the 2 x 2 mesh, each dp
    replica on its rows: outputs, input and weight gradients (first step), parameters after the
    steps (SGD). Returns max |difference| of each, and the gradients' placements."""
    from torch.distributed.tensor.parallel import parallelize_module

    mesh, _, tp_group = make_mesh(ctx, 2, 2)
    dense = dense_stack(1, sizes["d_model"], sizes["heads"], device=ctx.device)[0]
    ours = sequence_parallel_block(dense, tp_group)
    theirs = parallelize_module(copy.deepcopy(dense), mesh["tp"], dtensor_plan())
    rows = divide(batches[0][0].shape[0], 2, "the batch over 2 replicas")
    dp_rank = mesh.get_coordinate()[0]
    part = lambda t: sequence_shard(t[dp_rank * rows:(dp_rank + 1) * rows], tp_group)  # noqa: E731
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in (ours, theirs)]
    out: dict = {}
    for step, (x, target) in enumerate(batches):
        results = []
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            xi = part(x).requires_grad_(True)
            y = model(xi)
            local_loss(y.to_local() if hasattr(y, "to_local") else y, part(target), rows * x.shape[1]).backward()
            if model is ours:
                sync_replicated_grads(ours, tp_group)
            results.append((y.detach(), xi.grad, {n: local_grad(p.grad) for n, p in model.named_parameters()}))
            if model is theirs:
                out.setdefault("grad_placements", {n: [repr(pl) for pl in p.grad.placements]
                                                   for n, p in theirs.named_parameters()})
        if step == 0:
            (y0, g0, w0), (y1, g1, w1) = results
            out["output"] = (y0 - y1).abs().max().item()
            out["input_grad"] = (g0 - g1).abs().max().item()
            out["grads"] = max((w0[n] - w1[n]).abs().max().item() for n in w0)
        for opt in opts:
            opt.step()
    out["params"] = max((p.detach() - (q.to_local() if hasattr(q, "to_local") else q).detach()).abs().max().item()
                        for p, q in zip(ours.parameters(), theirs.parameters()))
    out["worst"] = max(out["output"], out["input_grad"], out["grads"], out["params"])
    return out


# ===================================================================== the planner's inputs
def lab_model(sizes: dict):
    """The stack this lab trains, as the planner's ModelSpec (vectors in, no vocabulary)."""
    from labs.lab09_planner import ModelSpec
    return ModelSpec("lab stack", sizes["layers"], sizes["d_model"], sizes["heads"], sizes["seq"], 0,
                     sizes["batch"])


def lab_config(entry: dict):
    """One configuration's run as the planner's ParallelConfig: fp32 parameters, gradients and
    activations, SGD momentum (4 bytes of state), no dropout, one micro-batch per replica, and
    the "selective" variant (the CPU's fused attention keeps no s x s matrix and recomputes it)."""
    from labs.lab09_planner import ParallelConfig
    return ParallelConfig(dp=entry["dp"], tp=entry["tp"], sequence_parallel=entry["sp"], recompute="selective",
                          param_bytes=4, grad_bytes=4, optimizer_bytes=4, activation_bytes=4, dropout=False)


def lab_cluster(machine: dict, per_call: bool = True):
    """This machine as the planner's ClusterSpec, from this run's measurements (`measure_machine`):
    the FLOP/s of a rank's share of the step with the one wait for the slowest rank, the all-reduce
    sweep's busbw, and what a call costs in a step (`call_costs`: call_s per call, step_s per ring
    step, gloo's reduce-scatter as an all-reduce). per_call=False: the planner as it was before the
    fixed cost of a call was measured: the sweep's alpha alone (per ring step, back to back, at
    least 0), FLOP/s of the plain step. One "node" of all the ranks: every group uses the same
    link."""
    from labs.lab09_planner import ClusterSpec
    ab, calls, compute = machine["all_reduce"], machine["calls"], machine["compute"]
    step_s = calls["step_s"] if per_call else max(0.0, ab["step_latency_s"])
    flops_per_s = compute["flops_per_s"] if per_call else compute["flops"] / compute["plain_seconds"]
    return ClusterSpec(f"this machine, {ab['ranks']} gloo ranks", gpus_per_node=ab["ranks"], memory_bytes=float("inf"),
                       peak_flops=flops_per_s, matmul_efficiency=1.0,
                       intra_latency_s=step_s, intra_bytes_per_s=ab["busbw"],
                       inter_latency_s=step_s, inter_bytes_per_s=ab["busbw"],
                       call_s=calls["call_s"] if per_call else 0.0,
                       reduce_scatter_as_all_reduce=per_call and calls["reduce_scatter_as_all_reduce"])


# ======================================================================================== the run
def run(ctx: DistContext, **sizes) -> dict:
    """Every configuration of CONFIGS that fits the ranks, the DTensor cross-check (4 ranks) and
    the planner's measurements (`measure_machine`), the configurations' steps timed in the same
    rounds. Configurations with tp > 1 need notebook 05's f/g backward."""
    s = {**default_sizes(), **sizes}
    batches = [sample(s["batch"], s["seq"], s["d_model"], seed=10 + i, device=ctx.device)
               for i in range(s["check_steps"])]
    reference = reference_params(s, batches, ctx.device)
    out = {"sizes": s, "configs": {}, "world_size": ctx.world_size}
    if ctx.world_size == 4:
        out["mesh"] = who_talks_to_whom(make_mesh(ctx, 2, 2)[0])
    x, target = batches[0]
    steps = {}
    for name, (dp, tp, _) in CONFIGS.items():
        if dp * tp == ctx.world_size:
            run_one = lambda n=name: run_config(ctx, n, s, batches, reference)  # noqa: E731
            result = run_one() if tp == 1 else attempt(run_one)
            if isinstance(result, tuple):
                out["configs"][name], replica = result
                steps[name] = lambda r=replica: r.step(x, target)
            else:
                out["configs"][name] = result            # {"unsolved": ...}: notebook 05's homework
    out["machine"], samples = measure_machine(ctx, s, steps)
    for name, times in samples.items():
        out["configs"][name]["step_s"] = statistics.median(times)
    if ctx.world_size == 4:
        out["dtensor"] = attempt(dtensor_cross_check, ctx, s, batches)
    return out


def main() -> None:
    with distributed() as ctx:
        result = run(ctx)
        ctx.report(**result)
        rows, bad = [], []
        for name, r in result["configs"].items():
            if "unsolved" in r:
                rows.append({"configuration": name, "max |param diff|": "needs notebook 05's f/g backward"})
                continue
            rows.append({"configuration": name, "max |param diff|": r["max_param_diff"],
                         "step ms": 1e3 * r["step_s"], "model states KiB": r["held"]["total"] / 2**10,
                         "activations KiB": r["activation_bytes"] / 2**10,
                         "dp group": r["groups"]["dp group"], "tp group": r["groups"]["tp group"]})
            bad += [name] if r["max_param_diff"] > TOLERANCE else []
        dtensor = result.get("dtensor", {})
        if ctx.rank == 0:
            table(rows, title=f"rank 0 of {ctx.world_size}: each configuration vs one process "
                  f"(tolerance {TOLERANCE:g}), its step time and what this rank holds", floatfmt=".3g")
            calls = result["machine"]["calls"]
            print(f"a collective call in a step costs {1e3 * calls['call_s']:.2f} ms + {1e3 * calls['step_s']:.2f} ms "
                  f"per ring step here, after the {1e3 * calls['wait_s']:.1f} ms every step waits for its slowest "
                  "rank (the planner's ClusterSpec for this machine: lab_cluster)", flush=True)
            if "worst" in dtensor:
                print(f"DTensor SequenceParallel vs ours on the tp sub-mesh: max |diff| {dtensor['worst']:.1e}")
        if bad or dtensor.get("worst", 0.0) > TOLERANCE:
            raise RuntimeError(f"rank {ctx.rank}: {bad or 'DTensor cross-check'} differs from one process")


if __name__ == "__main__":
    main()
