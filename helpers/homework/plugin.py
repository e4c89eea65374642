"""pytest plugin for check/submit/grade: `python -m pytest -p helpers.homework.plugin ...`.

With HOMEWORK_RECORD=path set it appends one JSON object per line to `path`, flushed at once so
that the runner (helpers.homework.runner) knows how far a process got even if it is killed:
    {"event": "collected", "nodeid", "file", "exercise", "points"}   one per test
    {"event": "collect_error", "file", "message"}                  a test file that failed to import
    {"event": "start", "nodeid"}                                   a test begins
    {"event": "result", "nodeid", "outcome", "message", "seconds"} it ended
`outcome` is passed, failed, skipped or not_implemented (a stub's NotImplementedError, raised
directly or inside a rank, as helpers.launch.LaunchError reports). `message` is one line: the
exception's message, never a traceback, so hidden tests' source never reaches feedback.

It also caps the size of files the tests may write (HOMEWORK_MAX_FILE_BYTES, a flood of output to
a log file dies instead of filling the disk) and, after each test, kills what the test left running
in sessions of its own (ranks still running after pytest-timeout interrupted their launch).
Stdlib and psutil only: loading it must not import torch.
"""
from __future__ import annotations

import json
import os
import re
import time

import pytest

RECORD_ENV = "HOMEWORK_RECORD"
MAX_FILE_ENV = "HOMEWORK_MAX_FILE_BYTES"
MESSAGE_CHARS = 400
_STUB_IN_RANK = re.compile(r"raised NotImplementedError(: Exercise |\s*$)", re.MULTILINE)

_record = None
_phases: dict[str, dict] = {}


def pytest_configure(config) -> None:
    global _record
    path = os.environ.pop(RECORD_ENV, None)  # the code under test has no business writing there
    if not path:
        return
    limit = os.environ.get(MAX_FILE_ENV)
    if limit:
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))
    _record = open(path, "a", encoding="utf-8")


def _write(**event) -> None:
    if _record is not None:
        _record.write(json.dumps(event) + "\n")
        _record.flush()


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_stub_error(exc: BaseException | None) -> bool:
    """A stub's NotImplementedError ("Exercise ..." or bare), also behind a cause or in a rank."""
    for link in _chain(exc):
        text = str(link)
        if isinstance(link, NotImplementedError) and (text == "" or text.startswith("Exercise ")):
            return True
        if _STUB_IN_RANK.search(text):
            return True
    return False


def stub_text(exc: BaseException | None) -> str:
    """The stub's own message ("NotImplementedError: Exercise ..."), wherever it was raised."""
    for link in _chain(exc):
        text = str(link)
        if isinstance(link, NotImplementedError):
            return first_line(f"NotImplementedError: {text}" if text else "NotImplementedError")
        match = re.search(r"NotImplementedError: (Exercise [^\n]*)", text)
        if match:
            return first_line(f"NotImplementedError: {match.group(1)}")
    return ""


def first_line(text: str) -> str:
    """The first line of a message; one more when the first ends with a colon ("launch failed:")
    unless it starts a traceback, which would show test source."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[0]
    if line.endswith(":") and len(lines) > 1 and not lines[1].startswith(("Traceback", "File ", "---")):
        line = f"{line} {lines[1]}"
    return line if len(line) <= MESSAGE_CHARS else line[: MESSAGE_CHARS - 3] + "..."


def _message(report) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        return first_line(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return first_line(crash.message)
    lines = [l for l in str(longrepr).splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("E ")]  # pytest's "E   SomeError: ..." lines
    return first_line((errors or lines or [""])[-1].lstrip("E").strip())


def _marker_arg(item, name: str, default):
    marker = item.get_closest_marker(name)
    if marker is None:
        return default
    if marker.args:
        return marker.args[0]
    return marker.kwargs.get("name", marker.kwargs.get("n", default))


def pytest_collection_finish(session) -> None:
    for item in session.items:
        points = _marker_arg(item, "points", 1)
        _write(event="collected", nodeid=item.nodeid, file=item.nodeid.split("::")[0],
               exercise=_marker_arg(item, "exercise", None),
               points=points if isinstance(points, (int, float)) else 1)


def pytest_collectreport(report) -> None:
    if report.failed:
        _write(event="collect_error", file=report.nodeid or report.fspath, message=_message(report))


def pytest_runtest_logstart(nodeid, location) -> None:
    _phases[nodeid] = {"start": time.monotonic(), "before": _descendants(), "outcome": "passed",
                       "message": ""}
    _write(event="start", nodeid=nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    state = _phases.setdefault(item.nodeid, {"start": time.monotonic(), "before": set(),
                                             "outcome": "passed", "message": ""})
    if state["outcome"] != "passed":
        return  # the first failing phase decides
    if report.failed:
        stub = call.excinfo is not None and is_stub_error(call.excinfo.value)
        state["outcome"] = "not_implemented" if stub else "failed"
        message = (stub and stub_text(call.excinfo.value)) or _message(report)
        state["message"] = message if report.when == "call" else f"in {report.when}: {message}"
    elif report.skipped:
        if hasattr(report, "wasxfail"):  # an expected failure that failed: that counts as passing
            return
        state["outcome"] = "skipped"
        state["message"] = _message(report)


def pytest_runtest_logfinish(nodeid, location) -> None:
    state = _phases.pop(nodeid, None) or {"start": time.monotonic(), "before": set(),
                                          "outcome": "failed", "message": "no report"}
    _write(event="result", nodeid=nodeid, outcome=state["outcome"], message=state["message"],
           seconds=round(time.monotonic() - state["start"], 3))
    if _record is not None:
        kill_strays(state["before"])


def _descendants() -> set[tuple[int, float]]:
    if _record is None:
        return set()
    try:
        import psutil
        return {(p.pid, p.create_time()) for p in psutil.Process().children(recursive=True)}
    except Exception:
        return set()


def kill_strays(before: set[tuple[int, float]]) -> None:
    """SIGKILL what the test started in sessions of its own and left running.

    That is torchrun and its ranks after pytest-timeout interrupted a launch (helpers.launch
    starts them with start_new_session). Helpers that share pytest's session and are meant to
    outlive a test (multiprocessing's forkserver and resource tracker) are left alone, and
    nothing is reaped here: their owners wait for them.
    """
    try:
        import psutil
        children = psutil.Process().children(recursive=True)
        session = os.getsid(0)
    except Exception:
        return
    for child in children:
        try:
            if os.getsid(child.pid) == session or (child.pid, child.create_time()) in before:
                continue
            if os.getpgid(child.pid) == child.pid:  # its group: whatever it started in it
                os.killpg(child.pid, 9)
            child.kill()
        except Exception:
            pass
