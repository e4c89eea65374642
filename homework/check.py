"""`check [NN]`: the public tests of one lab (or all), summarised per exercise.

Each exercise is passed (all its tests pass), not implemented yet (a test met the stub's
NotImplementedError, also inside a rank), or failed (with the first failing test's message).
Exit status 0 only when every test passed. All the lab's test files run in one pytest process
(another one only after a crash or a hang). The full pytest output goes to runs/homework/, and
the results of a check of all labs to runs/homework/check-all.json with a hash of labs/*.py and
tests/public/*.py, so that `submit` can reuse them while those files are unchanged.

In the student edition the tests run as grading runs them (homework.splice): on a copy of the
course (runs/homework/tree-PID, removed afterwards) whose labs are the course's own
(.course/labs, written by `release`) with the student's exercises and helpers spliced in. What
of labs/*.py is not run is listed first, and a location in a message ("labs/x.py:N") is the line
of the student's own file. The instructor's checkout, whose labs are the course, runs as it is.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers.config import settings
from homework.files import ALWAYS_SKIPPED_DIRS
from homework.runner import DEFAULT_TIMEOUT_S, Direct, Outcome, TestInfo, run_tests
from homework.splice import COURSE_LABS, Spliced, splice_folder, to_submitted

RESULTS_FILE = "runs/homework/check-all.json"
GLOO_PREFIX = re.compile(r"\[/[^\]\s]*\] ")  # gloo's source position in its messages: not the student's
# how pytest names the error of a test whose launch failed (tests/conftest.py); its message says
# the rest ("rank 1 raised ValueError: ... at labs/...")
RANK_FAILURE = "tests.harness.RankFailure: "

STATUS_TEXT = {"passed": "passed", "failed": "failed", "not_implemented": "not implemented yet",
               "not_run": "not run"}


@dataclass
class ExerciseResult:
    exercise: str
    status: str                      # passed | failed | not_implemented | not_run
    message: str = ""
    tests: list[dict] = field(default_factory=list)


def normalise_lab(raw: str) -> str:
    """'4', '04', 'lab04' -> '04'; ValueError otherwise."""
    match = re.fullmatch(r"(?:lab)?(\d{1,3})", raw.strip())
    if not match:
        raise ValueError(f"expected a lab number such as 04, got {raw!r}")
    return match.group(1).zfill(2)


def public_test_files(root: Path, lab: str | None = None) -> list[str]:
    pattern = f"test_lab{lab}_*.py" if lab else "test_lab*.py"
    return sorted(p.relative_to(root).as_posix() for p in (root / "tests" / "public").glob(pattern))


def summarise(infos: list[TestInfo], outcomes: dict[str, Outcome]) -> list[ExerciseResult]:
    """Per exercise, in the order tests were collected; a test without a marker counts under its file."""
    groups: dict[str, ExerciseResult] = {}
    for info in infos:
        name = info.exercise or f"(tests in {info.file})"
        group = groups.setdefault(name, ExerciseResult(name, "passed"))
        outcome = outcomes.get(info.nodeid, Outcome(info.nodeid, "not_run", "no result"))
        group.tests.append({"test": info.nodeid, "outcome": outcome.outcome,
                            "message": outcome.message})
    rank = {"not_implemented": 3, "failed": 2, "not_run": 1, "passed": 0}
    for group in groups.values():
        worst = None
        for test in group.tests:
            kind = test["outcome"]
            kind = {"timeout": "failed", "crashed": "failed", "error": "failed", "load_error": "failed",
                    "skipped": "passed"}.get(kind, kind)
            if worst is None or rank[kind] > rank[worst[0]]:
                worst = (kind, test["message"])
        group.status, group.message = worst if worst else ("passed", "")
        if group.status == "passed":
            group.message = ""
    return list(groups.values())


def _stub_text(message: str) -> str:
    """The stub's own words from a NotImplementedError message, rank prefix and type dropped."""
    index = message.find("Exercise ")
    return message[index:] if index >= 0 else message


