"""The course's foundation: backend choice, the launcher, run.sh, and committed notebooks.

Real processes throughout (torchrun, gloo); launches are few because each costs seconds.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from helpers.dist import choose_backend, distributed, new_group, timeout_seconds
from helpers.launch import REPO_ROOT, LaunchError, launch
from labs.lab00_orientation import expected_sum

RUN_SH = REPO_ROOT / "run.sh"
SCRIPTS = Path(__file__).parent / "scripts"


def processes_running(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def assert_all_gone(pids, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"}
        time.sleep(0.2)
    assert not alive, f"processes left behind: {alive}"


# ---- backend and device choice (a pure function: the launcher tests below run it for real) ----

@pytest.mark.parametrize(
    "gpus, local_world, backend",
    [(0, 1, "gloo"), (0, 2, "gloo"), (0, 4, "gloo"),
     (1, 1, "nccl"), (1, 2, "gloo"), (1, 4, "gloo"),
     (2, 1, "nccl"), (2, 2, "nccl"), (2, 4, "gloo"),
     (4, 2, "nccl"), (4, 4, "nccl"), (4, 8, "gloo")],
)
def test_backend_choice(gpus, local_world, backend):
    choice = choose_backend(gpus, local_world)
    assert choice.backend == backend
    assert choice.device_type == ("cuda" if backend == "nccl" else "cpu")
    assert choice.reason


def test_backend_choice_forced_cpu_and_bad_sizes():
    assert choose_backend(4, 2, force_cpu=True).backend == "gloo"
    with pytest.raises(ValueError):
        choose_backend(2, 0)
    with pytest.raises(ValueError):
        choose_backend(-1, 2)


def test_dist_timeout_is_read_and_validated(monkeypatch):
    monkeypatch.setenv("DIST_TIMEOUT", "7")
    assert timeout_seconds() == 7
    monkeypatch.delenv("DIST_TIMEOUT")
    assert timeout_seconds() == 60
    monkeypatch.setenv("DIST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DIST_TIMEOUT"):
        timeout_seconds()


def test_single_process_without_torchrun(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with distributed() as ctx:
        assert (ctx.rank, ctx.world_size) == (0, 1)
        x = torch.tensor([2.0])
        dist.all_reduce(x)
        assert x.item() == 2.0
    assert not dist.is_initialized()


def test_every_group_gets_dist_timeout_and_a_name(monkeypatch):
    """Groups made without a timeout (a bare `dist.new_group`, those torch makes inside a
    DeviceMesh or FSDP) get DIST_TIMEOUT, not torch's 30 minutes, while the process group is up;
    torch's default comes back after; `new_group` needs a name."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DIST_TIMEOUT", "7")
    c10d = dist.distributed_c10d
    before = c10d.default_pg_timeout
    with distributed():
        bare, named = dist.new_group([0]), new_group([0], name="checksums")
        for group in (bare, named):
            dist.all_reduce(torch.ones(1), group=group)
        seen = {entry["process_group"][1]: entry["timeout_ms"] for entry in
                pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, False, False))["entries"]}
        assert seen[named.group_desc] == seen[bare.group_desc] == 7000, seen
        assert named.group_desc == "checksums"
        with pytest.raises(ValueError, match="name"):
            new_group([0], name="")
    assert c10d.default_pg_timeout == before


# ---- the launcher -----------------------------------------------------------------------------

def test_two_launches_at_once_both_succeed():
    results, errors = [], []

    def one():
        try:
            results.append(launch("labs/lab00_orientation.py", nproc=2, timeout=120, stream=False,
                                  fork_ranks=True))  # the ports are the point, not how ranks start
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 2
    for res in results:
        assert sorted(res.results) == [0, 1]
        for rank, report in res.results.items():
            assert report["all_reduce"] == expected_sum(2)
            assert report["backend"] == choose_backend(torch.cuda.device_count(), 2).backend
        assert "[rank1]:" in res.output and "[rank0]:" in res.output


