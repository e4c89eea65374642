"""Run several labs' `run(ctx)` in one torchrun launch: one torch start and one process group for
all of them, where a launch per lab would pay both each time (seconds per launch).

    from helpers.launch import launch
    res = launch("helpers/launch/run_labs.py", "lab03_equivalence", "lab03_training", nproc=2)
    res.rank0["lab03_training"]      # what labs/lab03_training.py's run(ctx) returned on rank 0

The labs run in the order given, on every rank, inside one `helpers.dist.distributed()`, each on
its run description's preset (helpers/runs.py: smoke under COURSE_SMOKE=1, else full; `--preset
NAME` before the labs' names picks another); each one's return value is reported under its name (and whatever it reported itself stays as it was),
or, when its run needs an exercise that is still a stub (student edition), the record
`{"unsolved": message}` of helpers.notice.attempt: the other labs still run, and the notebook
shows the notice where it uses that lab's result (`solved(...)`).
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: import from the repository root, not from helpers/
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from helpers import runs  # noqa: E402
from helpers.dist import distributed  # noqa: E402
from helpers.notice import attempt  # noqa: E402


def main(names: list[str]) -> None:
    preset = None
    if names[:1] == ["--preset"]:
        preset, names = names[1], names[2:]
    if not names:
        raise SystemExit("usage: helpers/launch/run_labs.py [--preset NAME] LAB [LAB ...]   "
                         "(e.g. lab03_training)")
    labs = [importlib.import_module(f"labs.{name}") for name in names]  # a typo fails before setup
    with distributed() as ctx:
        for name, lab in zip(names, labs):
            ctx.report(**{name: attempt(runs.run_lab, lab, ctx, preset)})


if __name__ == "__main__":
    main(sys.argv[1:])
