"""Lab 09 (the machine, for the planner): what the planner of labs/lab09_planner.py needs to know
about this machine, measured in the same launch as the steps it is to predict.

A library of labs 09 and 12, with no main of its own: labs/lab09_mesh.py's run calls
`measure_machine` (`./run.sh 09`), and labs/lab12_plan.py does too.

`measure_machine` measures, on every rank: the FLOP/s of the dense stack's training step on a
rank's share of the batch with every rank busy (`compute_step`), the all-reduce's alpha-beta fit
on all the ranks (notebook 04's sweep and fit: `all_reduce_alpha_beta`), and what one small
collective call costs on groups of 2 and 4 ranks: back to back through torch.distributed
(`back_to_back_calls`), and inside the training step, added where the configurations issue them,
through the autograd functions they use (`call_costs`: a fixed cost per call and a latency per ring
step, after the one wait for the slowest rank every distributed step has). The steps are timed in
alternating rounds (`timed_rounds`) with the steps the planner is to predict, under the same load.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn as nn

from helpers import pick, smoke
from helpers.bench import measure
from helpers.comm_bench import all_reduce_fit, fit_call_costs, reduce_scatter_single, slowest
from helpers.dist import DistContext, device_mesh
from labs.lab05_tensor_parallel import all_reduce_sum
from labs.lab09_sequence_parallel import (GatherSequenceLinear, ReduceScatterToSequence, all_gather_sequence,
                                          dense_stack, local_loss, sample)

LR, MOMENTUM = 0.05, 0.9     # labs/lab09_mesh.py's SGD, which the calibration step runs too


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
        groups[2] = device_mesh(ctx.device.type, dp=ctx.world_size // 2, tp=2).get_group("tp")
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


def measure_machine(ctx: DistContext, sizes: dict, extra_jobs: dict | None = None,
                    rounds: int | None = None) -> tuple[dict, dict]:
    """What the planner needs from this machine (`lab_cluster` reads it), measured on every rank:
    the all-reduce sweep's alpha-beta fit (`all_reduce_alpha_beta`), small calls back to back
    (`back_to_back_calls`), the dense stack's training step on a rank's share of the batch
    (`compute_step`: the FLOP/s) and the same step with each kind of call added on each group size
    (`call_costs`: the fixed cost of a call in a step). The steps are timed in alternating rounds
    (`timed_rounds`) together with `extra_jobs` (name -> function: e.g. the training steps the
    planner is to predict), so the planner's inputs and what it predicts see the same load.
    `sizes`: the stack's (layers, d_model, heads, seq, batch) and timed_steps, the rounds (labs/
    lab09_mesh.py's default_sizes). Returns (the measurements, the extra jobs' times round by round)."""
    s = sizes
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
