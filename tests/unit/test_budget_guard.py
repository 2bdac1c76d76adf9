"""The suite's time guard (the repository's conftest.py): a test over its budget fails the run even when every test
passed, names itself and its time; a `budget` marker with a reason lets it take longer; a marker without a reason is
refused."""

from __future__ import annotations

import pathlib

pytest_plugins = ["pytester"]
GUARD = (pathlib.Path(__file__).resolve().parents[2] / "conftest.py").read_text()

SUITE = """
import time
import pytest

def test_quick():
    pass

def test_slow():
    time.sleep(0.6)

@pytest.mark.budget(5, reason="sleeps on purpose")
def test_slow_with_a_reason():
    time.sleep(0.6)

@pytest.fixture(scope="module")
def engine():
    time.sleep(0.6)  # a shared start-up is carried by the first test that asks for it

def test_first_user(engine):
    pass

def test_second_user(engine):
    pass
"""


def test_a_test_over_its_budget_fails_the_run_and_is_named(pytester, monkeypatch):
    monkeypatch.setenv("SHARDPLAN_TEST_BUDGET_S", "0.3")
    pytester.makeconftest(GUARD)
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=5)
    assert result.ret == 1
    over = result.stdout.str().split("tests over their time budget", 1)[1]
    assert "test_suite.py::test_slow" in over and "test_suite.py::test_first_user" in over
    assert "test_slow_with_a_reason" not in over and "test_second_user" not in over and "test_quick" not in over


def test_the_controller_judges_under_xdist(pytester, monkeypatch):
    monkeypatch.setenv("SHARDPLAN_TEST_BUDGET_S", "0.3")
    pytester.makeconftest(GUARD)
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest("-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile")
    result.assert_outcomes(passed=5)
    assert result.ret == 1
    over = result.stdout.str().split("tests over their time budget", 1)[1]
    assert "test_suite.py::test_slow" in over and "test_slow_with_a_reason" not in over


def test_within_budget_the_run_passes(pytester, monkeypatch):
    monkeypatch.setenv("SHARDPLAN_TEST_BUDGET_S", "30")
    pytester.makeconftest(GUARD)
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=5)
    assert result.ret == 0 and "over their time budget" not in result.stdout.str()


def test_a_budget_marker_without_a_reason_is_refused(pytester):
    pytester.makeconftest(GUARD)
    pytester.makepyfile(test_bad="import pytest\n\n@pytest.mark.budget(100)\ndef test_x():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret != 0
    assert "needs seconds > 0 and a reason" in result.stdout.str() + result.stderr.str()
