"""Tests of the homework cycle (homework): release, check, submit, archive checks.

They run on the tiny synthetic course of tests/homework_fixtures/course.py (labs 90 and 91). The
grading tests, which attack the sandbox for real, are in tests/test_homework_grading.py. The last
test runs the release on this repository itself. Instructor only: listed in .instructor-only.
"""
from __future__ import annotations

import ast
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tracemalloc
from pathlib import Path

import pytest

from homework import archive
from homework.check import run_check
from homework.release import ReleaseError, release
from tests.homework_fixtures.course import (BEGIN, END, REPO, file_member, make_course,
                                            tar_with)


def split_solution(text: str) -> tuple[list[str], list[str]]:
    """(stripped lines between the markers, stripped lines outside), read independently of
    homework."""
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
    assert len(secrets) == 6
    for rel, text in texts.items():
        assert marker_lines(text) == [], f"marker left in {rel}"
        for secret in secrets:
            assert secret not in text, f"solution line {secret!r} leaked into {rel}"
    # hidden tests and instructor-only files stay home; what students need ships
    assert not any(rel.startswith("tests/hidden/") for rel in texts)
    assert ".instructor-only" not in texts
    for rel in ("run.sh", "README.md", "helpers/launch/torchrun.py", "homework/check.py",
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
    # the notebook: outputs, execution counts and run metadata gone, code kept
    nb = json.loads(texts["notebooks/90_fixture.ipynb"])
    cell = nb["cells"][1]
    assert cell["outputs"] == [] and cell["execution_count"] is None and cell["metadata"] == {}
    assert "print(add_vectors([1], [2]))" in "".join(cell["source"])
    summary = "\n".join(printed)
    assert "3 exercise block(s) stubbed" in summary
    assert "labs/lab90_fixture.py: 2 block(s): add_vectors, RunningMean.push" in summary
    assert "tests/hidden/test_lab90_fixture.py" in summary  # named among the files left out


@pytest.mark.parametrize("case", ["malformed", "unclosed", "outside-function", "marker-in-readme",
                                  "marker-in-notebook", "hidden-helpers", "not-a-checkout"])
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
    elif case == "marker-in-notebook":
        nb = root / "notebooks" / "90_fixture.ipynb"
        data = json.loads(nb.read_text())
        data["cells"][1]["source"] = ["def square(x):\n", f"    {BEGIN}\n", "    return x * x\n",
                                      f"    {END}\n"]
        nb.write_text(json.dumps(data))
    elif case == "not-a-checkout":
        subprocess.run(["rm", "-rf", str(root / ".git")], check=True)
    else:
        (root / ".instructor-only").write_text("helpers/**\n")
    out = tmp_path / "student"
    with pytest.raises(ReleaseError) as error:
        release(root, out, log=lambda *a: None)
    expected = {"malformed": "malformed solution marker", "unclosed": "never closed",
                "outside-function": "not inside a function", "marker-in-readme": "README.md:3",
                "marker-in-notebook": "a solution marker in a notebook",
                "hidden-helpers": "helpers/ must ship", "not-a-checkout": "not a git checkout"}[case]
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
    """A wrong answer fails with the test's message; an exception raised in the lab says where
    in the lab (file, line, code)."""
    root = make_course(tmp_path)
    lab = root / "labs" / "lab90_fixture.py"
    lab.write_text(lab.read_text().replace("self.count += 1\n", "self.count += 2\n").replace(
        "    return summed\n", "    return [summed[i + 1] for i in range(len(a))]  # off by one\n"))
    bug = 1 + lab.read_text().splitlines().index("    return [summed[i + 1] for i in range(len(a))]  # off by one")
    lines: list[str] = []
    results, status = run_check(root, "90", timeout=60, log=lines.append)
    by_name = {r.exercise: r for r in results}
    assert status == 1 and by_name["RunningMean.push"].status == "failed"
    assert "the mean of 2 and 4 should be 3.0" in by_name["RunningMean.push"].message
    assert by_name["RunningMean.push"].message.endswith("should be 3.0"), \
        "no location for a failed assertion of the test itself"
    assert by_name["add_vectors"].message == (
        "IndexError: list index out of range at labs/lab90_fixture.py:"
        f"{bug} `return [summed[i + 1] for i in range(len(a))]  # off by one`"), by_name["add_vectors"]
    # the interpreter actually in use (this one is outside the course: its absolute path)
    assert f"Debug with: {sys.executable} -m pytest tests/public/test_lab90_fixture.py -x" in lines


def test_debug_with_names_a_file_that_really_failed(tmp_path):
    """`Debug with:` names the file of a test that failed, not the first file whose tests only met
    an exercise's stub (the lab 03 case: the classifier's stubs before BucketedDDP's failures)."""
    from homework.release import transform

    root = make_course(tmp_path)
    lab = root / "labs" / "lab90_fixture.py"
    lab.write_bytes(transform(root, "labs/lab90_fixture.py").data)  # both exercises: stubs
    (root / "tests" / "public" / "test_lab90_zz_more.py").write_text(
        "import pytest\n\n@pytest.mark.exercise('more')\n"
        "def test_more():\n    assert 1 == 2, 'a real failure'\n")
    lines: list[str] = []
    results, status = run_check(root, "90", timeout=60, log=lines.append)
    assert status == 1 and [r.status for r in results] == ["not_implemented", "not_implemented",
                                                           "failed"], results
    debug = [line for line in lines if line.startswith("Debug with:")]
    assert debug == [f"Debug with: {sys.executable} -m pytest tests/public/test_lab90_zz_more.py -x"], \
        f"the file that failed, not the first one with stubs: {debug}"
    # only stubs: the first file that did not pass
    (root / "tests" / "public" / "test_lab90_zz_more.py").unlink()
    lines.clear()
    run_check(root, "90", timeout=60, log=lines.append)
    assert f"Debug with: {sys.executable} -m pytest tests/public/test_lab90_fixture.py -x" in lines


BUGGY_RANK_SUM = '''
import torch
import torch.distributed as dist


def pick(parts, rank):
    return parts[rank]  # BUG: one part, two ranks


def rank_sum(value, group=None):
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return pick([value], dist.get_rank())
'''
RANKS_TEST = '''
import pytest

from tests.harness import launch_ranks


@pytest.mark.exercise("rank_sum")
def test_rank_sum_on_two_ranks():
    ranks = launch_ranks(__file__, "rank-sum", nproc=2, timeout=120)
    assert [r["total"] for r in ranks.values()] == [3.0, 3.0], "1 + 2 on every rank"


if __name__ == "__main__":
    import torch

    from helpers.dist import distributed
    from labs.lab91_fixture import rank_sum

    with distributed() as ctx:
        ctx.report(total=rank_sum(torch.tensor([ctx.rank + 1.0])).item())
'''


def test_check_shows_where_in_the_lab_a_rank_raised(tmp_path):
    """A rank's exception is located in the student's file: `check`'s line gives the innermost
    frame in labs/ (file, line, code), its log the rank's last frames in labs/, innermost last."""
    root = make_course(tmp_path, labs=("91",))
    for name in ("conftest.py", "harness.py"):  # launch_ranks
        shutil.copy(REPO / "tests" / name, root / "tests" / name)
    (root / "tests" / "public" / "test_lab91_fixture.py").write_text(RANKS_TEST)
    lab = root / "labs" / "lab91_fixture.py"
    lab.write_text(BUGGY_RANK_SUM)
    source = BUGGY_RANK_SUM.splitlines()
    bug = 1 + next(i for i, line in enumerate(source) if "BUG" in line)
    call = 1 + next(i for i, line in enumerate(source) if "return pick(" in line)
    lines: list[str] = []
    results, status = run_check(root, "91", timeout=120, log=lines.append)
    assert status == 1 and [r.status for r in results] == ["failed"], results
    where = (f"rank 1 raised IndexError: list index out of range at labs/lab91_fixture.py:{bug} "
             "`return parts[rank]  # BUG: one part, two ranks`")
    shown = next(line for line in lines if line.startswith("rank_sum "))
    assert shown.startswith(f"rank_sum  failed: {where} (launch of "), \
        f"check's line must say which rank raised what, where in the lab: {shown}"
    log = (root / "runs" / "homework" / "check-91.log").read_text()
    assert ("rank 1's traceback in the labs (innermost last):\n"
            f"E             labs/lab91_fixture.py:{call} in rank_sum: `return pick([value], dist.get_rank())`\n"
            f"E             labs/lab91_fixture.py:{bug} in pick: `return parts[rank]  # BUG: one part, two ranks`"
            ) in log, log[-3000:]


CAUGHT_TEST = '''
import pytest

from tests.harness import launch_ranks


@pytest.fixture(scope="module")
def ranks():
    return launch_ranks(__file__, "cases", nproc=2, timeout=120, env={"DIST_TIMEOUT": "5"})


@pytest.mark.exercise("rank_sum")
def test_rank_sum_on_two_ranks(ranks):
    for rank in range(2):
        assert "error" not in ranks[rank], f"rank {rank}: rank_sum raised {ranks[rank]['error']}"
        assert ranks[rank]["total"] == 3.0, "1 + 2 on every rank"


if __name__ == "__main__":
    import torch

    from helpers.dist import distributed
    from labs.lab91_fixture import rank_sum

    with distributed() as ctx:
        report = {}
        try:  # as many course tests do: keep the message and go on
            report["total"] = rank_sum(torch.tensor([ctx.rank + 1.0])).item()
        except Exception as err:
            report["error"] = f"{type(err).__name__}: {err}"
        ctx.report(**report)
'''
RANK_ONE_ONLY = f'''
import torch.distributed as dist


def rank_sum(value, group=None):
    {BEGIN}
    if dist.get_rank() == 1:
        [][0]  # BUG: rank 1 only
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value
    {END}
'''
EVERY_RANK = f'''
import torch.distributed as dist


def rank_sum(value, group=None):
    {BEGIN}
    len(value.item())  # BUG: every rank
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value
    {END}
'''
CAUGHT_IN_PROCESS = '''
import pytest

from labs.lab90_fixture import add_vectors


@pytest.mark.exercise("add_vectors")
def test_add_vectors_caught():
    try:
        add_vectors([1], [2])
        error = ""
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
    assert not error, f"add_vectors raised {error}"
'''


@pytest.mark.parametrize("bug", ["rank 1 only", "every rank", "in the test process"])
def test_check_locates_an_exception_the_test_caught(tmp_path, bug):
    """The course's test workers catch an exercise's exception, keep its message and go on; the
    ranks fall out of step, or the test fails with the message alone. check's line still names
    the file and line where the exercise raised and the rank that raised first (not rank 0's
    gloo timeout when only rank 1 raised), with no change to the test file (homework.watch)."""
    lab = "90" if bug == "in the test process" else "91"
    root = make_course(tmp_path, labs=(lab,))
    for name in ("conftest.py", "harness.py"):
        shutil.copy(REPO / "tests" / name, root / "tests" / name)
    test = root / "tests" / "public" / f"test_lab{lab}_fixture.py"
    test.write_text(CAUGHT_IN_PROCESS if lab == "90" else CAUGHT_TEST)
    source = {"rank 1 only": RANK_ONE_ONLY, "every rank": EVERY_RANK}.get(bug)
    path = root / "labs" / f"lab{lab}_fixture.py"
    if source is None:
        text = path.read_text()
        source = text.replace("    summed = [", "    [][0]  # BUG: in the test process\n    summed = [")
    path.write_text(source)
    line = 1 + next(i for i, text in enumerate(source.splitlines()) if "BUG" in text)
    lines: list[str] = []
    results, status = run_check(root, lab, timeout=120, log=lines.append)
    assert status == 1 and [r.status for r in results] == ["failed"], results
    shown = next(text for text in lines if text.startswith(results[0].exercise + " "))
    code = source.splitlines()[line - 1].strip()
    where = f"labs/lab{lab}_fixture.py:{line} `{code}`"
    assert where in shown, f"check's line must say where the exercise raised: {shown}"
    if bug == "rank 1 only":
        assert "rank 1 raised IndexError: list index out of range" in shown, shown
        assert "rank 0" not in shown.split(where)[0] or "there first" in shown, shown
    elif bug == "every rank":
        assert "TypeError: object of type 'float' has no len()" in shown and "raised it first" in shown, shown
    else:
        assert shown.endswith(f"add_vectors raised IndexError: list index out of range at {where}"), shown


CRASHING = '''
import os

def test_a_first():
    pass

def test_b_dies():
    os._exit(3)

def test_c_after_the_crash():
    pass
'''


def test_one_pytest_process_runs_every_file_and_another_only_after_a_crash(tmp_path):
    from homework.runner import Direct, run_tests

    root = make_course(tmp_path)
    (root / "tests" / "public" / "test_lab92_crash.py").write_text(CRASHING)
    (root / "tests" / "hidden" / "test_lab92_crash.py").write_text("def test_hidden_twin():\n    pass\n")
    files = ["tests/public/test_lab90_fixture.py", "tests/public/test_lab92_crash.py",
             "tests/hidden/test_lab92_crash.py"]  # two files of the same name: one process imports both
    run = run_tests(Direct(root), files, timeout=60)
    outcomes = {t.nodeid.split("::")[-1]: run.outcomes[t.nodeid].outcome for t in run.tests}
    assert outcomes == {"test_add_vectors_small": "passed", "test_running_mean_two_values": "passed",
                        "test_a_first": "passed", "test_b_dies": "crashed",
                        "test_c_after_the_crash": "passed", "test_hidden_twin": "passed"}, outcomes
    assert run.processes == 2, "one process for all the files, one more after the crash"
    assert "exit code 3" in run.outcomes["tests/public/test_lab92_crash.py::test_b_dies"].message


def test_a_stub_raised_inside_a_rank_counts_as_not_implemented():
    """What the plugin makes of a launch whose rank met a stub (helpers.launch.LaunchError's text;
    the student-journey test runs real ranks)."""
    from types import SimpleNamespace

    from homework.plugin import category

    stub = ("Exercise rank_sum (notebook 91): Sum `value` over the ranks. Fill in the block in "
            "labs/lab91_fixture.py and run ./run.sh check 91")
    launch = RuntimeError(f"tests/public/test_lab91_fixture.py on 2 rank(s) failed with exit code 1 "
                          f"after 3.1 s: rank 1 raised NotImplementedError: {stub}\n--- rank 1 "
                          "traceback (end) ---\n...")
    excinfo = SimpleNamespace(value=launch, typename="LaunchError")
    assert category(excinfo) == ("not_implemented", stub)
    assert category(SimpleNamespace(value=AssertionError("x"), typename="AssertionError"))[0] == "assertion"
    assert category(SimpleNamespace(value=ValueError("x"), typename="ValueError"))[0] == "error"
    # pytest.fail(...) and pytest.raises' "DID NOT RAISE" are checks that did not hold, not errors
    assert category(SimpleNamespace(value=Exception("DID NOT RAISE <class 'ValueError'>"),
                                    typename="Failed"))[0] == "assertion"
    assert category(SimpleNamespace(value=Exception("Timeout (>120.0s) from pytest-timeout."),
                                    typename="Failed"))[0] == "timeout"


def test_submit_packs_labs_notebooks_and_manifest(tmp_path):
    root = make_course(tmp_path)
    env = dict(os.environ, COURSE_STUDENT_ID="ada@example.org", PYTHONPATH=str(root),
               HOMEWORK_TEST_SECRET="do-not-pack-me")
    done = subprocess.run([sys.executable, "-m", "homework", "submit", "--timeout", "60"],
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
    # that check covered all labs and nothing changed since: a second submit reuses its results
    assert manifest["checks"]["reused"] is False
    again = subprocess.run([sys.executable, "-m", "homework", "submit"], cwd=root, env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "Reusing the results of your last `./run.sh check`" in again.stdout
    with tarfile.open(root / again.stdout.strip().splitlines()[-1]) as tar:
        assert json.loads(tar.extractfile("manifest.json").read())["checks"]["reused"] is True
    from homework.check import saved_results

    lab = root / "labs" / "lab90_fixture.py"
    lab.write_text(lab.read_text() + "\n# changed\n")
    assert saved_results(root) is None, "a changed lab must be checked again"


@pytest.mark.parametrize("case", ["hardlink", "device", "fifo", "outside-set", "dot-dot-inside",
                                  "duplicate", "too-many", "too-many-folders", "not-gzip", "empty"])
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
    elif case == "too-many-folders":  # folders count too
        folder = tarfile.TarInfo("labs")
        folder.type = tarfile.DIRTYPE
        tar_with(path, [(folder, None)] * archive.MAX_MEMBERS + [good])
    elif case == "not-gzip":
        path.write_bytes(b"PK\x03\x04 a zip file, not a tar.gz")
    else:
        tar_with(path, [])
    with pytest.raises(archive.ArchiveRejected):
        archive.extract(path, tmp_path / "dest")
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").rglob("*"))


def _gzip_repeating(path: Path, head: bytes, unit: bytes, repeats: int) -> Path:
    """A .tar.gz whose decompressed stream is `head` then `unit` `repeats` times, written in
    milliseconds: gzip members concatenate, so one compressed unit is repeated."""
    member = gzip.compress(unit, compresslevel=9)
    with open(path, "wb") as handle:
        handle.write(gzip.compress(head))
        for _ in range(repeats):
            handle.write(member)
    return path


def _header(name: str, kind: bytes, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, size
    return info.tobuf(format=tarfile.GNU_FORMAT)


@pytest.mark.parametrize("bomb", ["long-name", "million-folders"])
def test_archive_bombs_are_rejected_at_once_with_bounded_memory(tmp_path, bomb):
    if bomb == "long-name":  # a 1 GiB long-name header: 1 MiB of gzip
        head = _header("././@LongLink", tarfile.GNUTYPE_LONGNAME, 2**30)
        path = _gzip_repeating(tmp_path / "a.tar.gz", head, b"a" * 2**20, 1024)
    else:  # a million folder entries, each a 512-byte header
        unit = _header("labs", tarfile.DIRTYPE, 0) * 1000
        path = _gzip_repeating(tmp_path / "a.tar.gz", b"", unit, 1000)
    assert path.stat().st_size < archive.MAX_ARCHIVE_BYTES
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(archive.ArchiveRejected) as rejected:
        archive.validate(path)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < 1.0, f"rejecting the bomb took {seconds:.2f} s"
    assert peak < 4 * 2**20, f"rejecting the bomb held {peak} bytes"
    assert ("long-name header" if bomb == "long-name" else "entries") in str(rejected.value)


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
    # the student's page only: no instructor's or maintainer's guide, no pointer to them
    assert not any(rel.startswith("docs/") for rel in shipped), [r for r in shipped if r.startswith("docs/")]
    readme = shipped["README.md"]
    assert "instructor-only" not in readme and "INSTRUCTORS.md" not in readme and \
        "MAINTAINERS.md" not in readme, "the student edition's README points to guides it lacks"
    assert "## Homework" in readme and "./run.sh check" in readme


def graded_tests_without_a_docstring(folders=("tests/public", "tests/hidden")) -> list[str]:
    """`file:line name` of every `def test*` in the graded test files without a docstring (read
    from the source, without importing it)."""
    missing = []
    for folder in folders:
        for path in sorted((REPO / folder).glob("test_*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                        node.name.startswith("test"):
                    if not (ast.get_docstring(node) or "").strip():
                        missing.append(f"{folder}/{path.name}:{node.lineno} {node.name}")
    return missing


def test_every_graded_test_has_a_docstring():
    """Grading feedback and `check` show a test's docstring's first line as what it checks: every
    graded test (tests/public, tests/hidden) has one."""
    missing = graded_tests_without_a_docstring()
    assert not missing, (f"{len(missing)} graded test(s) without a docstring (its first line is "
                         "what grading feedback shows):\n" + "\n".join(missing))


def test_check_reports_a_lab_that_does_not_import(tmp_path):
    root = make_course(tmp_path)
    lab = root / "labs" / "lab90_fixture.py"
    lab.write_text(lab.read_text() + "\ndef broken(:\n")
    results, status = run_check(root, "90", timeout=60, log=lambda *a: None)
    assert status == 1
    assert [r.status for r in results] == ["failed"]
    assert "could not be loaded" in results[0].message and "SyntaxError" in results[0].message


FAKE_TOOL = """#!{bash}
echo "$*" >> "$FAKE_LOG.{name}"
{body}
exit 0
"""


@pytest.mark.parametrize("case", ["installs", "not-root", "unsafe"])
def test_run_sh_grade_sets_up_bubblewrap_as_test_does(tmp_path, case):
    """`./run.sh grade` follows `./run.sh test`'s rule (tests/test_foundation.py): bubblewrap is
    installed quietly where it can be (root, apt-get), else grade stops before anything runs with
    one line saying what to run; `--unsafe` (no sandbox) needs none. Fakes on a PATH that hides
    the real tools."""
    bash = shutil.which("bash")
    root = tmp_path / "course"
    (root / "labs").mkdir(parents=True)
    shutil.copy(REPO / "run.sh", root / "run.sh")
    shutil.copy(REPO / "requirements.txt", root / "requirements.txt")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "cat", "cksum", "mktemp", "tail", "rm", "chmod"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    (bin_dir / "id").write_text(f"#!{bash}\necho {'1000' if case == 'not-root' else '0'}\n")
    (bin_dir / "apt-get").write_text(FAKE_TOOL.format(bash=bash, name="apt", body=(
        'if [[ "$1" == install ]]; then printf "#!%s\\nexit 0\\n" "$BASH" > "$FAKE_BIN/bwrap"; '
        'chmod +x "$FAKE_BIN/bwrap"; fi')))
    python = tmp_path / "python"
    python.write_text(FAKE_TOOL.format(bash=bash, name="python", body=""))
    for path in [python, *bin_dir.iterdir()]:
        path.chmod(0o755)
    log = tmp_path / "log"
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "COURSE_PYTHON": str(python),
           "FAKE_LOG": str(log), "FAKE_BIN": str(bin_dir)}
    args = ["grade", "a.tar.gz", "--out", "grades"] + (["--unsafe"] if case == "unsafe" else [])
    proc = subprocess.run([bash, str(root / "run.sh"), *args], cwd=root, capture_output=True,
                          text=True, env=env, timeout=60)
    said = (proc.stdout + proc.stderr).strip().splitlines()
    apt = Path(f"{log}.apt").read_text().splitlines() if Path(f"{log}.apt").exists() else []
    graded = "-m homework grade" in (Path(f"{log}.python").read_text()
                                     if Path(f"{log}.python").exists() else "")
    if case == "installs":
        assert (proc.returncode, graded, apt) == (0, True, ["install -y -q bubblewrap"]), said
        assert said == ["run.sh: installing bubblewrap with apt-get (grading sandboxes each "
                        "submission with it)"], said
    elif case == "not-root":
        assert proc.returncode == 2 and not graded and apt == [], said
        assert len(said) == 1 and "grading needs bubblewrap" in said[0] and \
            "sudo apt-get install bubblewrap" in said[0] and "./run.sh grade again" in said[0], said
    else:
        assert (proc.returncode, graded, apt, said) == (0, True, [], []), said


# ---------------------------------------------------------------------------- the splice
def _fixture_lab() -> tuple[str, str]:
    """(the course's student-edition lab 90, the instructor's solution without marker lines)."""
    from homework.solutions import stub_python

    source = (REPO / "tests" / "homework_fixtures" / "lab90_fixture.py").read_text()
    solved = "\n".join(l for l in source.splitlines() if l.strip() not in (BEGIN, END)) + "\n"
    return stub_python(source, "labs/lab90_fixture.py", "90_fixture.ipynb").text, solved


def _swap(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


SUM_LINE = "    summed = [float(x) + float(y) for x, y in zip(a, b)]  # fixture solution, add_vectors\n"


@pytest.mark.parametrize("case", [
    "solved", "helpers", "instrument", "global", "import-in-block", "shadowing-helper", "syntax-error",
    "missing-exercise", "stub-comment-kept", "line-above-the-block", "module-code", "signature",
    "class-helper", "runtime-patch", "markers"])
def test_splice_runs_only_the_exercises_and_the_students_own_helpers(case):
    """What a careless or hostile submission does to a lab file, and what grading and check run:
    the course's copy, the student's code in each exercise's place, the helpers they added under
    new names; everything else reported, never run (homework.splice)."""
    from homework.splice import splice

    course, solved = _fixture_lab()
    submitted = {
        "solved": solved,
        "helpers": _swap(solved, SUM_LINE, "    summed = [_add(x, y) for x, y in zip(a, b)]\n")
        + "\n\nimport math\n\nEPSILON = 0.0\n\n\ndef _add(x, y):\n    return math.fsum([float(x), float(y), EPSILON])\n",
        "instrument": _swap(solved, "    return x is y\n", "    return False\n"),
        "global": _swap(solved, SUM_LINE, "    global same_list\n    same_list = lambda x, y: False\n" + SUM_LINE),
        "import-in-block": _swap(solved, SUM_LINE, "    import math\n    summed = [math.fsum([x, y]) for x, y in zip(a, b)]\n"),
        "shadowing-helper": solved + "\n\ndef same_list(x, y):\n    return False\n",
        "syntax-error": solved + "\ndef broken(:\n",
        "missing-exercise": _swap(solved, "def add_vectors(", "def add_vectors_renamed("),
        "stub-comment-kept": _swap(solved, SUM_LINE, "    # Exercise: write your code here, in place of the raise below.\n" + SUM_LINE),
        "line-above-the-block": _swap(solved, "    if len(a) != len(b):\n", "    print('debug')\n    if len(a) != len(b):\n"),
        "module-code": solved + "\nRunningMean.push = lambda self, value: 0.0\nprint('imported')\n",
        "signature": _swap(solved, "def add_vectors(a: list[float], b: list[float])", "def add_vectors(a, b=(1.0,))"),
        "class-helper": _swap(_swap(solved, "        self.count += 1\n", "        self._bump()\n"),
                              "    def push(self,", "    def _bump(self):\n        self.count += 1\n\n    def push(self,"),
        "runtime-patch": _swap(solved, SUM_LINE, "    import labs.lab90_fixture as lab\n    lab.same_list = lambda x, y: False\n" + SUM_LINE),
        "markers": (REPO / "tests" / "homework_fixtures" / "lab90_fixture.py").read_text(),
    }[case]
    done = splice("labs/lab90_fixture.py", course, submitted)
    ast.parse(done.text)
    namespace: dict = {}
    exec(compile(done.text, "labs/lab90_fixture.py", "exec"), namespace)
    add, mean, same = namespace["add_vectors"], namespace["RunningMean"](), namespace["same_list"]
    first = [1, 2]
    assert same(first, first), "the course's instrument ran"
    notes = "\n".join(done.notes())
    ours = {"yours"}
    if case in ("solved", "helpers", "import-in-block", "stub-comment-kept", "class-helper", "markers",
                "runtime-patch"):
        assert set(done.exercises.values()) == ours and not notes, (done.exercises, notes)
        assert case == "runtime-patch" or (add(first, [3, 4]) == [4.0, 6.0] and mean.push(2) == 2.0)
    if case == "solved":
        assert done.text == solved, "a file that changed only its exercises is run as it is"
    elif case == "helpers":
        assert done.helpers == ["math", "EPSILON", "_add"], done.helpers
    elif case == "instrument":
        assert "same_list (changed)" in notes and done.exercises["add_vectors"] == "yours"
    elif case == "global":
        assert done.exercises["add_vectors"].startswith("refused: it rebinds the course's `same_list` with `global`")
        with pytest.raises(RuntimeError, match="grading did not run your add_vectors"):
            add(first, [3, 4])
    elif case == "shadowing-helper":
        assert "a second definition of the course's same_list" in notes, notes
    elif case == "syntax-error":
        assert done.text == course and "does not parse (invalid syntax, line" in notes, notes
        with pytest.raises(NotImplementedError):
            add(first, [3, 4])
    elif case == "missing-exercise":
        assert done.exercises["add_vectors"].startswith("missing: not in the submitted file"), notes
        assert "add_vectors_renamed" in done.helpers
    elif case == "line-above-the-block":
        assert "your line 13 `print('debug')`, between the course's statements around the " \
            "exercise's code" in notes, notes
        assert "print('debug')" not in done.text
    elif case == "module-code":
        assert "`RunningMean.push = lambda self, value: 0.0`: module-level code that is not a definition" in notes
        assert "`print('imported')`" in notes and mean.push(4) == 4.0
    elif case == "signature":
        assert "the signature or decorators of add_vectors (yours differ)" in notes, notes
    elif case == "class-helper":
        assert done.helpers == ["RunningMean._bump"]
    elif case == "runtime-patch":  # run (the splice cannot stop it) and flagged for review
        assert len(done.review) == 1 and "assigns `lab.same_list`" in done.review[0], done.review


TWO_BLOCKS = f'''
def scaled_sum(values, scale):
    """Two blocks in one exercise, the course's code between them."""
    if not values:
        raise ValueError("no values")
    {BEGIN}
    total = sum(values)
    {END}
    checked = float(total)
    {BEGIN}
    return checked * scale
    {END}
'''


def test_splice_puts_each_of_several_blocks_of_one_exercise_in_place():
    """An exercise of two blocks: each gets the submitted code between the course's statements
    around it; a submission without the course's statement between them gets neither guessed."""
    from homework.solutions import stub_python
    from homework.splice import splice

    course = stub_python(TWO_BLOCKS, "labs/lab95_two.py").text
    mine = TWO_BLOCKS.replace(f"    {BEGIN}\n", "").replace(f"    {END}\n", "")
    mine = mine.replace("    total = sum(values)\n", "    total = 0\n    for v in values:\n        total += v\n")
    done = splice("labs/lab95_two.py", course, mine)
    assert done.text == mine and done.exercises == {"scaled_sum": "yours"}, done.text
    namespace: dict = {}
    exec(done.text, namespace)
    assert namespace["scaled_sum"]([1, 2], 3) == 9.0
    merged = splice("labs/lab95_two.py", course, mine.replace("    checked = float(total)\n", ""))
    assert merged.exercises["scaled_sum"].startswith("refused: the course's code between its blocks")
    assert "in scaled_sum: the course's `checked = float(total)` (yours differs or is missing" \
        in "\n".join(merged.notes())


def test_splice_folder_reports_renamed_missing_and_foreign_files(tmp_path):
    """A lab renamed or left out is graded as not done, a file the course lacks never runs, a lab
    without an exercise is the course's copy: each said in one line."""
    from homework.splice import splice_folder

    course, solved = _fixture_lab()
    (tmp_path / "course").mkdir()
    (tmp_path / "course" / "lab90_fixture.py").write_text(course)
    (tmp_path / "course" / "lab89_helpers.py").write_text("def helper():\n    return 1\n")
    submitted = {"labs/lab90_fixture_mine.py": solved.encode(),
                 "labs/lab89_helpers.py": b"def helper():\n    return 2\n"}
    splices, notes = splice_folder(tmp_path / "course", submitted, tmp_path / "out")
    assert notes == [
        "labs/lab89_helpers.py: a file without an exercise: the course's copy ran, not yours",
        "labs/lab90_fixture.py: exercise add_vectors missing: the file is not in the submission "
        "(graded as not done)",
        "labs/lab90_fixture.py: exercise RunningMean.push missing: the file is not in the submission "
        "(graded as not done)",
        "labs/lab90_fixture_mine.py: not a file of the course: not used"], notes
    assert (tmp_path / "out" / "lab89_helpers.py").read_text().endswith("return 1\n")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["lab89_helpers.py", "lab90_fixture.py"]


def test_check_runs_what_grading_runs_and_says_where_in_the_students_file(student, tmp_path):
    """In the student edition, check runs the course's own copy of each lab with the exercises
    spliced in, as grading does: an instrument edited to hide a mistake changes nothing (the
    test fails, and check lists what did not run), a helper of the student's own works, and a
    location in a message is the line of the student's file, also when lines of it were dropped."""
    out, _ = student
    work = tmp_path / "edition"
    shutil.copytree(out, work)
    course, solved = _fixture_lab()
    lab = work / "labs" / "lab90_fixture.py"
    lab.write_text(_swap(_swap(solved, SUM_LINE + "    return summed\n",
                               "    a[:] = [float(x) + float(y) for x, y in zip(a, b)]\n    return a\n"),
                         "    return x is y\n", "    return False\n"))
    lines: list[str] = []
    results, status = run_check(work, "90", timeout=60, log=lines.append)
    by_name = {r.exercise: r for r in results}
    assert status == 1 and by_name["add_vectors"].status == "failed", results
    assert "add_vectors returned its first input, changed: return a new list" in by_name["add_vectors"].message
    assert ("  labs/lab90_fixture.py: not run (the course's own code ran instead): same_list (changed)"
            in lines), lines
    assert not list((work / "runs" / "homework").glob("tree-*")), "check's copy of the course is removed"
    # a helper of the student's own; a dropped line above the exercise; a bug located in their file
    mine = _swap(solved, SUM_LINE, "    summed = [_add(x, y) for x, y in zip(a, b)]\n")
    mine = _swap(mine, "def add_vectors(", "print('dropped: module-level code')\n\n\ndef add_vectors(")
    mine = _swap(mine, "        self.count += 1\n", "        self.count += [][0]  # a bug\n")
    lab.write_text(mine + "\n\ndef _add(x, y):\n    return float(x) + float(y)\n")
    bug = 1 + mine.splitlines().index("        self.count += [][0]  # a bug")
    results, status = run_check(work, "90", timeout=60, log=lambda *a: None)
    by_name = {r.exercise: r for r in results}
    assert by_name["add_vectors"].status == "passed", by_name["add_vectors"]
    assert by_name["RunningMean.push"].message.endswith(
        f"at labs/lab90_fixture.py:{bug} `self.count += [][0]  # a bug`"), by_name["RunningMean.push"]


ROOT_CAUSE = """E1128 torch/distributed/elastic/multiprocessing/api.py:836] failed (exitcode: 1)
============================================================
run_script_path FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_14:25:49
  host      : localhost
  rank      : 2 (local_rank: 2)
  exitcode  : 1 (pid: 24516)
  error_file: /tmp/course-launch-x/error.json
  traceback : Traceback (most recent call last):
    File "/course/helpers/dist.py", line 105, in barrier
      dist.barrier()
  RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:52652
  
============================================================
"""


def test_a_failed_launch_names_the_exception_raised_first():
    """helpers.launch's first cause: the earliest of the ranks' error records and of what their
    exercises raised (homework.watch), whatever caught it; else torchrun's "Root Cause", gloo's
    source position dropped; else nothing."""
    from helpers.launch.torchrun import RankException, _first_cause, _raised

    timeout = (30.0, 0, 'Traceback (most recent call last):\n  File "x.py", line 1, in f\n'
                        "RuntimeError: [/__w/gloo/pair.cc:1] Timed out waiting 30000ms\n")
    index = RankException(1.0, 1, "ring_attention", 'Traceback (most recent call last):\n'
                          '  File "labs/lab11_ring_attention.py", line 290, in ring_attention\n'
                          "    [][0]\nIndexError: list index out of range\n")
    assert _first_cause([timeout], [index], "")[:2] == (1, index.text)
    assert _first_cause([timeout], [], "")[0] == 0
    rank, text, exercise, summary = _first_cause([], [], ROOT_CAUSE)
    assert (rank, exercise) == (2, "")
    assert _raised(text) == summary == "RuntimeError: Connection closed by peer [127.0.0.1]:52652"
    assert _first_cause([], [], "no summary here") is None


WATCHED = f'''
class Region:
    @staticmethod
    def backward(ctx, grad):
        """An exercise in a static method (torch.autograd.Function's backward)."""
        {BEGIN}
        return grad[ctx]
        {END}

    def step(self, value):
        """An exercise in a method."""
        {BEGIN}
        return 1 / value
        {END}


def plain(x):
    """Not an exercise."""
    return x[5]
'''


def test_watch_records_what_leaves_an_exercise_and_nothing_else(tmp_path):
    """homework.watch wraps a lab's exercises (static methods and methods too), records an
    exception as it leaves one (type, message, file and line in labs/, even when the caller
    catches it), re-raises it unchanged, and leaves other functions alone."""
    import importlib.util

    from homework import watch

    (tmp_path / "labs").mkdir()
    path = tmp_path / "labs" / "lab95_watched.py"
    path.write_text(WATCHED)
    spec = importlib.util.spec_from_file_location("lab95_watched", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert sorted(watch.watch_module(module)) == ["Region.backward", "Region.step"]
    assert isinstance(module.Region.__dict__["backward"], staticmethod)
    since = __import__("time").time()
    with pytest.raises(IndexError):
        module.Region.backward(3, [1])
    try:
        module.Region().step(0)
    except ZeroDivisionError:
        pass  # caught, as the tests' workers do: recorded all the same
    with pytest.raises(IndexError):
        module.plain([])
    records = watch.recorded(since)
    assert [(r["exercise"], r["line"], r["where"]) for r in records] == [
        ("Region.backward", "IndexError: list index out of range", "labs/lab95_watched.py:7 `return grad[ctx]`"),
        ("Region.step", "ZeroDivisionError: division by zero", "labs/lab95_watched.py:13 `return 1 / value`")]
    assert module.Region.step.__doc__ == "An exercise in a method.", "functools.wraps keeps what inspect reads"


def test_a_test_that_shows_a_later_ranks_gloo_error_is_located_at_the_first_exception(tmp_path):
    """The experts case: rank 1's forward raised IndexError, the test's worker caught it and went
    on, rank 0's forward then died of "Connection closed by peer" (gloo's source position in front
    of the message) and the test shows that. The location added is rank 1's, where it raised."""
    from types import SimpleNamespace

    from tests import harness

    script = (tmp_path / "test_lab11_experts.py").resolve()
    index = {"time": 1.0, "rank": 1, "exercise": "ExpertParallelMoE.forward",
             "line": "IndexError: list index out of range",
             "where": "labs/lab11_experts.py:268 `routed[0][9]`", "traceback": "...\nIndexError: x"}
    closed = {"time": 2.0, "rank": 0, "exercise": "ExpertParallelMoE.forward",
              "line": "RuntimeError: Connection closed by peer [127.0.0.1]:14771.",
              "where": "labs/lab11_experts.py:280 `dist.all_to_all_single(...)`", "traceback": "..."}
    harness._caught[script] = [[closed, index]]
    report = SimpleNamespace(failed=True, user_properties=[], sections=[], longreprtext=(
        "Failed: group rank 0 (top-1): ExpertParallelMoE.forward raised RuntimeError: "
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
        "by peer [127.0.0.1]:14771. This is typically caused by a remote worker crashing."))
    item = SimpleNamespace(path=script)
    harness.locate_failure(item, SimpleNamespace(excinfo=object(), start=0.0), report)
    assert report.user_properties == [("homework_where", "labs/lab11_experts.py:268 `routed[0][9]` "
                                       "(rank 1 raised IndexError: list index out of range there first)")]
    assert report.sections[0][1].startswith("rank 1 raised IndexError: list index out of range first, "
                                            "in ExpertParallelMoE.forward, at labs/lab11_experts.py:268")
    del harness._caught[script]


def test_a_launch_stopped_by_the_tests_timeout_keeps_what_its_ranks_raised(tmp_path, monkeypatch):
    """pytest-timeout stops a test whose launch hangs (rank 0 waits for rank 1, whose exercise
    raised and whose test caught it): the launch hands the ranks' records to the interrupting
    exception, and the timed-out setup, and the tests pytest gives the same error, get rank 1's
    location. (The launch is faked: a real hang takes as long as the timeout.)"""
    import json
    from types import SimpleNamespace

    from helpers.launch import torchrun
    from tests import harness

    record = {"time": 1.0, "rank": 1, "exercise": "rank_sum", "line": "IndexError: list index out of range",
              "where": "labs/lab91_fixture.py:8 `[][0]`", "traceback": "...IndexError..."}

    def stopped(cmd, env, timeout, stream, warm_start=False):
        (Path(env["COURSE_RESULTS_DIR"]) / "caught.rank1.0.json").write_text(json.dumps(record))
        raise RuntimeError("Timeout (>20.0s) from pytest-timeout.")  # as pytest-timeout's Failed

    monkeypatch.setattr(torchrun, "_run_streaming", stopped)
    script = (tmp_path / "test_lab91_fixture.py").resolve()
    script.write_text("")
    with pytest.raises(RuntimeError) as stopped_by:
        harness.launch_ranks(script, "cases", nproc=2)
    assert [c.rank for c in stopped_by.value.course_caught] == [1]
    for test in range(2):  # the test whose setup launched, and the next one of the module
        report = SimpleNamespace(failed=True, user_properties=[], sections=[],
                                 longreprtext="Failed: Timeout (>20.0s) from pytest-timeout.")
        harness.locate_failure(SimpleNamespace(path=script), SimpleNamespace(excinfo=object(), start=5.0 + test),
                               report)
        assert report.user_properties == [("homework_where", "labs/lab91_fixture.py:8 `[][0]` (rank 1 "
                                           "raised IndexError: list index out of range there first)")]
    del harness._caught[script]
