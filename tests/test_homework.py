"""Tests of the homework cycle (helpers/homework): release, check, submit, grade.

Most tests run on a tiny synthetic course built in a temporary folder: a copy of helpers/ and
pytest.ini, the fixture labs 90 (two exercises, no torch) and 91 (one exercise run in 2 ranks) with
their public and hidden tests, a notebook, README, run.sh and .instructor-only. The last test runs
the release on this repository itself. Instructor only: this file and tests/homework_fixtures/ are
listed in .instructor-only.
"""
from __future__ import annotations

import ast
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import psutil
import pytest

from helpers.homework import archive
from helpers.homework.check import run_check
from helpers.homework.grade import grade
from helpers.homework.release import ReleaseError, release

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "homework_fixtures"
BEGIN, END = "### BEGIN " + "SOLUTION", "### END " + "SOLUTION"
HANG_TAG = f"homework-hang-{uuid.uuid4().hex}"  # in the command line of the hanging lab's child


def split_solution(text: str) -> tuple[list[str], list[str]]:
    """(stripped lines between the markers, stripped lines outside), read independently of
    helpers.homework."""
    inside_lines, outside_lines, inside = [], [], False
    for line in text.splitlines():
        if line.strip() == BEGIN:
            inside = True
        elif line.strip() == END:
            inside = False
        elif line.strip():
            (inside_lines if inside else outside_lines).append(line.strip())
    return inside_lines, outside_lines


def solution_lines(text: str) -> list[str]:
    return split_solution(text)[0]


def marker_lines(text: str) -> list[str]:
    """Lines that look like solution markers (markers quoted inside prose do not count)."""
    return [l for l in text.splitlines() if re.match(r"\s*#+\s*(BEGIN|END)\s+SOLUTION", l, re.I)]


def notebook(cells: list[dict]) -> str:
    return json.dumps({"cells": cells, "metadata": {"kernelspec": {"name": "python3",
                       "display_name": "Python 3", "language": "python"}},
                       "nbformat": 4, "nbformat_minor": 5}, indent=1)


def make_course(folder: Path, labs: tuple[str, ...] = ("90",)) -> Path:
    root = folder / "course"
    shutil.copytree(REPO / "helpers", root / "helpers",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(REPO / "pytest.ini", root / "pytest.ini")
    for sub in ("labs", "tests/public", "tests/hidden", "notebooks"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "labs" / "__init__.py").write_text("")
    for lab in labs:
        shutil.copy(FIXTURES / f"lab{lab}_fixture.py", root / "labs" / f"lab{lab}_fixture.py")
        shutil.copy(FIXTURES / f"public_lab{lab}.py", root / "tests/public" / f"test_lab{lab}_fixture.py")
        if (FIXTURES / f"hidden_lab{lab}.py").exists():
            shutil.copy(FIXTURES / f"hidden_lab{lab}.py", root / "tests/hidden" / f"test_lab{lab}_fixture.py")
    code = (f'def square(x):\n    """Return x squared."""\n    {BEGIN}\n    return x * x  '
            f'# notebook solution line\n    {END}\n\nprint(square(3))\n')
    (root / "notebooks" / "90_fixture.ipynb").write_text(notebook([
        {"cell_type": "markdown", "id": "a", "metadata": {}, "source": ["# Fixture notebook\n"]},
        {"cell_type": "code", "id": "b", "metadata": {"execution": {"x": 1}}, "execution_count": 3,
         "outputs": [{"output_type": "stream", "name": "stdout", "text": ["9\n"]}],
         "source": code.splitlines(keepends=True)}]))
    (root / "README.md").write_text("# Fixture course\n\nRun `./run.sh check`.\n")
    (root / "run.sh").write_text("#!/usr/bin/env bash\necho fixture\n")
    (root / "run.sh").chmod(0o755)
    (root / ".gitignore").write_text("/submissions/\n/runs/\n")
    shutil.copy(REPO / ".instructor-only", root / ".instructor-only")
    return root


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    return make_course(tmp_path_factory.mktemp("instructor"), labs=("90", "91"))


@pytest.fixture(scope="module")
def student(course, tmp_path_factory) -> tuple[Path, list[str]]:
    printed: list[str] = []
    out = tmp_path_factory.mktemp("release") / "student"
    release(course, out, log=printed.append)
    return out, printed


def all_text(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): p.read_text(errors="replace")
            for p in folder.rglob("*") if p.is_file()}


