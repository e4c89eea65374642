"""Lab 13 (experts across ranks; a library of lab 13): expert parallelism inside the model, on a sub-mesh, and expert
tensor parallelism beside it.

Run:  imported by labs/lab13_parallelize.py and labs/lab13_train.py (no run of its own).

- `expert_parallel(experts, ep_mesh)`: rank r of the ep mesh keeps experts r E/n ... (r+1) E/n - 1
  of a layer's `GroupedExperts` (labs/lab13_model.py) and an `ExpertDispatcher`, which moves the
  rows sorted by expert to the ranks that own their experts and back. The dispatch is notebook
  11's (labs/lab11_experts.py's `all_to_all`, GShard's dispatch and combine, Lepikhin et al. 2020,
  arXiv:2006.16668) on the ep sub-mesh: the counts first (E integers per rank), then the rows
  (split sizes from the counts), the local experts on the rows sorted by local expert (one grouped
  GEMM per projection), the results back. Torchtitan's `ExpertParallel`
  (torchtitan/distributed/expert_parallel.py) does the same with `all_to_all_single_autograd`.
- `expert_tensor_parallel(experts, tp_mesh)`: every rank of the tp mesh keeps its columns of each
  expert's hidden width (w1 split along its rows, w2 along its columns: torchtitan's
  `TensorParallel` for grouped experts); the MoE gathers its input along the sequence first and
  reduce-scatters its partial outputs after (`gather_sequence`, `scatter_sequence`), and the router,
  whose weight every tp rank holds whole but whose gradient each tp rank computes only in part
  (the gates multiply partial outputs), has its gradient summed over tp (`grad_summed_over`).
  With both, ep = dp_shard x cp and etp = tp: torchtitan's `etp == tp` case
  (torchtitan/distributed/parallel_dims.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from helpers.tensors import divide
from labs.lab11_experts import all_to_all


# ============================================================== tensor parallelism's operators
def gather_sequence(x: torch.Tensor, tp_mesh) -> torch.Tensor:
    """(b, t/tp, d), this rank's positions -> (b, t, d) on every tp rank (an all-gather). Backward:
    each rank's gradient is a partial sum (its columns of the experts): reduce-scatter."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    return (DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False)
            .redistribute(tp_mesh, [Replicate()]).to_local(grad_placements=[Partial()]))


def scatter_sequence(x: torch.Tensor, tp_mesh) -> torch.Tensor:
    """(b, t, d) partial sums on every tp rank -> their sum at this rank's positions, (b, t/tp, d):
    a reduce-scatter. Backward: an all-gather."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    return DTensor.from_local(x, tp_mesh, [Partial()], run_check=False).redistribute(tp_mesh, [Shard(1)]).to_local()


class _ScaleGrad(torch.autograd.Function):
    """w itself; its gradient times `scale`."""

    @staticmethod
    def forward(ctx, w, scale):
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(w: torch.Tensor, scale: float) -> torch.Tensor:
    return w if scale == 1 else _ScaleGrad.apply(w, scale)


def grad_summed_over(w: torch.Tensor, mesh) -> torch.Tensor:
    """w itself; its gradient summed over the mesh's ranks (an all-reduce in the backward):
    Megatron's f operator applied to a weight every rank holds whole."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(w, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


# ======================================================================== the dispatch
class ExpertDispatcher:
    """Rows sorted by the layer's expert -> the ranks of `group` that own the experts, through the
    local experts, and back in the same order. Every rank of the group must call it together."""

    def __init__(self, group, ep_size: int):
        self.group, self.ep_size = group, ep_size
        self.splits: list[list[int]] = []       # the last forward's rows to each rank (send side)

    def __call__(self, experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        n, local = self.ep_size, experts.num_experts
        with torch.no_grad():                       # how many rows for each (rank, local expert)
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts.contiguous(), group=self.group)
        to_rank = counts.view(n, local).sum(1).tolist()
        per_source = received.view(n, local)        # [source rank, local expert]
        from_rank = per_source.sum(1).tolist()
        self.splits = to_rank
        arrived = all_to_all(rows, from_rank, to_rank, self.group)      # source-major
        pieces = list(arrived.split(per_source.reshape(-1).tolist()))
        order = [i * local + j for j in range(local) for i in range(n)]  # expert-major
        # the experts' gradients come from the tokens of all n ranks: averaged over them, as FSDP
        # averages the other weights' over the data-parallel ranks
        out = experts.compute(torch.cat([pieces[p] for p in order]), per_source.sum(0), grad_scale=1 / n)
        for p, piece in zip(order, out.split([len(pieces[p]) for p in order])):
            pieces[p] = piece
        return all_to_all(torch.cat(pieces), to_rank, from_rank, self.group)   # back, in row order


# ======================================================================== the placements
def expert_parallel(experts: nn.Module, ep_mesh) -> nn.Module:
    """Keep this rank's experts of `experts` (a GroupedExperts holding the whole layer's) and
    route its rows through an ExpertDispatcher on `ep_mesh` (1-D). In place, before FSDP."""
    n, r = ep_mesh.size(), ep_mesh.get_local_rank()
    local = divide(experts.num_experts, n, "a layer's experts over the expert-parallel ranks")
    with torch.no_grad():
        for name in ("w1", "w2"):
            full = getattr(experts, name)
            setattr(experts, name, nn.Parameter(full[r * local:(r + 1) * local].clone()))
    experts.first, experts.num_experts = experts.first + r * local, local
    experts.dispatcher = ExpertDispatcher(ep_mesh.get_group(), n)
    experts.ep_ranks = sorted(int(v) for v in ep_mesh.mesh.flatten().tolist())
    return experts


def expert_tensor_parallel(experts: nn.Module, tp_mesh) -> nn.Module:
    """Keep this rank's columns of every expert's hidden width (w1's rows, w2's columns). In place."""
    n, r = tp_mesh.size(), tp_mesh.get_local_rank()
    ffn = experts.w1.shape[1]
    width = divide(ffn, n, "an expert's hidden width over the tensor-parallel ranks")
    with torch.no_grad():
        experts.w1 = nn.Parameter(experts.w1[:, r * width:(r + 1) * width].clone())
        experts.w2 = nn.Parameter(experts.w2[:, :, r * width:(r + 1) * width].clone())
    start = experts.ffn_slice[0] + r * width
    experts.ffn_slice = (start, start + width)
    return experts


def expert_slices(experts: nn.Module) -> dict[str, tuple[slice, ...]]:
    """Where this module's w1 and w2 sit in the layer's whole tensors (what a rank compares with
    one process's)."""
    e = slice(experts.first, experts.first + experts.num_experts)
    f = slice(*experts.ffn_slice)
    return {"w1": (e, f, slice(None)), "w2": (e, slice(None), f)}


def dispatch_bytes(splits: list[int], rank: int, row_bytes: int) -> int:
    """Bytes one row all-to-all sends to the other ranks: the rows for other ranks' experts."""
    return sum(s for j, s in enumerate(splits) if j != rank) * row_bytes
