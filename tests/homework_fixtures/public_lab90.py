"""Public tests of the fixture lab 90 (copied to tests/public/test_lab90_fixture.py)."""
import pytest

from labs.lab90_fixture import RunningMean, add_vectors, same_list


@pytest.mark.exercise("add_vectors")
def test_add_vectors_small():
    """Two short lists of integers."""
    first = [1, 2]
    result = add_vectors(first, [3, 4])
    assert result == [4.0, 6.0], "add_vectors([1, 2], [3, 4]) should be [4.0, 6.0]"
    assert not same_list(result, first), "add_vectors returned its first input, changed: return a new list"


@pytest.mark.exercise("RunningMean.push")
def test_running_mean_two_values():
    mean = RunningMean()
    mean.push(2)
    assert mean.push(4) == 3.0, "the mean of 2 and 4 should be 3.0"
