"""Run a script under torchrun from a notebook cell, a test or run.sh, safely.

    from helpers.launch import launch
    res = launch("labs/lab00_orientation.py", nproc=2)   # streams every rank's output
    res.results[1]["device"]                             # what rank 1 reported (ctx.report)

Why not `!torchrun` or `mp.spawn` in a notebook: `!torchrun` ignores a non-zero exit, and
`mp.spawn` cannot pickle functions defined in the notebook (they live in `__main__`). Why not
`subprocess.run(timeout=...)`: it kills torchrun but not the workers, which torchrun starts in
sessions of their own, so they are left running. Here:

- torchrun runs under a guard (`helpers.launch.procs`) in a new session; every line any rank prints is
  streamed, labelled with its global rank (`[rank2]:` on the second node of two);
- on failure `LaunchError` names the rank that failed first and shows its traceback: the earliest
  of the ranks' error records and of the exceptions their exercises raised (recorded by
  homework.watch in the tests' launches, also when the caller caught them), else torchrun's
  "Root Cause";
- on timeout or KeyboardInterrupt (interrupting the cell) torchrun *and* its workers are killed,
  and if the launching process itself dies (a kernel restarted while the cell runs is SIGKILLed)
  the guard kills them within a second;
- single node uses `--standalone` (torchrun picks a free port): two launches never collide;
- each rank's `ctx.report(...)` values come back in `LaunchResult.results`, indexed by rank.

`fork_ranks=True` (the tests use it) starts torchrun from this process's warm launcher
(`helpers.launch.warm`: a process that imported torch once; no torchrun import per launch) and the ranks
as forks of torchrun (`--run-path --start-method fork`, Linux only) instead of as fresh `python -u
script` processes, so neither torchrun nor any rank imports torch again: a two-rank launch that
does nothing takes about 0.9 s instead of 3. The script, its ranks and what they report are the
same; what differs is torchrun's own failure summary (the multiprocessing form, whose "Root
Cause" may name a rank that only saw its peer go), so what students run, the lessons about
torchrun's reports, and restarts use the default. Left unset, `fork_ranks` follows
COURSE_FORK_RANKS=1 (the tests set it while they run the notebooks: tests/conftest.py), except
for a launch that restarts.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from helpers.launch import procs, warm
from helpers.config import settings
from helpers.dist import FINISHED, RESULTS_ENV, gpu_count

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_KEPT_OUTPUT = 2_000_000  # characters of output kept in LaunchResult (a flood is truncated)
FORK_RANKS_ENV = "COURSE_FORK_RANKS"  # "1": launches fork their ranks unless told otherwise
# torchrun's label for each output line; ${rank} is the global rank (${local_rank} repeats per node)
LINE_PREFIX_TEMPLATE = "[rank${rank}]:"


class LaunchError(RuntimeError):
    """A launch that failed, timed out or was given bad input; the message says which rank and why.

    `rank` is the rank that failed first (None when no rank recorded an error) and `summary` the
    last line of its traceback ("ValueError: ..."), or why the launch failed without one, followed
    by where in the labs it was raised (" at labs/lab04_ring.py:171 `chunks[recv].add_(x)`") when
    a frame of the traceback lies in labs/. `frames` holds those frames, innermost last, one line
    each ("labs/lab04_ring.py:171 in ring_all_reduce: `chunks[recv].add_(x)`")."""

    def __init__(self, message: str, result: "LaunchResult | None" = None, rank: int | None = None,
                 summary: str = "", frames: Sequence[str] = ()):
        super().__init__(message)
        self.result = result
        self.rank = rank
        self.summary = summary or message.splitlines()[0]
        self.frames = list(frames)


@dataclass
class RankException:
    """An exception that left an exercise function in a rank, recorded as it left (homework.watch:
    the tests' launches watch the exercises), whether or not the code that called it caught it."""
    time: float
    rank: int
    exercise: str
    text: str                   # its traceback, formatted
    line: str = ""              # "IndexError: list index out of range"
    where: str = ""             # "labs/lab04_ring.py:171 `chunks[recv].add_(x)`" (innermost in labs/)

    @property
    def summary(self) -> str:
        """Its last line, and where in the labs it was raised."""
        return _raised(self.text)


@dataclass
class LaunchResult:
    script: str
    nproc: int
    returncode: int
    seconds: float
    output: str
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    caught: list[RankException] = field(default_factory=list)  # oldest first

    @property
    def rank0(self) -> dict[str, Any]:
        return self.results.get(0, {})


def default_nproc() -> int:
    """NPROC if set, else the GPU count when there are 2 or more GPUs, else 2 (gloo on CPU)."""
    nproc = settings().nproc
    if nproc is not None:
        return nproc
    gpus = gpu_count()
    return gpus if gpus >= 2 else 2


def parse_nproc(raw: str | int) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise LaunchError(f"NPROC must be a positive whole number of ranks, got {raw!r}") from None
    if value < 1:
        raise LaunchError(f"NPROC must be a positive whole number of ranks, got {raw!r}")
    return value


def resolve_script(script: str | os.PathLike) -> Path:
    path = Path(script)
    if not path.is_absolute():
        candidates = [Path.cwd() / path, REPO_ROOT / path]
        path = next((p for p in candidates if p.exists()), candidates[-1])
    if not path.is_file():
        raise LaunchError(f"no such script: {script} (paths are relative to the repository root)")
    return path.resolve()


def torchrun_command(
    script: Path, args: Iterable[str], nproc: int, log_dir: Path, nnodes: int = 1,
    node_rank: int = 0, master_addr: str | None = None, master_port: int | None = None,
    torchrun_args: Iterable[str] = (), fork_ranks: bool = False,
) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--tee", "3", "--log-dir", str(log_dir)]
    if fork_ranks and sys.platform.startswith("linux"):  # fork is not safe on macOS
        cmd += ["--run-path", "--start-method", "fork"]
    if nnodes == 1:
        cmd.append("--standalone")  # torchrun picks a free port on this machine
    else:
        if not master_addr or not master_port:
            raise LaunchError("multi-node runs need MASTER_ADDR and MASTER_PORT (node 0's address)")
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank),
                "--master-addr", master_addr, "--master-port", str(master_port)]
    cmd += list(torchrun_args)
    cmd += [str(script), *map(str, args)]
    return cmd