def test_release_stubs_every_block_and_leaks_no_solution(course, student):
    out, printed = student
    texts = all_text(out)
    secrets = [line for lab in (course / "labs").glob("lab*.py") for line in solution_lines(lab.read_text())]
    secrets.append("return x * x  # notebook solution line")
    assert len(secrets) == 7
    for rel, text in texts.items():
        assert marker_lines(text) == [], f"marker left in {rel}"
        for secret in secrets:
            assert secret not in text, f"solution line {secret!r} leaked into {rel}"
    # hidden tests and instructor-only files stay home; what students need ships
    assert not any(rel.startswith("tests/hidden/") for rel in texts)
    assert ".instructor-only" not in texts
    for rel in ("run.sh", "README.md", "helpers/launch.py", "helpers/homework/check.py",
                "tests/public/test_lab90_fixture.py", "labs/lab90_fixture.py"):
        assert rel in texts, rel
    assert os.access(out / "run.sh", os.X_OK), "run.sh must stay executable"
    # one stub per block, naming the exercise, the notebook and the check command; still Python
    lab = texts["labs/lab90_fixture.py"]
    ast.parse(lab)
    assert lab.count("raise NotImplementedError(") == 2
    assert "'Exercise add_vectors (notebook 90_fixture.ipynb): Return the element-wise sum" in lab
    assert "Exercise RunningMean.push (notebook 90_fixture.ipynb)" in lab
    assert "./run.sh check 90" in lab
    # the notebook: block stubbed, outputs, execution counts and run metadata gone
    nb = json.loads(texts["notebooks/90_fixture.ipynb"])
    cell = nb["cells"][1]
    assert cell["outputs"] == [] and cell["execution_count"] is None and cell["metadata"] == {}
    assert "raise NotImplementedError(" in "".join(cell["source"])
    assert "print(square(3))" in "".join(cell["source"])
    summary = "\n".join(printed)
    assert "4 exercise block(s) stubbed" in summary
    assert "labs/lab90_fixture.py: 2 block(s): add_vectors, RunningMean.push" in summary
    assert "tests/hidden/test_lab90_fixture.py" in summary  # named among the files left out


@pytest.mark.parametrize("case", ["malformed", "unclosed", "outside-function", "marker-in-readme",
                                  "hidden-helpers"])
def test_release_refuses_and_writes_nothing(tmp_path, case):
    root = make_course(tmp_path)
    lab = root / "labs" / "lab90_fixture.py"
    if case == "malformed":
        lab.write_text(lab.read_text().replace(BEGIN, "## BEGIN SOLUTION", 1))
    elif case == "unclosed":
        lab.write_text(lab.read_text().replace(f"        {END}\n", "", 1))
    elif case == "outside-function":
        lab.write_text(lab.read_text() + f"\n{BEGIN}\nSECRET = 42\n{END}\n")
    elif case == "marker-in-readme":
        (root / "README.md").write_text(f"Example:\n\n    {BEGIN}\n    x = 1\n    {END}\n")
    else:
        (root / ".instructor-only").write_text("helpers/**\n")
    out = tmp_path / "student"
    with pytest.raises(ReleaseError) as error:
        release(root, out, log=lambda *a: None)
    expected = {"malformed": "malformed solution marker", "unclosed": "never closed",
                "outside-function": "not inside a function", "marker-in-readme": "README.md:3",
                "hidden-helpers": "helpers/ must ship"}[case]
    assert expected in str(error.value)
    assert not out.exists()
    assert not list(tmp_path.glob(".student*")), "no partial folder left behind"


def test_release_target_rules_and_strict_mode(tmp_path):
    root = make_course(tmp_path)
    out = tmp_path / "student"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ReleaseError, match="not empty"):
        release(root, out, log=lambda *a: None)
    (out / "notes.txt").unlink()
    release(root, out, log=lambda *a: None)
    with pytest.raises(ReleaseError, match="--force"):
        release(root, out, log=lambda *a: None)
    release(root, out, force=True, log=lambda *a: None)
    # a solution line the instructor also shows outside the blocks ships with a warning; --strict refuses
    readme = root / "README.md"
    readme.write_text(readme.read_text() + "\n    self.total += float(value)  # fixture solution, RunningMean.push\n")
    printed: list[str] = []
    release(root, out, force=True, log=printed.append)
    assert any("also appears outside the solution blocks" in line for line in printed)
    with pytest.raises(ReleaseError, match="--strict"):
        release(root, out, force=True, strict=True, log=lambda *a: None)


