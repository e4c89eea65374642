"""Public tests of lab 09's exercises: `plan_memory` and `plan_step_time` (labs/lab09_planner.py).

Run:  ./run.sh check 09

Small cases you can redo on paper, one term of the plan at a time: every term the exercise
docstrings name is checked on its own (the parallelism that splits it, the ZeRO stage that shards
it, the link it crosses, the factor interleaving and recomputation add), and a wrong answer that
matches a known misunderstanding is named in the message. Then the planner against what this
process measures on a real stack of Transformer blocks: the bytes of its parameters, gradients and
optimizer state (exactly) and of its saved activations (within 5%).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers.comm_count import RING_SHARE
from helpers.model_states import model_state_bytes
from labs import lab09_planner as pl
from labs.lab09_schedules import pipeline_timing

# h = 8, a = 2, s = 4, V = 16: a layer has 12 h^2 + 13 h = 872 parameters
TINY = pl.ModelSpec("tiny", layers=4, hidden=8, heads=2, seq=4, vocab=16, global_batch=8)
# 8 heads: room for 4- and 8-way tensor parallelism
WIDE = pl.ModelSpec("wide", layers=2, hidden=16, heads=8, seq=8, vocab=32, global_batch=4)
# 1 GFLOP/s; inside a node of 4 GPUs: 1 microsecond per ring step, 1 GB/s; between nodes: 10 us, 0.1 GB/s
CLUSTER = pl.ClusterSpec("paper cluster", gpus_per_node=4, memory_bytes=1e9, peak_flops=1e9,
                         matmul_efficiency=1.0, intra_latency_s=1e-6, intra_bytes_per_s=1e9,
                         inter_latency_s=1e-5, inter_bytes_per_s=1e8)
INTRA, INTER = (1e-6, 1e9), (1e-5, 1e8)


def expect(got: float, want: float, what: str, why: str, mistakes=()) -> None:
    """got == want (to 1e-9), else a message saying what the term should be and, when `got` is
    what a known misunderstanding gives, naming that misunderstanding. `mistakes`: (value or a
    function giving it, "what the misunderstanding is") pairs."""
    if got == pytest.approx(want, rel=1e-9, abs=1e-30):
        return
    named = []
    for value, text in mistakes:
        try:
            value = value() if callable(value) else value
        except Exception:     # that wrong formula cannot even be evaluated here
            continue
        if value != pytest.approx(want, rel=1e-6) and got == pytest.approx(value, rel=1e-6):
            named.append(text)
    diagnosis = f" That is what you get if {', or if '.join(named)}." if named else ""
    assert False, f"{what}: expected {want:.6g}, got {got:.6g}.{diagnosis} {why}"


def ar(nbytes, n, link):
    return pl.collective_seconds("all_reduce", nbytes, n, *link)


# ========================================================================== plan_memory
@pytest.mark.exercise("plan_memory")
def test_memory_one_gpu_by_hand():
    """One GPU: 4 layers x 872 + (16 + 4) x 8 parameters at 2 + 2 + 12 bytes, activations of 4 layers."""
    plan = pl.plan_memory(TINY, pl.ParallelConfig(micro_batches=2))
    params = 4 * 872 + (16 + 4) * 8
    expect(plan.params_per_gpu, params, "params_per_gpu",
           "4 layers x layer_params() = 872, plus the embeddings (V + s) h = 160 (stage 0 holds them)",
           [(4 * 872, "the embeddings are left out")])
    assert (plan.parameters, plan.gradients, plan.optimizer_state) == (2 * params, 2 * params, 12 * params), (
        "parameters, gradients, optimizer state: params_per_gpu x param_bytes, grad_bytes, optimizer_bytes")
    per_layer = lambda b: pl.activation_bytes_per_layer(4, b, 8, 2)       # noqa: E731
    expect(plan.activations, 4 * per_layer(4), "activations",
           "one micro-batch of b = global_batch / (dp m) = 4 sequences through the 4 layers",
           [(4 * per_layer(8), "the micro-batch is the whole batch (b = global_batch)"),
            (2 * 4 * per_layer(4), "all m micro-batches are held: gradient accumulation runs one at a time")])
    assert plan.microbatches_in_flight == 1, "one stage holds one micro-batch at a time"
    assert plan.total == pytest.approx(plan.parameters + plan.gradients + plan.optimizer_state + plan.activations)


@pytest.mark.exercise("plan_memory")
def test_memory_micro_batch_is_the_batch_over_dp_and_m():
    """dp = 2 replicas x m = 2 micro-batches of a batch of 8: micro-batches of b = 2 sequences."""
    plan = pl.plan_memory(TINY, pl.ParallelConfig(dp=2, micro_batches=2))
    per_layer = lambda b: 4 * pl.activation_bytes_per_layer(4, b, 8, 2)   # noqa: E731
    expect(plan.activations, per_layer(2), "activations", "b = global_batch / (dp m) = 8 / 4",
           [(per_layer(4), "b leaves out one of dp and m (b = global_batch / m or / dp)"),
            (per_layer(8), "b is the whole global batch")])


@pytest.mark.exercise("plan_memory")
def test_memory_splits_by_each_parallelism():
    """tp splits layers (not the replicated 6h) and the vocabulary; pp the layers; ZeRO the states."""
    plan = pl.plan_memory(TINY, pl.ParallelConfig(dp=2, tp=2, pp=2, zero_stage=1, micro_batches=2))
    params = 2 * TINY.layer_params(2) + TINY.embedding_params(2)
    expect(plan.params_per_gpu, params, "params_per_gpu with tp = 2, pp = 2",
           "stage 0 holds L/pp = 2 layers of layer_params(tp) plus embedding_params(tp)",
           [(2 * TINY.layer_params(2), "the first stage's embeddings are left out"),
            (2 * TINY.layer_params(1) / 2 + TINY.embedding_params(2),
             "tp divides the whole layer: the layer norms and the biases after row-parallel layers (6h) are replicated"),
            (2 * TINY.layer_params(2) + TINY.embedding_params(1), "the embedding is not split over tp (it is vocab-parallel)"),
            (4 * TINY.layer_params(2) + TINY.embedding_params(2), "pp does not divide the layers (stage 0 holds L/pp of them)"),
            (params / 2, "dp or ZeRO divides params_per_gpu: it counts the stage's parameters split by tp, before ZeRO")])
    states = model_state_bytes(params, 2, 1, 2, 2, 12)
    expect(plan.optimizer_state, states["optimizer state"], "optimizer state, ZeRO-1 over dp = 2",
           "ZeRO shards over the dp ranks: notebook 08's model_state_bytes",
           [(12 * params, "ZeRO-1 does not shard the optimizer state over dp")])
    expect(plan.gradients, states["gradients"], "gradients, ZeRO-1", "ZeRO-1 does not shard the gradients")


@pytest.mark.exercise("plan_memory")
def test_memory_zero_shards_one_more_state_per_stage():
    """dp = 4: stage 1 divides the optimizer state by dp, stage 2 the gradients too, stage 3 the parameters too."""
    params = 4 * 872 + (16 + 4) * 8
    for stage in range(4):
        plan = pl.plan_memory(TINY, pl.ParallelConfig(dp=4, micro_batches=2, zero_stage=stage))
        for part, bytes_per, first in (("optimizer_state", 12, 1), ("gradients", 2, 2), ("parameters", 2, 3)):
            whole, shard = params * bytes_per, params * bytes_per / 4
            want = shard if stage >= first else whole
            expect(getattr(plan, part), want, f"ZeRO-{stage}, {part.replace('_', ' ')} with dp = 4",
                   f"ZeRO stage {first} and up shard the {part.replace('_', ' ')} over the dp ranks (1/dp each), "
                   f"earlier stages keep all of it (notebook 08's model_state_bytes)",
                   [(whole, f"ZeRO-{stage} does not shard the {part.replace('_', ' ')} over dp"),
                    (shard, f"ZeRO-{stage} already shards the {part.replace('_', ' ')} (it starts at stage {first})")])


@pytest.mark.exercise("plan_memory")
def test_memory_activations_follow_every_option():
    """tp, sequence parallelism, selective and full recomputation, element size and dropout each change the activations."""
    base = pl.ParallelConfig(tp=2, micro_batches=1)        # b = 8 sequences, 4 layers on one stage
    formula = lambda **kw: 4 * pl.activation_bytes_per_layer(4, 8, 8, 2, **{"tp": 2, **kw})   # noqa: E731
    cases = [
        ("tensor parallelism (tp = 2)", {}, [(formula(tp=1), "tp does not split the activations (pass tp)")],
         "q, k, v, the attention output and the MLP's activations are split over tp: activation_bytes_per_layer(tp=...)"),
        ("sequence parallelism", {"sequence_parallel": True},
         [(formula(), "sequence parallelism is left out of the activations")],
         "with sequence parallelism the replicated part (layer-norm and block inputs, dropout masks) is split over tp too"),
        ("selective recomputation", {"recompute": "selective"},
         [(formula(), "recomputation is left out of the activations")],
         "selective recomputation keeps no s^2 attention matrices"),
        ("full recomputation", {"recompute": "full"},
         [(formula(), "recomputation is left out of the activations")],
         "full recomputation keeps only each layer's input"),
        ("full recomputation + sequence parallelism", {"recompute": "full", "sequence_parallel": True},
         [(formula(recompute="full"), "sequence parallelism is left out (the kept input is split along the sequence)")],
         "the layer's input is kept, split over tp with sequence parallelism"),
        ("4-byte activations", {"activation_bytes": 4},
         [(formula(), "the config's activation_bytes is not passed (element_bytes)")],
         "fp32 activations take twice the bytes: element_bytes=config.activation_bytes"),
        ("no dropout", {"dropout": False},
         [(formula(), "the config's dropout is not passed (no masks without dropout)")],
         "without dropout there are no masks: dropout=config.dropout"),
    ]
    for what, options, mistakes, why in cases:
        plan = pl.plan_memory(TINY, replace(base, **options))
        formula_options = {("element_bytes" if k == "activation_bytes" else k): v for k, v in options.items()}
        expect(plan.activations, formula(**formula_options), f"activations with {what}", why, mistakes)


@pytest.mark.exercise("plan_memory")
@pytest.mark.parametrize("schedule,m,v", [("1F1B", 8, 1), ("GPipe", 8, 1), ("1F1B", 2, 1), ("ZB-H1", 8, 1),
                                          ("interleaved 1F1B", 8, 2)])
def test_memory_counts_the_microbatches_the_schedule_keeps(schedule, m, v):
    """pp = 4: stage 0 holds the micro-batches the schedule keeps in flight at its peak (the simulator's peak_held)."""
    model = pl.ModelSpec("deep", layers=8, hidden=8, heads=2, seq=4, vocab=0, global_batch=8)
    plan = pl.plan_memory(model, pl.ParallelConfig(pp=4, micro_batches=m, schedule=schedule, virtual_stages=v,
                                                   recompute="selective"))
    held = pipeline_timing(schedule, 4, m, 1.0, 2.0, v)["peak_held"]
    expect(plan.microbatches_in_flight, held, f"micro-batches in flight on stage 0, {schedule}, p = 4, m = {m}"
           + (f", v = {v}" if v > 1 else ""),
           "ask the schedule's simulator: pipeline_timing(schedule, pp, m, 1.0, 2.0, v)['peak_held']",
           [(4, "every schedule holds p micro-batches (1F1B's warm-up; GPipe holds all m, interleaving more, "
                "and fewer than p when m < p)"),
            (m, "every schedule holds all m micro-batches (GPipe's peak, not 1F1B's)"),
            (1, "stage 0 holds one micro-batch: a pipeline keeps the activations of every micro-batch "
                "between its forward and its backward"),
            (lambda: pipeline_timing("1F1B", 4, m, 1.0, 2.0)["peak_held"],
             "interleaving is ignored: its warm-up holds more (pass schedule and v to pipeline_timing)")])
    per_layer = pl.activation_bytes_per_layer(4, 8 // m, 8, 2, recompute="selective")
    expect(plan.activations, per_layer * 2 * held, f"activations, {schedule}, m = {m}",
           f"per-layer bytes x the stage's L/pp = 2 layers x {held:g} micro-batches in flight",
           [(per_layer * 2, "the activations are divided by pp, for one micro-batch, instead of held for "
                            "every micro-batch in flight"),
            (per_layer * 8 * held, "stage 0 holds all L layers' activations (it holds L/pp)")])


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


# ======================================================================= plan_step_time
@pytest.mark.exercise("plan_step_time")
def test_step_time_one_gpu_is_compute():
    """One GPU, no recomputation: 3 x (L layer_forward_flops(b) + logits) / F per micro-batch, m of them."""
    plan = pl.plan_step_time(TINY, CLUSTER, pl.ParallelConfig(micro_batches=2))
    layers, logits = 4 * TINY.layer_forward_flops(4) / 1e9, TINY.logits_forward_flops(4) / 1e9
    forward = layers + logits
    expect(plan.compute, 2 * 3 * forward, "compute, m = 2 micro-batches of b = 4",
           f"forward {forward:.3e} s (the layers and the output layer) and backward twice that, per micro-batch",
           [(2 * 3 * layers, "the output layer's FLOPs (logits_forward_flops) are left out"),
            (2 * 2 * forward, "the backward costs as much as the forward (it is twice: input and weight gradients)"),
            (3 * forward, "compute counts one micro-batch, not m")])
    assert plan.tp_comm == plan.pp_comm == plan.dp_comm == plan.bubble == 0, "nothing to send on one GPU"
    assert plan.total == pytest.approx(plan.compute)


@pytest.mark.exercise("plan_step_time")
def test_step_time_micro_batch_is_the_batch_over_dp_and_m():
    """dp = 2 replicas x m = 2 micro-batches of a batch of 8: each GPU computes 2 micro-batches of b = 2."""
    plan = pl.plan_step_time(TINY, CLUSTER, pl.ParallelConfig(dp=2, micro_batches=2))
    forward = lambda b: (4 * TINY.layer_forward_flops(b) + TINY.logits_forward_flops(b)) / 1e9   # noqa: E731
    expect(plan.compute, 2 * 3 * forward(2), "compute, dp = 2, m = 2", "m micro-batches of b = global_batch / (dp m)",
           [(2 * 3 * forward(4), "b leaves out one of dp and m (b = global_batch / m or / dp)"),
            (2 * 3 * forward(8), "b is the whole global batch"),
            (2 * 3 * 4 * TINY.layer_forward_flops(2) / 1e9, "the output layer's FLOPs (logits_forward_flops) are left out")])


@pytest.mark.exercise("plan_step_time")
def test_step_time_splits_compute_over_tp_and_pp():
    """tp = 2, pp = 4: a stage runs L/pp layers and 1/pp of the output layer, each matmul split over tp."""
    plan = pl.plan_step_time(TINY, CLUSTER, pl.ParallelConfig(tp=2, pp=4, micro_batches=2))
    layers, logits = TINY.layer_forward_flops(4) / 1e9, TINY.logits_forward_flops(4) / 1e9
    want = 2 * 3 * (1 * layers + logits / 4) / 2
    expect(plan.compute, want, "compute with tp = 2, pp = 4",
           "forward = (L/pp layer_forward_flops(b) + logits_forward_flops(b) / pp) / tp / F, backward twice that",
           [(2 * 3 * (1 * layers + logits / 4), "compute is not divided by tp (each rank runs 1/tp of every matmul)"),
            (2 * 3 * (4 * layers + logits) / 2, "compute is not divided by pp (a stage runs L/pp layers)"),
            (2 * 3 * (1 * layers + logits) / 2, "every stage runs the whole output layer (spread it: / pp)"),
            (2 * 3 * layers / 2, "the output layer's FLOPs (logits_forward_flops) are left out")])


@pytest.mark.exercise("plan_step_time")
def test_recomputation_costs_forward_flops():
    """Full recomputation adds the stage's layers' forward to the backward; selective only their attention core."""
    config = pl.ParallelConfig(tp=2, pp=2, micro_batches=2)        # b = 4, 2 layers a stage
    none = pl.plan_step_time(TINY, CLUSTER, config).compute
    layers = 2 * TINY.layer_forward_flops(4) / 2 / 1e9             # L/pp layers' forward, split over tp
    core = 2 * 4 * 4 * 4 ** 2 * 8 / 2 / 1e9                        # L/pp x 4 b s^2 h / tp
    logits = TINY.logits_forward_flops(4) / 2 / 2 / 1e9
    for recompute, extra, other in (("full", layers, core), ("selective", core, layers)):
        got = pl.plan_step_time(TINY, CLUSTER, replace(config, recompute=recompute)).compute
        expect(got, none + 2 * extra, f"compute with {recompute} recomputation (m = 2)",
               f"{recompute} recomputation runs {'the layers forward' if recompute == 'full' else 'the attention core'} "
               "again in the backward of every micro-batch: m x that many more FLOPs",
               [(none, "recomputation costs no FLOPs: what was dropped in the forward is recomputed in the backward"),
                (none + 2 * other, f"{recompute} recomputes {'only the attention core' if recompute == 'full' else 'the whole layer'}"),
                (none + 2 * (extra + logits), "the recomputed forward includes the output layer (only the layers are recomputed)"),
                (none + 2 * extra * 2, "the recomputed FLOPs are not divided by tp")])


@pytest.mark.exercise("plan_step_time")
def test_tensor_parallel_collectives():
    """tp = 4: 2 all-reduces of (b, s, h) forward and 2 backward per layer; sequence parallelism and full recomputation change them."""
    config = pl.ParallelConfig(tp=4, micro_batches=1)               # b = 4: a (4, 8, 16) bf16 activation
    activation = 4 * 8 * 16 * 2
    plan = pl.plan_step_time(WIDE, CLUSTER, config)
    one = ar(activation, 4, INTRA)                                   # 6 steps x 1 us + 1.5 x S / 1 GB/s
    expect(plan.tp_comm, 2 * 4 * one, "tp_comm, 2 layers, tp = 4 (no sequence parallelism)",
           f"per layer 2 all-reduces forward and 2 backward of {activation} bytes, each "
           "collective_seconds('all_reduce', ...) on the tp link",
           [(2 * 2 * one, "only the forward's all-reduces are counted (the backward has its own 2: Megatron's f)"),
            (2 * 4 * ar(activation / 4, 4, INTRA), "each all-reduce moves a 1/tp slice (it moves the whole (b, s, h))"),
            (2 * 4 * ar(activation, 4, INTER), "the tp group (4 GPUs, one node) is given the link between nodes")])
    expect(plan.tp_bytes, 2 * 4 * 1.5 * activation, "tp_bytes",
           "each GPU sends RING_SHARE['all_reduce'](4) = 1.5 x the activation per all-reduce",
           [(2 * 4 * activation, "the bytes a GPU sends are the collective's size (times RING_SHARE: 2(n-1)/n)")])
    forward_compute = plan.compute / 3
    expect(plan.t_forward, forward_compute + 2 * 2 * one, "t_forward",
           "one micro-batch's forward: compute + the forward's tensor-parallel collectives",
           [(forward_compute + 2 * 4 * one, "all the collectives land in the forward (the backward ones go in t_backward)")])

    for what, options, mistake in (
            ("sequence parallelism", {"sequence_parallel": True},
             "sequence parallelism is ignored: it replaces each all-reduce by a reduce-scatter + all-gather and "
             "re-gathers the inputs in the backward"),
            ("full recomputation", {"recompute": "full"},
             "full recomputation's collectives are left out: the recomputed forward repeats its collectives")):
        other = replace(config, **options)
        kinds = pl.tp_collectives_per_layer(other)
        want = 2 * sum(pl.collective_seconds(k, activation, 4, *INTRA) for phase in kinds.values() for k in phase)
        sent = 2 * sum(RING_SHARE[k](4) * activation for phase in kinds.values() for k in phase)
        got = pl.plan_step_time(WIDE, CLUSTER, other)
        expect(got.tp_comm, want, f"tp_comm with {what}", "the collectives of tp_collectives_per_layer(config)",
               [(plan.tp_comm, mistake)])
        expect(got.tp_bytes, sent, f"tp_bytes with {what}", "RING_SHARE x the size of each collective",
               [(plan.tp_bytes, mistake)])


@pytest.mark.exercise("plan_step_time")
def test_tensor_parallel_group_larger_than_a_node_crosses_nodes():
    """tp = 8 on nodes of 4 GPUs: the tp collectives run on the link between nodes."""
    plan = pl.plan_step_time(WIDE, CLUSTER, pl.ParallelConfig(tp=8, micro_batches=1))
    activation = 4 * 8 * 16 * 2
    expect(plan.tp_comm, 2 * 4 * ar(activation, 8, INTER), "tp_comm, tp = 8 on nodes of 4",
           "a tp group of 8 consecutive GPUs spans two nodes: axis_link(cluster, config, 'tp') gives the inter link",
           [(2 * 4 * ar(activation, 8, INTRA), "the tp group's link is always the one inside a node "
                                               "(use axis_link: a group larger than a node crosses nodes)")])


@pytest.mark.exercise("plan_step_time")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_data_parallel_traffic_per_zero_stage(stage):
    """dp = 4, m = 2, 4-byte gradients, 2-byte parameters: all-reduce (ZeRO 0), reduce-scatter + all-gather (1, 2), ZeRO-3 per micro-batch."""
    config = pl.ParallelConfig(dp=4, micro_batches=2, zero_stage=stage, grad_bytes=4, param_bytes=2)
    plan = pl.plan_step_time(TINY, CLUSTER, config)
    params = 4 * 872 + (16 + 4) * 8
    G, P = 4 * params, 2 * params                                     # gradient and parameter bytes
    rs = lambda n: pl.collective_seconds("reduce_scatter", n, 4, *INTRA)   # noqa: E731
    ag = lambda n: pl.collective_seconds("all_gather", n, 4, *INTRA)       # noqa: E731
    per_stage = {0: (ar(G, 4, INTRA), 1.5 * G), 1: (rs(G) + ag(P), 0.75 * (G + P)), 2: (rs(G) + ag(P), 0.75 * (G + P)),
                 3: (2 * (2 * ag(P) + rs(G)), 2 * 0.75 * (2 * P + G))}
    want_time, want_bytes = per_stage[stage]
    G0, P0 = 4 * 4 * 872, 2 * 4 * 872                                 # without the embeddings
    per_stage_without_embeddings = {0: (ar(G0, 4, INTRA),), 1: (rs(G0) + ag(P0),), 2: (rs(G0) + ag(P0),),
                                    3: (2 * (2 * ag(P0) + rs(G0)),)}
    inter = {0: ar(G, 4, INTER), 1: None, 2: None, 3: None}[stage]
    if stage:
        inter = sum(pl.collective_seconds(kind, n, 4, *INTER) for kind, n in
                    ([("reduce_scatter", G), ("all_gather", P)] if stage < 3 else
                     [("all_gather", P), ("all_gather", P), ("reduce_scatter", G)] * 2))
    expect(plan.dp_comm, want_time, f"dp_comm, ZeRO-{stage}",
           {0: "one all-reduce of the gradients per step",
            1: "a reduce-scatter of the gradients and an all-gather of the parameters per step",
            2: "a reduce-scatter of the gradients and an all-gather of the parameters per step",
            3: "per micro-batch: two all-gathers of the parameters (forward, backward) and a reduce-scatter"}[stage],
           [(per_stage[0][0], "every ZeRO stage all-reduces the gradients (ZeRO 1 and 2 reduce-scatter the "
                              "gradients and all-gather the updated parameters: with 2-byte parameters that "
                              "is less)"),
            (rs(G) + ag(G), "the all-gather moves gradients (it gathers the updated parameters: param_bytes)"),
            (2 * ar(G, 4, INTRA), "the gradients are all-reduced once per micro-batch (DDP accumulates them "
                                  "and reduces once per step)"),
            (2 * ag(P) + rs(G), "ZeRO-3 gathers once per step: it gathers the parameters for every "
                                "micro-batch's forward and backward (2 all-gathers and a reduce-scatter each)"),
            (2 * (ag(P) + rs(G)), "ZeRO-3 gathers the parameters once per micro-batch: the backward gathers "
                                  "them again"),
            (inter, "the dp group (4 GPUs, one node) is given the link between nodes"),
            (per_stage_without_embeddings[stage][0],
             "the gradients and parameters leave out the embeddings (params_per_gpu as in plan_memory)")])
    expect(plan.dp_bytes, want_bytes, f"dp_bytes, ZeRO-{stage}",
           "RING_SHARE x the size of each collective: (n-1)/n for reduce-scatter and all-gather, 2(n-1)/n "
           "for all-reduce",
           [(1.5 * G, "every ZeRO stage all-reduces the gradients"),
            (2 * 1.5 * G, "the gradients are all-reduced once per micro-batch"),
            (0.75 * (2 * P + G), "ZeRO-3 gathers once per step, not per micro-batch")])


@pytest.mark.exercise("plan_step_time")
def test_each_axis_uses_the_link_its_group_crosses():
    """Nodes of 4: a dp group over 8 GPUs and pipeline neighbours 4 GPUs apart cross nodes; tp = 2 stays inside."""
    params = 4 * TINY.layer_params(2) + TINY.embedding_params(2)
    plan = pl.plan_step_time(TINY, CLUSTER, pl.ParallelConfig(dp=4, tp=2, micro_batches=2))
    expect(plan.dp_comm, ar(2 * params, 4, INTER), "dp_comm, dp = 4 x tp = 2 on nodes of 4",
           "ranks are laid out tp fastest: a dp group spans tp x dp = 8 GPUs, two nodes (axis_link(..., 'dp'))",
           [(ar(2 * params, 4, INTRA), "the dp group's link is the one inside a node (it spans tp x dp GPUs: "
                                       "more than a node here)")])
    plan = pl.plan_step_time(TINY, CLUSTER, pl.ParallelConfig(dp=2, tp=2, pp=2, micro_batches=2))
    message = 2 * 4 * 8 * 2 / 2                                       # b = 2: b s h bytes / tp
    stage_params = 2 * TINY.layer_params(2) + TINY.embedding_params(2)
    expect(plan.dp_comm, ar(2 * stage_params, 2, INTRA), "dp_comm, dp = 2 x tp = 2 x pp = 2",
           "the dp group spans tp x dp = 4 GPUs: inside a node",
           [(ar(2 * stage_params, 2, INTER), "the dp group is given the link between nodes (it fits in a node)")])
    expect(plan.pp_comm, 2 * 2 * pl.p2p_seconds(message, *INTER), "pp_comm, dp = 2 x tp = 2 x pp = 2",
           "neighbouring stages are tp x dp = 4 GPUs apart: two stages need 8 GPUs, more than a node, so the "
           "messages cross nodes (axis_link(..., 'pp'))",
           [(2 * 2 * pl.p2p_seconds(message, *INTRA), "the pipeline messages are given the link inside a node"),
            (2 * 2 * pl.p2p_seconds(2 * message, *INTER), "the message is the whole (b, s, h) activation (each of "
                                                          "the tp ranks sends its 1/tp slice)"),
            (2 * pl.p2p_seconds(message, *INTER), "only one direction is counted (activations go forward, their "
                                                  "gradients come back)")])


@pytest.mark.exercise("plan_step_time")
def test_every_call_pays_the_links_fixed_cost():
    """A cluster with a fixed cost per call and gloo's reduce-scatter: every collective and message pays them (pass each Link whole)."""
    gloo = replace(CLUSTER, call_s=1e-4, reduce_scatter_as_all_reduce=True)
    config = pl.ParallelConfig(dp=2, tp=2, pp=2, micro_batches=2, sequence_parallel=True)   # nodes of 4
    plan = pl.plan_step_time(TINY, gloo, config)
    tp_link, dp_link, pp_link = (pl.axis_link(gloo, config, axis) for axis in ("tp", "dp", "pp"))
    assert tp_link == (1e-6, 1e9, 1e-4, True) and pp_link == (1e-5, 1e8, 1e-4, True)
    activation = 2 * 4 * 8 * 2                                        # b = 2, s = 4, h = 8, bf16
    kinds = pl.tp_collectives_per_layer(config)
    tp_time = lambda link: 2 * 2 * sum(pl.collective_seconds(k, activation, 2, *link)   # noqa: E731
                                       for phase in kinds.values() for k in phase)
    two_fields = lambda link: tuple(link)[:2]                         # noqa: E731
    expect(plan.tp_comm, tp_time(tp_link), "tp_comm with a fixed cost per call and gloo's reduce-scatter",
           "collective_seconds(kind, nbytes, tp, *axis_link(cluster, config, 'tp')): the whole Link, whose "
           "call_s every call pays and whose rule makes a reduce-scatter cost an all-reduce",
           [(tp_time(two_fields(tp_link)), "only the link's latency and bandwidth are passed (the Link's call_s and "
                                           "reduce_scatter_as_all_reduce are left out: pass it whole, *link)"),
            (tp_time(tuple(tp_link)[:3]), "the Link's reduce-scatter rule is left out (pass it whole, *link)"),
            (tp_time(tp_link) / 2, "the tensor-parallel collectives are counted once per step (every one of the m "
                                   "micro-batches issues them)")])
    params = 2 * TINY.layer_params(2) + TINY.embedding_params(2)
    expect(plan.dp_comm, pl.collective_seconds("all_reduce", 2 * params, 2, *dp_link), "dp_comm with a fixed cost per call",
           "collective_seconds(..., *axis_link(cluster, config, 'dp'))",
           [(pl.collective_seconds("all_reduce", 2 * params, 2, *two_fields(dp_link)),
             "the dp link's fixed cost per call is left out (pass the Link whole)")])
    message = activation / 2
    expect(plan.pp_comm, 2 * 2 * pl.p2p_seconds(message, *pp_link), "pp_comm with a fixed cost per message",
           "p2p_seconds(nbytes, *axis_link(cluster, config, 'pp')): every message pays the call's fixed cost",
           [(2 * 2 * pl.p2p_seconds(message, *two_fields(pp_link)), "the pp link's fixed cost per message is left "
                                                                     "out (pass the Link whole)")])


@pytest.mark.exercise("plan_step_time")
def test_pipeline_messages_follow_v_and_tp():
    """Interleaved, v = 4, tp = 2: per micro-batch 2 v messages (v each way) of b s h bytes / tp."""
    model = pl.ModelSpec("deep", layers=8, hidden=8, heads=2, seq=4, vocab=16, global_batch=8)
    config = pl.ParallelConfig(tp=2, pp=2, micro_batches=4, schedule="interleaved 1F1B", virtual_stages=4)
    plan = pl.plan_step_time(model, CLUSTER, config)                  # b = 2, 4 GPUs: one node
    message = 2 * 4 * 8 * 2 / 2
    one = pl.p2p_seconds(message, *INTRA)
    m, v = 4, 4
    expect(plan.pp_bytes, m * 2 * v * message, "pp_bytes, m = 4, v = 4, tp = 2",
           f"each micro-batch crosses each rank boundary v times each way: 2 v messages of b s h e / tp = {message:g} bytes",
           [(m * 2 * message, "interleaving's v is left out (a micro-batch visits each rank v times)"),
            (m * 2 * v * message * 2, "the message is the whole (b, s, h) activation: each of the tp ranks sends "
                                      "its 1/tp slice (Megatron's scatter/gather)"),
            (m * v * message, "only the forward's messages are counted (the gradients go back)")])
    expect(plan.pp_comm, m * 2 * v * one, "pp_comm", "2 v p2p_seconds messages per micro-batch on the pp link",
           [(m * 2 * one, "interleaving's v is left out"),
            (m * 2 * v * pl.p2p_seconds(2 * message, *INTRA), "the message is not divided by tp"),
            (m * v * one, "only one direction is counted")])


@pytest.mark.exercise("plan_step_time")
@pytest.mark.parametrize("schedule,m,v", [("1F1B", 8, 1), ("GPipe", 4, 1), ("ZB-H1", 8, 1),
                                          ("interleaved 1F1B", 8, 2)])
def test_bubble_comes_from_the_schedule_simulation(schedule, m, v):
    """pp = 4: bubble = the simulated makespan - m (t_forward + t_backward), with the plan's own times."""
    model = pl.ModelSpec("deep", layers=8, hidden=8, heads=2, seq=4, vocab=0, global_batch=8)
    plan = pl.plan_step_time(model, CLUSTER, pl.ParallelConfig(pp=4, micro_batches=m, schedule=schedule,
                                                              virtual_stages=v))
    tf, tb = plan.t_forward, plan.t_backward
    want = pipeline_timing(schedule, 4, m, tf, tb, v)["bubble"]
    compute_f = plan.compute / m / 3
    expect(plan.bubble, want, f"bubble, {schedule}, p = 4, m = {m}" + (f", v = {v}" if v > 1 else ""),
           "pipeline_timing(schedule, pp, m, t_forward, t_backward, v)['bubble'] with the plan's own t_forward, "
           "t_backward (compute and messages)",
           [((4 - 1) * (tf + tb), "the bubble is 1F1B's (p-1)(t_F + t_B) for every schedule (ask the simulator)"),
            (4 * (tf + tb), "the bubble is off by one stage: p (t_F + t_B) (it is (p-1)(t_F + t_B) for 1F1B)"),
            ((4 - 1) / (m + 4 - 1) * m * (tf + tb), "the bubble is the idle fraction (p-1)/(m+p-1) times the "
                                                     "ideal time (that fraction is of the makespan)"),
            (lambda: pipeline_timing("1F1B", 4, m, tf, tb)["bubble"], "interleaving is ignored: pass v"),
            (lambda: pipeline_timing(schedule, 4, m, compute_f, 2 * compute_f, v)["bubble"],
             "the bubble is simulated with compute alone (t_forward and t_backward include the messages)")])
    assert plan.pp_comm > 0, "pp > 1: each micro-batch sends its activation forward and its gradient back"
    assert plan.total == pytest.approx(plan.compute + plan.tp_comm + plan.pp_comm + plan.bubble + plan.dp_comm)
