"""Lab 13 (the model grows up): notebook 12's byte-level decoder with rotary positions at global
positions, grouped-query attention and mixture-of-experts feed-forward layers (a top-k router, a
shared expert, DeepSeek-V3's bias balancing beside the Switch loss), trained on the same text.

Run:  ./run.sh 13      (this file alone: ./run.sh labs/lab13_model.py; one process trains the
                        reference every composed run of labs/lab13_train.py is checked against)

- Rotary positions (Su et al. 2021, arXiv:2104.09864) at the positions a layer is given
  (`Attention.positions`): under context parallelism a rank holds some of the sequence, and each
  of its rows must turn by the angle of its place in the whole sequence, not in the shard.
- Grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245): `kv_heads` key/value heads,
  each shared by heads / kv_heads query heads; fewer bytes of K and V to keep and to send.
- Mixture of experts (DeepSeek-V3, DeepSeek-AI 2024, arXiv:2412.19437, sec. 2.1.2): each token's
  affinity to expert i is s_i = sigmoid(u . e_i); the top-k experts are chosen by s_i + b_i, where
  the bias b_i only *chooses*; the gates that weigh the chosen experts' outputs are the s_i
  normalised over the chosen ones. After each step b_i moves by `bias_rate` towards balance: down
  if expert i took more than the mean load, up if less ("auxiliary-loss-free load balancing").
  Beside it, the Switch loss E sum_i f_i P_i (Fedus et al. 2021, arXiv:2101.03961, eq. 4; f the
  fraction of assignments, P the mean normalised affinity), coefficient `aux_coef`. One shared
  expert runs on every token (DeepSeekMoE). The first `dense_layers` blocks keep a dense MLP.
- Dropless experts on grouped GEMMs: the (token, choice) rows sorted by expert, then one
  `torch._grouped_mm` per projection over all experts at once (`GroupedExperts`), or a loop over
  experts (`impl="loop"`); labs/lab13_grouped_gemm.py compares them with padded capacity.

Names follow torchtitan's (`layers.<i>.attention.wq`, `layers.<i>.moe.experts.w1`,
`layers.<i>.moe.router.gate`, `layers.<i>.moe.shared_expert.w1`), and the initial values come
from each parameter's name (labs/lab12_model.py's `init_value`), so any layout starts from the
one-process model's weights. Everything a parallel layout changes is an attribute the layout sets
(labs/lab13_parallelize.py): an attention's `positions` and `context`, an MoE's `tp_mesh`, its
experts' `dispatcher`, its router's `load_group`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers import runs
from labs.lab12_model import LMConfig, batch_at, corpus, init_value, lm_loss, split  # noqa: F401

EXPERT_IMPLS = ("grouped", "loop")


@dataclass(frozen=True)
class MoEConfig(LMConfig):
    """Notebook 12's LMConfig and what the grown-up model adds."""
    kv_heads: int = 2             # grouped-query attention: key/value heads
    experts: int = 8              # routed experts per MoE layer
    top_k: int = 2                # experts per token
    expert_ffn: int = 32          # an expert's hidden width (fine-grained experts: narrow)
    shared_ffn: int = 32          # the shared expert's width (0: none)
    dense_layers: int = 1         # the first blocks keep a dense MLP (DeepSeek-V3: the first 3)
    bias_rate: float = 1e-2       # DeepSeek-V3's gamma (0.001 there, over 14.8T tokens; here a run
                                  # is tens of steps): how far a bias moves per step
    aux_coef: float = 0.0         # the Switch loss's coefficient (0: bias balancing alone)
    impl: str = "grouped"         # the experts' kernel: "grouped" (_grouped_mm) or "loop"


