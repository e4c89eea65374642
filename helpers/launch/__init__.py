"""Starting ranks and never leaving one behind: torchrun from a notebook cell, a test or run.sh.

    from helpers.launch import launch
    res = launch("labs/lab00_orientation.py", nproc=2)   # streams every rank's output
    res.results[1]["device"]                             # what rank 1 reported (ctx.report)

Modules:
- torchrun: `launch` (torchrun under a guard, output streamed, results read back, `LaunchError`
  naming the rank that failed and where in the labs);
- procs: the guard that ends a whole process tree with whoever started it;
- warm: a warm launcher, for processes that launch many times (the tests, grading);
- cli: what `./run.sh`, `./run.sh NN` and `./run.sh script.py` run;
- run_labs: several labs' `run(ctx)` in one launch (a notebook's one launch for many labs).
"""
__all__ = ["REPO_ROOT", "LaunchError", "LaunchResult", "default_nproc", "launch"]


def __getattr__(name: str):
    # The face's names are torchrun's, imported on first use: importing the package imports nothing,
    # so `python -m helpers.launch.procs` (or .warm) does not find itself already imported by
    # this package, as runpy would warn on every launch.
    if name in __all__:
        from helpers.launch import torchrun

        return getattr(torchrun, name)
    raise AttributeError(f"module 'helpers.launch' has no attribute {name!r}")
