"""The meaning of the plan IR: the reference interpreter every fast path is tested against.

`apply_reference(plan, tensors, params)` runs a rank's writes one at a time, in order, on real tensors: what vLLM's
loader did, replayed. The recorder's verify and every runtime test compare against it, so it is kept small and
obvious, and it sits at the bottom of the package (torch and `shardplan.plan.ir` only).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import torch

from shardplan.errors import DisallowedOpError, ForeignWriteError, MissingTensorError, PlanError, PlanTooLarge
from shardplan.plan import ir


# ---- reference interpreter ------------------------------------------------------------------------------------
def resolve_op(name: str) -> Callable:
    """The callable for an op name, through the allowlist only: "Tensor.x" -> torch.Tensor.x, "torch.x" -> torch.x."""
    if name not in ir.ALLOWED_OPS:
        raise DisallowedOpError(
            f"op {name!r} is not in shardplan.plan.ir.ALLOWED_OPS; a plan may only name allowlisted "
            f"ops: re-record the plan, or extend the allowlist if the op is a pure tensor op"
        )
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


def eval_view(
    view: ir.View,
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | str | None = None,
    limit: "Budget | None" = None,
) -> torch.Tensor:
    """Reference semantics of `View`: evaluate the leaf, take the region of its storage (relative to the leaf's own
    storage offset). Source leaves are contiguous tensors of the plan's shape; a Call result is addressed the way the
    recorder saw it (the op's own output strides), as the recorder saw it. `limit`: see check_write_sizes."""
    base = eval_leaf(view.leaf, tensors, device, limit)
    if limit is not None:  # on meta, as_strided does not check the storage bounds a real tensor's does
        lo, hi = view.region.extent()
        have = base.untyped_storage().nbytes() // base.element_size() - base.storage_offset()
        if view.region.numel and (lo < 0 or hi > have):
            raise PlanError(f"a view reads elements [{lo}, {hi}) of a value that has {have}")
    return region_view(base, view.region)


def eval_leaf(
    leaf: ir.Leaf,
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | str | None = None,
    limit: "Budget | None" = None,
) -> torch.Tensor:
    if device is None:
        device = next((t.device for t in tensors.values()), torch.device("cpu"))
    if isinstance(leaf, ir.Source):
        if leaf.name not in tensors:
            raise MissingTensorError(f"trainer tensor {leaf.name!r} is missing: the plan reads it")
        return tensors[leaf.name]
    if isinstance(leaf, ir.Full):
        if limit is not None:
            limit.take(
                math.prod(leaf.sizes),
                ir.itemsize(leaf.dtype) if leaf.dtype in ir.ITEMSIZE else 8,
                f"full({list(leaf.sizes)})",
            )
        return torch.full(leaf.sizes, leaf.value, dtype=to_dtype(leaf.dtype), device=device)
    if isinstance(leaf, ir.Call):
        # never into a tensor the plan did not make (plan files and Replayer refuse such a plan before this)
        if leaf.op in ir.INPLACE_OPS or any(key == "out" for key, _ in leaf.kwargs):
            target = ir.inplace_target(leaf)
            if target is None or any(key == "out" for key, _ in leaf.kwargs) or not ir.made_by_plan(target.leaf):
                raise ForeignWriteError(
                    f"refusing to replay {leaf.op}: it would write into a tensor the plan did not "
                    f"make ({ir.foreign_write(leaf)})"
                )
        inputs = [eval_view(v, tensors, device, limit) for v in leaf.inputs]
        args = [_literal(a, inputs, device) for a in leaf.args]
        kwargs = {k: _literal(v, inputs, device) for k, v in leaf.kwargs}
        fn = resolve_op(leaf.op)
        if limit is not None and leaf.op in ir.UNARY_OPS:  # elementwise: its shape rule, without torch's Python
            x = inputs[0]  # meta kernel for exp (a slow import on first use)
            result = torch.empty_like(x, dtype=x.dtype if x.is_floating_point() else torch.get_default_dtype())
        else:
            result = fn(*args, **kwargs)
        result = result if leaf.out is None else result[leaf.out]
        if limit is not None:
            if not isinstance(result, torch.Tensor):
                raise PlanError(f"{leaf.op} gives a {type(result).__name__}, not a tensor")
            limit.take(result.numel(), result.element_size(), leaf.op)
        return result
    if isinstance(leaf, ir.Update):
        base = eval_leaf(leaf.base, tensors, device, limit).clone()
        region_view(base, leaf.region).copy_(eval_view(leaf.value, tensors, device, limit))
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


# Tensors this small are never refused, whatever the plan declares (a toy plan's scratch may exceed its tiny params).
MIN_BUDGET = 1 << 20


class Budget:
    """What one computed write may make: each tensor at most `limit` elements; `peak` the bytes made in all."""

    def __init__(self, limit: int):
        self.limit, self.peak = limit, 0

    def take(self, numel: int, itemsize: int, what: str) -> None:
        if numel > self.limit:
            raise PlanTooLarge(
                f"{what} makes a tensor of {numel} elements, more than the {self.limit} this write may "
                f"(the elements its rank's params hold, or the sources it reads, whichever is more)"
            )
        self.peak += numel * itemsize


def check_write_sizes(write: ir.Write, sources: Mapping[str, ir.TensorMeta], rank_numel: int) -> int:
    """Sizes every tensor a computed write makes, before replay allocates any: evaluated on the meta device (shapes
    only), each op's output and constant must hold at most `max(rank_numel, elements of the sources it reads,
    MIN_BUDGET)` elements (`rank_numel`: what the rank's params hold; nothing a loader makes while loading exceeds
    both), each view
    must lie inside the value it views, and the result must broadcast to the destination. Returns the bytes the write
    makes in all (the bind checks them against the device). PlanTooLarge / PlanError name the op."""
    names = ir.sources(write.src.leaf)
    budget = Budget(max(rank_numel, sum(sources[n].numel for n in names), MIN_BUDGET))
    metas = {n: torch.empty(sources[n].shape, dtype=to_dtype(sources[n].dtype), device="meta") for n in names}
    with torch.no_grad():
        value = eval_view(write.src, metas, "meta", budget)
    try:
        broadcast = torch.broadcast_shapes(tuple(value.shape), tuple(write.dst.sizes)) == tuple(write.dst.sizes)
    except RuntimeError:
        broadcast = False
    if not broadcast:
        raise PlanError(
            f"the value's sizes {list(value.shape)} do not broadcast to the destination's {list(write.dst.sizes)}"
        )
    return budget.peak


def write_source(write: ir.Write, dtype: torch.dtype, tensors: Mapping[str, torch.Tensor], device=None) -> torch.Tensor:
    """The bytes a write puts into its destination: src evaluated, broadcast to dst sizes, in the dst dtype."""
    return eval_view(write.src, tensors, device).to(dtype).expand(write.dst.sizes)


def apply_reference(plan: ir.RankPlan, tensors: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> None:
    """The plan's meaning, one write at a time, in order: what every fast path must reproduce bit for bit."""
    with torch.no_grad():
        for w in plan.writes:
            region_view(params[w.param], w.dst).copy_(eval_view(w.src, tensors, params[w.param].device))
