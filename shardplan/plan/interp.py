"""The meaning of the plan IR: the reference interpreter every fast path is tested against.

`apply_reference(plan, tensors, params)` runs a rank's writes one at a time, in order, on real tensors: what vLLM's
loader did, replayed. The recorder's verify and every runtime test compare against it, so it is kept small and
obvious, and it sits at the bottom of the package (torch and `shardplan.plan.ir` only).
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from shardplan.errors import DisallowedOpError, MissingTensorError, PlanError
from shardplan.plan import ir


# ---- reference interpreter ------------------------------------------------------------------------------------
def resolve_op(name: str) -> Callable:
    """The callable for an op name, through the allowlist only: "Tensor.x" -> torch.Tensor.x, "torch.x" -> torch.x."""
    if name not in ir.ALLOWED_OPS:
        raise DisallowedOpError(f"op {name!r} is not in shardplan.plan.ir.ALLOWED_OPS; a plan may only name allowlisted "
                                f"ops: re-record the plan, or extend the allowlist if the op is a pure tensor op")
    owner, _, attr = name.partition(".")
    fn = getattr(torch.Tensor if owner == "Tensor" else torch, attr, None)
    if fn is None:
        raise DisallowedOpError(f"op {name!r} is allowlisted but torch {torch.__version__} has no such function")
    return fn


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise PlanError(f"unknown dtype name {name!r} in plan (expected a torch dtype name such as 'bfloat16')")
    return dtype


def region_view(base: torch.Tensor, region: ir.Region) -> torch.Tensor:
    """`base.as_strided(region)` with the region's offset taken relative to `base` (as_strided's is absolute)."""
    return base.as_strided(region.sizes, region.strides, base.storage_offset() + region.offset)


def eval_view(view: ir.View, tensors: Mapping[str, torch.Tensor], device: torch.device | str | None = None
              ) -> torch.Tensor:
    """Reference semantics of `View`: evaluate the leaf, take the region of its storage (relative to the leaf's own
    storage offset). Source leaves are contiguous tensors of the plan's shape; a Call result is addressed the way the
    recorder saw it (the op's own output strides), as the recorder saw it."""
    return region_view(eval_leaf(view.leaf, tensors, device), view.region)


def eval_leaf(leaf: ir.Leaf, tensors: Mapping[str, torch.Tensor], device: torch.device | str | None = None
              ) -> torch.Tensor:
    if device is None:
        device = next((t.device for t in tensors.values()), torch.device("cpu"))
    if isinstance(leaf, ir.Source):
        if leaf.name not in tensors:
            raise MissingTensorError(f"trainer tensor {leaf.name!r} is missing: the plan reads it")
        return tensors[leaf.name]
    if isinstance(leaf, ir.Full):
        return torch.full(leaf.sizes, leaf.value, dtype=to_dtype(leaf.dtype), device=device)
    if isinstance(leaf, ir.Call):
        inputs = [eval_view(v, tensors, device) for v in leaf.inputs]
        args = [_literal(a, inputs, device) for a in leaf.args]
        kwargs = {k: _literal(v, inputs, device) for k, v in leaf.kwargs}
        result = resolve_op(leaf.op)(*args, **kwargs)
        return result if leaf.out is None else result[leaf.out]
    if isinstance(leaf, ir.Update):
        base = eval_leaf(leaf.base, tensors, device).clone()
        region_view(base, leaf.region).copy_(eval_view(leaf.value, tensors, device))
        return base
    raise PlanError(f"not a plan leaf: {leaf!r}")


def _literal(lit, inputs: list[torch.Tensor], device):
    if isinstance(lit, ir.Arg):
        return inputs[lit.index]
    if isinstance(lit, ir.DType):
        return to_dtype(lit.name)
    if isinstance(lit, ir.Slice):
        return slice(lit.start, lit.stop, lit.step)
    if isinstance(lit, ir.Const):
        return torch.tensor(lit.values, dtype=to_dtype(lit.dtype), device=device).reshape(lit.shape)
    if isinstance(lit, tuple):
        return tuple(_literal(x, inputs, device) for x in lit)
    return lit  # None, bool, int, float, str, Ellipsis


def write_source(write: ir.Write, dtype: torch.dtype, tensors: Mapping[str, torch.Tensor], device=None
                 ) -> torch.Tensor:
    """The bytes a write puts into its destination: src evaluated, broadcast to dst sizes, in the dst dtype."""
    return eval_view(write.src, tensors, device).to(dtype).expand(write.dst.sizes)


def apply_reference(plan: ir.RankPlan, tensors: Mapping[str, torch.Tensor],
                    params: Mapping[str, torch.Tensor]) -> None:
    """The plan's meaning, one write at a time, in order: what every fast path must reproduce bit for bit."""
    with torch.no_grad():
        for w in plan.writes:
            region_view(params[w.param], w.dst).copy_(eval_view(w.src, tensors, params[w.param].device))

