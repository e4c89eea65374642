"""Lab 05: tensor parallelism. Every rank sees the whole batch and holds 1/world_size of each weight.

Run:  ./run.sh 05      (or: ./run.sh labs/lab05_tensor_parallel.py)

Two ways to run a two-layer MLP, fc2(gelu(fc1(x))), with its weights split along the model width
(Megatron-LM, Shoeybi et al. 2019, arXiv:1909.08053):
- the all-gather scheme: every layer is split by output features and all-gathers its output, so
  the next layer sees the full activation (two all-gathers per MLP forward);
- the Megatron pairing: a column-parallel fc1 leaves its output split, the row-parallel fc2 takes
  that split input, and one all-reduce sums the partial results (one all-reduce per MLP forward).
The communication is written as torch.autograd.Functions named after Megatron's operators f and g.
Their backward passes are the homework (tests: tests/public/test_lab05_tensor_parallel.py; check
them with ./run.sh check 05).

`main()` compares both schemes' outputs with the dense MLP's, then trains them side by side with it
for a few SGD steps and prints how far apart they end up (the training needs the backward passes:
until they are written, it reports that they are not). labs/lab05_tp_comm_volume.py counts and
times their communication.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers import runs
from helpers.comm_count import CommLog, LoggedCollective
from helpers.dist import DistContext, distributed
from helpers.notice import attempt
from helpers.show import table
from helpers.tensors import divide, seeded

# ====================================================================== shards
def shard(tensor: torch.Tensor, dim: int, tp_rank: int, tp_world_size: int) -> torch.Tensor:
    """Contiguous chunk `tp_rank` of `tensor` along `dim` (a copy): indices r*n/N ... (r+1)*n/N - 1."""
    size = divide(tensor.shape[dim], tp_world_size,
                  f"dimension {dim} of a {tuple(tensor.shape)} tensor over the tensor-parallel ranks")
    return tensor.narrow(dim, tp_rank * size, size).clone()


# ==================== collectives, counted: every call records what it carried in a CommLog
def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None, log: CommLog | None) -> torch.Tensor:
    """Sum of `x` over the group's ranks, as a NEW tensor; `x` itself is left untouched (autograd
    can hand one gradient tensor to two branches, e.g. both sides of a residual add)."""
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    if log is not None:
        log.record("all_reduce", out, dist.get_world_size(group))
    return out


def all_gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None, log: CommLog | None) -> torch.Tensor:
    """(..., d/N) on every rank -> (..., d) on every rank, rank r's piece at columns r*d/N...."""
    x = x.contiguous()
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, x, group=group)
    out = torch.cat(pieces, dim=-1)
    if log is not None:
        log.record("all_gather", out, dist.get_world_size(group))
    return out


