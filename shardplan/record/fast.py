"""The fast tier of the recorder (see FastRecorder): plain meta tensors, only the sinks hooked."""

from __future__ import annotations

import torch

from shardplan.errors import exception_text
from shardplan.plan import ir
from shardplan.record.hooks import ACTIVE, COPY, EMPTY, FACTORIES, FILL, TO, ZERO, hooks_installed
from shardplan.record.recording import RankRecording, TensorBase, dtype_name, op_name, region_in, tensor_args


class _FastGaveUp(Exception):
    """The fast tier met something it does not record; the full tier takes the whole rank over."""


class FastRecorder:
    """The fast tier. vLLM's loaders mostly take a view of the loaded tensor (narrow, view, transpose, chunk, ...)
    and copy_ it into a view of a parameter. A view of a meta tensor carries its exact storage offset and strides, so
    with *plain* meta tensors fed to the loader, only the final `param_view.copy_(loaded_view)` has to be seen: the
    storage of its source says which checkpoint tensor it reads and its geometry which elements. No tensor subclass,
    no torch-function round trip per view: recording costs about the loader's own time (docs/benchmarks.md).

    What it cannot see it must not miss. It gives up (the full tier then records the rank from the start) when:
    * a sink's source is a meta storage it did not feed (an op made new storage: cat, contiguous, .to(dtype), ...),
      or its dtype differs from the fed tensor's (a dtype-reinterpreting view), or its shape differs from the
      destination's (broadcast copy);
    * the source's version counter moved (an in-place op on the loaded tensor or any alias sharing the counter);
    * any other hooked call (`to`, `__setitem__`, fill_/zero_/mul_/..., factories: see HOOKED_TENSOR_METHODS) has a
      fed tensor or a parameter among its tensor arguments (covers in-place ops through `.data`, which has its own
      version counter), or a factory makes a meta tensor (a loader scratch tensor);
    * a parameter's storage changed under it (`param.data = loaded`);
    * the loader raised anything (value reads on meta raise), or swallowed one of our give-ups.
    """

    def __init__(self, param_of: dict, rank: int, params: dict):
        self.param_of = param_of
        self.rec = RankRecording(rank=rank, params=params)
        self.source_of: dict[int, tuple[ir.Source, torch.dtype]] = {}  # fed storage -> (leaf, fed dtype)
        self.keepalive: list[torch.Tensor] = []  # storage keys are addresses: keep their owners alive
        self.anomaly = ""

    def give_up(self, why: str):
        if not self.anomaly:
            self.anomaly = why
        raise _FastGaveUp(why)

    def run(self, model, tensors: list) -> bool:
        rec, source_of, keepalive = self.rec, self.source_of, self.keepalive

        def feed():
            for name, shape, dtype in tensors:
                dt = getattr(torch, dtype)
                t = EMPTY(shape, dtype=dt, device="meta")
                source_of[t.untyped_storage()._cdata] = (ir.Source(name), dt)
                keepalive.append(t)
                rec.fed.append(name)
                yield name, t

        with hooks_installed(_fast_hook):
            ACTIVE.recorder = self
            try:
                model.load_weights(feed())
            except Exception as e:  # _FastGaveUp, or the loader failed: the full tier finds out which and why
                if not self.anomaly:
                    self.anomaly = f"the loader raised {exception_text(e, 200)}"
            finally:
                ACTIVE.recorder = None
        if not self.anomaly:
            for key, (pname, p) in self.param_of.items():
                if p.untyped_storage()._cdata != key:
                    self.anomaly = f"the loader replaced the storage of {pname}"
                    break
        return not self.anomaly

    def sink(self, dst, src, rest, kwargs):
        """`dst.copy_(src, *rest, **kwargs)` with the fast tier active: record it, pass it through, or give up."""
        if isinstance(dst, TensorBase):
            entry = self.param_of.get(dst.untyped_storage()._cdata)
            fed = self.source_of.get(src.untyped_storage()._cdata) if isinstance(src, TensorBase) else None
            # (non_blocking= only says when a real copy may return: nothing to record)
            if entry is not None and fed is not None and not rest and (not kwargs or kwargs.keys() == {"non_blocking"}):
                shape = dst.shape
                if src._version != 0:
                    self.give_up(f"{fed[0].name} was modified in place before it was copied into {entry[0]}")
                if src.dtype != fed[1] or src.shape != shape:
                    self.give_up(f"{fed[0].name} is copied into {entry[0]} through a dtype view or a broadcast")
                pname, param = entry
                self.rec.writes.append(
                    ir.Write(
                        pname,
                        ir.Region(dst.storage_offset() - param.storage_offset(), tuple(shape), dst.stride()),
                        ir.View(fed[0], ir.Region(src.storage_offset(), tuple(shape), src.stride())),
                    )
                )
                return dst
            if entry is not None and isinstance(src, TensorBase):
                self.give_up(f"a tensor that is not a view of a fed checkpoint tensor is copied into {entry[0]}")
        self.check_untouched("Tensor.copy_", (dst, src) + tuple(rest), kwargs)
        return COPY(dst, src, *rest, **kwargs)

    def fill(self, original, args, kwargs):
        """`param_view.fill_(v)` / `.zero_()` with a Python scalar, e.g. vocab padding rows: a Full write, as the
        full tier records it (Recorder._param_write_without_source). Anything else goes to check_untouched."""
        dst = args[0] if args else None
        if isinstance(dst, TensorBase) and not kwargs:
            entry = self.param_of.get(dst.untyped_storage()._cdata)
            value = (
                0
                if original is ZERO and len(args) == 1
                else (args[1] if original is FILL and len(args) == 2 and type(args[1]) in (bool, int, float) else None)
            )
            if entry is not None and value is not None:
                out = original(*args)
                pname, param = entry
                sizes = tuple(dst.shape)
                self.rec.writes.append(
                    ir.Write(
                        pname,
                        region_in(dst, param),
                        ir.View(ir.Full(value, sizes, dtype_name(dst.dtype)), ir.full_region(sizes)),
                    )
                )
                return out
        self.check_untouched(op_name(original), args, kwargs)
        return original(*args, **kwargs)

    def check_untouched(self, op: str, args, kwargs) -> None:
        for a in tensor_args(args, kwargs):
            if a.device.type == "meta":
                key = a.untyped_storage()._cdata
                if key in self.source_of:
                    self.give_up(f"{op} on {self.source_of[key][0].name}")
                if key in self.param_of:
                    self.give_up(f"{op} on the parameter {self.param_of[key][0]}")


