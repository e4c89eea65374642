"""Tables, figures and interactive explorers for notebooks and terminals alike."""
from __future__ import annotations

import base64
import html
import io
import re
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
    """Rows of dicts as an aligned plain-text table, for terminals and logs.

    The text is shown as it is: a `|` inside a name or value is not escaped, so it is Markdown only
    when no cell holds one; `markdown_table` gives the Markdown."""
    columns, cells = _cells(rows, columns, floatfmt)
    return _aligned(columns, cells)


# Characters that end or reshape a Markdown table cell: `|` splits cells (GFM); `*`, `_`, `~` and
# backticks format; `<`, `>`, `&` are HTML; `[`, `]` make links; `\` escapes; `$` starts LaTeX in
# JupyterLab, which pairs dollars in the Markdown source (before the table is parsed, so a pair
# would swallow the `|` between cells) and again in the rendered page (MathJax). Each is written as
# a numeric character reference, which CommonMark reads as that literal character and nothing else.
_MARKDOWN_SPECIAL = re.compile(r"[\\|`*_~$<>&\[\]]")
# MathJax (JupyterLab's typesetter) leaves the inside of an element of this class alone
NO_MATH_CLASS = "mathjax_ignore"


def markdown_cell(text: str) -> str:
    """`text` as the content of one Markdown table cell that renders as exactly that text: the
    characters Markdown would read as syntax are written as character references, and a line
    break becomes `<br>` (a newline would end the row). Inside a `markdown_table`, where MathJax
    does not look, `$` is text too."""
    return "<br>".join(_MARKDOWN_SPECIAL.sub(lambda m: f"&#{ord(m.group())};", text).splitlines())


def markdown_table(rows: Iterable[dict[str, Any]], columns: Sequence[str] | None = None,
                   floatfmt: str = ".3g", title: str | None = None) -> str:
    """Rows of dicts as a Markdown (GFM) table whose cells render exactly as their text, whatever
    characters it holds (the column "max |param - 1 process|", a "$" in a value): cells escaped by
    `markdown_cell`, the table inside a `<div>` that JupyterLab's LaTeX typesetter skips."""
    columns, cells = _cells(rows, columns, floatfmt)
    text = _aligned([markdown_cell(c) for c in columns],
                    [[markdown_cell(v) for v in row] for row in cells])
    if title:
        text = f"**{markdown_cell(title)}**\n\n{text}"
    return f'<div class="{NO_MATH_CLASS}">\n\n{text}\n\n</div>'


def _cells(rows: Iterable[dict[str, Any]], columns: Sequence[str] | None,
           floatfmt: str) -> tuple[list[str], list[list[str]]]:
    rows = list(rows)
    keys = list(columns or (rows[0].keys() if rows else []))
    return [str(k) for k in keys], [[_fmt(row.get(k, ""), floatfmt) for k in keys] for row in rows]


