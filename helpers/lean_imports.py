"""Leave out one slow optional import in the course's processes that read notebooks.

jsonschema, which nbformat uses to validate notebooks, checks the "iri" string formats with
rfc3987_syntax when that is installed (jupyter_events pulls it in), and rfc3987_syntax builds a
grammar when imported: 1.6 CPU-s in every process that opens a notebook, e.g. the nbstripout git
filter, once per notebook that a git command looks at (the first `git status` of a fresh clone
took about 20 s). No notebook schema uses those formats, so these processes go without it: jsonschema
skips that checker, as it does when the package is missing.

    python -m helpers.lean_imports nbstripout --keep-id   # run a module as `python -m` would
    python -m pytest -p helpers.lean_imports ...          # or load it first (./run.sh test)
"""
import runpy
import sys

sys.modules.setdefault("rfc3987_syntax", None)  # `import rfc3987_syntax` now raises ImportError

if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m helpers.lean_imports MODULE [ARGS...]")
    runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)
