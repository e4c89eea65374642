"""`grade ARCHIVE... --out DIR`: score submissions with the public and hidden tests.

Once per grading run, under a lock on DIR: build the grading tree in DIR/.work-PID (mode 0700,
removed at the end) from the instructor's files (helpers, tests with the hidden ones, conftest,
pytest.ini, the labs as the student edition has them), plant canary tests with names drawn for
this run among the graded tests, and collect the tests from that tree (instructor code only: the
collection is trusted: test ids, exercises, points, docstrings).

Then for each archive, in the order given: validate it (homework.archive; a rejected one
scores 0 with the reason), splice its exercises into the course's own labs in a folder of its own
(homework.splice: the student owns only the exercises; whatever else of the submitted files
differs is listed in the feedback and never runs), and run every graded test in SHARDS pytest
processes, each inside a fresh sandbox (homework.sandbox: the tree and the labs read-only,
nothing else of this machine, limits, a time budget). What decides the score is computed out
here, from what the submission cannot change:

- the code the tests run around the exercises, and the tests themselves, are the course's;
- the tests, their points and their order come from the trusted collection;
- a test scores only when its setup, call and teardown were all reported passed, in order, once;
- a report stream that no pytest would write (a report twice, out of order, unreadable) and a
  canary that must fail reported passed mean the results were forged: the score is withheld (0)
  and the row flagged; a canary that must pass and failed is flagged too;
- feedback shows for each test its name, points, a result word from a fixed list, and what the
  test checks (the first line of its docstring, from the trusted collection): never text that the
  submission produced, so never a hidden test's source.

Writes DIR/grades.csv (submission, score, max_score, one column per test, note, flags),
DIR/<submission>.md (feedback) and DIR/logs/<submission>.log (raw pytest output, which can quote
hidden tests: for the instructor only; DIR may not be a folder that `release` would ship).
"""
from __future__ import annotations

import ast
import concurrent.futures
import csv
import datetime
import fcntl
import json
import os
import random
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from homework import archive
from homework.files import GRADING_STAMP, RELEASE_STAMP, course_files
from homework.release import transform, write_course_labs
from homework.runner import (DEFAULT_TIMEOUT_S, Direct, Outcome, RunResult, TestInfo, child_env,
                             collect, run_tests)
from homework.sandbox import Limits, Sandbox, SandboxUnavailable, probe
from homework.splice import splice_folder

DEFAULT_BUDGET_S = 1800.0   # one submission, all its tests, restarts included
RANKS_PER_SUBMISSION = 4    # processes one submission keeps busy: its largest test launch's ranks
SHARDS = 2                  # pytest runs at once per submission (each in a sandbox of its own)
LOCK_NAME = ".grade.lock"
WORK_PREFIX = ".work-"
RESULT_TEXT = {
    "passed": "passed",
    "failed": "failed: an assertion did not hold",
    "error": "failed: the code raised an error",
    "not_implemented": "not implemented (the exercise is still its stub)",
    "timeout": "timed out",
    "crashed": "crashed: the test process died",
    "load_error": "could not load the test file with this code",
    "skipped": "skipped",
    "not_run": "not run",
}
UNSAFE_TEXT = ("graded WITHOUT a sandbox (--unsafe): the submissions' code ran with your rights, "
               "could read and change your files (this checkout, --out, the hidden tests) and other "
               "submissions' results, reach the network and leave processes behind; only the "
               "per-test time limit, the report checks and the canaries applied")


class GradingError(RuntimeError):
    """The instructor's side cannot grade (bad --out, no sandbox, tests that do not collect)."""


@dataclass
class Graded:
    submission: str
    archive: Path
    score: float = 0.0
    max_score: float = 0.0
    points: dict[str, float] = field(default_factory=dict)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    note: str = ""
    flags: list[str] = field(default_factory=list)
    student: str = ""
    not_run: list[str] = field(default_factory=list)  # what of the submitted labs did not run (splice)
    started: float = 0.0      # time.monotonic() when its grading began
    seconds: float = 0.0
    graded: bool = True       # False: rejected or failed on our side (grade exits non-zero)


