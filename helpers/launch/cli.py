"""What run.sh calls to run labs and scripts: `python -m helpers.launch.cli labs [NN]` or
`python -m helpers.launch.cli script path/to/script.py [args...]`.

A lab's sizes and ranks come from its run description (helpers/runs.py): `./run.sh NN` runs it at
full size (smoke under COURSE_SMOKE=1), `./run.sh` runs every lab with `--preset tour`, its ranks
forked from a warm launcher (helpers/launch/warm.py), so the whole tour ends within minutes. Ranks per node: the lab's RANKS when it needs an exact count, else
NPROC, else the GPU count when >= 2, else 2 on the CPU; a lab that cannot run on the ranks NPROC
asks for says so before anything starts, as do a script's bad arguments. Multi-node runs take
NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT (torchrun's static rendezvous on node 0's address);
a single node always uses torchrun --standalone, which picks a free port.
"""
from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

from helpers import runs
from helpers.config import ConfigError, settings
from helpers.launch.torchrun import (REPO_ROOT, LaunchError, LaunchResult, default_nproc, launch,
                                     resolve_script)
from helpers.show import table

def discover_labs(selection: str | None = None) -> list[Path]:
    """labs/labNN_*.py in order; `selection` "NN" (or "N") keeps one lab number's files. A file
    without a `__main__` block is a library of its lab (e.g. lab12_checkpoint.py): not launched."""
    labs = sorted(p for p in (REPO_ROOT / "labs").glob("lab[0-9][0-9]_*.py") if "__main__" in p.read_text())
    if selection is None:
        return labs
    if not re.fullmatch(r"\d{1,2}", selection):
        raise LaunchError(f"'{selection}' is not a lab number (try ./run.sh 00, or ./run.sh --help)")
    number = f"{int(selection):02d}"
    chosen = [p for p in labs if p.name.startswith(f"lab{number}_")]
    if not chosen:
        known = sorted({p.name[3:5] for p in labs})
        raise LaunchError(f"there is no lab {number}; the labs are {', '.join(known)}")
    return chosen


def multinode_options() -> dict:
    """NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT (helpers.config checks them) as launch()'s
    keyword arguments; none for a single node."""
    config = settings()
    if config.nnodes == 1:
        return {}
    return dict(nnodes=config.nnodes, node_rank=config.node_rank, master_addr=config.master_addr,
                master_port=config.master_port)


def summary_row(lab: Path, nproc: int, nnodes: int, result: LaunchResult | None, seconds: float,
                ok: bool) -> dict:
    report = next(iter(result.results.values()), {}) if result else {}
    return dict(lab=lab.stem, backend=report.get("backend", "?"), device=report.get("device", "?"),
                ranks=nproc * nnodes, seconds=round(seconds, 1), result="ok" if ok else "FAILED")


def lab_plan(lab: Path, default: int, preset: str | None) -> tuple[int, list[str]]:
    """(ranks, arguments) for one lab: from its run description (helpers/runs.py) when it has
    one, with `--preset preset` when a preset is asked for; otherwise (a lab not yet converted)
    `default` ranks, or its module-level `LAB_NPROC` when NPROC is not set, and no arguments.
    A lab that does not import launches anyway, with the default ranks, to show its error."""
    try:
        module = importlib.import_module(f"labs.{lab.stem}")
    except Exception:  # noqa: BLE001  (the launch will raise it, located, with the rank)
        return default, []
    description = runs.description(module)
    if description is None:
        declared = getattr(module, "LAB_NPROC", None)
        return (declared if isinstance(declared, int) and settings().nproc is None else default), []
    ranks = runs.ranks_for(description.preset(preset), default, lab=lab.stem)
    return ranks, (["--preset", preset] if preset else [])


def run_labs(selection: str | None) -> int:
    labs = discover_labs(selection)
    nproc, options = default_nproc(), multinode_options()
    nnodes = options.get("nnodes", 1)
    # every lab: `./run.sh` takes the tour's sizes, `./run.sh NN` the full ones (smoke under
    # COURSE_SMOKE=1, which the lab reads itself)
    preset = "tour" if selection is None and not settings().smoke else None
    plans = {}
    for lab in labs:  # every lab's ranks checked before the first one starts
        try:
            plans[lab] = lab_plan(lab, nproc, preset)
        except runs.RunError as err:
            raise LaunchError(str(err)) from None
    cores = os.cpu_count() or 1
    if max(ranks for ranks, _ in plans.values()) > cores:
        print(f"note: up to {max(r for r, _ in plans.values())} ranks on {cores} CPU cores: "
              "they will share cores and run slowly")
    rows = []
    for lab in labs:
        ranks, args = plans[lab]
        print(f"\n=== {lab.relative_to(REPO_ROOT)}{' ' + ' '.join(args) if args else ''}: "
              f"{ranks} rank(s) x {nnodes} node(s) ===", flush=True)
        try:
            # the tour forks its ranks from a warm launcher, as the tests do: no torch import per
            # launch (seconds each, over some 60 launches); ./run.sh NN starts them fresh
            res = launch(lab, *args, nproc=ranks, timeout=settings().lab_timeout,
                         fork_ranks=True if preset == "tour" else None, **options)
            rows.append(summary_row(lab, ranks, nnodes, res, res.seconds, True))
        except LaunchError as err:
            print(f"\n{err}", file=sys.stderr, flush=True)
            res = err.result
            rows.append(summary_row(lab, ranks, nnodes, res, res.seconds if res else 0.0, False))
    print()
    table(rows, title="Summary")
    failed = [r["lab"] for r in rows if r["result"] != "ok"]
    if failed:
        print(f"\n{len(failed)} lab(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def run_script(script: str, args: list[str]) -> int:
    path = resolve_script(script)
    nproc = default_nproc()
    if path.parent == REPO_ROOT / "labs":
        try:
            description = runs.lab_description(path)
        except Exception:  # noqa: BLE001  (the launch will raise it, located, with the rank)
            description = None
        if description is not None:
            try:
                config = description.from_argv(args)  # a bad flag is refused before any rank
                nproc = runs.ranks_for(config, nproc, lab=path.stem)
            except SystemExit as done:  # --help: argparse has printed it
                return 0 if done.code in (0, None) else 2
            except runs.RunError as err:
                raise LaunchError(str(err)) from None
    try:
        launch(path, *args, nproc=nproc, timeout=settings().lab_timeout,
               **multinode_options())
    except LaunchError as err:
        if err.result is None:
            raise
        print(f"\n{err}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("labs", "script"):
        print("usage: python -m helpers.launch.cli labs [NN] | script PATH [ARGS...]", file=sys.stderr)
        return 2
    try:
        settings()  # every setting checked before anything starts
        if argv[0] == "labs":
            return run_labs(argv[1] if len(argv) > 1 else None)
        if len(argv) < 2:
            raise LaunchError("give the script to run: ./run.sh path/to/script.py [args]")
        return run_script(argv[1], argv[2:])
    except LaunchError as err:
        if err.result is not None:
            print(f"\n{err}", file=sys.stderr)
            return 1
        print(f"run.sh: {err}", file=sys.stderr)
        return 2
    except ConfigError as err:
        print(f"run.sh: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: every rank was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
