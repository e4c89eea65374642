"""Lab 05 (part 3): the same MLP split by PyTorch's own tensor parallelism (DTensor), against ours.

Run:  ./run.sh 05      (or: ./run.sh labs/lab05_tp_dtensor.py)

`torch.distributed.tensor.parallel.parallelize_module` takes a plain module, a DeviceMesh and a
plan naming a style per submodule. ColwiseParallel shards a Linear's weight and bias along dim 0
(Shard(0)) and leaves its output split; RowwiseParallel shards the weight along dim 1 (Shard(1)),
replicates the bias and all-reduces the output: the Megatron pairing, with parameters that are
DTensors (a local shard plus its placement on the mesh). The mesh is built for ctx.device.type,
so the same code runs on CPU/gloo and CUDA/nccl. The placements, the shapes and the forward
outputs need nothing of the homework; the gradients need our f/g backward passes (until they are
written, the lab reports that they are not).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from helpers import runs
from helpers.dist import DistContext, device_mesh, distributed
from helpers.notice import attempt
from helpers.show import table
from labs.lab05_tensor_parallel import dense_mlp, megatron_mlp, sample_batch

PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def dtensor_mlp(dense: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """A copy of `dense` with fc1 column-wise and fc2 row-wise parallel, the DTensor way."""
    return parallelize_module(copy.deepcopy(dense), mesh, PLAN)


def local(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds: a DTensor's local tensor, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def compare_with_ours(ctx: DistContext, batch: int, seq: int, d_model: int, d_ff: int, *,
                      steps: int, dtype=torch.float32) -> dict:
    """Our Megatron MLP and the DTensor one, same data: the placements and local shapes of the
    DTensor parameters against ours and the forward outputs (no backward needed); then (`training`,
    once our backward passes are written) max |difference| of input grads, every parameter's local
    gradient (first step) and local parameters after `steps` SGD steps."""
    mesh = device_mesh(ctx.device, tp=ctx.world_size)
    dense = dense_mlp(d_model, d_ff, dtype=dtype, device=ctx.device)
    ours, theirs = megatron_mlp(dense), dtensor_mlp(dense, mesh)
    x, target = sample_batch(batch, seq, d_model, seed=2, dtype=dtype, device=ctx.device)
    with torch.no_grad():  # DTensor's RowwiseParallel hands back a plain (replicated) tensor
        output = (ours(x) - theirs(x)).abs().max().item()
    result = {"output": output,
              "placements": {name: [repr(pl) for pl in p.placements] for name, p in theirs.named_parameters()},
              "local_shapes": {name: list(local(p).shape) for name, p in theirs.named_parameters()},
              "our_shapes": {name: list(p.shape) for name, p in ours.named_parameters()},
              "training": attempt(train_side_by_side, ours, theirs, x, target, steps)}
    training = result["training"]
    result["worst"] = max([output] + ([] if "unsolved" in training else [
        training["input_grad"], *training["grads"].values(), *training["params_after_steps"].values()]))
    return result


def train_side_by_side(ours: nn.Module, theirs: nn.Module, x: torch.Tensor, target: torch.Tensor,
                       steps: int) -> dict:
    """`steps` SGD steps of both on the same data: max |difference| of the input gradients and of
    every local gradient (first step), and of every local parameter afterwards."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    diffs = {"grads": {}, "params_after_steps": {}}
    for step in range(steps):
        xgrads = []
        for model, opt in zip((ours, theirs), opts):
            xi = x.detach().clone().requires_grad_(True)
            opt.zero_grad()
            F.mse_loss(model(xi), target).backward()
            xgrads.append(xi.grad)
        if step == 0:
            diffs["input_grad"] = (xgrads[0] - xgrads[1]).abs().max().item()
            for (name, mine), theirs_p in zip(ours.named_parameters(), theirs.parameters()):
                diffs["grads"][name] = (mine.grad - local(theirs_p.grad)).abs().max().item()
        for opt in opts:
            opt.step()
    for (name, mine), theirs_p in zip(ours.named_parameters(), theirs.parameters()):
        diffs["params_after_steps"][name] = (mine.detach() - local(theirs_p.detach())).abs().max().item()
    return diffs


@dataclass(frozen=True)
class Run(runs.Run):
    """The MLP (d_model -> d_ff -> d_model) and its batch, the SGD steps, the dtype's name."""
    batch: int = 4
    seq: int = 32
    d_model: int = 96
    d_ff: int = 384
    steps: int = 3
    dtype: str = "float32"
    SMOKE = dict(batch=2, seq=8, d_model=24, d_ff=96)


def run(ctx: DistContext, cfg: Run) -> dict:
    return compare_with_ours(ctx, batch=cfg.batch, seq=cfg.seq, d_model=cfg.d_model, d_ff=cfg.d_ff,
                             steps=cfg.steps, dtype=getattr(torch, cfg.dtype))


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        result = run(ctx, cfg)
        training = result["training"]
        trained = "unsolved" not in training
        if ctx.rank == 0:
            table([{"parameter": name, "DTensor placement": ", ".join(result["placements"][name]),
                    "its local shape": result["local_shapes"][name], "our shape": result["our_shapes"][name],
                    "max |grad diff|": training["grads"][name] if trained else "-",
                    "max |param diff| after steps": training["params_after_steps"][name] if trained else "-"}
                   for name in result["placements"]], title="parallelize_module vs our layers")
        ctx.print0(f"outputs differ by {result['output']:.2e}" + (
            f", input grads by {training['input_grad']:.2e}" if trained
            else "; the gradients need the f/g backward passes (the homework)"))
        if result["worst"] > 1e-4:
            raise RuntimeError(f"DTensor and our layers differ by {result['worst']:.2e}")
        ctx.report(**result)


if __name__ == "__main__":
    main()