def test_crashed_rank_ends_run_fast_with_its_message():
    """The run ends within seconds of the crash (measured from the crash: starting the ranks takes
    as long as a busy machine makes it), not after DIST_TIMEOUT."""
    with pytest.raises(LaunchError) as info:
        launch(SCRIPTS / "fail_rank.py", nproc=2, timeout=120, stream=False,
               env={"DIST_TIMEOUT": "120"})
    elapsed = time.time() - info.value.result.results[1]["raised_at"]
    message = str(info.value)
    assert elapsed < 60, f"the run ended {elapsed:.1f} s after rank 1 raised (DIST_TIMEOUT is 120 s)"
    assert "rank 1 raised ValueError: rank one is broken on purpose" in message
    assert info.value.result.returncode != 0


def test_a_ranks_error_is_located_in_the_labs():
    """A rank's error names the innermost frame in labs/ (the student's files) with its code, and
    the tests' RankFailure lists its last frames there: from the exception raised, else from the
    one it was handling; never for a stub (its message names its file) or outside labs/."""
    from helpers.notice import Unsolved
    from helpers.launch.torchrun import _first_error, lab_frames
    from tests.harness import RankFailure, _as_error

    lab = REPO_ROOT / "labs" / "lab04_ring.py"
    text = f"""Traceback (most recent call last):
  File "{lab}", line 10, in helper
    x = parts[3]
        ~~~~~^^^
KeyError: 3

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "{REPO_ROOT}/tests/public/test_lab04_collectives.py", line 60, in <module>
    ring_all_reduce(x)
  File "labs/lab04_ring.py", line 160, in ring_all_reduce
    step(chunks, recv)
  File "{lab}", line 171, in step
    chunks[recv].add_(incoming)
    ~~~~~~^^^^^^
  File "<string>", line 3, in f
  File "/usr/lib/python3/site-packages/torch/x.py", line 5, in add_
    return 1
IndexError: tuple index out of range
"""
    rank, summary, frames = _first_error([(1.0, 2, text)], "")
    assert rank == 2 and summary == ("IndexError: tuple index out of range at "
                                     "labs/lab04_ring.py:171 `chunks[recv].add_(incoming)`"), summary
    assert frames == ["labs/lab04_ring.py:160 in ring_all_reduce: `step(chunks, recv)`",
                      "labs/lab04_ring.py:171 in step: `chunks[recv].add_(incoming)`"], frames
    handled = text.split("During handling")[0] + "Traceback (most recent call last):\n" \
        f'  File "{REPO_ROOT}/tests/x.py", line 1, in <module>\nValueError: wrapped\n'
    assert lab_frames(handled) == ["labs/lab04_ring.py:10 in helper: `x = parts[3]`"]
    assert _first_error([(1.0, 0, text.replace("labs/", "tests/"))], "")[1:] == \
        ("IndexError: tuple index out of range", []), "nothing outside labs/ is located"
    stub = text.replace("IndexError: tuple index out of range",
                        "NotImplementedError: Exercise ring_all_reduce (notebook 04): ...")
    assert _first_error([(1.0, 0, stub)], "")[1] == stub.splitlines()[-1]
    error = LaunchError("launch failed", None, 2, summary, frames)
    failure = _as_error(f"rank 2 raised {summary}", error)
    assert isinstance(failure, RankFailure) and str(failure).splitlines() == [
        f"rank 2 raised {summary} (launch of ?)", "rank 2's traceback in the labs (innermost last):",
        f"  {frames[0]}", f"  {frames[1]}"], str(failure)
    assert isinstance(_as_error(f"rank 0 raised {stub.splitlines()[-1]}", error), Unsolved)


