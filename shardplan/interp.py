"""Reference interpreter of the plan IR: the executable meaning of every record, one write at a time.

It is the oracle the batched runtime (replay.py / apply.py) is tested against, and what `shardplan verify` replays.
Only ops named in `ir.ALLOWED_OPS` can run: a plan names operations, it never carries code.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from . import ir
from .errors import ShardplanError


class PlanOpError(ShardplanError):
    pass


def resolve_op(name: str) -> Callable:
    if name not in ir.ALLOWED_OPS:
        raise PlanOpError(f"op {name!r} is not in shardplan's allowlist; the plan is corrupt or from a newer "
                          f"shardplan. Re-record it with `shardplan record`.")
    owner, attr = name.split(".", 1)
    return getattr(torch.Tensor if owner == "Tensor" else torch, attr)


def _literal(lit, inputs: list[torch.Tensor], device):
    if isinstance(lit, ir.Arg):
        return inputs[lit.index]
    if isinstance(lit, ir.DType):
        return getattr(torch, lit.name)
    if isinstance(lit, ir.Slice):
        return slice(lit.start, lit.stop, lit.step)
    if isinstance(lit, ir.Const):
        return torch.tensor(lit.values, dtype=getattr(torch, lit.dtype), device=device).reshape(lit.shape)
    if isinstance(lit, tuple):
        return tuple(_literal(x, inputs, device) for x in lit)
    return lit


def eval_leaf(leaf: ir.Leaf, tensors: Mapping[str, torch.Tensor], device=None) -> torch.Tensor:
    if isinstance(leaf, ir.Source):
        return tensors[leaf.name]
    if isinstance(leaf, ir.Full):
        return torch.full(leaf.sizes, leaf.value, dtype=getattr(torch, leaf.dtype), device=device)
    if isinstance(leaf, ir.Call):
        inputs = [eval_view(v, tensors, device) for v in leaf.inputs]
        device = inputs[0].device if inputs else device
        out = resolve_op(leaf.op)(*[_literal(a, inputs, device) for a in leaf.args],
                                  **{k: _literal(v, inputs, device) for k, v in leaf.kwargs})
        return out if leaf.out is None else out[leaf.out]
    if isinstance(leaf, ir.Update):
        base = eval_leaf(leaf.base, tensors, device).clone()
        value = eval_view(leaf.value, tensors, device)
        base.as_strided(leaf.region.sizes, leaf.region.strides, leaf.region.offset).copy_(value)
        return base
    raise PlanOpError(f"not a plan leaf: {leaf!r}")


def eval_view(view: ir.View, tensors: Mapping[str, torch.Tensor], device=None) -> torch.Tensor:
    r = view.region
    base = eval_leaf(view.leaf, tensors, device)
    return base.as_strided(r.sizes, r.strides, base.storage_offset() + r.offset)


def apply_write(write: ir.Write, params: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    param = params[write.param]
    dst = param.as_strided(write.dst.sizes, write.dst.strides, param.storage_offset() + write.dst.offset)
    dst.copy_(eval_view(write.src, tensors, param.device))


def run_plan(plan: ir.RankPlan, params: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for w in plan.writes:
            apply_write(w, params, tensors)