def launch(
    script: str | os.PathLike,
    *args: Any,
    nproc: int | None = None,
    timeout: float = 600.0,
    env: Mapping[str, str] | None = None,
    stream: bool = True,
    check: bool = True,
    torchrun_args: Sequence[str] = (),
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    fork_ranks: bool | None = None,
) -> LaunchResult:
    """Run `script args` on `nproc` ranks; return what they printed and reported.

    Raises LaunchError (when `check`) if any rank fails, with the failing rank's error in the
    message, and on timeout. Ctrl-C / interrupting the cell kills every process of the launch.
    """
    path = resolve_script(script)
    nproc = default_nproc() if nproc is None else parse_nproc(nproc)
    if nnodes < 1:
        raise LaunchError(f"NNODES must be >= 1, got {nnodes}")
    restarts = any(a.startswith(("--max-restarts", "--max_restarts")) for a in torchrun_args)
    if fork_ranks is None:
        fork_ranks = settings().fork_ranks and not restarts
    with tempfile.TemporaryDirectory(prefix="course-launch-") as tmp:
        results_dir = Path(tmp) / "results"
        results_dir.mkdir()
        cmd = torchrun_command(path, [str(a) for a in args], nproc, Path(tmp) / "logs", nnodes,
                               node_rank, master_addr, master_port, torchrun_args, fork_ranks)
        child_env = _child_env(results_dir, nproc, env)
        if restarts:
            # Restarted gloo workers cannot reuse the agent's store in torch 2.13
            # (pytorch/pytorch#135712): give every attempt a fresh one.
            child_env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        start = time.perf_counter()
        try:
            returncode, output, reason = _run_streaming(cmd, child_env, timeout, stream,
                                                        warm_start=fork_ranks)
        except BaseException as exc:  # interrupted (a test's timeout): what the ranks had raised
            with contextlib.suppress(Exception):
                exc.course_caught = _read_caught(results_dir)
            raise
        seconds = time.perf_counter() - start
        if settings().launch_log:  # maintainers: where a test run's launches go
            with contextlib.suppress(OSError), open(settings().launch_log, "a") as log:
                log.write(f"{seconds:.1f}\t{nproc}\t{os.environ.get('PYTEST_CURRENT_TEST', '-')}\t"
                          f"{path.name} {' '.join(map(str, args))[:80]}\n")
        results = _read_results(results_dir)
        errors = _read_errors(results_dir)
        caught = _read_caught(results_dir)
    result = LaunchResult(str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path),
                          nproc, returncode, seconds, output, results, caught)
    if returncode != 0 and not reason and _teardown_abort(result, errors):
        # Every rank finished its work and met the others at the final barrier, then a process
        # died by SIGABRT while exiting: gloo occasionally aborts at interpreter exit with
        # "terminate called without an active exception" (seen about 1 launch in 20 on a 2-core
        # machine). The results are complete, so say so instead of failing the run. Anything
        # else after the work (an exception, sys.exit(1)) still fails it.
        print(f"note: {result.script}: a rank aborted while exiting, after every rank had "
              "finished its work (a known gloo teardown crash); the results are complete",
              file=sys.stderr, flush=True)
        return result
    if check and (returncode != 0 or reason):
        rank, summary, frames = _first_error(errors, reason, caught, output)
        raise LaunchError(_failure_message(result, reason, errors, _first_cause(errors, caught, output)),
                          result, rank, summary, frames)
    return result


