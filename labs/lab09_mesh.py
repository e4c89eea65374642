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
steps (`measure_machine`): the FLOP/s of the stack's training step on a quarter of the batch (one
rank's share of the work) with all 4 ranks busy, the all-reduce's alpha-beta fit on the 4 ranks
(notebook 04's sweep and fit), and what one small collective call costs on groups of 2 and 4 ranks:
back to back through torch.distributed, and inside the training step, added where the
configurations issue them, through the autograd functions they use (`call_costs`: a fixed cost per
call and a latency per ring step, after the one wait for the slowest rank every distributed step
has). Those steps and the configurations' are timed in alternating rounds, under the same load.
`lab_model`, `lab_config` and `lab_cluster` turn a run into the planner's inputs; `plan_lab12` does
the same for lab 12's composed run. On the 2 x 2 mesh it also runs PyTorch's own sequence
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

from helpers import pick, smoke
from helpers.accounting import held_bytes
from helpers.bench import measure
from helpers.comm_bench import (all_reduce_fit, fit_call_costs, reduce_scatter_single, slowest)
from helpers.dist import DistContext, distributed
from helpers.notice import attempt
from helpers.show import table
from helpers.tensors import ddp_device_ids, divide
from labs.lab05_tensor_parallel import all_reduce_sum, max_param_diffs
from labs.lab09_sequence_parallel import (GatherSequenceLinear, ReduceScatterToSequence,
                                          activation_bytes, all_gather_sequence, dense_stack,
                                          local_loss, parallel_stack, sample, sequence_parallel_block,
                                          sequence_shard, sync_replicated_grads)

LAB_NPROC = 4      # ./run.sh 09 launches this lab on 4 ranks (NPROC, when set, wins)
TOLERANCE = 1e-5   # max |parameter difference| after the steps, fp32, against one process
LR, MOMENTUM = 0.05, 0.9
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


# ===================================================================== what the planner needs
class WithCalls(nn.Module):
    """`module`, then the calls a tensor-parallel ("tp") or sequence-parallel ("sp") sub-block
    issues, forward and backward, through the autograd functions the configurations use, on four
    numbers of its output (the messages are tiny: what the calls add is their fixed cost). "tp":
    an all-reduce each way (`AllReduceBothWays`); "sp": `GatherSequenceLinear` then
    `ReduceScatterToSequence` (all-gather, reduce-scatter forward; all-gather, all-gather,
    reduce-scatter backward)."""

    def __init__(self, module: nn.Module, kind: str, group, device):
        super().__init__()
        self.module, self.kind, self.group = module, kind, group
        self.register_buffer("eye", torch.eye(4, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.module(x)
        probe = y.flatten()[:4].reshape(1, 1, 4)
        if self.kind == "tp":
            out = AllReduceBothWays.apply(probe, self.group)
        else:
            out = ReduceScatterToSequence.apply(GatherSequenceLinear.apply(probe, self.eye, None, self.group), self.group)
        return y + 0.0 * out.sum()


def compute_step(ctx: DistContext, sizes: dict, x: torch.Tensor, target: torch.Tensor, calls: str = "none",
                 group=None):
    """The dense stack's training step (forward, backward, SGD with momentum) on 1/world_size of
    the batch: a rank's share of the work in every configuration. Timed with every rank busy (they
    share this machine's cores, as in every configuration), and with the one wait for the slowest
    rank every distributed step has (`call_costs`), it calibrates the planner's FLOP/s.
    FLOPs as the planner counts them: 3 x (24 b s h^2 + 4 b s^2 h) per layer, plus the attention
    core recomputed in the backward (CPU's fused attention does that: the planner's "selective").
    calls="tp" or "sp": the same step with the calls a configuration issues added after each
    attention and MLP on `group` (`WithCalls`); "dp": with a small all-reduce when the backward is
    done (DDP's): what they add to the step is what they cost in one. Returns (the step, {"rows",
    "flops", "calls": calls per step})."""
    dense = dense_stack(sizes["layers"], sizes["d_model"], sizes["heads"], device=ctx.device)
    probe = torch.zeros(4, device=ctx.device)
    if calls in ("tp", "sp"):
        for block in dense:
            block.attn = WithCalls(block.attn, calls, group, ctx.device)
            block.mlp = WithCalls(block.mlp, calls, group, ctx.device)
    opt = torch.optim.SGD(dense.parameters(), lr=LR, momentum=MOMENTUM)
    rows = max(1, x.shape[0] // ctx.world_size)
    x, target = x[:rows], target[:rows]
    b, s, h = rows, x.shape[1], sizes["d_model"]
    flops = sizes["layers"] * (3 * (24 * b * s * h * h + 4 * b * s * s * h) + 4 * b * s * s * h)

    def step():
        opt.zero_grad()
        local_loss(dense(x), target, b * s).backward()
        if calls == "dp":
            dist.all_reduce(probe, group=group)
        opt.step()

    return step, {"rows": rows, "flops": flops,
                  "calls": 0 if calls == "none" else calls_per_step(calls, sizes["layers"])}


def all_reduce_alpha_beta(ctx: DistContext) -> dict:
    """Notebook 04's sweep and fit of the all-reduce on all ranks, t = latency + S / algbw, given
    per ring step and as bus bandwidth: the planner's alpha and beta (2(n-1) steps; busbw =
    algbw x 2(n-1)/n)."""
    sizes = [4, 256 * 1024, 4 * 1024 * 1024] if smoke() else [4 * 4 ** i for i in range(0, 12, 2)]
    latency, algbw, rows = all_reduce_fit(sizes, device=ctx.device, repeats=pick(5, 2))
    n = ctx.world_size
    return {"rows": rows, "latency_s": latency, "algbw": algbw,
            "step_latency_s": latency / (2 * (n - 1)), "busbw": algbw * 2 * (n - 1) / n, "ranks": n}


class AllReduceBothWays(torch.autograd.Function):
    """An all-reduce (notebook 05's `all_reduce_sum`) in the forward and another in the backward:
    the pair of calls a column/row-parallel pair issues (Megatron's g, then f's in the backward)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce_sum(x, group, None)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad, ctx.group, None), None


def ring_steps(kind: str, n: int, reduce_scatter_as_all_reduce: bool) -> int:
    """The planner's ring steps of one call on n ranks (collective_seconds)."""
    if kind == "reduce_scatter" and reduce_scatter_as_all_reduce:
        kind = "all_reduce"
    return {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1}[kind]


# The calls each attention and each MLP of a configuration issues, forward + backward: tensor
# parallelism's (an all-reduce each way) and sequence parallelism's (GatherSequenceLinear then
# ReduceScatterToSequence: all-gather, reduce-scatter forward; all-gather, all-gather,
# reduce-scatter backward); and data parallelism's, once per step: DDP's all-reduce of the
# gradients when the backward is done.
CHAIN_CALLS = {"tp": {"all_reduce": 2}, "sp": {"all_gather": 3, "reduce_scatter": 2}, "dp": {"all_reduce": 1}}
PER_STEP = ("dp",)      # kinds of CHAIN_CALLS issued once per step (the others: per attention and MLP)


def calls_per_step(kind: str, layers: int) -> int:
    """Calls a `compute_step(calls=kind)` issues: CHAIN_CALLS[kind] per attention and MLP, or once."""
    return sum(CHAIN_CALLS[kind].values()) * (1 if kind in PER_STEP else 2 * layers)


def collective_groups(ctx: DistContext) -> dict[int, object]:
    """The group sizes the configurations use on this many ranks -> a group of that size holding
    this rank: groups of 2 neighbouring ranks (a (world/2, 2) mesh's last dimension, all busy at
    once, as the tp groups of dp2 x tp2) and all the ranks."""
    groups = {}
    if ctx.world_size > 2 and ctx.world_size % 2 == 0:
        groups[2] = make_mesh(ctx, ctx.world_size // 2, 2)[2]
    if ctx.world_size > 1:
        groups[ctx.world_size] = None
    return groups


def back_to_back_calls(ctx: DistContext, sizes: dict, groups: dict) -> list[dict]:
    """Seconds per call of small collectives (a few KiB) issued back to back through
    torch.distributed, on each group of `groups` (`collective_groups`; the slowest rank's median):
    what notebook 04's sweep measures at its small end."""
    rows, calls, repeats, h = [], pick(20, 5), pick(5, 2), sizes["d_model"]
    for n, group in groups.items():
        x = torch.zeros(1, 2, h, device=ctx.device)
        flat_in, flat_out = torch.zeros(2 * n * h, device=ctx.device), torch.empty(2 * h, device=ctx.device)
        ops = {"all_reduce": lambda: dist.all_reduce(flat_out, group=group),
               "all_gather": lambda: all_gather_sequence(x, group),
               "reduce_scatter": lambda: reduce_scatter_single(flat_out, flat_in, group=group)}
        for kind, op in ops.items():
            t = measure(lambda: [op() for _ in range(calls)], warmup=1, repeats=repeats, device=ctx.device,
                        barrier=True).median
            rows.append({"kind": kind, "group size": n, "seconds per call": slowest(t, ctx.device) / calls})
    return rows


def call_costs(samples: dict, layers: int, world_size: int, reduce_scatter_as_all_reduce: bool) -> dict:
    """What calls cost inside a training step, from `timed_rounds`' samples of `compute_step`:
    "compute" (no call) and (kind, n) for each kind of CHAIN_CALLS and group size n.

    A step that synchronises at all waits once for its slowest rank (4 processes sharing 2 cores:
    some rank is always behind); the step with one all-reduce after the backward ("dp", DDP's) pays
    that wait and one call. Each further call costs call_s + step_s per ring step: "tp" and "sp"
    against "dp" on the same group, round by round (median), with one call fewer, give the rows
    `fit_call_costs` fits (a reduce-scatter counting an all-reduce's steps where the backend runs
    one: gloo). Returns the rows (with the fit per call), call_s, step_s, and "synced_s": the step
    that waits once, without its call (the "dp" step on all ranks less the fit's cost of its
    all-reduce): what the planner's compute is calibrated on; "wait_s": that minus the plain step."""
    def median_diff(a, b):
        return statistics.median(x - y for x, y in zip(samples[a], samples[b]))

    def steps_of(kind: str, n: int) -> int:
        per = calls_per_step(kind, layers) // sum(CHAIN_CALLS[kind].values())
        return per * sum(c * ring_steps(k, n, reduce_scatter_as_all_reduce) for k, c in CHAIN_CALLS[kind].items())

    rows = []
    sizes = sorted({n for key in samples if isinstance(key, tuple) for n in [key[1]]})
    for n in sizes:
        one_call = {"calls": 1, "steps": steps_of("dp", n)}
        rows.append({"chain": "dp", "group size": n, **one_call, "seconds": median_diff(("dp", n), "compute"),
                     "fitted": False})
        for kind in CHAIN_CALLS:
            if kind in PER_STEP:
                continue
            calls, steps = calls_per_step(kind, layers), steps_of(kind, n)
            rows.append({"chain": kind, "group size": n, "calls": calls - 1, "steps": steps - one_call["steps"],
                         "seconds": median_diff((kind, n), ("dp", n)), "fitted": True})
    fitted = [r for r in rows if r["fitted"]]
    call_s, step_s = fit_call_costs(fitted) if fitted else (0.0, 0.0)
    for row in rows:
        row["seconds per call"] = row["seconds"] / row["calls"]
        row["fit per call"] = (row["calls"] * call_s + row["steps"] * step_s) / row["calls"]
    plain = statistics.median(samples["compute"])
    synced = plain
    if ("dp", world_size) in samples:
        synced = statistics.median(samples[("dp", world_size)]) - (call_s + 2 * (world_size - 1) * step_s)
    return {"in_step": rows, "call_s": call_s, "step_s": step_s, "synced_s": synced, "wait_s": synced - plain,
            "plain_s": plain, "reduce_scatter_as_all_reduce": reduce_scatter_as_all_reduce}


def timed_rounds(ctx: DistContext, jobs: dict, rounds: int) -> dict:
    """Every job once per round, in turn (a barrier before each; one untimed round first); a
    round's time is its slowest rank's (a synchronous step waits for it). Returns each job's times,
    round by round: take medians, or compare two jobs round by round. Load that comes and goes on
    a shared machine hits every job alike, so their ratios stay fair (helpers.comm_bench.
    side_by_side's idea)."""
    samples: dict = {key: [] for key in jobs}
    for i in range(1 + rounds):
        for key, job in jobs.items():
            t = slowest(measure(job, warmup=0, repeats=1, device=ctx.device, barrier=True).median, ctx.device)
            if i:
                samples[key].append(t)
    return samples


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


# ============================================================================ lab 12, as the planner sees it
def lab12_model(config):
    """Lab 12's byte-level language model (labs/lab12_model.py's LMConfig) as the planner's
    ModelSpec. Its layout differs from the GPT one of the formulas, and says so: RMSNorm (a weight
    per norm), rotary positions (no parameters), no biases, an MLP of width `ffn`, an untied
    output layer (on the last stage), a vocabulary of 256 bytes. The parameters then come out as
    lab12_model.parameter_count counts them (the final norm on the last stage:
    `last_stage_params`). Activations: Korthikanti et al.'s count, whose MLP is 4h wide (the lab's
    full size has ffn = 4 dim; smoke mode's does not) and whose attention keeps q, k and v: the
    rotated copies rotary positions make are not in it."""
    from labs.lab09_planner import ModelSpec
    return ModelSpec("lab 12 byte LM", layers=config.layers, hidden=config.dim, heads=config.heads, seq=config.seq,
                     vocab=config.vocab, global_batch=config.batch, ffn=config.ffn, biases=False, norm="rmsnorm",
                     positions="rotary", tied=False)


def lab12_config(shape, microbatches: int, activation_checkpointing: bool = False):
    """Lab 12's (pp, dp, tp) run as the planner's ParallelConfig: FSDP2 over dp is ZeRO-3,
    sequence parallelism with tp > 1, 1F1B over pp with `microbatches` per replica (the Trainer's
    choice), float32 parameters, gradients and activations, AdamW (8 bytes of state per
    parameter), no dropout; attention as the CPU's fused kernel runs it ("selective"), or "full"
    recomputation with activation checkpointing per block."""
    from labs.lab09_planner import ParallelConfig
    pp, dp, tp = shape
    return ParallelConfig(dp=dp, tp=tp, pp=pp, zero_stage=3, micro_batches=microbatches,
                          recompute="full" if activation_checkpointing else "selective",
                          sequence_parallel=tp > 1, schedule="1F1B", param_bytes=4, grad_bytes=4,
                          optimizer_bytes=8, activation_bytes=4, dropout=False)


def plan_lab12(config, shape, microbatches: int, cluster, activation_checkpointing: bool = False) -> dict:
    """The planner's prediction for lab 12's run (labs/lab12_train.py) on `cluster` (e.g.
    `lab_cluster(measure_machine(...)[0])`, measured in the same launch): {"model", "config"
    (the planner's inputs), "memory": bytes per rank on the first and on the last pipeline stage
    (parameters, gradients, optimizer state, activations, total: plan_memory for the first;
    the last holds the untied output layer and the final norm instead of the embedding, and
    1F1B keeps one micro-batch in flight there), "step_s" (plan_step_time's total) and "time"
    (its terms)}. Needs the planner exercise (plan_memory, plan_step_time)."""
    from dataclasses import asdict

    from labs.lab08_zero import model_state_bytes
    from labs.lab09_planner import activation_bytes_per_layer, plan_memory, plan_step_time

    model, parallel = lab12_model(config), lab12_config(shape, microbatches, activation_checkpointing)
    first = plan_memory(model, parallel)
    layers_here = model.layers // parallel.pp
    params_last = layers_here * model.layer_params(parallel.tp) + model.last_stage_params(parallel.tp)
    if parallel.pp == 1:                 # one stage: the first is also the last
        params_last += model.embedding_params(parallel.tp)
    states = model_state_bytes(params_last, parallel.dp, parallel.zero_stage, parallel.param_bytes,
                               parallel.grad_bytes, parallel.optimizer_bytes)
    layer_bytes = activation_bytes_per_layer(model.seq, model.global_batch // (parallel.dp * parallel.micro_batches),
                                           model.hidden, model.heads, tp=parallel.tp,
                                           sequence_parallel=parallel.sequence_parallel, recompute=parallel.recompute,
                                           element_bytes=parallel.activation_bytes, dropout=parallel.dropout)
    last = {"parameters": states["parameters"], "gradients": states["gradients"],
            "optimizer state": states["optimizer state"], "activations": layer_bytes * layers_here}
    last["total"] = sum(last.values())
    time = plan_step_time(model, cluster, parallel)
    return {"model": asdict(model), "config": asdict(parallel),
            "memory": {"first stage": {"parameters": first.parameters, "gradients": first.gradients,
                                       "optimizer state": first.optimizer_state, "activations": first.activations,
                                       "total": first.total, "params_per_gpu": first.params_per_gpu,
                                       "microbatches_in_flight": first.microbatches_in_flight},
                       "last stage": {**last, "params_per_gpu": params_last, "microbatches_in_flight": 1}},
            "step_s": time.total, "time": asdict(time)}


# ======================================================================================== the run
def measure_machine(ctx: DistContext, sizes: dict | None = None, extra_jobs: dict | None = None,
                    rounds: int | None = None) -> tuple[dict, dict]:
    """What the planner needs from this machine (`lab_cluster` reads it), measured on every rank:
    the all-reduce sweep's alpha-beta fit (`all_reduce_alpha_beta`), small calls back to back
    (`back_to_back_calls`), the dense stack's training step on a rank's share of the batch
    (`compute_step`: the FLOP/s) and the same step with each kind of call added on each group size
    (`call_costs`: the fixed cost of a call in a step). The steps are timed in alternating rounds
    (`timed_rounds`) together with `extra_jobs` (name -> function: e.g. the training steps the
    planner is to predict), so the planner's inputs and what it predicts see the same load.
    `sizes`: the stack's (default_sizes). Returns (the measurements, the extra jobs' times round by
    round)."""
    s = {**default_sizes(), **(sizes or {})}
    groups = collective_groups(ctx)
    machine = {"all_reduce": all_reduce_alpha_beta(ctx) if ctx.world_size > 1 else None,
               "back_to_back": back_to_back_calls(ctx, s, groups)}
    x, target = sample(s["batch"], s["seq"], s["d_model"], seed=10, device=ctx.device)
    step, machine["compute"] = compute_step(ctx, s, x, target)
    jobs = {"compute": step}
    for n, group in groups.items():
        for kind in CHAIN_CALLS:
            jobs[(kind, n)] = compute_step(ctx, s, x, target, kind, group)[0]
    extra_jobs = extra_jobs or {}
    jobs.update(extra_jobs)
    samples = timed_rounds(ctx, jobs, s["timed_steps"] if rounds is None else rounds)
    machine["calls"] = call_costs({k: v for k, v in samples.items() if k not in extra_jobs}, s["layers"],
                                  ctx.world_size, ctx.world_size > 1 and dist.get_backend() == "gloo")
    machine["calls"]["back_to_back"] = machine.pop("back_to_back")
    seconds = machine["calls"]["synced_s"]
    machine["compute"].update(seconds=seconds, plain_seconds=machine["calls"]["plain_s"],
                              flops_per_s=machine["compute"]["flops"] / seconds)
    return machine, {name: samples[name] for name in extra_jobs}


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
