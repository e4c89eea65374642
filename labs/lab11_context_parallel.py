"""Lab 11 (torch's context parallelism): what `torch.distributed.tensor.experimental.context_parallel`
does, what it needs, and its ring run on this machine beside ours.

Run:  ./run.sh 11      (this file alone: ./run.sh labs/lab11_context_parallel.py)

`context_parallel(mesh, buffers=[...], buffer_seq_dims=[...])` (a prototype API in torch 2.13)
shards the listed buffers along the sequence, in place, by default in the head-tail (zig-zag)
layout of lab11_zigzag.py, and for the length of the block replaces
F.scaled_dot_product_attention: its inputs become DTensors sharded on the sequence and the SDPA
kernel call is dispatched to a ring (`_templated_ring_attention`; backward
`_templated_ring_attention_backward`). Only the CUDA kernels are routed there: flash, memory-
efficient and cuDNN attention (`_sdpa_handler` in torch/distributed/tensor/experimental/
_context_parallel/_attention.py). On the CPU, SDPA calls `_scaled_dot_product_flash_attention_for_cpu`,
which has no such route, and the call fails; this lab runs it, records the error, and runs it for
real when every rank has a GPU (nccl).

The same file has a second, module-wrapper API, the one torchtitan uses now
(torchtitan/distributed/context_parallel.py): `_ContextParallel(seq_dim, attention_type)`, a
ParallelStyle that `parallelize_module` applies to each attention module (SDPA: its inputs
become sequence-sharded DTensors, with `_enable_context_parallel_dispatcher()`; FlexAttention:
K and V are all-gathered, `flex_cp_allgather`), and `_context_parallel_shard(mesh, buffers,
seq_dims, load_balancer)` to shard the inputs, labels and positions, with a load balancer
(`_HeadTailLoadBalancer`, `_PerDocumentHeadTailLoadBalancer`, `_PTRRLoadBalancer` in
_context_parallel/_load_balancer.py). `api_summary` lists what this torch has.

The ring itself is plain torch code over a process group and an attention op that returns
(out, log-sum-exp). Given the CPU kernel, it runs here: `torch_ring` calls it (private functions:
they may change between versions) on the same inputs as ours, forward and backward, in both
layouts, with both of its ways to move K/V: "allgather" (its default: every rank gathers every
K/V block at once, one collective, N blocks held) and "alltoall" (a ring of permutes, one block
in flight).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

import labs.lab11_ring_attention as ring
from helpers import pick
from helpers.dist import DistContext, device_mesh, distributed
from helpers.notice import attempt
from helpers.show import table
from labs.lab11_results import Shown

ROTATE_METHODS = ("allgather", "alltoall")


def _private():
    """torch's private context-parallel pieces, or None when this torch has none."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    except ImportError:
        try:
            from torch.distributed.tensor.experimental import _attention as cp
        except ImportError:
            return None
    needed = ("_templated_ring_attention", "_templated_ring_attention_backward", "_cp_options",
              "_RotateMethod")
    return cp if all(hasattr(cp, name) for name in needed) else None


