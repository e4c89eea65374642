"""Lab 11 (ring check): the homework's `ring_attention` against one process's SDPA, traced.

Run:  ./run.sh 11      (this file alone: ./run.sh labs/lab11_ring_check.py; 2-4 ranks)

- float64, with and without the causal mask: output and gradients against
  F.scaled_dot_product_attention on the whole sequence (rounding only: about 1e-15), with each
  rank's trace (labs/lab11_ring_trace.py): the blocks it computed, its messages and waits;
- bfloat16, as torch tests its own ring (q, k, v uniform in [0, 1), the backward of out.sum(),
  absolute tolerances 1e-3 N for the output and 8e-3 N for the gradients, N ranks): the
  homework's ring and lab11_zigzag's against SDPA in float64 on the same values, beside SDPA's
  own bfloat16 error. The block kernel keeps scores, log-sum-exps and the merge in float32.
- `merge_demo`: one process, the naive merge against the log-sum-exp merge when scores overflow.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import labs.lab11_ring_attention as ring
from helpers import pick
from helpers.dist import DistContext, distributed
from helpers.notice import attempt
from labs.lab11_results import Shown
from labs.lab11_ring_trace import SendWaits, forward_events, send_waits, trace_ring
from labs.lab11_zigzag import zigzag_ring_attention

QUANTITIES = ("output", "dq", "dk", "dv")
ROUNDING = 1e-9          # float64: a correct ring differs by about 1e-15


def ring_check(device: torch.device, sizes: dict, group=None) -> dict:
    """ring_attention against SDPA (float64), non-causal and causal, with this rank's trace."""
    n = dist.get_world_size(group)
    q, k, v = ring.sample_qkv(sizes["batch"], sizes["heads"], sizes["seq_local"] * n, sizes["head_dim"],
                              device=device)
    out = {}
    for causal in (False, True):
        with trace_ring() as trace:
            diff = ring.compare_with_sdpa(lambda *t: ring.ring_attention(*t, causal=causal, group=group),
                                          q, k, v, causal, group)
        out["causal" if causal else "full"] = {"max_abs_diff": diff, "blocks": trace.blocks,
                                               "work": trace.work, "timeline": trace.rows()}
    return out


def bf16_check(device: torch.device, sizes: dict, attention, layout: str = "contiguous", group=None) -> dict:
    """`attention(q, k, v, causal=..., group=...)` on bfloat16 shards in `layout` against float64
    SDPA (torch's test's inputs and loss), causal and not: per quantity, this rank's largest error
    and the reference's magnitude, beside SDPA's own error in bfloat16 on one process."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v = ring.sample_qkv(sizes["batch"], sizes["heads"], sizes["seq_local"] * n, sizes["head_dim"],
                              dtype=torch.bfloat16, device=device, uniform=True)
    out = {}
    for causal in (False, True):
        mine = ring.compare_with_sdpa(lambda *t: attention(*t, causal=causal, group=group), q, k, v, causal,
                                      group, layout, dout=torch.ones_like(q))
        out["causal" if causal else "full"] = {"error": {name: mine[name] for name in QUANTITIES},
                                               "scale": mine["scale"],
                                               "sdpa_error": _sdpa_bf16_error(q, k, v, causal, rank, n, layout)}
    return out


def _sdpa_bf16_error(q, k, v, causal: bool, rank: int, n: int, layout: str) -> dict:
    """SDPA in bfloat16 on the whole sequence (one process) against SDPA in float64, this rank's rows."""
    got, want = {}, {}
    for found, dtype in ((got, None), (want, torch.float64)):
        ts = [t.detach().to(dtype or t.dtype).requires_grad_(True) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*ts, is_causal=causal)
        out.sum().backward()
        found.update(output=out.detach(), dq=ts[0].grad, dk=ts[1].grad, dv=ts[2].grad)
    return {name: (ring.sequence_shard(got[name], rank, n, layout).double()
                   - ring.sequence_shard(want[name], rank, n, layout).double()).abs().max().item()
            for name in QUANTITIES}


def default_sizes() -> dict:
    return dict(batch=2, heads=4, seq_local=pick(256, 16), head_dim=pick(32, 8))


