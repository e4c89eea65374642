"""Lab 09 (sequence parallelism): tensor parallelism's replicated activations split along the
sequence, with reduce-scatter + all-gather in place of all-reduce. Checked against one process.

Run:  ./run.sh 09      (this file alone: ./run.sh labs/lab09_sequence_parallel.py; tp = all ranks)

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
arXiv:2205.05198, sec. 4.2.2. In notebook 05's tensor-parallel block every rank holds the whole
(B, S, C) activation around the layer norms and residual adds: those parts (4 of 16 elements per
token and channel in fp32 here; 10 of 34 bytes in the paper's fp16 with dropout) are replicated
t times. Sequence parallelism keeps them split along the sequence, (B, S/t, C) per rank:

- before a column-parallel layer, an all-gather along the sequence rebuilds (B, S, C) (the
  paper's g; its backward is a reduce-scatter);
- after a row-parallel layer, a reduce-scatter along the sequence both sums the partial products
  and splits the result (the paper's g-bar; its backward is an all-gather).

An all-reduce *is* a reduce-scatter followed by an all-gather (notebook 04), so the forward sends
what tensor parallelism sends. The gathered input of a column-parallel layer is not kept: only
this rank's sequence shard is, and the backward gathers it again for the weight gradient (the
paper's choice, overlapped there; here it costs one more all-gather per column layer).
Parameters that every rank holds whole (layer norms, the biases added after a reduce-scatter) now
see only S/t positions: their gradients must be summed over the tensor-parallel ranks
(`sync_replicated_grads`).

The layers reuse notebook 05's `ColumnParallelLinear` / `RowParallelLinear` (their shards and
`from_dense`) and its `Block`, `MLP` and `Attention`; only the communication differs.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers import runs
from helpers.comm_count import count_collectives, summarize
from helpers.comm_bench import reduce_scatter_single
from helpers.dist import DistContext, distributed
from helpers.memory import SavedTensorBytes
from helpers.notice import attempt
from helpers.show import table
from helpers.tensors import divide, seeded
from labs.lab05_tensor_parallel import (MLP, ColumnParallelLinear, RowParallelLinear,
                                        max_param_diffs, shard)
from labs.lab05_tp_transformer import Attention, Block, dense_block, tensor_parallel_block


# ================================================================== sequence collectives
def all_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, S/t, C) on each rank -> (B, S, C), rank r's piece at positions r S/t ... (r+1) S/t - 1."""
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return torch.cat(pieces, dim=1)


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, S, C) partial sums on each rank -> (B, S/t, C): this rank's positions, summed."""
    t = dist.get_world_size(group)
    divide(x.shape[1], t, "the sequence over the tensor-parallel ranks")
    stacked = torch.cat(x.chunk(t, dim=1), dim=0).contiguous()        # (t B, S/t, C): rank-major
    out = torch.empty_like(stacked[: x.shape[0]])
    reduce_scatter_single(out, stacked, group=group)
    return out


