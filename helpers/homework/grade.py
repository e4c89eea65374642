"""`grade ARCHIVE... --out DIR`: score submissions with the public and hidden tests.

For each archive, in the order given: validate it (helpers.homework.archive; a rejected one
scores 0 with the reason), build a grading tree in a temporary folder from the instructor's
trusted files (helpers, tests with the hidden ones, pytest.ini, ...) whose labs are the student
edition's stubs, overlay the submission's labs/*.py only, and run the tests there with
helpers.homework.runner (each test bounded in time, its process tree killed, output capped).
Then on to the next archive, whatever this one did.

Writes DIR/grades.csv (one row per archive: submission, score, max_score, one column per test
with the points earned, and a last column `note`), DIR/<submission>.md (feedback for the student:
per test its points, result and one-line message, never a traceback, so never hidden source)
and DIR/logs/<submission>.log (raw pytest output, for the instructor only).
"""
from __future__ import annotations

import csv
import datetime
import json
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers.homework import archive
from helpers.homework.files import GRADING_STAMP, RELEASE_STAMP, course_files
from helpers.homework.release import transform
from helpers.homework.runner import DEFAULT_TIMEOUT_S, Outcome, TestInfo, child_env, collect, run_tests

RESULT_TEXT = {"passed": "passed", "failed": "failed", "not_implemented": "not implemented",
               "skipped": "skipped", "timeout": "timed out", "crashed": "crashed",
               "not_run": "not run"}


class GradingError(RuntimeError):
    """The instructor's side is broken (tests do not collect, a lab cannot be stubbed)."""


@dataclass
class Graded:
    submission: str
    archive: Path
    score: float = 0.0
    max_score: float = 0.0
    points: dict[str, float] = field(default_factory=dict)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    note: str = ""
    student: str = ""
    seconds: float = 0.0


def graded_test_files(root: Path, labs: list[str] | None = None) -> list[str]:
    files = []
    for kind in ("public", "hidden"):
        for path in sorted((root / "tests" / kind).glob("test_lab*.py")):
            match = re.match(r"test_lab(\d+)_", path.name)
            if labs and (not match or match.group(1) not in labs):
                continue
            files.append(path.relative_to(root).as_posix())
    return sorted(files, key=lambda f: (re.sub(r"^tests/\w+/", "", f), "hidden" in f))


def build_base_tree(root: Path, dest: Path) -> None:
    """The instructor's course minus solutions: every lab as the student edition has it."""
    for rel in course_files(root):
        if Path(rel).name == RELEASE_STAMP:
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if rel.startswith("labs/") and rel.endswith(".py"):
            target.write_bytes(transform(root, rel).data)
        else:
            shutil.copyfile(root / rel, target)
        shutil.copymode(root / rel, target)


def submission_name(path: Path, taken: set[str]) -> str:
    name = path.name
    for suffix in (".tar.gz", ".tgz", ".gz", ".tar"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "submission"
    unique, n = name, 2
    while unique in taken:
        unique, n = f"{name}-{n}", n + 1
    taken.add(unique)
    return unique


def _fmt(points: float) -> str:
    return f"{points:g}"


def _cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")


def _test_label(nodeid: str) -> str:
    kind = "hidden" if nodeid.startswith("tests/hidden/") else "public"
    return f"{kind}: {nodeid.split('::', 1)[-1]}"


def write_feedback(path: Path, graded: Graded, tests: list[TestInfo]) -> None:
    lines = [f"# Feedback: {graded.submission}", ""]
    if graded.student:
        lines.append(f"Student (from the manifest): {_cell(graded.student)}  ")
    lines.append(f"Graded {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  ")
    lines += [f"**Score: {_fmt(graded.score)} / {_fmt(graded.max_score)}**", ""]
    if graded.note:
        lines += [f"Note: {_cell(graded.note)}", ""]
    if graded.outcomes:
        lines += ["| test | exercise | points | result | message |", "|---|---|---|---|---|"]
        for test in tests:
            outcome = graded.outcomes.get(test.nodeid)
            result = RESULT_TEXT.get(outcome.outcome, outcome.outcome) if outcome else "not run"
            message = "" if outcome is None or outcome.passed else outcome.message
            lines.append(f"| {_cell(_test_label(test.nodeid))} | {_cell(test.exercise or '')} | "
                         f"{_fmt(graded.points.get(test.nodeid, 0))}/{_fmt(test.points)} | {result} | "
                         f"{_cell(message)} |")
        lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_csv(path: Path, rows: list[Graded], tests: list[TestInfo]) -> None:
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["submission", "score", "max_score", *[t.nodeid for t in tests], "note"])
        for row in rows:
            writer.writerow([row.submission, _fmt(row.score), _fmt(row.max_score),
                             *[_fmt(row.points.get(t.nodeid, 0)) for t in tests], row.note])
    tmp.replace(path)


