"""Lab 11 (attention memory): why long sequences break the other parallelisms. One attention
layer's memory measured as the sequence grows, against the formula; then the same per rank of
ring attention.

Run:  ./run.sh 11      (this file alone: ./run.sh labs/lab11_attention_memory.py)

Attention written plainly, softmax(Q K^T / sqrt(d)) V, materialises an s x s score matrix per head
and keeps its softmax for the backward: a s^2 b elements per layer (a heads, s positions, b
sequences), against 3 s b h for q, k and v (h = a d). Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", arXiv:2205.05198, sec. 4.1) count the
attention part of a layer's activations as 5 a s^2 b bytes in fp16 with dropout: the softmax
output (2 bytes), the dropout mask (1) and the dropout output (2). Tensor parallelism divides it
by t (each rank has a/t heads) and sequence parallelism does not touch it: every rank still holds
the whole sequence, and the term grows with s^2. Measured here:

- `saved_bytes`: what autograd keeps for the backward of plain attention (exact, a saved-tensors
  hook: notebook 07's SavedTensorBytes) against `plain_attention_saved_bytes`, the formula with
  element size e and no dropout (3 s b h e + a s^2 b e; causal: + s^2 bytes of mask);
- `peak_bytes`: the highest level of allocated memory during forward and backward (torch.profiler
  on the CPU, torch.cuda's counters on a GPU): the score matrix and its softmax side by side
  (about 2 a s^2 b e), then dP and dS in the backward;
- the same for torch's fused SDPA kernel (FlashAttention's idea on the CPU: no s x s matrix kept;
  the compute is still s^2) and per rank of ring attention on N ranks: blocks of (s/N)^2, none
  kept for the backward (the ring part needs the homework, lab11_ring_attention.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import labs.lab11_ring_attention as ring
from helpers import pick
from helpers.dist import DistContext, distributed
from helpers.notice import attempt
from helpers.show import table
from labs.lab07_memory import SavedTensorBytes, peak_memory
from labs.lab11_results import Shown

MiB = 2**20


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v written out: the (b, a, s, s) scores exist in memory."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        seq = q.shape[-2]
        future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def plain_attention_saved_bytes(seq: int, batch: int, heads: int, head_dim: int, element_bytes: int,
                                causal: bool = False, tp: int = 1) -> int:
    """Bytes plain attention keeps for its backward, on one of tp ranks (heads split over them):
    q and k (for the gradient of Q K^T), v, and the softmax output (used by the softmax's backward
    and by P V's), a s^2 b e; causal adds the s x s boolean mask (one byte each, shared)."""
    s, b, a, e = seq, batch, heads // tp, element_bytes
    return 3 * s * b * a * head_dim * e + a * s * s * b * e + (s * s if causal else 0)


def korthikanti_attention_bytes(seq: int, batch: int, heads: int, element_bytes: int = 2,
                                dropout: bool = True, tp: int = 1) -> float:
    """The s^2 part of a layer's activations per Korthikanti et al. (5 a s^2 b / t with fp16 and
    dropout): the difference between no recomputation and selective recomputation in
    lab09_planner's `activation_bytes_per_layer`."""
    from labs.lab09_planner import activation_bytes_per_layer

    args = dict(tp=tp, element_bytes=element_bytes, dropout=dropout)
    hidden = heads  # the s b h part cancels in the difference; any width will do
    return (activation_bytes_per_layer(seq, batch, hidden, heads, recompute="none", **args)
            - activation_bytes_per_layer(seq, batch, hidden, heads, recompute="selective", **args))


def saved_bytes(attention: Callable, q, k, v, causal: bool) -> int:
    """Bytes autograd keeps for the backward of one `attention(q, k, v, causal)`: q, k and v
    counted (in a model they are activations, outputs of the qkv projection)."""
    with SavedTensorBytes() as saved:
        attention(q, k, v, causal)
    return saved.bytes


def peak_bytes(attention: Callable, q, k, v, causal: bool) -> dict[str, int]:
    """Memory above the level before the call: after the forward, and the peaks of forward and
    backward of `attention(q, k, v, causal).sum()` (q, k, v themselves not included)."""
    if q.device.type == "cuda":
        torch.cuda.synchronize(q.device)
        base = torch.cuda.memory_allocated(q.device)
        torch.cuda.reset_peak_memory_stats(q.device)
        out = attention(q, k, v, causal).sum()
        torch.cuda.synchronize(q.device)
        after, forward = torch.cuda.memory_allocated(q.device), torch.cuda.max_memory_allocated(q.device)
        torch.cuda.reset_peak_memory_stats(q.device)
        out.backward()
        torch.cuda.synchronize(q.device)
        backward = torch.cuda.max_memory_allocated(q.device)
        return {"after forward": after - base, "peak forward": forward - base, "peak backward": backward - base}
    return peak_memory(lambda: attention(q, k, v, causal).sum())


def _fused(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _leaves(batch, heads, seq, head_dim, device, seed=0):
    return [t.requires_grad_(True) for t in ring.sample_qkv(batch, heads, seq, head_dim, seed=seed,
                                                            dtype=torch.float32, device=device)]


def single_process_sweep(device: torch.device, seqs: list[int], batch: int, heads: int, head_dim: int,
                         causal: bool = True) -> list[dict]:
    """Plain and fused attention on one process for each sequence length: saved bytes (measured,
    formula) and peaks, also in units of one attention matrix, a s^2 b e."""
    rows = []
    for seq in seqs:
        q, k, v = _leaves(batch, heads, seq, head_dim, device)
        matrix = heads * seq * seq * batch * q.element_size()
        plain, fused = peak_bytes(plain_attention, q, k, v, causal), peak_bytes(_fused, q, k, v, causal)
        rows.append({"seq": seq, "attention matrix a s^2 b e": matrix,
                     "saved (measured)": saved_bytes(plain_attention, q, k, v, causal),
                     "saved (formula)": plain_attention_saved_bytes(seq, batch, heads, head_dim,
                                                                   q.element_size(), causal),
                     **{f"plain {name}": value for name, value in plain.items()},
                     **{f"fused {name}": value for name, value in fused.items()},
                     "fused saved": saved_bytes(_fused, q, k, v, causal)})
    return rows


def ring_sweep(device: torch.device, seqs: list[int], batch: int, heads: int, head_dim: int,
               causal: bool = True, group=None) -> list[dict]:
    """Per rank of ring attention (the homework) on N ranks, for each whole-sequence length: saved
    bytes and peaks, also in units of one block's attention matrix, a (s/N)^2 b e."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    rows = []
    for seq in seqs:
        q, k, v = (ring.sequence_shard(t.detach(), rank, n).requires_grad_(True)
                   for t in _leaves(batch, heads, seq, head_dim, device))

        def attention(q, k, v, causal):
            return ring.ring_attention(q, k, v, causal=causal, group=group)

        block = heads * (seq // n) ** 2 * batch * q.element_size()
        rows.append({"seq": seq, "ranks": n, "block matrix a (s/N)^2 b e": block,
                     "saved": saved_bytes(attention, q, k, v, causal),
                     **peak_bytes(attention, q, k, v, causal)})
    return rows


def default_sizes() -> dict:
    return dict(seqs=pick([256, 512, 1024, 2048], [32, 64]), batch=1, heads=4, head_dim=pick(32, 8))


def run(ctx: DistContext, **sizes) -> dict:
    """Rank 0: plain and fused attention on one process as the sequence grows. Every rank: its
    share of ring attention on the same sequences (or the notice that it is not written yet)."""
    s = {**default_sizes(), **sizes}
    args = (s["seqs"], s["batch"], s["heads"], s["head_dim"])
    out = {"sizes": s, "world_size": ctx.world_size}
    if ctx.rank == 0:
        out["single"] = single_process_sweep(ctx.device, *args)
    ctx.barrier()
    out["ring"] = attempt(ring_sweep, ctx.device, *args)
    return out


# ============================================================================ what the notebook shows
def activation_table(model, tp: int, hbm_gb: float, seqs=(4096, 32768, 131072, 524288)) -> Shown:
    """Korthikanti et al.'s activations per GPU (notebook 09's `activation_bytes_per_layer`) for
    `model` with tensor + sequence parallelism over tp, one sequence, bf16: the s^2 term and the
    linear one per layer, the whole model stored and with FlashAttention (selective), and from
    which length they exceed `hbm_gb`."""
    from labs.lab09_planner import activation_bytes_per_layer

    def kept(seq, recompute):
        return activation_bytes_per_layer(seq, 1, model.hidden, model.heads, tp=tp, sequence_parallel=True,
                                          recompute=recompute)
    rows = []
    for seq in seqs:
        full, flash = kept(seq, "none"), kept(seq, "selective")
        rows.append({"s": seq, "s^2 term GB/layer": (full - flash) / 1e9, "linear term GB/layer": flash / 1e9,
                     f"{model.layers} layers, stored GB": model.layers * full / 1e9,
                     f"{model.layers} layers, FlashAttention GB": model.layers * flash / 1e9})
    stored = [r["s"] for r in rows if r[f"{model.layers} layers, stored GB"] > hbm_gb]
    flash = [r["s"] for r in rows if r[f"{model.layers} layers, FlashAttention GB"] > hbm_gb]
    return Shown(f"{model.name}: activations per GPU, t={tp} + sequence parallelism, 1 sequence, bf16", rows, [
        (f"storing the attention matrices, the activations exceed {hbm_gb:g} GB from s = {stored[0]} on (of the rows above)"
         if stored else f"storing the attention matrices, they stay under {hbm_gb:g} GB in every row above"),
        (f"with FlashAttention they exceed {hbm_gb:g} GB from s = {flash[0]} on, before any weight or optimizer state"
         if flash else f"with FlashAttention they stay under {hbm_gb:g} GB in every row above")])


def single_summary(report: dict) -> Shown:
    """Rank 0's report: one process's plain and fused attention, measured against the formula."""
    s = report["sizes"]
    rows = [{"s": r["seq"], "saved MiB (measured)": r["saved (measured)"] / MiB,
             "saved MiB (formula)": r["saved (formula)"] / MiB,
             "plain peak fwd / a s^2 b e": r["plain peak forward"] / r["attention matrix a s^2 b e"],
             "plain peak bwd / a s^2 b e": r["plain peak backward"] / r["attention matrix a s^2 b e"],
             "fused saved MiB": r["fused saved"] / MiB, "fused peak bwd MiB": r["fused peak backward"] / MiB,
             "Korthikanti 5as^2b MiB (fp16, dropout)": korthikanti_attention_bytes(r["seq"], s["batch"], s["heads"]) / MiB}
            for r in report["single"]]
    exact = all(r["saved (measured)"] == r["saved (formula)"] for r in report["single"])
    return Shown(f"one causal attention layer, one process, fp32: {s['heads']} heads of {s['head_dim']}, "
                 f"batch {s['batch']}", rows,
                 ["saved bytes " + ("equal the formula in every row" if exact else "DIFFER from the formula (see the table)")])


def growth_exponent(rows: list[dict], key: str) -> float:
    """p in y ~ s^p between the shortest and the longest sequence of `rows`."""
    first, last = rows[0], rows[-1]
    return math.log(last[key] / first[key]) / math.log(last["seq"] / first["seq"])


@dataclass(frozen=True)
class GrowthResult(Shown):
    seqs: list[int]
    curves: dict[str, list[float]]       # label -> MiB per sequence length
    exponents: dict[str, float]


def growth_verdict(plain: float, fused: float) -> str:
    return ("quadratic against linear, as the formula says" if plain > 1.5 and fused < 1.2 else
            "not on this run: the exponents are not clearly quadratic (plain) against linear (fused)")


def growth_summary(report: dict) -> GrowthResult:
    """How saved bytes and peaks grew with s (exponents between the shortest and longest)."""
    rows = report["single"]
    keys = {"plain: saved for backward": "saved (measured)", "plain: peak": "plain peak backward",
            "fused SDPA: saved for backward": "fused saved", "fused SDPA: peak": "fused peak backward"}
    exponents = {label: growth_exponent(rows, key) for label, key in keys.items()}
    plain, fused = exponents["plain: saved for backward"], exponents["fused SDPA: saved for backward"]
    return GrowthResult("One attention layer's memory as the sequence grows (measured)", [], [
        f"from s = {rows[0]['seq']} to {rows[-1]['seq']}: plain attention's saved bytes grew as s^{plain:.2f} and its "
        f"peak as s^{exponents['plain: peak']:.2f}; the fused kernel's saved bytes as s^{fused:.2f}",
        growth_verdict(plain, fused)], [r["seq"] for r in rows],
        {label: [r[key] / MiB for r in rows] for label, key in keys.items()}, exponents)


def ring_summary(report: dict) -> Shown:
    """Every rank's ring rows of rank 0's report beside one process (the ring part needs the
    homework: raises Unsolved while it is a stub)."""
    from helpers.notice import solved

    ring_rows = solved(report["ring"])
    single = {r["seq"]: r for r in report["single"]}
    s = report["sizes"]
    b, a, d, e = s["batch"], s["heads"], s["head_dim"], 4
    rows = [{"s": r["seq"], "ranks": r["ranks"], "saved KiB (rank 0)": r["saved"] / 2**10,
             "formula e b a (s/N)(4d+1) KiB": e * b * a * (r["seq"] // r["ranks"]) * (4 * d + 1) / 2**10,
             "peak bwd MiB (rank 0)": r["peak backward"] / MiB,
             "peak / a (s/N)^2 b e": r["peak backward"] / r["block matrix a (s/N)^2 b e"],
             "one process, plain: peak MiB": single[r["seq"]]["plain peak backward"] / MiB,
             "one process, fused: peak MiB": single[r["seq"]]["fused peak backward"] / MiB} for r in ring_rows]
    exact = all(math.isclose(r["saved KiB (rank 0)"], r["formula e b a (s/N)(4d+1) KiB"]) for r in rows)
    last = rows[-1]
    shrink = last["one process, plain: peak MiB"] / last["peak bwd MiB (rank 0)"]
    return Shown(f"ring attention on {report['world_size']} ranks vs one process (causal, fp32)", rows, [
        "saved bytes per rank " + ("equal the formula in every row: nothing s x s is kept" if exact else
                                   "DIFFER from the formula: something else is kept (see the table)"),
        f"at s = {last['s']}: rank 0's peak is {shrink:.1f}x "
        + ("below" if shrink > 1 else "NOT below") + f" plain attention's on one process (blocks of (s/N)^2 "
        f"instead of s^2: N^2 = {report['world_size'] ** 2})"])


def main() -> None:
    with distributed() as ctx:
        result = run(ctx)
        ctx.report(**result)
        if ctx.rank != 0:
            return
        s = result["sizes"]
        table([{"seq": r["seq"], "saved MiB": r["saved (measured)"] / MiB,
                "formula MiB": r["saved (formula)"] / MiB,
                "peak fwd / a s^2 b e": r["plain peak forward"] / r["attention matrix a s^2 b e"],
                "peak bwd / a s^2 b e": r["plain peak backward"] / r["attention matrix a s^2 b e"],
                "fused peak bwd MiB": r["fused peak backward"] / MiB,
                "Korthikanti fp16+dropout MiB": korthikanti_attention_bytes(r["seq"], s["batch"], s["heads"]) / MiB}
               for r in result["single"]],
              title=f"one causal attention layer on one process, fp32, {s['heads']} heads of "
                    f"{s['head_dim']}, batch {s['batch']}: plain (s x s scores) vs fused SDPA")
        if "unsolved" not in result["ring"]:
            table([{"seq": r["seq"], "ranks": r["ranks"], "saved MiB": r["saved"] / MiB,
                    "peak bwd MiB": r["peak backward"] / MiB,
                    "peak bwd / a (s/N)^2 b e": r["peak backward"] / r["block matrix a (s/N)^2 b e"]}
                   for r in result["ring"]], title="ring attention, rank 0")


if __name__ == "__main__":
    main()
