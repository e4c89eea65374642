"""Lab 13 (dropless MoE on grouped GEMMs): the experts' matmuls three ways, timed, their memory
measured and their dropped tokens counted side by side in one process.

Run:  ./run.sh labs/lab13_grouped_gemm.py      (one process; the notebook calls `compare`)

- grouped (dropless): the (token, choice) rows sorted by expert, one `torch._grouped_mm` per
  projection over all experts (offsets = the running sum of rows per expert): MegaBlocks'
  formulation (Gale et al. 2022, "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts",
  arXiv:2211.15841), which torchtitan's GroupedExperts uses;
- loop (dropless): the same sorted rows, one matmul pair per expert, in a Python loop;
- padded capacity: every expert gets a buffer of C = ceil(factor T k / E) rows (GShard's and
  Switch's capacity, Lepikhin et al. 2020, arXiv:2006.16668); rows beyond C are dropped, empty
  slots are zeros and computed anyway; one batched matmul (bmm) over the (E, C, dim) buffer.

`support` asks `torch._grouped_mm` itself which dtypes and row widths it takes on this machine
(on this CPU build: float32, bfloat16 and float16, every stride a multiple of 16 bytes).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from helpers import runs

IMPLS = ("grouped", "loop", "padded")


@dataclass(frozen=True)
class Run(runs.Run):
    """The comparison's routed (token, choice) rows and its timed rounds, in one process."""
    tokens: int = 4096
    rounds: int = 7
    ranks: int | None = 1
    SMOKE = dict(tokens=256, rounds=3)
    TOUR = dict(tokens=128, rounds=2)        # ./run.sh: a glimpse (every lab in minutes)


