"""Public tests of exercise `parallel_map` (labs/lab01_gil_threads.py). Run them with
`.venv/bin/python -m pytest tests/public/test_lab01_gil_threads.py -q`.

They check results and order against the serial reference, errors and bad arguments; never speed.
"""
import functools
import operator

import pytest

from labs.lab01_gil_threads import KINDS, io_work, parallel_map, python_work

pytestmark = pytest.mark.exercise("parallel_map")


@pytest.mark.parametrize("kind", KINDS)
def test_same_results_as_serial(kind):
    items = [(seed, 2_000 + seed) for seed in range(10)]
    expected = [python_work(item) for item in items]
    assert parallel_map(python_work, items, 2, kind) == expected


@pytest.mark.parametrize("kind", KINDS)
def test_results_come_back_in_input_order(kind):
    # item 0 waits longest, so with 4 workers the later items finish first
    items = [(seed, 0.2 - 0.05 * seed) for seed in range(4)]
    assert parallel_map(io_work, items, 4, kind) == [0, 1, 2, 3]


@pytest.mark.parametrize("kind", KINDS)
def test_errors_propagate(kind):
    one_over = functools.partial(operator.truediv, 1.0)  # picklable: works in processes too
    with pytest.raises(ZeroDivisionError):
        parallel_map(one_over, [1.0, 2.0, 0.0, 4.0], 2, kind)


def test_bad_kind_raises_value_error():
    with pytest.raises(ValueError):
        parallel_map(abs, [1, -2], 2, "fibers")


@pytest.mark.parametrize("kind", KINDS)
def test_workers_below_one_raise_value_error(kind):
    with pytest.raises(ValueError):
        parallel_map(abs, [1, -2], 0, kind)
