#!/usr/bin/env bash
# The course's one entry point. `./run.sh --help` lists what it does.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export COURSE_CALLER_CWD="$PWD"  # paths given to check/submit/release/grade are relative to it
cd "$ROOT"

usage() {
  cat <<'EOF'
usage: ./run.sh [COMMAND] [ARGS...]

  (nothing)            set up what is missing, then every lab in order at the tour's small sizes
  NN                   run lab NN (every labs/labNN_*.py) at full size, e.g. ./run.sh 03
  path/to/script.py    run a lab or your own script under torchrun with the course defaults
                       (a lab's sizes are flags: ./run.sh labs/lab03_ddp.py --help)
  test                 run every test and execute every notebook (smoke sizes), as CI does
  check [NN]           run the public checks of your exercises (all labs, or lab NN)
  submit               run the checks and pack your work into an archive to hand in
  jupyter              start JupyterLab in this repository
  update               get the course's latest version, keeping a copy of each notebook it replaces
  release DIR          (instructors) write the student edition into DIR
  grade ARCHIVE... --out DIR   (instructors) grade submissions
  -h, --help           this text

Settings (environment variables; helpers/config.py reads them):
EOF
  local base
  if base="$(find_base_python)"; then
    "$base" -m helpers.config text
  else
    echo "  (a Python 3.10 or newer shows them here; the README lists them too)"
  fi
}

die() { echo "run.sh: $*" >&2; exit 2; }

# A Python 3.10 or newer on PATH (COURSE_PYTHON if set): it checks the settings before anything
# starts, and makes .venv on the first run.
find_base_python() {
  if [[ -n "${COURSE_PYTHON:-}" ]]; then echo "$COURSE_PYTHON"; return 0; fi
  local candidate
  for candidate in python3 python3.13 python3.12 python3.11 python3.10 python; do
    if command -v "$candidate" >/dev/null 2>&1 && \
       "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  return 1
}

# ---- check the input before anything starts ---------------------------------------------------
cmd="${1:-labs}"
case "$cmd" in
  -h|--help|help) usage; exit 0 ;;
esac
BASE_PY="$(find_base_python)" || die "Python 3.10 or newer is needed and none was found on PATH: install it (python.org or your package manager), then run ./run.sh again"
"$BASE_PY" -m helpers.config check || exit 2  # one line naming the setting, e.g. NPROC=two
case "$cmd" in
  labs|test|check|submit|jupyter|update|release|grade) ;;
  [0-9]|[0-9][0-9])
    nn=$(printf '%02d' "$((10#$cmd))")
    compgen -G "labs/lab${nn}_*.py" >/dev/null || \
      die "there is no lab ${nn}; the labs are: $(ls labs | sed -n 's/^lab\([0-9][0-9]\)_.*\.py$/\1/p' | sort -u | tr '\n' ' ')"
    ;;
  *.py)
    [[ -f "$cmd" ]] || die "no such script: $cmd (give a path to a .py file, e.g. labs/lab00_orientation.py)" ;;
  *) die "unknown command '$cmd' (see ./run.sh --help)" ;;
esac

# ---- find or make the Python environment -------------------------------------------------------
has_requirements() {  # does this Python have what requirements.txt asks for?
  "$1" - <<'PY' 2>/dev/null
import importlib.metadata as md, re, sys
if sys.version_info < (3, 10):
    sys.exit(1)
for line in open("requirements.txt"):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name = re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0]
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        sys.exit(1)
    if name == "torch":  # any recent torch (a CUDA build on a GPU machine is fine); 2.13 is pinned for .venv
        major, minor = (int(x) for x in re.findall(r"\d+", version)[:2])
        if (major, minor) < (2, 6):
            sys.exit(1)
PY
}

