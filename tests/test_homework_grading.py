"""Grading that the graded code cannot fool (homework/grade.py and sandbox.py), attacked
for real.

Each attack is a small payload in a real submission archive of the synthetic course
(tests/homework_fixtures/course.py, lab 90: no torch, fast), graded in the real sandbox together
with unmodified submissions before and after it; each test asserts the attack's expected outcome:
the score is what the unmodified code gets, other students are unaffected, nothing is written
outside the sandbox's scratch, no process is left, the run completes, feedback holds no hidden
source, and the attempt is flagged. Grading runs only a submission's exercises and the helpers it
adds (homework.splice), so each payload runs as a student's code still can: from the body of a
helper class, at import (an exec in it, which the splice flags for review), or inside an exercise. These tests need bubblewrap (`./run.sh test` installs it
where it can): without it they fail with that message; they never skip. Instructor only: listed
in .instructor-only.
"""
from __future__ import annotations

import csv
import hashlib
import os
import shutil
import tarfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from homework.grade import GradingError, OutLock, check_out_dir, grade
from homework.release import transform
from homework.sandbox import INSTALL_HINT, Limits, SandboxUnavailable, probe
from tests.homework_fixtures.course import (FIXTURES, file_member, make_course, submission,
                                            tar_with)

TAG = f"homework-attack-{uuid.uuid4().hex}"   # in the command line of every process an attack leaves
LIMITS = Limits(memory=2 * 2**30, processes=128, file_size=16 * 2**20, scratch=64 * 2**20,
                shm=16 * 2**20)
HIDDEN = "tests/hidden/test_lab90_fixture.py"


@pytest.fixture(scope="module", autouse=True)
def sandbox_available():
    if shutil.which("bwrap") is None:
        pytest.fail(f"grading needs bubblewrap and this machine has none: {INSTALL_HINT}. "
                    "(./run.sh test installs it where it can, or says how.)", pytrace=False)
    try:
        probe(LIMITS)
    except SandboxUnavailable as exc:
        pytest.fail(f"no sandbox can be made on this machine: {exc}", pytrace=False)


