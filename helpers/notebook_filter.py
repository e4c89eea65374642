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

Git looks at a file's size and time before its content: a notebook saved with outputs has a new
size, so `git status` would list it as modified (and `git pull` refuse it) though the filter sees
no change. `refresh_index` makes git look at the content instead; JupyterLab runs it after every
save (`after_save`, the post-save hook `./run.sh jupyter` sets), `./run.sh update` before it
pulls, and so can anyone:

    python -m helpers.notebook_filter --refresh notebooks/*.ipynb
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Sequence

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


def refresh_index(root: Path, paths: Sequence[str]) -> None:
    """Make git compare the tracked files `paths` (relative to the checkout `root`) by content.

    Each one whose size or time differs from its index entry (`git diff-files`, which reads no
    content) has that entry written again with the same blob and no stat data (`git
    update-index --cacheinfo`: what is staged does not change); then the index is refreshed: git
    reads each such file through the filter once and records its size and time if the content
    matches, so a notebook that was only run and saved no longer shows as modified; one with
    edits still does. Untracked paths are left alone. CalledProcessError if git fails (another
    git command holding the index, say)."""
    if not paths:
        return  # (git with no path would take every file)
    git = lambda *args: subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                       check=True, timeout=60).stdout
    stale = list(filter(None, git("diff-files", "--name-only", "-z", "--", *paths).split("\0")))
    if not stale:
        return
    listed = git("ls-files", "--stage", "-z", "--", *stale)
    entries = []
    for record in filter(None, listed.split("\0")):
        info, path = record.split("\t", 1)
        mode, blob, stage = info.split()
        if stage == "0":  # not a merge conflict's side
            entries += ["--cacheinfo", f"{mode},{blob},{path}"]
    if not entries:
        return
    git("update-index", *entries)
    # -q: files that do differ are not an error; they stay listed as modified, as they should
    subprocess.run(["git", "update-index", "-q", "--refresh"], cwd=root, capture_output=True,
                   timeout=600)


_refreshing = threading.Lock()  # one refresh at a time (they share git's index lock)


def after_save(os_path: str, model: dict | None = None, contents_manager: Any = None,
               **_: Any) -> None:
    """JupyterLab's post-save hook (`--ContentsManager.post_save_hook`, set by `./run.sh
    jupyter`): a saved notebook in a git checkout gets `refresh_index`, in a thread of its own
    (a second or so of the filter's time; the save does not wait), and any failure is ignored
    (the next save, or `./run.sh update`, refreshes it again)."""
    if not str(os_path).endswith(".ipynb"):
        return

    def refresh() -> None:
        path = Path(os_path).resolve()
        with _refreshing:
            try:
                top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=path.parent,
                                     capture_output=True, text=True, timeout=60)
                if top.returncode == 0:
                    root = Path(top.stdout.strip()).resolve()
                    refresh_index(root, [path.relative_to(root).as_posix()])
            except (OSError, ValueError, subprocess.SubprocessError):
                pass

    threading.Thread(target=refresh, name="course-refresh-index", daemon=True).start()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--refresh"]:
        refresh_index(Path.cwd(), argv[1:])
        return 0
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print("usage: python -m helpers.notebook_filter [NOTEBOOK]  (no NOTEBOOK: stdin to stdout)\n"
              "       python -m helpers.notebook_filter --refresh NOTEBOOK...  (git compares them "
              "by content)", file=sys.stderr)
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
