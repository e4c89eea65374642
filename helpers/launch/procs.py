"""Process trees that never outlive whoever started them: the course's one process-tree killer.

`start(cmd)` runs `cmd` under a small *guard* process (`python -m helpers.launch.procs guard -- cmd`):

    launching process (a notebook kernel, pytest, run.sh)
      └─ guard: a subreaper that watches its parent
           └─ cmd (torchrun, pytest) ─ its children (the ranks, in sessions of their own)

The guard ends the whole tree when any of these happens:
- its parent dies, even by SIGKILL (Jupyter's "restart kernel" kills a busy kernel that way, so no
  cleanup code of the kernel runs): PR_SET_PDEATHSIG on Linux, and polling getppid() everywhere;
- it receives SIGTERM, SIGINT or SIGHUP (the launcher's timeout or interrupt: `stop()`);
- `cmd` exits: whatever it left running (torchrun's workers after torchrun died) is killed.

It finds the tree by remembering every descendant it sees (polled with psutil), and on Linux it is
a child subreaper, so orphans of the tree are re-parented to it instead of to pid 1. Stdlib and
psutil only: no torch, so the guard starts in ~50 ms.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

import psutil

POLL_S = 0.2
TERM_GRACE_S = 2.0  # after SIGTERM, how long the tree may take to exit before SIGKILL


# ---------------------------------------------------------------------------- killing a tree
def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children()
    except psutil.Error:
        return []


def kill_processes(procs: Iterable[psutil.Process], sig: int = signal.SIGKILL) -> None:
    """Signal each process (and the process group it leads), skipping ones already gone or reused."""
    for proc in procs:
        try:
            if not proc.is_running():  # psutil compares the creation time: a reused pid is skipped
                continue
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, sig)
            proc.send_signal(sig)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue


def alive(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    found = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def kill_tree(root: int, known: Iterable[psutil.Process] = (), grace: float = 0.0) -> int:
    """End `root`, its descendants and the `known` processes; return how many were still running.

    With `grace` > 0 the tree first gets SIGTERM and that long to exit (torchrun forwards it to its
    workers); then everything left gets SIGKILL, repeatedly until nothing is left (a process may
    fork while we kill).
    """
    tracked = {p.pid: p for p in known}
    try:
        root_proc = psutil.Process(root)
        tracked[root] = root_proc
    except psutil.Error:
        pass
    tracked.update({p.pid: p for p in descendants(root)})
    running = alive(tracked.values())
    if grace > 0 and running:
        kill_processes(running, signal.SIGTERM)
        psutil.wait_procs(running, timeout=grace)
    for _ in range(20):
        tracked.update({p.pid: p for p in descendants(root)})
        left = alive(tracked.values())
        if not left:
            break
        kill_processes(left, signal.SIGKILL)
        psutil.wait_procs(left, timeout=0.5)
    return len(running)


# ---------------------------------------------------------------------------- the guard
def _prctl(option: int, value: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(option, value, 0, 0, 0)


PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def guard(cmd: Sequence[str]) -> int:
    """Run `cmd`; kill its whole tree when it exits, when we are told to stop, or when our parent dies."""
    return supervise(lambda: subprocess.Popen(list(cmd), preexec_fn=_child_dies_with_guard),
                     watch=os.getppid())


def supervise(start_child, watch: int) -> int:
    """Be the guard of the child `start_child()` starts (a Popen, or a `Forked`): end its whole
    tree when it exits, when we get SIGTERM, SIGINT or SIGHUP, or when process `watch` (whoever the
    tree must not outlive) is gone. Returns the child's exit status (128 + N for a signal N)."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    stop = {"signal": 0}

    def on_signal(signum, frame):
        stop["signal"] = signum

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    if not _exists(watch):  # it died before PDEATHSIG was armed
        return 1
    child = start_child()
    tracked: dict[int, psutil.Process] = {}
    me = os.getpid()
    code = None
    while True:
        tracked.update({p.pid: p for p in descendants(me)})
        code = child.poll()
        if code is not None or stop["signal"] or not _exists(watch):
            break
        time.sleep(POLL_S)
    if code is None:  # told to stop: the child may have ended meanwhile (then its status stands)
        code = child.poll()
    grace = TERM_GRACE_S if code is None else 0.0
    kill_tree(child.pid, tracked.values(), grace=grace)
    if code is None:
        code = child.wait()
    _reap_orphans()
    return code if code >= 0 else 128 - code


def _exists(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Forked:
    """`fn()` in a forked child (it dies with us), with the Popen calls `supervise` uses; its exit
    status is `fn`'s return value (an exception: its traceback on stderr, and 1)."""

    def __init__(self, fn):
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                _child_dies_with_guard()
                code = fn()
            except BaseException:  # noqa: BLE001  the child's end, whatever ended it
                import traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code if isinstance(code, int) else 1)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by kill_tree (psutil), which killed it
                pid, status = self.pid, signal.SIGKILL
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            try:
                _, status = os.waitpid(self.pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
            except ChildProcessError:  # reaped by kill_tree (psutil), which killed it
                self.returncode = -signal.SIGKILL
        return self.returncode


def _child_dies_with_guard() -> None:
    # If the guard itself is SIGKILLed, its direct child (torchrun) goes too.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _reap_orphans() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def start(cmd: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """Popen `cmd` under a guard, in a session of its own (a terminal's Ctrl-C goes to us only).

    Stop it with `stop(proc)`. The guard passes stdin/stdout/stderr through and exits with
    `cmd`'s exit status (128 + N when a signal N ended it).
    """
    guarded = [sys.executable, "-m", "helpers.launch.procs", "guard", "--", *cmd]
    env = dict(popen_kwargs.pop("env", None) or os.environ)
    here = str(Path(__file__).resolve().parents[2])  # the repository
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.Popen(guarded, env=env, start_new_session=True, **popen_kwargs)


def stop(proc: subprocess.Popen, wait: float = 10.0) -> None:
    """Ask the guard to end the tree (SIGTERM, a short grace, then SIGKILL); make sure it did."""
    tree = descendants(proc.pid)
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            pass
    kill_tree(proc.pid, tree)  # the guard's work, done again from here in case it was killed
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "guard" and argv[1] == "--" and len(argv) > 2:
        return guard(argv[2:])
    print("usage: python -m helpers.launch.procs guard -- CMD [ARGS...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
