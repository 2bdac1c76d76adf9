"""Shared test configuration: hypothesis profiles.

HYPOTHESIS_PROFILE=ci (the default) keeps the recorder's architecture property tests within a few minutes on a
2-core machine; HYPOTHESIS_PROFILE=thorough draws many more layouts, ranks and dtypes per architecture. Tests that
build vLLM models ask `archs.examples(ci=..., thorough=...)` for their example budget; the profiles themselves only set
what every test here wants (no deadline: model builds and vLLM config creation take seconds on a loaded machine), so
tests that pin their own `max_examples` are unaffected by the choice of profile.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", **_COMMON)
settings.register_profile("thorough", max_examples=500, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