def test_check_fails_on_the_student_edition_and_passes_on_the_instructors(course, student):
    out, _ = student
    lines: list[str] = []
    results, status = run_check(out, "90", timeout=60, log=lines.append)
    assert status == 1
    assert {r.exercise: r.status for r in results} == {"add_vectors": "not_implemented",
                                                       "RunningMean.push": "not_implemented"}
    assert any("add_vectors       not implemented yet: Exercise add_vectors" in l for l in lines)
    results, status = run_check(course, "90", timeout=60, log=lambda *a: None)
    assert status == 0
    assert {r.exercise: r.status for r in results} == {"add_vectors": "passed",
                                                       "RunningMean.push": "passed"}


def test_check_reports_a_wrong_answer_as_failed_with_its_message(tmp_path):
    root = make_course(tmp_path)
    lab = root / "labs" / "lab90_fixture.py"
    lab.write_text(lab.read_text().replace("self.count += 1\n", "self.count += 2\n"))
    results, status = run_check(root, "90", timeout=60, log=lambda *a: None)
    by_name = {r.exercise: r for r in results}
    assert status == 1 and by_name["add_vectors"].status == "passed"
    assert by_name["RunningMean.push"].status == "failed"
    assert "the mean of 2 and 4 should be 3.0" in by_name["RunningMean.push"].message


def test_check_reports_a_stub_raised_inside_a_rank_as_not_implemented(student):
    out, _ = student
    results, status = run_check(out, "91", timeout=120, log=lambda *a: None)
    assert status == 1
    assert [(r.exercise, r.status) for r in results] == [("rank_sum", "not_implemented")]
    assert "Exercise rank_sum (notebook 91)" in results[0].message


