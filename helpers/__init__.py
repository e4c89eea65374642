"""The course's shared package: what labs, notebooks and tests import. One job a module:

- config: every setting (environment variable) the course reads, read and checked once;
- runs: one run description per lab (its sizes, ranks and tolerances, with full, smoke and tour
  presets), from which its command line, ./run.sh, the notebooks and the tests take their values;
- dist: the backend and device choice, the process group and every sub-group and mesh (with
  DIST_TIMEOUT, named), what a rank reports and how it fails;
- launch/: starting ranks (torchrun from a notebook cell, a test or run.sh) and never leaving one
  behind: torchrun, procs, warm, cli, run_labs;
- notice: an unsolved exercise's notice instead of a failure (notebooks, labs, tests);
- bench, comm_bench: timing done right; collectives' bandwidth and each call's fixed cost;
- traffic: the traffic meter: every collective and message a rank issues, by mesh dimension,
  checked against CommDebugMode and the flight recorder;
- comm_count: what a process sends (point-to-point, collectives: views of the meter; or counted by
  the caller);
- memory: what autograd saves for the backward, and the peak allocated during a block;
- accounting, tensors: the bytes a process holds; even splits, seeded construction;
- show: tables, figures and explorers, in a notebook and on a terminal;
- flight_recorder, mystery_jobs: notebook 10's instruments (torch's flight recorder; the jobs of
  the `diagnose` exercise);
- notebook_filter, lean_imports, update: the repository's own tooling (git's filter for notebooks;
  one slow import left out of the processes that read notebooks; `./run.sh update`).

The run mode is below: `smoke()`, and `pick(full, small)` for the labs whose sizes are not yet
in a run description (helpers/runs.py). The homework application (check, submit, release,
grade) is a package of its own, homework/.
"""
from __future__ import annotations


def smoke() -> bool:
    """COURSE_SMOKE=1 shrinks sizes and steps (CI and `./run.sh test`); students get full size."""
    from helpers.config import settings

    return settings().smoke


def pick(full, small):
    """`full` normally, `small` in smoke mode: `steps = pick(200, 20)`."""
    return small if smoke() else full
