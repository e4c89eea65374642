"""`./run.sh update`: the course's latest version, and nothing the student wrote or ran lost.

    ./run.sh update

1. JupyterLab must not be serving this checkout: a notebook open there keeps the version it
   loaded, and its next save ("File Changed": Overwrite) would write that back over the update.
2. `git fetch`, then the files the course changed since this checkout's version (from the merge
   base with the upstream branch).
3. Git's index is refreshed for the notebooks (`notebook_filter.refresh_index`): one that was only
   run and saved is not "modified".
4. A notebook the course changed and the student ran or edited is set aside, with its outputs and
   edits, in a folder of its own (runs/notebook-outputs/<date-time>/, never over an earlier
   copy), then put back to the committed version for git to update. Notebooks the course did not
   change are left as they are, outputs and edits included. Any other file the student changed
   that the course changed too (a lab with an exercise in it) stops the update before anything
   is touched: git would refuse it, and the student chooses (commit, then update: git merges).
5. `git merge` of the upstream branch (a fast-forward unless the student committed); if git
   refuses, the set-aside notebooks go back where they were.
6. One line for each notebook: what happened to it.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from helpers.notebook_filter import refresh_index

REPO_ROOT = Path(__file__).resolve().parent.parent
SET_ASIDE = Path("runs") / "notebook-outputs"


class UpdateError(RuntimeError):
    """The update cannot go on; nothing was changed. The message says why and what to do."""


def git(root: Path, *args: str, check: bool = True, capture: bool = True) -> str:
    done = subprocess.run(["git", *args], cwd=root, text=True, timeout=600,
                          capture_output=capture)
    if check and done.returncode != 0:
        raise UpdateError(f"git {' '.join(args)} failed: {(done.stderr or '').strip()}")
    return done.stdout if capture else ""


def jupyterlab_serving(root: Path) -> list[str]:
    """The running Jupyter servers (their URL and pid) whose folder holds `root`, from the files
    each one keeps in Jupyter's runtime folder while it runs."""
    try:
        from jupyter_core.paths import jupyter_runtime_dir
    except ImportError:
        return []
    found = []
    for info_file in sorted(Path(jupyter_runtime_dir()).glob("jpserver-*.json")):
        try:
            info = json.loads(info_file.read_text())
            os.kill(int(info["pid"]), 0)  # still running? (ProcessLookupError if not)
        except (OSError, ValueError, KeyError):
            continue
        served = Path(info.get("root_dir") or info.get("notebook_dir") or "/").resolve()
        if served == root or served in root.parents:
            found.append(f"{info.get('url', '?')} (pid {info['pid']})")
    return found


def has_outputs(path: Path) -> bool:
    """Does the notebook hold what a run leaves (outputs, execution counts, widget state)?"""
    try:
        notebook = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    cells = [c for c in notebook.get("cells", []) if c.get("cell_type") == "code"]
    return (any(c.get("outputs") or c.get("execution_count") is not None for c in cells)
            or "widgets" in notebook.get("metadata", {}))


@dataclass
class Plan:
    """What the update does, decided before anything is touched."""
    upstream: str
    changed_upstream: set[str]
    set_aside: dict[str, str] = field(default_factory=dict)  # notebook -> what of the student's
    kept: dict[str, str] = field(default_factory=dict)       # ... in one the course did not change
    blocked: list[str] = field(default_factory=list)         # files both the course and student changed
    notebooks: list[str] = field(default_factory=list)       # the notebooks tracked before the update


def _local_changes(root: Path) -> tuple[set[str], set[str]]:
    """(tracked files that differ from HEAD, untracked files), as git sees them."""
    changed, untracked = set(), set()
    records = git(root, "status", "--porcelain", "-z", "--untracked-files=all").split("\0")
    records = iter(records)
    for record in records:
        if not record:
            continue
        status, path = record[:2], record[3:]
        if status[0] in "RC":
            next(records, None)  # a rename's source path follows
        (untracked if status == "??" else changed).add(path)
    return changed, untracked


