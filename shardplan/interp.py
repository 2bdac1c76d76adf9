"""Reference interpreter of the plan IR: the executable meaning of every record, one write at a time.

One implementation serves both sides: it lives in `shardplan.replay` (eval_leaf / eval_view / resolve_op /
apply_reference, which the batched runtime is tested against). This module keeps the recorder side's entry point,
`run_plan(plan, params, tensors)`, used by `shardplan verify` and the recorder tests.
"""
from __future__ import annotations

from typing import Mapping

import torch

from . import ir
from .replay import apply_reference, eval_leaf, eval_view, resolve_op  # noqa: F401  (re-exported)


def run_plan(plan: ir.RankPlan, params: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    apply_reference(plan, tensors, params)