def run_check(root: Path, lab: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
              deadline: float | None = None, log=print, quiet: bool = False
              ) -> tuple[list[ExerciseResult], int]:
    """Run the public checks; print the summary; return it with the exit status."""
    root = root.resolve()
    files = public_test_files(root, lab)
    scope = f"lab {lab}" if lab else "all labs"
    if not files:
        if lab and not list((root / "labs").glob(f"lab{lab}_*.py")):
            log(f"There is no lab {lab} (no labs/lab{lab}_*.py).")
            return [], 2
        log(f"No public tests for {scope} (tests/public/test_lab{lab or ''}*.py): nothing to check.")
        return [], 0
    log_dir = root / "runs" / "homework"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"check-{lab or 'all'}.log"
    log_path.write_text("")
    log(f"Public checks for {scope}: {len(files)} test file(s), at most {timeout:g} s per test.")
    start = time.monotonic()

    def progress(outcome: Outcome) -> None:
        if not quiet:
            log(f"  {STATUS_TEXT.get(outcome.outcome, outcome.outcome):<20} {outcome.nodeid}")

    tree, splices = root, {}
    try:
        if (root / COURSE_LABS).is_dir():  # the student edition: run what grading runs
            tree = log_dir / f"tree-{os.getpid()}"
            splices, not_run = spliced_tree(root, tree)
            if not_run:
                log("Not run from your labs (the checks, like grading, run the course's own code "
                    "around your exercises and the helpers you added):")
                for text in not_run:
                    log(f"  {text}")
        run = run_tests(Direct(tree), files, timeout=timeout, deadline=deadline, log_path=log_path,
                        on_outcome=progress)
    finally:
        if tree != root:
            shutil.rmtree(tree, ignore_errors=True)
    infos, outcomes = run.tests, run.outcomes
    for outcome in outcomes.values():
        outcome.message = to_submitted(outcome.message, splices)
    results = summarise(infos, outcomes)
    log("")
    width = max([len("exercise")] + [len(r.exercise) for r in results])
    log(f"{'exercise':<{width}}  status")
    for result in results:
        text = STATUS_TEXT[result.status]
        detail = _stub_text(result.message) if result.status == "not_implemented" else \
            GLOO_PREFIX.sub("", result.message.removeprefix(RANK_FAILURE))
        log(f"{result.exercise:<{width}}  {text}" + (f": {detail}" if detail else ""))
    counts = {k: sum(r.status == k for r in results) for k in STATUS_TEXT}
    summary = ", ".join(f"{n} {STATUS_TEXT[k]}" for k, n in counts.items() if n)
    log(f"\n{len(results)} exercise(s): {summary} ({time.monotonic() - start:.0f} s). "
        f"Full output: {log_path.relative_to(root)}")
    file = debug_file(results)
    if file:
        log(f"Debug with: {debug_command(root, file, lab)}")
    ok = all(o.passed or o.outcome == "skipped" for o in outcomes.values())
    status = 0 if ok and outcomes else 1
    if lab is None and not any(o.outcome == "not_run" for o in outcomes.values()):
        save_results(root, results, status)
    return results, status


# what the checks' copy of the course holds besides the spliced labs: copied (the tests and the
# code around them), and the rest of the top level linked
COPIED = ("helpers", "homework", "tests", ".course")
NOT_IN_TREE = {"labs", "runs", "submissions", ".git"} | ALWAYS_SKIPPED_DIRS


def spliced_tree(root: Path, tree: Path) -> tuple[dict[str, Spliced], list[str]]:
    """A copy of the course in `tree` whose labs are the course's own with the exercises of
    root/labs spliced in; the splices, and what of root/labs is not run."""
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    for path in root.iterdir():
        if path.name in NOT_IN_TREE:
            continue
        if path.name in COPIED and path.is_dir():
            shutil.copytree(path, tree / path.name, symlinks=True,
                            ignore=shutil.ignore_patterns(*ALWAYS_SKIPPED_DIRS))
        elif path.is_file():
            shutil.copy2(path, tree / path.name)
        else:
            (tree / path.name).symlink_to(path.resolve())
    submitted = {f"labs/{p.name}": p.read_bytes() for p in sorted((root / "labs").glob("*.py"))
                 if p.is_file()}
    (tree / "labs").mkdir()
    for path in (root / "labs").iterdir():  # data a lab reads, if any: .course/labs has modules only
        if path.is_file() and path.suffix != ".py":
            shutil.copyfile(path, tree / "labs" / path.name)
    return splice_folder(root / COURSE_LABS, submitted, tree / "labs")


FAILURES = ("failed", "error", "timeout", "crashed", "load_error")  # outcomes worth debugging


def debug_file(results: list[ExerciseResult]) -> str | None:
    """The test file to debug: that of the first test that really failed (not one that only met
    an exercise's stub, nor one that was not run), else of the first test that did not pass."""
    tests = [t for r in results if r.status != "passed" for t in r.tests]
    for wanted in (FAILURES, ("not_implemented", "not_run")):
        for test in tests:
            if test["outcome"] in wanted:
                return test["test"].split("::")[0]
    return None


def debug_command(root: Path, test_file: str, lab: str | None) -> str:
    """How to run the failing file by hand, with the interpreter actually in use."""
    python = Path(sys.executable)
    if python.is_absolute() and python.is_relative_to(root):
        python = python.relative_to(root)
    if " " in str(python):
        return f"./run.sh check {lab}" if lab else "./run.sh check"
    return f"{python} -m pytest {test_file} -x"


def inputs_hash(root: Path) -> str:
    """What the public checks depend on that a student changes: labs/*.py and tests/public/*.py
    (and the course's copy of the labs, .course/labs, which an update changes)."""
    digest = hashlib.sha256()
    for folder, pattern in (("labs", "*.py"), ("tests/public", "*.py"), (COURSE_LABS, "*.py")):
        for path in sorted((root / folder).glob(pattern)):
            digest.update(f"{folder}/{path.name}\0".encode())
            digest.update(path.read_bytes() if path.is_file() else b"")
            digest.update(b"\0")
    return digest.hexdigest()


def save_results(root: Path, results: list[ExerciseResult], status: int) -> None:
    path = root / RESULTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"hash": inputs_hash(root), "status": status,
            "smoke": settings().smoke,
            "results": [dataclasses.asdict(r) for r in results]}
    path.write_text(json.dumps(data, indent=1))


def saved_results(root: Path) -> tuple[list[ExerciseResult], int] | None:
    """The results of the last check of all labs, if labs/ and tests/public/ are unchanged since."""
    try:
        data = json.loads((root / RESULTS_FILE).read_text())
        if data["hash"] != inputs_hash(root) or data.get("smoke") != settings().smoke:
            return None
        return [ExerciseResult(**r) for r in data["results"]], int(data["status"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
