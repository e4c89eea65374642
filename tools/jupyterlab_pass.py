"""A student's pass through the course's JupyterLab in headless Chromium: a maintainer's check,
not part of `./run.sh test` (a browser and minutes per notebook).

    .venv/bin/python tools/jupyterlab_pass.py [--full] [--out DIR] [--update NN] [NN ...]

Needs playwright (`.venv/bin/pip install playwright`: not in requirements.txt, no student needs
it) and Chromium (/usr/bin/chromium, or CHROMIUM=path). From this checkout's last commit:

1. the student edition (`./run.sh release`) becomes a git repository, pushed to a bare
   "upstream" that a student's clone follows, as students get the course;
2. `./run.sh jupyter` serves the clone (smoke sizes unless --full), Chromium at 1366 x 900 px;
3. each notebook (all, or those named): Run All (no cell may fail); each explorer's first control
   moved must change its panel; outputs wider than the notebook are listed; then restart the
   kernel, save, close: `git status` must be clean; reopen: each explorer must show its saved
   view, never "model not found". Screenshots of every explorer, live and reopened;
4. the update (notebook --update, default the first one run): the course changes it upstream;
   `./run.sh update` must refuse while JupyterLab serves the clone; once it is closed, the update
   sets the student's copy aside (outputs kept), the reopened notebook is the course's new
   version, saves with no "File Changed" dialog, and `git status` stays clean.

Writes DIR/report.json and DIR/shots/*.png (DIR: a new folder under /tmp unless --out), prints a
line per notebook and exits 1 if any check failed. Every process it starts is stopped at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOKEN = "course-pass"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# what the page shows: explorers' saved views, "model not found" lines, notices, pop-ups, dialogs
PAGE_STATE = """(root) => { root = root || document; const vis = e => e.offsetParent !== null;
  return {saved_views: [...root.querySelectorAll('.course-explorer-saved')].filter(vis).length,
    model_not_found: [...root.querySelectorAll('.jp-OutputArea-output')].filter(e => vis(e) && e.textContent.includes('model not found')).length,
    controls: [...root.querySelectorAll('.widget-vbox')].filter(vis).length,
    too_wide: [...root.querySelectorAll('.jp-OutputArea-output')].filter(e => vis(e) && e.scrollWidth > e.clientWidth + 2).map(e => e.scrollWidth - e.clientWidth),
    toasts: [...document.querySelectorAll('.Toastify__toast')].map(e => e.textContent.slice(0, 160)),
    dialogs: [...document.querySelectorAll('.jp-Dialog')].map(e => e.textContent.slice(0, 160))}; }"""
NOTEBOOK = "const nb = window.jupyterapp.shell.currentWidget;"
ERRORS = NOTEBOOK + """ const out = []; nb.content.widgets.forEach((c, i) => { if (c.model.type !== 'code') return;
  for (const o of c.model.outputs.toJSON()) if (o.output_type === 'error') out.push(`cell ${i}: ${o.ename}: ${(o.evalue || '').slice(0, 300)}`); });
  return out;"""
EXPLORER_CELLS = NOTEBOOK + """ return nb.content.widgets.map((c, i) => [c, i]).filter(([c, i]) => c.model.type === 'code' &&
  JSON.stringify(c.model.outputs.toJSON()).includes('course-explorer-saved')).map(([c, i]) => i);"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(*cmd: str, cwd: Path, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed in {cwd}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done


