"""Public tests of lab 09's exercises: `plan_memory` and `plan_step_time` (labs/lab09_planner.py).

Run:  ./run.sh check 09

Hand-computed cases (small numbers you can redo on paper, the formulas named in the docstrings),
the mistakes that are easy to make (a term split by the wrong parallelism, the embedding
forgotten, the bubble from a formula instead of the schedule's simulation), and the planner
against what this process measures on a real stack of Transformer blocks: the bytes of its
parameters, gradients and optimizer state (exactly) and of its saved activations (within 5%).
"""
from __future__ import annotations

import pytest
import torch

from labs import lab09_planner as pl
from labs.lab08_zero import model_state_bytes
from labs.lab09_schedules import pipeline_timing

# h = 8, a = 2, s = 4, V = 16: a layer has 12 h^2 + 13 h = 872 parameters
TINY = pl.ModelSpec("tiny", layers=4, hidden=8, heads=2, seq=4, vocab=16, global_batch=8)
# every link: 1 microsecond per ring step, 1 GB/s; 1 GFLOP/s
CLUSTER = pl.ClusterSpec("paper cluster", gpus_per_node=4, memory_bytes=1e9, peak_flops=1e9,
                         matmul_efficiency=1.0, intra_latency_s=1e-6, intra_bytes_per_s=1e9,
                         inter_latency_s=1e-5, inter_bytes_per_s=1e8)


@pytest.mark.exercise("plan_memory")
def test_memory_one_gpu_by_hand():
    """One GPU: 4 layers x 872 + (16 + 4) x 8 parameters at 2 + 2 + 12 bytes, activations of 4 layers."""
    plan = pl.plan_memory(TINY, pl.ParallelConfig(micro_batches=2))
    params = 4 * 872 + (16 + 4) * 8
    assert plan.params_per_gpu == params, (
        f"params_per_gpu: expected {params} (4 layers x 872 plus the embeddings (V + s) h = 160), "
        f"got {plan.params_per_gpu}")
    assert (plan.parameters, plan.gradients, plan.optimizer_state) == (2 * params, 2 * params, 12 * params), (
        "parameters, gradients, optimizer state: params_per_gpu x param_bytes, grad_bytes, optimizer_bytes")
    per_layer = pl.activation_bytes_per_layer(4, 4, 8, 2)          # micro-batch b = 8 / (1 x 2) = 4
    assert plan.activations == pytest.approx(4 * per_layer), (
        f"activations: one micro-batch (b = global_batch / (dp m) = 4) through the 4 layers, "
        f"{4 * per_layer} bytes; got {plan.activations}")
    assert plan.microbatches_in_flight == 1
    assert plan.total == pytest.approx(plan.parameters + plan.gradients + plan.optimizer_state + plan.activations)


@pytest.mark.exercise("plan_memory")
def test_memory_splits_by_each_parallelism():
    """tp splits layers (not the replicated 6h) and the vocabulary; pp the layers; ZeRO the states."""
    plan = pl.plan_memory(TINY, pl.ParallelConfig(dp=2, tp=2, pp=2, zero_stage=1, micro_batches=2))
    params = 2 * TINY.layer_params(2) + TINY.embedding_params(2)
    assert plan.params_per_gpu == pytest.approx(params), (
        f"stage 0 holds L/pp = 2 layers of layer_params(tp) and embedding_params(tp): {params}; "
        f"got {plan.params_per_gpu}. Only the split matrices divide by tp; the first stage keeps the embeddings")
    states = model_state_bytes(params, 2, 1, 2, 2, 12)
    assert plan.optimizer_state == pytest.approx(states["optimizer state"]) and \
        plan.gradients == pytest.approx(states["gradients"]), (
            "ZeRO-1 shards the optimizer state over the dp ranks only: use notebook 08's model_state_bytes")


@pytest.mark.exercise("plan_memory")
def test_memory_counts_the_microbatches_the_schedule_keeps():
    """4 stages, 1F1B, 8 micro-batches: stage 0 holds 4 micro-batches of its layer; GPipe all 8."""
    model = pl.ModelSpec("deep", layers=4, hidden=8, heads=2, seq=4, vocab=0, global_batch=8)
    per_layer = pl.activation_bytes_per_layer(4, 1, 8, 2, recompute="selective")
    for schedule, held in (("1F1B", 4), ("GPipe", 8)):
        plan = pl.plan_memory(model, pl.ParallelConfig(pp=4, micro_batches=8, schedule=schedule,
                                                       recompute="selective"))
        assert plan.microbatches_in_flight == held, (
            f"{schedule}, p = 4, m = 8: stage 0 holds {held} micro-batches at its peak (ask the "
            f"simulator: pipeline_timing(...)['peak_held']); got {plan.microbatches_in_flight}")
        assert plan.activations == pytest.approx(held * per_layer), f"{schedule}: 1 layer x {held} micro-batches"