find_python() {
  if [[ -n "${COURSE_PYTHON:-}" ]]; then PY="$COURSE_PYTHON"; return; fi
  if [[ -n "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ]] && command -v python >/dev/null \
     && has_requirements python; then
    PY="$(command -v python)"; return
  fi
  local stamp=".venv/.requirements.sha"
  local want
  want="$(cksum < requirements.txt)"
  if [[ -x .venv/bin/python && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    PY="$ROOT/.venv/bin/python"; return
  fi
  if [[ ! -x .venv/bin/python ]]; then
    echo "run.sh: creating .venv with $("$BASE_PY" --version 2>&1) (first run only)"
    "$BASE_PY" -m venv .venv || die "could not create .venv (on Debian/Ubuntu: apt install python3-venv)"
  fi
  echo "run.sh: installing requirements.txt into .venv (torch is the CPU build: a few minutes)"
  # pip would byte-compile the ~11,000 installed modules one at a time (half of the install's
  # time); compileall does it on every core, and leaves out the packages' own test suites (a fifth
  # of the code; imported, a module there still compiles). Modules that do not compile, such as
  # templates, are skipped, as pip skips them.
  .venv/bin/python -m pip install --disable-pip-version-check -q --no-compile -r requirements.txt 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
  .venv/bin/python -m compileall -q -j 0 -x '/tests?/' .venv/lib >/dev/null 2>&1 || true
  has_requirements .venv/bin/python || die "installing requirements.txt into .venv failed (see pip's messages above)"
  echo "$want" > "$stamp"
  PY="$ROOT/.venv/bin/python"
}

# Opening, running and saving a notebook changes nothing git sees: JupyterLab saves outputs, widget
# state and the kernel's metadata (its display name, the Python version) into the working files,
# and git's filter (configured here, in this checkout only; .gitattributes names it) strips the
# outputs and widget state (nbstripout) and puts the metadata back as committed
# (helpers/notebook_filter.py). Checkouts with an older filter get this one on the next run.
install_notebook_filter() {
  git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1 || return 0
  local filter="\"$PY\" -m helpers.notebook_filter"  # 0.5 s a notebook
  [[ "$(git -C "$ROOT" config --get filter.nbstripout.clean 2>/dev/null)" == "$filter" && \
     "$(git -C "$ROOT" config --get diff.ipynb.textconv 2>/dev/null)" == "$filter" ]] && return 0
  # (found, not imported: importing nbstripout takes seconds)
  "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("nbstripout") is None)' \
    2>/dev/null || return 0
  git -C "$ROOT" config filter.nbstripout.clean "$filter"
  git -C "$ROOT" config filter.nbstripout.smudge cat
  git -C "$ROOT" config diff.ipynb.textconv "$filter"
  echo "run.sh: installed the nbstripout git filter: notebook outputs, and the metadata JupyterLab rewrites, never show as changes"
}

# Grading sandboxes each submission with bubblewrap, one OS package, and so do the grading tests
# (instructor edition: tests/test_homework_grading.py): `./run.sh grade` (unless --unsafe) and
# `./run.sh test` install it where they can (as root, with apt-get or dnf), quietly but for one
# line, and otherwise stop before anything runs with the command to run. One rule for both.
GRADING_TESTS="tests/test_homework_grading.py"
INSTALL_BWRAP="sudo apt-get install bubblewrap (Debian, Ubuntu) or sudo dnf install bubblewrap (Fedora)"
ensure_bubblewrap() {
  local who why
  if [[ "$cmd" == test ]]; then
    [[ -f "$GRADING_TESTS" ]] || return 0  # the student edition has no grading tests
    who="the grading tests need bubblewrap (bwrap)"; why="the grading tests sandbox submissions with it"
  else
    who="grading needs bubblewrap (bwrap) to sandbox each submission (or --unsafe, on a throwaway machine only)"
    why="grading sandboxes each submission with it"
  fi
  command -v bwrap >/dev/null 2>&1 && return 0
  local manager="" log
  if [[ "$(id -u)" == "0" ]]; then
    if command -v apt-get >/dev/null 2>&1; then manager=apt-get
    elif command -v dnf >/dev/null 2>&1; then manager=dnf
    fi
  fi
  if [[ -z "$manager" && "$(id -u)" != "0" ]]; then
    die "$who, which is missing; installing it needs root: run $INSTALL_BWRAP, then ./run.sh $cmd again"
  elif [[ -z "$manager" ]]; then
    die "$who, which is missing, and neither apt-get nor dnf is here to install it: install the OS package bubblewrap (e.g. $INSTALL_BWRAP), then ./run.sh $cmd again"
  fi
  echo "run.sh: installing bubblewrap with $manager ($why)"
  log="$(mktemp)"
  if [[ "$manager" == apt-get ]]; then
    # the package lists may be missing or stale (fresh containers): update them if the first try fails
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap \
      || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap; }; } >"$log" 2>&1 || true
  else
    dnf install -y -q bubblewrap >"$log" 2>&1 || true
  fi
  if ! command -v bwrap >/dev/null 2>&1; then
    tail -n 5 "$log" >&2
    rm -f "$log"
    die "installing bubblewrap with $manager failed ($manager's last lines above): run $INSTALL_BWRAP, then ./run.sh $cmd again"
  fi
  rm -f "$log"
}

# bwrap is there, but can it make a sandbox? (Unprivileged user namespaces may be turned off.)
check_sandbox() {
  [[ -f "$GRADING_TESTS" ]] || return 0
  local why
  why="$("$PY" -c 'import sys
from homework.sandbox import SandboxUnavailable, probe
try:
    probe()
except SandboxUnavailable as exc:
    sys.exit(str(exc))' 2>&1)" || die "the grading tests cannot make a sandbox on this machine: ${why##*$'\n'} (run the tests as root, or as a user who may create user namespaces)"
}

if [[ "$cmd" == test ]]; then ensure_bubblewrap; fi
if [[ "$cmd" == grade && " $* " != *" --unsafe "* && " $* " != *" -h "* && " $* " != *" --help "* ]]; then
  ensure_bubblewrap
fi
find_python
install_notebook_filter
export COURSE_PYTHON="$PY"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# ---- dispatch ----------------------------------------------------------------------------------
case "$cmd" in
  labs) exec "$PY" -m helpers.launch.cli labs ;;
  [0-9]|[0-9][0-9]) exec "$PY" -m helpers.launch.cli labs "$cmd" ;;
  *.py) shift; exec "$PY" -m helpers.launch.cli script "$cmd" "$@" ;;
  test)
    shift
    check_sandbox
    export COURSE_SMOKE="${COURSE_SMOKE:-1}"
    export MPLBACKEND=Agg
    status=0
    # Three pytest processes share the cores (a launch spends part of its time starting up and
    # waiting); each test file (and each notebook) stays whole on one of them (tests/conftest.py
    # groups them), so a file's launch runs once. The public exercise tests run through
    # ./run.sh check in the student-journey test instead; the hidden ones run here, on the
    # instructor's solutions (the student edition has none). --no-loadscope-reorder keeps the
    # order tests/conftest.py gives the files (longest first); xdist would put the files with
    # the most tests first, and so the minutes-long single tests last.
    "$PY" -m pytest -p helpers.lean_imports tests notebooks --nbmake --nbmake-timeout=600 \
      -n "$("$PY" -m helpers.config get TEST_WORKERS)" --dist loadgroup --no-loadscope-reorder \
      --ignore=tests/public --durations=30 "$@" || status=$?
    if [[ $status -eq 5 ]]; then echo "run.sh: pytest found no tests" >&2; fi
    exit $status
    ;;
  check|submit|release|grade) shift; exec "$PY" -m homework "$cmd" "$@" ;;
  update)
    # The course's latest version, and nothing you wrote or ran lost: helpers/update.py says how
    # (a notebook the course changed is set aside in runs/notebook-outputs/ before it is updated)
    shift
    exec "$PY" -m helpers.update "$@"
    ;;
  jupyter)
    shift
    extra=()
    if [[ "$(id -u)" == "0" ]]; then
      echo "run.sh: running as root (as in most containers): starting JupyterLab with --allow-root"
      extra+=(--allow-root)
    fi
    # the course's JupyterLab defaults (.jupyter/settings/overrides.json): widget state is saved
    # with the notebook (a reopened notebook shows its widgets while it can); no pop-up asking
    # about Jupyter's news over a first notebook. After each save, git's index is refreshed, so
    # a notebook that was only run and saved does not show as modified (helpers/notebook_filter.py)
    exec "$PY" -m jupyter lab --ServerApp.root_dir="$ROOT" \
      --LabApp.app_settings_dir="$ROOT/.jupyter/settings" \
      --ContentsManager.post_save_hook=helpers.notebook_filter.after_save \
      ${extra[@]+"${extra[@]}"} "$@"
    ;;
esac
