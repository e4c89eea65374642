"""Lab 06, part 2: torch.distributed.pipelining trains a small Transformer LM on 2 stages.

Run:  ./run.sh 06      (labs/lab06_pipeline.py first, then this lab; one stage per rank)

The model (token embedding + sinusoidal positional encoding, pre-norm Transformer blocks, final
norm, output linear) is cut before block layers / p into p stages in two ways:

- tracer frontend: `pipeline(model, mb_args=(example_microbatch,), split_spec={"layers.2":
  SplitPoint.BEGINNING})` traces the model (torch.export) and `build_stage(pipe.get_stage_module(
  rank), rank, pipe.info(), device, group)` wraps this rank's piece;
- manual frontend: each rank deletes the modules it does not own and wraps the rest in
  `PipelineStage(module, rank, num_stages, device, group=group)` (what torchtitan does).

`ScheduleGPipe` or `Schedule1F1B` then runs `step()` every iteration: stage 0 passes the batch, the
last stage the targets; the schedule cuts both into micro-batches. Each micro-batch's backward adds
into .grad, so the gradients are a SUM over micro-batches; `scale_grads=True` divides them by the
number of micro-batches, which makes them the gradient of the mean loss over the whole batch, as
in single-process training of the same model on the same batches (checked here).

What this replaced: `torch.distributed.pipeline.sync.Pipe(model, chunks=8)` (from torchgpipe):
one process drove every GPU of one node, needed the RPC framework, ran GPipe only; deprecated in
PyTorch 2.3 (pytorch#121464), then removed (pytorch#127354) in favour of this package (from PiPPy,
new in 2.4). `chunks=8` became the schedule's `n_microbatches=8`.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import runs
from helpers.dist import distributed
from helpers.tensors import divide, seeded

# Tolerances against single-process training, float32 (helpers/runs.py says why these).
LOSS_RTOL, PARAM_ATOL = runs.LOSS_RTOL, runs.PARAM_ATOL


@dataclass(frozen=True)
class LMConfig:
    """A small language model and its batch: the course's one model config (this lab's TinyLM,
    notebook 09's pipelines; notebook 12's model takes the same names)."""
    vocab: int = 64           # tokens
    dim: int = 64             # model width h
    heads: int = 4
    layers: int = 4
    ffn: int = 256            # MLP width (4 h)
    seq: int = 32             # tokens per sequence (the context)
    batch: int = 16           # sequences per optimizer step (the global batch)
    lr: float = 3e-3          # AdamW, no weight decay
    seed: int = 0             # the weights' and the data's

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PipelinedLM(LMConfig):
    """An LMConfig trained pipelined: each batch cut into num_microbatches, for `steps` steps."""
    num_microbatches: int = 4
    steps: int = 20


@dataclass(frozen=True)
class Run(runs.Run, PipelinedLM):
    """This lab's run: PipelinedLM's fields (the model, its batch, micro-batches, steps)."""
    SMOKE = dict(steps=4)


# ------------------------------------------------------------------------------------ the data
def make_token_batches(config: LMConfig, num_batches: int) -> torch.Tensor:
    """Deterministic offline "language": a Markov chain whose next token is one of 4 successors
    of the current one (fixed random table), so a model can learn it; no download.

    Returns (num_batches, batch, seq + 1) int64: inputs are [..., :-1], targets [..., 1:].
    """
    rng = torch.Generator().manual_seed(config.seed + 7)
    successors = torch.randint(0, config.vocab, (config.vocab, 4), generator=rng)
    count = num_batches * config.batch
    tokens = torch.empty(count, config.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, config.vocab, (count,), generator=rng)
    for t in range(config.seq):
        choice = torch.randint(0, 4, (count,), generator=rng)
        tokens[:, t + 1] = successors[tokens[:, t], choice]
    return tokens.view(num_batches, config.batch, config.seq + 1)


# ----------------------------------------------------------------------------------- the model
class Block(nn.Module):
    """Pre-norm Transformer block: x + attention(norm(x)), then x + MLP(norm(x)); causal."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int):
        super().__init__()
        self.num_heads = num_heads
        self.attn_norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)  # a key bias has zero gradient
        self.proj = nn.Linear(d_model, d_model)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.fc_in = nn.Linear(d_model, d_ff)
        self.fc_out = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # x: (B, T, C)
        B, T, C = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2)
                   for t in (q, k, v))                            # (B, heads, T, C / heads)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_out(F.gelu(self.fc_in(self.mlp_norm(x))))


