"""One run description per lab: its ranks, sizes, steps and tolerances, in one frozen dataclass.

A lab declares what one run of it is, with its full size as the defaults and its other sizes as
presets beside them:

    @dataclass(frozen=True)
    class Run(runs.Run):          # labs/lab03_ddp.py
        width: int = 256          # the defaults: the full size (./run.sh 03, the notebooks)
        depth: int = 24
        cap_mb: float = 1.0
        SMOKE = dict(depth=6, cap_mb=0.5)   # COURSE_SMOKE=1: CI, ./run.sh test
        TOUR = dict(depth=12)               # ./run.sh, every lab (default: SMOKE's sizes)
    # `ranks` (every Run has it): the ranks a launch takes; None: NPROC, else the default

    def run(ctx, cfg: Run) -> dict: ...                  # the lab's work, on one preset or another
    def main(argv=None):
        cfg = Run.from_argv(argv)                        # --preset NAME and one flag per field
        with distributed() as ctx:
            run(ctx, cfg)

Everything else takes its values from there:
- the lab's command line: `--preset full|smoke|tour` and one flag per field (`--depth 6`), a flag
  overriding its preset's value; `./run.sh labs/lab03_ddp.py --help` lists them;
- `./run.sh NN` runs the lab at full size (smoke under COURSE_SMOKE=1), `./run.sh` every lab with
  `--preset tour`: a tour of the course that ends within minutes (helpers/launch/cli.py);
- the number of ranks: the field `ranks` (a preset may change it: 4 at full size, 3 in smoke),
  unless NPROC is set, which wins where the lab can run on any count; a lab that needs exactly
  `ranks` (EXACT_RANKS, e.g. a 2 x 2 mesh), or at least MIN_RANKS, says so before anything starts
  when NPROC asks for others (`ranks_for`); `ranks` None: NPROC, else the default
  (helpers.launch.default_nproc: the GPUs, or 2 on the CPU). Inside a run the ranks it got are
  `ctx.world_size`;
- notebooks: `cfg = Run.preset()` (smoke under COURSE_SMOKE=1, else full) and `nproc=cfg.nproc()`;
  `launch(lab, *cfg.argv())` runs a lab with a config built in the notebook;
- helpers/launch/run_labs.py hands each lab's `run(ctx, cfg)` its preset; tests build the config
  they need (`Run.preset("smoke")`, or `Run(depth=3)` for a size the presets do not have).

The tolerances of training compared with one process are defined here, once (`LOSS_RTOL`,
`PARAM_ATOL`); a lab imports them, or makes them fields of its Run where a preset changes them.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import typing
from pathlib import Path
from typing import Any, ClassVar, Sequence

PRESETS = ("full", "smoke", "tour")

# float32 against one process: micro-batched or sharded matmuls add in another order than the
# whole-batch ones (~1e-7 relative); AdamW divides by sqrt(v), which magnifies those differences
# for weights whose gradients are tiny (~1e-5 after 20 steps).
LOSS_RTOL = 1e-4
PARAM_ATOL = 1e-4


class RunError(ValueError):
    """A run description that cannot be used as asked (a preset that does not exist, a field a
    preset names that the Run has not, ranks the lab cannot run on); the message says which."""


class _Parser(argparse.ArgumentParser):
    """A bad flag is a RunError of one line naming the lab (before any rank starts, under run.sh),
    not argparse's usage block and exit."""

    def error(self, message: str):
        raise RunError(f"{self.prog}: {message} (--help lists its flags)")


def mode() -> str:
    """The preset a run takes unless told: "smoke" under COURSE_SMOKE=1, else "full"."""
    from helpers.config import settings

    return "smoke" if settings().smoke else "full"


