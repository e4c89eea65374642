"""Lab 08 (readings): what notebook 08 concludes from lab08_zero's runs (a library; lab08_zero
re-exports these names). Each verdict is tested both ways in tests/test_lab08_zero.py."""
from __future__ import annotations

PARTS = ("parameters", "gradients", "optimizer state")  # the model states


def memory_rows(stages: list[dict]) -> list[dict]:
    """One row per stage: MiB held per rank at the optimizer step, next to the formula."""
    rows = []
    for s in stages:
        held, formula = s["held"], s["formula"]
        rows.append({"stage": s["name"], "ranks": s["world_size"],
                     **{f"{k} MiB": held[k] / 2**20 for k in PARTS},
                     "total MiB": held["total"] / 2**20, "formula MiB": formula["total"] / 2**20,
                     "held / formula": held["total"] / formula["total"],
                     "sent MiB/step": s["collectives"]["sent_bytes"] / 2**20,
                     "sent / formula": s["collectives"]["sent_bytes"] / s["sent_formula"],
                     "max diff vs 1 process": s["max_diff_vs_one_process"]})
    return rows


def one_unit_verdict(what: str, peak: int, unit_bytes: list[int]) -> str:
    """A peak of full (gathered or unsharded) tensors against the model's units: at most the
    largest unit's bytes means one unit at a time (bytes counted: exact, no noise)."""
    total, largest = sum(unit_bytes), max(unit_bytes)
    return (f"{what}: {peak / 1024:.1f} KiB, {peak / total:.0%} of the model's {total / 1024:.1f} KiB: "
            + ("the largest unit's, one unit at a time" if peak <= largest else
               f"more than the largest unit's {largest / 1024:.1f} KiB: not one unit at a time on this run"))


def parity_verdict(worst_diff: float, tol: float = 1e-6) -> str:
    """Every stage against one process: float32 sums in another order explain up to `tol`."""
    return (f"every stage vs one process: max |parameter difference| {worst_diff:.1e}"
            + (f" (within {tol:g}: float32 sums in another order)" if worst_diff <= tol else
               " (more than float32 sums in another order explain: look at the stage that differs)"))


def shards_verdict(held: list[int], unsharded: int) -> str:
    """Optimizer-state bytes per rank against one unsharded optimizer: together once (5%: padding
    and per-shard scalars such as Adam's step)."""
    together = sum(held) / unsharded
    return (f"your optimizer's bytes per rank: {held}; together {together:.2f}x one unsharded Adam: "
            + ("each element's state held once" if abs(together - 1) <= 0.05 else
               "not each element's state exactly once on this run"))


def less_sent_verdict(scattered: float, reduced: float) -> str:
    """The gradients' reduce-scatter against the all-reduce, in bytes each rank sent."""
    return (f"gradients: the reduce-scatter sent {scattered / 1024:.1f} KiB per rank, the all-reduce "
            f"{reduced / 1024:.1f} KiB ({scattered / reduced:.2f}x)" + ("" if scattered < reduced else ": not less on this run"))


def peak_verdict(hook_peak: int, after_backward: int) -> str:
    """Section 3's per-unit hooks against reduce_gradients after backward: full gradients alive at once."""
    return (f"full gradients alive at once during backward: {after_backward / 1024:.1f} KiB with "
            f"reduce_gradients, {hook_peak / 1024:.1f} KiB with section 3's hooks ({hook_peak / after_backward:.2f}x): "
            + ("reduce_gradients lowers what a rank keeps between steps, not the peak" if hook_peak < after_backward
               else "the hooks did not lower the peak on this run"))