@pytest.mark.parametrize("where, nproc, rank, named", [
    ("subgroup", 2, 0, "group 'checksums' (ranks [0, 1])"),
    ("mesh", 4, 2, "the mesh's 'tp' dimension (ranks [2, 3])"),
], ids=["sub-group", "mesh dimension"])
def test_rank_that_never_joins_times_out_naming_the_group_and_leaves_nothing(where, nproc, rank, named):
    """The last rank never joins a collective of a group made by helpers.dist (a sub-group; a
    mesh's tp dimension): its partner fails after DIST_TIMEOUT, not torch's 30 minutes, and the
    launcher's message names that rank, the collective and the group."""
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(SCRIPTS / "hang_rank.py", "--in", where, nproc=nproc, timeout=120, stream=False,
               env={"DIST_TIMEOUT": "4"})
    elapsed = time.monotonic() - start
    result = info.value.result
    assert 4 <= elapsed < 60, f"took {elapsed:.1f} s"
    assert info.value.rank == rank, str(info.value)
    assert f"rank {rank} raised RuntimeError: rank {rank} waited 4 s in all_reduce #2 of {named}" \
        in str(info.value), str(info.value)
    pids = [r["pid"] for r in result.results.values()]
    assert len(pids) == nproc
    assert_all_gone(pids)


@pytest.mark.parametrize("fork_ranks", [False, True], ids=["fresh ranks", "warm launcher"])
def test_launcher_timeout_kills_every_rank(tmp_path, fork_ranks):
    """The launcher's own timeout ends every rank. On a loaded machine the ranks may not exist yet
    when a short timeout fires, which would check nothing: then try again with a longer one."""
    for timeout in (8, 30, 90):
        pid_dir = tmp_path / f"pids{timeout}"
        pid_dir.mkdir()
        with pytest.raises(LaunchError, match=f"timed out after {timeout} s"):
            launch(SCRIPTS / "hang_rank.py", "--all", nproc=2, timeout=timeout, stream=False,
                   env={"HANG_PID_DIR": str(pid_dir)}, fork_ranks=fork_ranks)
        pids = [int(p.read_text()) for p in pid_dir.glob("*.pid")]
        if len(pids) == 2:
            break
    assert len(pids) == 2, "the ranks never started, even with a 90 s timeout"
    assert_all_gone(pids)


def _start_launching_process(tmp_path: Path, fork_ranks: bool = False) -> tuple[subprocess.Popen, list[int]]:
    """A python process that launches 2 sleeping ranks (like a notebook kernel running a launch
    cell); returns it once both ranks are running, with the ranks' pids."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    # Like a Jupyter kernel, the process turns SIGINT into KeyboardInterrupt even when it was
    # started with SIGINT ignored (a shell's background job, e.g. `./run.sh test &`, is).
    code = ("import faulthandler, signal\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"  # a stuck launcher: _stuck
            "from helpers.launch import launch\n"
            "launch('tests/scripts/hang_rank.py', '--all', nproc=2, timeout=300, stream=False,\n"
            f"       env={{'HANG_PID_DIR': {str(pid_dir)!r}}}, fork_ranks={fork_ranks})\n")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)
    deadline = time.monotonic() + 120
    pids: list[int] = []
    while time.monotonic() < deadline and len(pids) < 2 and parent.poll() is None:
        pids = [int(p.read_text()) for p in pid_dir.glob("*.pid")]
        time.sleep(0.2)
    if len(pids) < 2:
        os.killpg(parent.pid, signal.SIGKILL)
        pytest.fail(f"the ranks never started: {parent.communicate()[0].decode(errors='replace')[-2000:]}")
    return parent, pids


def _stuck(parent: subprocess.Popen) -> str:
    """Every thread's stack of a launching process that does not end, and its process tree."""
    tree = "\n".join(f"  {p.pid} {p.status()} {' '.join(p.cmdline())[:120]}"
                     for p in psutil.Process(parent.pid).children(recursive=True))
    parent.send_signal(signal.SIGUSR1)
    time.sleep(2)
    os.killpg(parent.pid, signal.SIGKILL)
    out, _ = parent.communicate()
    return out.decode(errors="replace")[-6000:] + "\nits processes:\n" + tree