def _fast_hook(original):
    """The fast tier's wrapper of a hooked function (see FastRecorder)."""
    if original is COPY:

        def hooked_copy(dst, src=None, *rest, **kwargs):
            fast = ACTIVE.recorder
            if fast is None:
                return original(dst, src, *rest, **kwargs)
            return fast.sink(dst, src, rest, kwargs)

        return hooked_copy
    if original is FILL or original is ZERO:

        def hooked_fill(*args, **kwargs):
            fast = ACTIVE.recorder
            if fast is None:
                return original(*args, **kwargs)
            return fast.fill(original, args, kwargs)

        return hooked_fill
    name = op_name(original)
    is_factory = original in FACTORIES

    def hooked(*args, **kwargs):
        fast = ACTIVE.recorder
        if fast is not None:
            fast.check_untouched(name, args, kwargs)
            if is_factory:
                out = original(*args, **kwargs)
                if isinstance(out, TensorBase) and out.device.type == "meta":
                    fast.give_up(f"the loader makes a scratch tensor ({name})")
                return out
            if original is TO and args and isinstance(args[0], TensorBase) and args[0].device.type != "meta":
                out = original(*args, **kwargs)
                if isinstance(out, TensorBase) and out.device.type == "meta":
                    fast.give_up("the loader moves a constant tensor to the meta device")  # (see Recorder.handle)
                return out
        return original(*args, **kwargs)

    return hooked
