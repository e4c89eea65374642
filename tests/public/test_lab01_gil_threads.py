"""Public tests of exercise `parallel_map` (labs/lab01_gil_threads.py). Run them with
`./run.sh check 01`.

They check results and order against the serial reference, errors and bad arguments, and the point
of the exercise: "thread" runs items at the same time in threads of this process, "process" in
other processes. Concurrency is proven with barriers, never with timings: a barrier for `workers`
parties opens only when `workers` items wait on it at the same time, so items run one after
another time out (after WAIT_S seconds) instead of passing.
"""
import functools
import multiprocessing
import operator
import os
import threading
import time

import pytest

from labs.lab01_gil_threads import KINDS, io_work, parallel_map, python_work, where_am_i

pytestmark = pytest.mark.exercise("parallel_map")
WAIT_S = 10  # barrier timeout: generous, only items that never run together reach it


@pytest.mark.parametrize("kind", KINDS)
def test_same_results_as_serial(kind):
    """Every kind returns the same results as [fn(item) for item in items]."""
    items = [(seed, 2_000 + seed) for seed in range(10)]
    expected = [python_work(item) for item in items]
    got = parallel_map(python_work, items, 2, kind)
    if got != expected and isinstance(got, list) and sorted(got) == sorted(expected):
        pytest.fail(f"kind={kind!r}: the right results in another order: results must follow the "
                    "order of the items, not the order in which they finished (collect them by "
                    "position, e.g. with pool.map)")
    assert got == expected, f"kind={kind!r}: results differ from [fn(item) for item in items]"


@pytest.mark.parametrize("kind", KINDS)
def test_results_come_back_in_input_order(kind):
    # item 0 waits longest, so with 4 workers the later items finish first
    """Results follow the order of the items, not the order in which the items finish."""
    items = [(seed, 0.2 - 0.05 * seed) for seed in range(4)]
    got = parallel_map(io_work, items, 4, kind)
    assert got == [0, 1, 2, 3], (
        f"kind={kind!r} returned {got}: results must follow the order of the items, not the "
        "order in which they finished (collect them by position, e.g. with pool.map)")


@pytest.mark.parametrize("kind", KINDS)
def test_errors_propagate(kind):
    """An exception that fn raises on an item reaches the caller, for every kind."""
    one_over = functools.partial(operator.truediv, 1.0)  # picklable: works in processes too
    try:
        got = parallel_map(one_over, [1.0, 2.0, 0.0, 4.0], 2, kind)
    except ZeroDivisionError:
        return
    except Exception as exc:
        pytest.fail(f"kind={kind!r}: fn raised ZeroDivisionError on item 2 and the caller got "
                    f"{type(exc).__name__} instead: let the worker's own exception propagate "
                    "(future.result() and pool.map re-raise it with its type)")
    pytest.fail(f"kind={kind!r}: fn raised ZeroDivisionError on item 2, yet parallel_map returned "
                f"{got!r}: an exception in a worker must reach the caller, not be swallowed")


def test_bad_kind_raises_value_error():
    """An unknown `kind` raises ValueError."""
    with pytest.raises(ValueError):
        parallel_map(abs, [1, -2], 2, "fibers")
        pytest.fail('kind="fibers" did not raise ValueError: check `kind` against KINDS before '
                    "any work starts")


@pytest.mark.parametrize("kind", KINDS)
def test_workers_below_one_raise_value_error(kind):
    """workers < 1 raises ValueError, for every kind."""
    with pytest.raises(ValueError):
        parallel_map(abs, [1, -2], 0, kind)
        pytest.fail(f"kind={kind!r}, workers=0 did not raise ValueError: check `workers` (an int "
                    ">= 1) for every kind, before any work starts")


def meet_in_threads(workers: int) -> tuple[list, int]:
    """parallel_map(kind="thread") over 2 * workers items that each wait at a Barrier(workers),
    which opens only when `workers` items wait at the same time: the results, (item, pid, thread
    id) each, and the most items that ran at once. Raises threading.BrokenBarrierError (after
    WAIT_S) when fewer than `workers` items ever run together."""
    barrier = threading.Barrier(workers, timeout=WAIT_S)
    lock = threading.Lock()
    running, peak = [0], [0]

    def meet(item):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        barrier.wait()  # BrokenBarrierError after WAIT_S if no other item runs meanwhile
        time.sleep(0.02)  # give a thread beyond `workers`, if any, the time to show up
        with lock:
            running[0] -= 1
        return item, os.getpid(), threading.get_ident()

    return parallel_map(meet, range(2 * workers), workers, "thread"), peak[0]


def meet_in_processes(workers: int) -> list:
    """parallel_map(kind="process") over `workers` items that each wait at a Barrier(workers)
    served by a manager process (wait() returns only when `workers` processes wait on it at the
    same time; operator.methodcaller and the proxy are picklable): what each wait returned, a
    distinct index per waiting process. Raises threading.BrokenBarrierError (after WAIT_S) when
    they never wait together."""
    with multiprocessing.Manager() as manager:
        barrier = manager.Barrier(workers, timeout=WAIT_S)
        return parallel_map(operator.methodcaller("wait"), [barrier] * workers, workers, "process")


def test_threads_run_items_at_the_same_time_in_this_process():
    """kind="thread" runs `workers` items at the same time, in worker threads of this process."""
    workers = 2
    where = parallel_map(where_am_i, range(4), workers, "thread")  # (item, pid, thread name)
    assert {r[1] for r in where} == {os.getpid()}, (
        'kind="thread" ran items in another process: threads live in the calling process')
    try:
        results, peak = meet_in_threads(workers)
    except threading.BrokenBarrierError:
        pytest.fail(f'kind="thread" with {workers} workers never ran {workers} items at the same '
                    "time (they ran one after another): run them in a pool of threads")
    assert [r[0] for r in results] == list(range(2 * workers)), "results out of order"
    assert threading.get_ident() not in {r[2] for r in results}, (
        'kind="thread" ran items in the calling thread: start worker threads')
    assert peak == workers, (
        f'kind="thread" with workers={workers} ran {peak} items at once: use exactly `workers` '
        "threads")


def test_processes_run_items_at_the_same_time_in_other_processes():
    """kind="process" runs `workers` items at the same time, in at most `workers` other processes."""
    workers = 2
    results = parallel_map(where_am_i, range(6), workers, "process")
    assert [r[0] for r in results] == list(range(6)), "results out of order"
    pids = {r[1] for r in results}
    assert os.getpid() not in pids, (
        'kind="process" ran items in this process: use a pool of worker processes '
        "(process_pool(workers))")
    assert len(pids) <= workers, f'kind="process" used {len(pids)} processes for workers={workers}'
    try:
        meet_in_processes(workers)
    except threading.BrokenBarrierError:
        pytest.fail(f'kind="process" with {workers} workers never ran {workers} items at the '
                    "same time (they ran one after another)")