def own_chunk_last_dim(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(..., d) -> (..., d/N): this rank's contiguous chunk of the last dimension. No communication."""
    return shard(x, -1, dist.get_rank(group), dist.get_world_size(group))


# ======= Megatron-LM's conjugate operators (Shoeybi et al. 2019, arXiv:1909.08053, sec. 3, fig. 3)
# `ctx` inside an autograd.Function is autograd's context object (not helpers.dist.DistContext):
# forward stores what backward needs on it. backward returns one gradient per forward input, None
# for the non-tensor inputs (group, log).


class CopyToTensorParallelRegion(torch.autograd.Function):
    """Megatron's f: the identity in the forward pass; its backward is the exercise.

    It sits where a replicated activation X (..., d_in) enters a column-parallel layer: every rank
    holds the same X and multiplies it by its own columns A_r of the weight matrix, Y_r = X A_r,
    and the loss depends on X through every rank's Y_r. (nn.Linear stores A transposed: `weight`
    = A_r^T (out/N, in).)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, log: CommLog | None):
        ctx.group, ctx.log = group, log
        return x

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """Exercise (f_g_backward): return (dL/dx, None, None), one gradient per forward input.

        grad_output (..., d_in) is what autograd computed on this rank: dL/dx through this rank's
        Y_r only. Return dL/dx, the same on every rank of `ctx.group`. Which communication, if
        any, turns one into the other is the question of notebook 05, section 4. Communicate only
        through this module's helpers (all_reduce_sum, all_gather_last_dim, own_chunk_last_dim):
        they record what they send in `ctx.log`, and the tests read that record. Do not modify
        grad_output in place. Tests: input and weight gradients against the dense MLP (float64,
        2 and 3 ranks), the collectives this backward issues, and that it works on a sub-group
        (`ctx.group`)."""
        ### BEGIN SOLUTION
        return all_reduce_sum(grad_output, ctx.group, ctx.log), None, None
        ### END SOLUTION


class ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Megatron's g: an all-reduce (sum) in the forward pass; its backward is the exercise.

    It sits after a row-parallel layer: rank r holds the partial product Y_r = X_r B_r and the
    output is Y = sum_r Y_r, the same on every rank."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: dist.ProcessGroup | None, log: CommLog | None):
        ctx.group, ctx.log = group, log
        return all_reduce_sum(partial, group, log)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """Exercise (f_g_backward): return (dL/dpartial, None, None).

        The forward returned y = the sum over the ranks of `partial`. grad_output = dL/dy
        (..., d_out) is complete and identical on every rank (every rank computes the same loss
        from the same y). Same helpers and rules as f's backward. Tests: gradients against the
        dense MLP and the collectives this backward issues (none more than it needs)."""
        ### BEGIN SOLUTION
        return grad_output, None, None
        ### END SOLUTION


class GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather along the last dimension in the forward pass (the all-gather scheme's operator)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, log: CommLog | None):
        ctx.group, ctx.log = group, log
        return all_gather_last_dim(x, group, log)  # (..., d/N) -> (..., d)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """Exercise (gather_backward): return (dL/dx, None, None).

        The forward put this rank's x (..., d/N) at columns r*d/N ... (r+1)*d/N - 1 of its output
        y (..., d), r being this rank's index in `ctx.group`. grad_output = dL/dy (..., d) is
        complete and identical on every rank; dL/dx has x's shape. Same helpers and rules as f's
        backward. Tests: gradients against the dense MLP (2 and 3 ranks), the collectives this
        backward issues (none more than it needs), and a sub-group."""
        ### BEGIN SOLUTION
        return own_chunk_last_dim(grad_output, ctx.group), None, None
        ### END SOLUTION


def copy_to_tp_region(x, group=None, log=None):
    return CopyToTensorParallelRegion.apply(x, group, log)


def reduce_from_tp_region(partial, group=None, log=None):
    return ReduceFromTensorParallelRegion.apply(partial, group, log)


def gather_from_tp_region(x, group=None, log=None):
    return GatherFromTensorParallelRegion.apply(x, group, log)


# ================================================================== the layers
class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A (out, in) split by output features (rows of A, columns of Y).

    Rank r holds `weight` = A_r (out/N, in) (rows r*out/N ...) and `bias` = b_r (out/N). Input X
    (..., in), the same on every rank; output Y_r (..., out/N), left split, or all-gathered to
    (..., out) with gather_output=True. Build it with `from_dense`; __init__ allocates zeros."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: dist.ProcessGroup | None = None, gather_output: bool = False,
                 log: CommLog | None = None, device=None, dtype=None):
        super().__init__()
        self.group, self.gather_output, self.comm_log = group, gather_output, log
        self.tp_rank, self.tp_world_size = dist.get_rank(group), dist.get_world_size(group)
        self.in_features, self.out_features = in_features, out_features
        local_out = divide(out_features, self.tp_world_size,
                           "out_features of a column-parallel layer over the tensor-parallel ranks")
        self.weight = nn.Parameter(torch.zeros(local_out, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(local_out, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: dist.ProcessGroup | None = None, *,
                   gather_output: bool = False, log: CommLog | None = None) -> "ColumnParallelLinear":
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                    gather_output=gather_output, log=log, device=linear.weight.device,
                    dtype=linear.weight.dtype)
        with torch.no_grad():
            for name, param in layer.named_parameters():
                param.copy_(layer.local_part(name, getattr(linear, name)))
        return layer

    def local_part(self, name: str, dense: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the dense layer's `name` ("weight" or "bias") or of its gradient."""
        return shard(dense, 0, self.tp_rank, self.tp_world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp_region(x, self.group, self.comm_log)  # f: the identity here; see its backward
        y = F.linear(x, self.weight, self.bias)              # (..., out/N): this rank's columns
        if self.gather_output:
            y = gather_from_tp_region(y, self.group, self.comm_log)  # (..., out)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (this rank: {self.weight.shape[0]}), "
                f"tp_rank={self.tp_rank}/{self.tp_world_size}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """Y = X B^T + b with B (out, in) split by input features (columns of B).

    Rank r holds `weight` = B_r (out, in/N) (columns r*in/N ...) and the full `bias` (out). Input
    X_r (..., in/N), rank r's chunk (a column-parallel layer's output); output Y (..., out), the
    same on every rank: one all-reduce sums the partial products, then the bias is added once.
    Build it with `from_dense`; __init__ allocates zeros."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: dist.ProcessGroup | None = None, log: CommLog | None = None,
                 device=None, dtype=None):
        super().__init__()
        self.group, self.comm_log = group, log
        self.tp_rank, self.tp_world_size = dist.get_rank(group), dist.get_world_size(group)
        self.in_features, self.out_features = in_features, out_features
        local_in = divide(in_features, self.tp_world_size,
                          "in_features of a row-parallel layer over the tensor-parallel ranks")
        self.weight = nn.Parameter(torch.zeros(out_features, local_in, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: dist.ProcessGroup | None = None, *,
                   log: CommLog | None = None) -> "RowParallelLinear":
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                    log=log, device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            for name, param in layer.named_parameters():
                param.copy_(layer.local_part(name, getattr(linear, name)))
        return layer

    def local_part(self, name: str, dense: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the dense layer's `name` ("weight" or "bias") or of its gradient."""
        if name == "bias":
            return dense.detach().clone()  # replicated: every rank holds all of it
        return shard(dense, 1, self.tp_rank, self.tp_world_size)

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x_local, self.weight)                          # (..., out): X_r B_r^T
        y = reduce_from_tp_region(partial, self.group, self.comm_log)     # g: sum over ranks
        # The bias joins after the sum: added to every partial it would be counted N times.
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (this rank: {self.weight.shape[1]}), out={self.out_features}, "
                f"tp_rank={self.tp_rank}/{self.tp_world_size}")


