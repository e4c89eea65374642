"""Which files make up the course, which never ship, and notebooks without their outputs.

The course = tracked + untracked-but-not-ignored files (`git ls-files --cached --others
--exclude-standard`), or, outside a git checkout, a walk of the tree that skips .gitignore'd paths
and virtual environments. `.instructor-only` lists glob patterns (`tests/hidden/**`) that the
student edition leaves out; DEFAULT_INSTRUCTOR_ONLY applies even without that file.
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

INSTRUCTOR_ONLY_FILE = ".instructor-only"
RELEASE_STAMP = ".student-edition"    # marks a folder written by release
GRADING_STAMP = ".grading-output"      # marks a folder written by grade
DEFAULT_INSTRUCTOR_ONLY = ("tests/hidden/**", INSTRUCTOR_ONLY_FILE)
ALWAYS_SKIPPED_DIRS = {".git", ".venv", "venv", "__pycache__", ".ipynb_checkpoints", ".pytest_cache",
                       "node_modules", ".mypy_cache", ".ruff_cache"}
# Cell metadata that records a run (timings, scroll state), dropped like nbstripout does.
VOLATILE_CELL_METADATA = ("execution", "ExecuteTime", "collapsed", "scrolled")


def course_files(root: Path) -> list[str]:
    """Relative posix paths of the course's regular files (no symlinks), sorted."""
    listed = _git_files(root)
    if listed is None:
        listed = _walk_files(root)
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


def _git_files(root: Path) -> list[str] | None:
    try:
        inside = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-prefix"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if inside.returncode != 0:
        return None
    done = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                           "--exclude-standard"], capture_output=True, timeout=60)
    if done.returncode != 0:
        return None
    return [p for p in done.stdout.decode("utf-8", "surrogateescape").split("\0") if p]


def _walk_files(root: Path) -> list[str]:
    ignore = _gitignore_patterns(root)
    found = []
    for folder, dirs, files in os.walk(root):
        rel_folder = Path(folder).relative_to(root).as_posix()
        rel_folder = "" if rel_folder == "." else rel_folder + "/"
        dirs[:] = sorted(d for d in dirs if d not in ALWAYS_SKIPPED_DIRS
                         and not _ignored(rel_folder + d, True, ignore))
        found += [rel_folder + f for f in sorted(files) if not _ignored(rel_folder + f, False, ignore)]
    return found


def _gitignore_patterns(root: Path) -> list[str]:
    path = root / ".gitignore"
    if not path.is_file():
        return []
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines()]
    return [line for line in lines if line and not line.startswith(("#", "!"))]


def _ignored(rel: str, is_dir: bool, patterns: list[str]) -> bool:
    """A small subset of .gitignore: names, /anchored paths, dir/ patterns, * and ** globs."""
    name = rel.rsplit("/", 1)[-1]
    for pattern in patterns:
        dir_only = pattern.endswith("/")
        pattern = pattern.rstrip("/")
        if dir_only and not is_dir:
            continue
        if "/" in pattern:
            if glob_match(rel, pattern.lstrip("/")):
                return True
        elif fnmatch.fnmatchcase(name, pattern):
            return True
    return False


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


def set_cell_source(cell: dict[str, Any], text: str) -> None:
    cell["source"] = text.splitlines(keepends=True)


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
