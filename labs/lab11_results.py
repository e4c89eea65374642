"""Lab 11 (results), a library of lab 11 (no main): the typed result a notebook cell shows. Each
lab function that analyses a run returns one of these (or a subclass with more typed fields): a
table (title, rows) and the sentences computed from the run, so a cell calls, shows and plots, and
tests read fields, not dictionary keys.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Shown:
    """A table and the conclusions a cell prints under it."""
    title: str
    rows: list[dict]
    lines: list[str]

    def show(self, floatfmt: str = ".3g") -> None:
        from helpers.show import table

        if self.rows:
            table(self.rows, title=self.title, floatfmt=floatfmt)
        elif self.title:
            print(self.title)
        self.say()

    def say(self) -> None:
        """The conclusions only."""
        for line in self.lines:
            print(line, flush=True)


def median_and_noise(values: list[float]) -> tuple[float, float]:
    """The median of repeated measurements and its noise: the standard error of a median,
    1.2533 sigma / sqrt(n), with sigma = 1.4826 x the median absolute deviation (the standard
    deviation for normal noise, robust to the odd outlier a busy machine makes). Two medians
    closer than about twice their noise cannot be told apart by this run."""
    middle = statistics.median(values)
    sigma = 1.4826 * statistics.median(abs(v - middle) for v in values)
    return middle, 1.2533 * sigma / len(values) ** 0.5


def spread_verdict(values: list[float], noise: float, what: str) -> str:
    """Whether values measured per rank differ by more than the run's noise (`noise`: the same
    measurement repeated, in the same unit): "differ" or "within noise"."""
    if not values:
        return f"no {what} measured"
    gap = max(values) - min(values)
    if gap > 2 * noise:
        return f"the {what} differ by {gap:.3g}, more than twice the run's noise ({noise:.3g})"
    return f"the {what} differ by {gap:.3g}, within twice the run's noise ({noise:.3g}): noise"
