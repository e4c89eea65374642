"""The student journey, run on the edition an instructor hands out (instructor only).

`./run.sh release` writes the student edition into a temporary folder; then, as a student would:
- every notebook runs top to bottom under nbmake with every exercise unsolved, and each notebook
  that has an exercise shows the notice (exercise, file, `./run.sh check NN`) where its result
  would be;
- `./run.sh check` reports every exercise "not implemented yet" and exits non-zero;
- with the instructor's labs/*.py copied in, `./run.sh check` passes;
- `./run.sh submit` packs both states; `./run.sh grade` (the instructor's checkout, hidden tests
  included, in the grading sandbox) gives the stub archive 0 and the solved archive full marks, on
  GRADED_LABS: one lab of processes and one of ranks, so the sandbox runs both kinds of test.

This is also where the public exercise tests run in `./run.sh test`: through `check`, as students
run them (so they are not collected a second time). The hidden tests of every lab run directly in
`./run.sh test` on the instructor's solutions; grading all labs here would run the public tests a
second time for no new fact about the course (minutes of CI).
"""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.notice import EDITION_STAMP, NOTICE_CLASS, stub_messages
from tests.harness import notebook_launches

REPO_ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.name for p in (REPO_ROOT / "notebooks").glob("*.ipynb"))
STUB = re.compile(r"Exercise (\S+) \(notebook (\d+)_[^)]*\)")
NOTICE_NAME = re.compile(r"Exercise (\S+) is not done yet")
GRADED_LABS = ("01", "04")  # lab 01: worker processes; lab 04: torchrun ranks


def _env(edition: Path, **extra: str) -> dict[str, str]:
    """The environment of a student working in `edition`: nothing of the instructor's checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    env.update(PYTHONPATH=str(edition), COURSE_PYTHON=sys.executable, COURSE_SMOKE="1",
               MPLBACKEND="Agg", **extra)
    return env


@pytest.fixture(scope="session")
def edition(tmp_path_factory) -> Path:
    """The student edition, released once per test process."""
    dest = tmp_path_factory.mktemp("student-edition") / "course"
    done = subprocess.run([sys.executable, "-m", "homework", "release", str(dest)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env=_env(REPO_ROOT))
    assert done.returncode == 0, f"release failed:\n{done.stdout}\n{done.stderr}"
    assert (dest / EDITION_STAMP).is_file()
    return dest


def exercises_by_notebook(edition: Path) -> dict[str, set[str]]:
    """{"04": {"ring_all_reduce"}, ...} from the stubs in the edition's labs."""
    found: dict[str, set[str]] = {}
    for lab in (edition / "labs").glob("lab*.py"):
        for message in stub_messages(lab.read_text()):
            match = STUB.match(message)
            if match:
                found.setdefault(match.group(2), set()).add(match.group(1))
    return found


def notices(nb: dict) -> list[str]:
    """The exercise named by each notice the executed notebook shows."""
    names = []
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            html = output.get("data", {}).get("text/html", "")
            html = "".join(html) if isinstance(html, list) else html
            if NOTICE_CLASS in html:
                match = NOTICE_NAME.search(html)
                names.append(match.group(1) if match else "?")
    return names


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xdist_group(f"student-{n}"))
                                  for n in NOTEBOOKS])
def test_student_notebook_runs_through_with_notices(edition, name, monkeypatch):
    from nbmake.nb_run import NotebookRun

    for key, value in _env(edition).items():
        monkeypatch.setenv(key, value)
    with notebook_launches(name):
        result = NotebookRun(edition / "notebooks" / name, default_timeout=600).execute()
    assert result.error is None, (
        f"{name} stops in the student edition at cell {result.error.failing_cell_index}: "
        f"{result.error.summary}\n{result.error.trace[-3000:]}")
    shown = notices(result.nb)
    all_exercises = set().union(*exercises_by_notebook(edition).values())
    mine = exercises_by_notebook(edition).get(name[:2], set())
    unknown = [n for n in shown if n.split(".")[0] not in {e.split(".")[0] for e in all_exercises}]
    assert not unknown, f"{name}: notices for exercises the course does not have: {unknown}"
    if mine:
        assert shown, (f"{name} has exercises ({', '.join(sorted(mine))}) but showed no notice: a "
                       "cell that needs one should say so instead of silently showing nothing")
    else:
        assert not shown, f"{name} has no exercise, yet shows notices for {shown}"


