"""Run test files under pytest, each test bounded in time, whatever the code under test does.

One pytest process per test file (a compromise: one per test would be the strongest isolation but
pays ~2 s of torch import per test). Inside it, pytest-timeout interrupts a test that runs past
`timeout` (signal method: the process survives and moves on), and the plugin kills whatever the
test left running. Outside it, a watchdog kills the whole process tree when no test starts or ends
for `timeout + grace` seconds (a test that ignores the alarm, a hang at import or in a C call),
blames the test that was running, and starts a new process for the tests not yet run. A process
that dies (os._exit, a segfault) is handled the same way. Output is drained and only its head and
tail kept, so a test that floods stdout costs neither memory nor disk; the plugin caps file sizes.
"""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from helpers.homework.plugin import MAX_FILE_ENV, RECORD_ENV

DEFAULT_TIMEOUT_S = 120.0
OUTPUT_KEEP_BYTES = 64_000          # head and tail of each pytest process's output kept for logs
MAX_FILE_BYTES = 256 * 2**20        # no test may write a file bigger than this
TAG_ENV = "HOMEWORK_RUN_TAG"        # marks every process of a run, to find strays at the end
STARTUP_S = 60.0                    # extra time to start pytest and import the tests (busy machines)


@dataclass
class TestInfo:
    nodeid: str
    file: str
    exercise: str | None
    points: float


@dataclass
class Outcome:
    nodeid: str
    outcome: str      # passed | failed | skipped | not_implemented | timeout | crashed | not_run
    message: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"


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