# the lab's model at each size: every lab 13 Run's `model` field names one
MODELS = {"full": MoEConfig(dim=64, heads=4, kv_heads=2, layers=4, ffn=128, seq=64, batch=8, experts=8,
                            expert_ffn=32, shared_ffn=32, max_norm=math.inf),
          "smoke": MoEConfig(dim=32, heads=4, kv_heads=2, layers=2, ffn=64, seq=32, batch=4, experts=8,
                             expert_ffn=16, shared_ffn=16, max_norm=math.inf)}


def default_config(model: str | None = None, **changes) -> MoEConfig:
    """MODELS[model] (default: the run's mode, helpers.runs.mode(): smoke under COURSE_SMOKE=1),
    with `changes` applied."""
    base = MODELS[model or runs.mode()]
    return MoEConfig(**{**base.as_dict(), **changes})


def check_model(name: str) -> None:
    """A Run's `model` field: one of MODELS (a ValueError naming them before anything starts)."""
    if name not in MODELS:
        raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {name!r}")


@dataclass(frozen=True)
class Run(runs.Run):
    """The one-process reference (on rank 0): the model (MODELS) trained for `steps` steps."""
    model: str = "full"
    steps: int = 100
    ranks: int | None = 1
    SMOKE = dict(model="smoke", steps=5)
    TOUR = dict(model="smoke", steps=2)      # ./run.sh: a glimpse (every lab in minutes)

    def __post_init__(self):
        check_model(self.model)