# ============================================================================ context_parallel
def try_context_parallel(device: torch.device, sizes: dict, group=None) -> dict:
    """F.scaled_dot_product_attention (causal) inside torch's context_parallel on this device,
    forward and backward, against one process's SDPA. On the CPU it fails: the error, as raised,
    is the result ("ran": False)."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    n = dist.get_world_size(group)
    b, a, s, d = sizes["batch"], sizes["heads"], sizes["seq_local"] * n, sizes["head_dim"]
    q, k, v = ring.sample_qkv(b, a, s, d, dtype=torch.float32, device=device)
    dout = ring.sample_qkv(b, a, s, d, seed=1, dtype=torch.float32, device=device)[0]
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*full, is_causal=True)
    expected.backward(dout)
    mesh = device_mesh(device.type, cp=n)
    buffers = [q.clone(), k.clone(), v.clone(), dout.clone()]     # sharded in place inside
    try:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]):
            mine = [t.detach().clone().requires_grad_(True) for t in buffers[:3]]
            out = F.scaled_dot_product_attention(*mine, is_causal=True)
            out.backward(buffers[3])
            local = {"output": out.detach(), "dq": mine[0].grad, "dk": mine[1].grad, "dv": mine[2].grad}
            local_shape = tuple(buffers[0].shape)
    except Exception as err:  # what the CPU path raises: recorded, it is this part's result
        return {"ran": False, "device": str(device), "error": f"{type(err).__name__}: {err}"}
    whole = context_parallel_unshard(mesh, list(local.values()), [2] * len(local))
    reference = {"output": expected, "dq": full[0].grad, "dk": full[1].grad, "dv": full[2].grad}
    return {"ran": True, "device": str(device), "local_shape": local_shape,
            "max_abs_diff": {name: (got - reference[name].detach()).abs().max().item()
                             for name, got in zip(local, whole)}}


# ============================================================================ its ring, on the CPU
@contextlib.contextmanager
def _functional_collectives_counted() -> Iterator[list]:
    """Record (name, bytes this rank sent) of the functional collectives torch's ring calls
    (all_gather_single: its block to N-1 ranks; permute_tensor: its block to one)."""
    import torch.distributed._functional_collectives as ft_c

    log: list[tuple[str, int]] = []
    saved = {name: getattr(ft_c, name) for name in ("all_gather_single", "permute_tensor")}

    def all_gather_single(tensor, gather_dim, group, *args, **kwargs):
        log.append(("all_gather", tensor.nbytes * (dist.get_world_size(group) - 1)))
        return saved["all_gather_single"](tensor, gather_dim, group, *args, **kwargs)

    def permute_tensor(tensor, src_dst, group, *args, **kwargs):
        log.append(("permute", tensor.nbytes))
        return saved["permute_tensor"](tensor, src_dst, group, *args, **kwargs)

    ft_c.all_gather_single, ft_c.permute_tensor = all_gather_single, permute_tensor
    try:
        yield log
    finally:
        for name, fn in saved.items():
            setattr(ft_c, name, fn)


@contextlib.contextmanager
def _cp_settings(cp, rotate: str, load_balance: bool) -> Iterator[None]:
    """torch's global context-parallel options for the block: rotate method, load balancing, and
    no float32 upcast (we compare float64 results); restored afterwards."""
    options = cp._cp_options
    saved = (options.rotate_method, options.enable_load_balance, options.convert_to_f32)
    options.rotate_method = {"allgather": cp._RotateMethod.ALL_GATHER,
                             "alltoall": cp._RotateMethod.ALL_TO_ALL}[rotate]
    options.enable_load_balance, options.convert_to_f32 = load_balance, False
    try:
        yield
    finally:
        options.rotate_method, options.enable_load_balance, options.convert_to_f32 = saved


def torch_ring(q, k, v, dout, layout: str, rotate: str, group=None) -> dict:
    """torch's `_templated_ring_attention` and its backward on this rank's shard (causal; the
    zig-zag layout is torch's load-balanced one), with the CPU kernel as the block op. Returns
    out, dq, dk, dv and the bytes its collectives sent, per pass."""
    cp = _private()
    aten = torch.ops.aten
    group = group if group is not None else dist.group.WORLD
    with _cp_settings(cp, rotate, load_balance=layout == "zigzag"):
        with _functional_collectives_counted() as forward:
            out, lse = cp._templated_ring_attention(
                group, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v, is_causal=True)[:2]
        with _functional_collectives_counted() as backward:
            dq, dk, dv = cp._templated_ring_attention_backward(
                group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward, dout, "grad_out",
                q, k, v, out, lse, is_causal=True, dropout_p=0.0)[:3]
    return {"output": out, "dq": dq, "dk": dk, "dv": dv,
            "sent_bytes": {"forward": sum(n for _, n in forward), "backward": sum(n for _, n in backward)},
            "collectives": {"forward": [c for c, _ in forward], "backward": [c for c, _ in backward]}}


def compare_rings(device: torch.device, sizes: dict, group=None) -> dict:
    """torch's ring (both layouts, both rotate methods) and ours against one process's SDPA on the
    same causal float64 input; ours for the contiguous layout is the homework's ring_attention."""
    from labs.lab11_zigzag import zigzag_ring_attention

    rank, n = dist.get_rank(group), dist.get_world_size(group)
    b, a, s, d = sizes["batch"], sizes["heads"], sizes["seq_local"] * n, sizes["head_dim"]
    q, k, v = ring.sample_qkv(b, a, s, d, device=device)
    dout = ring.sample_qkv(b, a, s, d, seed=1, device=device)[0]
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*full, is_causal=True)
    expected.backward(dout)
    reference = {"output": expected.detach(), "dq": full[0].grad, "dk": full[1].grad, "dv": full[2].grad}

    def diffs(results: dict, layout: str) -> dict:
        return {name: (results[name] - ring.sequence_shard(reference[name], rank, n, layout)).abs().max().item()
                for name in reference}

    rows = []
    for layout in ring.LAYOUTS:
        mine = [ring.sequence_shard(t, rank, n, layout) for t in (q, k, v, dout)]
        for rotate in ROTATE_METHODS:
            result = torch_ring(*mine, layout, rotate, group)
            rows.append({"implementation": f"torch, {rotate}", "layout": layout, **diffs(result, layout),
                         "sent_bytes": result["sent_bytes"], "collectives": result["collectives"]})
        ours = ring.ring_attention if layout == "contiguous" else zigzag_ring_attention
        result = attempt(_ours, ours, *mine, group)
        if "unsolved" in result:
            rows.append({"implementation": "ours", "layout": layout, **result})
        else:
            rows.append({"implementation": "ours", "layout": layout, **diffs(result, layout),
                         "sent_bytes": result["sent_bytes"], "collectives": "isend/irecv"})
    return {"rows": rows}


