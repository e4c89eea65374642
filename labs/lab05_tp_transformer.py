"""Lab 05 (part 4): a tensor-parallel Transformer block, trained side by side with its dense twin.

Run:  ./run.sh 05      (or: ./run.sh labs/lab05_tp_transformer.py)

The block is x + attn(ln1(x)), then x + mlp(ln2(x)) (pre-norm, as in GPT-2). Megatron-LM splits
both halves the same way (Shoeybi et al. 2019, arXiv:1909.08053, fig. 3):
- attention: the qkv projection is column-parallel, so each rank computes the queries, keys and
  values of n_heads/N whole heads and attends with them alone; the output projection is
  row-parallel and one all-reduce (g) sums the heads' contributions;
- MLP: column-parallel fc1, row-parallel fc2 (labs/lab05_tensor_parallel.py).
Layer norms, residual adds and the block's output stay replicated: every rank computes them on
identical data. Per block: two all-reduces forward, two backward, whatever the number of heads.
(No dropout here: a real model needs the same random mask on every rank in replicated regions and
different ones on split activations; Megatron keeps separate generator states for that.)
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import pick
from helpers.dist import DistContext, distributed
from helpers.show import table
from labs.lab05_tensor_parallel import (
    MLP, ColumnParallelLinear, CommLog, RowParallelLinear, compare_training, count_collectives,
    divide, megatron_mlp, sample_batch, worst,
)


class Attention(nn.Module):
    """Causal multi-head self-attention over whichever heads `qkv` produces.

    qkv's output features are ordered head by head, [head, (q, k, v), head_dim], so a contiguous
    chunk of them is a set of whole heads with their q, k and v: column-splitting qkv splits the
    heads across ranks, and the same forward serves the dense and the parallel block."""

    def __init__(self, qkv: nn.Module, proj: nn.Module, head_dim: int):
        super().__init__()
        self.qkv, self.proj, self.head_dim = qkv, proj, head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape                                  # x [B, S, d_model]
        qkv = self.qkv(x).view(batch, seq, -1, 3, self.head_dim)  # [B, S, heads here, 3, hd]
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)           # each [B, heads here, S, hd]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))  # [B, S, heads here * hd]


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
    head_dim = divide(d_model, n_heads, "d_model over the heads")  # not a TP split: any n_heads | d
    torch.manual_seed(seed)
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
    divide(n_heads, world_size, "attention heads")  # whole heads per rank, not pieces of one
    attn = Attention(ColumnParallelLinear.from_dense(dense.attn.qkv, group, log=log),
                     RowParallelLinear.from_dense(dense.attn.proj, group, log=log), head_dim)
    # Layer norms are replicated: a copy on every rank, updated identically (their gradients
    # come through f, whose backward all-reduce already made them complete).
    return Block(copy.deepcopy(dense.ln1), attn, copy.deepcopy(dense.ln2),
                 megatron_mlp(dense.mlp, group, log))


SIZES = dict(batch=pick(4, 2), seq=pick(64, 8), d_model=pick(192, 48), n_heads=24,
             d_ff=pick(768, 96))


def run(ctx: DistContext, batch: int = SIZES["batch"], seq: int = SIZES["seq"],
        d_model: int = SIZES["d_model"], n_heads: int = SIZES["n_heads"], d_ff: int = SIZES["d_ff"],
        steps: int = pick(5, 3), dtype=torch.float32) -> dict:
    """Train the dense block and its parallel twin for `steps` SGD steps on the same batch."""
    dense = dense_block(d_model, n_heads, d_ff, dtype=dtype, device=ctx.device)
    log = CommLog()
    parallel = tensor_parallel_block(dense, None, log)
    x, target = sample_batch(batch, seq, d_model, seed=1, dtype=dtype, device=ctx.device)
    calls = count_collectives(parallel, log, x)
    check = compare_training(dense, parallel, x, target, steps=steps)
    return {
        "sizes": dict(batch=batch, seq=seq, d_model=d_model, n_heads=n_heads, d_ff=d_ff, steps=steps),
        "heads_per_rank": n_heads // ctx.world_size,
        "qkv_weight_shape": list(parallel.attn.qkv.weight.shape),
        "calls": [(c.phase, c.op, list(c.shape)) for c in calls],
        "check": check,
        "worst": worst(check),
    }


def main() -> None:
    with distributed() as ctx:
        result = run(ctx)
        s, check = result["sizes"], result["check"]
        ctx.print0(f"block d_model={s['d_model']}, {s['n_heads']} heads ({result['heads_per_rank']} "
                   f"per rank), d_ff={s['d_ff']}, {ctx.world_size} ranks; collectives per step: "
                   + ", ".join(f"{phase} {op}" for phase, op, _ in result["calls"]))
        if ctx.rank == 0:
            table([{"step": i, "loss dense": a, "loss tensor-parallel": b}
                   for i, (a, b) in enumerate(zip(check["losses_dense"], check["losses_parallel"]))],
                  title="Training the block and its twin", floatfmt=".6f")
        ctx.print0(f"largest difference (outputs, grads, parameters after {s['steps']} steps): "
                   f"{result['worst']:.2e}")
        if result["worst"] > 1e-4:
            raise RuntimeError(f"the tensor-parallel block differs from the dense one by {result['worst']:.2e}")
        ctx.report(**result)


if __name__ == "__main__":
    main()
