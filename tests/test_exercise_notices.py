"""helpers/notice.py's notices: one per exercise per notebook cell, one "[notice]" line per
exercise per process (a lab's rank, a terminal run), and the records that `attempt` returns."""
from __future__ import annotations

import pytest

import helpers.notice as ex


def stub(name: str) -> str:
    return (f"Exercise {name} (notebook 09_combining.ipynb): a hint. Fill in the block in "
            "labs/lab09_planner.py and run ./run.sh check 09")


def raises(name: str):
    def fn():
        raise NotImplementedError(stub(name))
    return fn


@pytest.fixture
def student(monkeypatch):
    """The student edition, with nothing shown yet in this process."""
    monkeypatch.setattr(ex, "student_edition", lambda root=ex.REPO_ROOT: True)
    monkeypatch.setattr(ex, "_shown", set())


def test_attempt_prints_once_per_exercise_per_process(student, capsys, monkeypatch):
    """Four parts that need exercise a, one that needs b: every part gets its record, the log two lines."""
    monkeypatch.setattr(ex, "_notebook_cell", lambda: None)
    records = [ex.attempt(raises("a")) for _ in range(4)] + [ex.attempt(raises("b"))]
    assert records == [{"unsolved": stub("a")}] * 4 + [{"unsolved": stub("b")}]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "Exercise a is not done yet" in lines[0] and "Exercise b " in lines[1], lines
    with ex.notice_if_unsolved():          # the same process, a terminal: a is not announced again
        ex.solved(records[0])
    assert capsys.readouterr().out == ""


def test_notebook_shows_one_notice_per_exercise_per_cell(student, monkeypatch):
    """In a notebook, each cell shows each exercise's notice once; the next cell shows it again."""
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda data, raw=False: shown.append(data["text/plain"]))
    cell = {"count": 7}
    monkeypatch.setattr(ex, "_notebook_cell", lambda: cell["count"])
    assert ex.attempt(raises("a")) == {"unsolved": stub("a")}      # a kernel prints nothing for attempt
    for name in ("a", "a", "b", "a", "b"):
        with ex.notice_if_unsolved():
            raises(name)()
    assert [s.split(" is not done yet")[0] for s in shown] == ["[notice] Exercise a", "[notice] Exercise b"]
    cell["count"] = 8
    with ex.notice_if_unsolved():
        ex.solved({"unsolved": stub("a")})
    assert len(shown) == 3 and "Exercise a " in shown[-1]


def test_instructor_edition_excuses_nothing(monkeypatch):
    """Without the student-edition stamp a stub error is a bug: attempt and notice_if_unsolved raise it."""
    monkeypatch.setattr(ex, "student_edition", lambda root=ex.REPO_ROOT: False)
    with pytest.raises(NotImplementedError):
        ex.attempt(raises("a"))
    with pytest.raises(NotImplementedError):
        with ex.notice_if_unsolved():
            raises("a")()