def _first_error(errors: list[tuple[float, int, str]], reason: str,
                 caught: Sequence[RankException] = (), output: str = ""
                 ) -> tuple[int | None, str, list[str]]:
    """(the rank that failed first, its exception's last line + where in labs/, its labs/ frames),
    or (None, `reason`, []) when no rank is known to have failed (see _first_cause)."""
    cause = _first_cause(errors, list(caught), output)
    if cause is None:
        return None, reason, []
    return cause[0], cause[3], lab_frames(cause[1])


def _first_cause(errors: list[tuple[float, int, str]], caught: list[RankException], output: str
                 ) -> tuple[int, str, str, str] | None:
    """(rank, traceback, exercise or "", its line and where in the labs) of what went wrong
    first: the earliest of the ranks' error records and of the exceptions their exercises raised
    (a test may catch one and go on, until the ranks fall out of step and another rank dies of a
    timeout: that rank's error is not the cause); without either, torchrun's "Root Cause" from
    the output; None when there is none."""
    found = [(stamp, rank, text, "", _raised(text)) for stamp, rank, text in errors] + \
        [(c.time, c.rank, c.text, c.exercise, f"{c.line} at {c.where}" if c.line and c.where
          else c.summary) for c in caught]
    if found:
        return min(found, key=lambda item: item[0])[1:]
    root = _root_cause(output)
    return (*root, _raised(root[1])) if root else None


# torchrun's failure summary: "Root Cause (first observed failure):", then "  rank      : 0 ...",
# then "  traceback : Traceback ..." indented by two spaces, up to a line of "="
_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):\n(?P<body>.*?)\n=+", re.S)
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.M)


def _root_cause(output: str) -> tuple[int, str, str] | None:
    """(rank, traceback, "") of torchrun's "Root Cause" in a launch's output, when it shows one."""
    match = _ROOT_CAUSE.search(output)
    rank = _ROOT_RANK.search(match["body"]) if match else None
    if not match or not rank or "traceback : Traceback" not in match["body"]:
        return None
    lines = match["body"].split("traceback : ", 1)[1].splitlines()
    text = "\n".join([lines[0]] + [line[2:] if line.startswith("  ") else line for line in lines[1:]])
    return int(rank.group(1)), text.strip() + "\n", ""


# `  File "/path/labs/lab04_ring.py", line 171, in ring_all_reduce` (traceback.format_exception)
_FRAME_LINE = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
LAB_FOLDER = "labs"  # the student's files: where a rank's error is located for them
CODE_CHARS = 80      # code quoted from a frame, at most


