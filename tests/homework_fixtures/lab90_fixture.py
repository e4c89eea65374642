"""Lab 90: a fixture of tests/test_homework.py, not a lesson. Two tiny exercises, no torch.

Run: ./run.sh 90 (there is nothing to see: the tests call these functions directly)
"""
from __future__ import annotations


def add_vectors(a: list[float], b: list[float]) -> list[float]:
    """Return the element-wise sum of two lists of equal length, as a new list of floats.

    Lists of different lengths raise ValueError (done for you above the block).
    """
    if len(a) != len(b):
        raise ValueError(f"lengths differ: {len(a)} != {len(b)}")
    ### BEGIN SOLUTION
    summed = [float(x) + float(y) for x, y in zip(a, b)]  # fixture solution, add_vectors
    return summed
    ### END SOLUTION


def same_list(x: list, y: list) -> bool:
    """The instrument the tests read: are `x` and `y` one list object (not equal lists)?"""
    return x is y


class RunningMean:
    """The mean of the values pushed so far."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0

    def push(self, value: float) -> float:
        """Add `value` and return the mean of all the values pushed so far."""
        ### BEGIN SOLUTION
        self.count += 1
        self.total += float(value)  # fixture solution, RunningMean.push
        ### END SOLUTION
        return self.total / self.count
