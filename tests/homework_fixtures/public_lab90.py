"""Public tests of the fixture lab 90 (copied to tests/public/test_lab90_fixture.py)."""
import pytest

from labs.lab90_fixture import RunningMean, add_vectors


@pytest.mark.exercise("add_vectors")
def test_add_vectors_small():
    """Two short lists of integers."""
    assert add_vectors([1, 2], [3, 4]) == [4.0, 6.0], "add_vectors([1, 2], [3, 4]) should be [4.0, 6.0]"


@pytest.mark.exercise("RunningMean.push")
def test_running_mean_two_values():
    mean = RunningMean()
    mean.push(2)
    assert mean.push(4) == 3.0, "the mean of 2 and 4 should be 3.0"
