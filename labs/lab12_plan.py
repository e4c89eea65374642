"""Lab 12 (the planner against the run): notebook 09's planner predicts this lab's composed step,
and the step is timed beside the planner's inputs, under the same load.

Run:  ./run.sh 12      (8 ranks, a 2 x 2 x 2 mesh; alone: NPROC=8 ./run.sh labs/lab12_plan.py)

The planner (labs/lab09_planner.py) needs a model, a configuration and a cluster. The model and
the configuration are lab 12's (`lab12_model`, `lab12_config` below: fp32, AdamW, FSDP2 over dp
as ZeRO-3, sequence parallelism, 1F1B with the Trainer's micro-batches); FSDP2's calls on dp are
counted per unit, as FSDP2 makes them (`fsdp2_calls`, checked against the traffic meter), not
per micro-batch as the planner's ZeRO-3 term counts them. The cluster
is this machine, measured by `measure_machine` (labs/lab09_mesh.py) in this launch: the FLOP/s of
a rank's share of a dense stack's training step at this model's width, sequence and batch (small
matrices run far below a large matmul's rate, so the calibration uses this model's sizes), the
all-reduce sweep's bandwidth, and the fixed cost of a collective call inside a step. The composed
training step (`Trainer.step`: forward and backward through the pipeline, clipping, AdamW) is
timed in the same alternating rounds as the calibration steps, so load that comes and goes on a
shared machine hits both alike (`timed_rounds`). Each round's time is its slowest rank's.

Also measured here, to hold the prediction against the run term by term (the notebook does, with
the per-rank trace of labs/lab12_trace.py): the calls of one composed step by mesh dimension
(helpers.traffic.TrafficMeter) beside the calls the planner's formulas count
(`planner_calls`); the operators the step dispatches, and how many on DTensors (`OpCount`); what
DTensor's dispatch adds to one small operator (`dispatch_cost`); and the CPU time of a step on
each rank, the composed step beside the planner's calibration step (`cpu_seconds`: the ranks share
this machine's cores, so a step's wall time is made of their CPU work). The planner counts FLOPs,
bytes and calls; not operators, nor the work between them.
"""
from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import pick
from helpers.dist import DistContext, distributed
from helpers.traffic import TrafficMeter
from labs.lab12_model import LMConfig, batch_at, corpus, default_config, split
from labs.lab12_parallelize import mesh_shape
from labs.lab12_train import Trainer

LAB_NPROC = 8
STEP_JOB = "lab 12 step"      # the composed step's name among measure_machine's jobs


def stack_sizes(config: LMConfig, rounds: int | None = None) -> dict:
    """Lab 09's dense stack (measure_machine's calibration step) at lab 12's sizes."""
    return dict(layers=config.layers, d_model=config.dim, heads=config.heads, seq=config.seq,
                batch=config.batch, timed_steps=rounds if rounds is not None else pick(9, 4))


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[str]:
    """torch's Schedule1F1B on one stage, as it runs it: min(m, stages - stage) forwards, then a
    backward and a forward in turn, then the remaining backwards (torch/distributed/pipelining/
    schedules.py). Actions "F" and "B", in order; one "F", "B" without a pipeline."""
    if stages == 1:
        return ["F", "B"]
    warmup = min(microbatches, stages - stage)
    order, forwards, backwards = ["F"] * warmup, warmup, 0
    while backwards < microbatches:
        order.append("B")
        backwards += 1
        if forwards < microbatches:
            order.append("F")
            forwards += 1
    return order


def fsdp2_calls(actions: list[str], blocks: int, reshard_after_forward: bool = True,
                pipelined: bool = True) -> dict[str, int]:
    """FSDP2's calls on dp in one step of a stage of `blocks` units and a root, each unit
    following its state: a forward or a backward that finds the unit sharded all-gathers it; after a
    forward a block reshards if `reshard_after_forward` (the root never: FSDP2's root keeps its
    parameters for the backward); after a backward a unit stays whole under a pipeline (torch's
    PipelineStage: set_reshard_after_backward(False) until the step's end) and reshards without
    one; each unit reduce-scatters its gradients once per step. Returns {"all_gather": ...,
    "reduce_scatter": ...}."""
    gathers = 0
    for root in [True] + [False] * blocks:
        whole = False
        for action in actions:
            gathers += not whole
            whole = not (action == "F" and reshard_after_forward and not root) and \
                not (action == "B" and not pipelined)
    return {"all_gather": gathers, "reduce_scatter": blocks + 1}


