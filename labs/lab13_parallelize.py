"""Lab 13 (the 5-D mesh): torchtitan's mesh [pp, dp_replicate, dp_shard, cp, tp] and the grown-up
model placed on it. The homework is `parallelize`.

Run:  ./run.sh 13      (this file alone: NPROC=4 ./run.sh labs/lab13_parallelize.py: what rank 0
                        holds on a dp_shard 2 x cp 2 mesh)

The mesh (`make_mesh`): five dimensions in torchtitan's order (torchtitan/distributed/
parallel_dims.py), each of size 1 when unused, and three flattened ones (DeviceMesh._flatten, as
torchtitan makes them):
- "dp_shard_cp" = dp_shard x cp: FSDP shards over it. The cp ranks hold the same weights and see
  different tokens of the same sequences, so their gradients are reduced like the dp_shard
  ranks'. It is also the experts' sub-mesh: ep = dp_shard x cp (torchtitan's `etp == tp` case:
  the experts split over tp by expert tensor parallelism, not by ep);
- "dp_cp" = dp_replicate x dp_shard x cp: every rank whose tokens make the global batch (the
  loss's mean and the experts' load are over it);
- "dp" = dp_replicate x dp_shard: the ranks that read different rows of the batch.

Given here: `moe_tensor_parallel` (an MoE block's part of tensor parallelism: the MoE gathers the
sequence and splits its experts' width itself, labs/lab13_experts.py) and `pipeline_stage` (lab
12's). The pieces the homework composes: notebook 12's tensor-parallel plan (yours), torch's
`parallelize_module` and `fully_shard`, `context_parallel` and `cp_positions` (labs/
lab13_context.py), `expert_parallel` (labs/lab13_experts.py).
"""
from __future__ import annotations

import datetime
import weakref
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn

from helpers import runs
from labs.lab12_parallelize import pipeline_stage  # noqa: F401  (a stage of the model, lab 12's)
from labs.lab13_context import context_parallel, cp_positions  # noqa: F401
from labs.lab13_experts import expert_parallel, expert_tensor_parallel  # noqa: F401
from labs.lab13_model import MoELM, check_model
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp")}


# ================================================================================== the mesh
class Mesh5D:
    """The 5-D DeviceMesh and its flattened dimensions: `mesh["cp"]`, `mesh["dp_shard_cp"]` and
    `mesh["dp_replicate", "dp_shard_cp"]` are 1-D and 2-D DeviceMeshes. The flattened ones are
    kept here, as torch asks (slicing a flattened dimension from the root mesh is deprecated);
    a tuple with one of them is put together with `DeviceMesh._concatenate`, as FSDP2 does."""

    def __init__(self, root, flattened: dict):
        self.root, self.flattened = root, flattened

    def __getitem__(self, key):
        from torch.distributed.device_mesh import DeviceMesh

        if isinstance(key, str):
            return self.flattened[key] if key in self.flattened else self.root[key]
        if all(k in DIMS for k in key):
            return self.root[tuple(key)]
        return DeviceMesh._concatenate([self[k] for k in key])

    def __getattr__(self, name):          # mesh_dim_names, get_group, device_type...: the root's
        return getattr(self.root, name)

    @property
    def sizes(self) -> dict[str, int]:
        return {d: self.root[d].size() for d in DIMS}


# default group -> {(device type, sizes): Mesh5D}. Keyed by the group object itself, weakly: a
# default group destroyed and made again is a new object (an id() could be reused, a stale mesh).
_MESHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def make_mesh(device_type: str, *, pp: int = 1, dp_replicate: int = 1, dp_shard: int = 1, cp: int = 1,
              tp: int = 1) -> Mesh5D:
    """The 5-D mesh over every rank (helpers.dist.device_mesh: short timeouts) with the flattened
    dimensions of FLATTENED, whose groups get the same short timeout. A mesh of the same sizes is
    made once and reused: every rank takes part in making each group of each dimension (36 groups
    for a mesh of 8 ranks), which costs seconds on a busy machine."""
    from helpers.dist import device_mesh, timeout_seconds

    made = _MESHES.setdefault(dist.group.WORLD, {})
    key = (device_type, pp, dp_replicate, dp_shard, cp, tp)
    if key in made:
        return made[key]
    root = device_mesh(device_type, pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp)
    timeout = datetime.timedelta(seconds=timeout_seconds())
    c10d = dist.distributed_c10d
    with mock.patch.object(c10d, "default_pg_timeout", timeout), \
            mock.patch.object(c10d, "default_pg_nccl_timeout", timeout):
        flattened = {name: root[dims]._flatten(name) for name, dims in FLATTENED.items()}
    made[key] = Mesh5D(root, flattened)
    return made[key]