# ============================================================================ what it takes
def support(dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
            widths=(64, 12, 10)) -> list[dict]:
    """For each dtype and row width (dim = ffn = width), whether `_grouped_mm` runs a forward and
    a backward here, or its error."""
    rows = []
    for dtype in dtypes:
        for width in widths:
            x = torch.randn(24, width).to(dtype).requires_grad_()
            w = torch.randn(3, width, width).to(dtype).requires_grad_()
            offsets = torch.tensor([8, 16, 24], dtype=torch.int32)
            try:
                y = torch._grouped_mm(x, w, offs=offsets)
                y.backward(torch.ones_like(y))
                result = "runs"
            except (RuntimeError, TypeError) as err:
                result = str(err).strip().splitlines()[0][:90]
            rows.append({"dtype": str(dtype).replace("torch.", ""), "row width": width,
                         "row bytes": width * torch.finfo(dtype).bits // 8, "grouped_mm": result})
    return rows


def inside_grouped_mm(groups: int = 4) -> dict[str, int]:
    """The matmul operators one `_grouped_mm` call over `groups` groups runs here, from the
    profiler ({"aten::mm": groups} on this CPU build: a loop inside the operator)."""
    from torch.profiler import profile

    from helpers.memory import quiet_stderr  # the profiler's C++ side prints to fd 2 on start and stop

    x, w = torch.randn(8 * groups, 16), torch.randn(groups, 16, 16)
    offsets = torch.arange(8, 8 * groups + 1, 8, dtype=torch.int32)
    with quiet_stderr():
        with profile() as prof:
            torch._grouped_mm(x, w, offs=offsets)
    return {e.key: e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::bmm", "aten::addmm", "aten::matmul")}


# ============================================================================ three ways
def routed(tokens: int, dim: int, experts: int, top_k: int, skew: float, seed: int = 0):
    """Tokens (T, dim) and their top-k experts from a random router leaning towards expert 0 by
    `skew` (0: about even): (x, experts (T, k), gates (T, k))."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=g)
    logits = x @ torch.randn(dim, experts, generator=g) / math.sqrt(dim)
    logits[:, 0] += skew
    scores = torch.sigmoid(logits)
    top, chosen = scores.topk(top_k, dim=-1)
    return x, chosen, top / top.sum(-1, keepdim=True)


def expert_weights(experts: int, dim: int, ffn: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, ffn, dim, generator=g) / math.sqrt(dim),
            torch.randn(experts, dim, ffn, generator=g) / math.sqrt(ffn))


def moe_forward(impl: str, x, chosen, gates, w1, w2, capacity_factor: float = 1.0):
    """The routed experts' output (T, dim) with `impl`; returns (out, dropped assignments)."""
    tokens, k = chosen.shape
    num = w1.shape[0]
    order = chosen.reshape(-1).argsort(stable=True)
    token = order // k
    counts = torch.bincount(chosen.reshape(-1), minlength=num)
    rows = x[token]
    if impl == "padded":
        capacity = math.ceil(capacity_factor * tokens * k / num)
        start = torch.cumsum(counts, 0) - counts                          # first row of each expert
        expert = chosen.reshape(-1)[order]
        slot = torch.arange(len(order)) - start[expert]                   # place in its expert's queue
        kept = slot < capacity
        buffer = rows.new_zeros(num, capacity, x.shape[1])
        buffer = buffer.index_put((expert[kept], slot[kept]), rows[kept])
        hidden = F.gelu(torch.bmm(buffer, w1.transpose(1, 2)))
        out_buffer = torch.bmm(hidden, w2.transpose(1, 2))
        out_rows = rows.new_zeros(rows.shape).index_put((kept.nonzero().squeeze(1),),
                                                        out_buffer[expert[kept], slot[kept]])
        dropped = int((~kept).sum())
    elif impl == "grouped":
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        hidden = F.gelu(torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offsets))
        out_rows, dropped = torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offsets), 0
    elif impl == "loop":
        outs = [F.gelu(p @ w1[e].t()) @ w2[e].t() for e, p in enumerate(rows.split(counts.tolist()))]
        out_rows, dropped = torch.cat(outs), 0
    else:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    weighted = out_rows * gates.reshape(-1)[order].unsqueeze(1)
    return x.new_zeros(x.shape).index_add(0, token, weighted), dropped


# ============================================================================ measured
@dataclass
class GemmResult:
    impl: str
    dtype: str
    ms: float              # median forward + backward over the rounds
    ratios: list           # per round: this impl's time / the float32 grouped GEMM's (paired)
    peak_bytes: int        # highest bytes allocated above the start, forward + backward
    dropped: int           # assignments not computed (capacity)
    max_diff: float        # |out - the loop's| on the tokens nothing dropped


def peak_bytes(fn) -> int:
    """Bytes allocated at the highest point while fn() runs, above the level before (the course's
    CPU allocation trace, helpers.memory.peak_allocated)."""
    from helpers.memory import peak_allocated

    return peak_allocated(fn, torch.device("cpu"))


def compare(tokens: int, dim: int = 64, ffn: int = 64, experts: int = 8, top_k: int = 2,
            skew: float = 1.0, capacity_factor: float = 1.25, rounds: int = 3,
            dtypes=(torch.float32, torch.bfloat16)) -> list[GemmResult]:
    """Each impl (and grouped in the other dtypes `_grouped_mm` takes) on the same routed tokens:
    forward + backward timed in rounds after a warm-up one, every impl once per round back to back
    (their time ratios paired by round), memory at its peak, dropped tokens, and the difference
    from the loop on the tokens every impl kept."""
    from helpers.bench import intra_op_threads

    with intra_op_threads(1):      # one thread, as the ranks run (torchrun's OMP_NUM_THREADS=1)
        return _compare(tokens, dim, ffn, experts, top_k, skew, capacity_factor, rounds, dtypes)


def _compare(tokens, dim, ffn, experts, top_k, skew, capacity_factor, rounds, dtypes) -> list[GemmResult]:
    x, chosen, gates = routed(tokens, dim, experts, top_k, skew)
    w1, w2 = expert_weights(experts, dim, ffn)
    cases = [(impl, torch.float32) for impl in IMPLS] + [("grouped", d) for d in dtypes if d != torch.float32]
    reference, _ = moe_forward("loop", x, chosen, gates, w1, w2)

    def step(impl, dtype):
        a, b, c = (t.to(dtype).requires_grad_() for t in (x, w1, w2))
        out, dropped = moe_forward(impl, a, chosen, gates.to(dtype), b, c, capacity_factor)
        out.float().sum().backward()
        return out.detach().float(), dropped

    times = {case: [] for case in cases}
    for round_ in range(rounds + 1):            # round 0 warms up
        for case in cases:
            start = time.perf_counter()
            step(*case)
            if round_:
                times[case].append(time.perf_counter() - start)
    base = times[("grouped", torch.float32)]
    results = []
    for impl, dtype in cases:
        out, dropped = step(impl, dtype)
        kept = _untouched(chosen, experts, top_k, tokens, capacity_factor) if impl == "padded" \
            else torch.ones(tokens, dtype=torch.bool)       # a dropped choice changes its token
        diff = (out - reference)[kept].abs().max().item() if kept.any() else 0.0
        results.append(GemmResult(impl, str(dtype).replace("torch.", ""), 1e3 * statistics.median(times[(impl, dtype)]),
                                  [t / b for t, b in zip(times[(impl, dtype)], base)],
                                  peak_bytes(lambda: step(impl, dtype)), dropped, diff))
    return results


def _untouched(chosen, experts: int, top_k: int, tokens: int, capacity_factor: float) -> torch.Tensor:
    """(T,) True for the tokens none of whose choices the padded layer dropped."""
    order = chosen.reshape(-1).argsort(stable=True)
    counts = torch.bincount(chosen.reshape(-1), minlength=experts)
    capacity = math.ceil(capacity_factor * tokens * top_k / experts)
    start = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(order)
    slot[order] = torch.arange(len(order)) - start[chosen.reshape(-1)[order]]
    return (slot.view(tokens, top_k) < capacity).all(1)


def faster(ratios: list[float]) -> str:
    """"grouped" if the other impl was slower in every round (all paired ratios above 1), "other"
    if faster in every round, else "noise": the rounds disagree."""
    if ratios and min(ratios) > 1:
        return "grouped"
    if ratios and max(ratios) < 1:
        return "other"
    return "noise"


def verdict(results: list[GemmResult]) -> dict:
    """From `compare`'s float32 rows: the loop's and padded capacity's time (median of the paired
    ratios) and peak memory against the grouped GEMM's, which was faster (`faster`), and the
    assignments each dropped."""
    by = {r.impl: r for r in results if r.dtype == "float32"}
    g = by["grouped"]
    out = {"dropped": {k: r.dropped for k, r in by.items()}}
    for other in ("loop", "padded"):
        r = by[other]
        out[other] = {"time_ratio": statistics.median(r.ratios), "memory_ratio": r.peak_bytes / max(g.peak_bytes, 1),
                      "faster": faster(r.ratios), "rounds": len(r.ratios)}
    return out


def sentence(v: dict) -> str:
    """`verdict` in words."""
    parts = []
    for other in ("loop", "padded"):
        o = v[other]
        time_part = f"{o['time_ratio']:.2f}x the grouped GEMM's time (median of {o['rounds']} paired rounds)"
        if o["faster"] == "noise":
            parts.append(f"the {other}: {time_part}, but the rounds disagree: no difference beyond noise")
        elif o["faster"] == "grouped":
            parts.append(f"the {other} was slower in every round: {time_part}")
        else:
            parts.append(f"the {other} was faster in every round: {time_part}")
        parts[-1] += f", {o['memory_ratio']:.2f}x its peak memory"
    dropped = v["dropped"]["padded"]
    parts.append(f"padded capacity dropped {dropped} assignment(s), the dropless ones none" if dropped
                 else "padded capacity dropped nothing at this capacity factor")
    return "; ".join(parts)


def run(ctx, cfg: Run) -> dict:
    """What `_grouped_mm` takes here and the comparison, on rank 0 (the other ranks return {})."""
    if ctx.rank != 0:
        return {}
    results = compare(cfg.tokens, rounds=cfg.rounds)
    return {"support": support(), "inside": inside_grouped_mm(), "results": [asdict(r) for r in results],
            "verdict": verdict(results)}


def main(argv: list[str] | None = None) -> None:
    from helpers.dist import distributed
    from helpers.show import table

    cfg = Run.from_argv(argv)
    with distributed() as ctx:
        out = run(ctx, cfg)
        if not out:
            return
        ctx.report(**{k: v for k, v in out.items() if k != "results"})
        table(out["support"], title="torch._grouped_mm on this machine (forward and backward)")
        print(f"one _grouped_mm over 4 groups runs, inside: {out['inside']}", flush=True)
        table(out["results"], title="the routed experts three ways, forward + backward")
        print(sentence(out["verdict"]), flush=True)


if __name__ == "__main__":
    main()