def plan(root: Path) -> Plan:
    """Fetch and decide (UpdateError where the update cannot go on)."""
    if git(root, "rev-parse", "--is-inside-work-tree", check=False).strip() != "true":
        raise UpdateError("this folder is not a git checkout: nothing to update (a course handed "
                          "out as an archive is updated by downloading it again)")
    servers = jupyterlab_serving(root)
    if servers:
        raise UpdateError(
            "JupyterLab is serving this folder (" + ", ".join(servers) + "): stop it first "
            "(File > Shut Down, or Ctrl-C twice where it runs), then run ./run.sh update again. "
            "A notebook open there keeps the version it loaded, and saving it would write that "
            "back over the update.")
    upstream = git(root, "rev-parse", "--abbrev-ref", "--symbolic-full-name", "@{u}",
                   check=False).strip()
    if not upstream:
        raise UpdateError("this checkout's branch follows no branch of the course's repository "
                          "(git branch --set-upstream-to=origin/main sets one)")
    print(f"run.sh update: fetching the course's latest version ({upstream})", flush=True)
    git(root, "fetch", "--quiet")
    base = git(root, "merge-base", "HEAD", "@{u}").strip()
    # --no-renames: a notebook the course renamed is one it removed (and one it added)
    changed_upstream = set(filter(None, git(root, "diff", "--name-only", "--no-renames", "-z", base,
                                            "@{u}").split("\0")))
    notebooks = sorted(filter(None, git(root, "ls-files", "-z", "--", "*.ipynb").split("\0")))
    refresh_index(root, notebooks)
    changed, untracked = _local_changes(root)
    result = Plan(upstream, changed_upstream, notebooks=notebooks)
    for path in sorted((changed | untracked) & changed_upstream):
        if not path.endswith(".ipynb"):
            result.blocked.append(path)
    for path in notebooks + sorted(p for p in untracked & changed_upstream if p.endswith(".ipynb")):
        ran, edited = has_outputs(root / path), path in changed
        what = ("your edits and outputs" if ran and edited else "your edits" if edited
                else "your outputs" if ran else "")
        if path in untracked:
            what = "yours"
        if not what:
            continue
        if path in changed_upstream:
            result.set_aside[path] = what
        else:
            result.kept[path] = what
    return result


def _aside_folder(root: Path) -> Path:
    """A new folder for this update's copies: never one an earlier update wrote."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    for n in range(1, 1000):
        folder = root / SET_ASIDE / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            folder.mkdir(parents=True)
            return folder
        except FileExistsError:
            continue
    raise UpdateError(f"could not make a new folder in {SET_ASIDE}")


def update(root: Path = REPO_ROOT) -> int:
    root = root.resolve()
    try:
        p = plan(root)
    except UpdateError as exc:
        print(f"run.sh update: {exc}", file=sys.stderr)
        return 1
    if p.blocked:
        print("run.sh update: the course changed files that you changed too:\n  "
              + "\n  ".join(p.blocked) + "\nNothing was changed. Commit your work first "
              "(git add -A && git commit -m 'my work'), then run ./run.sh update again: git "
              "merges the course's changes into yours and says where they meet.", file=sys.stderr)
        return 1
    if not p.changed_upstream:
        print("run.sh update: the course has no new version; nothing changed")
        return 0
    copies: dict[str, Path] = {}
    if p.set_aside:
        folder = _aside_folder(root)
        for path in p.set_aside:
            if (root / path).exists():
                copies[path] = folder / Path(path).name
                shutil.copy2(root / path, copies[path])
            if path in p.notebooks:
                git(root, "checkout", "HEAD", "--", path)
            else:  # untracked: the course adds a file of that name
                (root / path).unlink(missing_ok=True)
    ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", "HEAD", "@{u}"], cwd=root,
                              timeout=60).returncode == 0
    merged = subprocess.run(["git", "merge", "--ff-only" if ancestor else "--no-edit", "@{u}"],
                            cwd=root, timeout=600).returncode == 0
    if not merged:
        if git(root, "rev-parse", "-q", "--verify", "MERGE_HEAD", check=False).strip():
            git(root, "merge", "--abort", check=False)  # a merge stopped by conflicts
        for path, copy in copies.items():
            shutil.copy2(copy, root / path)
        print("run.sh update: git could not merge the course's version into your commits (its "
              "message is above); nothing changed. Merge by hand: git pull, then fix what git "
              "lists.", file=sys.stderr)
        return 1
    print(f"run.sh update: updated to the course's latest version ({p.upstream})")
    for path in sorted(n for n in p.changed_upstream | set(p.set_aside) if n.endswith(".ipynb")):
        now = ("the course removed it" if not (root / path).exists()
               else "the course changed it: this is its new version" if path in p.notebooks
               else "a new notebook")
        if path in copies and p.set_aside[path] == "yours":
            now += f"; your own notebook of that name is {_rel(root, copies[path])}"
        elif path in copies:
            now += f"; your copy, with {p.set_aside[path]}, is {_rel(root, copies[path])}"
        elif path in p.set_aside:
            now += " (you had deleted it)"
        print(f"  {path}: {now}")
    for path, what in sorted(p.kept.items()):
        print(f"  {path}: the course did not change it: left as it was, with {what}")
    others = [n for n in p.notebooks if n not in p.changed_upstream and n not in p.kept]
    if others:
        print(f"  {len(others)} other notebook(s): the course did not change them")
    return 0


def _rel(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def main(argv: list[str]) -> int:
    if argv:
        print("usage: ./run.sh update   (no arguments: it fetches and merges this checkout's "
              "upstream branch)", file=sys.stderr)
        return 2
    return update()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