def _ours(attention, q, k, v, dout, group) -> dict:
    from helpers.comm_count import count_p2p

    mine = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with count_p2p() as forward:
        out = attention(*mine, causal=True, group=group)
    with count_p2p() as backward:
        out.backward(dout)
    return {"output": out.detach(), "dq": mine[0].grad, "dk": mine[1].grad, "dv": mine[2].grad,
            "sent_bytes": {"forward": forward.sent_bytes, "backward": backward.sent_bytes}}


def default_sizes() -> dict:
    return dict(batch=1, heads=4, seq_local=pick(64, 8), head_dim=pick(32, 8))


def run(ctx: DistContext, **sizes) -> dict:
    """torch's context_parallel on this device (the error, on the CPU), and, where the CPU kernel
    can serve as its block op, torch's ring beside ours."""
    s = {**default_sizes(), **sizes}
    out = {"sizes": s, "world_size": ctx.world_size,
           "context_parallel": try_context_parallel(ctx.device, s)}
    if ctx.device.type == "cuda" and not out["context_parallel"]["ran"]:
        raise RuntimeError(f"context_parallel failed on {ctx.device}: {out['context_parallel']['error']}")
    if ctx.device.type != "cpu":
        out["torch_ring"] = {"skipped": "the CPU kernel is the block op here: on GPUs, "
                                        "context_parallel above runs torch's ring itself"}
    elif _private() is None:
        out["torch_ring"] = {"skipped": f"torch {torch.__version__} has no _templated_ring_attention"}
    else:
        out["torch_ring"] = compare_rings(ctx.device, s)
    return out


# ============================================================================ what the notebook shows
WRAPPER_API = ("_ContextParallel", "_context_parallel_shard", "_enable_context_parallel_dispatcher",
               "_HeadTailLoadBalancer", "_PerDocumentHeadTailLoadBalancer", "_PTRRLoadBalancer")


