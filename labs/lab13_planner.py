"""Lab 13 (a layout chooser; a library of lab 13): every 5-D layout the model's shapes allow on a number of ranks, its
collectives counted per mesh dimension and step, their time and the compute's predicted on a
machine, ranked (`rank_layouts`). labs/lab13_chooser.py ranks the layouts of 8 ranks for this
machine, measured in the launch, runs the top two and says whether the ranking held; and ranks the
layouts of a published cluster's MoE run. Nothing to run alone: `./run.sh labs/lab13_chooser.py`.

What a step costs (`step_calls`), per rank of pipeline stage `stage`, counted as the lab's run
issues them (tests/test_lab13_stack.py holds the counts against the traffic instrument's):
- FSDP2 over dp_shard_cp (F = dp_shard x cp ranks): per unit (each block, the root) an all-gather
  in the forward, another in the backward when it reshards after the forward (torchtitan: not
  with a pipeline), a reduce-scatter of its gradients; HSDP adds an all-reduce of each unit's
  shard over dp_replicate; the experts' units (over dp_replicate) likewise;
- expert parallelism over ep = dp_shard x cp: per MoE layer and micro-batch three all-to-alls
  forward (the counts, the rows, the results) and two backward; each row is k copies of a token's
  activations, (ep-1)/ep of them leave (balanced routing);
- context parallelism over cp: per attention layer and micro-batch, the ring's cp - 1 K/V messages
  forward, cp - 1 again and cp gradient accumulators backward (Ulysses: three all-to-alls each
  way), lab 13's `cp_bytes` per layer;
- tensor parallelism over tp: per block two all-gathers and two reduce-scatters of the sequence
  each way (sequence parallelism), one more pair at the embedding and at the output layer, and
  all-reduces: the loss over the vocabulary (3 per micro-batch), each router's gradient, each
  norm's weight gradient;
- pipelining over pp: an activation out and a gradient back per micro-batch and stage boundary;
- the batch's ranks (dp_cp): the loss and each MoE layer's load, one all-reduce each per step.
A collective costs the alpha-beta time of notebook 09's planner (`collective_seconds`, with the
machine's fixed cost per call), on the link its group crosses (lab 11's `group_link`: ranks tp
fastest, then cp, dp_shard, dp_replicate, pp); the compute is the step's FLOPs over the ranks at
the machine's rate; with a pipeline, 1F1B's bubble stretches the stage's time by (m + pp - 1) / m.
Nothing overlaps. Memory: parameters, gradients and AdamW's state (16 bytes a parameter) as the
layout shards them, plus activations (Korthikanti et al.'s selective-recomputation count), to
say whether a layout fits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from labs.lab09_planner import ClusterSpec, activation_bytes_per_layer, collective_seconds, p2p_seconds
from labs.lab11_planner import all_to_all_seconds, group_link

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def ranks(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def ep(self) -> int:
        return self.dp_shard * self.cp

    @property
    def sizes(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in DIMS}

    @property
    def name(self) -> str:
        used = [f"{d} {getattr(self, d)}" for d in DIMS if getattr(self, d) > 1]
        return " x ".join(used) or "one rank"


@dataclass(frozen=True)
class MoEShape:
    """What the planner needs of a model: lab 13's MoEConfig (`from_config`) or a published one."""
    name: str
    layers: int
    dense_layers: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int
    vocab: int
    seq: int
    batch: int                  # sequences per step

    @classmethod
    def from_config(cls, config, name: str = "lab 13's model") -> "MoEShape":
        c = config
        return cls(name, c.layers, c.dense_layers, c.dim, c.heads, c.kv_heads, c.ffn, c.experts, c.top_k,
                   c.expert_ffn, c.shared_ffn, c.vocab, c.seq, c.batch)

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def attention_params(self) -> int:
        return self.dim * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    def expert_params(self) -> int:
        return 2 * self.dim * self.expert_ffn

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 per active matmul weight (the k chosen experts, the shared
        one, attention, the dense MLPs, the output layer) plus attention's 12 L s dim."""
        moe = self.layers - self.dense_layers
        active = (self.layers * self.attention_params() + self.dense_layers * 2 * self.dim * self.ffn
                  + moe * (self.top_k * self.expert_params() + 2 * self.dim * self.shared_ffn + self.dim * self.experts)
                  + self.dim * self.vocab)
        return 6 * active + 12 * self.layers * self.seq * self.dim


