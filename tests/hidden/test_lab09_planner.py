"""Hidden tests of lab 09's exercises: `plan_memory` and `plan_step_time` (labs/lab09_planner.py).

Other sizes and configurations than the public tests (interleaving, sequence parallelism, full
recomputation, 8-way tensor parallelism across nodes, ZeRO-3 with gradient accumulation, mixed
precisions, groups that cross nodes), and the invariants a planner must keep: memory falls with
every ZeRO stage, the bubble is the schedule simulator's, each communication term scales as its
formula (bytes with the sizes, time with the link), and the traffic agrees with notebook 08's
per-step accounting. Each term the public tests check one at a time is checked here too, at other
sizes, so a planner that drops one fails here as well.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from labs import lab09_planner as pl
from labs.lab08_zero import step_sent_bytes
from labs.lab09_schedules import pipeline_timing

MODEL = pl.ModelSpec("mid", layers=8, hidden=64, heads=8, seq=32, vocab=128, global_batch=64)
CLUSTER = pl.ClusterSpec("test", gpus_per_node=8, memory_bytes=1e10, peak_flops=2e12, matmul_efficiency=0.5,
                         intra_latency_s=2e-6, intra_bytes_per_s=4e10, inter_latency_s=8e-6,
                         inter_bytes_per_s=5e9)


def dp_only(config: pl.ParallelConfig) -> pl.ParallelConfig:
    return replace(config, param_bytes=4, grad_bytes=4)


@pytest.mark.exercise("plan_memory")
@pytest.mark.points(2)
def test_memory_falls_with_each_zero_stage():
    """dp = 4: ZeRO 1 shrinks the optimizer state, 2 the gradients too, 3 the parameters too."""
    plans = [pl.plan_memory(MODEL, pl.ParallelConfig(dp=4, tp=2, micro_batches=2, zero_stage=z)) for z in range(4)]
    totals = [p.total for p in plans]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4, (
        f"total memory per GPU must fall strictly with each ZeRO stage: {totals}")
    assert plans[1].optimizer_state == pytest.approx(plans[0].optimizer_state / 4)
    assert plans[2].gradients == pytest.approx(plans[0].gradients / 4)
    assert plans[3].parameters == pytest.approx(plans[0].parameters / 4)
    assert len({p.activations for p in plans}) == 1, "ZeRO does not change the activations"


@pytest.mark.exercise("plan_memory")
def test_memory_sequence_parallel_interleaved_and_full_recompute():
    """tp 4 + sp with interleaving (v = 2), and full recomputation: the formula x layers x in flight."""
    config = pl.ParallelConfig(dp=2, tp=4, pp=2, micro_batches=4, sequence_parallel=True,
                               schedule="interleaved 1F1B", virtual_stages=2)
    plan = pl.plan_memory(MODEL, config)
    held = pipeline_timing("interleaved 1F1B", 2, 4, 1.0, 2.0, 2)["peak_held"]
    assert plan.microbatches_in_flight == pytest.approx(held) and held == 2.5
    per_layer = pl.activation_bytes_per_layer(32, 8, 64, 8, tp=4, sequence_parallel=True)
    assert plan.activations == pytest.approx(per_layer * 4 * held)
    full = pl.plan_memory(MODEL, pl.ParallelConfig(tp=2, pp=4, micro_batches=8, recompute="full"))
    assert full.activations == pytest.approx(2 * 32 * 8 * 64 * 2 * 4)     # e s b h x 2 layers x 4 in flight
    assert full.params_per_gpu == pytest.approx(2 * MODEL.layer_params(2) + MODEL.embedding_params(2))


@pytest.mark.exercise("plan_memory")
def test_memory_rejects_what_does_not_split():
    """Configurations that do not split evenly raise ValueError (check_config)."""
    for bad in (pl.ParallelConfig(tp=3), pl.ParallelConfig(pp=3), pl.ParallelConfig(dp=5)):
        with pytest.raises(ValueError):
            pl.plan_memory(MODEL, bad)


@pytest.mark.exercise("plan_step_time")
@pytest.mark.points(2)
@pytest.mark.parametrize("schedule,v,p,m", [("1F1B", 1, 2, 8), ("GPipe", 1, 4, 4), ("interleaved 1F1B", 2, 4, 8),
                                            ("ZB-H1", 1, 4, 16), ("interleaved 1F1B", 4, 2, 4)])
def test_bubble_is_the_simulators(schedule, v, p, m):
    """bubble == pipeline_timing(schedule, p, m, t_forward, t_backward, v)['bubble'] of the plan's own times."""
    config = pl.ParallelConfig(dp=64 // (m * 4), tp=2, pp=p, micro_batches=m, schedule=schedule, virtual_stages=v)
    plan = pl.plan_step_time(MODEL, CLUSTER, config)
    want = pipeline_timing(schedule, p, m, plan.t_forward, plan.t_backward, v)["bubble"]
    assert plan.bubble == pytest.approx(want, rel=1e-9), (schedule, plan.bubble, want)
    assert plan.total == pytest.approx(plan.compute + plan.tp_comm + plan.pp_comm + plan.bubble + plan.dp_comm)
    one = pl.plan_step_time(MODEL, CLUSTER, pl.ParallelConfig(dp=config.dp, tp=2, micro_batches=m))
    assert one.bubble == 0


@pytest.mark.exercise("plan_step_time")
def test_pipeline_messages_follow_v_and_tp():
    """pp messages: 2 v per micro-batch of b s h e / tp bytes each."""
    base = pl.ParallelConfig(dp=2, tp=2, pp=4, micro_batches=8)
    a = pl.plan_step_time(MODEL, CLUSTER, base)
    b = pl.plan_step_time(MODEL, CLUSTER, pl.ParallelConfig(dp=2, tp=2, pp=4, micro_batches=8,
                                                             schedule="interleaved 1F1B", virtual_stages=2))
    activation = 4 * 32 * 64 * 2 / 2                                    # b = 64 / 16
    assert a.pp_bytes == pytest.approx(8 * 2 * activation)
    assert b.pp_bytes == pytest.approx(2 * a.pp_bytes) and b.pp_comm == pytest.approx(2 * a.pp_comm)


@pytest.mark.exercise("plan_step_time")
@pytest.mark.points(2)
def test_communication_scales_as_the_formulas():
    """Bandwidth terms: bytes scale with b and with 1/(tp pp); time halves when bandwidth doubles."""
    free = replace(CLUSTER, intra_latency_s=0.0, inter_latency_s=0.0)
    fast = replace(free, intra_bytes_per_s=2 * free.intra_bytes_per_s, inter_bytes_per_s=2 * free.inter_bytes_per_s)
    config = pl.ParallelConfig(dp=2, tp=4, micro_batches=2)
    slow, quick = pl.plan_step_time(MODEL, free, config), pl.plan_step_time(MODEL, fast, config)
    assert quick.tp_comm == pytest.approx(slow.tp_comm / 2) and quick.dp_comm == pytest.approx(slow.dp_comm / 2)
    bigger = pl.plan_step_time(MODEL, free, pl.ParallelConfig(dp=2, tp=4, micro_batches=1))   # b doubles, m halves
    assert bigger.tp_bytes == pytest.approx(slow.tp_bytes)           # m b constant: same bytes per step
    sp = pl.plan_step_time(MODEL, free, pl.ParallelConfig(dp=2, tp=4, micro_batches=2, sequence_parallel=True))
    assert sp.tp_bytes == pytest.approx(1.25 * slow.tp_bytes), "sp: same forward bytes, plus the re-gather"
    deeper = pl.plan_step_time(MODEL, free, pl.ParallelConfig(dp=2, tp=4, pp=2, micro_batches=2))
    assert deeper.dp_bytes < slow.dp_bytes and deeper.tp_bytes == pytest.approx(slow.tp_bytes / 2)
    # 8-way TP on nodes of 4 crosses the slow link
    small_nodes = replace(CLUSTER, gpus_per_node=4)
    wide = pl.ParallelConfig(tp=8, micro_batches=1)
    assert pl.plan_step_time(MODEL, small_nodes, wide).tp_comm > 5 * pl.plan_step_time(MODEL, CLUSTER, wide).tp_comm


@pytest.mark.exercise("plan_step_time")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_data_parallel_traffic_is_notebook_08s(stage):
    """dp bytes = notebook 08's step_sent_bytes (ZeRO-3: once per micro-batch)."""
    m = 2
    config = dp_only(pl.ParallelConfig(dp=4, tp=2, micro_batches=m, zero_stage=stage))
    plan = pl.plan_step_time(MODEL, CLUSTER, config)
    params = pl.plan_memory(MODEL, config).params_per_gpu
    want = step_sent_bytes(params, 4, stage, 4) * (m if stage == 3 else 1)
    assert plan.dp_bytes == pytest.approx(want), (stage, plan.dp_bytes, want)


@pytest.mark.exercise("plan_step_time")
def test_recomputation_costs_compute():
    """Full recomputation adds one forward of the layers; selective the attention core only."""
    plans = {r: pl.plan_step_time(MODEL, CLUSTER, pl.ParallelConfig(micro_batches=4, recompute=r))
             for r in pl.RECOMPUTE}
    b, s, h, L = 16, 32, 64, 8
    flops_per_s = CLUSTER.flops_per_s
    assert plans["full"].compute - plans["none"].compute == pytest.approx(4 * L * MODEL.layer_forward_flops(b) / flops_per_s)
    assert plans["selective"].compute - plans["none"].compute == pytest.approx(4 * L * 4 * b * s * s * h / flops_per_s)


@pytest.mark.exercise("plan_memory")
def test_memory_activations_take_the_configs_precision_and_dropout():
    """fp32 activations without dropout, with and without sequence parallelism; one stage holds one micro-batch."""
    for options in ({}, {"sequence_parallel": True, "recompute": "selective"}):
        config = pl.ParallelConfig(dp=2, tp=4, micro_batches=4, activation_bytes=4, dropout=False, **options)
        plan = pl.plan_memory(MODEL, config)
        per_layer = pl.activation_bytes_per_layer(32, 8, 64, 8, tp=4, element_bytes=4, dropout=False, **options)
        assert plan.activations == pytest.approx(8 * per_layer), (options, plan.activations, 8 * per_layer)
        assert plan.microbatches_in_flight == 1, "one stage: gradient accumulation holds one micro-batch"


@pytest.mark.exercise("plan_step_time")
def test_compute_splits_over_tp_and_pp():
    """Compute: L/pp layers and 1/pp of the output layer, over tp, backward twice the forward; recomputation over tp too."""
    config = pl.ParallelConfig(dp=2, tp=2, pp=4, micro_batches=4)            # b = 8
    plan = pl.plan_step_time(MODEL, CLUSTER, config)
    F = CLUSTER.flops_per_s
    forward = (2 * MODEL.layer_forward_flops(8) + MODEL.logits_forward_flops(8) / 4) / 2 / F
    assert plan.compute == pytest.approx(4 * 3 * forward), (plan.compute, 4 * 3 * forward)
    full = pl.plan_step_time(MODEL, CLUSTER, replace(config, recompute="full"))
    assert full.compute - plan.compute == pytest.approx(4 * 2 * MODEL.layer_forward_flops(8) / 2 / F)


@pytest.mark.exercise("plan_step_time")
def test_each_axis_on_its_own_link():
    """A dp group larger than a node crosses nodes while tp stays inside; pipeline neighbours too far apart cross nodes."""
    inter = (CLUSTER.inter_latency_s, CLUSTER.inter_bytes_per_s)
    intra = (CLUSTER.intra_latency_s, CLUSTER.intra_bytes_per_s)
    config = pl.ParallelConfig(dp=8, tp=2, micro_batches=2)                   # dp spans 16 GPUs
    plan = pl.plan_step_time(MODEL, CLUSTER, config)
    grads = pl.plan_memory(MODEL, config).params_per_gpu * 2
    assert plan.dp_comm == pytest.approx(pl.collective_seconds("all_reduce", grads, 8, *inter))
    activation = 4 * 32 * 64 * 2
    want_tp = 8 * 4 * pl.collective_seconds("all_reduce", activation, 2, *intra) * 2
    assert plan.tp_comm == pytest.approx(want_tp)
    config = pl.ParallelConfig(dp=2, tp=4, pp=2, micro_batches=4)             # neighbours 8 GPUs apart
    plan = pl.plan_step_time(MODEL, CLUSTER, config)
    grads = pl.plan_memory(MODEL, config).params_per_gpu * 2
    assert plan.dp_comm == pytest.approx(pl.collective_seconds("all_reduce", grads, 2, *intra))
    assert plan.pp_comm == pytest.approx(4 * 2 * pl.p2p_seconds(8 * 32 * 64 * 2 / 4, *inter))


@pytest.mark.exercise("plan_step_time")
@pytest.mark.parametrize("options", [{}, {"recompute": "full"}, {"sequence_parallel": True, "recompute": "full"}])
def test_tensor_parallel_time_in_forward_and_backward(options):
    """tp collectives from tp_collectives_per_layer, forward ones in t_forward and backward ones in t_backward."""
    config = pl.ParallelConfig(dp=2, tp=4, micro_batches=2, **options)       # b = 16
    plan = pl.plan_step_time(MODEL, CLUSTER, config)
    link = (CLUSTER.intra_latency_s, CLUSTER.intra_bytes_per_s)
    activation = 16 * 32 * 64 * 2
    kinds = pl.tp_collectives_per_layer(config)
    phase = {k: 8 * sum(pl.collective_seconds(c, activation, 4, *link) for c in v) for k, v in kinds.items()}
    assert plan.tp_comm == pytest.approx(2 * (phase["forward"] + phase["backward"])), (plan.tp_comm, phase)
    F = CLUSTER.flops_per_s
    forward = (8 * MODEL.layer_forward_flops(16) + MODEL.logits_forward_flops(16)) / 4 / F
    assert plan.t_forward == pytest.approx(forward + phase["forward"])
    assert plan.t_backward - plan.t_forward == pytest.approx(plan.compute / 2 - 2 * forward + phase["backward"]
                                                             - phase["forward"])


@pytest.mark.exercise("plan_step_time")
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_gathers_parameters_not_gradients(stage):
    """ZeRO 1 and 2 with fp32 gradients and bf16 parameters: a reduce-scatter of the gradients, an all-gather of the parameters."""
    config = pl.ParallelConfig(dp=4, tp=2, micro_batches=2, zero_stage=stage, grad_bytes=4, param_bytes=2)
    plan = pl.plan_step_time(MODEL, CLUSTER, config)
    params = pl.plan_memory(MODEL, config).params_per_gpu
    assert plan.dp_bytes == pytest.approx(0.75 * params * (4 + 2)), (plan.dp_bytes, params)
    link = (CLUSTER.intra_latency_s, CLUSTER.intra_bytes_per_s)
    want = (pl.collective_seconds("reduce_scatter", 4 * params, 4, *link)
            + pl.collective_seconds("all_gather", 2 * params, 4, *link))
    assert plan.dp_comm == pytest.approx(want)


@pytest.mark.exercise("plan_step_time")
@pytest.mark.parametrize("options", [{}, {"sequence_parallel": True}, {"zero_stage": 2}])
def test_every_call_pays_the_fixed_cost_of_the_link(options):
    """With a fixed cost per call and gloo's reduce-scatter, each term equals its calls on the whole Link."""
    cluster = replace(CLUSTER, call_s=3e-5, reduce_scatter_as_all_reduce=True)
    config = pl.ParallelConfig(dp=4, tp=4, pp=2, micro_batches=4, **options)     # 32 GPUs on nodes of 8
    plan = pl.plan_step_time(MODEL, cluster, config)
    links = {axis: pl.axis_link(cluster, config, axis) for axis in ("tp", "dp", "pp")}
    activation = 4 * 32 * 64 * 2                                                    # b = 4
    kinds = pl.tp_collectives_per_layer(config)
    assert plan.tp_comm == pytest.approx(4 * 4 * sum(pl.collective_seconds(k, activation, 4, *links["tp"])
                                                     for phase in kinds.values() for k in phase))
    assert plan.pp_comm == pytest.approx(4 * 2 * pl.p2p_seconds(activation / 4, *links["pp"]))
    params = pl.plan_memory(MODEL, config).params_per_gpu
    ops = ([("all_reduce", 2 * params)] if config.zero_stage == 0 else
           [("reduce_scatter", 2 * params), ("all_gather", 2 * params)])
    assert plan.dp_comm == pytest.approx(sum(pl.collective_seconds(k, n, 4, *links["dp"]) for k, n in ops))
    free = pl.plan_step_time(MODEL, replace(cluster, call_s=0.0), config)
    assert plan.tp_comm > free.tp_comm and plan.pp_comm > free.pp_comm and plan.dp_comm > free.dp_comm, (
        "every collective and message pays the link's fixed cost per call")
