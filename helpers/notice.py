"""Exercises not done yet: a notice instead of a failure, in notebooks, labs and tests.

In the student edition (`./run.sh release`) each exercise is a stub that raises

    NotImplementedError("Exercise <name> (notebook NN_topic.ipynb): <hint>. Fill in the block in
                         labs/labNN_x.py and run ./run.sh check NN")

A notebook cell whose result needs an exercise wraps that part in `notice_if_unsolved()`:

    with notice_if_unsolved():
        table(solved(run.rank0["bucketed"]))    # or anything that calls the exercise

If the stub raised (directly, or in a rank of a launch), the cell shows a notice naming the
exercise, its file and `./run.sh check NN`, and the notebook goes on. Any other error still fails
the cell. In the instructor edition (no `.student-edition` stamp) nothing is excused: a stub error
there is a bug. Labs do the same for one part of their run with `attempt(...)`, which returns the
part's result or an `{"unsolved": message}` record the notebook later turns back into a notice
with `solved(...)`.

One notice per exercise: a notebook cell shows each exercise's notice once, however many of its
results need that exercise, and a process (a lab's rank, a terminal run) prints its "[notice]"
line once per exercise. The notice says "Exercise X is not done yet" once (not under a title
that says it too).

Stdlib only: the homework tooling and the test harness import this without torch.
"""
from __future__ import annotations

import ast
import contextlib
import html
import inspect
import re
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterator

REPO_ROOT = Path(__file__).resolve().parent.parent
EDITION_STAMP = ".student-edition"   # written by ./run.sh release into the student edition
STUB_PREFIX = "Exercise "
NOTICE_CLASS = "course-exercise-notice"  # in the notice's HTML; the student-journey test looks for it
# "... rank 1 raised NotImplementedError: Exercise ring_all_reduce (...)" in a LaunchError's text
_STUB_IN_TEXT = re.compile(r"NotImplementedError: (Exercise [^\n]*)")
_STUB_FIELDS = re.compile(
    r"Exercise (?P<name>\S+) \((?P<where>[^)]*)\): (?P<hint>.*?)\.? Fill in the block in "
    r"(?P<path>\S+) and run (?P<check>\./run\.sh check(?: \d+)?)")


class Unsolved(NotImplementedError):
    """An exercise that is still its stub; the message is the stub's own."""


def student_edition(root: Path = REPO_ROOT) -> bool:
    return (root / EDITION_STAMP).is_file()


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def unsolved_message(exc: BaseException | None) -> str:
    """The stub's message ("Exercise ...") if `exc` comes from an unsolved exercise, else ""."""
    for link in _chain(exc):
        text = str(link)
        if isinstance(link, NotImplementedError) and text.startswith(STUB_PREFIX):
            return text.splitlines()[0] if "\n" in text else text
        match = _STUB_IN_TEXT.search(text)
        if match:
            return match.group(1)
    return ""


def is_unsolved(exc: BaseException | None) -> bool:
    return bool(unsolved_message(exc))


def notice_text(message: str) -> str:
    fields = _STUB_FIELDS.search(message)
    if not fields:
        return f"Not done yet: {message}. This part shows its result once the exercise is solved."
    return (f"Exercise {fields['name']} is not done yet, so this part shows no result. Write it in "
            f"{fields['path']} ({fields['hint']}), check it with `{fields['check']}`, then rerun "
            "this cell.")


PLAIN_PREFIX = "[notice]"  # a notice's line on a terminal or in a log


def notice_html(message: str) -> str:
    """The notice as an HTML box (what `show_notice` displays in a notebook): its first sentence
    in bold, said once."""
    text = notice_text(message)
    head, comma, rest = text.partition(", ")
    if not comma or not head.startswith("Exercise "):
        head, rest = "", text
    body = (f"<b>{html.escape(head)}</b>, " if head else "") + html.escape(rest)
    return (f'<div class="{NOTICE_CLASS}" style="border-left: 6px solid #e0a800; background: #fff8e1; '
            f'color: #333; padding: 8px 12px; margin: 4px 0;">{body.replace("`", "")}</div>')


def exercise_name(message: str) -> str:
    """The exercise a stub's message names ("ring_all_reduce"), or the message itself."""
    fields = _STUB_FIELDS.search(message)
    return fields["name"] if fields else message


_shown: set[tuple[int | None, str]] = set()   # (cell or None, exercise): notices shown so far


def _notebook_cell() -> int | None:
    """The execution count of the notebook cell running now, or None outside a notebook kernel."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    if shell.__class__.__name__ != "ZMQInteractiveShell":
        return None
    return int(shell.execution_count)


def _first_time(message: str, cell: int | None) -> bool:
    """True the first time this exercise's notice comes up in `cell` (None: in this process)."""
    key = (cell, exercise_name(message))
    if key in _shown:
        return False
    _shown.add(key)
    return True


def show_notice(message: str) -> None:
    """A visible notice: a coloured box in a notebook, one line on a terminal. Once per exercise:
    per notebook cell (the kernel's execution count) in a notebook, per process elsewhere."""
    cell = _notebook_cell()
    if not _first_time(message, cell):
        return
    text = notice_text(message)
    if cell is None:
        print(f"{PLAIN_PREFIX} {text}", flush=True)
        return
    from IPython.display import display

    display({"text/html": notice_html(message), "text/plain": f"{PLAIN_PREFIX} {text}"}, raw=True)


@contextlib.contextmanager
def notice_if_unsolved() -> Iterator[None]:
    """Run the block; if an unsolved exercise stops it, show a notice and carry on (student
    edition only). Every other exception, and any stub error in the instructor edition, propagates."""
    try:
        yield
    except Exception as exc:
        message = unsolved_message(exc)
        if not message or not student_edition():
            raise
        show_notice(message)


def attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, or `{"unsolved": message}` when it needs an unsolved exercise.

    For labs that run several parts: the parts that need no exercise still run and report, and the
    notebook shows a notice for this one (`solved(...)`). Every rank must call it (the stub raises
    on every rank alike, so no rank is left waiting in a collective). The process prints its
    "[notice]" line once per exercise; in a notebook kernel it prints nothing (the cell that uses
    the record shows the notice)."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        message = unsolved_message(exc)
        if not message or not student_edition():
            raise
        if _notebook_cell() is None and _first_time(message, None):
            print(f"{PLAIN_PREFIX} {notice_text(message)}", flush=True)
        return {"unsolved": message}


def solved(value: Any) -> Any:
    """`value`, unless it is an `attempt(...)` record of an unsolved exercise: then raise Unsolved
    (inside `notice_if_unsolved()` that becomes the notice)."""
    if isinstance(value, dict) and set(value) == {"unsolved"}:
        raise Unsolved(value["unsolved"])
    return value


# ---------------------------------------------------------------------------- stubs in source
def stub_messages(source: str) -> list[str]:
    """Every exercise stub's message in `source` (adjacent string literals joined, as Python does)."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                and isinstance(node.exc.func, ast.Name) and node.exc.func.id == "NotImplementedError"
                and node.exc.args and isinstance(node.exc.args[0], ast.Constant)
                and isinstance(node.exc.args[0].value, str)
                and node.exc.args[0].value.startswith(STUB_PREFIX)):
            found.append(node.exc.args[0].value)
    return found


def stub_message(obj: Any) -> str:
    """The stub's message if the source of `obj` (a function, method or class) still raises an
    exercise stub, else "". Lets a test report "not implemented yet" without launching ranks."""
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        return ""
    found = stub_messages(source)
    return found[0] if found else ""
