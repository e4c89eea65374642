"""Lab 05 (part 2): what tensor parallelism sends. Bytes and time per MLP, counted, next to the formula.

Run:  ./run.sh 05      (or: ./run.sh labs/lab05_tp_comm_volume.py)

Every collective of labs/lab05_tensor_parallel.py goes through `all_reduce_sum` or
`all_gather_last_dim`, which record what they carried in a CommLog. Here one forward+backward of
the MLP, fc2(gelu(fc1(x))) with x [T, d] and a hidden width d_ff, runs in both schemes, and the
counted bytes stand beside the formulas (b bytes per element, N ranks; per-rank ring traffic as in
notebook 04: 2(N-1)/N K for an all-reduce of K bytes, (N-1)/N K for an all-gather):
- all-gather scheme, forward: gathers of [T, d_ff] and [T, d]; backward: the f before each layer
  all-reduces an input gradient, [T, d_ff] and [T, d];
- Megatron pairing, forward: one all-reduce of [T, d] (g); backward: one all-reduce of [T, d] (f).
Then both are timed, and one layer's matmul is timed against the all-gather of its output: the
ratio of link bandwidth to compute speed is what decides whether the all-gather scheme is viable
(and why tensor parallelism stays inside one NVLink-connected node).
"""
from __future__ import annotations

from dataclasses import asdict

import torch
import torch.nn as nn

from helpers import pick
from helpers.bench import measure
from helpers.dist import DistContext, distributed
from helpers.show import table
from labs.lab05_tensor_parallel import (
    SCHEMES, Collective, CommLog, all_gather_last_dim, count_collectives, dense_mlp, divide,
    ring_bytes_sent, sample_batch,
)


def mlp_collectives_formula(scheme: str, tokens: int, d_model: int, d_ff: int) -> list[tuple[str, str, int]]:
    """(phase, op, elements of the full result) of each collective of one MLP forward+backward,
    in order, for an input of `tokens` rows that requires grad (as inside a network)."""
    if scheme == "allgather":
        return [("forward", "all_gather", tokens * d_ff),      # fc1's output [T, d_ff]
                ("forward", "all_gather", tokens * d_model),   # fc2's output [T, d]
                ("backward", "all_reduce", tokens * d_ff),     # f before fc2: dL/dh [T, d_ff]
                ("backward", "all_reduce", tokens * d_model)]  # f before fc1: dL/dx [T, d]
    if scheme == "megatron":
        return [("forward", "all_reduce", tokens * d_model),   # g after fc2: y [T, d]
                ("backward", "all_reduce", tokens * d_model)]  # f before fc1: dL/dx [T, d]
    raise ValueError(f"unknown scheme {scheme!r}; expected one of {sorted(SCHEMES)}")


FORMULA_TEXT = {  # bytes each rank sends (ring), b bytes per element
    ("allgather", "forward"): "(N-1)/N·T·(d_ff+d)·b",
    ("allgather", "backward"): "2(N-1)/N·T·(d_ff+d)·b",
    ("megatron", "forward"): "2(N-1)/N·T·d·b",
    ("megatron", "backward"): "2(N-1)/N·T·d·b",
}


def comm_rows(scheme: str, calls: list[Collective], tokens: int, d_model: int, d_ff: int,
              world_size: int, bytes_per_element: int) -> list[dict]:
    """One table row per phase: the collectives and bytes the log counted, next to the formula."""
    expected = mlp_collectives_formula(scheme, tokens, d_model, d_ff)
    rows = []
    for phase in ("forward", "backward"):
        mine = [c for c in calls if c.phase == phase]
        want = [(op, n * bytes_per_element) for p, op, n in expected if p == phase]
        rows.append({
            "scheme": scheme, "phase": phase,
            "collectives": " + ".join(c.op for c in mine),
            "payload MB": sum(c.payload_bytes for c in mine) / 1e6,
            "sent/rank MB (counted)": sum(c.ring_bytes_sent for c in mine) / 1e6,
            "formula": FORMULA_TEXT[scheme, phase],
            "sent/rank MB (formula)": sum(ring_bytes_sent(op, k, world_size) for op, k in want) / 1e6,
        })
    return rows


def time_forward_backward(model: nn.Module, x: torch.Tensor, device, repeats: int) -> float:
    """Median seconds of one forward + backward, every repeat started on all ranks together."""
    xg = x.detach().clone().requires_grad_(True)

    def step():
        model.zero_grad(set_to_none=True)
        model(xg).square().mean().backward()

    return measure(step, warmup=1, repeats=repeats, device=device, barrier=True).median


