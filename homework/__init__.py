"""The homework cycle: release the student edition, check, submit, grade.

    python -m homework release DIR             # instructor: write the student edition
    python -m homework check [NN]              # student: public tests, summary per exercise
    python -m homework submit                  # student: checks + archive (path = last line)
    python -m homework grade A.tar.gz... --out DIR   # instructor: hidden + public tests,
                                                     # each submission in a sandbox

(`./run.sh check|submit|release|grade ...` runs the same from the repository root.)

Conventions: exercise code sits between the nbgrader-style lines `### BEGIN SOLUTION` and
`### END SOLUTION` inside a function or method body in `labs/labNN_*.py`; the exercise's name is
the enclosing function (`Class.method` for methods) and `notebooks/NN_*.ipynb` explains it.
Public tests are `tests/public/test_labNN_*.py`, hidden ones `tests/hidden/test_labNN_*.py`,
marked `@pytest.mark.exercise("name")` and optionally `@pytest.mark.points(n)` (default 1).

Modules: solutions (find and stub solution blocks), files (what ships, notebook stripping),
release, splice (a submitted lab's exercises and own helpers put into the course's copy of the
lab: what check and grade run), watch (where an exercise raised, in every rank, also when the
test caught it), plugin (markers and result categories for pytest-reportlog's stream), runner
(bounded pytest runs, one process per run, reports checked), sandbox (bubblewrap), check, archive
(submission archive safety), submit, grade (trusted collection, canaries, verdicts). Nothing here
imports torch.
"""
