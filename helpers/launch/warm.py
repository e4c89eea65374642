"""torchrun without its import: a warm launcher for the launches that fork their ranks.

Every launch starts torchrun, a Python process that imports torch before it does anything: about
1.5 CPU-seconds and as many wall seconds, most of a small launch (a two-rank launch that does
nothing takes about 1.9 s with forked ranks). A process that launches many times (a test run, a
grading sandbox) starts one *warm launcher* instead, once: a process that has imported
`torch.distributed.run` and does nothing else. Each launch asks it over a UNIX socket; it forks,
and the child runs torchrun's own `main()` under a guard (`helpers.launch.procs.supervise`), with the
launch's arguments, environment, working folder and output pipe:

    launching process ── request (argv, env, cwd; stdin/stdout/stderr passed as fds) ──┐
    warm launcher (imported torch.distributed.run; one thread; never computes)        │
      └─ guard (a fork: subreaper, watches the launching process)   <─────────────────┘
           └─ torchrun's main() (a fork)
                └─ the ranks (forks of torchrun: `--start-method fork`)

The launching process sees a `WarmProcess`, which answers what `helpers.launch` asks of a Popen
(pid, stdout, poll, wait, send_signal), so `procs.stop` and the rank bookkeeping work unchanged.
Nothing outlives the launching process: the warm launcher polls it and exits when it is gone, and
each guard watches it too (and dies with the warm launcher) and ends its tree.

Forking is safe here because the warm launcher never runs a torch operation or starts a thread
(torchrun's own fork start method relies on the same). Linux only; `launch` falls back to a
fresh torchrun anywhere else, and when the warm launcher cannot start.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

from helpers.launch import procs

REQUEST_BYTES = 4 << 20     # a request: argv and the environment, as JSON
START_TIMEOUT_S = 120.0     # the warm launcher's own start (an import of torch, on a busy machine)
_lock = threading.Lock()
_launcher: "WarmLauncher | None" = None


def available() -> bool:
    return sys.platform.startswith("linux") and hasattr(socket, "send_fds")


def start(argv: Sequence[str], env: dict[str, str], cwd: str | os.PathLike) -> "WarmProcess":
    """torchrun `argv` (its arguments, without `python -m torch.distributed.run`) from this
    process's warm launcher, started on first use. OSError if it cannot start."""
    global _launcher
    with _lock:
        if _launcher is None or not _launcher.alive():
            _launcher = WarmLauncher()
        launcher = _launcher
    return WarmProcess(launcher.path, list(argv), env, str(cwd))


# ---------------------------------------------------------------------------- the launching side
class WarmLauncher:
    """The warm launcher process of this process, and the socket it listens on."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="course-warm-")
        self.path = os.path.join(self.folder, "socket")
        here = str(Path(__file__).resolve().parents[2])  # the repository
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])]))
        self.proc = subprocess.Popen([sys.executable, "-m", "helpers.launch.warm", self.path], env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise OSError("the warm launcher did not start")
            time.sleep(0.02)
        atexit.register(self.close)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for name in (self.path, self.folder):
            try:
                (os.unlink if name == self.path else os.rmdir)(name)
            except OSError:
                pass


class WarmProcess:
    """One launch started by the warm launcher, seen as the Popen of its guard."""

    def __init__(self, path: str, argv: list[str], env: dict[str, str], cwd: str):
        read, write = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(path)
            request = json.dumps({"argv": argv, "env": env, "cwd": cwd, "client": os.getpid()})
            socket.send_fds(self._conn, [request.encode() + b"\n"], [null, write, write])
            self.pid = int(self._line())
        except (OSError, ValueError):
            self._conn.close()
            os.close(read)
            raise OSError("the warm launcher did not take the launch") from None
        finally:
            os.close(write)
            os.close(null)
        self.stdout = os.fdopen(read, "r", errors="replace", buffering=1)
        self.returncode: int | None = None

    def _line(self, timeout: float | None = 30.0) -> str:
        data = b""
        while not data.endswith(b"\n"):
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                raise OSError("no answer from the warm launcher")
            chunk = self._conn.recv(64)
            if not chunk:
                raise OSError("the warm launcher closed the connection")
            data += chunk
        return data.decode().strip()

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _, _ = select.select([self._conn], [], [], 0)
            if ready:
                self._finish()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired("warm launch", timeout)
            self._finish()
        return self.returncode

    def _finish(self) -> None:
        try:
            self.returncode = int(self._line(timeout=None))
        except (OSError, ValueError):  # the warm launcher died: its guard is gone with it
            self.returncode = -signal.SIGKILL
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ---------------------------------------------------------------------------- the warm launcher
def serve(path: str) -> int:
    """Accept launch requests on `path` until the parent is gone (or SIGTERM); fork a guard for each."""
    import torch.distributed.run  # noqa: F401  the import each launch would otherwise pay
    # A rank's first optimizer step imports torch._dynamo (torch.optim checks whether it is being
    # compiled): 1.5-1.7 CPU-s in every rank that trains, paid here once instead. It starts no
    # thread (tests/test_foundation.py checks the launcher's threads).
    import torch._dynamo  # noqa: F401

    # Its parent is polled, not watched with PR_SET_PDEATHSIG: that signal comes when the *thread*
    # that started this process ends, and launches come from any thread of the launching process.
    parent = os.getppid()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # its guards follow it (PDEATHSIG)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the socket appears once it accepts
    waiting: dict[int, socket.socket] = {}  # guard pid -> the connection that waits for its end
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            pid = _fork_guard(conn, listener, waiting)
            if pid:
                waiting[pid] = conn
        _reap(waiting)
    return 0


def _fork_guard(conn: socket.socket, listener: socket.socket, waiting: dict) -> int:
    try:
        data, fds, _, _ = socket.recv_fds(conn, REQUEST_BYTES, 3)
        while not data.endswith(b"\n"):
            more = conn.recv(REQUEST_BYTES)
            if not more:
                raise ValueError("a request cut short")
            data += more
        request = json.loads(data)
    except (OSError, ValueError):
        conn.close()
        return 0
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            listener.close()
            for other in waiting.values():
                other.close()
            conn.close()
            os.setsid()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            code = procs.supervise(lambda: procs.Forked(lambda: _torchrun(request["argv"])),
                                   watch=int(request["client"]))
        except BaseException:  # noqa: BLE001  said on the launch's own output
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    return pid


def _torchrun(argv: list[str]) -> int:
    """torchrun's main() in this (forked) process; its exit status."""
    import torch
    from torch.distributed.run import main

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # read by OpenMP when torch was loaded, not now
        torch.set_num_threads(int(threads))
    sys.argv = ["torchrun", *argv]
    try:
        main(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    return 0


def _reap(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            conn.close()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m helpers.launch.warm SOCKET_PATH")
    sys.exit(serve(sys.argv[1]))
