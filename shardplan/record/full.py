"""Record what vLLM's real `load_weights` does to each checkpoint tensor, on a model built on the meta device.

The full tier (see shardplan.record.loader for the two tiers). The fast tier (`FastRecorder`) feeds plain meta tensors
and hooks only the sinks: most loaders only take views and copy them into parameters, and a meta view's geometry is the
whole record. It gives up at the first thing it cannot vouch for, and the full tier described below records the rank
from the start.

Design of the full tier. The recording tensor `RecTensor` is a meta tensor subclass: it has a shape and dtype and no
data. The recorder (`Recorder`) sees every torch call that has a RecTensor among its arguments (through
`RecTensor.__torch_function__`) and the few calls on plain tensors that matter (writes into parameters, scratch-tensor
factories, `.to`, in-place ops: hooked only while a recording runs). A global TorchFunctionMode would be simpler but
slows vLLM's loaders even when it does nothing; it is pushed only once a loader creates a scratch tensor.

* Views (narrow, view, transpose, unbind, chunk, expand, `[a:b]`, ...) are run on the meta tensor itself. A meta view
  shares its base's storage and carries the exact storage offset and strides, so a whole chain of views folds into one
  `ir.View(leaf, Region)` for free: we never need to replay view ops one by one.
* Which *leaf* a meta storage holds is looked up at use time in `self.leaf_of[storage]`. A checkpoint tensor starts as
  `ir.Source(name)`; an op that makes a new storage (reshape needing a copy, cat, index_select, .to(dtype)) makes an
  `ir.Call` leaf; an in-place op on a loaded tensor (`zero_()`, `mul_()`, `copy_` into it) replaces the storage's leaf
  with an `ir.Update`, so any alias made earlier sees the new value, as in eager torch.
* A copy into a parameter (copy_, `param[idx] = w`) is the sink: it becomes an `ir.Write(param, Region, View)`. Writes
  into a parameter that read no checkpoint tensor (fill_/zero_ of padding rows) are recorded as `ir.Full` writes.
* A loader that reads values (`.item()`, `bool(t)`, `torch.equal`), or applies an op outside `ir.ALLOWED_OPS`, stops
  recording for that checkpoint tensor: it becomes an `ir.Fallback` (the consumer needs it whole and runs the real
  loader); `strict=True` raises `UnsupportedLoaderOp` naming the tensor, the op and the loader function instead.

Parameters are identified by their storage: vLLM loaders write into `param.data[...]`, a plain view, not the Parameter.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from shardplan.plan import ir
from shardplan.record.hooks import ACTIVE, COPY, FACTORIES, NAN, ORIGINAL, hooks_installed
from shardplan.record.recording import RankRecording, TensorBase, ValueRead, dtype_name, op_name, region_in, tensor_args
from shardplan.record.rectensor import (
    FAST_VIEWS,
    NO_SUBCLASS_TF,
    PASSTHROUGH,
    RecTensor,
    make_subclass,
    storage_key,
    wrap,
)

# Calls that only read metadata (shape, dtype, ...): answered from the meta tensor, never a value read.
_METADATA = frozenset(
    {
        "Tensor.size",
        "Tensor.dim",
        "Tensor.ndimension",
        "Tensor.stride",
        "Tensor.numel",
        "Tensor.nelement",
        "Tensor.storage_offset",
        "Tensor.element_size",
        "Tensor.is_contiguous",
        "Tensor.__len__",
        "Tensor.get_device",
        "Tensor.is_floating_point",
        "Tensor.is_complex",
        "Tensor.untyped_storage",
        "Tensor.__hash__",
        "Tensor.__format__",
        "Tensor.__repr__",
        "Tensor.data_ptr",
        "Tensor.type",
        "Tensor.__reduce_ex__",
        "Tensor.__eq__.get",
    }
)
# Value reads: the loader looks at data.
_VALUE_READS = frozenset(
    {
        "Tensor.item",
        "Tensor.tolist",
        "Tensor.__bool__",
        "Tensor.__int__",
        "Tensor.__float__",
        "Tensor.__index__",
        "Tensor.numpy",
        "Tensor.equal",
        "torch.equal",
        "torch.allclose",
        "Tensor.allclose",
        "Tensor.__array__",
        "Tensor.any",
        "Tensor.all",
        "torch.any",
        "torch.all",
        "torch.nonzero",
        "Tensor.nonzero",
        "torch.unique",
        "torch.where",
        "Tensor.__eq__",
        "Tensor.__ne__",
        "Tensor.__lt__",
        "Tensor.__gt__",
        "Tensor.__le__",
        "Tensor.__ge__",
        "torch.isnan",
        "torch.isinf",
        "Tensor.max",
        "Tensor.min",
        "Tensor.abs",
        "Tensor.sum",
        "torch.sum",
        "Tensor.mean",
        "torch.max",
        "torch.min",
    }
)


class Recorder:
    """Sees (1) every torch call with a RecTensor among its arguments, through RecTensor.__torch_function__, and
    (2) the few calls on plain tensors that matter (writes into params, scratch factories, `.to`, in-place ops),
    through wrappers `_hooks()` installs on those functions for the duration of a recording. A TorchFunctionMode would
    see everything, but slows vLLM's loaders even when it does nothing (they make tens of torch calls per tensor,
    mostly on params): it is pushed only once the loader makes a scratch tensor, whose later ops must all be seen."""

    def __init__(self, param_of_storage: dict[int, tuple[str, torch.Tensor]], recording: RankRecording):
        self.busy = False
        self.full_mode: _FullMode | None = None
        self.param_of = param_of_storage
        self.rec = recording
        self.leaf_of: dict[int, ir.Leaf] = {}
        self.keepalive: list[torch.Tensor] = []  # storage keys are addresses: keep their owners alive
        self.num_scratch = 0  # loader scratch tensors tracked by storage (not RecTensors)
        self.fast_counts: dict = {}  # calls taken by the fast paths, by function (named into ops_seen at close())

    # -- bookkeeping -------------------------------------------------------------------------------------
    def add_source(self, name: str, t: torch.Tensor) -> None:
        self.leaf_of[storage_key(t)] = ir.Source(name)
        self.keepalive.append(t)

    def _tracked(self, t) -> bool:
        return isinstance(t, TensorBase) and (type(t) is RecTensor or storage_key(t) in self.leaf_of)

    def view_of(self, t: torch.Tensor) -> ir.View:
        return ir.View(self.leaf_of[storage_key(t)], ir.Region(t.storage_offset(), tuple(t.shape), tuple(t.stride())))

    def sources_of(self, tensors) -> set[str]:
        names: set[str] = set()
        for t in tensors:
            leaf = self.leaf_of.get(storage_key(t))
            if leaf is not None:
                ir.sources(leaf, names)
        return names

    # -- dispatch ------------------------------------------------------------------------------------------
    def dispatch(self, func, types, args=(), kwargs=None):
        self.busy = True  # the handler's own torch calls run plain (and RecTensor's hook stays out of them)
        try:
            with NO_SUBCLASS_TF():
                # torch hands a Tensor method's *current* attribute to __torch_function__: our hook, not the original
                func = _UNHOOK.get(func, func)
                if func in FAST_VIEWS and type(args[0]) is RecTensor and not self.num_scratch:
                    out = self._fast_view(func, args, kwargs)
                    if out is not None:
                        return out
                elif (
                    func is COPY
                    and len(args) == 2
                    and not kwargs
                    and type(args[1]) is RecTensor
                    and type(args[0]) is not RecTensor
                    and not self.num_scratch
                ):
                    out = self._fast_copy(args[0], args[1])
                    if out is not None:
                        return out
                return self.handle(func, types, args, kwargs)
        finally:
            self.busy = False

    # The two calls vLLM's loaders make for almost every tensor: `loaded.narrow(...)` and `param_view.copy_(loaded)`.
    # Same result as handle(), without its general checks; anything unusual returns None and takes the general path.
    def _fast_view(self, func, args, kwargs):
        base = args[0]
        out = func(*args, **kwargs) if kwargs else func(*args)
        if type(out) is not torch.Tensor or out.untyped_storage()._cdata != base._storage_key:
            return None  # not a view of the loaded tensor after all: the general path handles it
        name = _OP_NAMES.get(func) or _OP_NAMES.setdefault(func, op_name(func))
        self.rec.ops_seen[name] = self.rec.ops_seen.get(name, 0) + 1
        r = make_subclass(RecTensor, out)
        r._plain, r._shape, r._dtype, r._storage_key = out, out.shape, out.dtype, base._storage_key
        return r

    def _fast_copy(self, dst, src):
        # touches only plain tensors (src through its `_plain` alias): no torch function runs, so no `busy` needed
        entry = self.param_of.get(dst.untyped_storage()._cdata)
        shape = dst.shape
        if entry is None or src._shape != shape:
            return None
        self.fast_counts[COPY] = self.fast_counts.get(COPY, 0) + 1
        pname, param = entry
        plain = src._plain
        self.rec.writes.append(
            ir.Write(
                pname,
                ir.Region(dst.storage_offset() - param.storage_offset(), tuple(shape), dst.stride()),
                ir.View(
                    self.leaf_of[src._storage_key], ir.Region(plain.storage_offset(), tuple(shape), plain.stride())
                ),
            )
        )
        return dst

    def watch_everything(self) -> None:
        """A loader scratch tensor exists: from now on every call may touch it, so see every call."""
        if self.full_mode is None:
            self.full_mode = _FullMode(self)
            self.full_mode.__enter__()

    def close(self) -> None:
        for func, n in self.fast_counts.items():
            name = _OP_NAMES.get(func) or _OP_NAMES.setdefault(func, op_name(func))
            self.rec.ops_seen[name] = self.rec.ops_seen.get(name, 0) + n
        self.fast_counts = {}
        if self.full_mode is not None:
            self.full_mode.__exit__(None, None, None)
            self.full_mode = None

    def handle(self, func, types, args=(), kwargs=None):
        if func in PASSTHROUGH:  # metadata queries (shape, dtype, size(), ...): the meta tensor answers them
            if types:  # skip RecTensor's own (no-op) __torch_function__: most calls on it are these
                with NO_SUBCLASS_TF():
                    return func(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        # Fast path first: most calls the loader makes touch no recorded tensor. Outputs of recorded ops are always
        # RecTensors, so a type check suffices, except for loader scratch tensors we track by storage (rare).
        if self.num_scratch:
            tracked = [a for a in tensor_args(args, kwargs) if self._tracked(a)]
        elif not types:  # torch lists the tensor subclasses among the args here: none means no RecTensor
            tracked = ()
        else:
            tracked = [a for a in tensor_args(args, kwargs) if type(a) is RecTensor]
        if not tracked:
            if (
                func is ORIGINAL["Tensor.to"]
                and args
                and isinstance(args[0], torch.Tensor)
                and args[0].device.type != "meta"
            ):
                out = func(*args, **kwargs)
                if isinstance(out, torch.Tensor) and out.device.type == "meta":
                    # `idx.to(loaded_weight.device)` (Llama 4's EP expert indices): in a real load the loaded tensor
                    # is on the CPU, so the constant stays there, values and all; on meta its values would be lost
                    # and the op using it could not be recorded. Keep the CPU tensor (with the dtype asked for).
                    return args[0].to(dtype=out.dtype)
                return out
            if func in FACTORIES:
                return self._factory(func, args, kwargs)
            if func in _FAST_SINK_FUNCS and args and isinstance(args[0], torch.Tensor):
                k = storage_key(args[0])
                if k in self.param_of:
                    return self._param_write_without_source(func, args, kwargs)
            elif (
                _is_inplace(func)
                and args
                and isinstance(args[0], torch.Tensor)
                and storage_key(args[0]) in self.param_of
            ):
                # `param.mul_(s)` after loading: transforms data the plan wrote, which a plan cannot express
                self._check_param_untouched(
                    storage_key(args[0]), op_name(func), "an in-place op on a parameter that already holds loaded data"
                )
            return func(*args, **kwargs)
        name = _OP_NAMES.get(func)
        if name is None:
            name = _OP_NAMES[func] = op_name(func)
        ops = self.rec.ops_seen
        ops[name] = ops.get(name, 0) + 1
        if name in _METADATA:
            return func(*args, **kwargs)
        if name in ("Tensor.data.set", "Tensor.set_"):
            # `param.data = loaded`: the parameter now *is* the loaded tensor (its storage and geometry), which a
            # plan of copies cannot express; the consumer runs the real loader for it
            raise ValueRead(
                self.sources_of(tracked), name, "the loader replaces a tensor's storage (`.data = ...` or set_)"
            )
        if name.endswith(".get") and name[:-4] not in _VALUE_READS:
            # `t.T`, `t.mT`, `t.data`: a view of the loaded tensor. Return it as a RecTensor: the fast path below
            # recognises tracked tensors by type, so a plain tensor here would make later ops on it (`t.T.contiguous()`)
            # invisible and their writes silently lost.
            return _as_rec(func(*args, **kwargs))
        if name in _VALUE_READS:
            raise ValueRead(
                self.sources_of(tracked), name, "the loader reads tensor values, which a recording does not have"
            )
        dst = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in ("Tensor.copy_", "Tensor.__setitem__") and dst is not None and not self._tracked(dst):
            return self._sink(name, func, args, kwargs)
        # `t[i] = v` into a loaded (or scratch) tensor is in-place too: it used to fall through to _op and be lost
        if (
            (name == "Tensor.__setitem__" or name.endswith("_") and not name.endswith("__"))
            and dst is not None
            and self._tracked(dst)
        ):
            return self._inplace_on_loaded(name, func, args, kwargs, tracked)
        return self._op(name, func, args, kwargs, tracked)

    def _op(self, name, func, args, kwargs, tracked):
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        new_leaf = None
        for i, o in enumerate(outs):
            if not isinstance(o, TensorBase):
                continue
            k = storage_key(o)
            if k in self.leaf_of:  # a view of a tracked storage: geometry says everything
                continue
            if name not in ir.ALLOWED_OPS:
                raise ValueRead(self.sources_of(tracked), name, f"op {name} is not in the replay allowlist")
            if new_leaf is None:
                new_leaf = self._call_leaf(name, args, kwargs, tracked)
            self.leaf_of[k] = (
                new_leaf
                if not isinstance(out, (tuple, list))
                else ir.Call(new_leaf.op, new_leaf.args, new_leaf.kwargs, new_leaf.inputs, i)
            )
            self.keepalive.append(o)
        if isinstance(out, (tuple, list)):
            return type(out)(_as_rec(o) for o in out)
        return _as_rec(out)

    def _call_leaf(self, name, args, kwargs, tracked) -> ir.Call:
        inputs: list[ir.View] = []
        index_of: dict[int, int] = {}

        def lit(a):
            if isinstance(a, TensorBase):
                if self._tracked(a):
                    if id(a) not in index_of:
                        index_of[id(a)] = len(inputs)
                        inputs.append(self.view_of(a))
                    return ir.Arg(index_of[id(a)])
                if a.device.type == "meta":
                    raise ValueRead(
                        self.sources_of(tracked),
                        name,
                        "an argument is a model tensor on the meta device, whose values are unknown",
                    )
                flat = a.detach().cpu().reshape(-1)
                if flat.numel() > 1 << 16:
                    raise ValueRead(self.sources_of(tracked), name, "a constant tensor argument is too large")
                return ir.Const(dtype_name(a.dtype), tuple(a.shape), tuple(flat.tolist()))
            if isinstance(a, (list, tuple)):
                return tuple(lit(x) for x in a)
            if isinstance(a, slice):
                return ir.Slice(a.start, a.stop, a.step)
            if isinstance(a, torch.dtype):
                return ir.DType(dtype_name(a))
            if a is Ellipsis or a is None or isinstance(a, (bool, int, float, str)):
                return a
            if isinstance(a, torch.device):
                return None  # devices are the replayer's choice
            if isinstance(a, torch.Size):
                return tuple(a)
            raise ValueRead(self.sources_of(tracked), name, f"argument of type {type(a).__name__} cannot be recorded")

        call_args = tuple(lit(a) for a in args)
        call_kwargs = tuple(sorted((k, lit(v)) for k, v in kwargs.items() if not isinstance(v, torch.device)))
        return ir.Call(name, call_args, call_kwargs, tuple(inputs))

    def _inplace_on_loaded(self, name, func, args, kwargs, tracked):
        """`w.zero_()`, `w.mul_(2)`, `w.copy_(x)`, `w[idx] = v` on a loaded tensor: its storage gets a new leaf."""
        dst = args[0]
        if name not in ir.ALLOWED_OPS and name != "Tensor.__setitem__":
            raise ValueRead(self.sources_of(tracked), name, f"in-place op {name} is not in the replay allowlist")
        region_view = self.view_of(dst)
        if name == "Tensor.__setitem__":
            sub = dst.__getitem__(args[1])
            if storage_key(sub) != storage_key(dst):
                raise ValueRead(self.sources_of(tracked), name, "advanced-index assignment into a loaded tensor")
            value = args[2]
            region = ir.Region(sub.storage_offset(), tuple(sub.shape), tuple(sub.stride()))
            new_value = self._value_view(value, tuple(sub.shape), dtype_name(sub.dtype), tracked, name)
        else:
            region = region_view.region
            # replay runs the in-place op on a clone, never on the trainer's tensor
            clone = ir.Call("Tensor.clone", (ir.Arg(0),), (), (region_view,))
            rest_args = args[1:]
            call = self._call_leaf(name, (dst,) + tuple(rest_args), kwargs, tracked)
            inputs = (ir.View(clone, ir.full_region(region.sizes)),) + call.inputs[1:]
            new_value = ir.View(ir.Call(name, call.args, call.kwargs, inputs), ir.full_region(region.sizes))
        func(*args, **kwargs)  # shape checks on meta
        if type(dst) is RecTensor:
            dst.refresh()
        k = storage_key(dst)
        self.leaf_of[k] = ir.Update(self.leaf_of[k], region, new_value)
        return dst

    def _value_view(self, value, sizes, dtype, tracked, name) -> ir.View:
        if isinstance(value, torch.Tensor):
            if self._tracked(value):
                return self.view_of(value.expand(sizes) if tuple(value.shape) != sizes else value)
            if value.device.type == "meta":
                raise ValueRead(self.sources_of(tracked), name, "the value written comes from a meta model tensor")
            flat = value.detach().cpu().reshape(-1)
            if flat.numel() == 1 or bool((flat == flat[0]).all()):
                return ir.View(ir.Full(flat[0].item(), sizes, dtype), ir.full_region(sizes))
            raise ValueRead(self.sources_of(tracked), name, "a non-constant plain tensor written into a parameter")
        return ir.View(ir.Full(value, sizes, dtype), ir.full_region(sizes))

    def _sink(self, name, func, args, kwargs):
        dst, src = (args[0], args[1]) if name == "Tensor.copy_" else (args[0].__getitem__(args[1]), args[2])
        if storage_key(dst) != storage_key(args[0]):
            raise ValueRead(self.sources_of([src]), name, "advanced-index assignment into a parameter")
        k = storage_key(dst)
        if k not in self.param_of:
            # a scratch tensor of the loader (copied into a parameter later): track it like a loaded tensor
            base = self.leaf_of.get(k) or ir.Full(
                NAN, (dst.untyped_storage().nbytes() // dst.element_size(),), dtype_name(dst.dtype)
            )
            region = ir.Region(dst.storage_offset(), tuple(dst.shape), tuple(dst.stride()))
            self.leaf_of[k] = ir.Update(
                base, region, self._value_view(src, tuple(dst.shape), dtype_name(dst.dtype), [src], name)
            )
            self.keepalive.append(dst)
            self.num_scratch += 1
            self.watch_everything()
            return args[0]
        pname, param = self.param_of[k]
        if isinstance(src, torch.Tensor) and tuple(src.shape) != tuple(dst.shape):
            src = src.expand(dst.shape)  # copy_ broadcasts
        value = self._value_view(src, tuple(dst.shape), dtype_name(dst.dtype), [src], name)
        self.rec.writes.append(ir.Write(pname, region_in(dst, param), value))
        return args[0]

    def _param_write_without_source(self, func, args, kwargs):
        name = op_name(func)
        if name == "Tensor.copy_":
            dst, value = args[0], args[1]
        elif name == "Tensor.__setitem__":
            dst, value = args[0].__getitem__(args[1]), args[2]
        elif name == "Tensor.fill_":
            dst, value = args[0], args[1]
        else:  # zero_
            dst, value = args[0], 0
        out = func(*args, **kwargs)
        if storage_key(dst) == storage_key(args[0]):
            pname, param = self.param_of[storage_key(dst)]
            try:
                view = self._value_view(value, tuple(dst.shape), dtype_name(dst.dtype), [], name)
            except ValueRead:
                # A value computed from model tensors, e.g. vLLM's composed_weight_loader:
                # `param.copy_(-torch.exp(param.float()))` after loading. If it overwrites (or copies from) a
                # parameter that holds loaded data, replaying the plain writes would be wrong: fall back the
                # tensors loaded there. Otherwise it is model-side init, not part of loading a checkpoint.
                self._check_param_untouched(
                    storage_key(dst),
                    name,
                    "the loader writes a value computed from model "
                    "tensors (not from a checkpoint tensor) into a parameter",
                )
                if isinstance(value, torch.Tensor) and storage_key(value) in self.param_of:
                    self._check_param_untouched(
                        storage_key(value), name, "the loader copies a loaded parameter into another parameter"
                    )
                return out
            self.rec.writes.append(ir.Write(pname, region_in(dst, param), view))
        return out

    def _factory(self, func, args, kwargs):
        """`torch.zeros(..., device=loaded.device)` and friends: a scratch tensor the loader may fill from checkpoint
        tensors and copy into a parameter. Track it from birth as a constant, so the elements the loader does not
        overwrite keep their value in the plan (unknown for `empty`: NaN, which any reader of them would expose)."""
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.device.type == "meta" and storage_key(out) not in self.param_of:
            value = FACTORIES[func]
            if value is None:  # full / new_full: the fill value is the argument after the size
                value = kwargs.get("fill_value", args[2] if func is ORIGINAL["Tensor.new_full"] else args[1])
            if isinstance(value, (bool, int, float)):
                numel = out.untyped_storage().nbytes() // out.element_size()
                self.leaf_of[storage_key(out)] = ir.Full(value, (numel,), dtype_name(out.dtype))
                self.keepalive.append(out)
                self.num_scratch += 1
                self.watch_everything()
        return out

    def _check_param_untouched(self, k: int, op: str, reason: str) -> None:
        """Raise a value read naming the checkpoint tensors already written into the parameter with storage `k`."""
        pname = self.param_of[k][0]
        sources: set[str] = set()
        for w in self.rec.writes:
            if w.param == pname:
                ir.sources(w.src.leaf, sources)
        if sources:
            raise ValueRead(sources, op, f"{reason} ({pname})")


_OP_NAMES: dict = {}
_FAST_SINK_FUNCS = {torch.Tensor.copy_, torch.Tensor.fill_, torch.Tensor.zero_, torch.Tensor.__setitem__}
_INPLACE: dict = {}


def _is_inplace(func) -> bool:
    """`Tensor.mul_` and friends (trailing underscore, not a dunder); cached per function: this is the fast path."""
    hit = _INPLACE.get(func)
    if hit is None:
        name = op_name(func)
        hit = _INPLACE[func] = (
            name.endswith("_")
            and not name.endswith("__")
            and name not in ("Tensor.requires_grad_", "Tensor.share_memory_")
        )
    return hit


class _FullMode(TorchFunctionMode):
    def __init__(self, recorder: "Recorder"):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.recorder.busy:
            return func(*args, **(kwargs or {}))
        return self.recorder.dispatch(func, types, args, kwargs)


_UNHOOK: dict = {}
_REC_TYPES = (RecTensor,)


def _hook(original):
    if original is COPY:

        def hooked_copy(*args, **kwargs):
            rec = ACTIVE.recorder
            # `param_view.copy_(loaded)`, once per tensor: straight to the recorder's fast path (see dispatch)
            if (
                rec is not None
                and len(args) == 2
                and not kwargs
                and not rec.busy
                and rec.full_mode is None
                and type(args[1]) is RecTensor
                and type(args[0]) is not RecTensor
            ):
                if rec._fast_copy(args[0], args[1]) is not None:
                    return args[0]
            return hooked(*args, **kwargs)

        _UNHOOK[hooked_copy] = original

    def hooked(*args, **kwargs):
        rec = ACTIVE.recorder
        if rec is None or rec.busy or rec.full_mode is not None:
            return original(*args, **kwargs)  # (with a RecTensor argument, RecTensor.__torch_function__ sees it)
        for a in args:
            if type(a) is RecTensor:  # what RecTensor.__torch_function__ would do, minus torch's round trip
                return rec.dispatch(original, _REC_TYPES, args, kwargs)
        return rec.dispatch(original, (), args, kwargs)

    hooked.__wrapped__ = original
    _UNHOOK[hooked] = original
    return hooked_copy if original is COPY else hooked


@contextlib.contextmanager
def recording(recorder: "Recorder"):
    """Make `recorder` the active one and hook the plain-tensor calls it needs; undo both on exit."""
    with hooks_installed(_hook):
        ACTIVE.recorder = recorder
        try:
            yield
        finally:
            ACTIVE.recorder = None
            recorder.close()
            _UNHOOK.clear()


def _as_rec(t):
    if isinstance(t, TensorBase) and type(t) is not RecTensor and t.device.type == "meta":
        return wrap(t)
    return t
