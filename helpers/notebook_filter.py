"""The git filter for notebooks: what git sees of a notebook is the committed notebook, whatever
running and saving it in JupyterLab wrote into the working file.

A JupyterLab save writes the outputs, the widget state, and metadata taken from the running kernel:
the kernel's display name ("Python 3 (ipykernel)") and `language_info` with the kernel's Python
version, which differs from one student to the next. The filter strips the outputs and the
widget state (nbstripout, with the keys in git's `filter.nbstripout.extrakeys`) and puts the
notebook metadata back to the course's one form (`COURSE_METADATA`), so a notebook that was only
opened, run and saved shows no change in `git diff`, and `./run.sh update` can set it aside and
pull. run.sh installs it, in this checkout only, as the clean filter and as the diff textconv:

    python -m helpers.notebook_filter < notebook.ipynb > committed.ipynb    # git's clean filter
    python -m helpers.notebook_filter notebook.ipynb                        # git diff's textconv

Every notebook runs on the course's kernel ("python3": nbmake and CI ask for it by that name), so
the filter sets that kernelspec whatever kernel the file was saved with.
"""
from __future__ import annotations

import io
import json
import sys
from typing import Any

import helpers.lean_imports  # noqa: F401  (nbformat without its slow optional import)

COURSE_METADATA = {
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}
NBSTRIPOUT_ARGS = ["--keep-id"]  # the committed cell ids stay; JupyterLab keeps them too


def normalise(notebook: dict[str, Any]) -> dict[str, Any]:
    """`notebook` (nbformat JSON) with the course's kernelspec and language_info, in place."""
    metadata = notebook.setdefault("metadata", {})
    for key, value in COURSE_METADATA.items():
        metadata[key] = json.loads(json.dumps(value))  # a copy
    return notebook


def normalised_bytes(data: bytes) -> bytes:
    """The notebook in `data` with its metadata normalised; anything that is not a notebook's JSON
    (a file with merge-conflict markers) unchanged, for nbstripout to refuse with its message."""
    try:
        notebook = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return data
    if not isinstance(notebook, dict) or "cells" not in notebook:
        return data
    return json.dumps(normalise(notebook), ensure_ascii=False).encode("utf-8")


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
    from nbstripout import main as nbstripout_main  # reads stdin, writes stdout

    sys.stdin = io.TextIOWrapper(io.BytesIO(normalised_bytes(data)), encoding="utf-8")
    sys.argv = ["nbstripout", *NBSTRIPOUT_ARGS]
    try:
        nbstripout_main()
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