def child_env(tree: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # an outer pytest's
    env["PYTHONPATH"] = str(tree)  # only the tree under test: never the instructor's own checkout
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("COURSE_SMOKE", "1")
    env[MAX_FILE_ENV] = str(MAX_FILE_BYTES)
    env.update(extra or {})
    return env


def _read_events(path: Path, offset: int) -> tuple[list[dict], int]:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
    events = []
    for line in data[:end].splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events, offset + end


def _kill(proc: subprocess.Popen, tracked: dict[int, psutil.Process], tag: str) -> None:
    """Kill the pytest process, every descendant seen during the run and any process tagged."""
    for p in _tagged(tag):
        tracked.setdefault(p.pid, p)
    try:
        tracked.update({p.pid: p for p in psutil.Process(proc.pid).children(recursive=True)})
    except psutil.Error:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in tracked.values():
        try:
            if p.is_running():  # psutil checks the pid was not reused
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                p.kill()
        except psutil.Error:
            pass
    proc.wait()
    psutil.wait_procs([p for p in tracked.values()], timeout=3)


def _tagged(tag: str) -> list[psutil.Process]:
    found = []
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            if p.environ().get(TAG_ENV) == tag:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def _pytest_command(targets: list[str], timeout: float, extra: list[str]) -> list[str]:
    # nbmake and anyio are not needed here, and nbmake's import (jsonschema) costs seconds
    return [sys.executable, "-m", "pytest", "-p", "helpers.homework.plugin", "-p", "no:cacheprovider",
            "-p", "no:nbmake", "-p", "no:anyio",
            "-q", "-s", "--no-header", "-o", "console_output_style=classic",
            f"--timeout={timeout:g}", "--timeout-method=signal", *extra, *targets]


def _run_once(tree: Path, targets: list[str], timeout: float, grace: float, env: dict[str, str],
              deadline: float | None, extra_args: list[str], on_event=None):
    """One pytest process; returns (events, killed_reason, returncode, output)."""
    with tempfile.TemporaryDirectory(prefix="homework-run-") as tmp:
        record = Path(tmp) / "events.jsonl"
        tag = uuid.uuid4().hex
        run_env = dict(env, **{RECORD_ENV: str(record), TAG_ENV: tag})
        proc = subprocess.Popen(_pytest_command(targets, timeout, extra_args), cwd=tree,
                                env=run_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        drain = _Drain(proc.stdout, OUTPUT_KEEP_BYTES)
        events: list[dict] = []
        offset = 0
        last_activity = time.monotonic() + STARTUP_S  # until the tests are collected
        tracked: dict[int, psutil.Process] = {}
        last_scan = 0.0
        reason = ""
        try:
            while proc.poll() is None:
                time.sleep(0.05)
                new, offset = _read_events(record, offset)
                if new:
                    last_activity = time.monotonic()
                    events += new
                    for event in new:
                        if on_event:
                            on_event(event)
                now = time.monotonic()
                if now - last_scan > 0.5:  # remember descendants: they may outlive their parent
                    try:
                        tracked.update({p.pid: p for p in
                                        psutil.Process(proc.pid).children(recursive=True)})
                    except psutil.Error:
                        pass
                    last_scan = now
                if now - last_activity > timeout + grace:
                    reason = f"timed out after {timeout:g} s; its processes were killed"
                    break
                if deadline is not None and now > deadline:
                    reason = "not run: the time budget ran out"
                    break
        finally:  # also on Ctrl-C: nothing of the run survives it
            _kill(proc, tracked, tag)
        new, offset = _read_events(record, offset)
        for event in new:
            if on_event:
                on_event(event)
        events += new
        return events, reason, proc.returncode, drain.text()


def run_tests(tree: Path, files: list[str], expected: dict[str, list[str]] | None = None, *,
              timeout: float = DEFAULT_TIMEOUT_S, grace: float | None = None,
              env: dict[str, str] | None = None, deadline: float | None = None,
              log_path: Path | None = None, on_outcome=None) -> tuple[list[TestInfo], dict[str, Outcome]]:
    """Run the tests of `files`, one pytest process per file (more after a kill or crash).

    `expected` (file -> node ids, from a trusted collection) says which tests must get an
    outcome; without it the first run's collection decides, and a file that dies before its
    tests are collected gets one failed Outcome under the file's own name.
    Returns the tests collected (in order) and an Outcome for each expected or collected test.
    """
    grace = max(5.0, 0.1 * timeout) if grace is None else grace
    env = env if env is not None else child_env(tree)
    infos: list[TestInfo] = []
    outcomes: dict[str, Outcome] = {}

    def settle(outcome: Outcome) -> None:
        outcomes[outcome.nodeid] = outcome
        if on_outcome:
            on_outcome(outcome)

    for file in files:
        remaining = list(expected[file]) if expected is not None else None
        targets = [file]
        while remaining is None or remaining:
            if deadline is not None and time.monotonic() > deadline:
                for nodeid in remaining or [file]:
                    settle(Outcome(nodeid, "not_run", "not run: the time budget ran out"))
                break
            events, reason, code, output = _run_once(tree, targets, timeout, grace, env, deadline, [])
            if log_path is not None:
                with open(log_path, "a", encoding="utf-8", errors="replace") as log:
                    log.write(f"$ pytest {' '.join(targets)}\n{output}\n"
                              f"[{_exit_text(code)}{'; ' + reason if reason else ''}]\n\n")
            collected = [TestInfo(e["nodeid"], e["file"], e.get("exercise"),
                                  float(e.get("points", 1)))
                         for e in events if e["event"] == "collected"]
            if remaining is None and collected:
                infos += collected
                remaining = [t.nodeid for t in collected]
            for event in events:
                if event["event"] == "result" and remaining and event["nodeid"] in remaining:
                    settle(Outcome(event["nodeid"], event["outcome"], event.get("message", ""),
                                   event.get("seconds", 0.0)))
            if remaining is not None:
                remaining = [n for n in remaining if n not in outcomes]
                if not remaining:
                    break
            started = [e["nodeid"] for e in events if e["event"] == "start"]
            running = [n for n in started if remaining and n in remaining]
            if running:  # it hung or died during this test: blame it, rerun the others
                blamed = running[-1]
                if reason.startswith("not run"):
                    settle(Outcome(blamed, "not_run", reason))
                elif reason:
                    settle(Outcome(blamed, "timeout", f"Timeout: the test {reason}", timeout))
                else:
                    settle(Outcome(blamed, "crashed", "the test process died during this test "
                                                      f"({_exit_text(code)})"))
                remaining = [n for n in remaining if n != blamed]
                targets = remaining
                continue
            # none of the tests left started: the file failed before them (import, collection)
            errors = [e.get("message", "") for e in events if e["event"] == "collect_error"]
            if errors:
                message = f"the test file could not be loaded: {errors[0]}"
            elif reason.startswith("not run"):
                message = reason
            elif reason:
                message = f"Timeout: loading the test file {reason}"
            elif code in (0, 4, 5):
                message = "test not found"
            else:
                message = (f"the test process died while loading the tests, before this test ran "
                           f"({_exit_text(code)})")
            kind = "not_run" if reason.startswith("not run") else "failed"
            if remaining is None:
                infos.append(TestInfo(file, file, None, 1.0))
            for nodeid in remaining or [file]:
                settle(Outcome(nodeid, kind, message))
            break
    return infos, outcomes


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def collect(tree: Path, files: list[str], env: dict[str, str] | None = None,
            timeout: float = 300.0) -> tuple[list[TestInfo], list[str]]:
    """The tests in `files` (in order) and the collection errors, from trusted pytest runs.

    One process per folder: tests/public/test_lab04_x.py and tests/hidden/test_lab04_x.py share
    a basename, which one pytest process cannot import twice in its default import mode.
    """
    env = env if env is not None else child_env(tree)
    folders: dict[str, list[str]] = {}
    for file in files:
        folders.setdefault(str(Path(file).parent), []).append(file)
    found: dict[str, TestInfo] = {}
    errors: list[str] = []
    for group in folders.values():
        events, reason, code, output = _run_once(tree, group, timeout, 0.0, env, None,
                                                 ["--collect-only"])
        for e in events:
            if e["event"] == "collected":
                found[e["nodeid"]] = TestInfo(e["nodeid"], e["file"], e.get("exercise"),
                                              float(e.get("points", 1)))
        errors += [f"{e['file']}: {e.get('message', '')}" for e in events
                   if e["event"] == "collect_error"]
        if reason:
            errors.append(f"collecting {', '.join(group)} {reason}")
        elif code not in (0, 5) and not errors:
            errors.append(f"pytest --collect-only failed ({_exit_text(code)}):\n{output[-2000:]}")
    order = {file: index for index, file in enumerate(files)}
    return sorted(found.values(), key=lambda t: order.get(t.file, len(order))), errors
