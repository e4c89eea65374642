"""Lab 09 (planner): memory per GPU and step time of a (dp, tp, pp, ZeRO, micro-batches,
recomputation) configuration, predicted from the model, the cluster and the formulas of the course.

Run:  ./run.sh 09      (this file alone: ./run.sh labs/lab09_planner.py; pure arithmetic: rank 0
                        plans a few configurations of a 1.7B model; labs/lab09_at_scale.py ranks
                        configurations of 7B and 70B models on 64 to 1024 H100s)

The model is a GPT layout (Narayanan et al. 2021, arXiv:2104.04473, sec. 3.3): L layers of width
h with a heads, an MLP of width 4h, learned position embeddings and a tied embedding of V tokens,
12 L h^2 (1 + 13/(12h) + (V + s)/(12 L h)) parameters. Memory per GPU (`plan_memory`): parameters,
gradients and optimizer state, split by tensor and pipeline parallelism and sharded by ZeRO
(notebook 08: `model_state_bytes`), plus activations by Korthikanti et al. 2022 (arXiv:2205.05198,
table 2; `activation_bytes_per_layer`) times the layers of a stage times the micro-batches the
pipeline schedule keeps in flight (the simulator of `labs/lab09_schedules.py`). Step time
(`plan_step_time`): the matmul FLOPs of each micro-batch at the cluster's achievable FLOP/s, each
collective at the alpha-beta cost of notebook 04 on the link its group crosses
(`collective_seconds`: a fixed cost per call, a latency per ring step, the bytes at the link's
bandwidth), the pipeline's bubble from the same simulator, and the data-parallel gradient traffic
at the end of the step. Nothing overlaps: communication is all exposed.
What memory it leaves out (exact on this course's CPU/fp32 runs, not on a GPU cluster): the
logits and the loss on the last stage, that stage's copy of the tied embedding, ZeRO-3's gathered
units while they are alive, communication buffers, the CUDA context and the allocator's
fragmentation.

Exercise (homework): `plan_memory(model, config)` and `plan_step_time(model, cluster, config)`.
Check them with ./run.sh check 09.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from helpers.comm_count import RING_SHARE
from helpers.model_states import model_state_bytes
from helpers.tensors import divide
from labs.lab09_schedules import PLANNER_SCHEDULES, pipeline_timing

GB = 1e9
RECOMPUTE = ("none", "selective", "full")


# ================================================================================ the inputs
@dataclass(frozen=True)
class ModelSpec:
    """A GPT-style decoder and its batch. vocab = 0: no embedding or output layer (a stack of
    layers on vectors, as the 4-rank lab trains); the position embedding counts only with a vocab.

    The defaults are the GPT layout of the formulas (an MLP of 4h, biases, LayerNorm, learned
    positions, the output layer tied to the embedding). Other decoders differ in the options:
    ffn (the MLP's width; 0: 4h), biases, norm ("layernorm": weight and bias; "rmsnorm": a weight),
    positions ("learned": an s x h table; "rotary": no parameters) and tied (False: a separate
    output layer, on the last pipeline stage)."""
    name: str
    layers: int            # L
    hidden: int            # h
    heads: int             # a
    seq: int               # s, tokens per sequence
    vocab: int             # V
    global_batch: int      # sequences per optimizer step
    ffn: int = 0           # the MLP's width; 0: 4h
    biases: bool = True
    norm: str = "layernorm"
    positions: str = "learned"
    tied: bool = True

    @property
    def mlp_width(self) -> int:
        return self.ffn or 4 * self.hidden

    def norm_params(self) -> int:
        """Parameters of one norm: weight and bias (LayerNorm) or a weight (RMSNorm)."""
        return (2 if self.norm == "layernorm" else 1) * self.hidden

    def layer_params(self, tp: int = 1) -> float:
        """Parameters of one layer on one of tp ranks: qkv, output projection, both MLP matrices
        and the qkv and first MLP biases are split ((12h^2 + 7h) / tp in the GPT layout; in general
        4h^2 + 2hf, plus 3h + f with biases); the two norms and the two biases added after a
        row-parallel layer are replicated (6h in the GPT layout)."""
        h, f = self.hidden, self.mlp_width
        split = 4 * h * h + 2 * h * f + ((3 * h + f) if self.biases else 0)
        return split / tp + (2 * h if self.biases else 0) + 2 * self.norm_params()

    def embedding_params(self, tp: int = 1) -> float:
        """What the first pipeline stage holds besides its layers: the token embedding split over
        tp (vocab-parallel; tied, it is also the output layer) plus the position embedding (learned
        positions). 0 without a vocabulary. An untied output layer sits on the last stage
        (`last_stage_params`)."""
        if not self.vocab:
            return 0.0
        return (self.vocab / tp + (self.seq if self.positions == "learned" else 0)) * self.hidden

    def last_stage_params(self, tp: int = 1) -> float:
        """What the last pipeline stage holds besides its layers: an untied output layer split
        over tp (vocab-parallel) and the final norm. The GPT count of the formulas (`params`,
        Narayanan et al.) leaves the final norm out; so does `plan_memory`, which plans stage 0."""
        if not self.vocab:
            return 0.0
        return (0 if self.tied else self.vocab * self.hidden / tp) + self.norm_params()

    @property
    def params(self) -> float:
        untied = 0 if self.tied else self.vocab * self.hidden
        return self.layers * self.layer_params() + self.embedding_params() + untied

    def layer_forward_flops(self, micro_batch: int) -> float:
        """Matmul FLOPs of one layer's forward on b sequences: 24 b s h^2 (the four weight
        matrices; with an MLP of width f, 2 b s (4 h^2 + 2 h f)) + 4 b s^2 h (attention scores
        and their product with the values)."""
        b, s, h = micro_batch, self.seq, self.hidden
        return 2 * b * s * (4 * h * h + 2 * h * self.mlp_width) + 4 * b * s * s * h

    def logits_forward_flops(self, micro_batch: int) -> float:
        return 2 * micro_batch * self.seq * self.hidden * self.vocab


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster: nodes of gpus_per_node GPUs. Collectives inside a node use the intra link,
    groups that span nodes the inter link. Latency is per ring step (an all-reduce on n GPUs
    takes 2(n-1) of them); bandwidth is per direction (busbw's unit, notebook 04).

    call_s is what one collective call or message costs whatever its size, once, on top of its
    ring steps: the software around it (Python, autograd, the backend's setup; a kernel launch on
    a GPU) and, where more ranks than cores share a machine, the wait for the group's ranks to be
    scheduled. The published clusters below leave it at 0 (on GPUs it is microseconds, inside the
    latency they assume); this machine's is measured (labs/lab09_mesh.py). NCCL estimates a
    collective's latency the same way (src/graph/tuning.cc: a base latency per call plus a
    latency per ring step). reduce_scatter_as_all_reduce: the backend runs a reduce-scatter as an
    all-reduce of the whole input and keeps its chunk, so it takes an all-reduce's time (torch's
    gloo backend does: ProcessGroupGloo::reduce_scatter_tensor_coalesced)."""
    name: str
    gpus_per_node: int
    memory_bytes: float             # per GPU
    peak_flops: float               # per GPU, dense, in the training precision
    matmul_efficiency: float        # fraction of the peak the model's matmuls reach
    intra_latency_s: float
    intra_bytes_per_s: float
    inter_latency_s: float
    inter_bytes_per_s: float
    call_s: float = 0.0                         # fixed cost of each collective call or message
    reduce_scatter_as_all_reduce: bool = False  # gloo: a reduce-scatter costs an all-reduce

    @property
    def flops_per_s(self) -> float:
        return self.peak_flops * self.matmul_efficiency


