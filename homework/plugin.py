"""pytest plugin of the homework tool: `python -m pytest -p homework.plugin ...`.

The per-test event stream is pytest-reportlog's (`--report-log=PATH`, one JSON report per line,
flushed at once, so the runner knows how far a process got even if it is killed). This plugin adds
only what the course's markers mean:

- `--homework-collection=PATH` writes, once the tests are collected, a JSON list with one object
  per test: nodeid, file, exercise (`@pytest.mark.exercise`), points (`@pytest.mark.points`,
  default 1) and doc (the first line of the test's docstring, what grading feedback shows for it);
- each failed report gets a `("homework", category)` user property, one word from a fixed
  vocabulary: `not_implemented` (an exercise's stub raised, directly or in a rank: decided by
  helpers.notice.unsolved_message), `timeout` (pytest-timeout stopped it), `assertion` or
  `error`; with ("homework_stub", the stub's message) for a stub, and ("homework_where",
  "labs/lab01_gil_threads.py:40 `code`") when the exception was raised inside the labs (the
  innermost frame there), which `check` adds to the failure's one-line message.

Stdlib only (and pytest): loading it must not import torch.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.notice import unsolved_message

COLLECTION_OPTION = "--homework-collection"
CATEGORY_KEY = "homework"
STUB_KEY = "homework_stub"
WHERE_KEY = "homework_where"
LAB_FOLDER = "labs"
CODE_CHARS = 80
CATEGORIES = ("not_implemented", "timeout", "assertion", "error")


def pytest_addoption(parser) -> None:
    parser.addoption(COLLECTION_OPTION, default=None, metavar="PATH",
                     help="write the collected tests with their exercise, points and doc as JSON")


def marker_arg(item, name: str, default):
    marker = item.get_closest_marker(name)
    if marker is None:
        return default
    if marker.args:
        return marker.args[0]
    return marker.kwargs.get("name", marker.kwargs.get("n", default))


def first_doc_line(item) -> str:
    doc = getattr(getattr(item, "obj", None), "__doc__", None) or ""
    return next((line.strip() for line in doc.splitlines() if line.strip()), "")


def pytest_collection_finish(session) -> None:
    path = session.config.getoption(COLLECTION_OPTION)
    if not path:
        return
    tests = []
    for item in session.items:
        points = marker_arg(item, "points", 1)
        tests.append({"nodeid": item.nodeid, "file": item.nodeid.split("::")[0],
                      "exercise": marker_arg(item, "exercise", None),
                      "points": points if isinstance(points, (int, float)) else 1,
                      "doc": first_doc_line(item)})
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(tests, handle)


def category(excinfo) -> tuple[str, str]:
    """(one of CATEGORIES, the stub's message or "") for a failed phase."""
    if excinfo is None:
        return "error", ""
    stub = unsolved_message(excinfo.value)
    if stub:
        return "not_implemented", stub
    if excinfo.typename == "Failed":  # pytest.fail(...), pytest.raises' "DID NOT RAISE"
        return ("timeout" if str(excinfo.value).startswith("Timeout") else "assertion"), ""
    return ("assertion" if isinstance(excinfo.value, AssertionError) else "error"), ""


def lab_location(excinfo, root: Path) -> str:
    """Where in the labs an exception was raised: the innermost frame of its traceback in
    root/labs/ ("labs/lab01_gil_threads.py:40 `return pool.map(fn, items)`"), or ""."""
    if excinfo is None:
        return ""
    root = root.resolve()
    for entry in reversed(excinfo.traceback):
        try:
            path = Path(str(entry.path)).resolve().relative_to(root)
        except (ValueError, OSError):
            continue
        if path.parts[0] != LAB_FOLDER or path.suffix != ".py":
            continue
        try:
            code = str(entry.statement).strip().splitlines()[0].strip()
        except Exception:  # no source to show
            code = ""
        if len(code) > CODE_CHARS:
            code = code[: CODE_CHARS - 3] + "..."
        return f"{path.as_posix()}:{entry.lineno + 1}" + (f" `{code}`" if code else "")
    return ""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        kind, stub = category(call.excinfo)
        report.user_properties.append((CATEGORY_KEY, kind))
        if stub:
            report.user_properties.append((STUB_KEY, stub))
        elif not any(key == WHERE_KEY for key, _ in report.user_properties):
            where = lab_location(call.excinfo, item.config.rootpath)
            if where:
                report.user_properties.append((WHERE_KEY, where))
