"""The course's settings: every environment variable it reads, read and checked here, once.

    from helpers.config import settings
    settings().dist_timeout       # 60.0, or DIST_TIMEOUT's value, checked

`SETTINGS` is the one table of them: each variable's name, its default and what it means. The
README's settings table is printed from it (`python -m helpers.config markdown`, and a test checks
that they agree); `run.sh` asks this module to check the environment before it starts anything
(`python -m helpers.config check`: one line naming the variable, exit 2) and for the values it
uses itself (`python -m helpers.config get TEST_WORKERS`). A value that does not parse is a
`ConfigError` naming the variable, what it must be and an example, wherever it is read.

Stdlib only: run.sh runs it with whatever Python it finds, before the course's venv exists.
Variables that torch and torchrun read themselves (TORCH_*, TORCHELASTIC_*, OMP_NUM_THREADS,
GLOO_SOCKET_IFNAME) are theirs, and are not settings of the course.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping


class ConfigError(ValueError):
    """A setting with a value the course cannot use; the message names it and says what to set."""


def _positive_int(raw: str) -> int:
    if raw.strip().isdigit() and int(raw) >= 1:
        return int(raw)
    raise ValueError("a positive whole number")


def _whole(raw: str) -> int:
    if raw.strip().isdigit():
        return int(raw)
    raise ValueError("a whole number >= 0")


def _positive_seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if value > 0:
        return value
    raise ValueError("a positive number of seconds")


def _flag(raw: str) -> bool:
    if raw in ("", "0", "1"):
        return raw == "1"
    raise ValueError("1 (on) or 0 (off)")


def _device(raw: str) -> str:
    if raw in ("", "cpu"):
        return raw
    raise ValueError("cpu, or unset (the course chooses)")


def _text(raw: str) -> str:
    return raw


@dataclass(frozen=True)
class Setting:
    name: str                   # the environment variable
    field: str                  # its attribute on Config
    default: str                # the value when it is unset or empty ("" = unset)
    parse: Callable[[str], Any]
    example: str                # for the error message: NAME=example ./run.sh ...
    meaning: str                # one line, for the README's table
    audience: str               # students, instructors, maintainers, or internal (the course's own)


SETTINGS: tuple[Setting, ...] = (
    Setting("NPROC", "nproc", "", lambda raw: _positive_int(raw) if raw else None, "2 ./run.sh",
            "ranks per node (default: the GPU count when there are 2 or more GPUs, else 2 on the "
            "CPU)", "students"),
    Setting("DIST_TIMEOUT", "dist_timeout", "60", _positive_seconds, "10 ./run.sh 04",
            "process-group timeout in seconds: a rank that never joins a collective fails after it",
            "students"),
    Setting("LAB_TIMEOUT", "lab_timeout", "900", _positive_seconds, "1800 ./run.sh",
            "time limit in seconds for one lab file under `./run.sh` or `./run.sh NN`", "students"),
    Setting("COURSE_SMOKE", "smoke", "", _flag, "1 ./run.sh 03",
            "1: small sizes and few steps (`./run.sh test` sets it; students get full size)",
            "students"),
    Setting("COURSE_DEVICE", "device", "", _device, "cpu ./run.sh",
            "cpu: gloo on the CPU even when there are GPUs", "students"),
    Setting("NNODES", "nnodes", "1", _positive_int, "2 NODE_RANK=0 ./run.sh 03",
            "nodes of a multi-node run (each runs the same command)", "students"),
    Setting("NODE_RANK", "node_rank", "0", _whole, "1 NNODES=2 ./run.sh 03",
            "this node's number in a multi-node run, 0 .. NNODES-1", "students"),
    Setting("MASTER_ADDR", "master_addr", "", _text, "10.0.0.1 ./run.sh 03",
            "node 0's address, for a multi-node run", "students"),
    Setting("MASTER_PORT", "master_port", "", lambda raw: _positive_int(raw) if raw else None,
            "29500 ./run.sh 03", "a free port on node 0, for a multi-node run", "students"),
    Setting("LAB10_SEED", "lab10_seed", "", lambda raw: _whole(raw) if raw else None,
            "1234 ./run.sh 10", "the seed of lab 10's mystery jobs (default: drawn at random in "
            "the notebook, 0 under `./run.sh 10`)", "students"),
    Setting("COURSE_STUDENT_ID", "student_id", "", _text, "s1234567 ./run.sh submit",
            "your id in a submission (default: git's user.email, else user.name)", "students"),
    Setting("TEST_WORKERS", "test_workers", "3", _positive_int, "2 ./run.sh test",
            "pytest processes for `./run.sh test` (a launch spends part of its time waiting)",
            "maintainers"),
    Setting("COURSE_FORK_RANKS", "fork_ranks", "", _flag, "1",
            "1: launches start torchrun from a warm launcher and fork the ranks from it "
            "(the tests set it for their launches and the notebooks they run)", "maintainers"),
    Setting("COURSE_LAUNCH_LOG", "launch_log", "", _text, "/tmp/launches.tsv ./run.sh test",
            "a file that gets one line per launch: seconds, ranks, the test, the script",
            "maintainers"),
    Setting("COURSE_PYTHON", "python", "", _text, "/usr/bin/python3 ./run.sh",
            "the Python that run.sh uses (default: .venv, made on first use, or an active "
            "environment that has the requirements)", "maintainers"),
    Setting("COURSE_RESULTS_DIR", "results_dir", "", _text, "",
            "where a launch's ranks write their reports (set by the launcher)", "internal"),
    Setting("COURSE_CALLER_CWD", "caller_cwd", "", _text, "",
            "the folder run.sh was started from (set by run.sh)", "internal"),
)


@dataclass(frozen=True)
class Config:
    nproc: int | None
    dist_timeout: float
    lab_timeout: float
    smoke: bool
    device: str
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    lab10_seed: int | None
    student_id: str
    test_workers: int
    fork_ranks: bool
    launch_log: str
    python: str
    results_dir: str
    caller_cwd: str


def read(environ: Mapping[str, str] | None = None) -> Config:
    """Every setting from `environ` (default: this process's environment), checked."""
    environ = os.environ if environ is None else environ
    values = {}
    for setting in SETTINGS:
        raw = environ.get(setting.name, "").strip() or setting.default
        try:
            values[setting.field] = setting.parse(raw)
        except ValueError as exc:
            example = f" (e.g. {setting.name}={setting.example})" if setting.example else ""
            raise ConfigError(f"{setting.name} must be {exc}, got {environ.get(setting.name)!r}"
                              f"{example}") from None
    config = Config(**values)
    if config.node_rank >= config.nnodes:
        raise ConfigError(f"NODE_RANK={config.node_rank} must be below NNODES={config.nnodes}")
    if config.nnodes > 1 and (not config.master_addr or config.master_port is None):
        raise ConfigError("NNODES > 1 needs MASTER_ADDR and MASTER_PORT: node 0's address and a "
                          "port open on it, the same on every node")
    return config


def settings() -> Config:
    """The settings as the environment has them now (read afresh: a test may change it)."""
    return read()


def markdown() -> str:
    """The settings a student, instructor or maintainer may set, as the README's Markdown table."""
    rows = ["| variable | default | what it does |", "|---|---|---|"]
    for setting in SETTINGS:
        if setting.audience != "internal":
            default = f"`{setting.default}`" if setting.default else "unset"
            rows.append(f"| `{setting.name}` | {default} | {setting.meaning} |")
    return "\n".join(rows)


def text() -> str:
    """The same settings as plain text, for `./run.sh --help`."""
    shown = [s for s in SETTINGS if s.audience != "internal"]
    width = max(len(s.name) for s in shown)
    return "\n".join(f"  {s.name:<{width}}  {s.meaning}" + (f" (default {s.default})" if s.default else "")
                     for s in shown)


def main(argv: list[str]) -> int:
    try:
        config = read()
    except ConfigError as exc:
        print(f"run.sh: {exc}", file=sys.stderr)
        return 2
    if argv == ["check"]:
        return 0
    if argv in (["markdown"], ["text"]):
        print(markdown() if argv == ["markdown"] else text())
        return 0
    if len(argv) == 2 and argv[0] == "get":
        field = {s.name: s.field for s in SETTINGS}.get(argv[1])
        if field is None:
            print(f"no setting {argv[1]}; the settings are {', '.join(s.name for s in SETTINGS)}",
                  file=sys.stderr)
            return 2
        value = getattr(config, field)
        print("" if value is None else value)
        return 0
    print("usage: python -m helpers.config check | markdown | text | get NAME", file=sys.stderr)
    return 2


assert [s.field for s in SETTINGS] == [f.name for f in fields(Config)], "SETTINGS and Config agree"

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
