"""Where an exercise raised: each exception that leaves an exercise function is recorded, with
its traceback, as it leaves, whether or not the code that called the exercise catches it.

Why: the tests call the exercises inside ranks and often catch what they raise, keeping only its
message ("ring_attention raised IndexError: list index out of range"), and carry on; the ranks
then fall out of step and the launch dies of another rank's gloo timeout or "connection closed",
or the test fails with the message alone. Either way the file and line, and the rank that raised
first, were lost. With these records, `helpers.launch` names the earliest exception of a failed
launch (LaunchError), and the test harness adds the location to a test that failed with a
recorded exception's message (tests/harness.py).

    python homework/watch.py SCRIPT ARGS...   # a test launch's rank (tests/harness.py launches
                                              # this): watch, then run SCRIPT as __main__

`install()` adds an import hook: each lab module (`labs.*`) is loaded as usual, then its exercise
functions are replaced by wrappers (functools.wraps) that record and re-raise. Which functions are
exercises: the lab's own solution blocks (the instructor's files), else the stubs of the course's
copy of the lab (.course/labs, homework.splice), else the lab's own stubs. A record is a file
`caught.rank{R}.{N}.json` ({"time", "rank", "exercise", "line": "IndexError: ...", "where":
"labs/x.py:12 `code`", "traceback"}) in the launch's results
folder (COURSE_RESULTS_DIR) in a rank, and an entry of `recorded()` elsewhere (a test's own
process). A stub's NotImplementedError is not recorded (the stub says where it is); an exception
is recorded once, at the innermost exercise it leaves; a rank writes at most MAX_RECORDS per
exercise, a process keeps the newest MAX_KEPT.

Stdlib only (and homework.solutions, helpers.notice, helpers.config).
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

CAUGHT_PREFIX = "caught.rank"
MAX_RECORDS = 8            # written per exercise by a rank: the first ones are the cause
MAX_KEPT = 256             # records a process keeps in memory (the newest)
MAX_TRACEBACK_CHARS = 20_000
LAB_PACKAGE = "labs"
_records: list[dict] = []  # this process's records (the newest MAX_KEPT; in a rank, also on disk)
_counts: dict[str, int] = {}
_written = 0
_installed = False


def exercise_names(path: Path) -> list[str]:
    """The exercises (dotted names) of the lab file at `path`: its solution blocks, else the
    stubs of the course's copy of it, else its own stubs."""
    from homework.solutions import ExerciseError, stub_python
    from homework.splice import COURSE_LABS, exercises

    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return []
    try:
        names = [block.exercise for block in stub_python(text, f"labs/{path.name}").blocks]
    except (SyntaxError, ValueError, ExerciseError):  # a stray marker (a spliced file keeps some)
        names = []
    if names:
        return list(dict.fromkeys(names))
    course = path.parent.parent / COURSE_LABS / path.name
    try:
        return exercises(course.read_text(encoding="utf-8") if course.is_file() else text)
    except (OSError, SyntaxError, ValueError):
        return []


CODE_CHARS = 80