def sinusoidal_positions(seq_len: int, d_model: int) -> torch.Tensor:
    """(seq_len, d_model) fixed positional encoding of "Attention Is All You Need"."""
    position = torch.arange(seq_len).unsqueeze(1)
    frequency = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
    encoding = torch.zeros(seq_len, d_model)
    encoding[:, 0::2] = torch.sin(position * frequency)
    encoding[:, 1::2] = torch.cos(position * frequency)
    return encoding


class TinyLM(nn.Module):
    """tokens (B, T) -> logits (B, T, vocab). Pieces set to None are skipped, so a pipeline stage
    can drop what it does not own (manual frontend) and keep the same parameter names."""

    def __init__(self, config: LMConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim)
        self.register_buffer("pos_encoding", sinusoidal_positions(config.seq, config.dim),
                             persistent=False)
        # a dict keyed "0".."L-1": deleting a layer keeps the names of the others
        self.layers = nn.ModuleDict({str(i): Block(config.dim, config.heads, config.ffn)
                                     for i in range(config.layers)})
        self.norm = nn.LayerNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:   # first stage: tokens (B, T) -> hidden (B, T, C)
            x = self.tok_embeddings(x) + self.pos_encoding[: x.shape[1]]
        for layer in self.layers.values():
            x = layer(x)
        if self.output is not None:           # last stage: hidden -> logits (B, T, vocab)
            x = self.output(self.norm(x))
        return x


def build_model(config: LMConfig) -> TinyLM:
    with seeded(config.seed):
        return TinyLM(config)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_reference(config: PipelinedLM, device: torch.device | str = "cpu") -> dict:
    """Single process, whole batches: the losses and final parameters pipelining must reproduce
    (on the pipeline's device type, so that both use the same kernels)."""
    model = build_model(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    batches = make_token_batches(config, config.steps).to(device)
    losses = []
    for tokens in batches:
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


# ------------------------------------------------------------------------------ the two frontends
def split_layers(config: LMConfig, num_stages: int) -> list[int]:
    """First layer of stages 1..p-1: an even split of the blocks."""
    per_stage = divide(config.layers, num_stages, "the blocks over the pipeline stages")
    return [stage * per_stage for stage in range(1, num_stages)]


def split_traced(model: TinyLM, config: PipelinedLM, *, rank: int, num_stages: int,
                 device: torch.device, group=None):
    """Tracer frontend: pipeline() + SplitPoint cut the traced model; build_stage wraps our piece.

    Returns (this rank's stage module, a function making a PipelineStage of it, warnings seen).
    """
    from torch.distributed.pipelining import SplitPoint, build_stage, pipeline

    microbatch_size = divide(config.batch, config.num_microbatches,
                             "the batch (sequences) over the micro-batches")
    example = torch.zeros(microbatch_size, config.seq, dtype=torch.long)  # one micro-batch
    split_spec = {f"layers.{i}": SplitPoint.BEGINNING for i in split_layers(config, num_stages)}
    with warnings.catch_warnings(record=True) as caught:   # report what tracing warns about
        warnings.simplefilter("always")
        pipe = pipeline(model, mb_args=(example,), split_spec=split_spec)
    if pipe.num_stages != num_stages:
        raise ValueError(f"split into {pipe.num_stages} stages, expected {num_stages}")
    stage_module = pipe.get_stage_module(rank).to(device)
    notes = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught})
    return stage_module, lambda: build_stage(stage_module, rank, pipe.info(), device, group), notes


def split_manual(model: TinyLM, config: PipelinedLM, *, rank: int, num_stages: int,
                 device: torch.device, group=None):
    """Manual frontend: delete what this rank does not own, wrap the rest in PipelineStage."""
    from torch.distributed.pipelining import PipelineStage

    bounds = [0, *split_layers(config, num_stages), config.layers]
    for i in range(config.layers):
        if not bounds[rank] <= i < bounds[rank + 1]:
            del model.layers[str(i)]
    if rank != 0:
        model.tok_embeddings = None
    if rank != num_stages - 1:
        model.norm, model.output = None, None
    model.to(device)
    # What crosses a stage boundary, (mb, T, C) hidden states, is inferred from the first
    # micro-batch at run time.
    return model, lambda: PipelineStage(model, rank, num_stages, device, group=group), []


FRONTENDS = {"tracer": split_traced, "manual": split_manual}


def schedule_class(name: str):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    classes = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
    if name not in classes:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(classes)}")
    return classes[name]


