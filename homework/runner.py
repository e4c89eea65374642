"""Run test files in as few pytest processes as possible, each test bounded in time.

One pytest process runs every file given (tests/public and tests/hidden are packages, so their
same-named files import side by side). Inside it, pytest-timeout interrupts a test that runs past
`timeout` (signal method: the process survives and moves on). From outside, a watchdog kills the
process and everything it started when no report arrives for `timeout + grace` seconds (a test that
ignores the alarm, a hang in C code), blames the test that was running, and starts a new process
for the tests not yet run; a process that dies (os._exit, a segfault) is handled the same way.

Reports come from pytest-reportlog (one JSON line per setup/call/teardown, flushed at once) through
a FIFO, and are checked as they arrive: a test passes only with its setup, call and teardown
reported passed, in order, once each. Anything else a pytest process would never write (a report
twice, a report for a test that is not the one running, an unreadable line) is recorded as
`tampering`: the code under test writes to the same channel, see homework.grade.

Where the process runs is the caller's choice: `Direct` (the student's own checks, under the
helpers.launch.procs guard that kills the whole tree) or homework.sandbox.Sandbox (grading).
Output is drained and only its head and tail kept, so a flood costs neither memory nor disk.
"""
from __future__ import annotations

import collections
import json
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers.launch import procs
from homework.plugin import CATEGORIES, CATEGORY_KEY, COLLECTION_OPTION, STUB_KEY, WHERE_KEY

DEFAULT_TIMEOUT_S = 120.0
OUTPUT_KEEP_BYTES = 64_000          # head and tail of each pytest process's output kept for logs
MAX_FILE_BYTES = 256 * 2**20        # no test may write a file bigger than this
MAX_LINE_BYTES = 16 * 2**20         # a report line longer than this is dropped (not trusted anyway)
TICK_S = 0.25                       # how often the executor looks at what runs (sandbox: processes)
STARTUP_S = 60.0                    # extra time to start pytest and import the tests (busy machines)
MESSAGE_CHARS = 400
MAX_TAMPERING = 20                  # anomalies kept per process (the rest are counted as "more")
# what a test's result can be; grading feedback shows only these words, never a message
OUTCOMES = ("passed", "failed", "error", "not_implemented", "skipped", "timeout", "crashed",
            "load_error", "not_run")
PLUGINS = ("pytest_timeout", "pytest_reportlog.plugin", "homework.plugin")


@dataclass
class TestInfo:
    nodeid: str
    file: str
    exercise: str | None
    points: float
    doc: str = ""     # first line of the test's docstring


@dataclass
class Outcome:
    nodeid: str
    outcome: str      # one of OUTCOMES
    message: str = "" # first line of the error: for `check` only, never in grading feedback
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"


@dataclass
class RunResult:
    tests: list[TestInfo]
    outcomes: dict[str, Outcome]
    tampering: list[str] = field(default_factory=list)   # reports no pytest would write
    notes: list[str] = field(default_factory=list)       # kills, limits, leftovers (flags)
    processes: int = 0                                    # pytest processes started


def child_env(tree: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a pytest process run directly (not in the sandbox) on `tree`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # an outer pytest's
    env["PYTHONPATH"] = str(tree)  # only the tree under test: never the instructor's own checkout
    env.update(PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    env.setdefault("COURSE_SMOKE", "1")
    env.setdefault("MPLBACKEND", "Agg")
    env.update(extra or {})
    return env


def pytest_args(targets: list[str], timeout: float, extra: list[str] = ()) -> list[str]:
    """`python` arguments for one pytest process (plugins loaded explicitly: autoload is off)."""
    plugins = [arg for name in PLUGINS for arg in ("-p", name)]
    return ["-m", "pytest", *plugins, "-p", "no:cacheprovider", "-q", "-s", "--no-header",
            "-o", "console_output_style=classic", "--continue-on-collection-errors",
            f"--timeout={timeout:g}", "--timeout-method=signal", *extra, *targets]


# ---------------------------------------------------------------------------- running directly
def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))


class Direct:
    """pytest as a child of a helpers.launch.procs guard on `tree`: stopping it ends the whole tree.
    No isolation: for the student's own checks (and `grade --unsafe`)."""

    kind = "direct"

    def __init__(self, tree: Path, env: dict[str, str] | None = None):
        self.tree = Path(tree)
        self.env = env if env is not None else child_env(self.tree)

    def start(self, args: list[str], events: Path, collection: Path | None = None) -> "DirectRun":
        extra = [f"--report-log={events}"] + ([f"{COLLECTION_OPTION}={collection}"] if collection else [])
        guarded = [sys.executable, "-m", "helpers.launch.procs", "guard", "--", sys.executable, *args, *extra]
        proc = subprocess.Popen(guarded, cwd=self.tree, env=self.env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_limit_file_size)
        return DirectRun(proc)