@dataclass(frozen=True)
class ParallelConfig:
    """How a step is split. m micro-batches per data-parallel replica per step (gradient
    accumulation), so a micro-batch holds global_batch / (dp m) sequences. Precisions default to
    mixed-precision Adam (bf16 parameters, gradients and activations, 12 bytes of fp32 master
    weights and moments: the ZeRO paper's 16 bytes per parameter)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0                 # 0 (DDP) .. 3 (FSDP), over the dp ranks
    micro_batches: int = 1              # m
    recompute: str = "none"             # "none", "selective" (attention core) or "full"
    sequence_parallel: bool = False
    schedule: str = "1F1B"              # one of lab09_schedules.PLANNER_SCHEDULES
    virtual_stages: int = 1             # v, for "interleaved 1F1B"
    param_bytes: int = 2
    grad_bytes: int = 2
    optimizer_bytes: int = 12
    activation_bytes: int = 2
    dropout: bool = True

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp


def micro_batch_size(model: ModelSpec, config: ParallelConfig) -> int:
    """b = global_batch / (dp m); ValueError if it does not divide."""
    return divide(model.global_batch, config.dp * config.micro_batches,
                  "the global batch over data-parallel replicas x micro-batches")


def check_config(model: ModelSpec, config: ParallelConfig) -> None:
    """ValueError naming the first thing that does not split evenly or is unknown."""
    divide(model.heads, config.tp, "attention heads over the tensor-parallel ranks")
    layers_here = divide(model.layers, config.pp, "layers over the pipeline stages")
    micro_batch_size(model, config)
    if config.sequence_parallel:
        divide(model.seq, config.tp, "the sequence over the tensor-parallel ranks")
    if config.recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {config.recompute!r}")
    if config.schedule not in PLANNER_SCHEDULES:
        raise ValueError(f"schedule must be one of {PLANNER_SCHEDULES}, got {config.schedule!r}")
    if config.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0..3, got {config.zero_stage}")
    if config.schedule == "interleaved 1F1B" and config.pp > 1:
        divide(layers_here, config.virtual_stages, "a stage's layers over its virtual stages")
        divide(config.micro_batches, config.pp, "micro-batches over the pipeline stages (interleaved)")


# ===================================================================== formulas (given, tested)
def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               element_bytes: int = 2, dropout: bool = True) -> float:
    """Bytes one layer keeps for its backward, per micro-batch, on one of tp ranks: Korthikanti et
    al. 2022 (arXiv:2205.05198, sec. 4 and table 2), with the element size e and dropout (1-byte
    masks) as parameters. With e = 2 and dropout it is the paper's table:
        no recomputation   s b h (10 + 24/t) + 5 a s^2 b / t     (t = 1: s b h (34 + 5 a s / h))
        + sequence par.    s b h 34 / t + 5 a s^2 b / t
        selective          the a s^2 b term (softmax, its dropout mask and output) is recomputed: 0
        full               only the layer's input: 2 s b h (divided by t with sequence
                           parallelism, where the input is split along the sequence)
    In general the s b h part is (4e + 2 masks) replicated (layer-norm inputs, the inputs of qkv
    and of the MLP, two dropout masks; split by t only with sequence parallelism) + 12e split (q,
    k, v, attention output, GeLU input and output), and the s^2 part a s^2 b (e + dropout (1 + e))
    / t. Without dropout the attention matrix is kept once (the softmax output feeds the next
    matmul directly)."""
    s, b, h, a, e, t = seq, micro_batch, hidden, heads, element_bytes, tp
    masks = 1 if dropout else 0
    if recompute == "full":
        return e * s * b * h / (t if sequence_parallel else 1)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    replicated = (4 * e + 2 * masks) / (t if sequence_parallel else 1)
    sbh = s * b * h * (replicated + 12 * e / t)
    attention = 0.0 if recompute == "selective" else a * s * s * b * (e + masks * (1 + e)) / t
    return sbh + attention


class Link(NamedTuple):
    """The link a group crosses, as `axis_link` gives it and `collective_seconds` and
    `p2p_seconds` take it: pass it whole, `collective_seconds(kind, nbytes, n, *link)`."""
    latency_s: float                            # per ring step
    bytes_per_s: float                          # per direction
    call_s: float = 0.0                         # fixed cost of each call (ClusterSpec.call_s)
    reduce_scatter_as_all_reduce: bool = False  # the backend's reduce-scatter is an all-reduce


def collective_seconds(kind: str, nbytes: float, group_size: int, latency_s: float,
                       bytes_per_s: float, call_s: float = 0.0,
                       reduce_scatter_as_all_reduce: bool = False) -> float:
    """Alpha-beta time of one ring collective (notebook 04), plus a fixed cost per call:
    call_s + steps * latency + share * S / bw. S follows nccl-tests (all-gather: the gathered
    output; reduce-scatter: the input), steps are 2(n-1) for an all-reduce and n-1 for an
    all-gather or a reduce-scatter, share the bytes each GPU sends per byte of S
    (helpers.comm_count.RING_SHARE). With reduce_scatter_as_all_reduce (gloo) a reduce-scatter
    of S takes the time of an all-reduce of S. One GPU: no communication."""
    n = group_size
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind == "reduce_scatter" and reduce_scatter_as_all_reduce:
        kind = "all_reduce"
    steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1}[kind]
    return call_s + steps * latency_s + RING_SHARE[kind](n) * nbytes / bytes_per_s


def p2p_seconds(nbytes: float, latency_s: float, bytes_per_s: float, call_s: float = 0.0,
                reduce_scatter_as_all_reduce: bool = False) -> float:
    """One point-to-point message (a pipeline activation or its gradient): call_s + latency +
    bytes / bandwidth. Takes a whole `Link` (`p2p_seconds(nbytes, *link)`; not its last field)."""
    return call_s + latency_s + nbytes / bytes_per_s if nbytes > 0 else 0.0


def axis_link(cluster: ClusterSpec, config: ParallelConfig, axis: str) -> Link:
    """The `Link` a group of `axis` ("tp", "dp" or "pp") crosses: latency and bandwidth of the
    cluster's intra or inter link, and the cluster's per-call cost and reduce-scatter rule. Ranks
    are laid out tp fastest, then dp, then pp (Megatron-LM's order): a tp group spans tp
    consecutive GPUs and a dp group tp*dp, inside a node if that many fit in one; a pipeline
    message goes between neighbouring stages, tp*dp GPUs apart, inside a node when two stages fit
    in one (2 tp dp <= gpus_per_node)."""
    span = {"tp": config.tp, "dp": config.tp * config.dp,
            "pp": config.tp * config.dp * min(config.pp, 2)}[axis]
    inside = span <= cluster.gpus_per_node
    return Link(cluster.intra_latency_s if inside else cluster.inter_latency_s,
                cluster.intra_bytes_per_s if inside else cluster.inter_bytes_per_s,
                cluster.call_s, cluster.reduce_scatter_as_all_reduce)


def tp_collectives_per_layer(config: ParallelConfig) -> dict[str, list[str]]:
    """The tensor-parallel collectives of one layer and micro-batch, each on a full (b, s, h)
    activation: {"forward": [...], "backward": [...]}.
    Without sequence parallelism: one all-reduce after attention and one after the MLP in each
    direction (Megatron's g forward, f backward). With it (Korthikanti et al. 2022, sec. 4.2.2):
    an all-gather before each column-parallel layer and a reduce-scatter after each row-parallel
    one, forward; backward, the reverse pair plus the all-gather that rebuilds the gathered input
    for the weight gradient (only the sequence shard was kept). Full recomputation repeats the
    forward's collectives in the backward pass."""
    if not config.sequence_parallel:
        forward, backward = ["all_reduce"] * 2, ["all_reduce"] * 2
    else:
        forward = ["all_gather", "reduce_scatter"] * 2
        backward = ["all_gather", "reduce_scatter", "all_gather"] * 2
    if config.recompute == "full":
        backward = forward + backward
    return {"forward": forward, "backward": backward}


def narayanan_flops(model: ModelSpec, recompute: bool = True) -> float:
    """FLOPs of one step as Narayanan et al. 2021 count them (eq. 3): 96 B s L h^2 (1 + s/(6h) +
    V/(16 L h)) with full recomputation (the per-GPU teraFLOP/s of their table 1); without it,
    72 B s L h^2 (1 + s/(6h) + V/(12 L h)) (the model FLOPs behind MFU)."""
    B, s, L, h, V = model.global_batch, model.seq, model.layers, model.hidden, model.vocab
    if recompute:
        return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


# ===================================================================================== results
@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU on the most loaded GPU (pipeline stage 0)."""
    parameters: float
    gradients: float
    optimizer_state: float
    activations: float
    params_per_gpu: float           # parameters this GPU's stage holds, split by tp (before ZeRO)
    microbatches_in_flight: float   # micro-batches of activations held at the peak (schedule)

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state + self.activations


@dataclass(frozen=True)
class StepTimePlan:
    """Seconds of one optimizer step, every term exposed (nothing overlaps)."""
    t_forward: float        # one micro-batch through one stage: compute + tp + pp messages
    t_backward: float
    compute: float          # m * (forward + backward compute) on one GPU
    tp_comm: float          # m * the tensor-parallel collectives
    pp_comm: float          # m * the stage's point-to-point messages
    bubble: float           # the schedule's idle time: simulated makespan - m (t_forward + t_backward)
    dp_comm: float          # gradient all-reduce (ZeRO: reduce-scatter + all-gather) at the end
    tp_bytes: float         # bytes this GPU sends per step on each axis
    pp_bytes: float
    dp_bytes: float

    @property
    def total(self) -> float:
        return self.compute + self.tp_comm + self.pp_comm + self.bubble + self.dp_comm


# ===================================================================================== exercise
def plan_memory(model: ModelSpec, config: ParallelConfig) -> MemoryPlan:
    """Exercise (plan_memory): predict the bytes held per GPU on pipeline stage 0.

    - params_per_gpu: the stage's L/pp layers, `model.layer_params(tp)` each, plus
      `model.embedding_params(tp)` (the first stage holds the embeddings);
    - parameters, gradients, optimizer state: notebook 08's `model_state_bytes(params_per_gpu,
      dp, zero_stage, param_bytes, grad_bytes, optimizer_bytes)`;
    - activations: `activation_bytes_per_layer` for one micro-batch (b = micro_batch_size(...),
      config's tp, sequence parallelism, recomputation, activation_bytes, dropout) times the
      stage's layers times the micro-batches in flight at the peak: `pipeline_timing(schedule,
      pp, m, 1.0, 2.0, v)["peak_held"]` with more than one stage, 1 with one stage (gradient
      accumulation runs one micro-batch at a time).
    Start with `check_config` (a ValueError for configurations that do not split).
    """
    ### BEGIN SOLUTION
    check_config(model, config)
    b = micro_batch_size(model, config)
    layers_here = model.layers // config.pp
    params = layers_here * model.layer_params(config.tp) + model.embedding_params(config.tp)
    states = model_state_bytes(params, config.dp, config.zero_stage, config.param_bytes,
                               config.grad_bytes, config.optimizer_bytes)
    in_flight = 1.0
    if config.pp > 1:
        in_flight = pipeline_timing(config.schedule, config.pp, config.micro_batches, 1.0, 2.0,
                                    config.virtual_stages)["peak_held"]
    per_layer = activation_bytes_per_layer(
        model.seq, b, model.hidden, model.heads, tp=config.tp,
        sequence_parallel=config.sequence_parallel, recompute=config.recompute,
        element_bytes=config.activation_bytes, dropout=config.dropout)
    return MemoryPlan(parameters=states["parameters"], gradients=states["gradients"],
                      optimizer_state=states["optimizer state"],
                      activations=per_layer * layers_here * in_flight,
                      params_per_gpu=params, microbatches_in_flight=in_flight)
    ### END SOLUTION


def plan_step_time(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig) -> StepTimePlan:
    """Exercise (plan_step_time): predict one step's time on stage 0, term by term.

    Per micro-batch (b sequences) on one stage (L/pp layers), with F = cluster.flops_per_s:
    - compute: forward = (L/pp layer_forward_flops(b) + logits_forward_flops(b) / pp) / tp / F
      (the output layer's FLOPs spread over the stages); backward = twice that, plus, with
      recomputation, the layers' forward again ("full") or their attention core,
      L/pp * 4 b s^2 h / tp ("selective");
    - tensor parallel: L/pp times each collective of `tp_collectives_per_layer(config)` on a
      (b, s, h) activation of activation_bytes, `collective_seconds` over tp GPUs on the tp link
      (`axis_link`; a `Link` is passed whole, `collective_seconds(kind, nbytes, n, *link)`, so
      its per-call cost and reduce-scatter rule count too), forward ones into the forward,
      backward ones into the backward;
    - pipeline (pp > 1): v messages of b s h activation_bytes / tp (each stage sends its tp-th
      slice, Megatron's scatter/gather) per micro-batch each way, `p2p_seconds` on the pp link
      (`p2p_seconds(nbytes, *link)`), into the forward and into the backward;
    - t_forward, t_backward: the sums above; the bubble: `pipeline_timing(schedule, pp, m,
      t_forward, t_backward, v)["bubble"]` (0 with one stage);
    - data parallel (dp > 1), G = params_per_gpu * grad_bytes, P = params_per_gpu * param_bytes
      (params_per_gpu as in plan_memory), over dp GPUs on the dp link: ZeRO 0 one all-reduce of
      G; 1 and 2 a reduce-scatter of G and an all-gather of P; 3 per micro-batch two all-gathers
      of P (forward, backward) and a reduce-scatter of G.
    compute, tp_comm and pp_comm are m times their per-micro-batch sums; *_bytes are the bytes
    this GPU sends per step on that axis (RING_SHARE times each collective's size; each message).
    """
    ### BEGIN SOLUTION
    check_config(model, config)
    b, m, tp, v = micro_batch_size(model, config), config.micro_batches, config.tp, config.virtual_stages
    layers_here = model.layers // config.pp
    flops_per_s = cluster.flops_per_s
    forward_flops = (layers_here * model.layer_forward_flops(b)
                     + model.logits_forward_flops(b) / config.pp) / tp
    extra = {"none": 0.0, "selective": layers_here * 4 * b * model.seq ** 2 * model.hidden / tp,
             "full": layers_here * model.layer_forward_flops(b) / tp}[config.recompute]
    compute_f, compute_b = forward_flops / flops_per_s, (2 * forward_flops + extra) / flops_per_s

    activation = b * model.seq * model.hidden * config.activation_bytes
    tp_link = axis_link(cluster, config, "tp")
    tp_time = {phase: layers_here * sum(collective_seconds(k, activation, tp, *tp_link) for k in kinds)
               for phase, kinds in tp_collectives_per_layer(config).items()}
    tp_sent = sum(layers_here * RING_SHARE[k](tp) * activation for kinds in
                  tp_collectives_per_layer(config).values() for k in kinds) if tp > 1 else 0.0
    messages = v if config.pp > 1 else 0
    pp_message = p2p_seconds(activation / tp, *axis_link(cluster, config, "pp")) if messages else 0.0

    t_forward = compute_f + tp_time["forward"] + messages * pp_message
    t_backward = compute_b + tp_time["backward"] + messages * pp_message
    bubble = 0.0
    if config.pp > 1:
        bubble = pipeline_timing(config.schedule, config.pp, m, t_forward, t_backward, v)["bubble"]

    params = layers_here * model.layer_params(tp) + model.embedding_params(tp)
    grads, weights = params * config.grad_bytes, params * config.param_bytes
    if config.zero_stage == 0:
        dp_ops = [("all_reduce", grads)]
    elif config.zero_stage in (1, 2):
        dp_ops = [("reduce_scatter", grads), ("all_gather", weights)]
    else:
        dp_ops = [("all_gather", weights), ("all_gather", weights), ("reduce_scatter", grads)] * m
    dp_link = axis_link(cluster, config, "dp")
    dp_time = sum(collective_seconds(k, n, config.dp, *dp_link) for k, n in dp_ops)
    dp_sent = sum(RING_SHARE[k](config.dp) * n for k, n in dp_ops) if config.dp > 1 else 0.0
    return StepTimePlan(
        t_forward=t_forward, t_backward=t_backward, compute=m * (compute_f + compute_b),
        tp_comm=m * (tp_time["forward"] + tp_time["backward"]), pp_comm=m * 2 * messages * pp_message,
        bubble=bubble, dp_comm=dp_time, tp_bytes=m * tp_sent,
        pp_bytes=m * 2 * messages * activation / tp, dp_bytes=dp_sent)
    ### END SOLUTION


# ========================================================================= a published cluster
# Narayanan et al. 2021 (arXiv:2104.04473, sec. 5): Selene, DGX A100 nodes of 8 80-GB A100s
# (312 TFLOP/s bf16 peak), NVLink 3 (600 GB/s both ways per GPU, A100 datasheet) and eight 200 Gb/s
# HDR InfiniBand adapters per node (25 GB/s per GPU).
A100_SELENE = ClusterSpec(
    "A100 80GB (Selene), 8 per node, NVLink + 200 Gb/s InfiniBand", gpus_per_node=8,
    memory_bytes=80 * GB, peak_flops=312e12, matmul_efficiency=0.7,
    intra_latency_s=1e-6, intra_bytes_per_s=300e9, inter_latency_s=5e-6, inter_bytes_per_s=25e9)


def main() -> None:
    from helpers.dist import distributed
    from helpers.notice import attempt, notice_if_unsolved, solved
    from helpers.show import table

    model = ModelSpec("GPT 1.7B (Narayanan et al. table 1)", 24, 2304, 24, 2048, 51200, 512)
    configs = {"1 GPU": ParallelConfig(micro_batches=512, recompute="full"),
               "dp 32": ParallelConfig(dp=32, micro_batches=16, recompute="full"),
               "dp 8 x tp 4, sp": ParallelConfig(dp=8, tp=4, micro_batches=64, sequence_parallel=True,
                                                 recompute="selective"),
               "dp 8 x pp 4, ZB-H1": ParallelConfig(dp=8, pp=4, micro_batches=64, schedule="ZB-H1")}
    with distributed() as ctx:
        if ctx.rank != 0:        # pure arithmetic: one rank is enough
            return
        rows = {name: attempt(lambda c=c: {"GB per GPU": plan_memory(model, c).total / GB,
                                           "step s": plan_step_time(model, A100_SELENE, c).total})
                for name, c in configs.items()}
        ctx.report(rows=rows)
        with notice_if_unsolved():
            table([{"configuration": name, **solved(row)} for name, row in rows.items()], floatfmt=".3g",
                  title=f"{model.name} on {A100_SELENE.name}")

if __name__ == "__main__":
    main()