# ===== the MLP, dense and in both parallel schemes: the same forward, other layers
class MLP(nn.Module):
    def __init__(self, fc1: nn.Module, fc2: nn.Module):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def dense_mlp(d_model: int, d_ff: int, *, seed: int = 0, dtype=torch.float32, device="cpu") -> MLP:
    """The reference: the same weights on every rank (same seed, built on the CPU, then moved)."""
    with seeded(seed):
        mlp = MLP(nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model))
    return mlp.to(device=device, dtype=dtype)


def allgather_mlp(dense: MLP, group=None, log: CommLog | None = None) -> MLP:
    """Both layers split by output features, each all-gathering its output (the first scheme)."""
    return MLP(ColumnParallelLinear.from_dense(dense.fc1, group, gather_output=True, log=log),
               ColumnParallelLinear.from_dense(dense.fc2, group, gather_output=True, log=log))


def megatron_mlp(dense: MLP, group=None, log: CommLog | None = None) -> MLP:
    """Column-parallel fc1 (output stays split; gelu is elementwise so it runs on the split),
    row-parallel fc2: one all-reduce (g) in the forward pass."""
    return MLP(ColumnParallelLinear.from_dense(dense.fc1, group, log=log),
               RowParallelLinear.from_dense(dense.fc2, group, log=log))


SCHEMES = {"allgather": allgather_mlp, "megatron": megatron_mlp}


# ============================ checking a parallel model against its dense twin
def max_param_diffs(tp_model: nn.Module, dense_model: nn.Module, *, grads: bool = False) -> dict[str, float]:
    """Per parameter: max |this rank's tensor - this rank's piece of the dense one| (or of grads).
    Modules are matched by name, so the parallel model must keep the dense model's names."""
    dense_params = dict(dense_model.named_parameters())
    diffs = {}
    for module_name, module in tp_model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{leaf}" if module_name else leaf
            mine, ref = (param.grad, dense_params[name].grad) if grads else (param, dense_params[name])
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                ref = module.local_part(leaf, ref)
            diffs[name] = (mine.detach() - ref.detach()).abs().max().item()
    return diffs


def compare_training(dense: nn.Module, parallel: nn.Module, x: torch.Tensor, target: torch.Tensor,
                     *, steps: int, lr: float = 0.05) -> dict:
    """Run forward, backward and `steps` SGD steps (momentum 0.9) on both models with the same
    data; return max |difference| of outputs, input grads, grads (first step) and parameters."""
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m in (dense, parallel)]
    out = {"output": 0.0, "input_grad": 0.0, "losses_dense": [], "losses_parallel": []}
    for step in range(steps):
        ys, xgrads = [], []
        for model, opt, key in zip((dense, parallel), opts, ("losses_dense", "losses_parallel")):
            xi = x.detach().clone().requires_grad_(True)
            opt.zero_grad()
            y = model(xi)
            loss = F.mse_loss(y, target)
            loss.backward()
            ys.append(y.detach())
            xgrads.append(xi.grad)
            out[key].append(loss.item())
        if step == 0:
            out["output"] = (ys[0] - ys[1]).abs().max().item()
            out["input_grad"] = (xgrads[0] - xgrads[1]).abs().max().item()
            out["grads"] = max_param_diffs(parallel, dense, grads=True)
        for opt in opts:
            opt.step()
    out["params_after_steps"] = max_param_diffs(parallel, dense)
    return out


def worst(diffs: dict) -> float:
    """Largest difference in a compare_training result."""
    values = [diffs["output"], diffs["input_grad"], *diffs["grads"].values(),
              *diffs["params_after_steps"].values()]
    return max(values)


