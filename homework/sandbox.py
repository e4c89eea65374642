"""One sandbox per submission, made by bubblewrap (`bwrap`, the OS package `bubblewrap`).

    grader (this process, outside)
      └─ bwrap                        new PID, network, IPC and UTS namespaces; the mounts below
           └─ bwrap, PID 1 inside     when it ends, the kernel kills every process inside
                └─ [setpriv: a user id of its own] prlimit → python -m pytest ...

Inside, the file system holds only: the system's /usr (with /bin, /lib... as the host has them) and
a few files of /etc (users, hosts, linker cache, fonts), the Python installation and the virtual
environment at their own paths, all read-only; the grading tree read-only at /course with the
submission's labs read-only at /course/labs; a FIFO at /homework/events for the report stream;
and private tmpfs scratch of bounded size at /tmp (HOME and TMPDIR) and /dev/shm, gone with the
sandbox. Not the instructor's checkout, not --out, not HOME, not other submissions. The network is
a loopback interface of its own (torchrun and gloo work on 127.0.0.1; nothing else is reachable).
Run as root, the tests run without capabilities as a user id of their own, drawn per sandbox from a
range no account uses (RLIMIT_NPROC counts the tasks of a user id, and is not enforced for root:
so the process limit holds, and counts this sandbox only); run as another user, in a user
namespace of that user.

Limits: address space per process, tasks (processes and threads) of the sandbox's user, file
size, open files, scratch sizes; the time is the runner's, which stops a run by killing the outer
bwrap: PID 1 inside dies with it (--die-with-parent), and every process inside with PID 1.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil

COURSE = "/course"
EVENTS = "/homework/events"
UID_RANGE = (0x70000000, 0x71000000)   # sandbox user ids: no account, no file owned by them
SYSTEM_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
ETC_FILES = ("passwd", "group", "hosts", "nsswitch.conf", "host.conf", "gai.conf", "ld.so.cache",
             "ld.so.conf", "ld.so.conf.d", "localtime", "fonts")
INSTALL_HINT = ("install the OS package `bubblewrap` (Debian/Ubuntu: sudo apt-get install bubblewrap; "
                "Fedora: sudo dnf install bubblewrap)")


class SandboxUnavailable(RuntimeError):
    """No sandbox can be made on this machine; the message says why and what to do."""


def _memory_default() -> int:
    """Address space per process: 8 GiB (torch maps much it never touches), or half of this
    machine's memory where that is more (thread arenas grow with the core count)."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        physical = 0
    return max(8 * 2**30, physical // 2)


@dataclass(frozen=True)
class Limits:
    memory: int = _memory_default()                   # address space of each process
    processes: int = max(1024, 8 * (os.cpu_count() or 1))  # tasks (processes, threads) in all
    file_size: int = 256 * 2**20   # one file
    open_files: int = 4096
    scratch: int = 1 * 2**30       # /tmp, tmpfs: counts against memory
    shm: int = 512 * 2**20         # /dev/shm (multiprocessing, torch's shared tensors)


def _python_roots() -> list[str]:
    """The Python installation(s) the grader runs, outermost first; /usr is mounted anyway."""
    found = set()
    for prefix in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
        found |= {os.path.abspath(prefix), os.path.realpath(prefix)}
    roots: list[str] = []
    for path in sorted(found):
        if path in ("/", "/usr") or path.startswith("/usr/"):
            continue
        if not any(path == r or path.startswith(r + "/") for r in roots):
            roots.append(path)
    return roots


class Sandbox:
    """Runs `python ARGS` on `tree` (at /course, read-only) in a fresh bubblewrap sandbox."""

    kind = "sandbox"

    def __init__(self, tree: Path, labs: Path | None = None, limits: Limits = Limits(),
                 env: dict[str, str] | None = None):
        self.tree, self.labs, self.limits = Path(tree), labs, limits
        self.env = env or {}
        self.bwrap = shutil.which("bwrap")
        self.as_root = os.geteuid() == 0
        self.uid = random.SystemRandom().randrange(*UID_RANGE)

    def environment(self) -> dict[str, str]:
        env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
               "HOME": "/tmp", "TMPDIR": "/tmp", "USER": "student", "LOGNAME": "student",
               "LANG": "C.UTF-8", "PYTHONPATH": COURSE,
               "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1",
               "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "MPLBACKEND": "Agg",
               "GLOO_SOCKET_IFNAME": "lo", "COURSE_SMOKE": os.environ.get("COURSE_SMOKE", "1")}
        for name in ("NPROC", "DIST_TIMEOUT", "LAB_TIMEOUT"):
            if name in os.environ:
                env[name] = os.environ[name]
        env.update(self.env)
        return env

    def command(self, args: list[str], events: Path | None) -> list[str]:
        if not self.bwrap:
            raise SandboxUnavailable(f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}")
        limits = self.limits
        cmd = [self.bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
               "--unshare-cgroup-try", "--hostname", "localhost", "--die-with-parent", "--new-session"]
        if not self.as_root:
            cmd.append("--unshare-user")
        cmd += ["--ro-bind", "/usr", "/usr"]
        for name in SYSTEM_LINKS:
            path = f"/{name}"
            if os.path.islink(path):
                cmd += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                cmd += ["--ro-bind", path, path]
        cmd += ["--perms", "0755", "--dir", "/etc"]
        for name in ETC_FILES:
            if os.path.exists(f"/etc/{name}"):
                cmd += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
        cmd += ["--proc", "/proc", "--dev", "/dev",
                "--perms", "1777", "--size", str(limits.shm), "--tmpfs", "/dev/shm",
                "--perms", "1777", "--size", str(limits.scratch), "--tmpfs", "/tmp"]
        made = {"/", "/usr", "/etc", "/tmp", "/dev", "/proc"}
        for root in _python_roots():
            cmd += _parents(root, made) + ["--ro-bind", root, root]
        cmd += ["--ro-bind", str(self.tree), COURSE]
        if self.labs is not None:
            cmd += ["--ro-bind", str(self.labs), f"{COURSE}/labs"]
        if events is not None:
            cmd += ["--perms", "0755", "--dir", os.path.dirname(EVENTS), "--bind", str(events), EVENTS]
        cmd += ["--chdir", COURSE, "--clearenv"]
        for name, value in self.environment().items():
            cmd += ["--setenv", name, value]
        if self.as_root:  # drop to a user id of its own, keeping nothing: then RLIMIT_NPROC holds
            cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--",
                    "setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups",
                    "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
        else:
            cmd.append("--")
        cmd += ["prlimit", f"--as={limits.memory}", f"--nproc={limits.processes}",
                f"--fsize={limits.file_size}", f"--nofile={limits.open_files}", "--core=0", "--",
                sys.executable, *args]
        return cmd

    def start(self, args: list[str], events: Path, collection: Path | None = None) -> "SandboxRun":
        if collection is not None:
            raise ValueError("collect the tests outside the sandbox, from the trusted tree")
        proc = subprocess.Popen(self.command([*args, f"--report-log={EVENTS}"], events),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        return SandboxRun(proc, self.limits)


def _parents(path: str, made: set[str]) -> list[str]:
    """bwrap makes missing parents of a mount point mode 0700, closed to the sandbox's user: 0755."""
    args = []
    parts = Path(path).parts
    for depth in range(2, len(parts)):
        parent = str(Path(*parts[:depth]))
        if parent not in made:
            made.add(parent)
            args += ["--perms", "0755", "--dir", parent]
    made.add(path)
    return args


class SandboxRun:
    """A running sandbox: looked at four times a second, killed as a whole."""

    def __init__(self, proc: subprocess.Popen, limits: Limits):
        self.proc, self.limits = proc, limits
        self.tasks = 0                      # most tasks seen at once
        self.orphans: set[tuple[int, float]] = set()  # re-parented to PID 1, at two looks running
        self._orphaned: set[tuple[int, float]] = set()
        self.scratch_full = False

    def _init(self) -> psutil.Process | None:
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return None
        return children[0] if children else None

    def tick(self) -> None:
        init = self._init()
        if init is None:
            return
        try:
            children = sorted(init.children(), key=lambda p: p.create_time())
            inside = init.children(recursive=True)
        except psutil.Error:
            return
        orphaned = set()
        for child in children[1:]:  # the first child is the command; the rest were orphaned
            try:
                if child.status() != psutil.STATUS_ZOMBIE:  # a zombie is only waiting to be reaped
                    orphaned.add((child.pid, child.create_time()))
            except psutil.Error:
                continue
        self.orphans = orphaned & self._orphaned  # not one dying as we looked
        self._orphaned = orphaned
        tasks = 0
        for proc in inside:
            try:
                tasks += proc.num_threads()
            except psutil.Error:
                continue
        self.tasks = max(self.tasks, tasks)
        try:
            stat = os.statvfs(f"/proc/{init.pid}/root/tmp")
            if stat.f_blocks and stat.f_bavail < 0.02 * stat.f_blocks:
                self.scratch_full = True
        except OSError:
            pass

    def stop(self) -> None:
        init = self._init()
        for target in (self.proc.pid, init.pid if init else None):
            if target is None:
                continue
            try:
                os.kill(target, signal.SIGKILL)  # PID 1 inside takes every process inside with it
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()
        if init is not None:
            psutil.wait_procs([init], timeout=5)

    def exit_code(self) -> int | None:
        code = self.proc.returncode
        return 128 - code if code is not None and code > 128 else code  # bwrap: 128 + signal

    def notes(self) -> list[str]:
        notes = []
        if self.exit_code() == -signal.SIGXFSZ:
            notes.append(f"the file size limit ({self.limits.file_size} bytes) was hit")
        if self.orphans:
            notes.append(f"{len(self.orphans)} process(es) still running at the end were killed "
                         "with the sandbox")
        if self.tasks >= 0.9 * self.limits.processes:
            notes.append(f"the process limit ({self.limits.processes} tasks) was reached")
        if self.scratch_full:
            notes.append("the scratch space (/tmp) filled up")
        return notes


PROBE = """
import os, socket, sys
try:
    import psutil, pytest, pytest_reportlog, pytest_timeout
except ImportError as exc:
    sys.exit(f"the Python inside cannot import what grading needs ({exc}); is it installed "
             "outside the Python prefix (user site-packages)?")
socket.getaddrinfo("localhost", 0)
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
c = socket.create_connection(s.getsockname(), timeout=5)
try:
    socket.create_connection(("1.1.1.1", 53), timeout=0.5)
    sys.exit("the network is reachable from inside")
except OSError:
    pass
if os.path.exists(sys.argv[1]):
    sys.exit("the grader's folder is visible from inside")
if os.getuid() == 0:
    sys.exit("the tests would run as root")
"""


def probe(limits: Limits = Limits()) -> None:
    """Make one sandbox and check it (loopback works, no network, not root, this folder hidden);
    SandboxUnavailable with the reason when that fails."""
    with tempfile.TemporaryDirectory(prefix="homework-probe-") as tmp:
        os.chmod(tmp, 0o755)
        sandbox = Sandbox(Path(tmp), limits=limits)
        try:
            done = subprocess.run(sandbox.command(["-c", PROBE, os.path.abspath(__file__)], None),
                                  capture_output=True, text=True, timeout=60,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxUnavailable(f"bubblewrap could not be run ({exc})") from None
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise SandboxUnavailable("bubblewrap could not make a working sandbox here: "
                                 f"{detail[-1] if detail else f'exit code {done.returncode}'}")
