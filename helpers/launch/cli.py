"""What run.sh calls to run labs and scripts: `python -m helpers.launch.cli labs [NN]` or
`python -m helpers.launch.cli script path/to/script.py [args...]`.

Ranks per node come from NPROC (default: the GPU count when >= 2, else 2 on the CPU). Multi-node
runs take NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT (torchrun's static rendezvous on node 0's
address); a single node always uses torchrun --standalone, which picks a free port.
"""
from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

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


def lab_nproc(lab: Path, default: int) -> int:
    """Ranks for one lab: `default`, unless the lab declares `LAB_NPROC = N` at module level (it
    needs N ranks, e.g. a 2 x 2 device mesh) and NPROC is not set (NPROC always wins). Read from
    the lab's source (its syntax tree: importing it would import torch)."""
    if settings().nproc is not None:
        return default
    for node in ast.parse(lab.read_text()).body:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["LAB_NPROC"]
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, int)):
            return node.value.value
    return default


def run_labs(selection: str | None) -> int:
    labs = discover_labs(selection)
    nproc, options = default_nproc(), multinode_options()
    nnodes = options.get("nnodes", 1)
    cores = os.cpu_count() or 1
    if nproc > cores:
        print(f"note: {nproc} ranks on {cores} CPU cores: they will share cores and run slowly")
    rows = []
    for lab in labs:
        ranks = lab_nproc(lab, nproc)
        print(f"\n=== {lab.relative_to(REPO_ROOT)}: {ranks} rank(s) x {nnodes} node(s) ===", flush=True)
        try:
            res = launch(lab, nproc=ranks, timeout=settings().lab_timeout, **options)
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
    try:
        launch(path, *args, nproc=default_nproc(), timeout=settings().lab_timeout,
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