def bf16_sizes() -> dict:
    """torch's test's sizes: 8 sequences, 8 heads of 32, 64 positions per rank."""
    return dict(batch=pick(8, 2), heads=8, seq_local=64, head_dim=32)


def run(ctx: DistContext, **sizes) -> dict:
    """ring_attention against one process's SDPA on every rank (or the notice that it is not
    written yet), with the blocks each rank computed and its timeline; then both rings in bf16."""
    s = {**default_sizes(), **sizes}
    b = bf16_sizes()
    return {"sizes": s, "world_size": ctx.world_size, "check": attempt(ring_check, ctx.device, s),
            "bf16_sizes": b,
            "bf16": {"ring_attention": attempt(bf16_check, ctx.device, b, ring.ring_attention),
                     "zigzag_ring_attention": bf16_check(ctx.device, b, zigzag_ring_attention, "zigzag")}}


# ============================================================================ what the notebook shows
def rounding_verdict(worst: float, tolerance: float = ROUNDING) -> str:
    return "rounding (float64)" if math.isfinite(worst) and worst < tolerance else "MORE than rounding"


def causal_blocks_verdict(blocks_per_rank: list[int]) -> str:
    """Rank r of a causal contiguous ring computes r + 1 blocks (the later ranks' are all in the future)."""
    expected = [r + 1 for r in range(len(blocks_per_rank))]
    return ("every later block was skipped" if blocks_per_rank == expected
            else f"NOT what it computed: {blocks_per_rank}, where each rank r has r + 1 = {expected}")


def check_summary(reports: list[dict]) -> Shown:
    """The float64 check on every rank: differences, blocks computed, and the verdicts."""
    checks = [ring_solved(rep) for rep in reports]
    rows = [{"rank": r, "mask": mask, **{q: c["max_abs_diff"][q] for q in QUANTITIES},
             "blocks computed": len(c["blocks"]), "first block (q start, k start)": (c["blocks"][0][0], c["blocks"][0][2])}
            for r, check in enumerate(checks) for mask, c in check.items()]
    worst = max(c["max_abs_diff"]["worst"] for check in checks for c in check.values())
    causal = [len(check["causal"]["blocks"]) for check in checks]
    sizes = reports[0]["sizes"]
    return Shown(f"ring_attention vs SDPA on one process (float64), {len(reports)} ranks, {sizes}", rows,
                 [f"largest difference {worst:.1e}: {rounding_verdict(worst)}",
                  f"causal: blocks computed per rank {causal}; rank r has r + 1 blocks at or before its queries: "
                  + causal_blocks_verdict(causal)])


def ring_solved(report: dict) -> dict:
    from helpers.notice import solved

    return solved(report["check"])


def within_tolerance(error: float, scale: float, atol: float, rtol: float = 1e-5) -> bool:
    """torch.allclose's test on the largest error: |error| <= atol + rtol |reference|."""
    return math.isfinite(error) and error <= atol + rtol * scale


def bf16_summary(reports: list[dict], implementation: str) -> Shown:
    """One implementation's bf16 errors (largest over the ranks) against torch's tolerances and
    beside SDPA's own bfloat16 error; raises Unsolved for the homework while it is a stub."""
    from helpers.notice import solved

    n = len(reports)
    per_rank = [solved(rep["bf16"][implementation]) for rep in reports]
    rows, passed = [], 0
    for mask in per_rank[0]:
        for quantity in QUANTITIES:
            error = max(r[mask]["error"][quantity] for r in per_rank)
            scale = max(r[mask]["scale"][quantity] for r in per_rank)
            sdpa = max(r[mask]["sdpa_error"][quantity] for r in per_rank)
            atol = ring.bf16_tolerance(quantity, n)
            ok = within_tolerance(error, scale, atol)
            passed += ok
            rows.append({"mask": mask, "quantity": quantity, "max |error|": error, "torch's atol": atol,
                         "SDPA bf16 |error|": sdpa, "error / SDPA's": error / sdpa if sdpa else math.inf,
                         "max |reference|": scale, "within": ok})
    b = reports[0]["bf16_sizes"]
    return Shown(f"{implementation} in bfloat16 vs SDPA in float64, {n} ranks, {b}", rows,
                 [f"{implementation}: {passed} of {len(rows)} within torch's own context-parallel tolerances "
                  f"(atol {ring.BF16_ATOL_PER_RANK['output']:g} N for the output, "
                  f"{ring.BF16_ATOL_PER_RANK['grads']:g} N for the gradients)"])


