"""The course's shared package: process groups (dist), the launcher (launch), timing (bench),
tables and plots (show), and the run mode below."""
from __future__ import annotations


def smoke() -> bool:
    """COURSE_SMOKE=1 shrinks sizes and steps (CI and `./run.sh test`); students get full size."""
    from helpers.config import settings

    return settings().smoke


def pick(full, small):
    """`full` normally, `small` in smoke mode: `steps = pick(200, 20)`."""
    return small if smoke() else full