class DirectRun:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def tick(self) -> None:
        pass

    def stop(self) -> None:
        procs.stop(self.proc, wait=2.0)

    def notes(self) -> list[str]:
        return []

    def exit_code(self) -> int | None:
        code = self.proc.returncode
        return code - 128 if code is not None and code > 128 else code  # the guard's 128 + N


# ---------------------------------------------------------------------------- output and reports
class _Drain:
    """Reads a pipe to its end, keeping only the first and last `keep` bytes."""

    def __init__(self, pipe, keep: int):
        self.head = bytearray()
        self.tail: collections.deque[bytes] = collections.deque()
        self.tail_bytes = 0
        self.total = 0
        self.keep = keep
        self.thread = threading.Thread(target=self._run, args=(pipe,), daemon=True)
        self.thread.start()

    def _run(self, pipe) -> None:
        fd = pipe.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            self.total += len(chunk)
            room = self.keep - len(self.head)
            if room > 0:
                self.head += chunk[:room]
                chunk = chunk[room:]
            if chunk:
                self.tail.append(chunk)
                self.tail_bytes += len(chunk)
                while self.tail_bytes - len(self.tail[0]) >= self.keep:
                    self.tail_bytes -= len(self.tail.popleft())
        pipe.close()

    def text(self) -> str:
        self.thread.join(timeout=5)
        tail = b"".join(self.tail)[-self.keep:]
        dropped = self.total - len(self.head) - len(tail)
        middle = f"\n[... {dropped} bytes of output dropped ...]\n".encode() if dropped > 0 else b""
        return (bytes(self.head) + middle + tail).decode("utf-8", "replace")


