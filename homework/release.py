"""`release DIR`: write the student edition of the course and prove it holds no solution.

The edition is the course's files (git's view: release runs from the instructor's checkout) minus
instructor-only ones, with every solution block of `labs/**/*.py` replaced by a stub and notebooks
cleared of outputs, plus the course's own copy of labs/*.py in .course/labs (homework.splice:
`check` runs the student's exercises inside it, as grading does). Exercises live in labs only: a solution marker in a notebook is refused. The
edition is built in a sibling folder, then checked without trusting the code that built it:
- no line anywhere looks like a solution marker;
- no solution line appears, unless the instructor's files show that same line outside the
  solution blocks (then it ships anyway: it is listed as a warning, and `--strict` refuses);
- every stubbed file parses and holds one NotImplementedError stub per block;
- no instructor-only file, no notebook output; run.sh, README, helpers, labs and public tests kept.
Only then does it move into DIR. Any problem: nothing is written, exit status 1, and the reason.
"""
from __future__ import annotations

import ast
import datetime
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from pathspec import GitIgnoreSpec

from homework.solutions import (Block, ExerciseError, is_marker_like, lab_number,
                                notebook_for, stub_python)
from homework.splice import COURSE_LABS
from homework.files import (RELEASE_STAMP, NotACheckout, cell_source, course_files,
                            clean_notebook, instructor_only, is_instructor_only)

REQUIRED = ("run.sh", "README.md", "helpers/", "homework/", "labs/", "tests/public/")
DISTINCTIVE_CHARS = 12   # shorter solution lines ("return out") are too common to tell anything
WARN_CHARS = 20          # a solution line shown elsewhere too is worth a warning from this long
SUBSTRING_CHARS = 24     # solution lines this long also count when found inside a longer line
STUB_CALL = "raise NotImplementedError("
INSTRUCTOR_ONLY_HINT = ".instructor-only leaves out too much"


class ReleaseError(RuntimeError):
    """The student edition could not be written safely; nothing was written."""


@dataclass
class Transformed:
    data: bytes
    blocks: list[Block] = field(default_factory=list)
    public_lines: list[str] = field(default_factory=list)  # the source's lines outside blocks
    cleared: bool = False                                   # a notebook whose outputs were cleared


@dataclass
class ReleaseReport:
    out_dir: Path
    files: list[str]
    stubbed: dict[str, list[str]]
    cleared: list[str]
    left_out: list[str]
    warnings: list[str]


def _lines_outside(text: str, blocks: list[Block]) -> list[str]:
    lines = text.splitlines()
    inside = {n for b in blocks for n in range(b.begin, b.end + 1)}
    return [line for n, line in enumerate(lines, start=1) if n not in inside]


def transform(root: Path, rel: str) -> Transformed:
    """The student-edition bytes of one course file (ExerciseError for a broken block)."""
    data = (root / rel).read_bytes()
    if rel.endswith(".ipynb"):
        return _transform_notebook(rel, data)
    if rel.startswith("labs/") and rel.endswith(".py"):
        text = data.decode("utf-8")
        stubbed = stub_python(text, rel, notebook_for(root, lab_number(rel)))
        return Transformed(stubbed.text.encode("utf-8"), stubbed.blocks,
                           _lines_outside(text, stubbed.blocks))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return Transformed(data)
    if rel.endswith(".md"):
        text = without_instructor_sections(text)
        data = text.encode("utf-8")
    return Transformed(data, [], text.splitlines())


INSTRUCTOR_SECTION = ("<!-- instructor-only -->", "<!-- /instructor-only -->")


def without_instructor_sections(text: str) -> str:
    """Markdown without the parts between INSTRUCTOR_SECTION's two comment lines (the README's
    pointers to the instructor's and maintainer's guides, which the student edition lacks)."""
    begin, end = INSTRUCTOR_SECTION
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        if line.strip() == begin:
            skipping = True
        elif line.strip() == end and skipping:
            skipping = False
        elif not skipping:
            out.append(line)
    return "".join(out)


def _transform_notebook(rel: str, data: bytes) -> Transformed:
    try:
        nb = json.loads(data)
    except ValueError as exc:
        raise ExerciseError(f"{rel}: not a readable notebook ({exc})") from None
    public = []
    for index, cell in enumerate(nb.get("cells", [])):
        text = cell_source(cell)
        for number, line in enumerate(text.splitlines(), start=1):
            if is_marker_like(line):
                raise ExerciseError(f"{rel} (cell {index}):{number}: a solution marker in a notebook; "
                                    "exercises live in labs/*.py (the notebook calls them)")
        public += text.splitlines()
    return Transformed(clean_notebook(data.decode("utf-8")).encode("utf-8"), [], public, cleared=True)