# ---------------------------------------------------------------------------- the grading tree
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
    """The instructor's course minus solutions (every lab as the student edition has it), readable
    by the sandbox's user."""
    labs = {}
    for rel in course_files(root):
        if Path(rel).name in (RELEASE_STAMP, GRADING_STAMP):
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if rel.startswith("labs/") and rel.endswith(".py"):
            labs[rel] = transform(root, rel).data
            target.write_bytes(labs[rel])
        else:
            shutil.copyfile(root / rel, target)
        target.chmod(0o755 if os.access(root / rel, os.X_OK) else 0o644)
    write_course_labs(dest, labs)  # as in the student edition (the tests' exercise watch reads it)
    for folder, dirs, _ in os.walk(dest):
        os.chmod(folder, 0o755)


# ---------------------------------------------------------------------------- canaries
WORDS = ("result", "shape", "value", "order", "sum", "mean", "rank", "step", "total", "chunk",
         "bucket", "buffer", "scale", "grad", "state", "layout", "split", "merge", "copy", "count")
VERBS = ("matches", "keeps", "holds", "stays", "gives", "checks", "agrees", "survives")


@dataclass
class Canary:
    nodeid: str
    must_pass: bool


def _canary_source(name: str, must_pass: bool, rng: random.Random) -> str:
    values = [rng.randint(2, 99) for _ in range(rng.randint(3, 6))]
    total = sum(values) + (0 if must_pass else rng.randint(1, 9))
    doc = f"The {rng.choice(WORDS)} {rng.choice(VERBS)} the reference {rng.choice(WORDS)}."
    return (f"def {name}():\n    \"\"\"{doc}\"\"\"\n    values = {values}\n"
            f"    assert sum(values) == {total}, \"the {rng.choice(WORDS)} differs\"\n\n\n")


def plant_canaries(tree: Path, files: list[str], rng: random.Random) -> list[Canary]:
    """Two tests per graded file, named at random for this run and placed among its top-level
    tests: one must fail, one must pass. A forged "everything passed" flips the first."""
    canaries: list[Canary] = []
    for rel in files:
        path = tree / rel
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        try:
            module = ast.parse(text)
        except SyntaxError:
            continue
        starts = [min([n.lineno] + [d.lineno for d in n.decorator_list]) for n in module.body
                  if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")]
        spots = starts or [len(lines) + 1]
        inserts: dict[int, str] = {}
        for must_pass in (False, True):
            name = f"test_{rng.choice(WORDS)}_{rng.choice(VERBS)}_{rng.choice(WORDS)}_{rng.randrange(16**4):04x}"
            spot = rng.choice(spots)
            inserts[spot] = inserts.get(spot, "") + _canary_source(name, must_pass, rng)
            canaries.append(Canary(f"{rel}::{name}", must_pass))
        out = []
        for number, line in enumerate(lines + [""], start=1):
            out.append(inserts.get(number, ""))
            out.append(line)
        if lines and not lines[-1].endswith("\n"):
            out.insert(len(out) - 1, "\n")
        path.write_text("".join(out), encoding="utf-8")
    return canaries


# ---------------------------------------------------------------------------- the --out folder
def check_out_dir(root: Path, out_dir: Path) -> None:
    """Refuse an --out that `release` would ship (inside the course and not ignored by git)."""
    if out_dir == root or root.is_relative_to(out_dir):
        raise GradingError(f"--out {out_dir} would contain the course itself; pick another folder")
    if not out_dir.is_relative_to(root):
        return
    rel = out_dir.relative_to(root).as_posix() + "/"
    try:
        done = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", "--", rel],
                              capture_output=True, timeout=30)
        ignored = done.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ignored = False
    if not ignored:
        raise GradingError(f"--out {rel} is inside the course and git does not ignore it, so the "
                           "next `release` would ship grades and logs that quote hidden tests; use "
                           "a folder outside the repository, or one that .gitignore lists (grades/)")