def _aligned(columns: list[str], cells: list[list[str]]) -> str:
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    out = [line(columns), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def table(rows: Iterable[dict[str, Any]], columns: Sequence[str] | None = None,
          title: str | None = None, floatfmt: str = ".3g") -> None:
    """Show a table: rendered Markdown in a notebook (with the aligned text as its plain-text
    form), aligned text in a terminal.

    Returns nothing, so a notebook cell ending in table(...) does not echo the text again; use
    format_table() for the text itself, markdown_table() for its Markdown."""
    rows = list(rows)
    text = format_table(rows, columns, floatfmt)
    if not in_notebook():
        print(f"{title}\n{text}" if title else text, flush=True)
        return
    from IPython.display import display

    display({"text/markdown": markdown_table(rows, columns, floatfmt, title),
             "text/plain": f"{title}\n{text}" if title else text}, raw=True)


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
    """A table as an HTML <table>, for an explorer's panel: numbers right-aligned, every cell's
    text escaped, styled inline (a widget's HTML gets none of JupyterLab's table style). A wide
    table stays a table: its cells wrap within their columns (a <pre> of aligned text wrapped its
    rows mid-line in Chromium at 1366 px, notebook 05's links table)."""
    rows = list(rows)
    keys = list(columns or (rows[0].keys() if rows else []))
    pad = "padding: 2px 8px; border-bottom: 1px solid #ddd"
    cell = lambda tag, value: (
        f'<{tag} style="{pad}; text-align: '
        f'{"right" if isinstance(value, (int, float)) and not isinstance(value, bool) else "left"}">'
        f"{html.escape(_fmt(value, floatfmt))}</{tag}>")
    head = f"<b>{html.escape(title)}</b>" if title else ""
    return (f'{head}<table class="{NO_MATH_CLASS}" style="border-collapse: collapse; margin: 4px 0">'
            "<tr>" + "".join(cell("th", str(k)) for k in keys) + "</tr>"
            + "".join("<tr>" + "".join(cell("td", row.get(k, "")) for k in keys) + "</tr>" for row in rows)
            + "</table>")


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


# ipywidgets 8 puts this class on every widget view whose model has no live kernel behind it: a
# notebook reopened from its saved widget state, or after the kernel restarted (the front end then
# draws a broken-link icon before each control, and moving one does nothing).
DISCONNECTED_CLASS = "jupyter-widgets-disconnected"
OFFLINE_NOTE_CLASS = "course-widgets-offline"
OFFLINE_NOTE = ("These controls are a picture saved with the notebook: no running kernel is behind "
                "them, so moving them does nothing. Run this cell to use the controls.")
# The saved view: an ordinary HTML output after the controls, hidden while they are drawn.
SAVED_VIEW_CLASS = "course-explorer-saved"
SAVED_VIEW_NOTE = ("The controls of this explorer are gone: they live in the kernel that drew them, "
                   "which has restarted or stopped since (JupyterLab keeps no widget across a "
                   "kernel restart). Below is the last view, saved with the notebook. Run this "
                   "cell to get the controls back.")
CONTROLS_TEXT = "(the explorer's controls: they need the kernel that drew them)"
_NOTE_STYLE = "color: #8a6d00; background: #fff8e1; border-left: 6px solid #e0a800; padding: 4px 10px"


def offline_note(key: str = "") -> Any:
    """A `widgets.HTML` to show above a group of controls that says "run this cell to use the
    controls" only where no kernel is behind them.

    Its text is in the saved widget state, so a reopened notebook shows it; its stylesheet hides
    it unless the front end has marked the view disconnected, so a live cell shows nothing. With
    `key`, it also hides that explorer's `saved_view` wherever the controls are drawn."""
    import ipywidgets as widgets

    note, gone = OFFLINE_NOTE_CLASS, DISCONNECTED_CLASS
    hide_saved = f" .{SAVED_VIEW_CLASS}.{_saved_class(key)} {{display: none}}" if key else ""
    return widgets.HTML(
        f"<style>.{note} {{display: none}} .{gone} .{note} {{display: block; {_NOTE_STYLE}}}"
        f"{hide_saved}</style>"
        f'<div class="{note}">{html.escape(OFFLINE_NOTE)}</div>')


def _saved_class(key: str) -> str:
    return f"{SAVED_VIEW_CLASS}-{key}"


def saved_view(key: str, panel: str, settings: str = "") -> dict[str, str]:
    """The explorer `key`'s last view as an ordinary output (a MIME bundle): a note saying the
    controls are gone and to run the cell, the settings the view was drawn with, and the panel's
    HTML (its figures are inline PNGs).

    JupyterLab saves widget state only for widgets whose kernel is alive: after a kernel restart
    the next save keeps none, and a reopened notebook shows "Error displaying widget: model not
    found" where the controls were. This output survives: the controls' stylesheet
    (`offline_note(key)`) hides it wherever the controls are drawn, and its own stylesheet hides
    that error line (the output just before it with no element inside). An untrusted notebook
    shows it without stylesheets: the note and the view, under the error line."""
    mine = f".{SAVED_VIEW_CLASS}.{_saved_class(key)}"
    style = (f"<style>.jp-OutputArea-child:has(+ .jp-OutputArea-child {mine})"
             f":not(:has(.jp-OutputArea-output *)) {{display: none}}</style>")
    shown = f"<div><i>{html.escape(settings)}</i></div>" if settings else ""
    return {"text/html": f'<div class="{SAVED_VIEW_CLASS} {_saved_class(key)}">{style}'
                         f'<div style="{_NOTE_STYLE}">{html.escape(SAVED_VIEW_NOTE)}</div>'
                         f"{shown}{panel}</div>",
            "text/plain": f"{SAVED_VIEW_NOTE}\n{settings}".strip()}


def control_settings(controls: Sequence[Any]) -> str:
    """'ranks N: 4, layout: zigzag': what each control (with a value) is set to."""
    shown = []
    for control in controls:
        if not hasattr(control, "value"):
            continue  # a button
        value = control.value
        labels, index = getattr(control, "_options_labels", None), getattr(control, "index", None)
        if labels and isinstance(index, int):  # a selection shows its label, not its value
            value = labels[index]      # (its `label` stays '' while the first option is chosen)
        elif labels and isinstance(index, (tuple, list)):
            value = [labels[i] for i in index]
        if isinstance(value, (tuple, list)):
            value = ", ".join(map(str, value))
        shown.append(f"{control.description or type(control).__name__}: {value}")
    return "drawn for " + "; ".join(shown) if shown else ""


def explorer(controls: Sequence[Any], render: Callable[[], str | Sequence[str]], *,
             button: Any = None) -> Any:
    """Show `controls` (ipywidgets) above a panel that `render()` fills with HTML, and redraw the
    panel when a control changes (or only when `button`, one of the controls, is clicked).

    The panel is a `widgets.HTML` whose value is replaced: no output is captured into an
    `Output` widget while a cell runs, which can stall notebook execution (nbclient issue #312).
    A reopened notebook shows the last view either way: from the saved widget state, under a
    note (`offline_note`) that says to run the cell to use the controls again, or, where
    JupyterLab saved no widget state (the kernel had restarted before the save), from the
    `saved_view` output that follows the controls, updated with every redraw. `render` returns
    HTML (`html_table`, `html_figure`, `html_text`); an unsolved exercise shows its notice in the
    panel (in the student edition), and any other error of the first drawing fails the cell."""
    import uuid

    import ipywidgets as widgets
    from IPython.display import display

    from helpers.notice import notice_html, student_edition, unsolved_message

    key = uuid.uuid4().hex[:12]
    panel = widgets.HTML()
    saved = []  # the saved view's display handle, once shown

    def update(_=None) -> None:
        try:
            parts = render()
        except Exception as exc:
            message = unsolved_message(exc)
            if not message or not student_edition():
                raise
            parts = notice_html(message)
        panel.value = parts if isinstance(parts, str) else "".join(parts)
        if saved:
            saved[0].update(saved_view(key, panel.value, control_settings(controls)), raw=True)

    if button is None:
        for control in controls:
            control.observe(update, names="value")
    else:  # a slow measurement: only the button starts it
        button.on_click(update)
    update()  # the first view, drawn while the cell runs; errors here fail the cell
    rows = [widgets.HBox(list(controls[i:i + 3])) for i in range(0, len(controls), 3)]
    box = widgets.VBox([offline_note(key), *rows, panel])
    # the controls; where they cannot be drawn (an untrusted notebook), one short line instead of
    # the widget's repr (its whole HTML)
    display({**box._repr_mimebundle_(), "text/plain": CONTROLS_TEXT}, raw=True)
    saved.append(display(saved_view(key, panel.value, control_settings(controls)), raw=True,
                         display_id=True))
    return box
