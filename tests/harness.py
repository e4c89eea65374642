"""The course's test harness: launching ranks for a test, and the test run's speed devices.
conftest.py only wires it into pytest; test files import what they use from here.

A test file that checks distributed code is also the torchrun script it launches: its
`if __name__ == "__main__":` block runs the case named on the command line inside
`helpers.dist.distributed()` and reports with `ctx.report(...)`. The test side launches it once per
module and reads what every rank reported:

    @pytest.fixture(scope="module")
    def bucketed():
        return launch_ranks(__file__, "bucketed", nproc=2, needs=[BucketedDDP])

    def test_something(bucketed):
        for rank, report in bucketed.items():
            assert report["x"] == ..., f"rank {rank}: ..."

`launch_ranks` never raises in the fixture. If the launch failed, every test that reads the
result fails with the same short message naming the rank and its exception ("rank 1 raised
ValueError: ..."), so each test reports the cause instead of one fixture ERROR. If an exercise in
`needs` is still its stub, nothing is launched and each test reports the stub's own message, which
`./run.sh check` shows as "not implemented yet".

Where an exercise raised, whatever the test file does with the exception: the ranks run under
homework/watch.py, which records every exception that leaves an exercise, with its rank, file and
line, even when the test's worker catches it, keeps only its message and goes on. A failed launch
then names the exception raised first (not the gloo timeout of a rank left waiting: see
helpers.launch's LaunchError), and `locate_failure` (wired in by conftest.py, also for exercises
the test process runs itself) adds to a test that failed with such an exception's message where
it was raised and which rank raised it first: in pytest's report (a section) and in the location
`./run.sh check` prints after the message. Test files need nothing for this.

The speed devices of `./run.sh test`, all here (docs/MAINTAINERS.md says where the time goes):
- every test launch forks: torchrun from the test process's warm launcher (helpers/launch/warm.py)
  and the ranks from torchrun (`fork_ranks`), so neither imports torch again;
- the notebooks' launches fork too (COURSE_FORK_RANKS, set while nbmake runs a notebook:
  `NotebookLaunches`), except FRESH_NOTEBOOKS, which run exactly as students run them;
- `group_and_order`: each test file stays on one xdist worker (its module-scoped launch runs once)
  and the files go out longest first (the student journey, then the notebooks, then the files
  with the most tests), so no long test starts last;
- helpers/lean_imports.py, loaded by run.sh with `-p`, leaves out one slow import of nbformat's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping
from unittest import mock

import pytest

from helpers.notice import Unsolved, stub_message
from homework import watch
from homework.plugin import WHERE_KEY

DEFAULT_TIMEOUT_S = 240.0
REPO_ROOT = Path(__file__).resolve().parents[1]
RANK_ENTRY = REPO_ROOT / "homework" / "watch.py"  # runs a launch's script with the exercises watched
# Notebooks whose launches start fresh torchrun and rank processes under the tests, as students
# run them, and why; every other notebook's launches fork (COURSE_FORK_RANKS: a few CPU-seconds
# less per launch). A launch that restarts (--max-restarts) is always fresh.
FRESH_NOTEBOOKS = {
    "10_debugging.ipynb": "it reads torchrun's own failure reports and the hung ranks' stacks, "
                          "which read differently for forked ranks",
}


class RankFailure(AssertionError):
    """The launch behind this test failed; the message names the rank and its error."""


class Ranks(Mapping[int, dict]):
    """What each rank reported ({rank: report}), or the reason there is nothing to read."""

    def __init__(self, reports: dict[int, dict] | None, error: BaseException | None = None,
                 output: str = "", partial: dict[int, dict] | None = None,
                 caught: list[dict] | None = None):
        self._reports = reports or {}
        self._error = error
        self.output = output
        self.partial = partial or {}  # what the ranks had reported when a failed launch ended
        self.caught = caught or []    # exceptions that left an exercise in a rank (homework.watch)

    def _check(self) -> None:
        if isinstance(self._error, Unsolved):
            raise Unsolved(str(self._error))
        if self._error is not None:
            raise RankFailure(str(self._error)) from None

    def __getitem__(self, rank: int) -> dict:
        self._check()
        return self._reports[rank]

    def __iter__(self) -> Iterator[int]:
        self._check()
        return iter(self._reports)

    def __len__(self) -> int:
        self._check()
        return len(self._reports)

    @property
    def rank0(self) -> dict:
        return self[0]


def launch_ranks(script: str | os.PathLike, *args: Any, nproc: int = 2,
                 timeout: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None,
                 needs: Iterable[Any] = (), torchrun_args: Iterable[str] = ()) -> Ranks:
    """Launch `script args` on `nproc` ranks once; see the module docstring. `torchrun_args`
    go to torchrun itself (e.g. ["--max-restarts=1"])."""
    from helpers.launch import LaunchError, launch  # torch: only when something is launched

    for exercise in needs:
        message = stub_message(exercise)
        if message:
            return Ranks(None, Unsolved(message))
    script = Path(script).resolve()
    shown = script.relative_to(REPO_ROOT).as_posix() if script.is_relative_to(REPO_ROOT) else str(script)
    try:
        # Ranks forked from torchrun: no torch import per rank (helpers/launch/torchrun.py); a restarting
        # launch (torchrun_args) keeps torchrun's default. Each rank runs the script under
        # homework/watch.py, which records where the exercises raised.
        result = launch(RANK_ENTRY, str(script), *map(str, args), nproc=nproc, timeout=timeout,
                        env=env, stream=False, torchrun_args=list(torchrun_args),
                        fork_ranks=not torchrun_args)
    except LaunchError as err:
        if err.rank is not None:
            summary = f"rank {err.rank} raised {err.summary}"
        else:
            summary = err.summary
        caught = _remember(script, err.result.caught if err.result else [])
        return Ranks(None, _as_error(summary, err, shown), err.result.output if err.result else "",
                     partial=err.result.results if err.result else None, caught=caught)
    except BaseException as exc:  # stopped (pytest-timeout's Failed): keep what the ranks raised
        _remember(script, getattr(exc, "course_caught", []))
        raise
    return Ranks(result.results, None, result.output, caught=_remember(script, result.caught))


SHOWN_FRAMES = 4  # the innermost frames of a rank's traceback in the labs, shown under its error
_caught: dict[Path, list[list[dict]]] = {}  # test file -> per launch, what its exercises raised


def _remember(script: Path, caught: list) -> list[dict]:
    """Keep what the exercises of `script`'s launch raised, as homework.watch's records."""
    records = [{**dataclasses.asdict(c), "traceback": c.text} for c in caught]
    _caught.setdefault(script, []).append(records)
    return records


def _as_error(summary: str, err, script: str | None = None) -> BaseException:
    """The stub's Unsolved, or a RankFailure whose first line names the rank, its exception and
    where in the labs it was raised, followed by the last frames of its traceback in the labs.
    `script`: the test file launched (default: the launch's own script)."""
    unsolved = Unsolved(summary.split("NotImplementedError: ", 1)[1]) \
        if "NotImplementedError: Exercise " in summary else None
    if unsolved:
        return unsolved
    if script is None:
        script = err.result.script if err.result else "?"
    message = f"{summary} (launch of {script})"
    frames = getattr(err, "frames", [])[-SHOWN_FRAMES:]
    if frames:
        message += (f"\nrank {err.rank}'s traceback in the labs (innermost last):\n"
                    + "\n".join(f"  {frame}" for frame in frames))
    return RankFailure(message)


def watch_exercises() -> None:
    """Record where the exercises raise in this process too (tests that call them directly)."""
    watch.install()


def locate_failure(item, call, report) -> None:
    """A test that failed with the message of an exception an exercise raised and its caller
    caught (in a rank of one of this test file's launches, or in this process during the test):
    say where the first exception of that launch up to it was raised, and by which rank (a rank
    left waiting by another's error times out later: the error came first), in a section of the
    report and in its location property (WHERE_KEY, which `./run.sh check` shows after the
    message). Nothing when the failure shows that place already."""
    try:
        _locate_failure(item, call, report)
    except Exception as exc:  # never let the locating break the report itself
        report.sections.append(("where the exercise raised", f"(not found: {type(exc).__name__}: {exc})"))


_GLOO_PREFIX = re.compile(r"\[/[^\]\s]*\] ")  # gloo's source position: "[/__w/.../pair.cc:553] "


def _locate_failure(item, call, report) -> None:
    if not report.failed or call.excinfo is None:
        return
    text = _GLOO_PREFIX.sub("", report.longreprtext)  # as homework.watch writes the lines
    launches = _caught.get(Path(str(item.path)).resolve(), [])
    groups = list(launches) + [[dict(r, rank=None) for r in watch.recorded(since=call.start)]]
    for records in groups:
        last_launch = bool(launches) and records is launches[-1]
        records = sorted((r for r in records if r.get("where")), key=lambda r: r["time"])
        shown = [r for r in records if r.get("line") and r["line"] in text]
        if not shown and "Timeout" in text and records and last_launch:
            shown = records[:1]  # timed out waiting for a launch in which this was raised (the
            # test whose setup ran it, and the next ones, which pytest gives the same error)
        if not shown:
            continue
        first = records[0]  # at or before the exception the failure shows
        if first["where"].split(" ", 1)[0] in text:
            return
        if first["rank"] is None:
            where = first["where"]
        elif first["line"] in text:
            where = f"{first['where']} (rank {first['rank']} raised it first)"
        else:
            where = f"{first['where']} (rank {first['rank']} raised {first['line']} there first)"
        if not any(key == WHERE_KEY for key, _ in report.user_properties):
            report.user_properties.append((WHERE_KEY, where))
        who = f"rank {first['rank']} raised" if first["rank"] is not None else "raised"
        report.sections.append(("where the exercise raised", f"{who} {first['line']} first, in "
                                f"{first['exercise']}, at {first['where']}:\n"
                                + "\n".join(_traceback_tail(first.get("traceback", "")))))
        return


def _traceback_tail(text: str, lines: int = 12) -> list[str]:
    """The last lines of a recorded traceback, without homework.watch's own frame."""
    kept, skipping = [], False
    for line in text.splitlines():
        if line.startswith("  File "):
            skipping = line.rstrip().endswith("in exercise_function") and "watch.py" in line
        elif not line.startswith("    "):
            skipping = False
        if not skipping and line.strip():
            kept.append(line)
    return kept[-lines:]


def notebook_launches(name: str) -> contextlib.AbstractContextManager:
    """Run notebook `name` ("03_ddp.ipynb") with its launches forking their ranks, if it may (the
    kernel inherits the environment)."""
    from helpers.launch.torchrun import FORK_RANKS_ENV

    return mock.patch.dict(os.environ, {} if name in FRESH_NOTEBOOKS else {FORK_RANKS_ENV: "1"})


class NotebookLaunches:
    """nbmake's items live in notebooks/, where a conftest.py in tests/ has no hooks: a plugin."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        if item.path.suffix != ".ipynb":
            yield
            return
        with notebook_launches(item.path.name):
            yield


def group_and_order(config, items) -> None:
    """Under `pytest -n N --dist loadgroup` (./run.sh test), keep each test file on one worker, so
    its module-scoped launch runs once; a test may pick its own group with
    `@pytest.mark.xdist_group(name)` to run beside the rest of its file."""
    # On xdist's workers (where this runs) the controller's --dist shows as the option loadgroup.
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    # Longest first, so no long test starts last and runs alone at the end: the student journey
    # (check, submit, grade: minutes), then the notebooks of both editions (later notebooks run
    # more and bigger launches), then the files with the most tests. run.sh passes
    # --no-loadscope-reorder so that xdist hands the files out in this order.
    groups = [item.get_closest_marker("xdist_group").args[0] for item in items]
    sizes = {group: groups.count(group) for group in set(groups)}

    def rank(pair) -> tuple:
        item, group = pair
        notebook = re.search(r"(\d\d)_\w+\.ipynb", item.nodeid)
        if group == "student-homework":
            return (0,)
        if notebook:
            return (1, -int(notebook.group(1)))
        return (2, -sizes[group], group)
    items[:] = [item for item, _ in sorted(zip(items, groups), key=rank)]
