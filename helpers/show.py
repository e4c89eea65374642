"""Tables, figures and interactive explorers for notebooks and terminals alike."""
from __future__ import annotations

import base64
import html
import io
from typing import Any, Callable, Iterable, Sequence


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


# ---------------------------------------------------------------------------- interactive explorers
def html_table(rows: Iterable[dict[str, Any]], columns: Sequence[str] | None = None,
               title: str | None = None, floatfmt: str = ".3g") -> str:
    """A table as HTML (a <pre> block of the aligned text), for an explorer's panel."""
    head = f"<b>{html.escape(title)}</b>" if title else ""
    return f"{head}<pre>{html.escape(format_table(rows, columns, floatfmt))}</pre>"


def html_figure(fig) -> str:
    """A matplotlib figure as an inline PNG <img>; the figure is closed (it is not shown again)."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}"/>'


def html_text(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


def explorer(controls: Sequence[Any], render: Callable[[], str | Sequence[str]], *,
             button: Any = None) -> Any:
    """Show `controls` (ipywidgets) above a panel that `render()` fills with HTML, and redraw the
    panel when a control changes (or only when `button`, one of the controls, is clicked).

    The panel is a `widgets.HTML` whose value is replaced: no output is captured into an
    `Output` widget while a cell runs, which can stall notebook execution (nbclient issue #312),
    and the saved widget state shows the last view when the notebook is reopened. `render` returns
    HTML (`html_table`, `html_figure`, `html_text`); an unsolved exercise shows its notice in the
    panel (in the student edition), and any other error of the first drawing fails the cell."""
    import ipywidgets as widgets
    from IPython.display import display

    from helpers.exercise import notice_html, student_edition, unsolved_message

    panel = widgets.HTML()

    def update(_=None) -> None:
        try:
            parts = render()
        except Exception as exc:
            message = unsolved_message(exc)
            if not message or not student_edition():
                raise
            parts = notice_html(message)
        panel.value = parts if isinstance(parts, str) else "".join(parts)

    if button is None:
        for control in controls:
            control.observe(update, names="value")
    else:  # a slow measurement: only the button starts it
        button.on_click(update)
    update()  # the first view, drawn while the cell runs; errors here fail the cell
    rows = [widgets.HBox(list(controls[i:i + 3])) for i in range(0, len(controls), 3)]
    box = widgets.VBox([*rows, panel])
    display(box)
    return box