@dataclass(frozen=True)
class TimelineResult(Shown):
    timelines: dict[str, list[list[dict]]]    # mask -> per rank, the forward's events
    sends: list[SendWaits]                     # no mask: each rank's waits on its sends


def timeline_summary(reports: list[dict]) -> TimelineResult:
    """Each rank's forward events for both masks, and, without the mask, whether the first messages
    were posted before the first block and why the waits on sends lasted (`send_waits`)."""
    checks = [ring_solved(rep) for rep in reports]
    n = len(checks)
    timelines = {("no mask" if mask == "full" else mask): [forward_events(c[mask]["timeline"]) for c in checks]
                 for mask in ("full", "causal")}
    rows = timelines["no mask"]
    sends = [send_waits(r, rows[r], rows[(r + 1) % n]) for r in range(n)]
    lines = []
    for r, w in enumerate(sends):
        events = rows[r]
        computing = sum(e["lasted ms"] for e in events if e["event"].startswith("block"))
        waiting = sum(e["lasted ms"] for e in events if e["event"].startswith("wait recv"))
        lines.append(f"rank {r}: the first send and receive were posted "
                     + ("before the first block, so the transfer could run during its compute" if w.posted_before_block
                        else "AFTER the first block: nothing overlapped")
                     + f"; {computing:.1f} ms computing, {waiting:.1f} ms waiting for blocks, {w.waited_ms:.1f} ms "
                       f"for its sends ({w.before_peer_ms:.1f} ms before rank {(r + 1) % n} posted its receive): {w.verdict}")
    return TimelineResult("the forward pass, per rank", [], lines, timelines, sends)


def merge_demo(keys: int = 64, blocks: int = 4, logit_scale: float = 50.0) -> Shown:
    """One process, float32: `keys` keys in `blocks` blocks with scores in the hundreds; the naive
    merge (weights e^lse) against the log-sum-exp merge, both against SDPA in float64."""
    q, k, v = ring.sample_qkv(1, 2, keys, 16, dtype=torch.float32, logit_scale=logit_scale)
    size = keys // blocks
    parts = [ring.attention_block(q, k[..., j:j + size, :], v[..., j:j + size, :], 0, j, causal=False)
             for j in range(0, keys, size)]
    merged, _ = ring.combine_partials([o for o, _ in parts], [lse for _, lse in parts])
    weights = [torch.exp(lse) for _, lse in parts]                        # e^{l_i}: overflows float32
    naive = sum(w.unsqueeze(-1) * o for w, (o, _) in zip(weights, parts)) / sum(weights).unsqueeze(-1)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    largest = (q @ k.transpose(-1, -2) * 16 ** -0.5).max().item()
    f32 = torch.finfo(torch.float32)
    finite = torch.isfinite(naive).float().mean().item()
    error = (merged.double() - exact).abs().max().item()
    return Shown("", [], [
        f"largest score {largest:.0f}: e^{largest:.0f} = 10^{largest / math.log(10):.0f}, "
        + ("beyond" if largest > math.log(f32.max) else "within") + f" float32's largest value {f32.max:.2g}",
        f"naive merge: {finite:.0%} of the outputs finite",
        f"log-sum-exp merge: largest difference from SDPA in float64 {error:.1e} "
        f"(float32's resolution at a score of {largest:.0f}: {f32.eps * largest:.1e})"])


def main() -> None:
    with distributed() as ctx:
        result = run(ctx)
        ctx.report(**result)
        reports = [None] * ctx.world_size
        dist.all_gather_object(reports, result)
        if ctx.rank == 0:
            for implementation in result["bf16"]:
                if "unsolved" not in result["bf16"][implementation]:
                    bf16_summary(reports, implementation).show()
            if "unsolved" not in result["check"]:
                check_summary(reports).show(floatfmt=".1e")
        if "unsolved" not in result["check"]:
            worst = max(c["max_abs_diff"]["worst"] for c in result["check"].values())
            if not worst < ROUNDING:
                raise RuntimeError(f"rank {ctx.rank}: ring_attention differs from SDPA by {worst:.2e}")


if __name__ == "__main__":
    main()
