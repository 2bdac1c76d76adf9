"""Facts with one home (docs/architecture.md, "Where each fact lives"): each test fails when a fact is restated
elsewhere, or when two restatements of it disagree."""

from __future__ import annotations

import ast
import pathlib
import re

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
    sizes, strides = np.array([[4]]), np.array([[1]])  # one geometry class: 4 contiguous elements
    with pytest.raises(PlanBoundsError, match="box 1"):
        check_extents(np.array([0, 5]), np.array([0, 0]), sizes, strides, np.array([8, 8]), lambda i: f"box {i}")
    check_extents(np.array([0, 4]), np.array([0, 0]), sizes, strides, np.array([8, 8]), str)
    with pytest.raises(PlanBoundsError):  # below the tensor (a negative stride reaches back from the offset)
        check_extents(np.array([2]), np.array([0]), sizes, -strides, np.array([8]), str)
    # an empty box reaches nothing; a box past any tensor neither wraps nor passes
    check_extents(np.array([100]), np.array([0]), np.array([[0]]), strides, np.array([8]), str)
    with pytest.raises(PlanBoundsError):
        check_extents(np.array([0]), np.array([0]), np.array([[3, 3]]), np.array([[1 << 62, 1 << 62]]), [8], str)


def test_load_and_replay_check_boxes_through_check_extents(monkeypatch):
    # the columnar load (plan/file/rank.py) and replay/apply (runtime/segments.py) call the one rule, not their own
    from planfile_helpers import rich_bytes

    from shardplan.plan.file import bounds, rank
    from shardplan.plan.file.format import PlanFile, decode
    from shardplan.runtime import segments
    from shardplan.runtime.apply import Applier, params_from_plan
    from shardplan.runtime.replay import Replayer

    boxes = []

    def spy(offset, *rest):
        boxes.append(len(offset))
        return bounds.check_extents(offset, *rest)

    for module in (rank, segments):
        monkeypatch.setattr(module, "check_extents", spy)
    plan_file = PlanFile(*decode(rich_bytes(), "x.plan"), "x.plan")
    plan = plan_file.rank(0)
    assert sum(boxes) >= 2 * 3, boxes  # load: the three layers' pure-view writes, destination and source
    at_load = len(boxes)
    replayer = Replayer(plan, plan_file.sources)
    assert len(boxes) > at_load
    at_replay = len(boxes)
    Applier(plan, replayer.layout, params_from_plan(plan), fallback_loader=lambda name, tensor: None)
    assert len(boxes) > at_replay


# a comparison of a box's reach with its tensor's size outside plan/file/bounds.py is a second bounds rule
_EXTENT = re.compile(r"(^|_)(offset|reach|hi|extent)s?($|_)")
# simplify._as_box: whether a region is a box of a shape; unwritten: whether a write is one contiguous run. Not checks
_EXTENT_EXCEPTIONS = {"plan/compile/simplify.py", "plan/unwritten.py"}


def test_no_second_box_bounds_rule():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "plan/file/bounds.py" or rel in _EXTENT_EXCEPTIONS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            words = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            words |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            if any("numel" in w for w in words) and any(_EXTENT.search(w) for w in words):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "box bounds checked outside plan/file/bounds.py (call check_extents):\n" + "\n".join(found)
