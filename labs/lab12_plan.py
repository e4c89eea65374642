"""Lab 12 (the planner against the run): notebook 09's planner predicts this lab's composed step,
and the step is timed beside the planner's inputs, under the same load.

Run:  ./run.sh 12      (8 ranks, a 2 x 2 x 2 mesh; alone: NPROC=8 ./run.sh labs/lab12_plan.py)

The planner (labs/lab09_planner.py) needs a model, a configuration and a cluster. The model and
the configuration are lab 12's (`lab12_model`, `lab12_config` in labs/lab09_mesh.py: fp32, AdamW,
FSDP2 over dp as ZeRO-3, sequence parallelism, 1F1B with the Trainer's micro-batches). The cluster
is this machine, measured by `measure_machine` (labs/lab09_mesh.py) in this launch: the FLOP/s of
a rank's share of a dense stack's training step at this model's width, sequence and batch (small
matrices run far below a large matmul's rate, so the calibration uses this model's sizes), the
all-reduce sweep's bandwidth, and the fixed cost of a collective call inside a step. The composed
training step (`Trainer.step`: forward and backward through the pipeline, clipping, AdamW) is
timed in the same alternating rounds as the calibration steps, so load that comes and goes on a
shared machine hits both alike (`timed_rounds`). Each round's time is its slowest rank's.

Also measured here, to hold the prediction against the run term by term (the notebook does, with
the per-rank trace of labs/lab12_trace.py): the calls of one composed step by mesh dimension
(labs/lab12_train.py's MeshTraffic) beside the calls the planner's formulas count
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

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import pick
from helpers.dist import DistContext, distributed
from labs.lab12_model import LMConfig, batch_at, corpus, default_config, split
from labs.lab12_parallelize import mesh_shape
from labs.lab12_train import MeshTraffic, Trainer

LAB_NPROC = 8
STEP_JOB = "lab 12 step"      # the composed step's name among measure_machine's jobs


def stack_sizes(config: LMConfig, rounds: int | None = None) -> dict:
    """Lab 09's dense stack (measure_machine's calibration step) at lab 12's sizes."""
    return dict(layers=config.layers, d_model=config.dim, heads=config.heads, seq=config.seq,
                batch=config.batch, timed_steps=rounds if rounds is not None else pick(9, 4))


def planner_calls(shape, microbatches: int, layers: int) -> dict[str, int]:
    """The calls per step on stage 0 that the planner's step time counts, by mesh dimension
    (`plan_step_time`): tp, the sequence-parallel collectives of `tp_collectives_per_layer` for
    each of the stage's layers and micro-batches; dp, ZeRO-3's two all-gathers and a reduce-scatter
    per micro-batch; pp, one message each way per micro-batch."""
    from labs.lab09_mesh import lab12_config
    from labs.lab09_planner import tp_collectives_per_layer

    pp, dp, tp = shape
    config = lab12_config(shape, microbatches)
    per_layer = sum(len(kinds) for kinds in tp_collectives_per_layer(config).values())
    return {"tp": layers // pp * microbatches * per_layer if tp > 1 else 0,
            "dp": 3 * microbatches if dp > 1 else 0, "pp": 2 * microbatches if pp > 1 else 0}


def measured_calls(traffic: dict) -> dict[str, int]:
    """Collective calls and messages of one step by mesh dimension, from MeshTraffic.summary()."""
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


def measure_step(ctx: DistContext, config: LMConfig, shape, rounds: int | None) -> tuple[dict, dict]:
    """The composed step, warmed up, its calls counted, then timed in measure_machine's rounds."""
    from labs.lab09_mesh import compute_step, default_sizes, measure_machine
    from labs.lab09_sequence_parallel import sample

    data, _ = split(corpus())
    trainer = Trainer(ctx, config, shape)
    step = composed_step(trainer, data)
    step()                                   # the first step builds the pipeline's buffers
    traffic, ops = MeshTraffic(trainer.mesh), OpCount()
    with traffic, ops:
        step()
    sizes = stack_sizes(config, rounds)
    machine, samples = measure_machine(ctx, sizes, {STEP_JOB: step})
    seconds = samples[STEP_JOB]
    x, target = sample(config.batch, config.seq, config.dim, seed=10, device=ctx.device)
    dense = compute_step(ctx, {**default_sizes(), **sizes}, x, target)[0]    # the planner's calibration step
    cpu = {"composed step": cpu_seconds(ctx, step, pick(3, 2)), "dense step": cpu_seconds(ctx, dense, pick(5, 3))}
    dense_ops = OpCount()
    with dense_ops:
        dense()
    return machine, {"microbatches": trainer.microbatches, "step_seconds": seconds,
                     "step_s": statistics.median(seconds), "traffic": traffic.summary(),
                     "calls": measured_calls(traffic.summary()),
                     "planner_calls": planner_calls(shape, trainer.microbatches, config.layers),
                     "ops": ops.ops, "dtensor_ops": ops.dtensor_ops, "dense_ops": dense_ops.ops,
                     "dispatch_s": dispatch_cost(ctx, trainer.mesh), "cpu": cpu}


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
    labs/lab09_mesh.py's plan_lab12 (needs notebook 09's planner exercise)."""
    from labs.lab09_mesh import lab_cluster, plan_lab12

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