# ================================= the run: both schemes against the dense MLP
def sample_batch(batch: int, seq: int, d_model: int, *, seed: int, dtype, device):
    """x and target (batch, seq, d_model), identical on every rank (CPU generator, then moved)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, d_model, generator=gen, dtype=dtype)
    target = torch.randn(batch, seq, d_model, generator=gen, dtype=dtype)
    return x.to(device), target.to(device)


def step_collectives(model: nn.Module, log: CommLog, x: torch.Tensor) -> list[LoggedCollective]:
    """The collectives of one forward and one backward, the input requiring grad (as it does
    inside a network: otherwise autograd skips the first f's backward)."""
    log.clear()
    log.phase = "forward"
    y = model(x.detach().clone().requires_grad_(True))
    log.phase = "backward"
    y.square().mean().backward()
    calls = list(log.calls)
    log.clear()
    return calls


@dataclass(frozen=True)
class Run(runs.Run):
    """The MLP (d_model -> d_ff -> d_model) and its batch, the SGD steps side by side with the
    dense MLP, and the dtype (a torch dtype's name)."""
    batch: int = 4
    seq: int = 64
    d_model: int = 192
    d_ff: int = 768
    steps: int = 3
    dtype: str = "float32"
    SMOKE = dict(batch=2, seq=8, d_model=48, d_ff=192)


def forward_difference(dense: nn.Module, parallel: nn.Module, x: torch.Tensor) -> float:
    """max |parallel(x) - dense(x)|: the forward pass alone, which needs no backward."""
    with torch.no_grad():
        return (parallel(x) - dense(x)).abs().max().item()


def check_scheme(scheme: str, x: torch.Tensor, target: torch.Tensor, d_model: int, d_ff: int, *,
                 steps: int, dtype, device) -> dict:
    """One scheme against the dense MLP: its collectives per forward+backward, then `steps` SGD
    steps side by side (compare_training). Needs the backward passes."""
    log = CommLog()
    parallel = SCHEMES[scheme](dense_mlp(d_model, d_ff, dtype=dtype, device=device), None, log)
    calls = [(c.phase, c.op, list(c.shape)) for c in step_collectives(parallel, log, x)]
    return {"calls": calls, **compare_training(dense_mlp(d_model, d_ff, dtype=dtype, device=device),
                                               parallel, x, target, steps=steps)}


def run(ctx: DistContext, cfg: Run) -> dict:
    """Both schemes against the dense MLP: the forward outputs, then (`check`, once the backward
    passes are written) `cfg.steps` SGD steps side by side and each scheme's collectives."""
    sizes = {k: getattr(cfg, k) for k in ("batch", "seq", "d_model", "d_ff")}
    steps, dtype = cfg.steps, getattr(torch, cfg.dtype)
    for what in ("d_model", "d_ff"):  # a clear error before any work
        divide(sizes[what], ctx.world_size, f"{what} of the MLP over the tensor-parallel ranks")
    batch, seq, d_model, d_ff = (sizes[k] for k in ("batch", "seq", "d_model", "d_ff"))
    x, target = sample_batch(batch, seq, d_model, seed=0, dtype=dtype, device=ctx.device)
    dense = dense_mlp(d_model, d_ff, dtype=dtype, device=ctx.device)
    result = {"sizes": dict(sizes, steps=steps), "forward": {}, "check": {}}
    for scheme, build in SCHEMES.items():
        result["forward"][scheme] = forward_difference(dense, build(dense, None, None), x)
        result["check"][scheme] = attempt(check_scheme, scheme, x, target, d_model, d_ff,
                                          steps=steps, dtype=dtype, device=ctx.device)
    return result


def main(argv: list[str] | None = None) -> None:
    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        result = run(ctx, cfg)
        s = result["sizes"]
        ctx.print0(f"MLP {s['d_model']} -> {s['d_ff']} -> {s['d_model']} on {ctx.world_size} ranks "
                   f"({ctx.backend}, {ctx.device.type}), {s['steps']} SGD steps against the dense MLP")
        rows = []
        for scheme, check in result["check"].items():
            trained = "unsolved" not in check
            rows.append({"scheme": scheme, "forward: max |diff|": result["forward"][scheme],
                         "collectives (forward, then backward)":
                             ", ".join(op for _, op, _ in check["calls"]) if trained else "-",
                         "training: max |diff|": worst(check) if trained else "backward not written"})
            if max(result["forward"][scheme], worst(check) if trained else 0.0) > 1e-4:
                raise RuntimeError(f"{scheme} MLP differs from the dense one: {rows[-1]}")
        if ctx.rank == 0:
            table(rows, title="Both schemes against dense (fp32)")
        ctx.report(**result)


if __name__ == "__main__":
    main()
