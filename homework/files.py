"""Which files make up the course, which never ship, and notebooks without their outputs.

The course = tracked + untracked-but-not-ignored files (`git ls-files --cached --others
--exclude-standard`): release and grade run from the instructor's git checkout, and refuse
clearly elsewhere. `.instructor-only` lists glob patterns (`tests/hidden/**`) that the student
edition leaves out; DEFAULT_INSTRUCTOR_ONLY applies even without that file.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

INSTRUCTOR_ONLY_FILE = ".instructor-only"
RELEASE_STAMP = ".student-edition"    # marks a folder written by release
GRADING_STAMP = ".grading-output"      # marks a folder written by grade
CALLER_ENV = "COURSE_CALLER_CWD"       # run.sh: the folder it was started from (before its cd)
DEFAULT_INSTRUCTOR_ONLY = ("tests/hidden/**", INSTRUCTOR_ONLY_FILE)
ALWAYS_SKIPPED_DIRS = {".git", ".venv", "venv", "__pycache__", ".ipynb_checkpoints", ".pytest_cache",
                       "node_modules", ".mypy_cache", ".ruff_cache"}
# Cell metadata that records a run (timings, scroll state), dropped like nbstripout does.
VOLATILE_CELL_METADATA = ("execution", "ExecuteTime", "collapsed", "scrolled")


class NotACheckout(RuntimeError):
    """The course folder is not a git checkout, so what belongs to it is unknown."""


def caller_dir() -> Path:
    """The folder the user ran the command from (run.sh changes directory before Python starts)."""
    return Path(os.environ.get(CALLER_ENV) or os.getcwd())


def from_caller(path: Path) -> Path:
    """`path` as the user meant it: relative paths are relative to the folder they ran from."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else caller_dir() / path


def course_files(root: Path) -> list[str]:
    """Relative posix paths of the course's regular files (no symlinks), sorted."""
    listed = _git_files(root)
    keep = []
    for rel in listed:
        path = root / rel
        if path.is_symlink() or not path.is_file():
            continue  # deleted but still in the index, or a link: never shipped
        if set(Path(rel).parts[:-1]) & ALWAYS_SKIPPED_DIRS:
            continue
        keep.append(rel)
    # folders that release or grade wrote inside the course are not part of it
    written = {rel.rsplit("/", 1)[0] + "/" for rel in keep
               if "/" in rel and rel.rsplit("/", 1)[1] in (RELEASE_STAMP, GRADING_STAMP)}
    return sorted({rel for rel in keep if not any(rel.startswith(w) for w in written)})


def _git_files(root: Path) -> list[str]:
    try:
        done = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                               "--exclude-standard"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NotACheckout(f"cannot run git in {root} ({exc}); the course must be a git checkout") from None
    if done.returncode != 0:
        raise NotACheckout(f"{root} is not a git checkout (git: "
                           f"{done.stderr.decode(errors='replace').strip()}); run this from the "
                           "course's repository, where git says which files belong to the course")
    return [p for p in done.stdout.decode("utf-8", "surrogateescape").split("\0") if p]


def load_instructor_only(root: Path) -> list[str]:
    patterns = list(DEFAULT_INSTRUCTOR_ONLY)
    path = root / INSTRUCTOR_ONLY_FILE
    if path.is_file():
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                patterns.append(line)
    return patterns


def _glob_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + "(?:/.*)?")  # a pattern naming a folder covers what is inside


def glob_match(rel: str, pattern: str) -> bool:
    """`tests/hidden/**`, `**/solutions/*.py`, `notes/` and plain paths, relative to the root."""
    return bool(_glob_regex(pattern.strip("/")).fullmatch(rel))


def is_instructor_only(rel: str, patterns: list[str]) -> bool:
    return any(glob_match(rel, p) for p in patterns)


# --- notebooks ---------------------------------------------------------------------------------

def cell_source(cell: dict[str, Any]) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def strip_notebook(nb: dict[str, Any]) -> dict[str, Any]:
    """Outputs, execution counts, run metadata and widget state removed (in place, returned)."""
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        metadata = cell.get("metadata", {})
        for key in VOLATILE_CELL_METADATA:
            metadata.pop(key, None)
    nb.get("metadata", {}).pop("widgets", None)
    return nb


def dump_notebook(nb: dict[str, Any]) -> str:
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