def sequence_shard(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of x (B, S, ...) along the sequence (a copy)."""
    return shard(x, 1, dist.get_rank(group), dist.get_world_size(group))


# ============================== Korthikanti et al.'s g (fused with the linear) and g-bar
class GatherSequenceLinear(torch.autograd.Function):
    """y = all_gather_sequence(x) W^T + b, keeping only x (B, S/t, C_in) for the backward.

    Backward: gather x again for dL/dW; reduce-scatter dL/d(gathered x) back to the shards."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather_sequence(x, group), weight, bias)    # (B, S, out/t)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        gathered = all_gather_sequence(x, ctx.group)                     # (B, S, C_in) again
        grad_x = reduce_scatter_sequence(grad_y @ weight, ctx.group)     # (B, S/t, C_in)
        grad_w = grad_y.flatten(0, -2).T @ gathered.flatten(0, -2)
        grad_b = grad_y.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class ReduceScatterToSequence(torch.autograd.Function):
    """Korthikanti et al.'s g-bar: reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, partial, group):
        ctx.group = group
        return reduce_scatter_sequence(partial, group)

    @staticmethod
    def backward(ctx, grad_output):
        return all_gather_sequence(grad_output, ctx.group), None


class SequenceParallelColumn(ColumnParallelLinear):
    """Notebook 05's column-parallel layer, its input split along the sequence (g before it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:               # (B, S/t, in) -> (B, S, out/t)
        return GatherSequenceLinear.apply(x, self.weight, self.bias, self.group)


class SequenceParallelRow(RowParallelLinear):
    """Notebook 05's row-parallel layer, its output reduce-scattered along the sequence (g-bar)."""

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:         # (B, S, in/t) -> (B, S/t, out)
        y = ReduceScatterToSequence.apply(F.linear(x_local, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class SequenceParallelAttention(Attention):
    """Notebook 05's attention; its input is a sequence shard, so the sequence length is read
    after qkv has gathered it (the rest is lab05's `Attention.forward`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)                                               # (B, S, 3 C/t)
        batch, seq, _ = qkv.shape
        q, k, v = qkv.view(batch, seq, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)    # (B, heads here, S, hd)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


def sequence_parallel_block(dense: Block, group=None) -> Block:
    """`dense` with heads and MLP columns split over the group (as notebook 05) and everything
    else split along the sequence: input and output are (B, S/t, C) shards."""
    divide(dense.attn.qkv.out_features // (3 * dense.attn.head_dim), dist.get_world_size(group),
           "attention heads over the tensor-parallel ranks")
    attn = SequenceParallelAttention(SequenceParallelColumn.from_dense(dense.attn.qkv, group),
                                     SequenceParallelRow.from_dense(dense.attn.proj, group),
                                     dense.attn.head_dim)
    mlp = MLP(SequenceParallelColumn.from_dense(dense.mlp.fc1, group),
              SequenceParallelRow.from_dense(dense.mlp.fc2, group))
    return Block(copy.deepcopy(dense.ln1), attn, copy.deepcopy(dense.ln2), mlp)


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters every tensor-parallel rank holds whole but, with sequence parallelism, trains on
    a shard of the sequence only: layer norms and the biases of sequence-parallel row layers."""
    out = []
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            out += list(module.parameters())
        elif isinstance(module, SequenceParallelRow) and module.bias is not None:
            out.append(module.bias)
    return out


def sync_replicated_grads(model: nn.Module, group) -> None:
    """Sum the replicated parameters' gradients over the tensor-parallel ranks (one all-reduce)."""
    params = [p for p in replicated_parameters(model) if p.grad is not None]
    if not params or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    for p, piece in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(piece.view_as(p.grad))


# ============================================================== the models and the checks
def dense_stack(layers: int, d_model: int, heads: int, *, seed: int = 0, device="cpu") -> nn.Sequential:
    """`layers` of notebook 05's block, one seed per layer: the reference on every rank."""
    return nn.Sequential(*[dense_block(d_model, heads, 4 * d_model, seed=seed + i, device=device)
                           for i in range(layers)])


def parallel_stack(dense: nn.Sequential, kind: str, group) -> nn.Sequential:
    """The same stack split over `group`: "tp" (notebook 05) or "sp" (sequence parallel)."""
    build = {"tp": tensor_parallel_block, "sp": sequence_parallel_block}[kind]
    return nn.Sequential(*[build(block, group) for block in dense])


def sample(batch: int, seq: int, d_model: int, *, seed: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """x and target (batch, seq, d_model), the same on every rank."""
    with seeded(seed):
        x, target = torch.randn(batch, seq, d_model), torch.randn(batch, seq, d_model)
    return x.to(device), target.to(device)


def local_loss(output: torch.Tensor, target: torch.Tensor, tokens_total: int) -> torch.Tensor:
    """Sum of squared errors of this rank's part over every element of the batch: its gradient
    is that of the whole batch's mean squared error, wherever the output is split."""
    return (output - target).pow(2).sum() / (tokens_total * output.shape[-1])


def train_side_by_side(dense: nn.Module, parallel: nn.Module, kind: str, x: torch.Tensor,
                       target: torch.Tensor, group, steps: int, lr: float = 0.05) -> dict:
    """`steps` SGD steps (momentum 0.9) of the dense stack on (x, target) and of the parallel one on its part
    (the sequence shard with "sp"): max |difference| of outputs, input grads, weight grads (first
    step) and parameters after the steps (each rank against its piece of the dense tensors)."""
    mine = (lambda t: sequence_shard(t, group)) if kind == "sp" else (lambda t: t)
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m in (dense, parallel)]
    out = {"losses": []}
    for step in range(steps):
        xs = [x.detach().clone().requires_grad_(True), mine(x.detach()).clone().requires_grad_(True)]
        ys = []
        for model, opt, xi, tgt in zip((dense, parallel), opts, xs, (target, mine(target))):
            opt.zero_grad()
            y = model(xi)
            local_loss(y, tgt, x.shape[0] * x.shape[1]).backward()
            ys.append(y.detach())
        if kind == "sp":
            sync_replicated_grads(parallel, group)
        if step == 0:
            out["output"] = (mine(ys[0]) - ys[1]).abs().max().item()
            out["input_grad"] = (mine(xs[0].grad) - xs[1].grad).abs().max().item()
            out["grads"] = max(max_param_diffs(parallel, dense, grads=True).values())
        out["losses"].append(F.mse_loss(ys[0], target).item())
        for opt in opts:
            opt.step()
    out["params"] = max(max_param_diffs(parallel, dense).values())
    out["worst"] = max(out["output"], out["input_grad"], out["grads"], out["params"])
    return out


def activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward of one forward of `model` on x (each storage once,
    parameters excluded: notebook 07's SavedTensorBytes)."""
    with SavedTensorBytes(exclude=list(model.parameters())) as saved:
        model(x.detach().clone().requires_grad_(True))
    return saved.bytes


def collectives_of_step(model: nn.Module, kind: str, x: torch.Tensor, group) -> dict:
    """Collectives one forward + backward issues (counted at the process group), per phase."""
    xi = (sequence_shard(x, group) if kind == "sp" else x).clone().requires_grad_(True)
    with count_collectives() as forward:
        y = model(xi)
    with count_collectives() as backward:
        y.square().mean().backward()
    return {"forward": summarize(forward), "backward": summarize(backward)}


@dataclass(frozen=True)
class Run(runs.Run):
    """The stack (layers Transformer blocks of d_model channels, `heads` heads), its batch of
    batch x seq positions, and the SGD steps the parallel stacks train beside the dense one."""
    layers: int = 2
    batch: int = 4
    seq: int = 32
    d_model: int = 64
    heads: int = 4
    steps: int = 4
    SMOKE = dict(batch=2, seq=8, d_model=32, steps=3)


def run(ctx: DistContext, cfg: Run) -> dict:
    """On all ranks as one tensor-parallel group: the TP and SP stacks against the dense one
    (needs notebook 05's f/g backward for TP), their activation bytes and their collectives."""
    s = cfg.values()
    group, t = None, ctx.world_size
    x, target = sample(s["batch"], s["seq"], s["d_model"], seed=1, device=ctx.device)
    out = {"sizes": s, "tp_size": t}
    for kind in ("tp", "sp"):
        dense = dense_stack(s["layers"], s["d_model"], s["heads"], device=ctx.device)
        parallel = parallel_stack(dense, kind, group)
        xin = sequence_shard(x, group) if kind == "sp" else x
        out[kind] = {"activation_bytes": activation_bytes(parallel, xin) / s["layers"],
                     "check": attempt(train_side_by_side, dense, parallel, kind, x, target, group, s["steps"]),
                     "collectives": attempt(collectives_of_step, parallel, kind, x, group)}
    out["dense_activation_bytes"] = activation_bytes(dense_stack(s["layers"], s["d_model"], s["heads"]), x) / s["layers"]
    return out


def main(argv: list[str] | None = None) -> None:
    from labs.lab09_planner import activation_bytes_per_layer

    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        result = run(ctx, cfg)
        ctx.report(**result)
        s, t = result["sizes"], result["tp_size"]
        rows = []
        for kind, sp in (("dense (1 rank)", False), ("tp", False), ("sp", True)):
            measured = result["dense_activation_bytes"] if kind.startswith("dense") else result[kind]["activation_bytes"]
            formula = activation_bytes_per_layer(s["seq"], s["batch"], s["d_model"], s["heads"],
                                                 tp=1 if kind.startswith("dense") else t, sequence_parallel=sp,
                                                 recompute="selective", element_bytes=4, dropout=False)
            check = result.get(kind, {}).get("check", {})
            rows.append({"model": kind, "activation KiB / layer": measured / 2**10,
                         "Korthikanti KiB": formula / 2**10, "measured / formula": measured / formula,
                         "max |diff| vs dense": "-" if "worst" not in check else check["worst"]})
        if ctx.rank == 0:
            table(rows, title=f"{s['layers']} blocks, d_model {s['d_model']}, seq {s['seq']}, batch "
                  f"{s['batch']}, on {t} ranks (fp32, no dropout: the formula's selective variant)")
        bad = [r for r in rows if isinstance(r["max |diff| vs dense"], float) and r["max |diff| vs dense"] > 1e-4]
        if bad:
            raise RuntimeError(f"rank {ctx.rank}: parallel stacks differ from the dense one: {bad}")


if __name__ == "__main__":
    main()