def layout_problem(layout: Layout, shape: MoEShape) -> str:
    """Why the model cannot take `layout` ("" when it can)."""
    L = layout
    checks = [(shape.batch % (L.dp_replicate * L.dp_shard), "the batch over the dp replicas"),
              (shape.seq % (2 * L.cp * L.tp), "the sequence over 2 cp chunks x tp"),
              (shape.heads % L.tp or shape.kv_heads % L.tp, "the heads (kv heads) over tp"),
              (shape.experts % L.ep, "the experts over ep = dp_shard x cp"),
              (shape.layers % L.pp or shape.layers < 2 * L.pp if L.pp > 1 else 0, "the blocks over pp"),
              (shape.expert_ffn % L.tp or shape.ffn % L.tp, "the MLP widths over tp"),
              ((shape.expert_ffn // L.tp) % 4, "a grouped GEMM's rows (16-byte strides)")]
    return "; ".join(why for bad, why in checks if bad)


def candidates(ranks: int, shape: MoEShape, max_tp: int | None = None) -> list[Layout]:
    """Every layout of `ranks` the model's shapes allow."""
    out = []
    divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
    for pp in divisors:
        for r in divisors:
            for s in divisors:
                for c in divisors:
                    t, rest = divmod(ranks, pp * r * s * c)
                    if rest or t < 1 or (max_tp and t > max_tp):
                        continue
                    layout = Layout(pp, r, s, c, t)
                    if layout.ranks == ranks and not layout_problem(layout, shape):
                        out.append(layout)
    return out


def microbatches(layout: Layout, shape: MoEShape, micro_batch_rows: int | None = None) -> int:
    """Micro-batches per step: `micro_batch_rows` sequences each (a cluster's runs: 1, as DeepSeek-V3
    trains), or lab 13's trainer's rule, min(rows of a replica, 2 pp) with a pipeline, else 1."""
    rows = shape.batch // (layout.dp_replicate * layout.dp_shard)
    if micro_batch_rows:
        return max(1, rows // micro_batch_rows)
    return min(rows, 2 * layout.pp) if layout.pp > 1 else 1


# ==================================================================================== the calls
@dataclass(frozen=True)
class Call:
    dim: str              # the mesh dimension whose group runs it
    kind: str             # all_gather, reduce_scatter, all_reduce, all_to_all, send
    nbytes: float         # nccl-tests' size (all-gather: output; reduce-scatter: input); a message's
    group: int            # ranks in the group
    count: float          # calls per step

    @property
    def sent(self) -> float:
        """Bytes a rank sends for all `count` calls (ring algorithms; an all-to-all (n-1)/n)."""
        n = self.group
        share = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
                 "all_to_all": (n - 1) / n, "send": 1.0}[self.kind]
        return self.count * share * self.nbytes


def step_calls(layout: Layout, shape: MoEShape, *, stage: int = 0, element_bytes: int = 4,
               design: str = "ring", reshard_after_forward: bool | None = None,
               micro_batch_rows: int | None = None) -> list[Call]:
    """The collectives and messages one rank of pipeline stage `stage` issues in one training step."""
    L, s, e = layout, shape, element_bytes
    P, R, S, C, T, F = L.pp, L.dp_replicate, L.dp_shard, L.cp, L.tp, L.dp_shard * L.cp
    m = microbatches(L, s, micro_batch_rows)
    rows = s.batch // (R * S) // m                                # sequences per micro-batch
    t = s.seq // C                                                # positions a cp rank holds
    per_stage = s.layers // P
    blocks = range(stage * per_stage, (stage + 1) * per_stage)
    moe = [b for b in blocks if b >= s.dense_layers]
    first, last = stage == 0, stage == P - 1
    reshard = (P == 1) if reshard_after_forward is None else reshard_after_forward
    calls: list[Call] = []

    def add(dim, kind, nbytes, group, count):
        if group > 1 and count:
            calls.append(Call(dim, kind, nbytes, group, count))
    # FSDP units: each block (its experts apart) and the root, sharded over F, replicated over R
    block_bytes = [e * (s.attention_params() / T + 2 * s.dim + (2 * s.dim * s.ffn / T if b < s.dense_layers else
                   s.dim * s.experts + 2 * s.dim * s.shared_ffn / T)) for b in blocks]
    root = e * ((s.vocab * s.dim / T if first else 0) + (s.vocab * s.dim / T + s.dim if last else 0))
    units = block_bytes + [root]
    # forward, and backward if resharded; under a pipeline FSDP keeps a unit whole from its first
    # backward on (stage.py: reshard_after_backward off until the last), measured: m + 1
    gathers = (m + 1 if P > 1 else 2) if reshard else 1
    for size in (u for u in units if u):                          # (a root without parameters: none)
        add("dp_shard_cp", "all_gather", size, F, gathers)
        add("dp_shard_cp", "reduce_scatter", size, F, 1)
        add("dp_replicate", "all_reduce", size / F, R, 1 if F > 1 else 0)
    experts = e * (s.experts // L.ep) * s.expert_params() / T
    for _ in moe:                                                 # the experts' units, over dp_replicate
        add("dp_replicate", "all_gather", experts, R, gathers)
        add("dp_replicate", "reduce_scatter", experts, R, 1)
    # expert parallelism over ep = F: counts, rows, results forward; both back
    rows_bytes = rows * t * s.top_k * s.dim * e
    add("dp_shard_cp", "all_to_all", 8 * s.experts, F, len(moe) * m)
    add("dp_shard_cp", "all_to_all", rows_bytes, F, 4 * len(moe) * m)
    # context parallelism over cp
    kv_block = 2 * rows * (s.kv_heads // T) * t * s.head_dim
    if design == "ring":
        add("cp", "send", kv_block * e, C, 2 * (C - 1) * len(blocks) * m)
        add("cp", "send", kv_block * 4, C, C * len(blocks) * m)                  # fp32 accumulators
    else:
        q_bytes = rows * (s.heads // T) * t * s.head_dim * e
        add("cp", "all_to_all", q_bytes, C, 4 * len(blocks) * m)       # q and the output, both ways
        add("cp", "all_to_all", kv_block * e, C, 2 * len(blocks) * m)  # k and v together, both ways
    # tensor (sequence) parallelism over tp
    seq_bytes = rows * t * s.dim * e
    ends = (1 if first else 0) + (1 if last else 0)
    add("tp", "all_gather", seq_bytes, T, (4 * len(blocks) + ends) * m)
    add("tp", "reduce_scatter", seq_bytes, T, (4 * len(blocks) + ends) * m)
    add("tp", "all_reduce", rows * t * e, T, (3 if last else 0) * m + len(moe) * m + 2 * len(blocks) + (1 if last else 0))
    # pipelining: per micro-batch an activation to the next stage, its gradient to the previous
    boundaries = (0 if first else 1) + (0 if last else 1)
    add("pp", "send", seq_bytes / T, P, boundaries * m)
    add("pp", "all_reduce", 4, P, 1)                              # the loss shared over the stages
    # the batch: the loss, each MoE layer's load
    add("dp_cp", "all_reduce", 4, R * F, (1 if last else 0) + len(moe))
    return calls


# the dimensions a group can be named by, as sets of the five: two names with the same set (its
# dimensions of size 1 left out) are the same ranks, the same group
BASE = {"pp": ("pp",), "dp_replicate": ("dp_replicate",), "dp_shard": ("dp_shard",), "cp": ("cp",), "tp": ("tp",),
        "dp_shard_cp": ("dp_shard", "cp"), "dp_cp": ("dp_replicate", "dp_shard", "cp"),
        "dp": ("dp_replicate", "dp_shard"), "world": DIMS}
LABEL_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp_shard_cp", "dp_cp", "dp", "world")


def dimension_label(name: str, sizes: dict[str, int]) -> str:
    """The label of the group `name` names on a mesh of `sizes`: every name of the same ranks,
    joined by "=" ("cp=dp_shard_cp=dp_cp" when cp is the only data dimension), "dp" and "world"
    only when nothing else names them; an unknown name as it is."""
    if name not in BASE:
        return name

    def ranks(n):
        return frozenset(d for d in BASE[n] if sizes.get(d, 1) > 1)
    same = [n for n in LABEL_ORDER if ranks(n) == ranks(name)]
    return "=".join([n for n in same if n not in ("dp", "world")] or same)


def relabel(summary: dict[str, dict], sizes: dict[str, int]) -> dict[str, dict]:
    """A traffic summary ({dim: {"calls": {kind: n}, "bytes": ..., "sent_bytes": ...}}) with its
    dimensions under `dimension_label`'s names, merged where two names are the same ranks."""
    out: dict[str, dict] = {}
    for dim, t in summary.items():
        d = out.setdefault(dimension_label(dim, sizes), {"calls": {}, "bytes": {}, "sent_bytes": 0.0})
        for key in ("calls", "bytes"):
            for kind, n in t.get(key, {}).items():
                d[key][kind] = d[key].get(kind, 0) + n
        d["sent_bytes"] += t.get("sent_bytes", 0.0)
    return out


def per_dimension(calls: list[Call], sizes: dict[str, int]) -> dict[str, dict]:
    """{dim label: {"calls": {kind: n}, "sent": bytes}}, dims named by `dimension_label`."""
    out: dict[str, dict] = {}
    for c in calls:
        d = out.setdefault(dimension_label(c.dim, sizes), {"calls": {}, "sent": 0.0})
        d["calls"][c.kind] = d["calls"].get(c.kind, 0) + c.count
        d["sent"] += c.sent
    return out


def traffic_rows(measured: dict[str, dict], layout: Layout, shape: MoEShape, **options) -> list[dict]:
    """One row per (dimension, kind): the calls and bytes a rank's step made (`measured`: a relabelled
    traffic summary of stage 0's rank 0) beside `step_calls`' count."""
    planned = per_dimension(step_calls(layout, shape, **options), layout.sizes)
    rows = []
    for dim in sorted(set(measured) | set(planned)):
        m, p = measured.get(dim, {}), planned.get(dim, {})
        for kind in sorted(set(m.get("calls", {})) | set(p.get("calls", {})) - {"recv"}):
            if kind == "recv":
                continue
            rows.append({"dimension": dim, "kind": kind, "calls": m.get("calls", {}).get(kind, 0),
                         "planner's calls": p.get("calls", {}).get(kind, 0)})
        rows.append({"dimension": dim, "kind": "(bytes sent)", "calls": round(m.get("sent_bytes", 0)),
                     "planner's calls": round(p.get("sent", 0))})
    return rows


def rank_groups(sizes: dict[str, int], dims=("tp", "cp", "dp_shard_cp", "dp_replicate", "dp_cp", "pp")) -> list[dict]:
    """Each rank's coordinate on the mesh of `sizes` (torchtitan's order, tp fastest) and its
    group along each of `dims`."""
    import torch

    shape = [sizes.get(d, 1) for d in DIMS]
    grid = torch.arange(math.prod(shape)).reshape(shape)
    rows = []
    for rank in range(grid.numel()):
        where = [int(i) for i in (grid == rank).nonzero()[0]]
        row = {"rank": rank, **{d: where[i] for i, d in enumerate(DIMS) if shape[i] > 1}}
        for name in dims:
            index = tuple(slice(None) if d in BASE[name] else where[i] for i, d in enumerate(DIMS))
            row[f"{name} group"] = sorted(int(r) for r in grid[index].flatten())
        rows.append(row)
    return rows


# ================================================================================== prediction
SPANS = {"tp": ("tp",), "cp": ("tp", "cp"), "dp_shard_cp": ("tp", "cp", "dp_shard"),
         "dp_replicate": ("tp", "cp", "dp_shard", "dp_replicate"),
         "dp_cp": ("tp", "cp", "dp_shard", "dp_replicate"), "pp": DIMS}


def call_seconds(call: Call, layout: Layout, cluster: ClusterSpec) -> float:
    span = math.prod(getattr(layout, d) for d in SPANS[call.dim])
    link = group_link(cluster, span)
    if call.kind == "send":
        one = p2p_seconds(call.nbytes, *link)
    elif call.kind == "all_to_all":
        one = all_to_all_seconds(call.nbytes, call.group, *link)
    else:
        one = collective_seconds(call.kind, call.nbytes, call.group, *link)
    return call.count * one


def predict(layout: Layout, shape: MoEShape, cluster: ClusterSpec, *, element_bytes: int = 4,
            design: str = "ring", micro_batch_rows: int | None = None, recompute: str = "selective") -> dict:
    """Step time (the slowest stage's) and memory per rank of `layout` on `cluster`. recompute
    "full" keeps only each layer's input and recomputes a forward in the backward (4/3 the FLOPs)."""
    m = microbatches(layout, shape, micro_batch_rows)
    flops = shape.flops_per_token() * (4 / 3 if recompute == "full" else 1)
    compute = flops * shape.batch * shape.seq / layout.ranks / cluster.flops_per_s
    worst = None
    for stage in range(layout.pp):
        calls = step_calls(layout, shape, stage=stage, element_bytes=element_bytes, design=design,
                           micro_batch_rows=micro_batch_rows)
        comm = {}
        for c in calls:
            comm[c.dim] = comm.get(c.dim, 0.0) + call_seconds(c, layout, cluster)
        busy = compute + sum(comm.values())
        step = busy * (m + layout.pp - 1) / m if layout.pp > 1 else busy
        if worst is None or step > worst["step_s"]:
            worst = {"stage": stage, "compute_s": compute, "comm_s": comm, "step_s": step,
                     "calls": sum(c.count for c in calls)}
    memory = memory_per_rank(layout, shape, element_bytes, micro_batch_rows, recompute)
    return {"layout": layout.name, "sizes": layout.sizes, **worst, "memory_bytes": memory,
            "fits": memory <= cluster.memory_bytes}


def memory_per_rank(layout: Layout, shape: MoEShape, element_bytes: int = 4, micro_batch_rows: int | None = None,
                    recompute: str = "selective") -> float:
    """16 bytes per parameter a rank keeps (weights, gradients, AdamW, as notebook 08 counts
    them), sharded as the layout shards them; the two largest FSDP units whole (the one running,
    the next one gathered); one stage's activations (`recompute` "selective": Korthikanti et al.'s
    count without the s x s scores; "full": each layer's input) times the micro-batches 1F1B keeps
    in flight."""
    L, s, e = layout, shape, element_bytes
    moe = s.layers - s.dense_layers
    attention_mlp = s.attention_params() + 2 * s.dim * max(s.ffn if s.dense_layers else 0, s.shared_ffn)
    dense = (s.layers * s.attention_params() + s.dense_layers * 2 * s.dim * s.ffn
             + moe * (2 * s.dim * s.shared_ffn) + 2 * s.vocab * s.dim) / L.tp
    local_experts = s.experts // L.ep * s.expert_params() / L.tp          # one layer's, unsharded
    states = 16 * (dense / (L.dp_shard * L.cp) + moe * local_experts / L.dp_replicate
                   + moe * s.dim * s.experts / (L.dp_shard * L.cp)) / L.pp
    whole_units = 2 * e * max(attention_mlp / L.tp, local_experts if moe else 0)
    m = microbatches(L, s, micro_batch_rows)
    rows = s.batch // (L.dp_replicate * L.dp_shard) // m
    layer_acts = (e * (s.seq // L.cp) * rows * s.dim / (L.tp if L.tp > 1 else 1) if recompute == "full" else
                  activation_bytes_per_layer(s.seq // L.cp, rows, s.dim, s.heads, tp=L.tp, sequence_parallel=L.tp > 1,
                                             recompute="selective", element_bytes=e, dropout=False))
    in_flight = min(m, L.pp) if L.pp > 1 else 1
    return states + whole_units + layer_acts * (s.layers // L.pp) * in_flight


def rank_layouts(shape: MoEShape, cluster: ClusterSpec, ranks: int, *, max_tp: int | None = None,
                 **options) -> list[dict]:
    """Every candidate layout's prediction (`predict`'s options), what fits first, then by
    predicted step time."""
    rows = [predict(layout, shape, cluster, **options) for layout in candidates(ranks, shape, max_tp)]
    return sorted(rows, key=lambda r: (not r["fits"], r["step_s"]))
