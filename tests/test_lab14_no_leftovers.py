"""Nothing of lab 14's fault-tolerance run outlives the cell that started it: with the replica
groups training and torchft's lighthouse listening, the launching process (a notebook kernel) is
interrupted (Ctrl-C, "interrupt the kernel") or SIGKILLed (Jupyter's "restart kernel" kills a busy
kernel that way): every process of the run ends within seconds and the lighthouse's port closes.

The two cases run at once (two launching processes), each a `launch("labs/lab14_failures.py",
"--only-ft", ...)` whose replica groups would train for a long time.

Run:  .venv/bin/python -m pytest tests/test_lab14_no_leftovers.py -q
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CODE = ("import signal\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"   # as a Jupyter kernel does
        "from helpers.launch import launch\n"
        "launch('labs/lab14_failures.py', '--only-ft', '--replicas', '2', '--group', '1', '--steps', '100000',\n"
        "       '--kill-at', '-1', nproc=1, timeout=600, stream=False)\n")


def start() -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), COURSE_SMOKE="1")
    return subprocess.Popen([sys.executable, "-c", CODE], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def replica_ranks(parent: subprocess.Popen) -> list[psutil.Process]:
    """The replica groups' ranks (not their torchrun agents or the guards above those)."""
    found = []
    for proc in psutil.Process(parent.pid).children(recursive=True):
        try:
            line = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "lab14_replicas.py" in line and "torch.distributed.run" not in line and "helpers.launch" not in line:
            found.append(proc)
    return found


def serving(proc: psutil.Process) -> bool:
    """Whether a rank listens on a port: its torchft Manager's server is up."""
    try:
        return any(c.status == psutil.CONN_LISTEN for c in proc.net_connections("tcp"))
    except psutil.Error:
        return False


def lighthouse_ports(parent: subprocess.Popen) -> set[int]:
    """Ports some process of the tree listens on at 127.0.0.1: the lighthouse among them."""
    ports = set()
    for proc in [psutil.Process(parent.pid), *psutil.Process(parent.pid).children(recursive=True)]:
        try:
            ports |= {c.laddr.port for c in proc.net_connections("tcp")
                      if c.status == psutil.CONN_LISTEN and c.laddr.ip == "127.0.0.1"}
        except psutil.Error:
            continue
    return ports


def running(parent: subprocess.Popen, deadline_s: float = 240.0) -> tuple[list[psutil.Process], set[int]]:
    """Wait until both replica groups' ranks run (one rank each), then return the whole tree and
    the listening ports."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and parent.poll() is None:
        ranks = replica_ranks(parent)
        if len(ranks) >= 2 and all(serving(rank) for rank in ranks):
            time.sleep(1.0)       # the managers are up (each serves): quorum, then training
            tree = psutil.Process(parent.pid).children(recursive=True)
            return tree, lighthouse_ports(parent)
        time.sleep(0.3)
    os.killpg(parent.pid, signal.SIGKILL)
    pytest.fail("the replica groups never started: " + parent.communicate()[0].decode(errors="replace")[-3000:])


def gone(procs: list[psutil.Process], within: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=within)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def listening(ports: set[int]) -> set[int]:
    return {c.laddr.port for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port in ports}


def test_interrupt_and_kernel_restart_leave_nothing_behind():
    interrupted, killed = start(), start()
    try:
        tree_i, ports_i = running(interrupted)
        tree_k, ports_k = running(killed)
        assert ports_i and ports_k, "no process of the run listens on 127.0.0.1: where is the lighthouse?"
        interrupted.send_signal(signal.SIGINT)              # interrupting the cell
        os.kill(killed.pid, signal.SIGKILL)                  # restarting the kernel
        out, _ = interrupted.communicate(timeout=60)
        killed.wait(timeout=30)
        left = gone(tree_i + tree_k, within=20)
        assert not left, "left running: " + ", ".join(f"{p.pid} {' '.join(p.cmdline())[:100]}" for p in left)
        assert not listening(ports_i | ports_k), f"still listening: {listening(ports_i | ports_k)}"
        text = out.decode(errors="replace")
        assert "KeyboardInterrupt" in text and "no process left" in text, text[-2000:]
    finally:
        for parent in (interrupted, killed):
            if parent.poll() is None:
                os.killpg(parent.pid, signal.SIGKILL)