class OutLock:
    """An exclusive lock on DIR/.grade.lock: a second grader on the same --out is refused."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / LOCK_NAME
        self.handle = None

    def __enter__(self) -> "OutLock":
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            raise GradingError(f"another grade is writing to {self.path.parent}"
                               f"{f' (pid {holder})' if holder else ''}; wait for it to finish or "
                               "give another --out") from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self.handle = handle
        return self

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            self.handle.close()  # releases the lock


# ---------------------------------------------------------------------------- output files
def submission_name(path: Path, taken: set[str]) -> str:
    name = _stem(path)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "submission"
    unique, n = name, 2
    while unique in taken:
        unique, n = f"{name}-{n}", n + 1
    taken.add(unique)
    return unique


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".tar.gz", ".tgz", ".gz", ".tar"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


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
    if graded.flags:
        lines += [f"Flags: {_cell('; '.join(graded.flags))}", ""]
    if graded.not_run:
        lines += ["The tests ran the course's own copy of each lab with your exercises (and the helpers "
                  "you added) in it. Not run from your files:", ""]
        lines += [f"- {_cell(text)}" for text in graded.not_run] + [""]
    if graded.outcomes:
        lines += ["| test | exercise | points | result | what it checks |", "|---|---|---|---|---|"]
        for test in tests:
            outcome = graded.outcomes.get(test.nodeid)
            result = RESULT_TEXT.get(outcome.outcome, "not run") if outcome else "not run"
            lines.append(f"| {_cell(_test_label(test.nodeid))} | {_cell(test.exercise or '')} | "
                         f"{_fmt(graded.points.get(test.nodeid, 0))}/{_fmt(test.points)} | {result} | "
                         f"{_cell(test.doc)} |")
        lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_csv(path: Path, rows: list[Graded], tests: list[TestInfo]) -> None:
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["submission", "score", "max_score", *[t.nodeid for t in tests], "note", "flags"])
        for row in rows:
            writer.writerow([row.submission, _fmt(row.score), _fmt(row.max_score),
                             *[_fmt(row.points.get(t.nodeid, 0)) for t in tests], row.note,
                             "; ".join(row.flags)])
    tmp.replace(path)


def _manifest(folder: Path) -> dict | None:
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _manifest_flags(archive_path: Path, manifest: dict | None) -> tuple[str, list[str]]:
    """The student id from the manifest, and a flag when it does not match the file name."""
    from homework.submit import safe_name

    if manifest is None:
        return "", ["no readable manifest.json"]
    student = str(manifest.get("student", ""))[:200]
    expected = safe_name(student)
    stem = _stem(archive_path)
    if not student or not (stem == expected or stem.startswith(expected + "-")):
        return student, [f"the manifest's student id {student[:60]!r} does not match the file name"]
    return student, []


# ---------------------------------------------------------------------------- grading
def default_jobs(cores: int | None = None) -> int:
    """Submissions graded at once: one per RANKS_PER_SUBMISSION cores (a submission's tests run one
    at a time, and one of them keeps at most that many processes busy), at least one."""
    return max(1, (cores or os.cpu_count() or 1) // RANKS_PER_SUBMISSION)


def grade(archives: list[Path], out_dir: Path, root: Path, timeout: float = DEFAULT_TIMEOUT_S,
          labs: list[str] | None = None, grace: float | None = None,
          budget: float = DEFAULT_BUDGET_S, unsafe: bool = False, limits: Limits = Limits(),
          seed: int | None = None, jobs: int | None = None, shards: int | None = None,
          log=print) -> list[Graded]:
    root, out_dir = Path(root).resolve(), Path(out_dir).resolve()
    check_out_dir(root, out_dir)
    files = graded_test_files(root, labs)
    if not files:
        raise GradingError("no tests to grade with (tests/public|hidden/test_labNN_*.py)")
    if not unsafe:
        try:
            probe(limits)
        except SandboxUnavailable as exc:
            raise GradingError(f"{exc}.\nGrading runs each submission in a sandbox and refuses to "
                               "go on without one. `--unsafe` grades without it (on a throwaway "
                               "machine only): then the submissions' code runs with your rights "
                               "and can change your files, other results and the network.") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    with OutLock(out_dir):
        (out_dir / "logs").mkdir(exist_ok=True)
        (out_dir / GRADING_STAMP).write_text("Grades and feedback; never part of a student edition.\n")
        for stale in out_dir.glob(f"{WORK_PREFIX}*"):  # left by a grader that was killed
            shutil.rmtree(stale, ignore_errors=True)
        work = out_dir / f"{WORK_PREFIX}{os.getpid()}"
        work.mkdir(mode=0o700)
        try:
            return _grade_all(archives, out_dir, root, work, files, timeout, grace, budget, unsafe,
                              limits, random.Random(seed), jobs or default_jobs(),
                              shards or SHARDS, log)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _grade_all(archives, out_dir, root, work, files, timeout, grace, budget, unsafe, limits, rng,
               jobs, shards, log) -> list[Graded]:
    base = work / "base"
    build_base_tree(root, base)
    canaries = plant_canaries(base, files, rng)
    collected, errors = collect(Direct(base, child_env(base, {"TMPDIR": str(work)})), files)
    if errors:
        raise GradingError("the tests do not collect on the student edition:\n  " + "\n  ".join(errors))
    canary_ids = {c.nodeid for c in canaries}
    tests = [t for t in collected if t.nodeid not in canary_ids]
    missing = canary_ids - {t.nodeid for t in collected}
    if missing:
        raise GradingError(f"canary tests were not collected: {sorted(missing)}")
    max_score = sum(t.points for t in tests)
    jobs = max(1, min(jobs, len(archives)))
    log(f"Grading {len(archives)} submission(s) with {len(tests)} tests from {len(files)} file(s), "
        f"{_fmt(max_score)} points, at most {timeout:g} s per test and {budget:g} s per submission, "
        f"{jobs} at a time, each in {shards} pytest runs at once"
        + (f"; {UNSAFE_TEXT}" if unsafe else ", each run in a sandbox of its own."))
    taken: set[str] = set()
    rows = [Graded(submission_name(Path(path), taken), Path(path), max_score=max_score)
            for path in archives]
    done: set[int] = set()  # id() of the rows graded so far
    lock = threading.Lock()

    def one(number: int, graded: Graded) -> None:
        start = graded.started = time.monotonic()
        sub = work / f"sub{number}"
        try:
            _grade_one(graded, sub, base, files, collected, tests, canaries, timeout, grace,
                       start + budget, unsafe, limits, out_dir / "logs" / f"{graded.submission}.log",
                       shards)
        except archive.ArchiveRejected as exc:
            graded.note, graded.graded = f"rejected: {exc}", False
        except Exception as exc:  # our side failed on this one: say so, go on with the others
            graded.score, graded.points, graded.graded = 0.0, {}, False
            graded.note = f"grading failed: {type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(sub, ignore_errors=True)
        if unsafe:
            graded.flags.append("graded without a sandbox (--unsafe)")
        graded.seconds = time.monotonic() - start
        write_feedback(out_dir / f"{graded.submission}.md", graded, tests)
        with lock:  # grades.csv after each one, in the order given: a crash loses nothing
            done.add(id(graded))
            write_csv(out_dir / "grades.csv", [row for row in rows if id(row) in done], tests)
            log(f"[{len(done)}/{len(rows)}] {graded.submission}: {_fmt(graded.score)}/{_fmt(max_score)}"
                + (f" ({graded.note})" if graded.note else "")
                + (f" [flags: {'; '.join(graded.flags)}]" if graded.flags else "")
                + f" in {graded.seconds:.0f} s")

    with concurrent.futures.ThreadPoolExecutor(jobs, thread_name_prefix="grade") as pool:
        for future in [pool.submit(one, number, graded) for number, graded in enumerate(rows, 1)]:
            future.result()
    log(f"Wrote {out_dir / 'grades.csv'} and one feedback file per submission in {out_dir}.")
    return rows


def shard_files(files: list[str], shards: int) -> list[list[str]]:
    """`files` dealt out to `shards` groups in turn (a lab's public and hidden files, adjacent in
    `files`, land in different groups); no empty group."""
    groups = [files[i::shards] for i in range(max(1, shards))]
    return [group for group in groups if group]


def run_shards(executor, files: list[str], collected: list[TestInfo], shards: int, *,
               timeout: float, grace: float | None, deadline: float, log_path: Path) -> RunResult:
    """The tests of `files` in `shards` pytest runs at once, each started by `executor()` (a
    sandbox of its own), merged into one RunResult. A submission's launches wait on one another
    (rendezvous, gloo's connections) as much as they compute, so a few at once fill the cores."""
    groups = shard_files(files, shards)
    logs = [log_path.with_name(f"{log_path.name}.{i}") for i in range(len(groups))]

    def one(group: list[str], log: Path) -> RunResult:
        expected = [t for t in collected if t.file in group]
        return run_tests(executor(), group, expected, timeout=timeout, grace=grace,
                         deadline=deadline, log_path=log)

    with concurrent.futures.ThreadPoolExecutor(len(groups), thread_name_prefix="shard") as pool:
        runs = list(pool.map(one, groups, logs))
    merged = RunResult(list(collected), {})
    with open(log_path, "a", encoding="utf-8") as out:
        for group, log, run in zip(groups, logs, runs):
            merged.outcomes.update(run.outcomes)
            merged.tampering += run.tampering
            merged.notes += [note for note in run.notes if note not in merged.notes]
            merged.processes += run.processes
            if log.is_file():
                out.write(f"=== shard: {' '.join(group)}\n{log.read_text(encoding='utf-8', errors='replace')}")
                log.unlink()
    return merged


def _grade_one(graded: Graded, sub: Path, base: Path, files: list[str], collected: list[TestInfo],
               tests: list[TestInfo], canaries: list[Canary], timeout: float, grace: float | None,
               deadline: float, unsafe: bool, limits: Limits, log_path: Path, shards: int) -> None:
    unpacked, labs = sub / "unpacked", sub / "labs"
    unpacked.mkdir(parents=True)
    written = archive.extract(graded.archive, unpacked)
    graded.student, graded.flags = _manifest_flags(graded.archive, _manifest(unpacked))
    submitted = {name: (unpacked / name).read_bytes() for name in written
                 if name.startswith("labs/") and name.endswith(".py")}
    # the course's own labs with the submission's exercises (and its own helpers) spliced in:
    # nothing else of the submitted files runs (homework.splice)
    splices, graded.not_run = splice_folder(base / "labs", submitted, labs)
    graded.flags += [text for spliced in splices.values() for text in spliced.review]
    for path in [labs, *labs.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    if not submitted:
        graded.note = "no labs/*.py in the submission: graded the stubs"
    elif graded.not_run:
        graded.note = (f"{len(graded.not_run)} part(s) of the submitted labs not run (the course's "
                       "own code ran instead): see the feedback")
    log_path.write_text(f"submission {graded.archive}\nlabs submitted: {', '.join(sorted(submitted))}\n"
                        + "".join(f"not run: {text}\n" for text in graded.not_run) + "\n")
    if unsafe:
        tree = sub / "tree"
        shutil.copytree(base, tree)
        shutil.rmtree(tree / "labs")
        shutil.copytree(labs, tree / "labs")
        executor = lambda: Direct(tree, child_env(tree, {"TMPDIR": str(sub)}))  # noqa: E731
    else:
        executor = lambda: Sandbox(base, labs, limits)  # noqa: E731  a fresh sandbox per shard
    run = run_shards(executor, files, collected, shards, timeout=timeout, grace=grace,
                     deadline=deadline, log_path=log_path)
    graded.outcomes = {t.nodeid: run.outcomes[t.nodeid] for t in tests if t.nodeid in run.outcomes}
    graded.flags += run.notes
    forged = [f"the report stream was tampered with ({run.tampering[0]}"
              + (f", and {len(run.tampering) - 1} more" if len(run.tampering) > 1 else "") + ")"
              ] if run.tampering else []
    for canary in canaries:
        outcome = run.outcomes.get(canary.nodeid)
        if outcome is None or outcome.outcome in ("not_run", "crashed", "load_error", "timeout"):
            continue
        if not canary.must_pass and outcome.passed:
            forged.append(f"canary {canary.nodeid.split('::')[-1]} (must fail) reported passed")
        elif canary.must_pass and not outcome.passed and outcome.outcome != "skipped":
            graded.flags.append(f"canary {canary.nodeid.split('::')[-1]} (must pass) reported "
                                f"{outcome.outcome}: the submission interfered with the test process")
    if forged:
        graded.flags = [f"FORGED: {text}" for text in forged] + graded.flags
        graded.note = "score withheld: the test results were forged (see flags and the log)"
    for test in tests:
        outcome = graded.outcomes.get(test.nodeid)
        graded.points[test.nodeid] = test.points if outcome and outcome.passed and not forged else 0.0
    graded.score = sum(graded.points.values())
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"canaries: {', '.join(c.nodeid + (' (must pass)' if c.must_pass else ' (must fail)') for c in canaries)}\n"
                  f"tampering: {run.tampering}\nflags: {graded.flags}\n")