def test_submit_packs_labs_notebooks_and_manifest(tmp_path):
    root = make_course(tmp_path)
    env = dict(os.environ, COURSE_STUDENT_ID="ada@example.org", PYTHONPATH=str(root),
               HOMEWORK_TEST_SECRET="do-not-pack-me")
    done = subprocess.run([sys.executable, "-m", "helpers.homework", "submit", "--timeout", "60"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    path = root / done.stdout.strip().splitlines()[-1]
    assert path.is_file() and path.parent == root / "submissions"
    assert path.name.startswith("ada_example.org-") and path.name.endswith(".tar.gz")
    members = archive.validate(path)  # what the grader accepts
    names = sorted(m.name for m in members)
    assert names == ["labs/__init__.py", "labs/lab90_fixture.py", "manifest.json",
                     "notebooks/90_fixture.ipynb"]
    with tarfile.open(path) as tar:
        data = {n: tar.extractfile(n).read() for n in names}
    manifest = json.loads(data["manifest.json"])
    assert manifest["student"] == "ada@example.org" and manifest["created_utc"].endswith("Z")
    assert manifest["checks"]["status"] == "all passed"
    assert {e["exercise"]: e["status"] for e in manifest["checks"]["exercises"]} == {
        "add_vectors": "passed", "RunningMean.push": "passed"}
    nb = json.loads(data["notebooks/90_fixture.ipynb"])
    assert all(c.get("outputs", []) == [] and c.get("execution_count") is None for c in nb["cells"])
    packed = b"".join(data.values())
    assert b"do-not-pack-me" not in packed and str(root).encode() not in packed


# --- grading --------------------------------------------------------------------------------

def tar_with(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def file_member(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


HANG = f'''
import signal, subprocess, sys, time
def add_vectors(a, b):
    if not a:  # only the hidden edge case hangs, ignoring pytest-timeout's alarm, with a child
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "{HANG_TAG}"],
                         start_new_session=True)
        time.sleep(600)
    return [float(x) + float(y) for x, y in zip(a, b)]
'''
FLOOD = '''
import sys
def add_vectors(a, b):
    if a == [1, 2]:
        for _ in range(100):
            sys.stdout.write("flood " * 174763)  # 1 MiB, 100 times
    return [float(x) + float(y) for x, y in zip(a, b)]
'''


def test_grade_scores_good_bad_and_hostile_submissions(course, student, tmp_path):
    solution = (course / "labs" / "lab90_fixture.py").read_bytes()
    stubs = (student[0] / "labs" / "lab90_fixture.py").read_bytes()
    manifest = json.dumps({"student": "ada | <b>"}).encode()
    escaped, absolute = tmp_path / "escaped.py", tmp_path / "absolute.py"
    link = tarfile.TarInfo("labs/lab90_fixture.py")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    archives = {
        "solution": [file_member("labs/lab90_fixture.py", solution),
                     file_member("manifest.json", manifest)],
        "zipslip": [file_member("../" * 40 + str(escaped).lstrip("/"), b"print('escaped')\n"),
                    file_member("labs/lab90_fixture.py", solution)],
        "absolute": [file_member(str(absolute), b"x = 1\n")],
        "symlink": [(link, None)],
        "oversized": [file_member("labs/lab90_fixture.py", solution + b"#" * (6 * 2**20))],
        "hang": [file_member("labs/lab90_fixture.py", solution + HANG.encode())],
        "crash": [file_member("labs/lab90_fixture.py", solution + b"\nimport os\nos._exit(3)\n")],
        "flood": [file_member("labs/lab90_fixture.py", solution + FLOOD.encode())],
        "stubs": [file_member("labs/lab90_fixture.py", stubs)],
    }
    paths = [tar_with(tmp_path / f"{name}.tar.gz", members) for name, members in archives.items()]
    out = tmp_path / "grades"
    rows = grade(paths, out, course, timeout=5, labs=["90"], grace=1, log=lambda *a: None)
    scores = {r.submission: (r.score, r.max_score) for r in rows}
    assert [r.submission for r in rows] == list(archives)
    assert scores["solution"] == (7, 7) and scores["flood"] == (7, 7)
    assert scores["stubs"] == (0, 7) and scores["crash"] == (0, 7)
    assert scores["hang"] == (5, 7)  # the hidden edge case (2 points) timed out, the rest passed
    notes = {r.submission: r.note for r in rows}
    for name, reason in (("zipslip", "'..' is not allowed"), ("absolute", "absolute paths"),
                         ("symlink", "links are not allowed"), ("oversized", "at most")):
        assert scores[name] == (0, 7) and notes[name].startswith("rejected:") and reason in notes[name]
    assert not escaped.exists() and not absolute.exists()
    # nothing of the hanging submission survives, and the flood was not kept
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if HANG_TAG in (p.info["cmdline"] or [])]
    assert leftovers == []
    assert (out / "logs" / "flood.log").stat().st_size < 1_000_000
    # the CSV: one row per archive in order, points per test, the rejection reason at the end
    import csv
    with open(out / "grades.csv", newline="") as handle:
        table = list(csv.reader(handle))
    header = table[0]
    assert header[:3] == ["submission", "score", "max_score"] and header[-1] == "note"
    assert "tests/hidden/test_lab90_fixture.py::test_add_vectors_edge_cases" in header
    assert [row[0] for row in table[1:]] == list(archives)
    hang_row = dict(zip(header, table[1 + list(archives).index("hang")]))
    assert hang_row["tests/hidden/test_lab90_fixture.py::test_add_vectors_edge_cases"] == "0"
    assert hang_row["tests/hidden/test_lab90_fixture.py::test_running_mean_many_values"] == "2"
    assert "links are not allowed" in table[1 + list(archives).index("symlink")][-1]
    # feedback: names, points, one-line messages, never the hidden tests' source
    hidden_source = [l.strip() for l in (FIXTURES / "hidden_lab90.py").read_text().splitlines()
                     if len(l.strip()) >= 12 and not l.strip().startswith(("@pytest", "def ", '"""'))]
    for name in archives:
        feedback = (out / f"{name}.md").read_text()
        assert "/ 7**" in feedback
        for line in hidden_source:
            assert line not in feedback, f"hidden source {line!r} in {name}.md"
    hang_feedback = (out / "hang.md").read_text()
    assert "hidden: test_add_vectors_edge_cases | add_vectors | 0/2 | timed out" in hang_feedback
    assert "Timeout" in hang_feedback
    assert "exit code 3" in (out / "crash.md").read_text()
    assert "not implemented" in (out / "stubs.md").read_text()
    assert "ada \\| &lt;b>" in (out / "solution.md").read_text()


@pytest.mark.parametrize("case", ["hardlink", "device", "fifo", "outside-set", "dot-dot-inside",
                                  "duplicate", "too-many", "not-gzip", "empty"])
def test_archive_validation_rejects_before_extracting(tmp_path, case):
    path = tmp_path / "a.tar.gz"
    good = file_member("labs/lab90_fixture.py", b"x = 1\n")
    special = tarfile.TarInfo("labs/x.py")
    if case == "hardlink":
        special.type, special.linkname = tarfile.LNKTYPE, "labs/lab90_fixture.py"
        tar_with(path, [good, (special, None)])
    elif case in ("device", "fifo"):
        special.type = tarfile.CHRTYPE if case == "device" else tarfile.FIFOTYPE
        tar_with(path, [(special, None)])
    elif case == "outside-set":
        tar_with(path, [good, file_member("helpers/dist.py", b"x = 1\n")])
    elif case == "dot-dot-inside":
        tar_with(path, [file_member("labs/../labs/lab90_fixture.py", b"x = 1\n")])
    elif case == "duplicate":
        tar_with(path, [good, good])
    elif case == "too-many":
        tar_with(path, [file_member(f"labs/l{i}.py", b"") for i in range(archive.MAX_MEMBERS + 1)])
    elif case == "not-gzip":
        path.write_bytes(b"PK\x03\x04 a zip file, not a tar.gz")
    else:
        tar_with(path, [])
    with pytest.raises(archive.ArchiveRejected):
        archive.extract(path, tmp_path / "dest")
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").rglob("*"))


def test_release_of_this_repository_stubs_every_block_and_leaks_nothing(tmp_path):
    out = tmp_path / "student"
    release(REPO, out, log=lambda *a: None)
    labs = sorted((REPO / "labs").glob("*.py"))
    # what the instructor shows outside the blocks ships anyway: only the rest is secret
    public_lines: list[str] = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in (".venv", ".git", "hidden", "homework_fixtures")]
        for name in files:
            if name.endswith((".py", ".ipynb", ".md", ".sh", ".txt")):
                public_lines += split_solution((Path(folder) / name).read_text(errors="replace"))[1]
    public_set, public_text = set(public_lines), "\n".join(public_lines)
    shipped = all_text(out)
    shipped_set = {l.strip() for text in shipped.values() for l in text.splitlines()}
    shipped_text = "\n".join(shipped_set)

    def found(line: str, lines: set[str], text: str) -> bool:
        # the release's rule: a whole line, or inside a longer line for lines of 24+ characters
        return line in lines or (len(line) >= 24 and line in text)

    for lab in labs:
        source = lab.read_text()
        blocks = sum(line.strip() == BEGIN for line in source.splitlines())
        stubbed = shipped[f"labs/{lab.name}"]
        assert stubbed.count("NotImplementedError(") - source.count("NotImplementedError(") == blocks, lab.name
        for line in solution_lines(source):
            if len(line) >= 12 and not found(line, public_set, public_text):
                assert not found(line, shipped_set, shipped_text), f"{lab.name}: {line!r} leaked"
    for rel, text in shipped.items():
        assert marker_lines(text) == [], f"marker left in {rel}"
    assert not any(rel.startswith(("tests/hidden/", "tests/homework_fixtures/")) for rel in shipped)
    assert "tests/test_homework.py" not in shipped


STRAYS = '''
import subprocess, sys, time
import psutil

children = {}


def test_a_starts_a_helper_and_a_stray():
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    children["helper"] = subprocess.Popen(sleep)  # like multiprocessing's forkserver
    children["stray"] = subprocess.Popen(sleep, start_new_session=True)  # like torchrun


def test_b_sees_the_helper_alive_and_the_stray_gone():
    time.sleep(0.2)
    assert children["helper"].poll() is None, "a helper of the session must survive a test"
    stray = children["stray"]
    gone = stray.poll() is not None or psutil.Process(stray.pid).status() == psutil.STATUS_ZOMBIE
    assert gone, "a process left in a session of its own must be killed after its test"
'''


def test_runner_kills_what_a_test_leaves_in_its_own_session_only(tmp_path):
    from helpers.homework.runner import run_tests

    root = make_course(tmp_path)
    (root / "tests" / "public" / "test_lab92_strays.py").write_text(STRAYS)
    infos, outcomes = run_tests(root, ["tests/public/test_lab92_strays.py"], timeout=30)
    assert [outcomes[i.nodeid].outcome for i in infos] == ["passed", "passed"], outcomes
