"""What run.sh calls to run labs and scripts: `python -m helpers.cli labs [NN]` or
`python -m helpers.cli script path/to/script.py [args...]`.

Ranks per node come from NPROC (default: the GPU count when >= 2, else 2 on the CPU). Multi-node
runs take NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT (torchrun's static rendezvous on node 0's
address); a single node always uses torchrun --standalone, which picks a free port.
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from helpers.launch import REPO_ROOT, LaunchError, LaunchResult, default_nproc, launch, resolve_script
from helpers.show import table

LAB_TIMEOUT_S = float(os.environ.get("LAB_TIMEOUT", "900"))


def discover_labs(selection: str | None = None) -> list[Path]:
    """labs/labNN_*.py in order; `selection` "NN" (or "N") keeps one lab number's files."""
    labs = sorted((REPO_ROOT / "labs").glob("lab[0-9][0-9]_*.py"))
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
    """NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT from the environment, validated."""
    raw = {k: os.environ.get(k, "") for k in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    nnodes = _whole(raw["NNODES"] or "1", "NNODES", minimum=1)
    if nnodes == 1:
        return {}
    node_rank = _whole(raw["NODE_RANK"] or "0", "NODE_RANK", minimum=0)
    if node_rank >= nnodes:
        raise LaunchError(f"NODE_RANK={node_rank} must be below NNODES={nnodes}")
    if not raw["MASTER_ADDR"] or not raw["MASTER_PORT"]:
        raise LaunchError("NNODES > 1 needs MASTER_ADDR and MASTER_PORT: node 0's address and a "
                          "port open on it, the same on every node")
    port = _whole(raw["MASTER_PORT"], "MASTER_PORT", minimum=1)
    return dict(nnodes=nnodes, node_rank=node_rank, master_addr=raw["MASTER_ADDR"], master_port=port)


def _whole(raw: str, name: str, minimum: int) -> int:
    if not re.fullmatch(r"\d+", raw) or int(raw) < minimum:
        raise LaunchError(f"{name} must be a whole number >= {minimum}, got '{raw}'")
    return int(raw)


def summary_row(lab: Path, nproc: int, nnodes: int, result: LaunchResult | None, seconds: float,
                ok: bool) -> dict:
    report = next(iter(result.results.values()), {}) if result else {}
    return dict(lab=lab.stem, backend=report.get("backend", "?"), device=report.get("device", "?"),
                ranks=nproc * nnodes, seconds=round(seconds, 1), result="ok" if ok else "FAILED")


def lab_nproc(lab: Path, default: int) -> int:
    """Ranks for one lab: `default`, unless the lab declares a module-level line `LAB_NPROC = N`
    (it needs N ranks, e.g. a 2 x 2 device mesh) and NPROC is not set (NPROC always wins)."""
    if os.environ.get("NPROC"):
        return default
    match = re.search(r"^LAB_NPROC = (\d+)\b", lab.read_text(), re.MULTILINE)
    return int(match.group(1)) if match else default


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
            res = launch(lab, nproc=ranks, timeout=LAB_TIMEOUT_S, **options)
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
        launch(path, *args, nproc=default_nproc(), timeout=LAB_TIMEOUT_S, **multinode_options())
    except LaunchError as err:
        if err.result is None:
            raise
        print(f"\n{err}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("labs", "script"):
        print("usage: python -m helpers.cli labs [NN] | script PATH [ARGS...]", file=sys.stderr)
        return 2
    try:
        default_nproc()  # validate NPROC before anything starts
        multinode_options()
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
    except KeyboardInterrupt:
        print("\ninterrupted: every rank was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