def _run_sh(edition: Path, *args: str, timeout: float = 900, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(edition / "run.sh"), *args], cwd=edition, capture_output=True,
                          text=True, timeout=timeout, env=_env(edition, **env))


@pytest.mark.timeout(1800)
@pytest.mark.xdist_group("student-homework")
def test_check_submit_and_grade_from_stubs_to_full_marks(edition, tmp_path):
    work = tmp_path / "course"
    shutil.copytree(edition, work, symlinks=True)
    exercises = set().union(*exercises_by_notebook(work).values())
    assert exercises, "the student edition has no exercises"

    # 1. Nothing done yet: every exercise "not implemented yet", and check fails.
    stubs = _run_sh(work, "check")
    assert stubs.returncode != 0, f"check passed on the stubs:\n{stubs.stdout[-3000:]}"
    rows = check_summary(stubs.stdout)
    not_yet = [row for row in rows if "not implemented yet" not in row]
    assert not not_yet, "with every exercise a stub, check should say 'not implemented yet':\n" + \
        "\n".join(not_yet)
    stub_archive = _submitted(_run_sh(work, "submit", COURSE_STUDENT_ID="student-stub"), work)

    # 2. The instructor's solutions in place: every public check passes.
    for lab in (REPO_ROOT / "labs").glob("*.py"):
        shutil.copyfile(lab, work / "labs" / lab.name)
    solved = _run_sh(work, "check")
    assert solved.returncode == 0, f"check fails with the solutions in:\n{solved.stdout[-4000:]}"
    solved_archive = _submitted(_run_sh(work, "submit", COURSE_STUDENT_ID="student-solved"), work)

    # 3. The instructor grades both, hidden tests included (GRADED_LABS).
    out = tmp_path / "grades"
    labs = [arg for lab in GRADED_LABS for arg in ("--lab", lab)]
    graded = subprocess.run([sys.executable, "-m", "homework", "grade", str(stub_archive),
                             str(solved_archive), "--out", str(out), *labs], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=1500, env=_env(REPO_ROOT))
    assert graded.returncode == 0, f"grade failed:\n{graded.stdout[-3000:]}\n{graded.stderr[-3000:]}"
    rows = {row["submission"]: row for row in csv.DictReader(open(out / "grades.csv"))}
    stub_row = next(r for s, r in rows.items() if s.startswith("student-stub"))
    solved_row = next(r for s, r in rows.items() if s.startswith("student-solved"))
    assert float(stub_row["score"]) == 0, f"the stubs scored {stub_row['score']}"
    if float(solved_row["score"]) != float(solved_row["max_score"]):
        feedback = (out / f"{solved_row['submission']}.md").read_text()
        failing = [line for line in feedback.splitlines() if line.startswith("|")
                   and "| passed |" not in line and "---" not in line and "| test |" not in line]
        pytest.fail(f"the instructor's solutions scored {solved_row['score']}/"
                    f"{solved_row['max_score']}; not passed:\n" + "\n".join(failing[:40]))


def check_summary(stdout: str) -> list[str]:
    """The per-exercise lines of `./run.sh check`'s summary table."""
    lines = stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if re.match(r"exercise\s+status", line))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(line)
    assert rows, f"no summary table in check's output:\n{stdout[-2000:]}"
    return rows


def _submitted(done: subprocess.CompletedProcess, work: Path) -> Path:
    assert done.returncode == 0, f"submit failed:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
    last = done.stdout.strip().splitlines()[-1]
    path = (work / last) if not os.path.isabs(last) else Path(last)
    assert path.is_file(), f"submit's last line is not the archive: {last!r}"
    manifest_names = json.loads(subprocess.run(["tar", "-xzOf", str(path), "manifest.json"],
                                               capture_output=True, check=True).stdout)["files"]
    assert any(n.startswith("labs/") for n in manifest_names)
    return path