# ============================================================================= attention
def rope_at(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of x (b, heads, t, head_dim) at global `positions` (t,): channel pair
    (2i, 2i+1) of the row at position p turned by p * base^(-2i/head_dim). With positions
    0..t-1 it is labs/lab12_model.py's `rope`."""
    d = x.shape[-1]
    inverse = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angle = positions.to(device=x.device, dtype=torch.float32)[:, None] * inverse[None]   # (t, d/2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary positions, no biases. Under tensor parallelism
    wq, wk, wv hold this rank's heads and wo their columns: the head counts come from the shapes.

    `positions`: the global positions of the rows this layer sees (None: 0..t-1, the whole
    sequence). `context`: None (attention over the rows here: the whole sequence in one process)
    or a callable (q, k, v) -> out over the whole sequence held by several ranks
    (labs/lab13_context.py's ring or Ulysses), q (b, heads, t, hd), k and v (b, kv_heads, t, hd)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.heads * self.head_dim, config.dim, bias=False)
        self.positions: torch.Tensor | None = None
        self.context = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:              # x: (b, t, dim)
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        positions = self.positions if self.positions is not None else torch.arange(t)
        if len(positions) != t:
            raise ValueError(f"the attention was given {len(positions)} positions for {t} rows")
        q, k = rope_at(q, positions), rope_at(k, positions)
        if self.context is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out = self.context(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


# ============================================================================= the router
class Router(nn.Module):
    """Top-k routing with DeepSeek-V3's bias: `bias` (a buffer, never trained) changes which
    experts a token chooses and nothing else. `load` counts the assignments of the training
    forwards since the last `update_bias()`; `load_group`: the ranks whose tokens make the global
    batch (None: this process), over which the load is summed."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.top_k, self.num_experts = config.top_k, config.experts
        self.gate = nn.Linear(config.dim, config.experts, bias=False)
        self.register_buffer("bias", torch.zeros(config.experts))
        self.register_buffer("load", torch.zeros(config.experts))
        self.load_group = None

    def forward(self, x: torch.Tensor, gate_weight: torch.Tensor | None = None):
        """x (T, dim) -> (experts (T, k) int64 best first, gates (T, k), assignments per expert (E,),
        normalised affinities (T, E)). `gate_weight` replaces self.gate.weight (tensor parallelism
        passes it through an operator that sums its gradient over the tp ranks)."""
        scores = torch.sigmoid(F.linear(x, self.gate.weight if gate_weight is None else gate_weight))
        _, experts = (scores + self.bias).topk(self.top_k, dim=-1)        # the bias chooses...
        chosen = scores.gather(1, experts)                                  # ...the scores weigh
        gates = chosen / chosen.sum(-1, keepdim=True)
        counts = F.one_hot(experts, self.num_experts).sum((0, 1))         # (E,) static shape
        if self.training and torch.is_grad_enabled():
            self.load += counts.detach().to(self.load.dtype)
        return experts, gates, counts, scores / scores.sum(-1, keepdim=True)

    def global_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Assignments per expert over the whole batch (summed over `load_group`)."""
        total = counts.detach().to(torch.float32).clone()
        if self.load_group is not None:
            dist.all_reduce(total, group=self.load_group)
        return total

    @torch.no_grad()
    def update_bias(self, rate: float) -> torch.Tensor:
        """DeepSeek-V3's rule, once per step: b_i += rate * sign(mean load - load_i) on the load of
        the whole batch. Returns that load and starts a new count."""
        load = self.global_counts(self.load)
        self.bias += rate * torch.sign(load.mean() - load)
        self.load.zero_()
        return load


# ============================================================================= the experts
class GroupedExperts(nn.Module):
    """`num` experts, each an MLP dim -> ffn -> dim (GELU), stored stacked as torchtitan stores
    them: w1 (num, ffn, dim), w2 (num, dim, ffn). forward(rows, counts): rows sorted by expert,
    counts[e] of them for expert e; every row goes through its expert, none is dropped.

    A layout may hold part of them: experts `first` .. `first + num - 1` of the layer (expert
    parallelism) and columns `ffn_slice` of their hidden width (expert tensor parallelism); a
    `dispatcher` (labs/lab13_experts.py) then moves the rows to the ranks that hold their experts."""

    def __init__(self, num: int, dim: int, ffn: int, impl: str = "grouped"):
        super().__init__()
        if impl not in EXPERT_IMPLS:
            raise ValueError(f"impl must be one of {EXPERT_IMPLS}, got {impl!r}")
        self.impl, self.num_experts = impl, num
        self.w1 = nn.Parameter(torch.empty(num, ffn, dim))
        self.w2 = nn.Parameter(torch.empty(num, dim, ffn))
        self.first, self.ffn_slice = 0, (0, ffn)     # what of the layer's experts this module holds
        self.dispatcher = None

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.dispatcher is not None:
            return self.dispatcher(self, rows, counts)
        return self.compute(rows, counts)

    def compute(self, rows: torch.Tensor, counts: torch.Tensor, grad_scale: float = 1.0) -> torch.Tensor:
        """The local experts on rows sorted by local expert (counts: (num,)); their weights'
        gradients multiplied by `grad_scale`."""
        from labs.lab13_experts import scale_grad

        w1, w2 = scale_grad(self.w1, grad_scale), scale_grad(self.w2, grad_scale)
        # torch 2.13's _grouped_mm: float32/bf16/fp16 on the CPU; on a GPU bf16 on sm90 and newer
        grouped = rows.device.type == "cpu" or rows.dtype == torch.bfloat16
        if self.impl == "loop" or rows.shape[0] == 0 or not grouped:
            pieces = rows.split(counts.tolist())
            outs = [F.gelu(p @ w1[e].t()) @ w2[e].t() for e, p in enumerate(pieces)]
            out = torch.cat(outs) if outs else rows.new_zeros(0, w2.shape[1])
            return out + 0.0 * (w1.sum() + w2.sum()) if rows.shape[0] == 0 else out
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        hidden = F.gelu(torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offsets))
        return torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offsets)


class MoE(nn.Module):
    """Routed experts plus a shared expert: out[t] = sum over t's k choices c of gate[t, c] *
    expert_c(x[t]) + shared(x[t]). The (token, choice) rows are sorted by expert (a stable sort:
    token order inside each expert), run through `experts` and added back weighted by the gates.
    `aux_loss` (the Switch loss of this forward) and `counts` (assignments per expert) are kept.

    `tp_mesh` (set by tensor parallelism): the input arrives split along the sequence over the tp
    ranks; it is gathered (every tp rank then routes the same tokens), the experts hold their
    columns of the hidden width, and the partial outputs are summed and split again
    (reduce-scatter), the Megatron pairing applied to the experts (expert tensor parallelism)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.router = Router(config)
        self.experts = GroupedExperts(config.experts, config.dim, config.expert_ffn, config.impl)
        self.shared_expert = (GroupedExperts(1, config.dim, config.shared_ffn, config.impl)
                              if config.shared_ffn else None)
        self.tp_mesh = None
        self.aux_loss = torch.zeros(())
        self.counts = torch.zeros(config.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from labs.lab13_experts import gather_sequence, grad_summed_over, scatter_sequence

        if self.tp_mesh is not None:
            x = gather_sequence(x, self.tp_mesh)
        b, t, dim = x.shape
        tokens = x.reshape(-1, dim)                                           # (T, dim)
        gate_weight = None if self.tp_mesh is None else grad_summed_over(self.router.gate.weight, self.tp_mesh)
        experts, gates, counts, affinity = self.router(tokens, gate_weight)
        k = experts.shape[1]
        order = experts.reshape(-1).argsort(stable=True)                      # (T k) rows by expert
        token = order // k
        out_rows = self.experts(tokens[token], counts)
        weighted = out_rows * gates.reshape(-1)[order].unsqueeze(1)
        out = tokens.new_zeros(tokens.shape).index_add(0, token, weighted)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens, torch.tensor([tokens.shape[0]], device=tokens.device))
        self.counts = counts.detach()
        self.aux_loss = self.switch_loss(counts, affinity)
        out = out.reshape(b, t, dim)
        return scatter_sequence(out, self.tp_mesh) if self.tp_mesh is not None else out

    def switch_loss(self, counts: torch.Tensor, affinity: torch.Tensor) -> torch.Tensor:
        """E sum_i f_i P_i: f from the whole batch's assignments (summed over the router's
        load_group), P the mean normalised affinity of the tokens here. Averaged over the ranks of
        the batch, P is the whole batch's, so the ranks' mean is one process's loss. Under tensor
        parallelism each tp rank holds 1/tp of it (they route the same tokens)."""
        if not self.config.aux_coef:
            return affinity.new_zeros(())
        total = self.router.global_counts(counts)
        share = 1 if self.tp_mesh is None else self.tp_mesh.size()
        return self.config.experts * (total / total.sum() * affinity.mean(0)).sum() / share


# ============================================================================= the model
class Block(nn.Module):
    """x + attention(norm(x)), then x + MLP(norm(x)): a dense MLP (`feed_forward`, notebook 12's)
    in the first `dense_layers` blocks, an MoE (`moe`) after them."""

    def __init__(self, config: MoEConfig, index: int):
        super().__init__()
        from labs.lab12_model import FeedForward

        self.attention_norm = nn.RMSNorm(config.dim)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim)
        dense = index < config.dense_layers
        self.feed_forward = FeedForward(config) if dense else None
        self.moe = None if dense else MoE(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        ffn = self.feed_forward if self.moe is None else self.moe
        return x + ffn(self.ffn_norm(x))


class MoELM(nn.Module):
    """tokens (b, t) -> logits (b, t, vocab), with notebook 12's structure (`layers` a dict keyed
    "0".."L-1", a pipeline stage keeps some and sets the ends it does not own to None: lab 12's
    `pipeline_stage` applies)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.ModuleDict({str(i): Block(config, i) for i in range(config.layers)})
        self.norm = nn.RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def moe_layers(self) -> dict[str, MoE]:
        return {key: block.moe for key, block in self.layers.items() if block.moe is not None}

    def aux_loss(self) -> torch.Tensor:
        """The last forward's Switch losses, summed over this model's MoE layers."""
        losses = [moe.aux_loss for moe in self.moe_layers().values()]
        return sum(losses) if losses else torch.zeros(())

    def update_biases(self) -> dict[str, list[float]]:
        """Each MoE layer's bias step (after the optimizer step); returns each layer's load."""
        return {key: moe.router.update_bias(self.config.bias_rate).tolist()
                for key, moe in self.moe_layers().items()}