def api_summary() -> Shown:
    """What this torch's context-parallel module offers, read from it: the rotate methods and the
    defaults of the context-manager API, and which pieces of the module-wrapper API exist."""
    cp = _private()
    if cp is None:
        return Shown(f"torch {torch.__version__} has no _templated_ring_attention: the ring comparison is skipped", [], [])
    try:
        from torch.distributed.tensor.experimental import _context_parallel as package
    except ImportError:
        package = cp
    options = cp._cp_options
    found = [name for name in WRAPPER_API if hasattr(package, name)]
    return Shown(f"torch {torch.__version__}'s context parallelism", [], [
        f"context_parallel(): rotate methods {[m.name for m in cp._RotateMethod]}, default "
        f"{options.rotate_method.name}; load balancing (head-tail) on by default: {options.enable_load_balance}",
        f"module-wrapper API (torchtitan's): {', '.join(found) if found else 'not in this torch'}"])


def context_parallel_line(report: dict) -> str:
    """Rank 0's `try_context_parallel` result, in words."""
    c = report["context_parallel"]
    if c["ran"]:
        diffs = {k: f"{v:.1e}" for k, v in c["max_abs_diff"].items()}
        return f"context_parallel ran on {c['device']}: local q {c['local_shape']}; largest difference from SDPA: {diffs}"
    return (f"context_parallel on {c['device']} fails" + (", as the dispatch table says for the CPU"
                                                          if c["device"] == "cpu" else "") + f":\n  {c['error']}")


def rings_summary(report: dict) -> Shown:
    """Rank 0's comparison of torch's ring and ours: differences, bytes and collectives, with the
    verdicts (the homework's row is left out while it is a stub)."""
    tr = report["torch_ring"]
    if "skipped" in tr:
        return Shown(tr["skipped"], [], [])
    done = [row for row in tr["rows"] if "unsolved" not in row]
    rows = [{"implementation": r["implementation"], "layout": r["layout"],
             **{k: r[k] for k in ("output", "dq", "dk", "dv")},
             "sent fwd B": r["sent_bytes"]["forward"], "sent bwd B": r["sent_bytes"]["backward"],
             "collectives (fwd; bwd)": r["collectives"] if isinstance(r["collectives"], str) else
             f"{', '.join(r['collectives']['forward'])}; {', '.join(r['collectives']['backward'])}"} for r in done]
    worst = max(r[k] for r in done for k in ("output", "dq", "dk", "dv"))
    lines = [f"largest difference from SDPA: {worst:.1e}" + (" (rounding)" if worst < 1e-9 else " (MORE than rounding)")]
    for layout in ring.LAYOUTS:
        by = {r["implementation"]: r["sent_bytes"] for r in done if r["layout"] == layout}
        if "ours" in by:
            lines.append(f"{layout}: ours sent {by['ours']}, torch's alltoall ring {by['torch, alltoall']}: "
                         + ("the same bytes" if by["ours"] == by["torch, alltoall"] else "different bytes"))
    return Shown(f"torch's ring and ours vs SDPA on one process, causal, float64, rank 0 of {report['world_size']}",
                 rows, lines)


def main() -> None:
    with distributed() as ctx:
        result = run(ctx)
        ctx.report(**result)
        cp = result["context_parallel"]
        if cp["ran"]:
            ctx.print0(f"context_parallel on {cp['device']}: local q {cp['local_shape']}, max |diff| "
                       f"vs SDPA on one process {cp['max_abs_diff']}")
        else:
            ctx.print0(f"context_parallel on {cp['device']} fails: {cp['error']}")
        rows = result["torch_ring"].get("rows")
        if ctx.rank == 0 and rows:
            table([{k: (f"{v:.1e}" if isinstance(v, float) else v) for k, v in row.items()}
                   for row in rows], title="torch's ring and ours vs SDPA on one process (causal, "
                                           "float64), rank 0; bytes this rank sent")
        if rows:
            worst = max(row[k] for row in rows if "output" in row for k in ("output", "dq", "dk", "dv"))
            if worst > 1e-9:
                raise RuntimeError(f"rank {ctx.rank}: a ring differs from SDPA by {worst:.2e}")


if __name__ == "__main__":
    main()
