"""Hidden tests of the fixture lab 90 (copied to tests/hidden/test_lab90_fixture.py)."""
import pytest

from labs.lab90_fixture import RunningMean, add_vectors, same_list


@pytest.mark.exercise("add_vectors")
@pytest.mark.points(2)
def test_add_vectors_edge_cases():
    """Empty lists and negative, fractional values."""
    hidden_expected_for_empty_lists = []
    assert add_vectors([], []) == hidden_expected_for_empty_lists, "empty lists should give []"
    assert add_vectors([-1.5], [0.5]) == [-1.0], "negative and fractional values"


@pytest.mark.exercise("add_vectors")
def test_add_vectors_returns_a_new_list():
    """The result is a new list, not one of the inputs."""
    first = [1.0, 2.0]
    assert not same_list(add_vectors(first, [0.0, 0.0]), first), "add_vectors must not return its input"


@pytest.mark.exercise("RunningMean.push")
@pytest.mark.points(2)
def test_running_mean_many_values():
    """The running mean after each of five values."""
    mean = RunningMean()
    values_pushed_by_the_hidden_test = [1, 2, 3, 4, 10]
    means = [mean.push(v) for v in values_pushed_by_the_hidden_test]
    assert means == [1.0, 1.5, 2.0, 2.5, 4.0], f"running means were {means}"
