"""What a student sees in JupyterLab: tables, an interrupted launch, widgets with no kernel behind
them, and a notebook that was only opened, run and saved.

One JupyterLab server, started by `./run.sh jupyter` in a scratch git checkout (this checkout's
run.sh, helpers and one committed notebook), and one kernel it started for that notebook serve the
tests that need them. No browser: the tests speak JupyterLab's REST API and the kernel's messaging
protocol as its front end does, and read the front end's own code where a rule lives there (which
class marks a widget whose kernel is gone, which class MathJax skips). What these tests read was
checked against what Chromium shows, by hand.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import psutil
import pytest

from helpers import show
from helpers.launch import REPO_ROOT

NOTEBOOK = "notebooks/00_orientation.ipynb"
TOKEN = "course-test"
ANSI = re.compile(r"\x1b\[[0-9;]*m")

# The column names of notebooks 03 and 09 (issue 25: one jumbled line of pipes in JupyterLab)
PIPE_ROWS = [{"scheme": "ddp", "max |param - 1 process|": 0.0, "max |grad - one process|": 1e-7},
             {"scheme": "a|b", "max |param - 1 process|": 2e-7, "max |grad - one process|": 0.0}]
# ... and every other character Markdown, GFM tables and JupyterLab's LaTeX read as syntax
TRICKY_ROWS = [
    {"scheme": "a|b", "max |param - 1 process|": 1e-7, "cost": "$5 and $6",
     "note": "line 1\nline 2"},
    {"scheme": "*not* _italic_", "max |param - 1 process|": 0.0, "cost": "$",
     "note": r"\(x\) \[y\]"},
    {"scheme": "`code` ~~s~~", "max |param - 1 process|": "&amp; <b>", "cost": "$a$ | $b$",
     "note": r"[link](x) a\|b \begin{x}"},
]


# ---- tables -------------------------------------------------------------------------------------

class _Cells(HTMLParser):
    """The text of every <th>/<td> of rendered HTML, by row (<br> read as a newline)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("th", "td"):
            self._cell = []
        elif tag == "br" and self._cell is not None:
            self._cell.append("\n")

    def handle_endtag(self, tag):
        if tag in ("th", "td") and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _rendered_cells(markdown: str) -> list[list[str]]:
    import mistune  # nbconvert's Markdown parser (GFM tables), installed with JupyterLab

    parser = _Cells()
    parser.feed(mistune.create_markdown(plugins=["table"], escape=False)(markdown))
    return parser.rows


def _expected_cells(rows) -> list[list[str]]:
    columns = list(rows[0])
    return [columns] + [[show._fmt(row[c], ".3g") for c in columns] for row in rows]


@pytest.mark.parametrize("rows", [PIPE_ROWS, TRICKY_ROWS], ids=["pipes", "every special"])
def test_markdown_table_shows_every_cell_as_written(rows):
    """A table whose names or values hold |, $, *, _, <, \\ or a line break renders with its columns
    and its text as written (a | inside a name must not split the row into more columns)."""
    markdown = show.markdown_table(rows)
    cells = _rendered_cells(markdown)
    expected = _expected_cells(rows)
    assert cells, ("the Markdown does not render as a table at all (a line break or an unescaped | "
                   f"in a cell breaks it):\n{markdown}")
    assert [len(r) for r in cells] == [len(r) for r in expected], (
        "a | (or another character) in a cell split or merged the table's columns: rows rendered "
        f"with {[len(r) for r in cells]} cells, expected {[len(r) for r in expected]}\n{markdown}")
    for got, want in zip(cells, expected):
        assert got == want, f"cells render as {got}, not as written: {want}\n{markdown}"


def test_markdown_table_keeps_latex_out():
    """JupyterLab typesets $...$ and \\( \\) as LaTeX: dollars or backslashes in a table's cells
    must not turn into mathematics (in the Markdown source, or in the rendered page)."""
    markdown = show.markdown_table(TRICKY_ROWS, title="cost in $")
    # JupyterLab pairs `$` (and reads `\(`, `\[`, `\begin`) in the Markdown source before the
    # table is parsed: a pair across two cells would swallow the | between them.
    assert "$" not in markdown and "\\" not in markdown, \
        f"the Markdown source holds $ or \\, which JupyterLab reads as LaTeX:\n{markdown}"
    # ... and MathJax typesets the rendered page, except inside the class it ignores
    assert markdown.startswith(f'<div class="{show.NO_MATH_CLASS}">\n\n') and \
        markdown.endswith("\n\n</div>"), f"the table is not inside the no-LaTeX <div>:\n{markdown}"
    from jupyterlab.commands import get_app_dir

    skipped = re.compile(rf"ignoreHtmlClass\s*:\s*[\"']{show.NO_MATH_CLASS}[\"']")
    assert skipped.search(_front_end_code(Path(get_app_dir()) / "static")), \
        f"this JupyterLab's MathJax no longer skips the class {show.NO_MATH_CLASS!r}"