def lab_frames(traceback_text: str, root: Path = REPO_ROOT) -> list[str]:
    """The frames of a formatted traceback that lie in the labs (the student's files), innermost
    last, one line each: "labs/lab04_ring.py:171 in ring_all_reduce: `chunks[recv].add_(x)`".
    From the exception raised (the last of a chain); if none of its frames is in labs/, from the
    exception it was raised while handling, and so on."""
    return [f"{path}:{line} in {func}" + (f": `{code}`" if code else "")
            for path, line, func, code in _lab_frames(traceback_text, root)]


def _lab_frames(text: str, root: Path = REPO_ROOT) -> list[tuple[str, str, str, str]]:
    """lab_frames as (path relative to root, line, function, code)."""
    root = root.resolve()
    blocks: list[list[tuple[str, str, str, str]]] = []
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            blocks.append([])
            continue
        match = _FRAME_LINE.match(line)
        if not match or not blocks:
            continue
        try:
            path = (root / match["file"]).resolve().relative_to(root)  # an absolute file stays
        except (ValueError, OSError):
            continue
        if path.parts[0] != LAB_FOLDER or path.suffix != ".py":
            continue
        following = lines[index + 1] if index + 1 < len(lines) else ""
        code = following.strip() if following.startswith("    ") else ""  # none: no source
        if set(code) <= set("^~ "):  # only the markers under an expression
            code = ""
        if len(code) > CODE_CHARS:
            code = code[: CODE_CHARS - 3] + "..."
        blocks[-1].append((path.as_posix(), match["line"], match["func"], code))
    return next((block for block in reversed(blocks) if block), [])


# gloo's source position in front of its messages: "RuntimeError: [/__w/.../pair.cc:553] Connection..."
_GLOO_PREFIX = re.compile(r"^(?P<kind>[\w.]+: )\[/[^\]]*\] ")


def _raised(text: str) -> str:
    """The exception's line, with where in the labs it was raised when it was (not for a stub:
    its message names its file already)."""
    last = _GLOO_PREFIX.sub(r"\g<kind>", text.strip().splitlines()[-1])
    frames = _lab_frames(text)
    if not frames or "NotImplementedError: Exercise " in last:
        return last
    path, line, _, code = frames[-1]
    return f"{last} at {path}:{line}" + (f" `{code}`" if code else "")


def _teardown_abort(result: LaunchResult, errors: list) -> bool:
    """Every rank finished and raised nothing; a rank died of SIGABRT and the others, if they
    failed at all, were stopped by torchrun (SIGTERM) because of it."""
    if errors or not _all_finished(result.results, result.nproc):
        return False
    codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", result.output))  # torchrun's failure table
    return "-6" in codes and codes <= {"-6", "-15"}


def _all_finished(results: dict[int, dict[str, Any]], nproc: int) -> bool:
    return len(results) == nproc and all(r.get(FINISHED) for r in results.values())


def _child_env(results_dir: Path, nproc: int, extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env[RESULTS_ENV] = str(results_dir)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", LINE_PREFIX_TEMPLATE)
    # torchrun would set 1 thread per rank and print a banner about it; say it ourselves: the
    # cores are shared out between the ranks.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def _run_streaming(cmd: list[str], env: dict[str, str], timeout: float, stream: bool,
                   warm_start: bool = False):
    """Run torchrun under a guard, streaming lines; end the whole tree on timeout or interrupt.
    `warm_start`: from this process's warm launcher (helpers.launch.warm), when it can."""
    proc = None
    if warm_start and warm.available():
        try:
            proc = warm.start(cmd[3:], env, REPO_ROOT)  # cmd[3:]: after python -m torch.distributed.run
        except OSError:
            proc = None  # a fresh torchrun, below
    if proc is None:
        proc = procs.start(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1)
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True)
    reader.start()
    kept: list[str] = []
    kept_chars = 0
    reason = ""
    deadline = time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                reason = f"timed out after {timeout:.0f} s"
                break
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None:
                break
            if kept_chars < MAX_KEPT_OUTPUT:
                kept.append(line)
                kept_chars += len(line)
            if stream:
                print(line, end="", flush=True)
    except KeyboardInterrupt:
        ranks = _ranks_of(proc)
        procs.stop(proc)
        left = procs.alive(ranks)
        message = (f"stopped: {len(ranks)} rank(s) killed, no process left" if not left else
                   f"stopped, but {len(left)} process(es) could not be killed: {[p.pid for p in left]}")
        if not _ipython_running():  # IPython shows the exception itself as this one line
            print(message, file=sys.stderr, flush=True)
        raise _one_line_interrupt(message) from None
    except BaseException:  # e.g. pytest-timeout's Failed raised in this thread: leave nothing behind
        procs.stop(proc)
        raise
    procs.stop(proc)  # after a timeout; or, after a normal exit, whatever torchrun left running
    if kept_chars >= MAX_KEPT_OUTPUT:
        kept.append("\n[... output truncated ...]\n")
    return proc.returncode, "".join(kept), reason


