"""Lab 12 (the composition): tensor + sequence parallelism, activation checkpointing and FSDP2 on
one device mesh, in torchtitan's order, and gradient clipping to the global norm.

Run:  ./run.sh 12      (this file alone: NPROC=8 ./run.sh labs/lab12_parallelize.py; it builds
                        the model on the meta device, parallelises it on a 2 x 2 x 2 (pp, dp, tp)
                        mesh and shows what each rank holds, before any training)

The mesh: `init_device_mesh(device, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))`, tp
fastest (neighbouring ranks: the most traffic), then dp, then pp (Megatron-LM's and torchtitan's
order; Liang et al. 2024, "TorchTitan", arXiv:2410.06511). `mesh["tp"]`, `mesh["dp"]` and
`mesh["pp"]` are this rank's 1-D sub-meshes along each dimension.

torchtitan parallelises a model in this order (its `parallelize_llama`), and each step needs the
one before it:
1. tensor parallelism (`parallelize_module` on mesh["tp"]): the parameters become DTensors
   sharded over the tp ranks, and with sequence parallelism the activations between the
   layers are split along the sequence;
2. activation checkpointing per block (`checkpoint_wrapper`): the block's forward is re-run in
   the backward instead of keeping its activations;
3. FSDP2 (`fully_shard` on mesh["dp"]) per block, then at the root: each DTensor shard is split
   again over the dp ranks (a 2-D DTensor on the (dp, tp) mesh), gathered per block before use.
Pipelining (`PipelineStage`) wraps the result; labs/lab12_train.py does that.

Exercise (homework): `parallelize(model, mesh, ...)` and `clip_grad_norm_(parameters,
max_norm, pp_group)`. Check them with ./run.sh check 12.
"""
from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from helpers.tensors import divide
from labs.lab12_model import ByteLM, LMConfig, build_model

LAB_NPROC = 8      # ./run.sh 12 launches this file on 8 ranks, a 2 x 2 x 2 mesh (NPROC wins)
MESH_DIMS = ("pp", "dp", "tp")
# DTensor logs a warning on every rank each time a redistribution over the 2-D (dp, tp) mesh takes
# one collective per dimension (the global norm: two all-reduces; a full_tensor(): two
# all-gathers). lab12_train counts those collectives per dimension; the warning adds nothing.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


# ======================================================================================= the mesh
def mesh_shape(world_size: int) -> tuple[int, int, int]:
    """(pp, dp, tp) for `world_size` ranks: 8 -> 2 x 2 x 2; fewer ranks drop a dimension (4 ->
    pp 2 x tp 2, 2 -> tp 2, 1 -> one process); more ranks grow dp."""
    known = {1: (1, 1, 1), 2: (1, 1, 2), 4: (2, 1, 2), 8: (2, 2, 2)}
    if world_size in known:
        return known[world_size]
    return (2, divide(world_size, 4, "the ranks over a pp 2 x dp x tp 2 mesh"), 2)


def make_mesh(shape: tuple[int, int, int], device_type: str = "cpu") -> DeviceMesh:
    """The (pp, dp, tp) mesh over every rank of the default group. Its groups wait as long as the
    default group (DIST_TIMEOUT, helpers/dist.py) before a collective or a message gives up:
    `init_device_mesh` creates them with torch's default (30 minutes on gloo, read from
    `distributed_c10d.default_pg_timeout` when each group is made), so a rank whose peer failed
    would hang that long. The default is replaced while the mesh is made."""
    import datetime
    from unittest import mock

    from helpers.dist import timeout_seconds

    if shape[0] * shape[1] * shape[2] != dist.get_world_size():
        raise ValueError(f"a {' x '.join(map(str, shape))} (pp, dp, tp) mesh needs "
                         f"{shape[0] * shape[1] * shape[2]} ranks, there are {dist.get_world_size()}")
    timeout = datetime.timedelta(seconds=timeout_seconds())
    c10d = dist.distributed_c10d
    with mock.patch.object(c10d, "default_pg_timeout", timeout), \
            mock.patch.object(c10d, "default_pg_nccl_timeout", timeout):
        return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)


def pipeline_stage(model: ByteLM, stage: int, num_stages: int) -> ByteLM:
    """Keep this stage's blocks (an even split, in order) and drop the rest: the first stage keeps
    the embedding, the last the final norm and the output layer. In place; returns `model`."""
    per_stage = divide(len(model.layers), num_stages, "the blocks over the pipeline stages")
    for key in list(model.layers.keys()):
        if not stage * per_stage <= int(key) < (stage + 1) * per_stage:
            del model.layers[key]
    if stage != 0:
        model.tok_embeddings = None
    if stage != num_stages - 1:
        model.norm, model.output = None, None
    return model