def _front_end_code(folder: Path) -> str:
    """The JavaScript of an installed JupyterLab front end (or extension) folder."""
    code = "".join(p.read_text(errors="replace") for p in sorted(folder.glob("*.js")))
    assert code, f"no JupyterLab front-end code in {folder}"
    return code


# ---- the JupyterLab server and its kernel -------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _git(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    identity = ["-c", "user.email=student@course", "-c", "user.name=student"]
    return subprocess.run(["git", *identity, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def _committed(rel: str) -> str:
    """A file as committed here (the git index), or as on disk outside a git checkout."""
    shown = subprocess.run(["git", "-C", str(REPO_ROOT), "show", f":{rel}"], capture_output=True,
                           text=True, timeout=60)
    return shown.stdout if shown.returncode == 0 else (REPO_ROOT / rel).read_text()


class Lab:
    """A JupyterLab server in a scratch checkout; a client of the kernel it runs for NOTEBOOK."""

    def __init__(self, root: Path, runtime: Path):
        self.root, self.runtime = root, runtime
        self.log = runtime / "jupyterlab.log"
        self.port = _free_port()
        self.server: subprocess.Popen | None = None
        self.kernel_id = ""
        self.session_id = ""
        self.client = None

    def api(self, method: str, path: str, body: dict | None = None, timeout: float = 60) -> dict:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {TOKEN}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            data = reply.read()
        return json.loads(data) if data else {}

    def start(self) -> None:
        env = dict(os.environ, COURSE_PYTHON=sys.executable, JUPYTER_RUNTIME_DIR=str(self.runtime),
                   JUPYTER_CONFIG_DIR=str(self.runtime / "config"), HOME=str(self.runtime))
        with open(self.log, "w") as log:  # the server's output: read it any time
            self.server = subprocess.Popen(
                ["bash", "run.sh", "jupyter", "--no-browser", f"--port={self.port}",
                 f"--IdentityProvider.token={TOKEN}"], cwd=self.root, env=env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180
        while True:
            try:
                self.api("GET", "/api/status", timeout=5)
                break
            except OSError:
                if self.server.poll() is not None or time.monotonic() > deadline:
                    output = self.stop()[-3000:]
                    raise RuntimeError(f"JupyterLab did not start:\n{output}") from None
                time.sleep(0.5)
        # what JupyterLab's front end does when it opens a notebook: a session with its kernel
        kernel = json.loads(_committed(NOTEBOOK))["metadata"]["kernelspec"]["name"]
        session = self.api("POST", "/api/sessions", {"path": NOTEBOOK, "type": "notebook",
                                                      "name": Path(NOTEBOOK).name,
                                                      "kernel": {"name": kernel}}, timeout=120)
        self.session_id, self.kernel_id = session["id"], session["kernel"]["id"]
        from jupyter_client import BlockingKernelClient

        connection = self.runtime / f"kernel-{self.kernel_id}.json"
        self.client = BlockingKernelClient(connection_file=str(connection))
        self.client.load_connection_file()
        self.client.start_channels()
        # wait_for_ready calls the kernel dead if its heartbeat does not answer within a second of
        # the first request: a kernel still importing (a busy machine) is not dead, so ask again
        # until the deadline. (The server's execution_state is no guide: with no front end
        # connected it stays "starting" after the kernel is up, and waiting for it cost 120 s.)
        deadline = time.monotonic() + 120
        while True:
            try:
                self.client.wait_for_ready(timeout=max(1.0, deadline - time.monotonic()))
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        # the notebooks put the repository root first on the path; this checkout's helpers
        self.run(f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r})")

    def run(self, code: str, timeout: float = 240, during=None) -> list[dict]:
        """Execute `code` in the kernel; every iopub message of that execution (`during(msgs)`
        is called while waiting, e.g. to interrupt it)."""
        msg_id = self.client.execute(code)
        messages: list[dict] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if during is not None:
                during(messages)
            try:
                msg = self.client.get_iopub_msg(timeout=0.5)
            except Exception:  # queue.Empty: nothing yet
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            messages.append(msg)
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return messages
        raise TimeoutError(f"the cell did not finish within {timeout:.0f} s:\n{code}")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> str:
        """Stop the kernel and the server; the server's output."""
        if self.client is not None:
            self.client.stop_channels()
        if self.session_id and self.server is not None and self.server.poll() is None:
            try:  # shuts its kernel down, as closing the notebook does
                self.api("DELETE", f"/api/sessions/{self.session_id}", timeout=30)
            except OSError:
                pass
        if self.server is not None and self.server.poll() is None:
            os.killpg(self.server.pid, signal.SIGTERM)
            try:
                self.server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.server.pid, signal.SIGKILL)
                self.server.wait()
        return self.output()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab (./run.sh jupyter) in a scratch git checkout of run.sh, helpers/ and one notebook
    as committed; the notebook's kernel is running."""
    base = tmp_path_factory.mktemp("jupyterlab")
    root, runtime = base / "course", base / "runtime"
    root.mkdir()
    runtime.mkdir()
    for name in ("run.sh", "requirements.txt", ".gitattributes", ".gitignore"):
        shutil.copy(REPO_ROOT / name, root / name)
    for folder in ("helpers", ".jupyter"):
        shutil.copytree(REPO_ROOT / folder, root / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    (root / NOTEBOOK).parent.mkdir()
    (root / NOTEBOOK).write_text(_committed(NOTEBOOK))
    assert _git("init", "-q", cwd=root).returncode == 0
    _git("add", "-A", cwd=root)
    assert _git("commit", "-qm", "course", cwd=root).returncode == 0
    server = Lab(root, runtime)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_jupyterlab_starts_as_root_and_saves_widget_state(lab):
    """./run.sh jupyter starts JupyterLab as root too (containers), and JupyterLab saves widget
    state with notebooks (a reopened notebook shows its widgets instead of "model not found")."""
    if os.getuid() == 0:
        assert "--allow-root" in lab.output(), lab.output()[-2000:]
    settings = lab.api("GET", "/lab/api/settings/@jupyter-widgets/jupyterlab-manager:plugin")
    default = settings["schema"]["properties"]["saveState"]["default"]
    assert settings["settings"].get("saveState", default) is True, \
        "widget state is not saved with notebooks: reopened notebooks would show 'model not found'"


def test_table_in_a_notebook_is_escaped_markdown_over_plain_text(lab):
    """show.table in a notebook shows the escaped Markdown table, with the aligned text as its
    plain-text form (what a terminal prints)."""
    code = (f"from helpers.show import table\nrows = {TRICKY_ROWS!r}\n"
            "table(rows, title='max |diff|')")
    messages = lab.run(code)
    shown = [m["content"]["data"] for m in messages if m["msg_type"] == "display_data"]
    assert len(shown) == 1, f"expected one table: {[m['content'] for m in messages]}"
    assert shown[0]["text/markdown"] == show.markdown_table(TRICKY_ROWS, title="max |diff|")
    assert shown[0]["text/plain"] == "max |diff|\n" + show.format_table(TRICKY_ROWS)


def test_interrupted_launch_shows_one_line_and_leaves_no_rank(lab, tmp_path):
    """Interrupting a cell that runs a 2-rank launch (JupyterLab's stop button) shows one line,
    "KeyboardInterrupt: stopped: 2 rank(s) killed, no process left", and every rank is gone."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    code = ("from helpers.launch import launch\n"
            f"launch({str(REPO_ROOT / 'tests/scripts/hang_rank.py')!r}, '--all', nproc=2, "
            f"timeout=300, stream=False, env={{'HANG_PID_DIR': {str(pid_dir)!r}}})\n")
    pids: list[int] = []

    def interrupt_once_running(_messages) -> None:
        if pids:
            return
        found = [int(p.read_text()) for p in pid_dir.glob("*.pid") if p.read_text()]
        if len(found) == 2:
            pids.extend(found)
            lab.api("POST", f"/api/kernels/{lab.kernel_id}/interrupt")  # the stop button

    messages = lab.run(code, timeout=280, during=interrupt_once_running)
    assert pids, "the ranks never started"
    errors = [m["content"] for m in messages if m["msg_type"] == "error"]
    streams = "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")
    assert len(errors) == 1, f"the interrupted cell raised {len(errors)} errors: {errors}"
    shown = [ANSI.sub("", line) for entry in errors[0]["traceback"] for line in entry.splitlines()]
    assert shown == ["KeyboardInterrupt: stopped: 2 rank(s) killed, no process left"], (
        f"the interrupted cell shows {len(shown)} line(s) of error instead of one line saying what "
        "became of the ranks:\n" + "\n".join(shown))
    assert not streams.strip(), f"the interrupted cell also printed:\n{streams}"
    deadline = time.monotonic() + 15
    alive = _alive(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = _alive(alive)
    assert not alive, f"ranks left running after the interrupt: {alive}"
    after = [m["content"] for m in lab.run("print(6 * 7)") if m["msg_type"] == "stream"]
    assert after and after[0]["text"] == "42\n", "the kernel does not run cells after the interrupt"


def _alive(pids: list[int]) -> list[int]:
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def _widget_states(messages: list[dict]) -> dict[str, dict]:
    return {m["content"]["comm_id"]: m["content"]["data"]["state"] for m in messages
            if m["msg_type"] == "comm_open"
            and m["content"].get("target_name") == "jupyter.widget"}


def _css_rules(html_text: str) -> dict[str, str]:
    """{selector: declarations} of the <style> blocks in `html_text`."""
    styles = "".join(re.findall(r"<style>(.*?)</style>", html_text, re.S))
    return {" ".join(k.split()): v for k, v in re.findall(r"([^{}]+)\{([^}]*)\}", styles)}


EXPLORER = ("import ipywidgets as widgets\nfrom helpers.show import explorer, html_text\n"
            "n = widgets.IntSlider(value=3, min=1, max=9, description='n')\n"
            "box = explorer([n], lambda: html_text(f'n squared = {n.value ** 2}'))")


def test_explorer_says_to_run_the_cell_when_no_kernel_is_behind_it(lab):
    """An explorer's saved widget state carries "run this cell to use the controls", shown only
    where the front end marks the controls disconnected (reopened notebook, restarted kernel)."""
    messages = lab.run(EXPLORER)
    states = _widget_states(messages)  # what the front end keeps, and saves with the notebook
    views = [m["content"]["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]
             for m in messages if m["msg_type"] == "display_data"
             and "application/vnd.jupyter.widget-view+json" in m["content"]["data"]]
    assert len(views) == 1, f"expected one widget view: {messages}"
    children = [ref.removeprefix("IPY_MODEL_") for ref in states[views[0]]["children"]]
    notes = [states[c] for c in children
             if "run this cell to use the controls" in states[c].get("value", "").lower()]
    assert len(notes) == 1, ("the explorer's saved state has no note saying to run the cell to use "
                             "the controls: reopened, its controls would do nothing, silently")
    rules = _css_rules(notes[0]["value"])
    note, gone = f".{show.OFFLINE_NOTE_CLASS}", f".{show.DISCONNECTED_CLASS}"
    assert "display: none" in rules.get(note, ""), \
        "the note is not hidden by default: it would show under live, working controls too"
    assert "display: block" in rules.get(f"{gone} {note}", ""), \
        f"the note is not shown where the front end marks widgets disconnected ({gone})"
    # the class ipywidgets' JupyterLab manager puts on a view whose kernel is gone
    marks = re.compile(rf"addClass\(\s*[\"']{show.DISCONNECTED_CLASS}[\"']\s*\)")
    assert marks.search(_front_end_code(_widget_manager_code())), \
        f"this ipywidgets no longer marks disconnected views with {show.DISCONNECTED_CLASS!r}"


def _widget_manager_code() -> Path:
    from jupyter_core.paths import jupyter_path

    folders = [Path(p) / "@jupyter-widgets" / "jupyterlab-manager" / "static"
               for p in jupyter_path("labextensions")]
    return next((f for f in folders if f.is_dir()), folders[0])


def test_explorer_leaves_its_last_view_where_no_widget_state_is_saved(lab):
    """After a kernel restart JupyterLab saves no widget state (only live models), and the
    reopened notebook shows "Error displaying widget: model not found" where the controls were.
    An explorer also leaves an ordinary output after its controls: its last view (kept up to date
    as the controls move) under a note saying to run the cell, hidden while the controls are
    drawn, and hiding that error line when they are not. (Checked in Chromium: run, restart,
    save, reopen; what the browser applies is read here from the stylesheets.)"""
    messages = lab.run(EXPLORER)
    shown = [m["content"] for m in messages if m["msg_type"] == "display_data"]
    assert len(shown) == 2, f"expected the controls, then the saved view: {shown}"
    controls, saved = shown
    assert controls["data"]["text/plain"] == show.CONTROLS_TEXT, \
        "an untrusted notebook would show the widget's whole repr instead of one line"
    html_view = saved["data"].get("text/html", "")
    display_id = saved.get("transient", {}).get("display_id")
    assert "run this cell" in html_view.lower() and "n squared = 9" in html_view, (
        "the explorer leaves no view of its own after the controls: a notebook saved after a kernel "
        f"restart shows only 'model not found'\n{html_view}")
    assert "n: 3" in html_view, "the saved view does not say which settings it was drawn for"
    assert display_id, "the saved view has no display id: it cannot follow the controls"
    moved = lab.run("n.value = 5")
    updates = [m["content"] for m in moved if m["msg_type"] == "update_display_data"]
    assert updates and updates[-1]["transient"]["display_id"] == display_id and \
        "n squared = 25" in updates[-1]["data"]["text/html"], \
        "moving a control does not update the saved view: a reopened notebook would show a stale one"
    # its class names this explorer alone; the controls' stylesheet hides exactly that view
    key = re.search(rf'class="{show.SAVED_VIEW_CLASS} ({show.SAVED_VIEW_CLASS}-\w+)"', html_view)
    assert key, f"the saved view is not marked with its explorer's own class:\n{html_view}"
    mine = f".{show.SAVED_VIEW_CLASS}.{key.group(1)}"
    states = _widget_states(messages)
    hidden = [k for state in states.values() if isinstance(state.get("value"), str)
              for k, v in _css_rules(state["value"]).items() if "display: none" in v]
    assert mine in hidden, ("the live controls do not hide the saved view: every explorer would "
                            f"show its picture under its working controls ({hidden})")
    # ... and the saved view hides the output just before it when that holds no element (the
    # error line), never a drawn widget
    after = ".jp-OutputArea-child:has(+ .jp-OutputArea-child " + mine + ")"
    rules = _css_rules(html_view)
    assert any(k.startswith(after) and ":not(:has(.jp-OutputArea-output *))" in k
               and "display: none" in v for k, v in rules.items()), \
        f"the saved view does not hide the 'model not found' line before it: {rules}"
    # the front end's rules these rely on: models saved only while live; that error line
    code = _front_end_code(_widget_manager_code())
    assert re.search(r"comm_live&&\w+\.push", code), \
        "ipywidgets now saves widgets whose kernel is gone: the saved view may be unneeded"
    assert 'textContent="Error displaying widget: model not found"' in code, \
        "ipywidgets shows a missing widget differently now: check the saved view's stylesheet"


def test_saved_view_names_every_control_as_the_student_set_it():
    """The saved view's "drawn for" line shows each control as the student sees it: a selection
    by its label (ipywidgets leaves a SelectionSlider's `label` empty while its first option is
    chosen: notebook 11's saved view read "router skew: ;"), several choices, numbers, boxes."""
    import ipywidgets as widgets

    line = show.control_settings([
        widgets.SelectionSlider(options=[0.0, 0.5], value=0.0, description="router skew"),
        widgets.Dropdown(options=[("none (dropless)", 0.0), ("1.0", 1.0)], value=0.0, description="capacity"),
        widgets.SelectMultiple(options=["thread", "process"], value=("thread", "process"), description="kinds"),
        widgets.IntSlider(value=3, description="n"), widgets.Checkbox(value=False, description="causal"),
        widgets.Button(description="measure")])
    assert line == ("drawn for router skew: 0.0; capacity: none (dropless); kinds: thread, process; "
                    "n: 3; causal: False"), line


def test_every_notebook_shows_its_widgets_through_an_explorer():
    """A widget displayed any other way than by `show.explorer` leaves nothing after a kernel
    restart and a save ("Error displaying widget: model not found", the view gone): every
    notebook cell that uses ipywidgets calls explorer(). And no label is cut: Chromium showed
    notebook 11's toggle button 'contiguous' as 'contiguo...' (90 px), 06's description
    'micro-batches m' as 'micro-bat...' (ipywidgets' 80 px). (The rest of what a student
    sees in a browser is tools/jupyterlab_pass.py's, docs/MAINTAINERS.md.)"""
    offenders = []
    for path in sorted((REPO_ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            source = "".join(cell["source"])
            if cell["cell_type"] != "code" or "widgets" not in source:
                continue
            if "explorer(" not in source:
                offenders.append(f"{path.name} cell {i}: widgets shown without explorer()")
            if re.search(r"button_width[\"']?\s*[:=]\s*[\"']\d", source):
                offenders.append(f"{path.name} cell {i}: a toggle button of fixed width cuts its label")
            # a control's description gets 80 px (ipywidgets' default) unless its style says
            # otherwise: Chromium showed notebook 06's "micro-batches m" as "micro-bat..."
            for kind, call in re.findall(r"widgets\.(\w+)\((.*?)(?=widgets\.|\Z)", source, re.S):
                label = re.search(r'description="([^"]*)"', call)
                if label and len(label.group(1)) > 10 and kind not in ("Checkbox", "Button") \
                        and "description_width" not in call and "style=style" not in call:
                    offenders.append(f"{path.name} cell {i}: the description {label.group(1)!r} is cut "
                                     "at ipywidgets' 80 px (give it style={'description_width': ...})")
    assert not offenders, "\n".join(offenders)


def test_a_notebook_opened_run_and_saved_is_unchanged_for_git(lab):
    """A notebook opened, run and saved in JupyterLab (outputs, widget state, and the kernel's name
    and Python version in its metadata) shows no change in git diff, nor in git status (git
    compares sizes first: JupyterLab's post-save hook has it compare the content), so a plain
    git pull can update it too."""
    model = lab.api("GET", f"/api/contents/{NOTEBOOK}?content=1")
    notebook = model["content"]
    # what JupyterLab's front end writes into the notebook from the kernel it runs
    specs = lab.api("GET", "/api/kernelspecs")["kernelspecs"]
    spec = specs[notebook["metadata"]["kernelspec"]["name"]]
    reply = lab.client.kernel_info(reply=True, timeout=60)["content"]
    notebook["metadata"]["kernelspec"] = {"display_name": spec["spec"]["display_name"],
                                          "language": spec["spec"]["language"],
                                          "name": spec["name"]}
    notebook["metadata"]["language_info"] = reply["language_info"]
    notebook["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {
        "state": {}, "version_major": 2, "version_minor": 0}}
    code = next(c for c in notebook["cells"] if c["cell_type"] == "code")
    code["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "measured: 1.23 s\n"}]
    code["execution_count"] = 1
    lab.api("PUT", f"/api/contents/{NOTEBOOK}", {"type": "notebook", "format": "json",
                                                 "content": notebook})
    saved = json.loads((lab.root / NOTEBOOK).read_text())["metadata"]
    assert saved["language_info"].get("version") == reply["language_info"]["version"], \
        "the save did not write the kernel's metadata: this checks nothing"
    if _git("diff", "--quiet", "--", NOTEBOOK, cwd=lab.root).returncode != 0:  # as ./run.sh update
        diff = _git("diff", "--no-textconv", "--", NOTEBOOK, cwd=lab.root)
        pytest.fail("opening, running and saving a notebook shows as a change in git (./run.sh "
                    "update would refuse to pull over it):\n"
                    f"{diff.stdout[-3000:]}{diff.stderr[-2000:]}")
    # the post-save hook refreshes git's index in the background (the filter: a second or so)
    deadline = time.monotonic() + 60
    while (listed := _git("status", "--porcelain", cwd=lab.root).stdout.strip()) and \
            time.monotonic() < deadline:
        time.sleep(0.5)
    assert not listed, ("git status lists the notebook that was only run and saved as modified "
                        f"(git compared its size, not its content: no post-save refresh):\n{listed}")


def test_update_waits_for_jupyterlab_to_stop(lab):
    """./run.sh update refuses while JupyterLab serves the checkout (a notebook open there would
    be saved back over the update), and says how to stop it."""
    env = dict(os.environ, COURSE_PYTHON=sys.executable, JUPYTER_RUNTIME_DIR=str(lab.runtime),
               HOME=str(lab.runtime))
    done = subprocess.run(["bash", "run.sh", "update"], cwd=lab.root, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "JupyterLab is serving this folder" in done.stderr and \
        f":{lab.port}/" in done.stderr, \
        f"./run.sh update did not stop for the running JupyterLab:\n{done.stdout}{done.stderr}"


# ---- ./run.sh update, with an upstream repository and a student's clone -------------------------

def _notebook(title: str) -> str:
    """A small notebook as the course commits it (what the filter makes of it)."""
    import nbformat

    from helpers.notebook_filter import clean

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {title}"),
                nbformat.v4.new_code_cell("print(6 * 7)")]
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i}"
    return clean(nbformat.writes(nb))


def _run_and_save(path: Path, output: str) -> None:
    """What running a notebook and saving it in JupyterLab writes into the file."""
    nb = json.loads(path.read_text())
    code = next(c for c in nb["cells"] if c["cell_type"] == "code")
    code["outputs"] = [{"output_type": "stream", "name": "stdout", "text": [output]}]
    code["execution_count"] = 1
    nb["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nb["metadata"]["language_info"] = {"name": "python", "version": "3.11.9"}
    path.write_text(json.dumps(nb, indent=1))


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _edit(path: Path, text: str) -> None:
    nb = json.loads(path.read_text())
    nb["cells"].append({"cell_type": "markdown", "id": "mine", "metadata": {}, "source": [text]})
    path.write_text(json.dumps(nb, indent=1))


def test_update_keeps_what_the_student_ran_and_wrote(tmp_path):
    """./run.sh update against a bare upstream repository: it stops before touching anything when
    the course changed a file the student changed too (a lab); otherwise it updates the notebooks
    the course changed, each the student ran or edited first set aside with its outputs and edits
    in a folder of its own (a second update never overwrites the first's copies), leaves every
    other notebook as it was, and says what happened to each. Saving outputs (as JupyterLab does)
    leaves git status clean once the index is refreshed."""
    identity = ["-c", "user.email=i@course", "-c", "user.name=instructor"]
    git = lambda *args, cwd: subprocess.run(["git", *identity, *args], cwd=cwd, capture_output=True,
                                            text=True, timeout=120)
    course, bare, student = tmp_path / "course", tmp_path / "upstream.git", tmp_path / "student"
    for name in ("run.sh", "requirements.txt", ".gitattributes", ".gitignore"):
        (course / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / name, course / name)
    shutil.copytree(REPO_ROOT / "helpers", course / "helpers",
                    ignore=shutil.ignore_patterns("__pycache__"))
    names = {"ran": "01_ran", "kept": "02_kept", "edited": "03_edited", "fresh": "04_fresh",
             "mine": "05_mine"}
    nbs = {k: Path("notebooks") / f"{v}.ipynb" for k, v in names.items()}
    (course / "notebooks").mkdir()
    (course / "labs").mkdir()
    for key, rel in nbs.items():
        (course / rel).write_text(_notebook(key))
    (course / "labs" / "lab01.py").write_text("def exercise():\n    raise NotImplementedError\n")
    assert git("init", "-q", "-b", "main", cwd=course).returncode == 0
    git("add", "-A", cwd=course)
    assert git("commit", "-qm", "course", cwd=course).returncode == 0
    assert git("clone", "-q", "--bare", str(course), str(bare), cwd=tmp_path).returncode == 0
    git("remote", "add", "origin", str(bare), cwd=course)
    git("fetch", "-q", "origin", cwd=course)
    git("branch", "-q", "--set-upstream-to=origin/main", cwd=course)
    assert git("clone", "-q", str(bare), str(student), cwd=tmp_path).returncode == 0
    # files written in the second the index was: git compares their content on the next status,
    # through the filter once it is installed (a second a notebook): compare them now, unfiltered
    time.sleep(1.1)
    git("update-index", "-q", "--really-refresh", cwd=student)
    env = dict(os.environ, COURSE_PYTHON=sys.executable,
               JUPYTER_RUNTIME_DIR=str(tmp_path / "no-jupyter"))

    def update() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "run.sh", "update"], cwd=student, env=env,
                              capture_output=True, text=True, timeout=300)

    def publish(changes: dict[str, str]) -> None:
        for rel, text in changes.items():
            (course / rel).write_text(text)
        git("add", "-A", cwd=course)
        assert git("commit", "-qm", "fix", cwd=course).returncode == 0
        assert git("push", "-q", "origin", "main", cwd=course).returncode == 0

    done = update()  # the first run installs the git filter; the course has nothing new yet
    assert done.returncode == 0 and "no new version" in done.stdout, done.stdout + done.stderr

    # the student runs three notebooks, edits two, writes the lab's exercise
    _run_and_save(student / nbs["ran"], "ran: 1.23 s\n")
    _run_and_save(student / nbs["kept"], "kept: 4.56 s\n")
    _run_and_save(student / nbs["edited"], "edited: 7.89 s\n")
    _edit(student / nbs["edited"], "my note on 03")
    _edit(student / nbs["mine"], "my note on 05")
    (student / "labs" / "lab01.py").write_text("def exercise():\n    return 42\n")
    subprocess.run([sys.executable, "-m", "helpers.notebook_filter", "--refresh",
                    *map(str, nbs.values())], cwd=student, check=True, timeout=120)
    listed = sorted(line[3:] for line in git("status", "--porcelain", cwd=student).stdout.splitlines())
    assert listed == sorted(["labs/lab01.py", str(nbs["edited"]), str(nbs["mine"])]), (
        "after refreshing, git status should list what the student edited and nothing that was "
        f"only run: {listed}")

    # the course changes the lab, two notebooks the student touched, one not, and adds one
    new = {k: _notebook(f"{k} (updated)") for k in ("ran", "edited", "fresh")}
    publish({str(nbs[k]): text for k, text in new.items()}
            | {"notebooks/06_new.ipynb": _notebook("new"),
               "labs/lab01.py": "def exercise():\n    raise NotImplementedError('better hint')\n"})
    before = {rel: (student / rel).read_bytes() for rel in nbs.values()}
    done = update()
    assert done.returncode != 0 and "labs/lab01.py" in done.stderr and \
        "Nothing was changed" in done.stderr, done.stdout + done.stderr
    assert {rel: (student / rel).read_bytes() for rel in nbs.values()} == before and \
        not (student / "runs").exists(), "the refused update changed the student's notebooks"

    git("checkout", "--", "labs/lab01.py", cwd=student)  # the student sets the lab aside
    done = update()
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    copies = sorted((student / "runs" / "notebook-outputs").glob("*/*.ipynb"))
    assert [c.name for c in copies] == [nbs["ran"].name, nbs["edited"].name], \
        f"set aside {[c.name for c in copies]}, expected the ran and the edited notebook:\n{out}"
    assert "ran: 1.23 s" in copies[0].read_text(), "the outputs of the notebook the course changed are lost"
    assert "my note on 03" in copies[1].read_text() and "edited: 7.89 s" in copies[1].read_text(), \
        "the edits (and outputs) of the notebook the course changed are lost"
    for key in ("ran", "edited", "fresh"):
        assert "(updated)" in (student / nbs[key]).read_text(), f"{nbs[key]} was not updated"
    assert (student / "notebooks/06_new.ipynb").exists(), "the new notebook did not arrive"
    assert (student / nbs["kept"]).read_bytes() == before[nbs["kept"]] and \
        (student / nbs["mine"]).read_bytes() == before[nbs["mine"]], \
        "a notebook the course did not change was touched (outputs or edits lost)"
    said = out[out.index("updated to"):].splitlines()
    for key, says in [("ran", f"with your outputs, is {_rel(copies[0], student)}"),
                      ("edited", f"with your edits and outputs, is {_rel(copies[1], student)}"),
                      ("fresh", "new version"), ("kept", "left as it was, with your outputs"),
                      ("mine", "left as it was, with your edits")]:
        line = next((line for line in said if str(nbs[key]) in line), "")
        assert says in line, f"the update does not say what happened to {nbs[key]}:\n{out}"
    assert "06_new.ipynb: a new notebook" in out, out
    assert not git("status", "--porcelain", "--", str(nbs["ran"]), str(nbs["kept"]),
                   cwd=student).stdout.strip(), "notebooks that were only run show as modified"

    # run again, the course changes it again: a second copy, the first one untouched
    first = copies[0].read_bytes()
    _run_and_save(student / nbs["ran"], "ran again: 2.34 s\n")
    publish({str(nbs["ran"]): _notebook("ran (updated twice)")})
    done = update()
    assert done.returncode == 0, done.stdout + done.stderr
    again = sorted(set((student / "runs" / "notebook-outputs").glob("*/*.ipynb")) - set(copies))
    assert len(again) == 1 and "ran again: 2.34 s" in again[0].read_text(), \
        f"the second update did not keep the second run's outputs in a new copy: {again}"
    assert copies[0].read_bytes() == first, "the second update overwrote the first update's copy"
