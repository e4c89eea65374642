"""Lab 05 (part 4): a tensor-parallel Transformer block, trained side by side with its dense twin.

Run:  ./run.sh 05      (or: ./run.sh labs/lab05_tp_transformer.py)

The block is x + attn(ln1(x)), then x + mlp(ln2(x)) (pre-norm, as in GPT-2). Megatron-LM splits
both halves the same way (Shoeybi et al. 2019, arXiv:1909.08053, fig. 3):
- attention: the qkv projection is column-parallel, so each rank computes the queries, keys and
  values of n_heads/N whole heads and attends with them alone; the output projection is
  row-parallel and one all-reduce (g) sums the heads' contributions;
- MLP: column-parallel fc1, row-parallel fc2 (labs/lab05_tensor_parallel.py).
Layer norms, residual adds and the block's output stay replicated: every rank computes them on
identical data. Per block: two all-reduces forward (one g per half), whatever the number of heads;
the backward's are counted once the f/g backward passes (the homework) are written. Until then the
lab compares the forward outputs only and reports that the training needs them.
(No dropout here: a real model needs the same random mask on every rank in replicated regions and
different ones on split activations; Megatron keeps separate generator states for that.)
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import runs
from helpers.dist import DistContext, distributed
from helpers.notice import attempt
from helpers.show import table
from helpers.tensors import divide, seeded
from labs.lab05_tensor_parallel import (
    MLP, ColumnParallelLinear, CommLog, RowParallelLinear, compare_training, step_collectives,
    forward_difference, megatron_mlp, sample_batch, worst,
)


class Attention(nn.Module):
    """Causal multi-head self-attention over whichever heads `qkv` produces.

    qkv's output features are ordered head by head, (head, (q, k, v), head_dim), so a contiguous
    chunk of them is a set of whole heads with their q, k and v: column-splitting qkv splits the
    heads across ranks, and the same forward serves the dense and the parallel block."""

    def __init__(self, qkv: nn.Module, proj: nn.Module, head_dim: int):
        super().__init__()
        self.qkv, self.proj, self.head_dim = qkv, proj, head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape                                  # x (B, S, d_model)
        qkv = self.qkv(x).view(batch, seq, -1, 3, self.head_dim)  # (B, S, heads here, 3, hd)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)           # each (B, heads here, S, hd)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))  # (B, S, heads here * hd)


class Block(nn.Module):
    def __init__(self, ln1: nn.Module, attn: Attention, ln2: nn.Module, mlp: MLP):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = ln1, attn, ln2, mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def dense_block(d_model: int, n_heads: int, d_ff: int, *, seed: int = 0, dtype=torch.float32,
                device="cpu") -> Block:
    """The reference block; the same weights on every rank (same seed, built on the CPU)."""
    head_dim = divide(d_model, n_heads, "d_model over the attention heads")  # not a TP split
    with seeded(seed):
        block = Block(nn.LayerNorm(d_model),
                      Attention(nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model), head_dim),
                      nn.LayerNorm(d_model),
                      MLP(nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)))
    return block.to(device=device, dtype=dtype)


def tensor_parallel_block(dense: Block, group=None, log: CommLog | None = None) -> Block:
    """The same block with attention heads and MLP columns split over the group's ranks."""
    head_dim = dense.attn.head_dim
    n_heads = dense.attn.qkv.out_features // (3 * head_dim)
    world_size = torch.distributed.get_world_size(group)
    divide(n_heads, world_size, "attention heads over the tensor-parallel ranks")  # whole heads per rank
    attn = Attention(ColumnParallelLinear.from_dense(dense.attn.qkv, group, log=log),
                     RowParallelLinear.from_dense(dense.attn.proj, group, log=log), head_dim)
    # Layer norms are replicated: a copy on every rank, which must receive the same, complete
    # gradient on every rank to stay identical (what makes it so is the homework's question).
    return Block(copy.deepcopy(dense.ln1), attn, copy.deepcopy(dense.ln2),
                 megatron_mlp(dense.mlp, group, log))


@dataclass(frozen=True)
class Run(runs.Run):
    """The block (d_model, n_heads, d_ff) and its batch, the SGD steps, the dtype's name."""
    batch: int = 4
    seq: int = 64
    d_model: int = 192
    n_heads: int = 24
    d_ff: int = 768
    steps: int = 5
    dtype: str = "float32"
    SMOKE = dict(batch=2, seq=8, d_model=48, d_ff=96, steps=3)


def train_and_count(dense: Block, parallel: Block, log: CommLog, x: torch.Tensor,
                    target: torch.Tensor, steps: int) -> dict:
    """The collectives of one forward+backward, then `steps` SGD steps side by side with the dense
    block. Needs the f/g backward passes."""
    calls = step_collectives(parallel, log, x)
    check = compare_training(dense, parallel, x, target, steps=steps)
    return {"calls": [(c.phase, c.op, list(c.shape)) for c in calls], "check": check,
            "worst": worst(check)}


def run(ctx: DistContext, cfg: Run) -> dict:
    """The dense block and its parallel twin: forward outputs, then (`training`, once the backward
    passes are written) `cfg.steps` SGD steps on the same batch."""
    s = {k: getattr(cfg, k) for k in ("batch", "seq", "d_model", "n_heads", "d_ff", "steps")}
    dtype = getattr(torch, cfg.dtype)
    dense = dense_block(s["d_model"], s["n_heads"], s["d_ff"], dtype=dtype, device=ctx.device)
    log = CommLog()
    parallel = tensor_parallel_block(dense, None, log)
    x, target = sample_batch(s["batch"], s["seq"], s["d_model"], seed=1, dtype=dtype, device=ctx.device)
    return {
        "sizes": s,
        "heads_per_rank": s["n_heads"] // ctx.world_size,
        "qkv_weight_shape": list(parallel.attn.qkv.weight.shape),
        "forward": forward_difference(dense, parallel, x),
        "training": attempt(train_and_count, dense, parallel, log, x, target, s["steps"]),
    }


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        result = run(ctx, cfg)
        s, training = result["sizes"], result["training"]
        ctx.print0(f"block d_model={s['d_model']}, {s['n_heads']} heads ({result['heads_per_rank']} "
                   f"per rank), d_ff={s['d_ff']}, {ctx.world_size} ranks; forward outputs differ by "
                   f"{result['forward']:.2e}")
        if result["forward"] > 1e-4:
            raise RuntimeError(f"the tensor-parallel block's output differs by {result['forward']:.2e}")
        if "unsolved" in training:
            ctx.print0("training side by side needs the f/g backward passes (the homework)")
            ctx.report(**result)
            return
        check = training["check"]
        ctx.print0("collectives per step: " + ", ".join(f"{phase} {op}" for phase, op, _ in training["calls"]))
        if ctx.rank == 0:
            table([{"step": i, "loss dense": a, "loss tensor-parallel": b}
                   for i, (a, b) in enumerate(zip(check["losses_dense"], check["losses_parallel"]))],
                  title="Training the block and its twin", floatfmt=".6f")
        ctx.print0(f"largest difference (outputs, grads, parameters after {s['steps']} steps): "
                   f"{training['worst']:.2e}")
        if training["worst"] > 1e-4:
            raise RuntimeError(f"the tensor-parallel block differs from the dense one by {training['worst']:.2e}")
        ctx.report(**result)


if __name__ == "__main__":
    main()