# ===================================================================================== exercise
def parallelize(model: ByteLM, mesh: DeviceMesh, *, loss_parallel: bool = True,
                mp_policy=None, activation_checkpointing: bool = False) -> ByteLM:
    """Exercise (parallelize): tensor/sequence parallelism, checkpointing and FSDP2 on one mesh.

    In torchtitan's order: tensor + sequence parallelism on mesh["tp"], activation checkpointing
    per block, FSDP2 on mesh["dp"].

    `model`: a ByteLM (labs/lab12_model.py) on the meta device, or a pipeline stage of one
    (`pipeline_stage`: some of `tok_embeddings`, `norm`, `output` are None and only some blocks
    are left in `model.layers`). `mesh`: a DeviceMesh whose dimensions include "dp" and "tp"
    (either may have size 1; a "pp" dimension is ignored here). Returns the model, changed in
    place: the caller then materialises it (`to_empty`, `init_weights`) and trains it.

    Contract, for tp ranks = mesh["tp"].size() and dp ranks = mesh["dp"].size():
    - every parameter is a DTensor; the matrices of attention, the MLP, the embedding and the
      output layer are split over the tp ranks and every parameter is split again over the dp
      ranks only (never over ranks of another dimension), so a rank holds 1/(dp tp) of each
      matrix and 1/dp of each norm's weight; the embedding and the output layer are split over
      the vocabulary: each tp rank holds the rows of some tokens (looks up those tokens, computes
      their logits);
    - with tp > 1 the activations between the blocks, and the inputs of every RMSNorm, are split
      along the sequence (sequence parallelism): a rank's norm sees (b, t / tp, dim); the tp ranks
      exchange activations only where that needs it: in a forward, one all-gather of the sequence
      into each attention, each MLP and the output layer, and one reduce-scatter out of each
      attention, each MLP and the embedding (the backward the reverse), besides the loss's
      reductions and, with `loss_parallel` False, the logits' gather;
    - a stage's forward takes what the previous stage's forward returns: the first stage the
      tokens (b, t), the same on every tp rank; a later stage plain tensors of hidden states,
      split along the sequence over the tp ranks when tp > 1. The stage with the output layer
      returns logits split over the vocabulary (a DTensor with placement Shard(2) on the tp
      dimension) when `loss_parallel` is True, to be used inside
      `torch.distributed.tensor.parallel.loss_parallel()`; whole logits (a plain tensor, every
      tp rank the same) when it is False;
    - `activation_checkpointing`: each block keeps only its input for the backward;
    - FSDP2: each block, as `model.layers` holds it (checkpointed or not), is one unit
      (`fully_shard`), and the root too; `mp_policy` (a `MixedPrecisionPolicy`, or None for none)
      applies to every unit; without a pipeline a block's parameters are whole only around its
      own forward and its own backward: during a step at most the root's and one block's are
      gathered at once;
    - trained with AdamW and `clip_grad_norm_`, it gives the losses and parameters of the same
      model trained whole in one process (within float32 rounding).
    The tests check the placements, meshes and local sizes of the parameters, the shapes the
    norms see, the logits' placement, the FSDP units, the units whole at once during a step, the
    collectives of a forward and a step on each mesh dimension (counted), what a block keeps for
    the backward, the dtype the layers compute in, and training against one process, on several
    meshes.
    """
    ### BEGIN SOLUTION
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    if tp_mesh.size() > 1:
        # 1. tensor parallelism; between the blocks the activations are split along the sequence
        top = {}
        if model.tok_embeddings is not None:   # vocabulary-parallel: a reduce-scatter after it
            top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        if model.norm is not None:
            top["norm"] = SequenceParallel()
        if model.output is not None:           # all-gather the sequence, split the vocabulary
            top["output"] = ColwiseParallel(input_layouts=Shard(1),
                                            output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                            use_local_output=not loss_parallel)
        parallelize_module(model, tp_mesh, top)
        block_plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, block_plan)
    # 2. activation checkpointing per block
    if activation_checkpointing:
        for key, block in list(model.layers.items()):
            model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
    # 3. FSDP2 over the dp ranks only: each block a unit, then the root
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return model
    ### END SOLUTION


def clip_grad_norm_(parameters, max_norm: float, pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Exercise (clip_grad_norm_): clip the gradients to the whole model's global 2-norm.

    Scale every gradient by min(1, max_norm / total norm), the total being the 2-norm of the
    whole model's gradient, every shard and every pipeline stage of it.

    `parameters`: this rank's parameters (an iterable; DTensors sharded any way over a mesh,
    or plain tensors; those without a gradient are skipped). `pp_group`: the process group of
    this rank's pipeline stages (None or a group of one: no pipeline), whose other ranks hold the
    other stages' parameters. Returns the total norm, a plain 0-d float32 tensor equal on every
    rank to what `torch.nn.utils.clip_grad_norm_` returns for the whole model in one process,
    and leaves the gradients as that call would (each rank its part of them).

    The tests compare the norm and the parameters after a clipped step with one process, with a
    max_norm small enough to clip, with and without a pipeline.
    """
    ### BEGIN SOLUTION
    from torch.distributed.tensor import DTensor

    parameters = [p for p in parameters if p.grad is not None]
    by_mesh: dict = {}      # gradients of one mesh reduce together (plain tensors: key None)
    for p in parameters:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    device = _local(parameters[0].grad).device if parameters else _device_of(pp_group)
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for grads in by_mesh.values():
        # On DTensors the norm is reduced over their mesh (the shards' squares summed, a
        # replicated piece once): a Partial or Replicate DTensor whose full value is the norm.
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares = squares + norm.float() ** 2        # norms do not add: their squares do
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squares, group=pp_group)     # every stage's parameters
    total = squares.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)   # torch's clip_grad_norm_ rule
    for p in parameters:
        p.grad.mul_(coef.item() if isinstance(p.grad, DTensor) else coef)
    return total
    ### END SOLUTION


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _device_of(group) -> torch.device:
    """The device a collective on `group` needs (a rank with no gradient still joins the sum)."""
    from helpers.dist import gpu_count

    backend = dist.get_backend(group) if dist.is_initialized() else "gloo"
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" and gpu_count() else torch.device("cpu")


# ============================================================================ what a rank holds
def placements(model: nn.Module) -> dict[str, dict]:
    """Each parameter: its mesh's dimension names, placements, global and local shape."""
    from labs.lab12_model import canonical_name

    out = {}
    for name, p in model.named_parameters():
        entry = {"global": list(p.shape), "local": list(p.shape), "mesh": [], "placements": []}
        if hasattr(p, "device_mesh"):
            entry.update(local=list(p.to_local().shape), mesh=list(p.device_mesh.mesh_dim_names or ()),
                         placements=[repr(pl) for pl in p.placements])
        out[canonical_name(name)] = entry
    return out


