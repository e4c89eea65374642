"""Which files make up the course, which never ship, and notebooks without their outputs.

The course = tracked + untracked-but-not-ignored files (`git ls-files --cached --others
--exclude-standard`): release and grade run from the instructor's git checkout, and refuse
clearly elsewhere. `.instructor-only` lists glob patterns (`tests/hidden/**`) that the student
edition leaves out; DEFAULT_INSTRUCTOR_ONLY applies even without that file.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from pathspec import GitIgnoreSpec

from helpers.config import settings

INSTRUCTOR_ONLY_FILE = ".instructor-only"
RELEASE_STAMP = ".student-edition"    # marks a folder written by release
GRADING_STAMP = ".grading-output"      # marks a folder written by grade
DEFAULT_INSTRUCTOR_ONLY = ("tests/hidden/**", INSTRUCTOR_ONLY_FILE)
ALWAYS_SKIPPED_DIRS = {".git", ".venv", "venv", "__pycache__", ".ipynb_checkpoints", ".pytest_cache",
                       "node_modules", ".mypy_cache", ".ruff_cache"}


class NotACheckout(RuntimeError):
    """The course folder is not a git checkout, so what belongs to it is unknown."""


def caller_dir() -> Path:
    """The folder the user ran the command from (run.sh changes directory before Python starts)."""
    return Path(settings().caller_cwd or os.getcwd())


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


def instructor_only(root: Path) -> GitIgnoreSpec:
    """What the student edition leaves out: DEFAULT_INSTRUCTOR_ONLY and the patterns of
    `.instructor-only`, in gitignore's syntax (pathspec's GitIgnoreSpec): `tests/hidden/**`, a
    folder name for everything in it, `*` within a name, `**` across folders."""
    lines = list(DEFAULT_INSTRUCTOR_ONLY)
    path = root / INSTRUCTOR_ONLY_FILE
    if path.is_file():
        lines += [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    return GitIgnoreSpec.from_lines([line for line in lines if line])


def is_instructor_only(rel: str, spec: GitIgnoreSpec) -> bool:
    return spec.match_file(rel)


# --- notebooks ---------------------------------------------------------------------------------

def cell_source(cell: dict[str, Any]) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def clean_notebook(text: str) -> str:
    """The notebook in `text` as the course commits it: no outputs, execution counts, run metadata
    or widget state, the course's kernel metadata (the git filter's own cleaning:
    helpers.notebook_filter). ValueError if it is not a notebook."""
    from helpers.notebook_filter import clean

    return clean(text)