def layer_comm_vs_compute(ctx: DistContext, tokens: int, d_in: int, d_out: int, repeats: int) -> dict:
    """One column-parallel layer on this machine: its matmul [T, d_in] x [d_in, d_out/N] against
    the all-gather of its output to [T, d_out] (what the all-gather scheme adds to every layer)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, d_in, generator=gen).to(ctx.device)
    w = torch.randn(divide(d_out, ctx.world_size, "d_out"), d_in, generator=gen).to(ctx.device)
    y = x @ w.T                                                     # [T, d_out/N]
    matmul_s = measure(lambda: x @ w.T, repeats=repeats, device=ctx.device, barrier=True).median
    gather_s = measure(lambda: all_gather_last_dim(y, None, None), repeats=repeats,
                       device=ctx.device, barrier=True).median
    flops = 2 * tokens * d_in * y.shape[1]
    sent = ring_bytes_sent("all_gather", tokens * d_out * y.element_size(), ctx.world_size)
    return {"matmul_s": matmul_s, "all_gather_s": gather_s, "flops_per_s": flops / matmul_s,
            "sent_bytes_per_s": sent / gather_s, "comm_over_compute": gather_s / matmul_s}


# Spec-sheet figures for the model below (not measured here): the H100 SXM's dense bf16
# tensor-core peak, and link bandwidth per direction (in a ring every rank sends one way).
H100_BF16_FLOPS = 989e12
LINKS_BYTES_PER_S = {
    "NVLink 4 (H100: 900 GB/s both ways)": 450e9,
    "PCIe 7.0 x16": 242e9,
    "PCIe 5.0 x16": 63e9,
    "Ethernet 100 Gb/s": 12.5e9,
}


def comm_vs_compute_model(tokens: int, d_model: int, d_ff: int, world_size: int, bytes_per_element: int,
                          flops_per_s: float, link_bytes_per_s: float) -> dict:
    """Seconds per MLP forward: this rank's two matmuls at `flops_per_s` against each scheme's
    forward communication at `link_bytes_per_s`, with the ring formulas (no latency, no overlap)."""
    compute = 2 * 2 * tokens * d_model * d_ff / world_size / flops_per_s
    out = {"compute_s": compute}
    for scheme in SCHEMES:
        sent = sum(ring_bytes_sent(op, n * bytes_per_element, world_size)
                   for phase, op, n in mlp_collectives_formula(scheme, tokens, d_model, d_ff)
                   if phase == "forward")
        out[f"{scheme}_comm_s"] = sent / link_bytes_per_s
        out[f"{scheme}_comm_over_compute"] = out[f"{scheme}_comm_s"] / compute
    return out


SIZES = dict(batch=pick(4, 2), seq=pick(128, 16), d_model=pick(384, 48), d_ff=pick(1536, 192))


def run(ctx: DistContext, batch: int = SIZES["batch"], seq: int = SIZES["seq"],
        d_model: int = SIZES["d_model"], d_ff: int = SIZES["d_ff"], repeats: int = pick(5, 2)) -> dict:
    """Count and time one forward+backward of each scheme (fp32) and of the dense MLP on one rank."""
    for what, size in (("d_model", d_model), ("d_ff", d_ff)):
        divide(size, ctx.world_size, what)  # a clear error before any work
    tokens = batch * seq
    x, _ = sample_batch(batch, seq, d_model, seed=0, dtype=torch.float32, device=ctx.device)
    dense = dense_mlp(d_model, d_ff, device=ctx.device)
    result = {"sizes": dict(batch=batch, seq=seq, tokens=tokens, d_model=d_model, d_ff=d_ff),
              "calls": {}, "comm_rows": [], "seconds": {}}
    for scheme, build in SCHEMES.items():
        log = CommLog()
        parallel = build(dense, None, log)
        calls = count_collectives(parallel, log, x)
        result["calls"][scheme] = [asdict(c) for c in calls]
        result["comm_rows"] += comm_rows(scheme, calls, tokens, d_model, d_ff, ctx.world_size, 4)
        parallel = build(dense, None, None)  # timed without the log
        result["seconds"][scheme] = time_forward_backward(parallel, x, ctx.device, repeats)
    result["seconds"]["dense (one rank)"] = time_forward_backward(dense, x, ctx.device, repeats)
    result["layer"] = layer_comm_vs_compute(ctx, tokens, d_model, d_ff, repeats)
    return result


def print_summary(ctx: DistContext, result: dict) -> None:
    s = result["sizes"]
    ctx.print0(f"MLP {s['d_model']} -> {s['d_ff']} -> {s['d_model']}, {s['tokens']} tokens, "
               f"{ctx.world_size} ranks, {ctx.backend} on {ctx.device.type}")
    if ctx.rank != 0:
        return
    table(result["comm_rows"], title="Communication per MLP forward+backward, counted vs formula",
          floatfmt=".4g")
    table([{"scheme": k, "forward+backward ms": 1e3 * v} for k, v in result["seconds"].items()],
          title="Time per MLP (median)")
    layer = result["layer"]
    print(f"one column layer: matmul {1e3 * layer['matmul_s']:.2f} ms, all-gather of its output "
          f"{1e3 * layer['all_gather_s']:.2f} ms ({layer['comm_over_compute']:.2f}x the matmul)", flush=True)


def main() -> None:
    with distributed() as ctx:
        result = run(ctx)
        print_summary(ctx, result)
        ctx.report(**result)


if __name__ == "__main__":
    main()
