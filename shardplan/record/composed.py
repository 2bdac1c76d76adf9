"""vLLM's `composed_weight_loader(loader, fn)`, recorded: the loader writes a parameter, then the value is computed
from the parameter itself (`param.data.copy_(fn(param))`; the Mamba family's A is `-torch.exp(A.float())`, Plamo3's
norms `x + offset`).

A plan cannot read parameters, and the recorder does not see torch calls on plain parameters. But right after
`loader(param, loaded)` the parameter's value is known exactly: the writes recorded into it so far. So for the length
of a recording, each such parameter's `weight_loader` is replaced by the same two steps, with `fn` applied to a
recording tensor holding that value (`Update`s of the writes over a constant). `fn`'s ops (float, exp,
neg, ...) are then recorded like any loader op, and `param.data.copy_(...)` becomes one computed write that replaces
the plain ones. A parameter the writes do not cover whole (its other elements would be whatever vLLM's torch.empty
left) stays a fallback, as before.

vLLM's helper is recognised by its module, qualified name and closure variables; anything else that reads a
parameter after loading it is still caught by `full.Recorder._param_write_without_source` (a fallback).
"""

from __future__ import annotations

import contextlib

import torch

from shardplan.plan import ir
from shardplan.record.recording import ValueRead, dtype_name
from shardplan.record.rectensor import RecTensor, storage_key

_MODULE = "vllm.model_executor.model_loader.weight_utils"
_QUALNAME = "composed_weight_loader.<locals>.composed_loader"


def composed_parts(weight_loader) -> tuple | None:
    """(loader, fn) of a loader made by vLLM's `composed_weight_loader`; None for any other function."""
    code = getattr(weight_loader, "__code__", None)
    if (
        code is None
        or getattr(weight_loader, "__module__", None) != _MODULE
        or getattr(weight_loader, "__qualname__", None) != _QUALNAME
        or sorted(code.co_freevars) != ["fn", "loader"]
    ):
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in weight_loader.__closure__)))
    return cells["loader"], cells["fn"]


@contextlib.contextmanager
def composed_loaders_recorded(recorder):
    """Within the block, every parameter of `recorder.param_of` whose weight_loader is a composed one records it."""
    swapped = []
    for _, (pname, p) in recorder.param_of.items():
        original = getattr(p, "weight_loader", None)
        parts = composed_parts(original)
        if parts is not None:
            try:
                p.weight_loader = _recording_loader(recorder, *parts)
            except AttributeError:  # a read-only property (vLLM parameter classes): recorded as before, a fallback
                continue
            swapped.append((p, original))
    try:
        yield
    finally:
        for p, original in swapped:
            p.weight_loader = original


def _recording_loader(recorder, loader, fn):
    def composed_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        loader(param, loaded_weight)  # recorded as usual: writes into param
        param.data.copy_(fn(param_value(recorder, param)))  # the one write that replaces them

    return composed_loader


def param_value(recorder, param: torch.Tensor) -> RecTensor:
    """A recording tensor holding `param`'s value as the writes recorded so far made it; those writes are dropped
    (the caller overwrites the whole parameter with a value computed from this one, which reads their sources)."""
    pname, base = recorder.param_of[storage_key(param)]
    writes = [w for w in recorder.rec.writes if w.param == pname]
    sources: set[str] = set()
    for w in writes:
        ir.sources(w.src.leaf, sources)
    numel = base.numel()
    if not base.is_contiguous() or not _covers(writes, numel):
        raise ValueRead(
            sources,
            "composed_weight_loader",
            f"the loader computes {pname} from its value, but the writes before do not cover it whole",
        )
    # the base never shows (the writes cover it); 0, not NaN: plans compare equal (NaN != NaN), and where it would
    # show, verify still fails (the real loader's poisoned NaN through fn, against fn(0))
    leaf: ir.Leaf = ir.Full(0, (numel,), dtype_name(base.dtype))
    for w in writes:
        leaf = ir.Update(leaf, w.dst, w.src)
    recorder.rec.writes = [w for w in recorder.rec.writes if w.param != pname]
    value = RecTensor.make(tuple(base.shape), base.dtype)
    recorder.leaf_of[storage_key(value)] = leaf
    recorder.keepalive.append(value)
    return value


def _covers(writes: list[ir.Write], numel: int) -> bool:
    """Do the writes' destinations cover elements [0, numel)? Only dense (contiguous-span) destinations count."""
    spans = []
    for w in writes:
        sizes = [s for s in w.dst.sizes if s != 1]
        strides = [st for s, st in zip(w.dst.sizes, w.dst.strides) if s != 1]
        if 0 not in w.dst.sizes and strides == list(ir.contiguous_strides(sizes)):
            spans.append((w.dst.offset, w.dst.offset + w.dst.numel))
    reached = 0
    for lo, hi in sorted(spans):
        if lo > reached:
            return False
        reached = max(reached, hi)
    return reached >= numel