def exception_line(exc: BaseException) -> str:
    """"IndexError: list index out of range": what a test that caught it usually keeps (gloo's
    source position in front of its messages left out)."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if message.startswith("[/") and "] " in message:
        message = message.split("] ", 1)[1]
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _in_labs(filename: str, root: Path) -> str:
    """"labs/x.py" for a file of root/labs, else ""."""
    try:
        path = Path(filename).resolve().relative_to(root)
    except (ValueError, OSError):
        return ""
    return path.as_posix() if path.parts[0] == LAB_PACKAGE and path.suffix == ".py" else ""


def _code(frame: traceback.FrameSummary) -> str:
    code = (frame.line or "").strip()
    code = code if len(code) <= CODE_CHARS else code[: CODE_CHARS - 3] + "..."
    return f" `{code}`" if code else ""


def where(exc: BaseException, root: Path, exercise: str = "") -> str:
    """The innermost frame of `exc`'s traceback in root/labs, "labs/x.py:12 `code`", and when
    that is not the exercise's own code (a course function it called), the exercise's line too:
    "labs/x.py:408 `work = ...` (from ring_attention, line 298 `requests = ...`)"; or ""."""
    frames = [(frame, rel) for frame in traceback.extract_tb(exc.__traceback__)
              if (rel := _in_labs(frame.filename, root))]  # from the exercise inwards
    if not frames:
        return ""
    inner, rel = frames[-1]
    text = f"{rel}:{inner.lineno}{_code(inner)}"
    own = frames[0][0]  # the exercise's own frame (its wrapper called it)
    if len(frames) > 1 and exercise and own.name == exercise.rsplit(".", 1)[-1]:
        text += f" (from {exercise}, line {own.lineno}{_code(own)})"
    return text


def _record(exc: BaseException, exercise: str, root: Path) -> None:
    global _written
    from helpers.notice import unsolved_message

    if getattr(exc, "_course_recorded", False) or unsolved_message(exc):
        return
    try:
        exc._course_recorded = True
    except (AttributeError, TypeError):
        pass
    folder = _results_dir() if _rank() is not None else ""  # a rank of a launch: on disk too
    _counts[exercise] = _counts.get(exercise, 0) + 1
    if folder and _counts[exercise] > MAX_RECORDS:
        return
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    record = {"time": time.time(), "rank": _rank(), "exercise": exercise,
              "line": exception_line(exc), "where": where(exc, root, exercise),
              "traceback": text[-MAX_TRACEBACK_CHARS:]}
    _records.append(record)
    del _records[:-MAX_KEPT]
    if folder:
        path = Path(folder) / f"{CAUGHT_PREFIX}{record['rank']}.{_written}.json"
        _written += 1
        try:
            tmp = path.with_suffix(".tmp")  # whole or not at all: the launcher may read it now
            tmp.write_text(json.dumps(record))
            tmp.replace(path)
        except OSError:
            pass


def _rank() -> int | None:
    try:
        return int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None


def _results_dir() -> str:
    from helpers.config import settings

    return settings().results_dir


def recorded(since: float = 0.0) -> list[dict]:
    """This process's records made at or after `since` (time.time()), oldest first."""
    return [record for record in _records if record["time"] >= since]


def _watching(function: Any, exercise: str, root: Path) -> Any:
    @functools.wraps(function)
    def exercise_function(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception as exc:
            _record(exc, exercise, root)
            raise
    exercise_function.__course_exercise__ = exercise
    return exercise_function


def watch_module(module: Any) -> list[str]:
    """Wrap the exercises of a loaded lab module; the names wrapped."""
    path = getattr(module, "__file__", None)
    if not path:
        return []
    wrapped = []
    root = Path(path).resolve().parent.parent  # the course: labs/ is in it
    for name in exercise_names(Path(path)):
        *owners, attribute = name.split(".")
        owner = module
        for part in owners:
            owner = owner.__dict__.get(part) if isinstance(owner, type) or owner is module else None
            if not isinstance(owner, type):
                break
        if not (owner is module or isinstance(owner, type)):
            continue  # a function inside a function: nothing to wrap from outside
        raw = owner.__dict__.get(attribute)
        if isinstance(raw, staticmethod):
            replacement = staticmethod(_watching(raw.__func__, name, root))
        elif isinstance(raw, classmethod):
            replacement = classmethod(_watching(raw.__func__, name, root))
        elif callable(raw) and not getattr(raw, "__course_exercise__", None):
            replacement = _watching(raw, name, root)
        else:
            continue
        setattr(owner, attribute, replacement)
        wrapped.append(name)
    return wrapped


class _Loader(importlib.abc.Loader):
    """The lab's own loader, with the exercises wrapped once the module ran."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        watch_module(module)

    def __getattr__(self, name):  # get_source, get_filename, ... (inspect, linecache, runpy)
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if not name.startswith(LAB_PACKAGE + ".") or name.count(".") != 1:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None and spec.origin and spec.origin.endswith(".py"):
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Watch the exercises of every lab module imported from now on in this process (and in
    processes it forks)."""
    global _installed
    if not _installed:
        sys.meta_path.insert(0, _Finder())
        _installed = True


def run(argv: list[str]) -> None:
    """A rank: watch, then run `argv[0]` as __main__ with `argv` as its sys.argv (as torchrun
    would have run it)."""
    import runpy

    install()
    here = Path(__file__).resolve().parent
    if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == here:  # python homework/watch.py
        sys.path[0] = str(Path(argv[0]).resolve().parent)  # as `python SCRIPT` would have it
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a file: use the module, not a second copy of it
        sys.path.append(str(Path(__file__).resolve().parents[1]))
        from homework import watch

        watch.run(sys.argv[1:])
    else:
        run(sys.argv[1:])