class Server:
    """`./run.sh jupyter` in `root`, with its own HOME (Jupyter's runtime files, the kernel's)."""

    def __init__(self, root: Path, env: dict):
        self.port, self.root = free_port(), root
        self.log = open(Path(env["HOME"]) / "server.log", "a")
        self.proc = subprocess.Popen(
            ["bash", "run.sh", "jupyter", "--no-browser", f"--port={self.port}",
             f"--IdentityProvider.token={TOKEN}", "--LabApp.expose_app_in_browser=True"],
            cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 600
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/status?token={TOKEN}", timeout=10)
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise RuntimeError(f"JupyterLab did not start: see {self.log.name}")
                time.sleep(0.5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/lab?token={TOKEN}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class Lab:
    """Chromium on a server's JupyterLab, driven through its own command registry."""

    def __init__(self, server: Server, profile: Path):
        from playwright.sync_api import sync_playwright

        shutil.rmtree(profile, ignore_errors=True)
        self.pw = sync_playwright().start()
        self.ctx = self.pw.chromium.launch_persistent_context(
            str(profile), executable_path=os.environ.get("CHROMIUM", "/usr/bin/chromium"),
            headless=True, args=CHROMIUM_ARGS, viewport={"width": 1366, "height": 900})
        self.page = self.ctx.pages[0] if self.ctx.pages else self.ctx.new_page()
        self.page.goto(server.url, wait_until="domcontentloaded")
        self.page.wait_for_function("window.jupyterapp && window.jupyterapp.started", timeout=180_000)
        self.page.evaluate("async () => { await window.jupyterapp.started; await window.jupyterapp.restored; }")
        time.sleep(3)

    def js(self, code: str, arg=None):
        return self.page.evaluate(f"async (arg) => {{ {code} }}", arg)

    def open(self, path: str) -> None:
        self.js("const w = await window.jupyterapp.commands.execute('docmanager:open', {path: arg}); "
                "await w.context.ready; await w.sessionContext.ready;", path)
        time.sleep(3)

    def run_all(self) -> float:
        start = time.time()
        self.js("await window.jupyterapp.commands.execute('notebook:run-all-cells');")
        while self.js(NOTEBOOK + " return nb.sessionContext.session.kernel.status;") != "idle":
            time.sleep(1)
        return time.time() - start

    def restart_and_save(self) -> None:
        self.js(NOTEBOOK + " await nb.sessionContext.restartKernel(); await nb.sessionContext.ready;")
        time.sleep(3)
        self.js(NOTEBOOK + " await nb.context.save();")
        time.sleep(2)

    def close_all(self) -> list[str]:
        """Close every tab; the dialogs that came up (each answered with its default)."""
        self.js("await window.jupyterapp.commands.execute('application:close-all');")
        time.sleep(2)
        seen = self.page.evaluate(PAGE_STATE)["dialogs"]
        for button in self.page.query_selector_all(".jp-Dialog .jp-mod-accept"):
            try:
                button.click()
            except Exception:
                pass  # the dialog closed itself meanwhile
        return seen

    def explorers(self, shots: Path, name: str, stage: str, move: bool) -> list[dict]:
        found = []
        for k, i in enumerate(self.js(EXPLORER_CELLS)):
            self.js(NOTEBOOK + " await nb.content.scrollToItem(arg, 'start');", i)
            for _ in range(30):  # a windowed notebook draws a cell's outputs once it is in view
                time.sleep(1)
                if self.js(NOTEBOOK + " return !!nb.content.widgets[arg].node.querySelector('.jp-Cell-outputWrapper .jp-OutputArea-output');", i):
                    break
            cell = self.page.evaluate_handle(
                "(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node", i).as_element()
            state = {"cell": i, **self.page.evaluate(PAGE_STATE, cell)}
            if move and state["controls"]:
                state["first control changes the panel"] = self.move_first_control(cell)
            cell = self.page.evaluate_handle(  # drawn anew where the notebook re-rendered it
                "(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node", i).as_element()
            (cell.query_selector(".jp-Cell-outputWrapper") or cell).screenshot(
                path=str(shots / f"{name}-{stage}-{k}.png"))
            found.append(state)
        return found

    def move_first_control(self, cell) -> bool:
        """Set the explorer's first control to another value (and press its button, if it has one);
        whether its panel (the last HTML in the box) changed within a minute (or why it need not)."""
        panel = "(c) => { const p = c.querySelectorAll('.widget-vbox > .widget-html'); return p.length ? p[p.length - 1].innerHTML : ''; }"
        before = self.page.evaluate(panel, cell)
        control = cell.query_selector(".widget-vbox .widget-hbox > *:not(.widget-button)")
        if control.query_selector("select"):
            select = control.query_selector("select")
            options = [o.get_attribute("value") for o in select.query_selector_all("option")]
            current = select.evaluate("s => s.value")
            select.select_option(next(o for o in options if o != current))
        elif control.query_selector("input[type=checkbox]"):
            control.query_selector("input[type=checkbox]").click()
        elif control.query_selector(".widget-toggle-button:not(.mod-active)"):
            control.query_selector(".widget-toggle-button:not(.mod-active)").click()
        else:  # a slider: one step right (or left, at its end)
            readout = lambda: control.query_selector(".widget-readout").inner_text()
            start = readout()
            control.query_selector(".noUi-handle").focus()
            self.page.keyboard.press("ArrowRight")
            time.sleep(0.5)
            if readout() == start:
                self.page.keyboard.press("ArrowLeft")
        button = cell.query_selector(".widget-vbox .widget-hbox .widget-button:not(.widget-toggle-button)")
        if button:
            button.click()
        for _ in range(60):
            time.sleep(1)
            now = self.page.evaluate(panel, cell)
            if now != before:
                while True:  # until the kernel has drawn the last value (no change for 2 s)
                    time.sleep(2)
                    now, last = self.page.evaluate(panel, cell), now
                    if now == last:
                        return True
        # an unsolved exercise's notice alone is the same whatever the controls say
        return "the panel is an exercise's notice" if before.count("course-exercise-notice") and \
            not re.sub(r'<div class="course-exercise-notice.*?</div>', "", before, flags=re.S).strip() else False

    def close(self) -> None:
        self.ctx.close()
        self.pw.stop()


def git_status(root: Path) -> str:
    """`git status --short`, given a few seconds (the post-save hook runs after the save returns)."""
    for _ in range(10):
        out = sh("git", "status", "--short", cwd=root).stdout
        if not out.strip():
            return ""
        time.sleep(1)
    return out


def make_student_clone(out: Path) -> Path:
    """The student edition of HEAD, pushed to a bare upstream, and a student's clone of it."""
    committed = out / "checkout"
    sh("git", "clone", "-q", str(REPO), str(committed), cwd=out)
    (committed / ".venv").symlink_to(REPO / ".venv")
    sh("bash", "run.sh", "release", str(out / "course"), cwd=committed)
    course = out / "course"
    for args in (["init", "-q", "-b", "main"], ["add", "-A"],
                 ["-c", "user.email=course@example.org", "-c", "user.name=course", "commit", "-qm", "course"]):
        sh("git", *args, cwd=course)
    sh("git", "clone", "-q", "--bare", str(course), str(out / "upstream.git"), cwd=out)
    sh("git", "remote", "add", "origin", str(out / "upstream.git"), cwd=course)
    sh("git", "clone", "-q", str(out / "upstream.git"), str(out / "student"), cwd=out)
    (out / "student" / ".venv").symlink_to(REPO / ".venv")
    return out / "student"


def notebook_pass(lab: Lab, student: Path, path: str, shots: Path) -> dict:
    name = Path(path).name[:2]
    r: dict = {"problems": []}
    lab.open(path)
    r["run all, s"] = round(lab.run_all(), 1)
    r["errors"] = lab.js(ERRORS)
    r["problems"] += [f"a cell failed: {e}" for e in r["errors"]]
    r["too wide"] = lab.page.evaluate(PAGE_STATE)["too_wide"]
    r["explorers, live"] = lab.explorers(shots, name, "live", move=True)
    for e in r["explorers, live"]:
        r["too wide"] += e["too_wide"]
        if e.get("first control changes the panel") is False:
            r["problems"].append(f"cell {e['cell']}: moving the explorer's first control changes nothing")
    lab.restart_and_save()
    r["dialogs at close"] = lab.close_all()
    r["git status"] = git_status(student)
    if r["git status"]:
        r["problems"].append(f"git status after a save: {r['git status']!r}")
    lab.open(path)
    time.sleep(3)
    r["explorers, reopened"] = lab.explorers(shots, name, "reopened", move=False)
    for e in r["explorers, reopened"]:
        if e["model_not_found"] or not e["saved_views"]:
            r["problems"].append(f"cell {e['cell']} reopened: {e['saved_views']} saved view(s), "
                                 f"{e['model_not_found']} 'model not found'")
    lab.close_all()
    return r


def update_pass(out: Path, student: Path, env: dict, path: str, shots: Path) -> dict:
    r: dict = {"notebook": path, "problems": []}
    course = out / "course"
    import nbformat  # written as JupyterLab and the course's filter write it (one string a line)

    nb = nbformat.read(course / path, as_version=4)
    nb.cells[0].source = "**Updated by the course.**\n\n" + nb.cells[0].source
    nbformat.write(nb, course / path)
    sh("git", "-c", "user.email=course@example.org", "-c", "user.name=course", "commit", "-qam",
       f"{path} updated", cwd=course)
    sh("git", "push", "-q", "origin", "main", cwd=course)
    server = Server(student, env)
    try:
        lab = Lab(server, out / "profile-update")
        lab.open(path)
        refused = sh("bash", "run.sh", "update", cwd=student, env=env, check=False)
        r["update with JupyterLab open"] = (refused.returncode, (refused.stdout + refused.stderr)[-600:])
        if refused.returncode == 0:
            r["problems"].append("./run.sh update ran while JupyterLab served the checkout")
        lab.close_all()
        lab.close()
    finally:
        server.stop()
    done = sh("bash", "run.sh", "update", cwd=student, env=env, check=False)
    r["update"] = (done.returncode, (done.stdout + done.stderr)[-1500:])
    copies = sorted((student / "runs" / "notebook-outputs").glob(f"*/{Path(path).name}"))
    kept = copies and any(c.get("outputs") for c in json.loads(copies[-1].read_text())["cells"]
                          if c["cell_type"] == "code")
    if done.returncode or not kept:
        r["problems"].append(f"the update failed or kept no copy with outputs ({copies})")
    server = Server(student, env)
    try:
        lab = Lab(server, out / "profile-update-2")
        lab.open(path)
        first = lab.js(NOTEBOOK + " return nb.content.widgets[0].model.sharedModel.getSource();")
        if "Updated by the course" not in first:
            r["problems"].append("the reopened notebook is not the course's new version")
        lab.js(NOTEBOOK + " await nb.context.save();")
        time.sleep(2)
        r["dialogs after save"] = lab.page.evaluate(PAGE_STATE)["dialogs"]
        if r["dialogs after save"]:
            r["problems"].append(f"saving the updated notebook: {r['dialogs after save']}")
        lab.page.screenshot(path=str(shots / "update-reopened.png"))
        lab.close_all()
        lab.close()
    finally:
        server.stop()
    r["git status"] = git_status(student)
    if r["git status"]:
        r["problems"].append(f"git status after the update: {r['git status']!r}")
    return r


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", help="two-digit numbers (default: every notebook)")
    parser.add_argument("--full", action="store_true", help="full sizes (default: COURSE_SMOKE=1)")
    parser.add_argument("--out", type=Path, help="a new folder for everything (default: under /tmp)")
    parser.add_argument("--update", help="the notebook the course changes upstream (default: the first run)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="jupyterlab-pass-"))
    out.mkdir(parents=True, exist_ok=True)
    shots = out / "shots"
    shots.mkdir(exist_ok=True)
    student = make_student_clone(out)
    paths = sorted(f"notebooks/{p.name}" for p in (student / "notebooks").glob("*.ipynb")
                   if not args.notebooks or p.name[:2] in args.notebooks)
    (out / "home").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_", "COURSE_"))}
    env["HOME"] = str(out / "home")
    if not args.full:
        env["COURSE_SMOKE"] = "1"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server on the way out
    report: dict = {}
    server = Server(student, env)
    try:
        lab = Lab(server, out / "profile")
        report["first start"] = lab.page.evaluate(PAGE_STATE)
        lab.page.screenshot(path=str(shots / "first-start.png"))
        if report["first start"]["toasts"] or report["first start"]["dialogs"]:
            print(f"first start: pop-ups {report['first start']}")
        for path in paths:
            try:
                r = report[path] = notebook_pass(lab, student, path, shots)
            except Exception as exc:  # the next notebook still runs
                r = report[path] = {"problems": [f"the pass stopped: {type(exc).__name__}: {exc}"]}
                lab.close_all()
            print(f"{path}: {r.get('run all, s', '?')} s, too wide {r.get('too wide', [])}, "
                  + ("; ".join(r["problems"]) or "ok"), flush=True)
        lab.close()
    finally:
        server.stop()
        (out / "report.json").write_text(json.dumps(report, indent=1))
    if paths:
        target = args.update and next(p for p in paths if Path(p).name.startswith(args.update))
        r = report["update"] = update_pass(out, student, env, target or paths[0], shots)
        print(f"update of {r['notebook']}: " + ("; ".join(r["problems"]) or "ok"), flush=True)
        (out / "report.json").write_text(json.dumps(report, indent=1))
    print(f"report: {out / 'report.json'}, screenshots: {shots}")
    failed = [k for k, v in report.items() if isinstance(v, dict) and v.get("problems")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