@pytest.mark.parametrize("fork_ranks", [False, True], ids=["fresh ranks", "forked ranks"])
def test_interrupted_launch_leaves_no_process_and_says_so_in_one_line(tmp_path, fork_ranks):
    """Ctrl-C / interrupting a notebook cell: KeyboardInterrupt in the launching process. Ranks
    forked from torchrun (the tests' launches) are found and killed the same way."""
    parent, pids = _start_launching_process(tmp_path, fork_ranks)
    try:
        parent.send_signal(signal.SIGINT)
        try:
            out, _ = parent.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the interrupted launch did not end within 60 s; where it was:\n" + _stuck(parent))
        text = out.decode(errors="replace")
        assert parent.returncode != 0
        assert "stopped: 2 rank(s) killed, no process left" in text, text
        assert "KeyboardInterrupt" in text
        assert "queue.py" not in text and "threading.py" not in text, \
            f"the interrupt should not show the launcher's internals:\n{text}"
        assert_all_gone(pids + [parent.pid])
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)


@pytest.mark.parametrize("fork_ranks", [False, True], ids=["fresh ranks", "warm launcher"])
def test_killed_launching_process_takes_its_ranks_along(tmp_path, fork_ranks):
    """Restarting a busy Jupyter kernel SIGKILLs it: no cleanup code of it runs, yet no rank may
    outlive it (the guard in helpers.launch.procs notices its parent died; with forked ranks, the warm
    launcher (helpers.launch.warm) and each guard it forked notice that the launching process died)."""
    parent, pids = _start_launching_process(tmp_path, fork_ranks)
    tree = [p.pid for p in psutil.Process(parent.pid).children(recursive=True)]
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert_all_gone(pids + tree, within=15)


def test_an_exception_after_the_distributed_block_fails_the_launch():
    """Only SIGABRT at interpreter exit after every rank finished is forgiven (gloo's teardown
    crash); an exception raised after the block is a real failure, with its rank and message."""
    with pytest.raises(LaunchError) as info:
        launch(SCRIPTS / "raise_after.py", nproc=2, timeout=120, stream=False)
    assert "fails after its work on purpose" in str(info.value)
    assert info.value.rank in (0, 1)


# ---- run.sh -----------------------------------------------------------------------------------