def planner_calls(shape, microbatches: int, layers: int, stage: int = 0) -> dict[str, int]:
    """The calls per step on `stage` that the step time counts, by mesh dimension: tp, the
    sequence-parallel collectives of `tp_collectives_per_layer` for each of the stage's layers and
    micro-batches (plan_step_time); dp, FSDP2's per unit (`fsdp2_calls` with 1F1B's order), not
    notebook 09's ZeRO-3 per micro-batch (two all-gathers and a reduce-scatter each: `zero3`);
    pp, one message each way per micro-batch."""
    from labs.lab09_planner import tp_collectives_per_layer

    pp, dp, tp = shape
    config = lab12_config(shape, microbatches)
    per_layer = sum(len(kinds) for kinds in tp_collectives_per_layer(config).values())
    fsdp = fsdp2_calls(one_f_one_b(stage, pp, microbatches), layers // pp, pipelined=pp > 1)
    return {"tp": layers // pp * microbatches * per_layer if tp > 1 else 0,
            "dp": sum(fsdp.values()) if dp > 1 else 0, "pp": 2 * microbatches if pp > 1 else 0,
            "zero3": 3 * microbatches if dp > 1 else 0}


def measured_calls(traffic: dict) -> dict[str, int]:
    """Collective calls and messages of one step by mesh dimension, from TrafficMeter.summary()."""
    return {dim: sum(t["calls"].values()) for dim, t in traffic.items()}


class OpCount(TorchDispatchMode):
    """The operators this rank dispatches while active: all of them, and those with a DTensor
    among their arguments (each of which runs DTensor's sharding propagation, in Python, before
    the local kernel). A mode sees an operator before a tensor subclass does, once per call."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.dtensor_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        self.ops += 1
        self.dtensor_ops += any(issubclass(t, DTensor) for t in types)
        return func(*args, **(kwargs or {}))


def dispatch_cost(ctx: DistContext, mesh, repeats: int | None = None) -> dict:
    """CPU seconds (this thread's) per call of one small elementwise multiplication, (1, 16, 64)
    float32, on plain tensors and on DTensors split over mesh["tp"] (Shard(1): no communication),
    every rank at once: what DTensor's dispatch adds to an operator, in the units of `cpu_seconds`."""
    from torch.distributed.tensor import DTensor, Shard

    repeats = repeats or pick(400, 100)
    a, b = (torch.randn(1, 16, 64, device=ctx.device) for _ in range(2))
    da, db = (DTensor.from_local(t, mesh["tp"], [Shard(1)], run_check=False) for t in (a, b))
    out = {}
    for name, (x, y) in {"plain": (a, b), "DTensor": (da, db)}.items():
        x * y                                     # warm-up (DTensor caches its sharding decision)
        samples = []
        for _ in range(pick(5, 3)):
            ctx.barrier()
            start = time.thread_time()
            for _ in range(repeats):
                x * y
            samples.append((time.thread_time() - start) / repeats)
        out[name] = statistics.median(samples)
    return out


def cpu_seconds(ctx: DistContext, fn, repeats: int) -> dict[str, float]:
    """Seconds per call of fn() on this rank, every rank at once (a barrier before each call):
    wall-clock, CPU of this process (all its threads: gloo runs its transfers on threads of its
    own) and CPU of the calling thread; medians."""
    from helpers.dist import synchronize

    fn()                                          # warm-up
    samples = []
    for _ in range(repeats):
        ctx.barrier()
        wall, process, thread = time.perf_counter(), time.process_time(), time.thread_time()
        fn()
        synchronize(ctx.device)
        samples.append((time.perf_counter() - wall, time.process_time() - process, time.thread_time() - thread))
    return {key: statistics.median(s[i] for s in samples) for i, key in enumerate(("wall", "process_cpu", "thread_cpu"))}


def composed_step(trainer: Trainer, data: torch.Tensor):
    """The training step measure_machine times: each call the next step of the run."""
    steps = itertools.count()

    def step():
        x, y = batch_at(data, next(steps), trainer.config.batch, trainer.config.seq)
        trainer.step(x, y)

    return step


# ================================================================== lab 12, as the planner sees it
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


def fsdp2_dp_seconds(model, cluster, parallel, stage: int = 0) -> float:
    """FSDP2's data-parallel time per step on `stage`: each unit's all-gathers of its parameters
    and its one reduce-scatter of its gradients (`fsdp2_calls`, 1F1B's order), `collective_seconds`
    on the dp link; a block's unit holds a layer, the root the embedding (first stage) and the
    output layer with the final norm (last stage)."""
    from labs.lab09_planner import axis_link, collective_seconds

    if parallel.dp == 1:
        return 0.0
    actions = one_f_one_b(stage, parallel.pp, parallel.micro_batches)
    root_calls = fsdp2_calls(actions, 0, pipelined=parallel.pp > 1)
    block_gathers = fsdp2_calls(actions, 1, pipelined=parallel.pp > 1)["all_gather"] - root_calls["all_gather"]
    root_params = (model.embedding_params(parallel.tp) if stage == 0 else 0.0) + \
        (model.last_stage_params(parallel.tp) if stage == parallel.pp - 1 else 0.0)
    link = axis_link(cluster, parallel, "dp")

    def unit(params: float, gathers: int) -> float:
        return (gathers * collective_seconds("all_gather", params * parallel.param_bytes, parallel.dp, *link)
                + collective_seconds("reduce_scatter", params * parallel.grad_bytes, parallel.dp, *link))

    return (unit(root_params, root_calls["all_gather"])
            + model.layers // parallel.pp * unit(model.layer_params(parallel.tp), block_gathers))


def plan_lab12(config, shape, microbatches: int, cluster, activation_checkpointing: bool = False) -> dict:
    """The planner's prediction for lab 12's run (labs/lab12_train.py) on `cluster` (e.g.
    `lab_cluster(measure_machine(...)[0])`, measured in the same launch): {"model", "config"
    (the planner's inputs), "memory": bytes per rank on the first and on the last pipeline stage
    (parameters, gradients, optimizer state, activations, total: plan_memory for the first;
    the last holds the untied output layer and the final norm instead of the embedding, and
    1F1B keeps one micro-batch in flight there), "step_s" and "time": plan_step_time's terms on
    stage 0, with FSDP2's data-parallel calls per unit (`fsdp2_dp_seconds`) in "dp_comm" and the
    exercise's ZeRO-3 term, per micro-batch, kept as "dp_comm_zero3"}. Needs the planner exercise
    (plan_memory, plan_step_time)."""
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
    time = asdict(plan_step_time(model, cluster, parallel))
    # FSDP2's calls on dp per unit (fsdp2_calls), not the exercise's ZeRO-3 per micro-batch
    time["dp_comm_zero3"], time["dp_comm"] = time["dp_comm"], fsdp2_dp_seconds(model, cluster, parallel)
    time["total"] = sum(time[k] for k in ("compute", "tp_comm", "pp_comm", "bubble", "dp_comm"))
    return {"model": asdict(model), "config": asdict(parallel),
            "memory": {"first stage": {"parameters": first.parameters, "gradients": first.gradients,
                                       "optimizer state": first.optimizer_state, "activations": first.activations,
                                       "total": first.total, "params_per_gpu": first.params_per_gpu,
                                       "microbatches_in_flight": first.microbatches_in_flight},
                       "last stage": {**last, "params_per_gpu": params_last, "microbatches_in_flight": 1}},
            "step_s": time["total"], "time": time}


@dataclass(frozen=True)
class StepMeasurement:
    """The composed step as `measure_step` measured it on one rank (reported as a dict: rebuild it
    with StepMeasurement(**d))."""
    microbatches: int
    step_seconds: list          # each round's time (its slowest rank's)
    step_s: float               # their median
    traffic: dict               # TrafficMeter.summary() of one step
    calls: dict                 # calls per dimension in that step
    planner_calls: dict         # planner_calls: what the planner counts (FSDP2's per unit on dp; "zero3")
    ops: int                    # operators one step dispatched
    dtensor_ops: int            # ... with a DTensor argument
    dense_ops: int              # operators of the planner's calibration step
    dispatch_s: dict            # dispatch_cost: CPU seconds per small operator, "plain" and "DTensor"
    cpu: dict                   # cpu_seconds of "composed step" and "dense step"


def measure_step(ctx: DistContext, config: LMConfig, shape, rounds: int | None) -> tuple[dict, dict]:
    """The composed step, warmed up, its calls counted, then timed in measure_machine's rounds."""
    from labs.lab09_machine import compute_step, measure_machine
    from labs.lab09_sequence_parallel import sample

    data, _ = split(corpus())
    trainer = Trainer(ctx, config, shape)
    step = composed_step(trainer, data)
    step()                                   # the first step builds the pipeline's buffers
    traffic, ops = TrafficMeter(trainer.mesh), OpCount()
    with traffic, ops:
        step()
    sizes = stack_sizes(config, rounds)
    machine, samples = measure_machine(ctx, sizes, {STEP_JOB: step})
    seconds = samples[STEP_JOB]
    x, target = sample(config.batch, config.seq, config.dim, seed=10, device=ctx.device)
    dense = compute_step(ctx, sizes, x, target)[0]    # the planner's calibration step
    cpu = {"composed step": cpu_seconds(ctx, step, pick(3, 2)), "dense step": cpu_seconds(ctx, dense, pick(5, 3))}
    dense_ops = OpCount()
    with dense_ops:
        dense()
    return machine, asdict(StepMeasurement(
        microbatches=trainer.microbatches, step_seconds=seconds, step_s=statistics.median(seconds),
        traffic=traffic.summary(), calls=measured_calls(traffic.summary()),
        planner_calls=planner_calls(shape, trainer.microbatches, config.layers), ops=ops.ops,
        dtensor_ops=ops.dtensor_ops, dense_ops=dense_ops.ops, dispatch_s=dispatch_cost(ctx, trainer.mesh), cpu=cpu))


def run(ctx: DistContext, *, config: LMConfig | None = None, shape=None, rounds: int | None = None) -> dict:
    """The planner's inputs ("machine", lab_cluster reads it) and the composed step ("step": its
    round-by-round times, median, calls). While `parallelize` is a stub, "step" is its
    {"unsolved": ...} record and nothing is measured: the machine's numbers only serve the
    comparison with the step."""
    from helpers.notice import attempt

    config = config or default_config()
    shape = tuple(shape or mesh_shape(ctx.world_size))
    out = {"shape": list(shape), "config": config.as_dict(), "sizes": stack_sizes(config, rounds)}
    result = attempt(measure_step, ctx, config, shape, rounds)
    if isinstance(result, dict):              # the exercise is a stub
        out["step"] = result
    else:
        out["machine"], out["step"] = result
    return out


def prediction(out: dict) -> dict:
    """The planner's prediction for the run `out` (this lab's run) on the cluster it measured:
    plan_lab12 (needs notebook 09's planner exercise)."""
    from labs.lab09_mesh import lab_cluster

    config = LMConfig(**out["config"])
    return plan_lab12(config, tuple(out["shape"]), out["step"]["microbatches"], lab_cluster(out["machine"]))


def main() -> None:
    from helpers.notice import notice_if_unsolved, solved
    from helpers.show import table

    with distributed() as ctx:
        out = run(ctx)
        ctx.report(plan=out)
        if ctx.rank != 0:
            return
        with notice_if_unsolved():
            step = solved(out["step"])
            plan = prediction(out)
            terms = plan["time"]
            table([{"term": k, "predicted ms": 1e3 * terms[k]} for k in
                   ("compute", "tp_comm", "pp_comm", "bubble", "dp_comm")]
                  + [{"term": "total", "predicted ms": 1e3 * plan["step_s"]},
                     {"term": "measured (median of the rounds)", "predicted ms": 1e3 * step["step_s"]}],
                  title=f"{' x '.join(map(str, out['shape']))} (pp, dp, tp): the planner's step on stage 0",
                  floatfmt=".4g")
            print(f"predicted / measured: {plan['step_s'] / step['step_s']:.2f}; calls per step on rank 0 by "
                  f"dimension: measured {step['calls']}, the planner counts {step['planner_calls']}", flush=True)


if __name__ == "__main__":
    main()
