"""The git filter for notebooks: what git sees of a notebook is the committed notebook, whatever
running and saving it in JupyterLab wrote into the working file.

A JupyterLab save writes the outputs, the widget state, and metadata taken from the running kernel:
the kernel's display name ("Python 3 (ipykernel)") and `language_info` with the kernel's Python
version, which differs from one student to the next. The filter strips the outputs and the
widget state (nbstripout's `strip_output`, with the keys in `STRIPPED_KEYS`) and puts the
notebook metadata back to the course's one form (`COURSE_METADATA`), so a notebook that was only
opened, run and saved shows no change in `git diff`, and `./run.sh update` can set it aside and
pull. run.sh installs it, in this checkout only, as the clean filter and as the diff textconv:

    python -m helpers.notebook_filter < notebook.ipynb > committed.ipynb    # git's clean filter
    python -m helpers.notebook_filter notebook.ipynb                        # git diff's textconv

Every notebook runs on the course's kernel ("python3": nbmake and CI ask for it by that name), so
the filter sets that kernelspec whatever kernel the file was saved with.
"""
from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import helpers.lean_imports  # noqa: F401  (nbformat without its slow optional import)

COURSE_METADATA = {
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}
# What a run leaves besides the outputs and execution counts: nbstripout's own default keys (the
# notebook's signature and widget state; cells' run timings, collapse and scroll state).
STRIPPED_KEYS = ["metadata.signature", "metadata.widgets", "cell.metadata.collapsed",
                 "cell.metadata.ExecuteTime", "cell.metadata.execution",
                 "cell.metadata.heading_collapsed", "cell.metadata.hidden", "cell.metadata.scrolled"]


def normalise(notebook: dict[str, Any]) -> dict[str, Any]:
    """`notebook` (nbformat JSON) with the course's kernelspec and language_info, in place."""
    metadata = notebook.setdefault("metadata", {})
    for key, value in COURSE_METADATA.items():
        metadata[key] = json.loads(json.dumps(value))  # a copy
    return notebook


def clean(text: str) -> str:
    """The notebook in `text` as the course commits it: outputs, execution counts and
    STRIPPED_KEYS removed (nbstripout's `strip_output`; the committed cell ids kept), the kernel
    metadata normalised. ValueError (nbformat's NotJSONError) if it is not a notebook's JSON."""
    import nbformat
    from nbstripout import strip_output

    with warnings.catch_warnings():  # nbformat warns about notebooks of older minor versions
        warnings.simplefilter("ignore", UserWarning)
        notebook = nbformat.reads(text, as_version=nbformat.NO_CONVERT)
        normalise(notebook)
        strip_output(notebook, keep_output=False, keep_count=False, keep_id=True,
                     extra_keys=STRIPPED_KEYS)
        out = nbformat.writes(notebook)
    return out if out.endswith("\n") else out + "\n"


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print("usage: python -m helpers.notebook_filter [NOTEBOOK]  (no NOTEBOOK: stdin to stdout)",
              file=sys.stderr)
        return 2
    if argv:
        with open(argv[0], "rb") as f:
            data = f.read()
    else:
        data = sys.stdin.buffer.read()
    try:
        text = clean(data.decode("utf-8"))
    except ValueError:  # merge-conflict markers, or not a notebook: git shows this and stops
        print(f"No valid notebook detected in {argv[0] if argv else 'stdin'}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(text.encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
