"""Facts with one home (docs/architecture.md, "Where each fact lives"): each test fails when a fact is restated
elsewhere, or when two restatements of it disagree."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest
import torch

from shardplan.errors import PlanError
from shardplan.plan import ir
from shardplan.plan.file import checks
from shardplan.plan.file.bounds import check_extents
from shardplan.plan.file.errors import PlanBoundsError, PlanFileError

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "shardplan"
# record/checkpoint.py filters on-disk names by a `^model.layers.N.` prefix: a checkpoint-file fact, not the parser
NAME_PATTERN_EXCEPTIONS = {"record/checkpoint.py"}


def _string_constants(tree: ast.Module):
    """String literals that are not docstrings."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node


def test_dtype_set_is_the_itemsize_table():
    # the plan-file check accepts exactly the dtypes ir.itemsize knows (float8_e8m0fnu included), and each is the
    # torch dtype of that name and size
    assert checks.TENSOR_DTYPES == set(ir.ITEMSIZE)
    assert "float8_e8m0fnu" in checks.TENSOR_DTYPES
    for name, size in ir.ITEMSIZE.items():
        assert getattr(torch, name).itemsize == size, name
    assert set(checks.MODEL_DTYPES) <= checks.TENSOR_DTYPES


def test_name_patterns_live_in_names_py():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "plan/names.py" or rel in NAME_PATTERN_EXCEPTIONS:
            continue
        for node in _string_constants(ast.parse(path.read_text())):
            text = node.value
            if "_scale_inv" in text or "experts\\." in text or "layers\\." in text:
                bad.append(f"{rel}:{node.lineno}: {text!r}")
    assert not bad, "name parsing outside plan/names.py (use its functions):\n" + "\n".join(bad)


def test_one_bounds_error_at_load_and_at_replay():
    assert issubclass(PlanBoundsError, PlanFileError) and issubclass(PlanBoundsError, PlanError)
    with pytest.raises(PlanBoundsError, match="box 1"):
        check_extents(
            np.array([0, 4]), np.array([4, 9]), np.array([False, False]), np.array([8, 8]), lambda i: f"box {i}"
        )
    check_extents(np.array([0, 4]), np.array([4, 8]), np.array([False, False]), np.array([8, 8]), str)
    # an empty box reaches nothing
    check_extents(np.array([100]), np.array([100]), np.array([True]), np.array([8]), str)