def run_sh(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUN_SH), *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          env=dict(os.environ, COURSE_PYTHON=sys.executable, **(env or {})),
                          timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_localhost_match_one_node():
    port = str(free_port())
    common = dict(NNODES="2", NPROC="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                  COURSE_FORK_RANKS="1")  # forked ranks: a torch import less per node
    nodes = [subprocess.Popen([str(RUN_SH), "00"], cwd=REPO_ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=dict(os.environ, COURSE_PYTHON=sys.executable, NODE_RANK=str(i),
                                       **common)) for i in range(2)]
    outputs = [n.communicate(timeout=120)[0] for n in nodes]
    for node, out in zip(nodes, outputs):
        assert node.returncode == 0, out
        # one node with two ranks computes expected_sum(2) (test_two_launches_at_once)
        assert f"all_reduce(rank + 1) = {expected_sum(2):g}" in out, out
        assert "| ok" in out  # the summary table
    assert "rank 0/2" in outputs[0] and "rank 1/2" in outputs[1]
    # lines carry the global rank: node 1's only rank is rank 1 (its local rank is 0)
    assert "[rank1]:rank 1/2" in outputs[1] and "[rank0]:" not in outputs[1], outputs[1]


@pytest.mark.parametrize(
    "args, env, expected",
    [(["99"], {}, "there is no lab 99"),
     (["labs/no_such_lab.py"], {}, "no such script: labs/no_such_lab.py"),
     (["00"], {"NPROC": "0"}, "NPROC must be a positive whole number"),
     (["00"], {"NPROC": "two"}, "NPROC must be a positive whole number"),
     (["frobnicate"], {}, "unknown command 'frobnicate'")],
)
def test_run_sh_bad_input_is_one_clear_line(args, env, expected):
    start = time.monotonic()
    proc = run_sh(*args, env=env, timeout=30)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert time.monotonic() - start < 5, "bad input must be refused before anything starts"


def test_run_sh_without_python_says_so(tmp_path):
    shutil.copy(RUN_SH, tmp_path / "run.sh")
    shutil.copy(REPO_ROOT / "requirements.txt", tmp_path / "requirements.txt")
    (tmp_path / "labs").mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "cat", "cksum", "ls", "sed", "sort", "tr"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    proc = subprocess.run([str(bin_dir / "bash"), str(tmp_path / "run.sh"), "check"],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode != 0
    assert "Python 3.10 or newer is needed" in proc.stderr, proc.stderr


BASH = shutil.which("bash")
FAKE_PYTHON = f"""#!{BASH}
echo "$*" >> "$FAKE_LOG.python"
if [[ "$1" == -c && -n "$FAKE_NO_SANDBOX" ]]; then
  echo "Traceback (most recent call last):"; echo "bubblewrap could not make a working sandbox here: $FAKE_NO_SANDBOX"; exit 1
fi
exit 0
"""
FAKE_APT = f"""#!{BASH}
echo "$*" >> "$FAKE_LOG.apt"
echo "Reading package lists... APT-NOISE"
[[ -n "$FAKE_APT_FAILS" ]] && {{ echo "E: Unable to locate package bubblewrap"; exit 100; }}
if [[ "$1" == install ]]; then printf '#!{BASH}\\nexit 0\\n' > "$FAKE_BIN/bwrap"; chmod +x "$FAKE_BIN/bwrap"; fi
exit 0
"""


@pytest.mark.parametrize("case", ["installs", "present", "not-root", "no-package-manager",
                                  "install-fails", "no-sandbox", "student-edition"])
def test_run_sh_test_sets_up_bubblewrap_or_stops_in_one_line(tmp_path, case):
    """`./run.sh test` does its own set-up, as `./run.sh` does for the venv: the grading tests
    need bubblewrap, which it installs quietly (one line) where it can, as root with apt-get, and
    never when bwrap is there; where it cannot, or where bwrap makes no sandbox, it stops before
    any test with one line saying what to run. Tools are fakes on a PATH that hides the real ones."""
    root = tmp_path / "course"
    (root / "labs").mkdir(parents=True)
    (root / "tests").mkdir()
    shutil.copy(RUN_SH, root / "run.sh")
    shutil.copy(REPO_ROOT / "requirements.txt", root / "requirements.txt")
    if case != "student-edition":  # the student edition ships no grading tests
        (root / "tests" / "test_homework_grading.py").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "cat", "cksum", "mktemp", "tail", "rm", "chmod"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    uid = "1000" if case in ("not-root", "student-edition") else "0"
    (bin_dir / "id").write_text(f"#!{BASH}\necho {uid}\n")
    if case != "no-package-manager":
        (bin_dir / "apt-get").write_text(FAKE_APT)
    if case in ("present", "no-sandbox"):
        (bin_dir / "bwrap").write_text(f"#!{BASH}\nexit 0\n")
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    for path in [python, *bin_dir.iterdir()]:
        path.chmod(0o755)
    log = tmp_path / "log"
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "COURSE_PYTHON": str(python),
           "FAKE_LOG": str(log), "FAKE_BIN": str(bin_dir),
           "FAKE_APT_FAILS": "1" if case == "install-fails" else "",
           "FAKE_NO_SANDBOX": "setting up uid map: Permission denied" if case == "no-sandbox" else ""}
    proc = subprocess.run([BASH, str(root / "run.sh"), "test"], cwd=root, capture_output=True,
                          text=True, env=env, timeout=60)
    said = (proc.stdout + proc.stderr).strip().splitlines()
    apt_calls = Path(f"{log}.apt").read_text().splitlines() if Path(f"{log}.apt").exists() else []
    python_calls = Path(f"{log}.python").read_text() if Path(f"{log}.python").exists() else ""
    ran_tests = "-m pytest" in python_calls
    if case in ("installs", "present", "student-edition"):
        assert proc.returncode == 0 and ran_tests, (proc.returncode, said, python_calls)
    else:
        assert proc.returncode == 2 and not ran_tests, f"the tests must not start: {said}"
        assert said and said[-1].startswith("run.sh: "), said
    if case == "installs":
        assert said == ["run.sh: installing bubblewrap with apt-get (the grading tests sandbox "
                        "submissions with it)"], f"one line, and apt-get's own output hidden: {said}"
        assert apt_calls == ["install -y -q bubblewrap"], apt_calls
    elif case in ("present", "student-edition"):
        assert said == [] and apt_calls == [], (said, apt_calls)
    elif case in ("not-root", "no-package-manager"):
        assert len(said) == 1 and apt_calls == [], said
        assert "sudo apt-get install bubblewrap" in said[0] and "./run.sh test again" in said[0], said
    elif case == "install-fails":
        assert apt_calls == ["install -y -q bubblewrap", "update -q"], apt_calls
        assert "installing bubblewrap with apt-get failed" in said[-1], said
        assert "E: Unable to locate package bubblewrap" in said, "apt-get's reason is shown"
    elif case == "no-sandbox":
        assert len(said) == 1 and apt_calls == [], said
        assert "cannot make a sandbox on this machine: bubblewrap could not make a working " \
               "sandbox here: setting up uid map: Permission denied" in said[0], said


def test_a_labs_bad_flag_is_refused_before_any_rank_starts(capsys, monkeypatch):
    """./run.sh labs/lab03_ddp.py --depth x: one line naming the lab and the flag, exit 2, and no
    launch (the flags are the lab's run description's, checked in the launching process)."""
    from helpers.launch import cli

    monkeypatch.setattr(cli, "launch", lambda *a, **k: pytest.fail("a launch started"))
    assert cli.main(["script", "labs/lab03_ddp.py", "--depth", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["run.sh: lab03_ddp.py: argument --depth: invalid int value: 'x' (--help lists its flags)"], err


def test_run_sh_help_lists_commands():
    proc = run_sh("--help", timeout=30)
    assert proc.returncode == 0
    for word in ("test", "check", "submit", "jupyter", "NPROC", "NNODES"):
        assert word in proc.stdout


# ---- repository hygiene -----------------------------------------------------------------------

def committed_notebooks() -> dict[str, dict]:
    """The notebooks as committed (the git index), or as on disk outside a git checkout."""
    listed = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files", "-z", "notebooks/*.ipynb"],
                            capture_output=True, timeout=60)
    if listed.returncode != 0:  # not a git checkout (a student edition copied as files)
        return {p.name: json.loads(p.read_text()) for p in sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))}
    found = {}
    for rel in filter(None, listed.stdout.decode().split("\0")):
        blob = subprocess.run(["git", "-C", str(REPO_ROOT), "show", f":{rel}"], capture_output=True,
                              timeout=60, check=True).stdout
        found[Path(rel).name] = json.loads(blob)
    return found


def test_committed_notebooks_carry_no_outputs():
    """What is committed carries no outputs; the working files may (JupyterLab saves them, and the
    nbstripout filter that run.sh installs strips them on commit)."""
    notebooks = committed_notebooks()
    assert notebooks, "no notebooks found"
    for name, nb in notebooks.items():
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert not cell.get("outputs"), f"{name} has outputs"
                assert cell.get("execution_count") is None, f"{name} has execution counts"


def test_every_lab_documents_how_to_run_it():
    """A lab's docstring says how to run it; a file without a __main__ block (./run.sh NN does
    not launch it) says it is a library of its lab, and ./run.sh NN leaves it out."""
    from helpers.launch.cli import discover_labs

    launched = set(discover_labs())
    for lab in sorted((REPO_ROOT / "labs").glob("lab[0-9][0-9]_*.py")):
        text = lab.read_text()
        doc = text.split('"""')[1]
        if "__main__" in text:
            assert "./run.sh" in doc, f"{lab.name}: its docstring should say how to run it"
            assert lab in launched, f"./run.sh {lab.name[3:5]} does not launch {lab.name}"
        else:
            assert "library" in doc, (f"{lab.name} has no __main__ block, so ./run.sh {lab.name[3:5]} "
                                      "does not launch it: its docstring should say it is a library of its lab")
            assert lab not in launched, f"./run.sh {lab.name[3:5]} would launch {lab.name}, which has no main"


def test_readme_is_a_students_page_with_the_settings_table_from_config():
    """The README lists every setting exactly as helpers/config.py's table has them (the one
    place that reads them), and stays a page a student reads in minutes."""
    from helpers.config import markdown

    readme = (REPO_ROOT / "README.md").read_text()
    assert markdown() in readme, ("README.md's settings table differs from helpers/config.py's: "
                                  "paste the output of `python -m helpers.config markdown`")
    assert len(readme.encode()) <= 14_000, f"README.md is {len(readme.encode())} bytes; keep it a student's page"
    for name in sorted(p.stem for p in (REPO_ROOT / "notebooks").glob("*.ipynb")):
        assert f"`{name}`" in readme, f"README.md's table of notebooks has no row for {name}"


# The course's own names for settings (helpers/config.py); torch's and torchrun's (TORCH_*,
# TORCHELASTIC_*, OMP_NUM_THREADS, GLOO_SOCKET_IFNAME, RANK...) are theirs and not checked here.
SETTING_NAME = re.compile(r"\b(?:(?:COURSE|DIST|LAB|LAB10|TEST)_[A-Z0-9_]*[A-Z0-9]|NPROC|NNODES|NODE_RANK"
                          r"|MASTER_ADDR|MASTER_PORT)\b")
NOT_SETTINGS = {"LAB_NPROC"}  # a lab's module constant (still read from labs not yet converted)


def settings_named(text: str) -> set[str]:
    """The course's settings a guide names: environment variables in the course's namespaces."""
    return set(SETTING_NAME.findall(text)) - NOT_SETTINGS


def test_every_setting_the_guides_name_exists():
    """docs/ and the README name only settings helpers/config.py reads (a guide once named a
    COURSE_TIMEOUT that never existed)."""
    from helpers.config import SETTINGS

    known = {s.name for s in SETTINGS}
    assert settings_named("a short timeout (`COURSE_TIMEOUT`); NPROC=2 ./run.sh") == {"COURSE_TIMEOUT", "NPROC"}
    for guide in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        unknown = settings_named(guide.read_text()) - known
        assert not unknown, f"{guide.relative_to(REPO_ROOT)} names settings helpers/config.py does not have: {sorted(unknown)}"


# ---- run descriptions (helpers/runs.py) ------------------------------------------------------

def _run_class(**ranks):
    from dataclasses import dataclass

    from helpers import runs

    @dataclass(frozen=True)
    class Run(runs.Run):
        width: int = 64
        widths: tuple[int, ...] = (1, 2)
        lessons: bool = False
        SMOKE = dict(width=8)
        TOUR = dict(width=16, widths=(3,))

    for name, value in ranks.items():
        setattr(Run, name, value)
    return Run


def test_a_run_description_gives_presets_flags_and_the_command_line():
    from helpers import runs

    Run = _run_class()
    assert (Run.preset("full").width, Run.preset("smoke").width, Run.preset("tour").width) == (64, 8, 16)
    assert Run.preset("smoke", width=4).width == 4
    cfg = Run.from_argv(["--preset", "tour", "--width", "5", "--lessons"])
    assert (cfg.width, cfg.widths, cfg.lessons) == (5, (3,), True)
    assert Run.from_argv(cfg.argv()) == cfg and cfg.values() == {"width": 5, "widths": (3,), "lessons": True}
    with pytest.raises(runs.RunError, match="argument --width: invalid int value"):
        Run.from_argv(["--width", "wide"])
    with pytest.raises(runs.RunError, match="no field"):
        Run.preset("smoke", depth=3)
    with pytest.raises(runs.RunError, match="no preset 'huge'"):
        Run.preset("huge")


def test_ranks_come_from_the_run_description_and_nproc_wins_where_any_count_works():
    from helpers.runs import RunError, ranks_for

    Run = _run_class()
    assert ranks_for(Run.preset(), default=2, nproc_set=None) == 2          # ranks None: the default
    assert ranks_for(Run.preset(ranks=4), default=2, nproc_set=None) == 4
    assert ranks_for(Run.preset(ranks=4), default=2, nproc_set=3) == 3      # NPROC wins
    exact = _run_class(EXACT_RANKS=True)
    assert ranks_for(exact.preset(ranks=4), default=2, nproc_set=4) == 4
    with pytest.raises(RunError, match="runs on exactly 4 ranks; NPROC=2"):
        ranks_for(exact.preset(ranks=4), default=2, nproc_set=2)
    with pytest.raises(RunError, match="needs at least 3 ranks"):
        ranks_for(_run_class(MIN_RANKS=3).preset(), default=2, nproc_set=None)


def test_every_labs_run_description_builds_its_presets_and_parses_its_own_command_line():
    """Each lab's Run: every preset names only its fields, and its command line gives it back."""
    import importlib

    from helpers import runs

    described = [p for p in sorted((REPO_ROOT / "labs").glob("lab[0-9][0-9]_*.py"))
                 if re.search(r"^class Run\(", p.read_text(), re.M)]
    assert len(described) >= 30, "the labs of notebooks 00-10 have run descriptions"
    for path in described:
        Run = runs.description(importlib.import_module(f"labs.{path.stem}"))
        assert Run is not None, f"{path.name}: its Run is not a helpers.runs.Run"
        for name in runs.PRESETS:
            cfg = Run.preset(name)
            assert Run.from_argv(cfg.argv()) == cfg, (path.name, name)


def test_abort_at_exit_after_finishing_is_reported_not_fatal(capsys):
    res = launch(SCRIPTS / "abort_rank.py", "after", nproc=2, timeout=120, stream=False)
    assert res.returncode != 0 and sorted(res.results) == [0, 1]
    assert "aborted while exiting, after every rank had finished" in capsys.readouterr().err


def test_abort_during_the_work_fails_the_launch():
    with pytest.raises(LaunchError, match="failed with exit code"):
        launch(SCRIPTS / "abort_rank.py", "inside", nproc=2, timeout=120, stream=False)


# ---- JupyterLab and notebooks in a student's checkout -------------------------------------------

# JupyterLab itself (started as root, saving widget state, saves that change nothing for git,
# interrupts, tables, widgets without a kernel) and ./run.sh update against an upstream
# repository (what it keeps, sets aside and says): tests/test_jupyterlab.py.


def test_the_launch_package_imports_nothing_until_used():
    """`python -m helpers.launch.procs` and `.warm` run on every launch; if importing the package
    imported them first, runpy would print a RuntimeWarning to the student each time."""
    code = ("import sys, helpers.launch; "
            "print(sorted(m for m in sys.modules if m.startswith('helpers.launch.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"importing helpers.launch imported {out.stdout.strip()}"
