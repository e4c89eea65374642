"""The course's shared package: process groups (dist), the launcher (launch), timing (bench),
tables and plots (show), and the run mode below."""
from __future__ import annotations

import os


def smoke() -> bool:
    """COURSE_SMOKE=1 shrinks sizes and steps (CI and `./run.sh test`); students get full size."""
    return os.environ.get("COURSE_SMOKE", "") not in ("", "0")


def pick(full, small):
    """`full` normally, `small` in smoke mode: `steps = pick(200, 20)`."""
    return small if smoke() else full
