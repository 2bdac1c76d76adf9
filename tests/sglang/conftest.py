"""Tests that need SGLang: they run in .venv-sglang (`make test-sglang`, part of `make test`); the vLLM venv's run
skips this folder (tests/conftest.py). The built-ins' shrink overrides are the vLLM tests' own (one home)."""

from __future__ import annotations

import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "integration"))
os.environ.setdefault("SHARDPLAN_NAMES_CACHE", "0")