def _git_commit(root: Path) -> str:
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", "-q", "HEAD"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _distinctive(line: str) -> bool:
    return len(line) >= DISTINCTIVE_CHARS and re.search(r"[A-Za-z0-9]", line) is not None


class _Corpus:
    """Stripped lines of some files, searchable by whole line or (long lines) by substring."""

    def __init__(self, lines_by_file: dict[str, list[str]]):
        self.where: dict[str, str] = {}
        for rel, lines in lines_by_file.items():
            for number, line in enumerate(lines, start=1):
                self.where.setdefault(line.strip(), f"{rel}:{number}")
        self.text = "\n".join(self.where)

    def find(self, needle: str) -> str | None:
        if needle in self.where:
            return self.where[needle]
        if len(needle) >= SUBSTRING_CHARS and needle in self.text:
            start = self.text.rfind("\n", 0, self.text.index(needle)) + 1
            end = self.text.find("\n", start)
            return self.where[self.text[start: end if end >= 0 else None]]
        return None


def _output_lines(folder: Path, rel: str) -> list[str] | None:
    data = (folder / rel).read_bytes()
    if rel.endswith(".ipynb"):
        nb = json.loads(data)
        lines = []
        for cell in nb.get("cells", []):
            lines += cell_source(cell).splitlines()
            for output in cell.get("outputs", []):
                lines += json.dumps(output).splitlines()
        return lines
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        return None


def verify(staging: Path, written: dict[str, Transformed], patterns: GitIgnoreSpec,
           strict: bool) -> tuple[list[str], list[str]]:
    """Problems (refuse) and warnings (ship) about the edition in `staging`."""
    problems: list[str] = []
    output: dict[str, list[str]] = {}
    for rel in sorted(written):
        lines = _output_lines(staging, rel)
        if lines is None:
            continue
        output[rel] = lines
        for number, line in enumerate(lines, start=1):
            if is_marker_like(line):
                problems.append(f"{rel}:{number}: a solution marker would ship ({line.strip()!r}); "
                                "markers belong in labs/*.py and notebooks only, inside a function")
        if is_instructor_only(rel, patterns) or rel.startswith("tests/hidden/"):
            problems.append(f"{rel}: instructor-only file in the edition")
    for rel, item in written.items():
        if item.cleared:
            nb = json.loads((staging / rel).read_bytes())
            if any(c.get("outputs") or c.get("execution_count") for c in nb.get("cells", [])):
                problems.append(f"{rel}: notebook outputs remain")
        if item.blocks and rel.endswith(".py"):
            text = (staging / rel).read_text()
            try:
                ast.parse(text)
            except SyntaxError as exc:
                problems.append(f"{rel}:{exc.lineno}: the stubbed lab does not parse ({exc.msg})")
            before = sum(line.count(STUB_CALL) for line in item.public_lines)
            after = text.count(STUB_CALL)
            if after - before != len(item.blocks):
                problems.append(f"{rel}: {len(item.blocks)} solution blocks but "
                                f"{after - before} new NotImplementedError stubs")
    public = _Corpus({rel: item.public_lines for rel, item in written.items()})
    shipped = _Corpus(output)
    warnings: list[str] = []
    seen: set[str] = set()
    for rel, item in written.items():
        for block in item.blocks:
            for offset, line in enumerate(block.solution, start=1):
                solution = line.strip()
                if not _distinctive(solution) or solution in seen:
                    continue
                seen.add(solution)
                here = f"{rel}:{block.begin + offset}"
                also = public.find(solution)
                if also:  # the instructor shows this line outside the blocks too
                    if len(solution) >= WARN_CHARS:
                        warnings.append(f"solution line {here} {solution!r} also appears outside the "
                                        f"solution blocks, at {also}, so it ships")
                    continue
                leak = shipped.find(solution)
                if leak:
                    problems.append(f"solution line {here} {solution!r} would ship in {leak}")
    if strict:
        problems += [f"(--strict) {w}" for w in warnings]
    return problems, warnings


COURSE_LABS_README = """\
The course's own copy of every lab (labs/), as this edition handed it out. `./run.sh check`, like
the grader, runs the tests on these files with your exercises, and the helpers you add, spliced in
(homework/splice.py): the rest of labs/*.py (the instruments, references and runners around the
exercises) is the course's, whatever your copy says. Editing these files changes nothing but your
own checks.
"""


