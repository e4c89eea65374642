"""Wires the test harness (tests/harness.py) into pytest; the machinery lives there."""
from __future__ import annotations

import pytest

from tests import harness


def pytest_configure(config) -> None:
    # nbmake's items live in notebooks/, where a conftest.py in tests/ has no hooks: a plugin
    config.pluginmanager.register(harness.NotebookLaunches(), "course-notebook-launches")
    harness.watch_exercises()  # before the test files import the labs


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    harness.locate_failure(item, call, outcome.get_result())


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the groups into node ids
def pytest_collection_modifyitems(config, items) -> None:
    harness.group_and_order(config, items)