def layout_name(sizes: dict[str, int]) -> str:
    """"dp_shard 2 x cp 2": the dimensions larger than 1."""
    used = [f"{d} {sizes[d]}" for d in DIMS if sizes.get(d, 1) > 1]
    return " x ".join(used) or "one rank"


# ============================================================================ tensor parallelism
def moe_tensor_parallel(block, tp_mesh):
    """An MoE block's part of tensor parallelism on `tp_mesh` (what notebook 12's plan does not
    cover): its ffn_norm on the sequence shard with a plain (local) output, the MoE told the mesh
    (it gathers its input along the sequence and reduce-scatters its output itself), its routed
    and shared experts keeping 1/tp of their hidden width (labs/lab13_experts.py). In place."""
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    parallelize_module(block, tp_mesh, {"ffn_norm": SequenceParallel(use_local_output=True)})
    block.moe.tp_mesh = tp_mesh
    expert_tensor_parallel(block.moe.experts, tp_mesh)
    if block.moe.shared_expert is not None:
        expert_tensor_parallel(block.moe.shared_expert, tp_mesh)
    return block


# ===================================================================================== exercise
def parallelize(model: MoELM, mesh, *, reshard_after_forward: bool | None = None,
                design: str = "ring") -> MoELM:
    """Exercise (parallelize): place the model's attention, experts and weights on the 5-D mesh.

    `model`: a MoELM (labs/lab13_model.py) built whole on this rank's device, or a pipeline stage
    of one (lab 12's `pipeline_stage`: only some blocks, and maybe no embedding or output layer).
    `mesh`: `make_mesh(...)`'s mesh, dimensions pp, dp_replicate, dp_shard, cp, tp (any of size 1)
    and the flattened dp, dp_shard_cp, dp_cp. Returns the model, changed in place, ready for
    AdamW and the training loop of labs/lab13_train.py, which gives rank r of mesh["cp"] the
    columns `cp_positions(seq, cp, r)` of every sequence of its rows.

    Contract (the tests check each, on several meshes, against one process):
    - tensor parallelism first, when mesh["tp"] has more than one rank: notebook 12's plan
      (your lab12 `parallelize` without its FSDP) for this model's attention (wk and wv
      column-parallel like wq: each tp rank its query heads and their kv heads), its dense MLPs,
      norms, embedding and output layer; the output layer's logits split over the vocabulary
      (loss parallel) for the whole model, whole (a plain tensor) on a pipeline's last stage,
      whose schedule computes the loss; an MoE block's feed-forward part is `moe_tensor_parallel`;
    - every attention attends over the whole sequence held by its mesh["cp"] group (`design`:
      "ring" or "ulysses"), its rotary angles and causal mask at the global positions of its rows
      (`context_parallel`);
    - every MoE layer's routed experts split over the ep ranks, the ranks of mesh["dp_shard_cp"]
      (`expert_parallel`): rank r of it holds experts r E/ep ... of every layer; the shared expert
      is never dispatched (every rank runs it on its own tokens);
    - every router counts its experts' load over the whole global batch, mesh["dp_cp"]'s ranks
      (its `load_group`), so the bias balancing moves every copy of a router alike;
    - FSDP2 on every block and on the root, sharding over mesh["dp_shard_cp"]: the cp ranks'
      gradients are reduced with the dp_shard ranks'. With mesh["dp_replicate"] > 1 it is HSDP:
      the 2-D mesh (dp_replicate, dp_shard_cp), sharded within a replica, replicated across;
    - the routed experts are their own FSDP unit on mesh["dp_replicate"], the ranks that hold the
      same experts (the dispatcher already averages their gradients over the ep ranks, as FSDP
      averages the other weights' over dp_shard_cp): each gradient then equals one process's
      gradient of the batch's mean loss;
    - `reshard_after_forward`: passed to every fully_shard; None means torchtitan's rule, True
      without a pipeline and False with one (mesh["pp"] > 1).
    """
    ### BEGIN SOLUTION
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    tp = mesh["tp"]
    if tp.size() > 1:      # 1. tensor + sequence parallelism, as in notebook 12
        ends = {}
        if model.tok_embeddings is not None:
            ends["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        if model.norm is not None:
            ends["norm"] = SequenceParallel()
        if model.output is not None:
            whole_model = model.tok_embeddings is not None
            ends["output"] = ColwiseParallel(input_layouts=Shard(1),
                                             output_layouts=Shard(-1) if whole_model else Replicate(),
                                             use_local_output=not whole_model)
        parallelize_module(model, tp, ends)
        for block in model.layers.values():
            plan = {"attention_norm": SequenceParallel(),
                    "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                    "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                    "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1))}
            if block.moe is None:
                plan.update({"ffn_norm": SequenceParallel(),
                             "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                                desired_input_layouts=(Replicate(),)),
                             "feed_forward.w1": ColwiseParallel(),
                             "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
            else:
                moe_tensor_parallel(block, tp)
            parallelize_module(block, tp, plan)
    cp = mesh["cp"]        # 2. context parallelism at global positions; 3. experts over ep
    positions = cp_positions(model.config.seq, cp.size(), cp.get_local_rank())
    for block in model.layers.values():
        context_parallel(block.attention, cp, positions, design)
        if block.moe is not None:
            expert_parallel(block.moe.experts, mesh["dp_shard_cp"])
            block.moe.router.load_group = mesh["dp_cp"].get_group()
    if reshard_after_forward is None:     # 4. FSDP2 (HSDP with replicas), the experts apart
        reshard_after_forward = mesh["pp"].size() == 1
    weights = mesh["dp_replicate", "dp_shard_cp"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard_cp"]
    for block in model.layers.values():
        if block.moe is not None:
            fully_shard(block.moe.experts, mesh=mesh["dp_replicate"], reshard_after_forward=reshard_after_forward)
        fully_shard(block, mesh=weights, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=weights, reshard_after_forward=reshard_after_forward)
    return model
    ### END SOLUTION


# ============================================================================ what a rank holds
def placements(model: nn.Module) -> dict[str, dict]:
    """Each parameter: its mesh's dimension names, placements, global and local shape; for the
    experts also which of the layer's experts and hidden columns this rank's tensor covers."""
    from labs.lab12_model import canonical_name

    out = {}
    for name, p in model.named_parameters():
        entry = {"global": list(p.shape), "local": list(p.shape), "mesh": [], "placements": [], "ranks": []}
        if hasattr(p, "device_mesh"):
            entry.update(local=list(p.to_local().shape), mesh=list(p.device_mesh.mesh_dim_names or ()),
                         placements=[repr(pl) for pl in p.placements],
                         ranks=sorted(int(r) for r in p.device_mesh.mesh.flatten().tolist()))
        out[canonical_name(name)] = entry
    for key, block in getattr(model, "layers", {}).items():
        if getattr(block, "moe", None) is not None:
            ex = block.moe.experts
            out[f"layers.{key}.moe.experts.w1"]["experts"] = [ex.first, ex.first + ex.num_experts]
            out[f"layers.{key}.moe.experts.w1"]["ffn"] = list(ex.ffn_slice)
            out[f"layers.{key}.moe.experts.w1"]["ep_ranks"] = getattr(ex, "ep_ranks", [])
    return out


def parse_mesh(text: str) -> dict[str, int]:
    """"dp_shard=2,cp=2" -> {"dp_shard": 2, "cp": 2}; a dimension not in DIMS is a ValueError."""
    sizes = {}
    for part in filter(None, text.replace(" ", "").split(",")):
        name, _, value = part.partition("=")
        if name not in DIMS or not value.isdigit():
            raise ValueError(f"--mesh: {part!r} is not DIM=SIZE with DIM one of {', '.join(DIMS)}")
        sizes[name] = int(value)
    return sizes


@dataclass(frozen=True)
class Run(runs.Run):
    """What each rank holds after `parallelize` on `mesh` ("dp_shard=2,cp=2"; empty: dp_shard 2 x
    cp 2 on 4 ranks, or cp over every rank), with the model `model` (lab13_model.MODELS)."""
    model: str = "full"
    mesh: str = ""
    ranks: int | None = 4
    SMOKE = dict(model="smoke")

    def __post_init__(self):
        check_model(self.model)
        parse_mesh(self.mesh)


def run(ctx, cfg: Run) -> dict:
    """What this rank holds on cfg's mesh, or {"unsolved": ...} while `parallelize` is a stub."""
    from helpers.notice import attempt
    from labs.lab13_model import build_model, default_config

    sizes = parse_mesh(cfg.mesh) or ({"dp_shard": 2, "cp": ctx.world_size // 2}
                                     if ctx.world_size % 2 == 0 and ctx.world_size > 2 else {"cp": ctx.world_size})
    mesh = make_mesh(ctx.device.type, **sizes)

    def place():
        model = parallelize(build_model(default_config(cfg.model), ctx.device), mesh)
        return placements(model)
    return {"sizes": sizes, "layout": layout_name(sizes), "placements": attempt(place)}


def main(argv: list[str] | None = None) -> None:
    from helpers.dist import distributed
    from helpers.show import table

    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        out = run(ctx, cfg)
        ctx.report(**out)
        if ctx.rank == 0 and "unsolved" not in out["placements"]:
            table([{"parameter": n, "global": e["global"], "rank 0 holds": e["local"], "mesh": " x ".join(e["mesh"]),
                    "placements": ", ".join(e["placements"])} for n, e in out["placements"].items()],
                  title=f"rank 0 on {out['layout']}")


if __name__ == "__main__":
    main()