@dataclasses.dataclass(frozen=True)
class Run:
    """The base of every lab's run description (a frozen dataclass whose defaults are its full
    size). Subclasses set SMOKE and TOUR (dicts of field values), EXACT_RANKS and MIN_RANKS."""

    ranks: int | None = None  # ranks a launch takes; None: NPROC, else the default

    SMOKE: ClassVar[dict[str, Any]] = {}
    TOUR: ClassVar[dict[str, Any] | None] = None   # None: the smoke preset's values
    EXACT_RANKS: ClassVar[bool] = False            # True: exactly `ranks`, whatever NPROC says
    MIN_RANKS: ClassVar[int] = 1

    # ---- presets
    @classmethod
    def preset(cls, name: str | None = None, **overrides: Any):
        """The `name` preset ("full", "smoke" or "tour"; default: `mode()`), with `overrides`."""
        name = mode() if name is None else name
        if name not in PRESETS:
            raise RunError(f"{cls.__qualname__}: no preset {name!r}; the presets are {', '.join(PRESETS)}")
        values = {"full": {}, "smoke": cls.SMOKE,
                  "tour": cls.SMOKE if cls.TOUR is None else cls.TOUR}[name]
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known) + sorted(set(overrides) - known)
        if unknown:
            raise RunError(f"{cls.__module__}.{cls.__qualname__} has no field(s) {unknown} "
                           f"(its fields: {', '.join(sorted(known))})")
        try:
            return cls(**{**values, **overrides})
        except RunError:
            raise
        except (TypeError, ValueError) as exc:  # a value its __post_init__ refuses
            raise RunError(f"{cls.__module__.rpartition('.')[2]}: {exc}") from None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def values(self) -> dict[str, Any]:
        """Every field but `ranks`: what the run computes with (inside a run, the ranks it got
        are ctx.world_size)."""
        return {k: v for k, v in self.as_dict().items() if k != "ranks"}

    # ---- ranks
    def nproc(self) -> int:
        """Ranks a launch of this run takes (`ranks_for`: NPROC, `ranks` or the default)."""
        from helpers.launch import default_nproc

        return ranks_for(self, default_nproc())

    # ---- the command line
    @classmethod
    def parser(cls, description: str | None = None) -> argparse.ArgumentParser:
        """--preset and one flag per field (`depth` is --depth), typed as the field is; described
        by the first line of the lab's docstring."""
        module = sys.modules.get(cls.__module__)
        file = getattr(module, "__file__", None)
        if description is None and getattr(module, "__doc__", None):
            description = module.__doc__.strip().splitlines()[0]
        parser = _Parser(prog=Path(file).name if file else None, description=description,
                         allow_abbrev=False)
        parser.add_argument("--preset", choices=PRESETS, default=None,
                            help="sizes: full (./run.sh NN), smoke (COURSE_SMOKE=1), tour (./run.sh); "
                                 "default: smoke under COURSE_SMOKE=1, else full")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = _parse_as(hints.get(f.name, type(f.default)))
            flag = "--" + f.name.replace("_", "-")
            if kind is bool:  # `--lessons` alone is `--lessons 1`
                parser.add_argument(flag, dest=f.name, default=None, type=_flag, nargs="?",
                                    const=True, metavar="0|1", help=f"(full: {_shown(f.default)})")
            else:
                parser.add_argument(flag, dest=f.name, default=None, type=kind,
                                    help=f"(full: {_shown(f.default)})")
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace):
        """The config a parsed command line asks for: its preset with the flags given over it."""
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                 if getattr(args, f.name, None) is not None}
        return cls.preset(getattr(args, "preset", None), **given)

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None = None):
        """`from_args(parser().parse_args(argv))`; argv None: sys.argv[1:]."""
        return cls.from_args(cls.parser().parse_args(
            sys.argv[1:] if argv is None else list(map(str, argv))))

    def argv(self) -> list[str]:
        """The command line that gives this config: every field as a flag."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out += ["--" + f.name.replace("_", "-"), _shown(value)]
        return out


def ranks_for(config: Run | None, default: int, nproc_set: int | None = None,
              lab: str | None = None) -> int:
    """Ranks for one launch of `config`: NPROC (`nproc_set`; read from the settings when left
    out) when set, except for a lab that needs exactly `config.ranks` (EXACT_RANKS); else
    `config.ranks`; else `default`. A count the lab cannot run on is a RunError naming the lab,
    raised before anything starts."""
    if nproc_set is None:
        from helpers.config import settings

        nproc_set = settings().nproc
    if config is None:
        return default
    lab = lab or type(config).__module__.rpartition(".")[2]
    cls = type(config)
    if cls.EXACT_RANKS:
        if config.ranks is None:
            raise RunError(f"{lab}: EXACT_RANKS needs `ranks` set in the run description")
        if nproc_set is not None and nproc_set != config.ranks:
            raise RunError(f"{lab} runs on exactly {config.ranks} ranks; NPROC={nproc_set} asks for "
                           f"{nproc_set} (unset NPROC to run it)")
        return config.ranks
    ranks = nproc_set if nproc_set is not None else config.ranks if config.ranks is not None else default
    if ranks < cls.MIN_RANKS:
        raise RunError(f"{lab} needs at least {cls.MIN_RANKS} ranks; it would get {ranks} "
                       f"(set NPROC={cls.MIN_RANKS} or more)")
    return ranks


def description(module: Any) -> type[Run] | None:
    """A lab module's run description: its `Run` class, when it has one (None: a lab not yet
    converted, whose sizes still come from `helpers.pick`)."""
    found = getattr(module, "Run", None)
    return found if isinstance(found, type) and issubclass(found, Run) and found is not Run else None


def lab_description(path: str | Path) -> type[Run] | None:
    """`description` of labs/<name>.py, imported as labs.<name> (None when it has no Run; an
    ImportError or SyntaxError propagates: the caller decides how to say it)."""
    path = Path(path)
    if path.parent.name != "labs":
        return None
    return description(importlib.import_module(f"labs.{path.stem}"))


def run_lab(module: Any, ctx: Any, preset: str | None = None, **overrides: Any) -> Any:
    """`module.run(ctx, cfg)` on its `preset` (default: `mode()`) with `overrides`; a lab not
    yet converted (no Run) is `module.run(ctx)`."""
    found = description(module)
    if found is None:
        if overrides:
            raise RunError(f"{module.__name__} has no run description to take {sorted(overrides)}")
        return module.run(ctx)
    return module.run(ctx, found.preset(preset, **overrides))


def _parse_as(hint: Any):
    """A str -> value parser for a field's type: int, float, str, bool, tuples of them
    (comma-separated), and X | None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin in (tuple, list):
        item = _parse_as(args[0]) if args else str
        return lambda raw: tuple(item(x) for x in raw.split(",") if x.strip())
    if args and origin is not None:  # Optional[X], X | None
        return _parse_as(args[0])
    if hint in (int, float, str, bool):
        return hint
    return str


def _flag(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected 1 or 0, got {raw!r}")


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return str(value)