@pytest.mark.exercise("plan_step_time")
def test_step_time_one_gpu_is_compute():
    """One GPU, no recomputation: 3 x (L layer_forward_flops(b) + logits) / F per micro-batch, m of them."""
    plan = pl.plan_step_time(TINY, CLUSTER, pl.ParallelConfig(micro_batches=2))
    forward = (4 * TINY.layer_forward_flops(4) + TINY.logits_forward_flops(4)) / 1e9
    assert plan.compute == pytest.approx(2 * 3 * forward), (
        f"compute: m = 2 micro-batches of b = 4, forward {forward:.3e} s and backward twice that; "
        f"got {plan.compute:.3e} s")
    assert plan.tp_comm == plan.pp_comm == plan.dp_comm == plan.bubble == 0, "nothing to send on one GPU"
    assert plan.total == pytest.approx(plan.compute)


@pytest.mark.exercise("plan_step_time")
def test_step_time_tensor_and_data_parallel_by_hand():
    """tp = 2: 4 all-reduces of (b, s, h) per layer and micro-batch; dp = 2: one all-reduce of the gradients."""
    config = pl.ParallelConfig(dp=2, tp=2, micro_batches=1)
    plan = pl.plan_step_time(TINY, CLUSTER, config)
    activation = 4 * 4 * 8 * 2                                   # b s h x 2 bytes, b = 8 / 2
    one = 2 * 1e-6 + activation / 1e9                            # all-reduce on 2: 2 steps, share 1
    assert plan.tp_comm == pytest.approx(4 * 4 * one), (
        f"tp_comm: 4 layers x 4 all-reduces of {activation} bytes, each 2 x 1 us + "
        f"{activation} B / 1 GB/s; got {plan.tp_comm:.3e} s")
    grads = (4 * TINY.layer_params(2) + TINY.embedding_params(2)) * 2
    assert plan.dp_comm == pytest.approx(2e-6 + grads / 1e9), (
        f"dp_comm: one all-reduce of the {grads:.0f} bytes of gradients this GPU holds")
    assert plan.dp_bytes == pytest.approx(grads) and plan.tp_bytes == pytest.approx(16 * activation), (
        "*_bytes: what this GPU sends, RING_SHARE x the collective's size")


@pytest.mark.exercise("plan_step_time")
def test_bubble_comes_from_the_schedule_simulation():
    """pp = 4: bubble = simulated makespan - m (t_forward + t_backward), for 1F1B and for ZB-H1."""
    model = pl.ModelSpec("deep", layers=8, hidden=8, heads=2, seq=4, vocab=0, global_batch=8)
    for schedule in ("1F1B", "ZB-H1"):
        plan = pl.plan_step_time(model, CLUSTER, pl.ParallelConfig(pp=4, micro_batches=8, schedule=schedule))
        want = pipeline_timing(schedule, 4, 8, plan.t_forward, plan.t_backward)["bubble"]
        assert plan.bubble == pytest.approx(want), (
            f"{schedule}: the bubble must be the simulated one, {want:.3e} s (pipeline_timing with your "
            f"t_forward and t_backward), got {plan.bubble:.3e} s. (p-1)/m holds for 1F1B only")
        assert plan.pp_comm > 0, "pp > 1: each micro-batch sends its activation forward and its gradient back"


@pytest.mark.exercise("plan_memory")
@pytest.mark.points(2)
def test_memory_against_this_process():
    """A stack of notebook 05's blocks, fp32, SGD momentum: states exact, activations within 5%."""
    from labs.lab09_sequence_parallel import activation_bytes, dense_stack, local_loss, sample

    layers, h, heads, seq, batch = 2, 32, 4, 16, 3
    stack = dense_stack(layers, h, heads)
    x, target = sample(batch, seq, h, seed=0)
    opt = torch.optim.SGD(stack.parameters(), lr=0.01, momentum=0.9)
    local_loss(stack(x), target, batch * seq).backward()
    opt.step()
    held = sum(p.nbytes + p.grad.nbytes + opt.state[p]["momentum_buffer"].nbytes for p in stack.parameters())
    measured_activations = activation_bytes(stack, x)
    model = pl.ModelSpec("stack", layers, h, heads, seq, 0, batch)
    plan = pl.plan_memory(model, pl.ParallelConfig(recompute="selective", param_bytes=4, grad_bytes=4,
                                                   optimizer_bytes=4, activation_bytes=4, dropout=False))
    states = plan.parameters + plan.gradients + plan.optimizer_state
    assert states == held, f"model states: this process holds {held} bytes, the plan says {states}"
    assert 1.0 <= measured_activations / plan.activations < 1.05, (
        f"activations: this process saves {measured_activations} bytes for backward, the plan says "
        f"{plan.activations:.0f} (fp32, no dropout, fused attention = the selective variant)")
