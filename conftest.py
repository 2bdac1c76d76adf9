"""The suite's time guard (every pytest run from the repository root: tests/, notebooks/).

A test may take at most SHARDPLAN_TEST_BUDGET_S seconds (default 90), setup, call and teardown together: a module's
shared engine starts in its first test's setup, so that test carries it. A test that needs longer says how long and
why: `@pytest.mark.budget(seconds, reason="...")`. At the end the run prints every test over its budget and fails,
even when every test passed: a suite that only grows would otherwise pass CI's limit unnoticed. The budgets leave
about 2x headroom over a 2-core box's time, so a busy machine does not fail a run; SHARDPLAN_TEST_BUDGET_S=0 turns
the guard off (profiling, a much slower machine).
"""

from __future__ import annotations

import os

import pytest

DEFAULT_BUDGET_S = 90.0
# notebooks carry no markers: theirs, by path
NOTEBOOK_BUDGETS = {
    "notebooks/02-rl-loop-live-engine.ipynb": (150, "a live vLLM engine, a trainer process and fresh engines"),
    "notebooks/03-fleet-simulation.ipynb": (150, "simulates Kimi-K2 and Qwen3-235B fleets at published scales"),
}


def budget_s() -> float:
    return float(os.environ.get("SHARDPLAN_TEST_BUDGET_S", DEFAULT_BUDGET_S))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "budget(seconds, reason): this test may take up to `seconds` (setup + call + teardown) instead of the "
        "suite's default budget, for the reason given (conftest.py)",
    )
    config._budget_times = {}  # nodeid -> [seconds so far, budget]


def pytest_collection_modifyitems(items):
    for item in items:
        budget = NOTEBOOK_BUDGETS.get(item.nodeid.split("::")[0])
        if budget is not None:
            item.add_marker(pytest.mark.budget(budget[0], reason=budget[1]))


def _budget_of(item) -> float:
    marker = item.get_closest_marker("budget")
    if marker is None:
        return budget_s()
    seconds = marker.args[0] if marker.args else marker.kwargs.get("seconds")
    if not isinstance(seconds, (int, float)) or seconds <= 0 or not marker.kwargs.get("reason"):
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.budget needs seconds > 0 and a reason=...")
    return float(seconds)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "setup":  # carried to the controller under pytest-xdist
        outcome.get_result().user_properties.append(("budget_s", _budget_of(item)))


_CONFIG: dict = {}


def pytest_sessionstart(session):
    _CONFIG["config"] = session.config


def pytest_runtest_logreport(report):
    config = _CONFIG.get("config")
    if config is None:
        return
    entry = config._budget_times.setdefault(report.nodeid, [0.0, budget_s()])
    entry[0] += report.duration
    for key, value in report.user_properties:
        if key == "budget_s":
            entry[1] = value


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    if budget_s() <= 0 or hasattr(session.config, "workerinput"):  # under pytest-xdist the controller judges
        return
    over = sorted(
        ((seconds, budget, nodeid) for nodeid, (seconds, budget) in session.config._budget_times.items()),
        reverse=True,
    )
    session.config._budget_over = [(s, b, n) for s, b, n in over if s > b]
    if session.config._budget_over and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    over = getattr(config, "_budget_over", [])
    if over:
        terminalreporter.section("tests over their time budget (conftest.py)", red=True)
        for seconds, budget, nodeid in over:
            terminalreporter.write_line(f"{seconds:7.1f} s > {budget:5.0f} s  {nodeid}")
        terminalreporter.write_line(
            "Make the test cheaper, or mark it @pytest.mark.budget(seconds, reason=...) saying why it needs longer."
        )