def write_course_labs(edition: Path, files: dict[str, bytes]) -> None:
    """The course's own copy of labs/*.py in the edition (COURSE_LABS), which `check` splices the
    student's exercises into."""
    folder = edition / COURSE_LABS
    folder.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        if rel.startswith("labs/") and rel.endswith(".py") and rel.count("/") == 1:
            (folder / rel.split("/", 1)[1]).write_bytes(data)
    (folder.parent / "README.md").write_text(COURSE_LABS_README)


def _check_target(root: Path, out_dir: Path, force: bool) -> None:
    if out_dir == root or root.is_relative_to(out_dir):
        raise ReleaseError(f"{out_dir} would contain the course itself; pick another folder")
    if out_dir.exists() and not out_dir.is_dir():
        raise ReleaseError(f"{out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not (out_dir / RELEASE_STAMP).is_file():
            raise ReleaseError(f"{out_dir} exists and is not empty (and is not an earlier student "
                               "edition); pick a new folder")
        if not force:
            raise ReleaseError(f"{out_dir} holds an earlier student edition; pass --force to "
                               "replace it")


def release(root: Path, out_dir: Path, force: bool = False, strict: bool = False,
            log=print) -> ReleaseReport:
    root, out_dir = root.resolve(), out_dir.resolve()
    _check_target(root, out_dir, force)
    try:
        files = course_files(root)
    except NotACheckout as exc:
        raise ReleaseError(str(exc)) from None
    if out_dir.is_relative_to(root):  # the target inside the course is not part of it
        inside = out_dir.relative_to(root).as_posix() + "/"
        files = [rel for rel in files if not rel.startswith(inside)]
    patterns = instructor_only(root)
    shipped = [rel for rel in files if not is_instructor_only(rel, patterns)]
    left_out = [rel for rel in files if is_instructor_only(rel, patterns)]
    for required in REQUIRED:
        present = [rel for rel in files if rel == required or rel.startswith(required)]
        if present and not any(rel in shipped for rel in present):
            raise ReleaseError(f"{INSTRUCTOR_ONLY_HINT}: {required} must ship to students")

    written: dict[str, Transformed] = {}
    errors = []
    for rel in shipped:
        try:
            written[rel] = transform(root, rel)
        except (ExerciseError, UnicodeDecodeError) as exc:
            errors.append(str(exc))
    if errors:
        raise ReleaseError("cannot stub the solutions:\n  " + "\n  ".join(errors))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    try:
        for rel, item in written.items():
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(item.data)
            shutil.copymode(root / rel, target)  # run.sh stays executable
        write_course_labs(staging, {rel: item.data for rel, item in written.items()})
        commit = _git_commit(root)
        stamp = (f"Student edition written by `./run.sh release` on "
                 f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
                 f"{' from commit ' + commit[:12] if commit else ''}.\n"
                 "Do your homework in labs/; check it with ./run.sh check, hand it in with "
                 "./run.sh submit.\n")
        (staging / RELEASE_STAMP).write_text(stamp)
        problems, warnings = verify(staging, written, patterns, strict)
        if problems:
            raise ReleaseError("refusing to write the student edition:\n  "
                               + "\n  ".join(problems[:30])
                               + (f"\n  ... and {len(problems) - 30} more" if len(problems) > 30 else ""))
        if out_dir.exists():  # empty, or an earlier edition with --force (checked above)
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)

    stubbed = {rel: [b.exercise for b in item.blocks] for rel, item in written.items() if item.blocks}
    report = ReleaseReport(out_dir, sorted(written), stubbed,
                           sorted(rel for rel, item in written.items() if item.cleared),
                           left_out, warnings)
    _print_summary(report, log)
    return report


def _print_summary(report: ReleaseReport, log) -> None:
    total = sum(len(v) for v in report.stubbed.values())
    log(f"Student edition written to {report.out_dir}: {len(report.files)} files, "
        f"{total} exercise block(s) stubbed.")
    for rel, names in sorted(report.stubbed.items()):
        unique = list(dict.fromkeys(names))
        log(f"  {rel}: {len(names)} block(s): {', '.join(unique)}")
    if report.cleared:
        log(f"  notebooks cleared of outputs: {len(report.cleared)}")
    if report.left_out:
        shown = ", ".join(report.left_out[:8])
        more = f" and {len(report.left_out) - 8} more" if len(report.left_out) > 8 else ""
        log(f"  left out (instructor only): {len(report.left_out)} file(s): {shown}{more}")
    for warning in report.warnings[:10]:
        log(f"  warning: {warning}")
    if len(report.warnings) > 10:
        log(f"  warning: ... and {len(report.warnings) - 10} more such lines")
