"""Tables and figures for notebooks and terminals alike."""
from __future__ import annotations

from typing import Any, Iterable, Sequence


def in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and shell.__class__.__name__ == "ZMQInteractiveShell"


def _fmt(value: Any, floatfmt: str) -> str:
    if isinstance(value, float):
        return format(value, floatfmt)
    return str(value)


def format_table(rows: Iterable[dict[str, Any]], columns: Sequence[str] | None = None,
                 floatfmt: str = ".3g") -> str:
    """Rows of dicts as an aligned plain-text (and valid Markdown) table."""
    rows = list(rows)
    columns = list(columns or (rows[0].keys() if rows else []))
    cells = [[_fmt(row.get(c, ""), floatfmt) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    out = [line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def table(rows: Iterable[dict[str, Any]], columns: Sequence[str] | None = None,
          title: str | None = None, floatfmt: str = ".3g") -> None:
    """Show a table: rendered Markdown in a notebook, aligned text in a terminal.

    Returns nothing, so a notebook cell ending in table(...) does not echo the text again; use
    format_table() for the text itself."""
    text = format_table(rows, columns, floatfmt)
    if title:
        text = f"**{title}**\n\n{text}" if in_notebook() else f"{title}\n{text}"
    if in_notebook():
        from IPython.display import Markdown, display
        display(Markdown(text))
    else:
        print(text, flush=True)


def bar_chart(labels: Sequence[str], values: Sequence[float], *, title: str, ylabel: str,
              xlabel: str = "", reference: float | None = None, ax=None):
    """A labelled bar chart (values written on the bars); `reference` draws a dashed line."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(labels) + 2), 3.2))
    bars = ax.bar(list(labels), list(values), color="tab:blue")
    ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], padding=2, fontsize=8)
    if reference is not None:
        ax.axhline(reference, color="gray", linestyle="--", linewidth=1)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.tick_params(axis="x", labelrotation=20)
    ax.figure.tight_layout()
    return ax
