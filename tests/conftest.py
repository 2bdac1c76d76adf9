"""Shared test configuration: hypothesis profiles.

HYPOTHESIS_PROFILE=ci (the default) keeps the recorder's architecture property tests within a few minutes on a
2-core machine; HYPOTHESIS_PROFILE=thorough draws many more layouts, ranks and dtypes per architecture;
HYPOTHESIS_PROFILE=fast (`make test-fast`) caps every property test at a few examples. Tests that build vLLM models
ask `archs.examples(ci=..., thorough=...)` for their example budget; the ci and thorough profiles only set what every
test here wants (no deadline: model builds and vLLM config creation take seconds on a loaded machine), so tests that
pin their own `max_examples` keep it under them.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", **_COMMON)
settings.register_profile("thorough", max_examples=500, **_COMMON)
# `make test-fast`: every property test at most FAST_EXAMPLES examples, also those that pin their own budget
FAST_EXAMPLES = 10
settings.register_profile("fast", max_examples=FAST_EXAMPLES, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    """Under the `fast` profile, cap the budget a test pinned with @settings(max_examples=N): a profile only sets
    what a test leaves unset. Hypothesis reads the settings from this attribute of the test when it runs."""
    if settings._current_profile != "fast":
        return
    for item in items:
        test = getattr(item, "obj", None)
        pinned = getattr(test, "_hypothesis_internal_use_settings", None)
        if pinned is not None and pinned.max_examples > FAST_EXAMPLES:
            test._hypothesis_internal_use_settings = settings(pinned, max_examples=FAST_EXAMPLES)


# The on-disk checkpoint-names cache (record/checkpoint.py) would carry one test's listing into another (and across
# runs): a list cached by a recording inside a vLLM config context is served where a test expects the build itself to
# run (and fail by name). Tests build names afresh; tests/integration/test_models.py turns the cache on where it is
# the subject.
os.environ.setdefault("SHARDPLAN_NAMES_CACHE", "0")

# tests/sglang needs SGLang, which lives in its own venv (.venv-sglang: its torch pin cannot share vLLM's); `make test`
# runs that folder there (`make test-sglang`). Anywhere SGLang is not installed the folder is not collected.
# (asked of the installed distributions: a module spec would find tests/sglang itself, which pytest's rootdir
# insertion puts on sys.path as a namespace package "sglang")
import importlib.metadata  # noqa: E402


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


collect_ignore = [] if _installed("sglang") else ["sglang"]