def first_line(text: str) -> str:
    """The first line of a message; one more when the first ends with a colon ("launch failed:")
    unless it starts a traceback."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[0]
    if line.endswith(":") and len(lines) > 1 and not lines[1].startswith(("Traceback", "File ", "---")):
        line = f"{line} {lines[1]}"
    return line if len(line) <= MESSAGE_CHARS else line[: MESSAGE_CHARS - 3] + "..."


def _message(report: dict) -> str:
    longrepr = report.get("longrepr")
    if isinstance(longrepr, list) and len(longrepr) == 3:  # a skip: (path, line, reason)
        return first_line(str(longrepr[2]))
    if isinstance(longrepr, dict):
        crash = longrepr.get("reprcrash") or {}
        if crash.get("message"):
            return first_line(crash["message"])
    lines = [l for l in str(longrepr or "").splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("E ")]  # pytest's "E   SomeError: ..." lines
    return first_line((errors or lines or [""])[-1].lstrip("E").strip())


def _properties(report: dict) -> dict[str, str]:
    found = {}
    for pair in report.get("user_properties") or []:
        if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str):
            found.setdefault(pair[0], str(pair[1]))
    return found


def _summary(report: dict) -> dict:
    """What a phase report decides, kept small (a report's traceback can be megabytes)."""
    props = _properties(report)
    category = props.get(CATEGORY_KEY)
    return {"outcome": report.get("outcome"), "xfail": "wasxfail" in report,
            "category": category if category in CATEGORIES else "error",
            "stub": props.get(STUB_KEY, "")[:MESSAGE_CHARS], "message": _message(report),
            "where": props.get(WHERE_KEY, "")[:MESSAGE_CHARS // 2],
            "duration": float(report.get("duration") or 0) if isinstance(report.get("duration"), (int, float)) else 0.0}


def test_outcome(nodeid: str, phases: dict[str, dict]) -> Outcome:
    """A finished test's outcome from its phases: passed needs setup, call and teardown passed."""
    seconds = sum(phase["duration"] for phase in phases.values())
    for when in ("setup", "call", "teardown"):
        phase = phases.get(when)
        if phase is None:
            continue
        if phase["outcome"] == "failed":
            kind = phase["category"]
            message = phase["stub"] or phase["message"]
            if kind == "not_implemented" and not message.startswith("NotImplementedError"):
                message = f"NotImplementedError: {message}"
            elif phase.get("where") and phase["where"] not in message:  # raised in the labs
                tail = f" at {phase['where']}"
                room = MESSAGE_CHARS - len(tail)
                message = (message if len(message) <= room else message[: room - 3] + "...") + tail
            return Outcome(nodeid, {"assertion": "failed"}.get(kind, kind),
                           message if when == "call" else f"in {when}: {message}", seconds)
        if phase["outcome"] == "skipped" and not phase["xfail"]:
            return Outcome(nodeid, "skipped", phase["message"], seconds)
    if "call" not in phases and not phases.get("setup", {}).get("xfail"):
        return Outcome(nodeid, "error", "the test body never ran", seconds)
    return Outcome(nodeid, "passed", "", seconds)


class Reports:
    """The reports of one pytest process, checked as they arrive."""

    def __init__(self, expected: set[str] | None):
        self.expected = expected          # None: every test is expected (no trusted collection)
        self.phases: dict[str, dict[str, dict]] = {}
        self.finished: list[str] = []
        self.running: str | None = None
        self.modules: dict[str, str] = {}  # test file -> "" (collected) or the collection error
        self.tampering: list[str] = []
        self.dropped = 0                   # oversized lines, not read
        self._partial = bytearray()
        self._skipping = False

    def feed(self, data: bytes) -> int:
        """Take a chunk of the stream; return how many complete lines it held."""
        if len(self.tampering) > MAX_TAMPERING:  # forged beyond doubt: reading on costs only time
            return data.count(b"\n")
        pieces = data.split(b"\n")
        for index, piece in enumerate(pieces):
            if not self._skipping:
                self._partial += piece
                if len(self._partial) > MAX_LINE_BYTES:
                    self._partial.clear()
                    self._skipping = True
                    self.dropped += 1
            if index < len(pieces) - 1:  # a newline followed this piece
                if not self._skipping and len(self.tampering) <= MAX_TAMPERING:
                    self._line(bytes(self._partial))
                self._partial.clear()
                self._skipping = False
        return len(pieces) - 1

    def _tampered(self, what: str) -> None:
        if len(self.tampering) < MAX_TAMPERING:
            self.tampering.append(what)
        elif len(self.tampering) == MAX_TAMPERING:
            self.tampering.append("... and more")

    def _odd(self, what: str) -> None:
        if not self.dropped:  # a dropped line can explain an order problem; not a forgery by itself
            self._tampered(what)

    def _line(self, raw: bytes) -> None:
        try:
            report = json.loads(raw)
        except ValueError:
            self._tampered("an unreadable line in the report stream")
            return
        if not isinstance(report, dict):
            self._tampered("a report that is not a JSON object")
            return
        kind = report.get("$report_type")
        nodeid = report.get("nodeid")
        if kind == "CollectReport" and isinstance(nodeid, str) and nodeid.endswith(".py") and "::" not in nodeid:
            if report.get("outcome") == "failed":
                self.modules[nodeid] = _message(report) or "the test file could not be loaded"
            else:
                self.modules.setdefault(nodeid, "")
            return
        if kind != "TestReport" or not isinstance(nodeid, str):
            return
        if self.expected is not None and nodeid not in self.expected:
            return  # not a test we grade: whatever it says does not count
        when = report.get("when")
        phases = self.phases.setdefault(nodeid, {})
        if when not in ("setup", "call", "teardown") or when in phases or nodeid in self.finished:
            self._tampered(f"{nodeid}: a second {when!s} report")
            return
        if when == "setup":
            if self.running is not None:
                self._odd(f"{nodeid}: started while {self.running} was running")
            self.running = nodeid
        elif self.running != nodeid or "setup" not in phases:
            self._odd(f"{nodeid}: a {when} report for a test that was not running")
        phases[when] = _summary(report)
        if when == "teardown":
            self.finished.append(nodeid)
            if self.running == nodeid:
                self.running = None


class _Events:
    """The read end of a FIFO, opened before the writer exists; read without blocking."""

    def __init__(self, path: Path):
        os.mkfifo(path, 0o600)
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)

    def read(self, wait: float) -> bytes:
        ready, _, _ = select.select([self.fd], [], [], wait)
        if not ready:
            return b""
        try:
            return os.read(self.fd, 1 << 20)
        except BlockingIOError:
            return b""

    def close(self) -> None:
        os.close(self.fd)


# ---------------------------------------------------------------------------- one process
@dataclass
class _Attempt:
    reports: Reports
    reason: str         # "" | "timeout" | "budget"
    code: int | None    # pytest's exit code, or -N when a signal N ended it
    output: str
    collection: list[TestInfo] | None
    notes: list[str]


def _run_once(executor, targets: list[str], timeout: float, grace: float,
              deadline: float | None, expected: set[str] | None, extra: list[str],
              want_collection: bool) -> _Attempt:
    with tempfile.TemporaryDirectory(prefix="homework-run-") as tmp:
        events = _Events(Path(tmp) / "events")
        os.chmod(events.path, 0o622)  # a sandboxed pytest runs as another user: it may write only
        collection_path = Path(tmp) / "collection.json" if want_collection else None
        run = executor.start(pytest_args(targets, timeout, extra), events.path, collection_path)
        drain = _Drain(run.proc.stdout, OUTPUT_KEEP_BYTES)
        reports = Reports(expected)
        last_activity = time.monotonic() + STARTUP_S  # until the tests are collected
        last_tick = 0.0
        reason = ""
        try:
            while run.proc.poll() is None:
                if reports.feed(events.read(0.05)):
                    last_activity = time.monotonic()
                now = time.monotonic()
                if now - last_tick > TICK_S:
                    run.tick()
                    last_tick = now
                if now - last_activity > timeout + grace:
                    reason = "timeout"
                    break
                if deadline is not None and now > deadline:
                    reason = "budget"
                    break
        finally:  # also on Ctrl-C: nothing of the run survives it
            run.stop()
            until = time.monotonic() + 5.0  # what is left in the FIFO (a writer that survived: stop)
            while time.monotonic() < until:
                data = events.read(0)
                if not data:
                    break
                reports.feed(data)
            events.close()
        collection = None
        if collection_path is not None and collection_path.is_file():
            try:
                collection = [TestInfo(t["nodeid"], t["file"], t.get("exercise"),
                                       float(t.get("points", 1)), t.get("doc", ""))
                              for t in json.loads(collection_path.read_text())]
            except (ValueError, KeyError, TypeError):
                collection = None
        return _Attempt(reports, reason, run.exit_code(), drain.text(), collection, run.notes())


def exit_text(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# ---------------------------------------------------------------------------- the whole run
def run_tests(executor, files: list[str], expected: list[TestInfo] | None = None, *,
              timeout: float = DEFAULT_TIMEOUT_S, grace: float | None = None,
              deadline: float | None = None, log_path: Path | None = None,
              on_outcome=None) -> RunResult:
    """Run the tests of `files` in one pytest process (more after a kill or crash).

    `expected` (from a trusted collection) says which tests must get an outcome; reports about any
    other test are ignored. Without it the first process's own collection decides, and a file that
    dies before its tests are collected gets one outcome under the file's own name.
    """
    grace = max(5.0, 0.1 * timeout) if grace is None else grace
    tests: list[TestInfo] = list(expected) if expected is not None else []
    trusted = {t.nodeid for t in tests} if expected is not None else None
    outcomes: dict[str, Outcome] = {}
    result = RunResult(tests, outcomes)

    def settle(outcome: Outcome) -> None:
        if outcome.nodeid not in outcomes:
            outcomes[outcome.nodeid] = outcome
            if on_outcome:
                on_outcome(outcome)

    def note(text: str) -> None:
        if text not in result.notes:
            result.notes.append(text)

    def as_file(file: str) -> TestInfo:
        info = TestInfo(file, file, None, 1.0)
        tests.append(info)
        return info

    unknown = [] if expected is not None else list(files)  # files whose tests are not known yet
    first = True
    while True:
        remaining = [t for t in tests if t.nodeid not in outcomes]
        if not remaining and not unknown:
            break
        if deadline is not None and time.monotonic() > deadline:
            for test in remaining + [as_file(f) for f in unknown]:
                settle(Outcome(test.nodeid, "not_run", "not run: the time budget ran out"))
            note("the time budget ran out")
            break
        targets = list(files) if first else unknown + [t.nodeid for t in remaining]
        first = False
        attempt = _run_once(executor, targets, timeout, grace, deadline, trusted, [],
                            want_collection=bool(unknown))
        reports = attempt.reports
        result.processes += 1
        for text in attempt.notes + _limit_notes(attempt.output):
            note(text)
        result.tampering += reports.tampering
        if log_path is not None:
            with open(log_path, "a", encoding="utf-8", errors="replace") as log:
                shown = " ".join(targets[:6]) + (" ..." if len(targets) > 6 else "")
                log.write(f"$ pytest {shown}\n{attempt.output}\n[{exit_text(attempt.code)}"
                          f"{'; killed: ' + attempt.reason if attempt.reason else ''}]\n\n")
        if unknown:
            if attempt.collection is not None:
                known = {t.nodeid for t in tests}
                tests += [t for t in attempt.collection if t.nodeid not in known]
                for file in [f for f in unknown if reports.modules.get(f)]:  # it did not import
                    settle(Outcome(as_file(file).nodeid, "load_error",
                                   f"the test file could not be loaded: {reports.modules[file]}"))
                unknown = []
            else:  # it died or hung while collecting: blame the file being loaded, retry the rest
                for file in [f for f in unknown if reports.modules.get(f)]:
                    settle(Outcome(as_file(file).nodeid, "load_error",
                                   f"the test file could not be loaded: {reports.modules[file]}"))
                loading = [f for f in unknown if f not in reports.modules][:1]
                if attempt.reason != "budget":
                    for file in loading:
                        settle(Outcome(as_file(file).nodeid, _load_kind(attempt),
                                       _load_failure(attempt, timeout)))
                    unknown = [f for f in unknown if f not in reports.modules and f not in loading]
                    if not loading:  # collected everything, yet no collection: give up on them
                        for file in unknown:
                            settle(Outcome(as_file(file).nodeid, "load_error", _load_failure(attempt, timeout)))
                        unknown = []
                continue
        for nodeid in reports.finished:
            settle(test_outcome(nodeid, reports.phases[nodeid]))
        for test in tests:  # files that failed to import: their tests cannot run
            error = reports.modules.get(test.file)
            if error and test.nodeid not in reports.phases:
                settle(Outcome(test.nodeid, "load_error", f"the test file could not be loaded: {error}"))
        remaining = [t for t in tests if t.nodeid not in outcomes]
        if not remaining:
            continue
        if attempt.reason == "budget":
            continue  # the deadline check above settles the rest
        blamed = _blame(reports, remaining)
        if attempt.reason == "timeout":
            note("a test ignored its timeout: its processes were killed")
            for test in blamed:
                settle(Outcome(test.nodeid, "timeout", f"Timeout: the test ran past {timeout:g} s "
                                                       "and did not stop; its processes were killed",
                               timeout))
        elif reports.running or attempt.code not in (0, 1, 5):
            if attempt.code is not None and attempt.code < 0:
                note(f"a test process was {exit_text(attempt.code)}")
            loading = blamed[0].file not in reports.modules
            for test in blamed:
                settle(Outcome(test.nodeid, "load_error" if loading else "crashed",
                               _load_failure(attempt, timeout) if loading else
                               f"the test process died during this test ({exit_text(attempt.code)})"))
        else:  # pytest ended normally without running them: running it again would not either
            for test in remaining:
                settle(Outcome(test.nodeid, "not_run", "not run: the test process ended without "
                                                       "running it"))
    for test in tests:  # every test gets an outcome
        settle(Outcome(test.nodeid, "not_run", "no result"))
    return result


LIMIT_SIGNS = {  # what a limit looks like from inside Python (it ignores SIGXFSZ: writes fail)
    "[Errno 27] File too large": "the file size limit was hit",
    "MemoryError": "a MemoryError was raised (the memory limit?)",
    "[Errno 28] No space left on device": "the scratch space ran out",
    "BlockingIOError: [Errno 11] Resource temporarily unavailable": "fork failed (the process limit?)",
}


def _limit_notes(output: str) -> list[str]:
    """Limits hit, as the output tells (informational: the code under test writes the output)."""
    return [note for sign, note in LIMIT_SIGNS.items() if sign in output]


def _blame(reports: Reports, remaining: list[TestInfo]) -> list[TestInfo]:
    """The tests that were running when the process ended: the open test; else, if a file was
    still being loaded, all its tests; else the first test not done (its setup had not reported)."""
    for test in remaining:
        if test.nodeid == reports.running:
            return [test]
    first = remaining[0]
    if first.file not in reports.modules:
        return [t for t in remaining if t.file == first.file]
    return [first]


def _load_kind(attempt: _Attempt) -> str:
    return "timeout" if attempt.reason == "timeout" else "load_error"


def _load_failure(attempt: _Attempt, timeout: float) -> str:
    if attempt.reason == "timeout":
        return f"Timeout: loading the test file took more than {timeout:g} s"
    return (f"the test process died while loading the tests, before they ran "
            f"({exit_text(attempt.code)})")


def collect(executor, files: list[str], timeout: float = 300.0) -> tuple[list[TestInfo], list[str]]:
    """The tests in `files` (in order) and the collection errors, from one pytest process."""
    attempt = _run_once(executor, files, timeout, 0.0, None, None, ["--collect-only"], True)
    errors = [f"{file}: {error}" for file, error in attempt.reports.modules.items() if error]
    if attempt.collection is None:
        errors.append(f"pytest --collect-only failed ({exit_text(attempt.code)}):\n"
                      f"{attempt.output[-2000:]}")
        return [], errors
    order = {file: index for index, file in enumerate(files)}
    tests = sorted(attempt.collection, key=lambda t: order.get(t.file, len(order)))
    return tests, errors