def layout_demo(ctx, shape: tuple[int, int, int], config: LMConfig) -> dict:
    """Build on meta, split into pipeline stages, parallelise, materialise: what this rank holds."""
    from helpers.accounting import held_bytes

    mesh = make_mesh(shape, ctx.device.type)
    pp_rank = mesh["pp"].get_local_rank()
    model = pipeline_stage(build_model(config), pp_rank, shape[0])
    parallelize(model, mesh)
    model.to_empty(device=ctx.device)
    model.init_weights()
    return {"coordinate": dict(zip(MESH_DIMS, mesh.get_coordinate())), "placements": placements(model),
            "held": held_bytes({"parameters": model.parameters()})["total"]}


def what_composes(ctx, shape: tuple[int, int, int]) -> dict:
    """Compositions tried on a column-parallel linear layer on mesh["tp"] (the lab's plan is not
    needed for this): FSDP2 on mesh["dp"] with bf16 parameters, with CPU offload, and over every
    rank instead of mesh["dp"]. For each: whether a forward and backward ran, or torch's error."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = make_mesh(shape, ctx.device.type)
    tries = {
        "FSDP2 on dp, bf16 parameters, fp32 reduction": dict(
            mesh=mesh["dp"], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
        "FSDP2 on dp with CPU offload (CPUOffloadPolicy)": dict(mesh=mesh["dp"], offload_policy=CPUOffloadPolicy()),
        "FSDP2 over every rank (no mesh=) after tensor parallelism": {},
    }
    out = {}
    # FSDP2 warns on every rank that a lone root module's forward "returned a view tensor": true of
    # this one-layer probe, and beside its point
    warnings.filterwarnings("ignore", message=".*view tensor.*")
    for name, options in tries.items():
        layer = nn.Linear(8, 8 * mesh["tp"].size(), bias=False, device=ctx.device)
        try:
            parallelize_module(layer, mesh["tp"], ColwiseParallel())
            fully_shard(layer, **options)
            layer(torch.randn(2, 8, device=ctx.device)).sum().backward()
            out[name] = {"ran": True}
        except Exception as exc:   # whatever torch says is the answer reported
            out[name] = {"ran": False, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"}
        ctx.barrier()    # a rank that failed early must not leave the others in a collective
    return out


def run(ctx) -> dict:
    """This lab's run on the default mesh of the world size: what this rank holds ("layout";
    {"unsolved": ...} while `parallelize` is a stub) and the composition probes ("composes")."""
    from helpers.notice import attempt
    from labs.lab12_model import default_config

    shape = mesh_shape(ctx.world_size)
    return {"shape": list(shape), "layout": attempt(layout_demo, ctx, shape, default_config()),
            "composes": what_composes(ctx, shape)}


def main() -> None:
    from helpers.dist import distributed
    from helpers.show import table
    from labs.lab12_model import default_config, parameter_count

    config = default_config()
    with distributed() as ctx:
        result = run(ctx)
        ctx.report(**result)
        shape, out, probes = result["shape"], result["layout"], result["composes"]
        if ctx.rank == 0:
            table([{"composition": k, "runs here": v["ran"], "torch says": v.get("error", "")}
                   for k, v in probes.items()], title=f"what composes on {ctx.device.type} ({ctx.backend})")
        if ctx.rank == 0 and "unsolved" not in out:
            rows = [{"parameter": name, "global shape": e["global"], "rank 0's shard": e["local"],
                     "mesh": " x ".join(e["mesh"]), "placements": ", ".join(e["placements"])}
                    for name, e in out["placements"].items()]
            table(rows, title=f"rank 0 of a {' x '.join(map(str, shape))} (pp, dp, tp) mesh: "
                  f"{out['held']:,} bytes of parameters of the whole model's "
                  f"{4 * parameter_count(config):,}")


if __name__ == "__main__":
    main()