def train_pipelined(config: PipelinedLM, schedule_name: str, stage_module: nn.Module, make_stage,
                    *, rank: int, world_size: int, device: torch.device) -> dict:
    """Train this rank's stage with torch.distributed.pipelining (same optimizer as the reference).

    Returns the whole-batch losses (last stage: mean of its micro-batch losses) and this stage's
    parameters after training.
    """
    stage = make_stage()
    schedule = schedule_class(schedule_name)(stage, n_microbatches=config.num_microbatches,
                                             loss_fn=lm_loss, scale_grads=True)
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=config.lr)
    losses = []
    for tokens in make_token_batches(config, config.steps).to(device):
        optimizer.zero_grad()
        # the first stage gives the whole batch, the last the targets; the schedule cuts both
        inputs = (tokens[:, :-1],) if rank == 0 else ()
        microbatch_losses: list[torch.Tensor] = []
        is_last = rank == world_size - 1
        targets = {"target": tokens[:, 1:], "losses": microbatch_losses} if is_last else {}
        schedule.step(*inputs, **targets)
        if microbatch_losses:   # equal micro-batches: the whole-batch mean is their mean
            losses.append(torch.stack(microbatch_losses).mean().item())
        optimizer.step()
    params = {n: p.detach().cpu().clone() for n, p in stage_module.named_parameters()}
    return {"losses": losses, "params": params}


def max_param_diff(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    missing = set(params) - set(reference)
    if missing:
        raise ValueError(f"stage parameters not in the model: {sorted(missing)}")
    return max((params[n] - reference[n]).abs().max().item() for n in params)


def tracer_available() -> bool:
    """pipeline() and SplitPoint exist (torch 2.4 to at least 2.13)."""
    try:
        from torch.distributed.pipelining import SplitPoint, pipeline  # noqa: F401
    except ImportError:
        return False
    return True


def planned_runs() -> dict[str, list[str]]:
    """frontend -> schedules to train; manual only if a future torch drops the tracer."""
    if tracer_available():
        return {"tracer": ["GPipe", "1F1B"], "manual": ["1F1B"]}
    return {"manual": ["GPipe", "1F1B"]}


def compare(run: dict, reference: dict) -> dict:
    """This stage's run vs single-process training: loss (last stage) and parameter differences."""
    out = {"losses": run["losses"], "param_names": sorted(run["params"]),
           "max_param_diff": max_param_diff(run["params"], reference["params"])}
    if run["losses"]:
        out["max_loss_rel_diff"] = max(abs(a - b) / abs(b)
                                       for a, b in zip(run["losses"], reference["losses"]))
    return out


def main(argv: list[str] | None = None) -> None:
    config = Run.from_argv(argv)
    with distributed() as ctx:
        is_last = ctx.rank == ctx.world_size - 1
        ctx.print0(f"torch {torch.__version__}: TinyLM {config.layers} layers, width "
                   f"{config.dim}, {ctx.world_size} stages, {config.num_microbatches} "
                   f"micro-batches of {config.batch // config.num_microbatches} sequences")
        reference = train_reference(config, ctx.device)   # every rank checks its own stage
        if not tracer_available():
            ctx.print0("this torch has no pipeline()/SplitPoint: manual PipelineStage only")
        results = {}
        for frontend, schedule_names in planned_runs().items():
            stage_module, make_stage, notes = FRONTENDS[frontend](
                build_model(config), config, rank=ctx.rank, num_stages=ctx.world_size,
                device=ctx.device)
            for note in notes:
                ctx.print0(f"  tracing with pipeline() warned: {note}")
            initial = {k: v.clone() for k, v in stage_module.state_dict().items()}
            for schedule_name in schedule_names:
                stage_module.load_state_dict(initial)   # every run starts from the same weights
                run = train_pipelined(config, schedule_name, stage_module, make_stage,
                                      rank=ctx.rank, world_size=ctx.world_size, device=ctx.device)
                key = f"{schedule_name}/{frontend}"
                results[key] = {**compare(run, reference), "notes": notes}
                if is_last:
                    r = results[key]
                    print(f"{key:12s}: loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}; vs "
                          f"single process: max relative loss diff {r['max_loss_rel_diff']:.1e} "
                          f"(tolerance {LOSS_RTOL:g}), max |param diff| on this stage "
                          f"{r['max_param_diff']:.1e} (tolerance {PARAM_ATOL:g})", flush=True)
        ctx.report(runs=results, reference_losses=reference["losses"], config=config.as_dict(),
                   torch_version=torch.__version__)
        if is_last:
            print(f"single process: loss {reference['losses'][0]:.4f} -> "
                  f"{reference['losses'][-1]:.4f}", flush=True)
        bad = [k for k, r in results.items() if r["max_param_diff"] > PARAM_ATOL
               or r.get("max_loss_rel_diff", 0.0) > LOSS_RTOL]
        if bad:
            raise RuntimeError(f"rank {ctx.rank}: {bad} differ from single-process training "
                               f"beyond the tolerances")


if __name__ == "__main__":
    main()
