"""`submit`: run the public checks, then pack the homework into submissions/<id>-<time>.tar.gz.

When `./run.sh check` (all labs) ran since labs/*.py and tests/public/*.py last changed, its
results are reused instead (a content hash says so). The archive holds labs/*.py,
notebooks/*.ipynb (outputs and run metadata stripped) and manifest.json: student id (COURSE_STUDENT_ID, else git config user.email, else user.name, else
"anonymous"), UTC time, commit (if any), Python and torch versions and the check results. Nothing
else of the student's machine goes in: no environment variables, no absolute paths. The checks are
bounded in time (per test and in all); a failing or hanging check never stops the submission.
The archive's path is the last line printed.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import time
from importlib import metadata
from pathlib import Path

from homework import archive
from homework.check import run_check, saved_results
from helpers.config import settings
from homework.files import caller_dir, clean_notebook
from homework.runner import DEFAULT_TIMEOUT_S

DEFAULT_BUDGET_S = 900.0


def _git(root: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def student_id(root: Path) -> str:
    for value in (settings().student_id, _git(root, "config", "user.email"),
                  _git(root, "config", "user.name")):
        if value.strip():
            return value.strip()
    return "anonymous"


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._")[:64] or "anonymous"


def _private_free(text: str, root: Path) -> str:
    """Messages may quote paths: show them relative to the course, never the home folder."""
    text = text.replace(str(root) + os.sep, "").replace(str(root), ".")
    home = os.path.expanduser("~")
    return text.replace(home, "~") if len(home) > 1 else text


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def collect_files(root: Path, log=print) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for folder, suffix in (("labs", ".py"), ("notebooks", ".ipynb")):
        for path in sorted((root / folder).glob(f"*{suffix}")):
            name = f"{folder}/{path.name}"
            if path.is_symlink() or not path.is_file():
                log(f"  left out {name}: not a regular file")
                continue
            if not any(p.fullmatch(name) for p in archive.ALLOWED):
                log(f"  left out {name}: rename it with letters, digits and _ only")
                continue
            data = path.read_bytes()
            if suffix == ".ipynb":
                try:
                    data = clean_notebook(data.decode("utf-8")).encode("utf-8")
                except ValueError:
                    log(f"  warning: {name} is not valid notebook JSON; packed as it is")
            files[name] = data
    return files


def submit(root: Path, timeout: float = DEFAULT_TIMEOUT_S, budget: float = DEFAULT_BUDGET_S,
           out_dir: Path | None = None, log=print) -> Path:
    root = root.resolve()
    out_dir = (out_dir or root / "submissions").resolve()
    try:
        reused = saved_results(root)
        if reused is not None:
            results, status = reused
            log("Reusing the results of your last `./run.sh check` (labs/*.py and tests/public/*.py "
                "are unchanged since).")
        else:
            log(f"Running the public checks first (at most {timeout:g} s per test, {budget:g} s in all).")
            results, status = run_check(root, None, timeout, deadline=time.monotonic() + budget,
                                        log=log, quiet=True)
        checks = {"status": "all passed" if status == 0 else "not all passed",
                  "reused": reused is not None,
                  "exercises": [{"exercise": r.exercise, "status": r.status,
                                 "message": _private_free(r.message, root),
                                 "tests": [dict(t, message=_private_free(t["message"], root))
                                           for t in r.tests]} for r in results]}
    except Exception as exc:  # a broken check must not stop the submission
        log(f"The checks could not run ({type(exc).__name__}: {exc}); submitting anyway.")
        checks = {"status": "could not run", "error": _private_free(f"{type(exc).__name__}: {exc}",
                                                                    root), "exercises": []}
    log("\nPacking the submission:")
    files = collect_files(root, log)
    now = datetime.datetime.now(datetime.timezone.utc)
    commit = _git(root, "rev-parse", "--verify", "-q", "HEAD")
    student = student_id(root)
    manifest = {
        "format": "course-homework-submission/1",
        "student": student,
        "created_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit or None,
        "uncommitted_changes": bool(_git(root, "status", "--porcelain")) if commit else None,
        "python": platform.python_version(),
        "torch": _version("torch"),
        "files": sorted(files),
        "checks": checks,
    }
    files["manifest.json"] = (json.dumps(manifest, indent=1, ensure_ascii=False) + "\n").encode()
    path = out_dir / f"{safe_name(student)}-{now:%Y%m%dT%H%M%SZ}.tar.gz"
    archive.pack(files, path, now.timestamp())
    try:
        archive.validate(path)  # what the grader would say, said now
    except archive.ArchiveRejected as exc:
        path.unlink()
        raise SystemExit(f"The submission would be rejected by the grader: {exc}. Nothing was "
                         "written; make the file smaller and submit again.")
    labs = sum(n.startswith("labs/") for n in files)
    notebooks = sum(n.startswith("notebooks/") for n in files)
    log(f"  {labs} lab file(s), {notebooks} notebook(s) (outputs stripped), manifest for {student!r}; "
        f"checks: {checks['status']}.")
    log("Hand in this file:")
    here = caller_dir()
    shown = path.relative_to(here) if path.is_relative_to(here) else path
    log(str(shown))
    return path
