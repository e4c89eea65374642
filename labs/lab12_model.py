"""Lab 12 (the model and its data): a byte-level decoder-only language model, built without
memory on the meta device, trained on the Python standard library's own source files.

Run:  ./run.sh 12      (this file alone: ./run.sh labs/lab12_model.py; one process trains the
                        reference the composed runs of labs/lab12_train.py are checked against,
                        and writes a sample)

- The data: the `.py` files of the standard library this Python ships (`sysconfig`'s "stdlib"
  folder), in sorted order, read as bytes: megabytes of real text, the same on every rank and on
  every run of this machine, no download. Bytes are the tokens (vocabulary 256); the last tenth
  is held out for the loss curve.
- The model: pre-norm Transformer blocks (RMSNorm, causal attention with rotary positions, a GELU
  MLP), the layout and parameter names of torchtitan's Llama (`tok_embeddings`, `layers.<i>.
  attention.wq`, `feed_forward.w1`, `norm`, `output`), so its parallelisation plan reads as
  torchtitan's. `layers` is a dict keyed "0".."L-1": a pipeline stage deletes the blocks it does
  not own (and sets `tok_embeddings`, `norm`, `output` to None) and the others keep their names.
- Initialisation by name: `init_weights()` fills every parameter with the values
  `init_value(name, shape)` gives its full tensor (a generator seeded by the name), copying only
  the rows and columns this rank holds. So a model built on the meta device (no memory), then
  sharded any way (tensor-parallel, FSDP, a pipeline stage) and materialised with `to_empty`,
  starts from exactly the weights of the one-process model: the check of every composed run
  compares like with like, and a rank never holds more than its shards plus one full parameter.
"""
from __future__ import annotations

import functools
import math
import os
import sysconfig
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import pick

LAB_NPROC = 1     # ./run.sh 12 runs this file on one rank: it is the one-process reference
# Wrappers that put a prefix into parameter names (activation checkpointing; FSDP1) and what
# `init_weights` strips to find the model's own name. FSDP2 (`fully_shard`) keeps the names.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


@dataclass(frozen=True)
class LMConfig:
    """The model's shape and the training run's batch."""
    vocab: int = 256          # bytes
    dim: int = 64             # model width h
    heads: int = 4
    layers: int = 4
    ffn: int = 256            # MLP width
    seq: int = 64             # tokens per sequence (the context)
    batch: int = 8            # sequences per optimizer step (the global batch)
    lr: float = 3e-3          # AdamW, no weight decay
    max_norm: float = 1.0     # gradient clipping: the global norm

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def as_dict(self) -> dict:
        return asdict(self)


def default_config() -> LMConfig:
    """The lab's model (smoke mode: a smaller one)."""
    return pick(LMConfig(), LMConfig(dim=32, heads=4, layers=4, ffn=64, seq=32, batch=8))


# ========================================================================================= model
def rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021, arXiv:2104.09864) of x (b, heads, t, head_dim):
    each pair of channels (2i, 2i+1) at position p turned by the angle p * base^(-2i/head_dim)."""
    t, d = x.shape[-2], x.shape[-1]
    inverse = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angle = torch.arange(t, dtype=torch.float32, device=x.device)[:, None] * inverse[None]  # (t, d/2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal self-attention with rotary positions, no biases. Under tensor parallelism wq, wk,
    wv hold this rank's heads (column-parallel) and wo their rows (row-parallel): `forward` reads
    the number of heads from the shapes, so the same code runs the whole layer or its shard."""

    def __init__(self, config: LMConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:             # x: (b, t, dim)
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2)   # (b, heads here, t, hd)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, config: LMConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn, bias=False)
        self.w2 = nn.Linear(config.ffn, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, config: LMConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class ByteLM(nn.Module):
    """tokens (b, t) int64 -> logits (b, t, vocab). A pipeline stage sets the parts it does not
    own to None: without `tok_embeddings` it takes hidden states (b, t, dim), without `output`
    it returns them."""

    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.ModuleDict({str(i): Block(config) for i in range(config.layers)})
        self.norm = nn.RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self) -> None:
        """Give every parameter (this rank's shard of it) its value from `init_value`."""
        for name, param in self.named_parameters():
            fill_shard(param, init_value(canonical_name(name), tuple(param.shape)))


def build_model(config: LMConfig, device: torch.device | str = "meta") -> ByteLM:
    """The model on `device`; on "meta" (the default) its parameters take no memory until
    `to_empty(device=...)` and `init_weights()`."""
    with torch.device(device):
        model = ByteLM(config)
    if torch.device(device).type != "meta":
        model.init_weights()
    return model


def canonical_name(name: str) -> str:
    """A parameter's name in the plain model: wrapper prefixes removed."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def init_value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The initial value of parameter `name` (its full tensor, float32, on the CPU): norms' weights
    1, everything else N(0, 1/fan_in) from a generator seeded by the name (CRC-32), so it does not
    depend on which other parameters exist or in which order they are made."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) / math.sqrt(shape[-1])


def fill_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy into `param` its part of `full`: all of it for a plain tensor, this rank's shard for a
    DTensor (the shard's shape and offset in the full tensor from its mesh and placements)."""
    if not hasattr(param, "device_mesh"):    # a plain tensor
        param.copy_(full)
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = param.to_local()
    if local.numel():
        local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape))])


