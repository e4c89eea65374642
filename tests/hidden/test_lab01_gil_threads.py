"""Hidden tests of exercise `parallel_map`: edge cases and the systems property, that "thread"
runs up to `workers` items at the same time in threads of this process and "process" in other
processes, with other worker counts than the public tests. Barriers prove concurrency without
timing anything: they only open when `workers` items wait at the same time (the timeouts are there
so a wrong answer fails instead of hanging); the barrier runs are the public tests'
(`meet_in_threads`, `meet_in_processes`).
"""
import os
import threading

import pytest

from labs.lab01_gil_threads import (
    KINDS, io_work, matmul_work, parallel_map, python_work, tiny_ops_work, where_am_i,
)
from tests.public.test_lab01_gil_threads import meet_in_processes, meet_in_threads

pytestmark = pytest.mark.exercise("parallel_map")


@pytest.mark.parametrize("kind", KINDS)
def test_empty_items_give_an_empty_list(kind):
    """No items give an empty result list, for every kind."""
    assert parallel_map(python_work, [], 3, kind) == [], f"kind={kind!r}: no items, no results"


@pytest.mark.parametrize("kind", KINDS)
def test_any_iterable_and_more_workers_than_items(kind):
    """Any iterable works (a generator too), and more workers than items, for every kind."""
    items = ((seed, 500) for seed in range(3))  # a generator, consumed once
    assert parallel_map(python_work, items, 8, kind) == [python_work((s, 500)) for s in range(3)], (
        f"kind={kind!r}: a generator of items, more workers than items")


@pytest.mark.points(2)
@pytest.mark.parametrize("kind", ["thread", "process"])
def test_torch_workloads_match_serial_exactly(kind):
    """Torch workloads give bit-for-bit the serial results, with threads and with processes."""
    # one intra-op thread per call makes every result bit-for-bit reproducible: tolerance 0
    matmuls = [(seed, 2, 64) for seed in range(6)]
    tiny = [(seed, 50) for seed in range(6)]
    assert parallel_map(matmul_work, matmuls, 3, kind) == [matmul_work(i) for i in matmuls], (
        f"kind={kind!r}: matmul_work results differ from serial")
    assert parallel_map(tiny_ops_work, tiny, 3, kind) == [tiny_ops_work(i) for i in tiny], (
        f"kind={kind!r}: tiny_ops_work results differ from serial")


def test_many_items_keep_their_order_in_processes():
    """Many items in processes all come back, in input order."""
    items = [(seed, 10) for seed in range(500)]
    assert parallel_map(python_work, items, 2, "process") == [python_work(i) for i in items], (
        "500 items in processes: results differ or out of order")


def test_order_kept_when_later_items_finish_first_in_processes():
    """Results stay in input order in processes even when later items finish first."""
    items = [(seed, 0.3 - 0.1 * seed) for seed in range(3)]
    assert parallel_map(io_work, items, 3, "process") == [0, 1, 2], "results out of order"


@pytest.mark.parametrize("kind", KINDS)
def test_an_error_in_a_later_item_propagates_with_its_type(kind):
    """An error raised by a later item reaches the caller with its own type, for every kind."""
    with pytest.raises(ValueError, match="invalid literal"):
        parallel_map(int, ["1", "2", "3", "4", "5", "x"], 2, kind)


@pytest.mark.parametrize("workers", [0, -1, 1.5, "2", None])
@pytest.mark.parametrize("kind", KINDS)
def test_bad_workers_raise_before_any_work(kind, workers):
    """Invalid `workers` values are rejected before any item runs, for every kind."""
    calls = []
    with pytest.raises(ValueError):
        parallel_map(calls.append, [1, 2], workers, kind)
    assert calls == [], "bad arguments must raise before any item runs"


@pytest.mark.parametrize("kind", ["", "threads", "Process", None, "mpi"])
def test_bad_kind_raises_before_any_work(kind):
    """An unknown or misspelled `kind` is rejected before any item runs."""
    calls = []
    with pytest.raises(ValueError):
        parallel_map(calls.append, [1, 2], 2, kind)
    assert calls == [], "bad arguments must raise before any item runs"


def test_serial_runs_in_this_thread():
    """kind="serial" runs every item in the calling thread."""
    here = (os.getpid(), threading.current_thread().name)
    assert {tuple(r[1:]) for r in parallel_map(where_am_i, range(4), 2, "serial")} == {here}, (
        'kind="serial" must run every item in the calling thread')


def test_threads_run_in_this_process_off_the_calling_thread():
    """kind="thread" runs items in this process, off the calling thread, on at most `workers` threads."""
    results = parallel_map(where_am_i, range(6), 2, "thread")
    assert [r[0] for r in results] == list(range(6)), "results out of order"
    assert {r[1] for r in results} == {os.getpid()}, 'kind="thread" ran items in another process'
    assert threading.current_thread().name not in {r[2] for r in results}, (
        'kind="thread" ran items in the calling thread')
    assert len({r[2] for r in results}) <= 2, "more threads than workers=2"


@pytest.mark.points(2)
@pytest.mark.parametrize("workers", [3, 4])
def test_threads_run_workers_items_at_once_and_no_more(workers):
    """kind="thread" runs exactly `workers` items at the same time, never more, for other worker counts."""
    try:
        results, peak = meet_in_threads(workers)
    except threading.BrokenBarrierError:
        pytest.fail(f'kind="thread" never ran {workers} items at the same time')
    assert [r[0] for r in results] == list(range(2 * workers)), "results differ or out of order"
    assert peak == workers, f"{peak} items ran at once with workers={workers}"


def test_processes_run_in_other_processes():
    """kind="process" runs items in other processes, at most `workers` of them, results in order."""
    results = parallel_map(where_am_i, range(9), 3, "process")
    assert [r[0] for r in results] == list(range(9)), "results out of order"
    pids = {r[1] for r in results}
    assert os.getpid() not in pids, 'kind="process" ran items in this process'
    assert 1 <= len(pids) <= 3, f"{len(pids)} worker processes for workers=3"


@pytest.mark.points(2)
def test_three_processes_run_three_items_at_once():
    """kind="process" with more workers really runs `workers` items at the same time."""
    try:
        got = sorted(meet_in_processes(3))
    except threading.BrokenBarrierError:
        pytest.fail('kind="process" never ran 3 items at the same time with workers=3')
    assert got == [0, 1, 2], "Barrier.wait returns a distinct index per waiting process"