def build_model(config: MoEConfig, device: torch.device | str = "cpu") -> MoELM:
    """The whole model on `device`, every parameter from its name (`init_value`); the layouts of
    labs/lab13_parallelize.py cut it up from there."""
    model = MoELM(config).to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_value(name, tuple(p.shape)))
    return model


def parameter_count(config: MoEConfig) -> dict[str, int]:
    """Parameters: "total", "active" per token (the chosen k experts, not all E), "experts"."""
    model = MoELM(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(m.experts.w1.numel() + m.experts.w2.numel() for m in model.moe_layers().values())
    per_expert = 2 * config.dim * config.expert_ffn
    active = total - experts + len(model.moe_layers()) * config.top_k * per_expert
    return {"total": total, "active": active, "experts": experts}


# ============================================================================= one process
def model_loss(model: MoELM, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The training loss: mean cross-entropy plus aux_coef times the MoE layers' Switch losses."""
    loss = lm_loss(logits, targets)
    return loss + model.config.aux_coef * model.aux_loss() if model.config.aux_coef else loss


def train_reference(config: MoEConfig, steps: int, data: torch.Tensor, *, device="cpu",
                    keep_grads: bool = False) -> dict:
    """One process, whole batches: AdamW (clipping to the global norm if max_norm is finite), the
    bias step after each optimizer step. Returns per step the losses (the cross-entropy) and each
    MoE layer's load (assignments per expert), with keep_grads the first step's gradients, and
    the model."""
    model = build_model(config, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    out: dict = {"losses": [], "loads": [], "grads": {}}
    for step in range(steps):
        x, y = (t.to(device) for t in batch_at(data, step, config.batch, config.seq))
        logits = model(x)
        model_loss(model, logits, y).backward()
        out["losses"].append(lm_loss(logits, y).item())
        if keep_grads and step == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if math.isfinite(config.max_norm):     # (the lab's runs do not clip: max_norm = inf)
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_norm)
        optimizer.step()
        optimizer.zero_grad()
        out["loads"].append(model.update_biases())
    out["model"] = model
    return out


def imbalance(load) -> float:
    """max / mean of one layer's load (assignments per expert): 1.0 when balanced, E / k when
    every token picks the same k experts."""
    load = [float(v) for v in load]
    mean = sum(load) / len(load)
    return max(load) / mean if mean else 1.0


def run(ctx, cfg: Run) -> dict:
    """The reference trained on rank 0 (the other ranks, if any, return {})."""
    if ctx.rank != 0:
        return {}
    config = default_config(cfg.model)
    train, _ = split(corpus())
    trained = train_reference(config, cfg.steps, train)
    return {"config": config.as_dict(), "losses": trained["losses"], "parameters": parameter_count(config),
            "imbalance": {k: imbalance(v) for k, v in trained["loads"][-1].items()}}


def main(argv: list[str] | None = None) -> None:
    from helpers.dist import distributed
    from helpers.show import table

    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        out = run(ctx, cfg)
        if not out:
            return
        ctx.report(**out)
        counts, losses = out["parameters"], out["losses"]
        table([out["config"]], title="MoEConfig")
        print(f"{counts['total']:,} parameters, {counts['active']:,} active per token; loss "
              f"{losses[0]:.3f} -> {losses[-1]:.3f} in {cfg.steps} steps; last step's load "
              f"imbalance (max/mean) per MoE layer: "
              f"{ {k: round(v, 2) for k, v in out['imbalance'].items()} }", flush=True)


if __name__ == "__main__":
    main()