def parameter_count(config: LMConfig) -> int:
    """Parameters of the whole model: embedding + L blocks (4 h^2 attention, 2 h f MLP, 2 h norms)
    + final norm + output layer."""
    h = config.dim
    return config.vocab * h + config.layers * (4 * h * h + 2 * h * config.ffn + 2 * h) + h + h * config.vocab


def model_flops_per_token(config: LMConfig) -> float:
    """Training FLOPs per token, forward + backward (3x the forward): 6 per weight of the matmuls
    (the embedding is a lookup: none) plus attention's scores and weighted sum, 6 * 2 t h per
    layer counted in full, without the causal half: PaLM's 6N + 12 L H Q T (Chowdhery et al. 2022,
    arXiv:2204.02311, appendix B; H Q = h here). Kaplan et al. 2020 (arXiv:2001.08361, table 1)
    count attention as 2 n_layer n_ctx d_attn per forward token, 6 L t h for training: half of it."""
    h, t = config.dim, config.seq
    matmul_weights = config.layers * (4 * h * h + 2 * h * config.ffn) + h * config.vocab
    return 6 * matmul_weights + 12 * config.layers * t * h


# ========================================================================================== data
@functools.lru_cache(maxsize=2)
def corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """The standard library's .py files (sorted by name) concatenated, up to max_bytes, as a
    uint8 tensor: the text every run trains on (read once per process; do not change it)."""
    root = sysconfig.get_paths()["stdlib"]
    data = bytearray()
    for name in sorted(f for f in os.listdir(root) if f.endswith(".py")):
        with open(os.path.join(root, name), "rb") as f:
            data += f.read()
        if len(data) >= max_bytes:
            break
    return torch.frombuffer(data[:max_bytes], dtype=torch.uint8).clone()


def split(data: torch.Tensor, held_out: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(training bytes, held-out bytes): the last `held_out` of the text is never trained on."""
    cut = int(len(data) * (1 - held_out))
    return data[:cut], data[cut:]


def batch_at(data: torch.Tensor, step: int, batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step `step`: `batch` windows of seq + 1 bytes at random offsets drawn
    from (seed, step) alone, so a resumed run gets the batches the lost steps would have got.
    Returns inputs and targets, (batch, seq) int64 each (targets: the inputs shifted by one)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
    windows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: logits (b, t, vocab), targets (b, t)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ==================================================================== one process: the reference
def train_reference(config: LMConfig, steps: int, data: torch.Tensor, *, start: dict | None = None,
                    device: torch.device | str = "cpu", first_step: int = 0) -> dict:
    """One process, whole batches, AdamW and clipping to the global norm: what every composed
    run must reproduce. `start` = {"model": state dict, "optimizer": state dict} resumes.
    Returns the losses and gradient norms of each step, the model and the optimizer."""
    model = build_model(config, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    if start is not None:
        model.load_state_dict(start["model"])
        optimizer.load_state_dict(start["optimizer"])
    losses, norms = [], []
    for step in range(first_step, first_step + steps):
        x, y = (t.to(device) for t in batch_at(data, step, config.batch, config.seq))
        loss = lm_loss(model(x), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms, "model": model, "optimizer": optimizer}


@torch.no_grad()
def held_out_loss(model: nn.Module, data: torch.Tensor, config: LMConfig, batches: int = 4) -> float:
    """Mean loss of a whole model on `batches` fixed held-out batches."""
    losses = [lm_loss(model(x), y).item() for x, y in
              (batch_at(data, i, config.batch, config.seq, seed=1) for i in range(batches))]
    return sum(losses) / len(losses)


@torch.no_grad()
def generate(model: nn.Module, prompt: str, new_bytes: int, config: LMConfig, temperature: float = 0.8,
             seed: int = 0) -> str:
    """Continue `prompt` by `new_bytes` bytes sampled from a whole model (one process), the
    context cut to the last `config.seq` bytes; undecodable bytes shown as U+FFFD."""
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    tokens = list(prompt.encode())
    for _ in range(new_bytes):
        context = torch.tensor([tokens[-config.seq:]], device=device)
        logits = model(context)[0, -1].float().cpu() / temperature
        tokens.append(int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
    return bytes(tokens).decode("utf-8", errors="replace")


def main() -> None:
    from helpers.dist import distributed
    from helpers.show import table

    config = default_config()
    steps = pick(200, 10)
    with distributed() as ctx:
        if ctx.rank != 0:     # one process is the point: the other ranks wait
            return
        data = corpus()
        train, held = split(data)
        first = held_out_loss(build_model(config, "cpu"), held, config)
        run = train_reference(config, steps, train, device=ctx.device)
        model = run["model"]
        last = held_out_loss(model, held, config)
        ctx.report(config=config.as_dict(), losses=run["losses"], held_out=[first, last],
                   corpus_bytes=len(data), parameters=parameter_count(config))
        table([{"bytes of text": len(data), "parameters": parameter_count(config), "steps": steps,
                "train loss first": run["losses"][0], "train loss last": run["losses"][-1],
                "held-out loss before": first, "held-out loss after": last}],
              title="one process, the reference of lab 12", floatfmt=".4g")
        print("sample:", repr(generate(model, "def ", 120, config)), flush=True)


if __name__ == "__main__":
    main()
