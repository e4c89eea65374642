"""How long one full submission takes to grade: the benchmark behind the grader's speed target.

Run:  .venv/bin/python benchmarks/grade_speed.py            (every lab; about a minute or two)
      .venv/bin/python benchmarks/grade_speed.py --lab 04   (one lab)

It packs this checkout's labs (the instructor's solutions, so every test runs to its end) into a
submission archive as `./run.sh submit` would, grades it with `homework.grade` exactly as
`./run.sh grade` does (sandboxes, canaries, the default shards), and prints the seconds it took,
the score, and this machine's `import torch` time (CPU seconds), the figure to compare machines by:
the target, about 60 s for a full submission on a 2-core machine, was set where that import costs
about 2 CPU-s. A benchmark, not a test: these machines are shared, so its numbers are read, not
asserted. Needs what grading needs (bubblewrap; `./run.sh test` installs it where it can).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from homework.archive import pack  # noqa: E402
from homework.grade import SHARDS, grade  # noqa: E402


def import_torch_cpu_seconds() -> float:
    """CPU seconds (user + system) a fresh `python -c "import torch"` costs on this machine now."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lab", action="append", default=None, help="grade only lab NN (repeat)")
    parser.add_argument("--shards", type=int, default=SHARDS, help="pytest runs at once per submission")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="grade-speed-") as tmp:
        files = {f"labs/{p.name}": p.read_bytes() for p in sorted((ROOT / "labs").glob("*.py"))}
        files["manifest.json"] = json.dumps({"student": "benchmark"}).encode()
        archive = pack(files, Path(tmp) / "benchmark-1.tar.gz", time.time())
        torch_s = import_torch_cpu_seconds()
        start = time.monotonic()
        rows = grade([archive], Path(tmp) / "out", ROOT, labs=args.lab, shards=args.shards,
                     log=lambda *a: None)
        seconds = time.monotonic() - start
    row = rows[0]
    failed = [nodeid for nodeid, outcome in row.outcomes.items() if not outcome.passed]
    print(f"one submission, {'labs ' + ' '.join(args.lab) if args.lab else 'every lab'}: "
          f"{len(row.outcomes)} tests, {row.score:g}/{row.max_score:g} points, "
          f"{seconds:.0f} s in all ({row.seconds:.0f} s grading it, {args.shards} runs at once); "
          f"`import torch` costs {torch_s:.2f} CPU-s here")
    if failed or row.note:
        print(f"not a clean run: {row.note} {failed[:5]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