def _one_line_interrupt(message: str) -> KeyboardInterrupt:
    """The KeyboardInterrupt an interrupted launch raises, which IPython (a notebook's kernel, the
    ipython shell) shows as one line, "KeyboardInterrupt: stopped: ...", not as a traceback through
    the launcher's internals: IPython draws what an exception's `_render_traceback_()` returns in
    place of its traceback. Plain Python prints its usual traceback."""
    interrupt = KeyboardInterrupt(message)
    line = f"\x1b[0;31mKeyboardInterrupt\x1b[0m: {message}"  # the name in red, as IPython draws it
    interrupt._render_traceback_ = lambda: [line]
    return interrupt


def _ipython_running() -> bool:
    ipython = sys.modules.get("IPython")  # never imported here: a terminal does not pay for it
    return ipython is not None and ipython.get_ipython() is not None


def _ranks_of(proc) -> list:
    """The worker processes of a guarded torchrun: torchrun's children (grandchildren of the
    guard), whether torchrun started them as fresh processes or forked them."""
    ranks = []
    for torchrun in procs.children(proc.pid):
        ranks += procs.children(torchrun.pid)
    return ranks


def _pump(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


def _read_results(folder: Path) -> dict[int, dict[str, Any]]:
    results = {}
    for path in folder.glob("rank*.json"):
        try:
            results[int(path.stem[4:])] = json.loads(path.read_text())
        except (ValueError, json.JSONDecodeError):
            continue
    return dict(sorted(results.items()))


def _read_caught(folder: Path) -> list[RankException]:
    """The exceptions the ranks' exercises raised (homework.watch's records), oldest first."""
    caught = []
    for path in folder.glob("caught.rank*.json"):
        try:
            record = json.loads(path.read_text())
            caught.append(RankException(float(record["time"]), int(record["rank"]),
                                        str(record["exercise"]), str(record["traceback"]),
                                        str(record.get("line", "")), str(record.get("where", ""))))
        except (OSError, ValueError, KeyError, TypeError):  # not a whole record: not ours to read
            continue
    return sorted(caught, key=lambda c: c.time)


def _read_errors(folder: Path) -> list[tuple[float, int, str]]:
    errors = []
    for path in folder.glob("error.rank*.txt"):
        stamp, _, text = path.read_text().partition("\n")
        try:
            errors.append((float(stamp), int(path.name[len("error.rank"):-len(".txt")]), text))
        except ValueError:  # not a record error.rank wrote (they are written whole)
            continue
    return sorted(errors)


def _failure_message(result: LaunchResult, reason: str, errors: list[tuple[float, int, str]],
                     cause: tuple[int, str, str, str] | None) -> str:
    head = f"{result.script} on {result.nproc} rank(s) "
    head += reason if reason else f"failed with exit code {result.returncode}"
    head += f" after {result.seconds:.1f} s"
    if cause:
        rank, text, exercise, summary = cause  # the first rank to fail is the cause; the others followed
        tail = "\n".join(text.strip().splitlines()[-25:])
        message = f"{head}: rank {rank} raised {summary}"
        if exercise:  # recorded as it left the exercise (its caller may have caught it)
            message += f" (in {exercise})"
        message += f"\n--- rank {rank} traceback (end) ---\n{tail}"
        later = [(r, t) for _, r, t in errors if r != rank]  # what the others died of
        if exercise and later:
            message += f"\n--- then ---\nrank {later[0][0]} raised {_raised(later[0][1])}"
        return message
    tail = "\n".join(result.output.strip().splitlines()[-25:])
    return f"{head}.\n--- last output ---\n{tail}"
