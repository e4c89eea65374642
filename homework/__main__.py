"""Command line: python -m homework {check,submit,release,grade} ... (see --help)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from homework.files import from_caller
from homework.grade import DEFAULT_BUDGET_S
from homework.runner import DEFAULT_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[1]  # the course whose homework/ this is


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="./run.sh", description="The homework cycle.")
    commands = parser.add_subparsers(dest="command", required=True)

    check = commands.add_parser("check", help="run the public checks of lab NN (or all labs)")
    check.add_argument("lab", nargs="?", help="lab number, e.g. 04 (default: all labs)")
    check.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                       help="seconds per test (default %(default)g)")

    submit = commands.add_parser("submit", help="run the checks and pack submissions/<id>-<time>.tar.gz")
    submit.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds per test (default %(default)g)")
    submit.add_argument("--budget", type=float, default=900.0,
                        help="seconds for all checks together (default %(default)g)")

    release = commands.add_parser("release", help="write the student edition into DIR")
    release.add_argument("dir", type=Path, help="relative paths are relative to where you are")
    release.add_argument("--force", action="store_true",
                         help="replace DIR if it holds an earlier student edition")
    release.add_argument("--strict", action="store_true",
                         help="also refuse when a solution line appears outside the solution blocks")

    grade = commands.add_parser("grade", help="grade submission archives into DIR, each in a sandbox")
    grade.add_argument("archives", nargs="+", type=Path)
    grade.add_argument("--out", type=Path, required=True,
                       help="folder for grades.csv, feedback and logs (outside the repository, or "
                            "ignored by git)")
    grade.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                       help="seconds per test (default %(default)g)")
    grade.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                       help="seconds per submission, all its tests together (default %(default)g)")
    grade.add_argument("--jobs", type=int, default=None,
                       help="submissions graded at once, each in its own sandbox (default: one per "
                            "4 cores, at least one)")
    grade.add_argument("--lab", action="append", default=None,
                       help="grade only lab NN's tests (repeat for several)")
    grade.add_argument("--unsafe", action="store_true",
                       help="grade without the sandbox when none can be made (throwaway machines "
                            "only: the submissions' code then runs with your rights)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if getattr(args, "timeout", 1) <= 0 or getattr(args, "budget", 1) <= 0 or \
            (getattr(args, "jobs", None) is not None and args.jobs < 1):
        print("--timeout, --budget and --jobs must be positive", file=sys.stderr)
        return 2
    if args.command == "check":
        from homework.check import normalise_lab, run_check
        try:
            lab = normalise_lab(args.lab) if args.lab else None
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        return run_check(ROOT, lab, args.timeout)[1]
    if args.command == "submit":
        from homework.submit import submit
        submit(ROOT, args.timeout, args.budget)
        return 0
    if args.command == "release":
        from homework.release import ReleaseError, release
        try:
            release(ROOT, from_caller(args.dir), force=args.force, strict=args.strict)
        except ReleaseError as exc:
            print(f"release: {exc}", file=sys.stderr)
            return 1
        return 0
    from homework.check import normalise_lab
    from homework.files import NotACheckout
    from homework.grade import GradingError, grade
    try:
        labs = [normalise_lab(lab) for lab in args.lab] if args.lab else None
        rows = grade([from_caller(a) for a in args.archives], from_caller(args.out), ROOT,
                     args.timeout, labs, budget=args.budget, unsafe=args.unsafe, jobs=args.jobs)
    except (GradingError, NotACheckout, ValueError) as exc:
        print(f"grade: {exc}", file=sys.stderr)
        return 1
    failed = [row for row in rows if not row.graded]
    if failed:
        print(f"grade: {len(failed)} of {len(rows)} archive(s) could not be graded: "
              + ", ".join(f"{row.submission} ({row.note})" for row in failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