def _student(folder: Path) -> str:
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        return str(manifest.get("student", ""))[:200]
    except (OSError, ValueError, AttributeError):
        return ""


def grade(archives: list[Path], out_dir: Path, root: Path, timeout: float = DEFAULT_TIMEOUT_S,
          labs: list[str] | None = None, grace: float | None = None, log=print) -> list[Graded]:
    root, out_dir = root.resolve(), out_dir.resolve()
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    # grades name hidden tests: a release must never pick this folder up, even inside the course
    (out_dir / GRADING_STAMP).write_text("Grades and feedback; never part of a student edition.\n")
    files = graded_test_files(root, labs)
    if not files:
        raise GradingError("no tests to grade with (tests/public|hidden/test_labNN_*.py)")
    work = Path(tempfile.mkdtemp(prefix="course-grade-"))
    try:
        base = work / "base"
        build_base_tree(root, base)
        tests, errors = collect(base, files, child_env(base, {"TMPDIR": str(work)}))
        if errors:
            raise GradingError("the tests do not collect on the student edition:\n  "
                               + "\n  ".join(errors))
        max_score = sum(t.points for t in tests)
        expected: dict[str, list[str]] = {f: [t.nodeid for t in tests if t.file == f] for f in files}
        files = [f for f in files if expected[f]]
        log(f"Grading {len(archives)} submission(s) with {len(tests)} tests from {len(files)} "
            f"file(s), {_fmt(max_score)} points, at most {timeout:g} s per test.")
        rows: list[Graded] = []
        taken: set[str] = set()
        for number, path in enumerate(archives, start=1):
            graded = Graded(submission_name(Path(path), taken), Path(path), max_score=max_score)
            start = time.monotonic()
            sub = work / f"sub{number}"
            try:
                _grade_one(graded, sub, base, files, expected, tests, timeout, grace,
                           out_dir / "logs" / f"{graded.submission}.log")
            except archive.ArchiveRejected as exc:
                graded.note = f"rejected: {exc}"
            except Exception as exc:  # our side failed on this one: say so, go on to the next
                graded.score, graded.points = 0.0, {}
                graded.note = f"grading failed: {type(exc).__name__}: {exc}"
            finally:
                shutil.rmtree(sub, ignore_errors=True)
            graded.seconds = time.monotonic() - start
            rows.append(graded)
            write_feedback(out_dir / f"{graded.submission}.md", graded, tests)
            write_csv(out_dir / "grades.csv", rows, tests)  # after each one: a crash loses nothing
            log(f"[{number}/{len(archives)}] {graded.submission}: {_fmt(graded.score)}/"
                f"{_fmt(max_score)}" + (f" ({graded.note})" if graded.note else "")
                + f" in {graded.seconds:.0f} s")
        log(f"Wrote {out_dir / 'grades.csv'} and one feedback file per submission in {out_dir}.")
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _grade_one(graded: Graded, sub: Path, base: Path, files: list[str],
               expected: dict[str, list[str]], tests: list[TestInfo], timeout: float,
               grace: float | None, log_path: Path) -> None:
    unpacked, tree, tmp = sub / "unpacked", sub / "tree", sub / "tmp"
    unpacked.mkdir(parents=True)
    written = archive.extract(graded.archive, unpacked)
    graded.student = _student(unpacked)
    shutil.copytree(base, tree, symlinks=False)
    tmp.mkdir()
    overlaid = [name for name in written if name.startswith("labs/") and name.endswith(".py")]
    for name in overlaid:
        shutil.copyfile(unpacked / name, tree / name)
    if not overlaid:
        graded.note = "no labs/*.py in the submission: graded the stubs"
    log_path.write_text(f"submission {graded.archive}\nlabs overlaid: {', '.join(overlaid)}\n\n")
    _, graded.outcomes = run_tests(tree, files, expected, timeout=timeout, grace=grace,
                                   env=child_env(tree, {"TMPDIR": str(tmp)}), log_path=log_path)
    for test in tests:
        outcome = graded.outcomes.get(test.nodeid)
        graded.points[test.nodeid] = test.points if outcome and outcome.passed else 0.0
    graded.score = sum(graded.points.values())