# ---------------------------------------------------------------------------- the payloads
FORGE_IN_MEMORY = '''
import gc, pytest

class _Forge:  # every report says passed, whatever happened
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        report.outcome, report.longrepr = "passed", None
        report.user_properties[:] = []

for _obj in gc.get_objects():
    if isinstance(_obj, pytest.Config):
        _obj.pluginmanager.register(_Forge(), "forge")
        break
'''
FORGE_STREAM = '''
import atexit, gc, json, sys, pytest

_ids = []

class _Grab:
    def pytest_collection_finish(self, session):
        _ids[:] = [item.nodeid for item in session.items]

for _obj in gc.get_objects():
    if isinstance(_obj, pytest.Config):
        _obj.pluginmanager.register(_Grab(), "grab")
        break

def _append_passed():  # "passed" for every test, appended to the report stream at exit
    path = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--report-log="))
    with open(path, "a") as out:
        for nodeid in _ids:
            for when in ("setup", "call", "teardown"):
                out.write(json.dumps({"$report_type": "TestReport", "nodeid": nodeid, "when": when,
                                      "outcome": "passed", "longrepr": None, "duration": 0.0,
                                      "user_properties": []}) + "\\n")

atexit.register(_append_passed)
'''
FORGE_COMPLETE = '''
import gc, json, os, sys, pytest

class _Forge:  # a complete, well-ordered stream of passes, then exit before any test runs
    def pytest_collection_finish(self, session):
        path = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--report-log="))
        with open(path, "a") as out:
            for item in session.items:
                for when in ("setup", "call", "teardown"):
                    out.write(json.dumps({"$report_type": "TestReport", "nodeid": item.nodeid,
                                          "when": when, "outcome": "passed", "longrepr": None,
                                          "duration": 0.0, "user_properties": []}) + "\\n")
        os._exit(0)

for _obj in gc.get_objects():
    if isinstance(_obj, pytest.Config):
        _obj.pluginmanager.register(_Forge(), "forge")
        break
'''
TAMPER = '''
import os
for _target in {targets!r}:
    try:
        os.makedirs(os.path.dirname(_target), exist_ok=True)
        with open(_target, "a") as _f:
            _f.write("\\nraise SystemExit('TAMPERED')\\n")
    except OSError:
        pass
'''
LEAK = '''
import base64, glob, zlib
_SOURCE = "".join(open(p).read() for p in sorted(glob.glob("/course/tests/hidden/*.py")))
_PACKED = base64.b64encode(zlib.compress(_SOURCE.encode())).decode()
print(_SOURCE)

def add_vectors(a, b):
    raise AssertionError(_SOURCE + _PACKED)

class RunningMean:
    def push(self, value):
        raise ValueError(_PACKED + _SOURCE)
'''
DETACH = '''
import os, sys, time
_middle = os.fork()
if _middle == 0:  # a double fork, a new session, exec with an empty environment
    os.setsid()
    if os.fork() == 0:
        os.execve(sys.executable, [sys.executable, "-c",
                  "import sys, time\\nfor _ in range(600):\\n"
                  "    try:\\n        open(sys.argv[1], 'a').write('DETACHED\\\\n')\\n"
                  "    except OSError:\\n        pass\\n    time.sleep(0.1)", {csv!r}, {tag!r}], {{}})
    os._exit(0)
os.waitpid(_middle, 0)  # the grandchild is an orphan from here on
for _ in range(50):  # fifty sleepers
    if os.fork() == 0:
        try:
            os.execv("/bin/sh", ["sh", "-c", "sleep 120; :", {tag!r}])
        finally:
            os._exit(0)
time.sleep(3.0)  # the grader looks 4 times a second and flags an orphan seen twice: even on a busy machine
'''
KILL_PARENT = '''
import os, signal
for _pid in [os.getppid(), 1] + [int(p) for p in os.listdir("/proc") if p.isdigit()]:
    if _pid != os.getpid():
        try:
            os.kill(_pid, signal.SIGKILL)
        except OSError:
            pass
'''
FORK_BOMB = f'''
import os, time
try:
    for _ in range(5000):
        if os.fork() == 0:
            try:
                os.execv("/bin/sh", ["sh", "-c", "sleep 120; :", "{TAG}"])
            finally:
                os._exit(0)
except OSError:
    pass
time.sleep(0.6)
'''
MEMORY = '''
try:
    _hog = bytearray(3 * 2**30)
except MemoryError:
    _hog = None
'''
DISK = '''
import time
try:
    for _i in range(100):
        with open(f"/tmp/fill{_i}", "wb") as _f:
            _f.write(b"x" * 8 * 2**20)
except OSError:
    pass
time.sleep(0.6)
'''
FILE_SIZE = '''
with open("/tmp/big", "wb") as _f:
    _f.write(b"x" * 32 * 2**20)
'''
HANG = f'''
import signal, subprocess, sys, time
def add_vectors(a, b):
    if not a:  # only the hidden edge case hangs, ignoring pytest-timeout's alarm, with a child
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "{TAG}"],
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


def _gzip_bomb(path: Path, head: bytes, unit: bytes, repeats: int) -> Path:
    import gzip

    member = gzip.compress(unit, compresslevel=9)
    with open(path, "wb") as handle:
        handle.write(gzip.compress(head))
        handle.write(member * repeats)
    return path


def _header(name: str, kind: bytes, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, size
    return info.tobuf(format=tarfile.GNU_FORMAT)


# ---------------------------------------------------------------------------- one grading run
class Run:
    """What one grading run of every attack left behind."""

    def __init__(self, tmp: Path):
        self.course = make_course(tmp / "instructor")
        self.out = tmp / "grades"
        self.escaped = tmp / "escaped.txt"
        self.solution = (self.course / "labs" / "lab90_fixture.py").read_bytes()
        self.stubs = transform(self.course, "labs/lab90_fixture.py").data
        self.course_before = _snapshot(self.course)
        targets = ["/course/homework/plugin.py", f"/course/{HIDDEN}",
                   "/course/tests/conftest.py", "/course/pytest.ini", "/course/labs/lab90_fixture.py",
                   str(self.course / "tests" / "conftest.py"), str(self.course / HIDDEN),
                   str(self.out / "grades.csv"), str(self.out / "ada-1.md"), str(self.escaped),
                   os.path.expanduser("~/homework-escaped.txt")]
        stub = {"lab90_fixture.py": self.stubs}
        solved = {"lab90_fixture.py": self.solution}
        archives = {
            "ada-1": (solved, "ada"),
            "forge_in_memory": (_with(stub, FORGE_IN_MEMORY), "forge_in_memory"),
            "forge_stream": (_with(stub, FORGE_STREAM), "forge_stream"),
            "forge_complete": (_with(stub, FORGE_COMPLETE), "forge_complete"),
            "instrument": (_edited(solved, RETURNS_ITS_INPUT, BLIND_INSTRUMENT), "instrument"),
            "own_helper": (_edited({"lab90_fixture.py": solved["lab90_fixture.py"] + OWN_HELPER_CODE.encode()},
                                   OWN_HELPER), "own_helper"),
            "outside": (_plain(solved, "def add_vectors(a, b):\n    return []\n\n"
                                       "RunningMean.push = lambda self, value: 0.0\n"
                                       "same_list = lambda x, y: False\n"), "outside"),
            "tamper": (_with(stub, TAMPER.format(targets=targets)), "tamper"),
            "leak": (_with(stub, LEAK), "leak"),
            "detach": (_with(stub, DETACH.format(csv=str(self.out / "grades.csv"), tag=TAG)), "detach"),
            "kill_parent": (_with(stub, KILL_PARENT), "kill_parent"),
            "fork_bomb": (_with(stub, FORK_BOMB), "fork_bomb"),
            "memory": (_with(stub, MEMORY), "memory"),
            "disk": (_with(stub, DISK), "disk"),
            "file_size": (_with(stub, FILE_SIZE), "file_size"),
            "hang": (_with(solved, HANG), "hang"),
            "crash": (_with(solved, "\nimport os\nos._exit(3)\n"), "crash"),
            "flood": (_with(solved, FLOOD), "flood"),
            "carol-20250101T000000Z": (solved, "bob"),
            "ada-2": (solved, "ada"),
            "stubs": (stub, "stubs"),
        }
        paths = [submission(tmp / f"{name}.tar.gz", labs, student)
                 for name, (labs, student) in archives.items()]
        paths.insert(1, _gzip_bomb(tmp / "bomb_long_name.tar.gz",
                                   _header("././@LongLink", tarfile.GNUTYPE_LONGNAME, 2**30),
                                   b"a" * 2**20, 1024))
        paths.insert(2, _gzip_bomb(tmp / "bomb_folders.tar.gz", b"",
                                   _header("labs", tarfile.DIRTYPE, 0) * 1000, 1000))
        paths.insert(3, tar_with(tmp / "zipslip.tar.gz", [
            file_member("../" * 40 + str(self.escaped).lstrip("/"), b"x = 1\n"),
            file_member("labs/lab90_fixture.py", self.solution)]))
        self.names = [p.name[: -len(".tar.gz")] for p in paths]
        self.printed: list[str] = []
        start = time.monotonic()
        self.rows = {r.submission: r for r in grade(paths, self.out, self.course, timeout=2,
                                                    labs=["90"], grace=1, limits=LIMITS,
                                                    log=self.printed.append)}
        self.seconds = time.monotonic() - start
        time.sleep(0.3)  # a process that escaped would write now (it tries every 0.1 s)
        with open(self.out / "grades.csv", newline="") as handle:
            self.table = list(csv.reader(handle))
        self.feedback = {name: (self.out / f"{name}.md").read_text() for name in self.names}

    def score(self, name: str) -> float:
        return self.rows[name].score

    def flags(self, name: str) -> str:
        return "; ".join(self.rows[name].flags)


def _with(labs: dict[str, bytes], payload: str) -> dict[str, bytes]:
    """`payload` run in the lab's namespace when the lab is imported, from a class the student
    adds: the splice keeps such a class, and a class body runs at import."""
    return {**labs, "lab90_fixture.py": labs["lab90_fixture.py"]
            + f"\n\nclass _Payload:\n    exec({payload!r}, globals())\n".encode()}


def _plain(labs: dict[str, bytes], code: str) -> dict[str, bytes]:
    """`code` appended to the lab as it is: module-level code, which the splice never runs."""
    return {**labs, "lab90_fixture.py": labs["lab90_fixture.py"] + b"\n" + code.encode()}


# add_vectors that changes its first input and returns it (the tests read the lab's instrument
# same_list to catch that), handed in with that instrument edited to say "not the same list"
RETURNS_ITS_INPUT = ("    summed = [float(x) + float(y) for x, y in zip(a, b)]  # fixture solution, add_vectors\n"
                     "    return summed\n",
                     "    a[:] = [float(x) + float(y) for x, y in zip(a, b)]\n    return a\n")
BLIND_INSTRUMENT = ("    return x is y\n", "    return False\n")
# a helper function and an import of the student's own, which the exercise uses
OWN_HELPER = ("    summed = [float(x) + float(y) for x, y in zip(a, b)]  # fixture solution, add_vectors\n",
              "    summed = [_add(x, y) for x, y in zip(a, b)]\n")
OWN_HELPER_CODE = "\n\nimport math\n\n\ndef _add(x, y):\n    return math.fsum([float(x), float(y)])\n"


def _edited(labs: dict[str, bytes], *swaps: tuple[str, str]) -> dict[str, bytes]:
    text = labs["lab90_fixture.py"].decode()
    for old, new in swaps:
        assert old in text, old
        text = text.replace(old, new, 1)
    return {**labs, "lab90_fixture.py": text.encode()}


def _snapshot(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in folder.rglob("*") if p.is_file() and ".git" not in p.parts}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    return Run(tmp_path_factory.mktemp("attacks"))


def _left_behind() -> list[str]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if TAG in line:
            found.append(f"{proc.pid}: {line[:120]}")
    return found


# ---------------------------------------------------------------------------- what must hold
def test_every_archive_gets_a_row_in_order_and_the_controls_score_right(run):
    assert [row[0] for row in run.table[1:]] == run.names, "one row per archive, in the order given"
    header = run.table[0]
    assert header[:3] == ["submission", "score", "max_score"] and header[-2:] == ["note", "flags"]
    assert len(header) == 3 + 5 + 2, "the five real tests, no canary"
    for name in ("ada-1", "ada-2"):
        assert (run.score(name), run.rows[name].max_score) == (7, 7), run.feedback[name]
        assert run.rows[name].flags == [], run.flags(name)
    assert run.score("stubs") == 0 and run.rows["stubs"].flags == []
    assert "not implemented" in run.feedback["stubs"]


@pytest.mark.parametrize("attack", ["forge_in_memory", "forge_stream", "forge_complete"])
def test_forged_results_do_not_score_and_are_flagged(run, attack):
    assert run.score(attack) == run.score("stubs") == 0, run.feedback[attack]
    assert "FORGED" in run.flags(attack), run.flags(attack)
    assert run.rows[attack].note.startswith("score withheld")
    if attack == "forge_stream":
        assert "tampered" in run.flags(attack)
    else:
        assert "(must fail) reported passed" in run.flags(attack)


def test_code_outside_the_exercises_never_runs_and_the_feedback_says_so(run):
    """The issue's case in small: an exercise the tests catch through an instrument of its lab
    (same_list), handed in with that instrument edited to hide it, gets the score its exercise
    earns, with a note naming what did not run; module-level code and a second definition of an
    exercise never run; a student's own helper function and import work."""
    assert run.score("instrument") == 7 - 2, run.feedback["instrument"]  # both new-list tests fail
    assert "| public: test_add_vectors_small | add_vectors | 0/1 | failed: an assertion did not " \
           "hold |" in run.feedback["instrument"]
    assert "labs/lab90_fixture.py: not run (the course's own code ran instead): same_list (changed)" \
        in run.feedback["instrument"], run.feedback["instrument"]
    assert run.rows["instrument"].note.startswith("1 part(s) of the submitted labs not run")
    assert run.score("outside") == 7, run.feedback["outside"]
    for what in ("a second definition of the course's add_vectors",
                 "`RunningMean.push = lambda self, value: 0.0`: module-level code that is not a "
                 "definition", "`same_list = lambda x, y: False`: it rebinds the course's same_list"):
        assert what in run.feedback["outside"], (what, run.feedback["outside"])
    assert (run.score("own_helper"), run.rows["own_helper"].note, run.flags("own_helper")) == (7, "", ""), \
        run.feedback["own_helper"]
    assert "Not run from your files" not in run.feedback["ada-1"] and run.rows["ada-1"].note == ""
    # code that can still change the course's code at run time is run, and flagged for review
    assert "calls exec(): it can change the course's code as the tests run; review it" \
        in run.flags("tamper"), run.flags("tamper")


def test_nothing_outside_the_sandbox_is_written(run):
    assert run.score("tamper") == 0
    assert _snapshot(run.course) == run.course_before, "the instructor's checkout changed"
    assert not run.escaped.exists(), "a file was written outside the sandbox"
    assert not Path(os.path.expanduser("~/homework-escaped.txt")).exists()
    for name, text in run.feedback.items():
        assert "TAMPERED" not in text and "DETACHED" not in text, name
    assert "TAMPERED" not in (run.out / "grades.csv").read_text()
    # the grading tree was read-only: the submissions graded after the attack scored normally
    assert run.score("ada-2") == 7


def test_feedback_never_carries_hidden_source(run):
    docstrings = {"Empty lists and negative, fractional values.",
                  "The result is a new list, not one of the inputs.",
                  "The running mean after each of five values."}  # shown on purpose
    hidden = [line.strip() for line in (FIXTURES / "hidden_lab90.py").read_text().splitlines()
              if len(line.strip()) >= 12 and line.strip().strip('"') not in docstrings
              and not line.strip().startswith(("@pytest", "def ", "from ", "import "))]
    assert len(hidden) >= 5
    leaked = {name: [l for l in hidden if l in text] for name, text in run.feedback.items()}
    assert not any(leaked.values()), leaked
    csv_text = (run.out / "grades.csv").read_text()
    assert not [l for l in hidden if l in csv_text]
    assert run.score("leak") == 0
    assert "failed: an assertion did not hold" in run.feedback["leak"]
    assert "| hidden: test_add_vectors_edge_cases | add_vectors | 0/2 | failed: an assertion did " \
           "not hold | Empty lists and negative, fractional values. |" in run.feedback["leak"]


def test_no_process_survives_and_the_grader_survives(run):
    assert _left_behind() == []
    for name in ("detach", "kill_parent", "fork_bomb"):
        assert run.score(name) == 0, run.feedback[name]
    assert "still running at the end were killed with the sandbox" in run.flags("detach")
    assert "process limit (128 tasks) was reached" in run.flags("fork_bomb")
    # the grades.csv read after the grader returned (and a pause) is the grader's own
    assert "DETACHED" not in (run.out / "grades.csv").read_text()
    assert run.names[-1] == "stubs" and run.table[-1][0] == "stubs", "later submissions were graded"


def test_limits_hold_and_are_flagged(run):
    for name in ("memory", "disk", "file_size"):
        assert run.score(name) == 0, run.feedback[name]
    assert "scratch space (/tmp) filled up" in run.flags("disk")
    assert "file size limit" in run.flags("file_size")
    assert "could not load the test file" in run.feedback["file_size"]


def test_hangs_crashes_and_floods_cost_only_their_own_tests(run):
    assert run.score("hang") == 5, run.feedback["hang"]  # the hidden edge case (2 points) timed out
    assert "| hidden: test_add_vectors_edge_cases | add_vectors | 0/2 | timed out |" in run.feedback["hang"]
    assert "ignored its timeout" in run.flags("hang")
    assert run.score("crash") == 0 and "could not load the test file" in run.feedback["crash"]
    assert run.score("flood") == 7
    assert (run.out / "logs" / "flood.log").stat().st_size < 1_000_000


def test_bombs_and_unsafe_archives_are_rejected_and_grade_says_so(run):
    for name, reason in (("bomb_long_name", "long-name header"), ("bomb_folders", "entries"),
                         ("zipslip", "outside the destination")):
        row = run.rows[name]
        assert row.score == 0 and not row.graded and reason in row.note, row.note
    assert not run.escaped.exists()


def test_a_manifest_that_does_not_match_its_file_name_is_flagged(run):
    assert run.score("carol-20250101T000000Z") == 7
    assert "does not match the file name" in run.flags("carol-20250101T000000Z")
    assert "Student (from the manifest): bob" in run.feedback["carol-20250101T000000Z"]


PARALLEL_WRITER = f"""
import pathlib, time
pathlib.Path("/tmp/{TAG}-marker").write_text("another submission was here")
time.sleep(3)
"""
PARALLEL_READER = f"""
import pathlib, time
time.sleep(1.5)
if pathlib.Path("/tmp/{TAG}-marker").exists():  # the other submission's scratch: must not be seen
    def add_vectors(a, b):
        return []
"""


def test_submissions_graded_at_once_each_in_a_sandbox_of_its_own(tmp_path):
    """--jobs 2: two submissions are graded at the same time, and neither sees the other's files:
    one writes into its /tmp while the other looks there (it would then break itself)."""
    course = make_course(tmp_path / "instructor")
    solved = (course / "labs" / "lab90_fixture.py").read_bytes()
    paths = [submission(tmp_path / f"{name}.tar.gz", {"lab90_fixture.py": solved + payload.encode()}, name)
             for name, payload in (("writer", PARALLEL_WRITER), ("reader", PARALLEL_READER))]
    rows = grade(paths, tmp_path / "grades", course, labs=["90"], jobs=2, log=lambda *a: None)
    assert [(row.submission, row.score) for row in rows] == [("writer", 7), ("reader", 7)], \
        [(row.submission, row.score, row.note, row.flags) for row in rows]
    writer, reader = rows
    assert abs(writer.started - reader.started) < min(writer.seconds, reader.seconds), (
        "with --jobs 2 the two submissions must be graded at the same time: "
        f"started {reader.started - writer.started:+.1f} s apart, took {writer.seconds:.1f} and "
        f"{reader.seconds:.1f} s")
    assert not Path(f"/tmp/{TAG}-marker").exists(), "a sandbox's /tmp is its own, gone with it"


def test_default_jobs_follow_the_cores():
    """One submission at a time per 4 cores (a test launches up to 4 ranks), at least one."""
    from homework.grade import default_jobs

    assert [default_jobs(cores) for cores in (1, 2, 4, 7, 8, 64)] == [1, 1, 1, 1, 2, 16]


# ---------------------------------------------------------------------------- budget, torch, workflow
def test_a_submission_that_hangs_everywhere_stops_at_its_time_budget(tmp_path):
    from homework.runner import Direct, run_tests

    course = make_course(tmp_path)
    (course / "tests" / "public" / "test_lab92_hangs.py").write_text(
        "import signal, time\n" + "".join(
            f"def test_hang_{i}():\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
            f"    time.sleep(600)  # {TAG}\n" for i in range(5)))
    start = time.monotonic()
    run = run_tests(Direct(course), ["tests/public/test_lab92_hangs.py"], timeout=1, grace=1,
                    deadline=start + 3)
    assert time.monotonic() - start < 3 + 30, "the budget bounds a submission's time"
    assert "the time budget ran out" in run.notes
    outcomes = [run.outcomes[t.nodeid].outcome for t in run.tests]
    assert set(outcomes) <= {"timeout", "not_run"} and outcomes[-1] == "not_run", outcomes
    assert _left_behind() == []


def test_torchrun_and_gloo_work_inside_the_sandbox(tmp_path):
    course = make_course(tmp_path / "instructor", labs=("91",))
    solved = (course / "labs" / "lab91_fixture.py").read_bytes()
    paths = [submission(tmp_path / "ada-1.tar.gz", {"lab91_fixture.py": solved}, "ada")]
    rows = grade(paths, tmp_path / "grades", course, timeout=120, labs=["91"], log=lambda *a: None)
    assert (rows[0].score, rows[0].max_score) == (1, 1), (tmp_path / "grades" / "logs" / "ada-1.log").read_text()[-3000:]
    assert rows[0].flags == []


def test_out_inside_the_course_is_refused_unless_git_ignores_it(tmp_path):
    course = make_course(tmp_path)
    for out in (course, course / "feedback", tmp_path):
        with pytest.raises(GradingError):
            check_out_dir(course, out)
    check_out_dir(course, course / "grades")      # listed in .gitignore
    check_out_dir(course, tmp_path / "elsewhere")


def test_a_second_grader_on_the_same_out_is_refused(tmp_path):
    course = make_course(tmp_path / "instructor")
    out = tmp_path / "grades"
    out.mkdir()
    archive_path = submission(tmp_path / "ada-1.tar.gz", {"lab90_fixture.py": b"x = 1\n"}, "ada")
    with OutLock(out):
        with pytest.raises(GradingError, match="another grade is writing"):
            grade([archive_path], out, course, labs=["90"], log=lambda *a: None)
    assert not (out / "grades.csv").exists()


def test_relative_paths_are_the_callers_and_a_missing_archive_fails_the_run(tmp_path, monkeypatch):
    from homework import __main__ as cli

    course = make_course(tmp_path / "instructor")
    solved = (course / "labs" / "lab90_fixture.py").read_bytes()
    here = tmp_path / "here"
    here.mkdir()
    submission(here / "ada-1.tar.gz", {"lab90_fixture.py": solved}, "ada")
    monkeypatch.setattr(cli, "ROOT", course)
    monkeypatch.setenv("COURSE_CALLER_CWD", str(here))
    monkeypatch.chdir(course)  # where run.sh runs Python from
    code = cli.main(["grade", "ada-1.tar.gz", "missing.tar.gz", "--out", "out", "--lab", "90",
                     "--timeout", "60"])
    assert code == 1, "an archive that could not be graded makes grade fail"
    with open(here / "out" / "grades.csv", newline="") as handle:
        rows = {row[0]: row for row in csv.reader(handle)}
    assert rows["ada-1"][1] == "7" and "no such file" in rows["missing"][-2]


def test_grade_refuses_without_a_sandbox_unless_unsafe(tmp_path, monkeypatch):
    import homework.sandbox as sandbox

    course = make_course(tmp_path / "instructor")
    solved = (course / "labs" / "lab90_fixture.py").read_bytes()
    path = submission(tmp_path / "ada-1.tar.gz", {"lab90_fixture.py": solved}, "ada")
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(GradingError, match="bubblewrap") as refused:
        grade([path], tmp_path / "grades", course, labs=["90"], log=lambda *a: None)
    assert "--unsafe" in str(refused.value)
    printed: list[str] = []
    rows = grade([path], tmp_path / "grades", course, labs=["90"], unsafe=True, log=printed.append)
    assert rows[0].score == 7 and "without a sandbox" in "; ".join(rows[0].flags)
    assert "WITHOUT a sandbox" in printed[0]
