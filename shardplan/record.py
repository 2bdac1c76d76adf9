"""Record what vLLM's real `load_weights` does to each checkpoint tensor, on a model built on the meta device.

Two tiers (record_loader). The fast tier (`_FastRecorder`) feeds plain meta tensors and hooks only the sinks: most
loaders only take views and copy them into parameters, and a meta view's geometry is the whole record. It gives up at
the first thing it cannot vouch for, and the full tier described below records the rank from the start.

Design of the full tier. The recording tensor `RecTensor` is a meta tensor subclass: it has a shape and dtype and no data. The
recorder (`_Recorder`) sees every torch call that has a RecTensor among its arguments (through
`RecTensor.__torch_function__`) and the few calls on plain tensors that matter (writes into parameters, scratch-tensor
factories, `.to`, in-place ops: hooked only while a recording runs). A global TorchFunctionMode would be simpler but
costs ~1.5x on vLLM's loaders even when it does nothing; it is pushed only once a loader creates a scratch tensor.

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
import gc
import time
import traceback
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from . import ir
from .errors import ShardplanError
from .layout import Layout


class UnsupportedLoaderOp(ShardplanError):
    pass


class RecordError(ShardplanError):
    pass


def _key(t: torch.Tensor) -> int:
    if type(t) is RecTensor:
        return t._storage_key
    return t.untyped_storage()._cdata


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class RecTensor(torch.Tensor):
    """A metadata-only checkpoint tensor: meta storage, real shape/dtype. All the recording is done by `_Recorder`,
    which identifies these tensors by storage. The subclass's own __torch_function__ does nothing but make torch list
    RecTensor in `types` when one is among a call's arguments: the recorder's fast path for every other call is then
    `if not types`, without scanning arguments (the loader makes ~20 torch calls per tensor, mostly on params)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        rec = _ACTIVE
        self = args[0] if args else None
        if type(self) is RecTensor and not kwargs:
            # The two hot cases, ~2 per tensor in vLLM's loaders, answered on the plain meta alias `_plain` (same
            # storage and geometry): no context manager, no second trip through torch's dispatch. Metadata queries
            # (size(), dim(), ...) outside a recording or from the recorder itself:
            if func in _PASSTHROUGH or rec is None or rec.busy:
                return func(self._plain, *args[1:])
            # A pure view op (narrow, view, transpose, ...) while no loader scratch tensor exists: its output shares
            # the loaded tensor's storage, so its geometry is its whole record (see _Recorder.handle for the rest).
            if func in _FAST_VIEWS and not rec.num_scratch:
                out = func(self._plain, *args[1:])
                rec.fast_counts[func] = rec.fast_counts.get(func, 0) + 1
                r = _make_subclass(RecTensor, out)
                r._plain, r._shape, r._dtype, r._storage_key = out, out.shape, out.dtype, self._storage_key
                return r
        if rec is None or rec.busy or func in _PASSTHROUGH:
            with _NO_SUBCLASS_TF():
                return func(*args, **kwargs) if kwargs else func(*args)
        return rec.dispatch(func, types, args, kwargs)

    @staticmethod
    def make(shape, dtype: torch.dtype) -> "RecTensor":
        rec = _ACTIVE
        if rec is not None and rec.full_mode is not None:
            # fed lazily, so possibly while the recorder's mode is active: keep this torch.empty out of it (the mode
            # would take it for a loader scratch tensor, see _Recorder._factory)
            with torch._C.DisableTorchFunction():
                base = _EMPTY(shape, dtype=dtype, device="meta")
        else:
            base = _EMPTY(shape, dtype=dtype, device="meta")
        r = _make_subclass(RecTensor, base)
        r._plain, r._shape, r._dtype, r._storage_key = base, base.shape, dtype, base.untyped_storage()._cdata
        return r

    def __repr__(self):
        return f"RecTensor({list(self.shape)}, {dtype_name(self.dtype)})"

    # Metadata the loaders read ~10 times per tensor (shape, ndim, ...), answered from attributes cached at creation:
    # through __torch_function__ each read would cost a Python dispatch, half of the recording's overhead.
    shape = property(lambda self: self._shape)
    ndim = property(lambda self: len(self._shape))
    dtype = property(lambda self: self._dtype)
    device = property(lambda self: _META)

    def refresh(self) -> None:
        """Re-read the cached metadata and alias (after an in-place op that may change the geometry, e.g. t_())."""
        with _NO_SUBCLASS_TF():
            self._plain = torch.Tensor.as_strided(self, torch.Tensor.size(self), torch.Tensor.stride(self),
                                                  torch.Tensor.storage_offset(self))
            self._shape, self._dtype = self._plain.shape, self._plain.dtype
            self._storage_key = self._plain.untyped_storage()._cdata


_META = torch.device("meta")
_TensorBase = torch._C.TensorBase  # isinstance against torch.Tensor runs a Python __instancecheck__: hot paths use this


_make_subclass = torch.Tensor._make_subclass


def _wrap(base: torch.Tensor) -> "RecTensor":
    """A RecTensor sharing `base`'s meta storage and geometry; `base` (a plain tensor) stays its `_plain` alias."""
    r = _make_subclass(RecTensor, base)
    r._plain, r._shape, r._dtype, r._storage_key = base, base.shape, base.dtype, base.untyped_storage()._cdata
    return r


class _ValueRead(Exception):
    """Raised inside the loader when it needs data we do not have; unwinds out of load_weights."""

    def __init__(self, sources: set[str], op: str, reason: str):
        super().__init__(f"{op}: {reason}")
        self.sources, self.op, self.reason = sources, op, reason


def op_name(func) -> str:
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    if qual.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + qual.split(".", 1)[1]
    if qual.startswith("_VariableFunctionsClass."):
        # torch.cat, torch.narrow, ... are C functions whose __qualname__ is `_VariableFunctionsClass.cat`: name them
        # as the allowlist and the replayer do (`torch.cat`), or they could never be recorded.
        return "torch." + qual.split(".", 1)[1]
    if qual.endswith(".__get__") or qual.endswith(".__set__"):
        # property access (`t.T`, `t.data`, `t.shape`): func is the getset descriptor's bound __get__, whose
        # __self__ names the attribute; the qualname alone would say "getset_descriptor" for all of them.
        attr = getattr(getattr(func, "__self__", None), "__name__", None) or qual.rsplit(".", 2)[-2]
        return "Tensor." + attr + (".get" if qual.endswith(".__get__") else ".set")
    module = getattr(func, "__module__", "") or ""
    if module.startswith("torch.nn.functional"):
        return "F." + qual
    return "torch." + qual


# Calls that only read metadata (shape, dtype, ...): answered from the meta tensor, never a value read.
_METADATA = frozenset({
    "Tensor.size", "Tensor.dim", "Tensor.ndimension", "Tensor.stride", "Tensor.numel", "Tensor.nelement",
    "Tensor.storage_offset", "Tensor.element_size", "Tensor.is_contiguous", "Tensor.__len__", "Tensor.get_device",
    "Tensor.is_floating_point", "Tensor.is_complex", "Tensor.untyped_storage", "Tensor.__hash__", "Tensor.__format__",
    "Tensor.__repr__", "Tensor.data_ptr", "Tensor.type", "Tensor.__reduce_ex__", "Tensor.__eq__.get",
})
# Value reads: the loader looks at data.
_VALUE_READS = frozenset({
    "Tensor.item", "Tensor.tolist", "Tensor.__bool__", "Tensor.__int__", "Tensor.__float__", "Tensor.__index__",
    "Tensor.numpy", "Tensor.equal", "torch.equal", "torch.allclose", "Tensor.allclose", "Tensor.__array__",
    "Tensor.any", "Tensor.all", "torch.any", "torch.all", "torch.nonzero", "Tensor.nonzero", "torch.unique",
    "torch.where", "Tensor.__eq__", "Tensor.__ne__", "Tensor.__lt__", "Tensor.__gt__", "Tensor.__le__",
    "Tensor.__ge__", "torch.isnan", "torch.isinf", "Tensor.max", "Tensor.min", "Tensor.abs", "Tensor.sum",
    "torch.sum", "Tensor.mean", "torch.max", "torch.min",
})
_INPLACE_SINKS = frozenset({"Tensor.copy_", "Tensor.__setitem__", "Tensor.fill_", "Tensor.zero_"})


@dataclass
class RankRecording:
    """What one rank's loader did: writes in recording order plus per-source bookkeeping."""
    rank: int
    params: dict[str, ir.TensorMeta]
    writes: list[ir.Write] = field(default_factory=list)
    fallbacks: dict[str, ir.Fallback] = field(default_factory=dict)
    fed: list[str] = field(default_factory=list)  # names fed to the loader, in order
    ops_seen: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    tier: str = "fast"    # which recorder produced this: "fast" or "full" (see record_loader)
    tier_note: str = ""   # why the fast tier gave up, when it did

    def not_needed(self) -> list[str]:
        read: set[str] = set()
        for w in self.writes:
            ir._collect_sources(w.src.leaf, read)
        # dict.fromkeys: a name fed again after a fallback (see _unfinished) is listed once
        return [n for n in dict.fromkeys(self.fed) if n not in read and n not in self.fallbacks]

    def to_plan(self) -> ir.RankPlan:
        used = sorted({w.param for w in self.writes})
        return ir.RankPlan(rank=self.rank, params=tuple(self.params[p] for p in used), writes=tuple(self.writes),
                           fallbacks=tuple(sorted(self.fallbacks.values(), key=lambda f: f.source)),
                           not_needed=tuple(sorted(self.not_needed())))


class _Recorder:
    """Sees (1) every torch call with a RecTensor among its arguments, through RecTensor.__torch_function__, and
    (2) the few calls on plain tensors that matter (writes into params, scratch factories, `.to`, in-place ops),
    through wrappers `_hooks()` installs on those functions for the duration of a recording. A TorchFunctionMode would
    see everything, but costs ~1.5x on vLLM's loaders even when it does nothing (~21 torch calls per tensor, mostly
    on params): it is pushed only once the loader makes a scratch tensor, whose later ops must all be seen."""

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
        self.leaf_of[_key(t)] = ir.Source(name)
        self.keepalive.append(t)

    def _tracked(self, t) -> bool:
        return isinstance(t, _TensorBase) and (type(t) is RecTensor or _key(t) in self.leaf_of)

    def view_of(self, t: torch.Tensor) -> ir.View:
        return ir.View(self.leaf_of[_key(t)], ir.Region(t.storage_offset(), tuple(t.shape), tuple(t.stride())))

    def sources_of(self, tensors) -> set[str]:
        names: set[str] = set()
        for t in tensors:
            leaf = self.leaf_of.get(_key(t))
            if leaf is not None:
                ir._collect_sources(leaf, names)
        return names

    # -- dispatch ------------------------------------------------------------------------------------------
    def dispatch(self, func, types, args=(), kwargs=None):
        self.busy = True  # the handler's own torch calls run plain (and RecTensor's hook stays out of them)
        try:
            with _NO_SUBCLASS_TF():
                # torch hands a Tensor method's *current* attribute to __torch_function__: our hook, not the original
                func = _UNHOOK.get(func, func)
                if func in _FAST_VIEWS and type(args[0]) is RecTensor and not self.num_scratch:
                    out = self._fast_view(func, args, kwargs)
                    if out is not None:
                        return out
                elif func is _COPY and len(args) == 2 and not kwargs and type(args[1]) is RecTensor \
                        and type(args[0]) is not RecTensor and not self.num_scratch:
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
        r = _make_subclass(RecTensor, out)
        r._plain, r._shape, r._dtype, r._storage_key = out, out.shape, out.dtype, base._storage_key
        return r

    def _fast_copy(self, dst, src):
        # touches only plain tensors (src through its `_plain` alias): no torch function runs, so no `busy` needed
        entry = self.param_of.get(dst.untyped_storage()._cdata)
        shape = dst.shape
        if entry is None or src._shape != shape:
            return None
        self.fast_counts[_COPY] = self.fast_counts.get(_COPY, 0) + 1
        pname, param = entry
        plain = src._plain
        self.rec.writes.append(ir.Write(
            pname, ir.Region(dst.storage_offset() - param.storage_offset(), tuple(shape), dst.stride()),
            ir.View(self.leaf_of[src._storage_key], ir.Region(plain.storage_offset(), tuple(shape), plain.stride()))))
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
        if func in _PASSTHROUGH:  # metadata queries (shape, dtype, size(), ...): the meta tensor answers them
            if types:  # skip RecTensor's own (no-op) __torch_function__: most calls on it are these
                with _NO_SUBCLASS_TF():
                    return func(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        # Fast path first: most calls the loader makes touch no recorded tensor. Outputs of recorded ops are always
        # RecTensors, so a type check suffices, except for loader scratch tensors we track by storage (rare).
        if self.num_scratch:
            tracked = [a for a in _tensor_args(args, kwargs) if self._tracked(a)]
        elif not types:  # torch lists the tensor subclasses among the args here: none means no RecTensor
            tracked = ()
        else:
            tracked = [a for a in _tensor_args(args, kwargs) if type(a) is RecTensor]
        if not tracked:
            if func is _ORIGINAL["Tensor.to"] and args and isinstance(args[0], torch.Tensor) \
                    and args[0].device.type != "meta":
                out = func(*args, **kwargs)
                if isinstance(out, torch.Tensor) and out.device.type == "meta":
                    # `idx.to(loaded_weight.device)` (Llama 4's EP expert indices): in a real load the loaded tensor
                    # is on the CPU, so the constant stays there, values and all; on meta its values would be lost
                    # and the op using it could not be recorded. Keep the CPU tensor (with the dtype asked for).
                    return args[0].to(dtype=out.dtype)
                return out
            if func in _FACTORIES:
                return self._factory(func, args, kwargs)
            if func in _FAST_SINK_FUNCS and args and isinstance(args[0], torch.Tensor):
                k = _key(args[0])
                if k in self.param_of:
                    return self._param_write_without_source(func, args, kwargs)
            elif _is_inplace(func) and args and isinstance(args[0], torch.Tensor) and _key(args[0]) in self.param_of:
                # `param.mul_(s)` after loading: transforms data the plan wrote, which a plan cannot express
                self._check_param_untouched(_key(args[0]), op_name(func), "an in-place op on a parameter that "
                                                                           "already holds loaded data")
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
            raise _ValueRead(self.sources_of(tracked), name, "the loader replaces a tensor's storage (`.data = ...` "
                                                             "or set_)")
        if name.endswith(".get") and name[:-4] not in _VALUE_READS:
            # `t.T`, `t.mT`, `t.data`: a view of the loaded tensor. Return it as a RecTensor: the fast path below
            # recognises tracked tensors by type, so a plain tensor here would make later ops on it (`t.T.contiguous()`)
            # invisible and their writes silently lost.
            return _as_rec(func(*args, **kwargs))
        if name in _VALUE_READS:
            raise _ValueRead(self.sources_of(tracked), name, "the loader reads tensor values, which a recording "
                                                              "does not have")
        dst = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in ("Tensor.copy_", "Tensor.__setitem__") and dst is not None and not self._tracked(dst):
            return self._sink(name, func, args, kwargs)
        # `t[i] = v` into a loaded (or scratch) tensor is in-place too: it used to fall through to _op and be lost
        if (name == "Tensor.__setitem__" or name.endswith("_") and not name.endswith("__")) and dst is not None \
                and self._tracked(dst):
            return self._inplace_on_loaded(name, func, args, kwargs, tracked)
        return self._op(name, func, args, kwargs, tracked)

    def _op(self, name, func, args, kwargs, tracked):
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        new_leaf = None
        for i, o in enumerate(outs):
            if not isinstance(o, _TensorBase):
                continue
            k = _key(o)
            if k in self.leaf_of:      # a view of a tracked storage: geometry says everything
                continue
            if name not in ir.ALLOWED_OPS:
                raise _ValueRead(self.sources_of(tracked), name, f"op {name} is not in the replay allowlist")
            if new_leaf is None:
                new_leaf = self._call_leaf(name, args, kwargs, tracked)
            self.leaf_of[k] = new_leaf if not isinstance(out, (tuple, list)) else ir.Call(
                new_leaf.op, new_leaf.args, new_leaf.kwargs, new_leaf.inputs, i)
            self.keepalive.append(o)
        if isinstance(out, (tuple, list)):
            return type(out)(_as_rec(o) for o in out)
        return _as_rec(out)

    def _call_leaf(self, name, args, kwargs, tracked) -> ir.Call:
        inputs: list[ir.View] = []
        index_of: dict[int, int] = {}

        def lit(a):
            if isinstance(a, _TensorBase):
                if self._tracked(a):
                    if id(a) not in index_of:
                        index_of[id(a)] = len(inputs)
                        inputs.append(self.view_of(a))
                    return ir.Arg(index_of[id(a)])
                if a.device.type == "meta":
                    raise _ValueRead(self.sources_of(tracked), name, "an argument is a model tensor on the meta "
                                                                     "device, whose values are unknown")
                flat = a.detach().cpu().reshape(-1)
                if flat.numel() > 1 << 16:
                    raise _ValueRead(self.sources_of(tracked), name, "a constant tensor argument is too large")
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
            raise _ValueRead(self.sources_of(tracked), name, f"argument of type {type(a).__name__} cannot be recorded")

        call_args = tuple(lit(a) for a in args)
        call_kwargs = tuple(sorted((k, lit(v)) for k, v in kwargs.items() if not isinstance(v, torch.device)))
        return ir.Call(name, call_args, call_kwargs, tuple(inputs))

    def _inplace_on_loaded(self, name, func, args, kwargs, tracked):
        """`w.zero_()`, `w.mul_(2)`, `w.copy_(x)`, `w[idx] = v` on a loaded tensor: its storage gets a new leaf."""
        dst = args[0]
        if name not in ir.ALLOWED_OPS and name != "Tensor.__setitem__":
            raise _ValueRead(self.sources_of(tracked), name, f"in-place op {name} is not in the replay allowlist")
        region_view = self.view_of(dst)
        if name == "Tensor.__setitem__":
            sub = dst.__getitem__(args[1])
            if _key(sub) != _key(dst):
                raise _ValueRead(self.sources_of(tracked), name, "advanced-index assignment into a loaded tensor")
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
        k = _key(dst)
        self.leaf_of[k] = ir.Update(self.leaf_of[k], region, new_value)
        return dst

    def _value_view(self, value, sizes, dtype, tracked, name) -> ir.View:
        if isinstance(value, torch.Tensor):
            if self._tracked(value):
                return self.view_of(value.expand(sizes) if tuple(value.shape) != sizes else value)
            if value.device.type == "meta":
                raise _ValueRead(self.sources_of(tracked), name, "the value written comes from a meta model tensor")
            flat = value.detach().cpu().reshape(-1)
            if flat.numel() == 1 or bool((flat == flat[0]).all()):
                return ir.View(ir.Full(flat[0].item(), sizes, dtype), ir.full_region(sizes))
            raise _ValueRead(self.sources_of(tracked), name, "a non-constant plain tensor written into a parameter")
        return ir.View(ir.Full(value, sizes, dtype), ir.full_region(sizes))

    def _sink(self, name, func, args, kwargs):
        dst, src = (args[0], args[1]) if name == "Tensor.copy_" else (args[0].__getitem__(args[1]), args[2])
        if _key(dst) != _key(args[0]):
            raise _ValueRead(self.sources_of([src]), name, "advanced-index assignment into a parameter")
        k = _key(dst)
        if k not in self.param_of:
            # a scratch tensor of the loader (copied into a parameter later): track it like a loaded tensor
            base = self.leaf_of.get(k) or ir.Full(float("nan"), (dst.untyped_storage().nbytes() // dst.element_size(),),
                                                 dtype_name(dst.dtype))
            region = ir.Region(dst.storage_offset(), tuple(dst.shape), tuple(dst.stride()))
            self.leaf_of[k] = ir.Update(base, region, self._value_view(src, tuple(dst.shape), dtype_name(dst.dtype),
                                                                       [src], name))
            self.keepalive.append(dst)
            self.num_scratch += 1
            self.watch_everything()
            return args[0]
        pname, param = self.param_of[k]
        if isinstance(src, torch.Tensor) and tuple(src.shape) != tuple(dst.shape):
            src = src.expand(dst.shape)  # copy_ broadcasts
        value = self._value_view(src, tuple(dst.shape), dtype_name(dst.dtype), [src], name)
        self.rec.writes.append(ir.Write(pname, _region_in(dst, param), value))
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
        if _key(dst) == _key(args[0]):
            pname, param = self.param_of[_key(dst)]
            try:
                view = self._value_view(value, tuple(dst.shape), dtype_name(dst.dtype), [], name)
            except _ValueRead:
                # A value computed from model tensors, e.g. vLLM's composed_weight_loader:
                # `param.copy_(-torch.exp(param.float()))` after loading. If it overwrites (or copies from) a
                # parameter that holds loaded data, replaying the plain writes would be wrong: fall back the
                # tensors loaded there. Otherwise it is model-side init, not part of loading a checkpoint.
                self._check_param_untouched(_key(dst), name, "the loader writes a value computed from model "
                                                             "tensors (not from a checkpoint tensor) into a parameter")
                if isinstance(value, torch.Tensor) and _key(value) in self.param_of:
                    self._check_param_untouched(_key(value), name, "the loader copies a loaded parameter into "
                                                                   "another parameter")
                return out
            self.rec.writes.append(ir.Write(pname, _region_in(dst, param), view))
        return out

    def _factory(self, func, args, kwargs):
        """`torch.zeros(..., device=loaded.device)` and friends: a scratch tensor the loader may fill from checkpoint
        tensors and copy into a parameter. Track it from birth as a constant, so the elements the loader does not
        overwrite keep their value in the plan (unknown for `empty`: NaN, which any reader of them would expose)."""
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.device.type == "meta" and not _key(out) in self.param_of:
            value = _FACTORIES[func]
            if value is None:  # full / new_full: the fill value is the argument after the size
                value = kwargs.get("fill_value", args[2] if func is _ORIGINAL["Tensor.new_full"] else args[1])
            if isinstance(value, (bool, int, float)):
                numel = out.untyped_storage().nbytes() // out.element_size()
                self.leaf_of[_key(out)] = ir.Full(value, (numel,), dtype_name(out.dtype))
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
                ir._collect_sources(w.src.leaf, sources)
        if sources:
            raise _ValueRead(sources, op, f"{reason} ({pname})")


_OP_NAMES: dict = {}
_COPY = torch.Tensor.copy_
_TO = torch.Tensor.to
_FILL, _ZERO = torch.Tensor.fill_, torch.Tensor.zero_
_EMPTY = torch.empty
# pure view ops: the output shares the input's storage, its geometry is the whole record
_FAST_VIEWS = {torch.Tensor.narrow, torch.Tensor.view, torch.Tensor.t, torch.Tensor.transpose, torch.Tensor.select,
               torch.Tensor.unsqueeze, torch.Tensor.squeeze, torch.Tensor.permute, torch.Tensor.expand}
_NO_SUBCLASS_TF = torch._C.DisableTorchFunctionSubclass
_PASSTHROUGH = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.stride, torch.Tensor.numel,
                torch.Tensor.storage_offset, torch.Tensor.element_size, torch.Tensor.is_contiguous,
                torch.Tensor.__len__, torch.Tensor.untyped_storage, torch.Tensor.is_floating_point,
                torch.Tensor.data_ptr, torch.Tensor.get_device, torch.Tensor.ndimension, torch.Tensor.nelement,
                torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
                torch.Tensor.ndim.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.is_meta.__get__,
                torch.Tensor.requires_grad.__get__, torch.Tensor.layout.__get__, torch.Tensor.is_sparse.__get__,
                torch.Tensor.is_quantized.__get__}
_FAST_SINK_FUNCS = {torch.Tensor.copy_, torch.Tensor.fill_, torch.Tensor.zero_, torch.Tensor.__setitem__}
_INPLACE: dict = {}
# factories whose meta results the recorder tracks as constants (see _Recorder._factory); None: fill value argument
_FACTORIES = {torch.zeros: 0, torch.ones: 1, torch.empty: float("nan"), torch.full: None,
              torch.Tensor.new_zeros: 0, torch.Tensor.new_ones: 1, torch.Tensor.new_empty: float("nan"),
              torch.Tensor.new_full: None}


def _is_inplace(func) -> bool:
    """`Tensor.mul_` and friends (trailing underscore, not a dunder); cached per function: this is the fast path."""
    hit = _INPLACE.get(func)
    if hit is None:
        name = op_name(func)
        hit = _INPLACE[func] = (name.endswith("_") and not name.endswith("__")
                                and name not in ("Tensor.requires_grad_", "Tensor.share_memory_"))
    return hit


class _FullMode(TorchFunctionMode):
    def __init__(self, recorder: "_Recorder"):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.recorder.busy:
            return func(*args, **(kwargs or {}))
        return self.recorder.dispatch(func, types, args, kwargs)


_ACTIVE: "_Recorder | None" = None
# Functions whose calls on plain tensors the recorder must see. Wrapped only while a recording runs.
_HOOKED_TENSOR_METHODS = ("to", "copy_", "fill_", "zero_", "__setitem__", "new_zeros", "new_ones", "new_empty",
                          "new_full", "mul_", "add_", "sub_", "div_", "neg_", "exp_", "clamp_", "masked_fill_",
                          "index_copy_", "index_fill_", "index_put_", "scatter_", "normal_", "uniform_", "abs_",
                          "copysign_", "pow_", "sqrt_", "reciprocal_", "addcmul_", "addcdiv_", "lerp_", "t_",
                          "transpose_", "squeeze_", "unsqueeze_", "resize_", "set_", "fill_diagonal_", "clamp_min_",
                          "clamp_max_", "sign_", "log_", "tanh_", "sigmoid_", "exponential_", "bernoulli_")
_HOOKED_TORCH_FUNCTIONS = ("zeros", "ones", "empty", "full")
_ORIGINAL: dict = {f"Tensor.{n}": getattr(torch.Tensor, n) for n in _HOOKED_TENSOR_METHODS}
_ORIGINAL.update({f"torch.{n}": getattr(torch, n) for n in _HOOKED_TORCH_FUNCTIONS})


_UNHOOK: dict = {}
_REC_TYPES = (RecTensor,)


def _hook(original):
    if original is _COPY:
        def hooked_copy(*args, **kwargs):
            rec = _ACTIVE
            # `param_view.copy_(loaded)`, once per tensor: straight to the recorder's fast path (see dispatch)
            if rec is not None and len(args) == 2 and not kwargs and not rec.busy and rec.full_mode is None \
                    and type(args[1]) is RecTensor and type(args[0]) is not RecTensor:
                if rec._fast_copy(args[0], args[1]) is not None:
                    return args[0]
            return hooked(*args, **kwargs)
        _UNHOOK[hooked_copy] = original

    def hooked(*args, **kwargs):
        rec = _ACTIVE
        if rec is None or rec.busy or rec.full_mode is not None:
            return original(*args, **kwargs)  # (with a RecTensor argument, RecTensor.__torch_function__ sees it)
        for a in args:
            if type(a) is RecTensor:  # what RecTensor.__torch_function__ would do, minus torch's round trip
                return rec.dispatch(original, _REC_TYPES, args, kwargs)
        return rec.dispatch(original, (), args, kwargs)
    hooked.__wrapped__ = original
    _UNHOOK[hooked] = original
    return hooked_copy if original is _COPY else hooked


@contextlib.contextmanager
def _recording(recorder: "_Recorder"):
    """Make `recorder` the active one and hook the plain-tensor calls it needs; undo both on exit."""
    global _ACTIVE
    with _hooks_installed(_hook):
        _ACTIVE = recorder
        try:
            yield
        finally:
            _ACTIVE = None
            recorder.close()
            _UNHOOK.clear()


@contextlib.contextmanager
def _hooks_installed(wrap):
    """Replace each hooked torch function by `wrap(original)` for the block; the originals are back after it,
    whatever happens inside. Both tiers record through this, so it is where nesting is refused."""
    if _ACTIVE is not None or _ACTIVE_FAST is not None:
        raise RecordError("a recording is already running in this thread; recordings do not nest")
    for n in _HOOKED_TENSOR_METHODS:
        setattr(torch.Tensor, n, wrap(_ORIGINAL[f"Tensor.{n}"]))
    for n in _HOOKED_TORCH_FUNCTIONS:
        setattr(torch, n, wrap(_ORIGINAL[f"torch.{n}"]))
    try:
        yield
    finally:
        for n in _HOOKED_TENSOR_METHODS:
            setattr(torch.Tensor, n, _ORIGINAL[f"Tensor.{n}"])
        for n in _HOOKED_TORCH_FUNCTIONS:
            setattr(torch, n, _ORIGINAL[f"torch.{n}"])


class _FastGaveUp(Exception):
    """The fast tier met something it does not record; the full tier takes the whole rank over."""


class _FastRecorder:
    """The fast tier. vLLM's loaders mostly take a view of the loaded tensor (narrow, view, transpose, chunk, ...)
    and copy_ it into a view of a parameter. A view of a meta tensor carries its exact storage offset and strides, so
    with *plain* meta tensors fed to the loader, only the final `param_view.copy_(loaded_view)` has to be seen: the
    storage of its source says which checkpoint tensor it reads and its geometry which elements. No tensor subclass,
    no torch-function round trip per view: recording costs about the loader's own time (issue 2's bar).

    What it cannot see it must not miss. It gives up (the full tier then records the rank from the start) when:
    * a sink's source is a meta storage it did not feed (an op made new storage: cat, contiguous, .to(dtype), ...),
      or its dtype differs from the fed tensor's (a dtype-reinterpreting view), or its shape differs from the
      destination's (broadcast copy);
    * the source's version counter moved (an in-place op on the loaded tensor or any alias sharing the counter);
    * any other hooked call (`to`, `__setitem__`, fill_/zero_/mul_/..., factories: see _HOOKED_TENSOR_METHODS) has a
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
                t = _EMPTY(shape, dtype=dt, device="meta")
                source_of[t.untyped_storage()._cdata] = (ir.Source(name), dt)
                keepalive.append(t)
                rec.fed.append(name)
                yield name, t

        global _ACTIVE_FAST
        with _hooks_installed(_fast_hook):
            _ACTIVE_FAST = self
            try:
                model.load_weights(feed())
            except Exception as e:  # _FastGaveUp, or the loader failed: the full tier finds out which and why
                if not self.anomaly:
                    first_line = str(e).splitlines()[0][:200] if str(e) else ""
                    self.anomaly = f"the loader raised {type(e).__name__}: {first_line}"
            finally:
                _ACTIVE_FAST = None
        if not self.anomaly:
            for key, (pname, p) in self.param_of.items():
                if p.untyped_storage()._cdata != key:
                    self.anomaly = f"the loader replaced the storage of {pname}"
                    break
        return not self.anomaly

    def sink(self, dst, src, rest, kwargs):
        """`dst.copy_(src, *rest, **kwargs)` with the fast tier active: record it, pass it through, or give up."""
        if isinstance(dst, _TensorBase):
            entry = self.param_of.get(dst.untyped_storage()._cdata)
            fed = self.source_of.get(src.untyped_storage()._cdata) if isinstance(src, _TensorBase) else None
            # (non_blocking= only says when a real copy may return: nothing to record)
            if entry is not None and fed is not None and not rest and (not kwargs or kwargs.keys() == {"non_blocking"}):
                shape = dst.shape
                if src._version != 0:
                    self.give_up(f"{fed[0].name} was modified in place before it was copied into {entry[0]}")
                if src.dtype != fed[1] or src.shape != shape:
                    self.give_up(f"{fed[0].name} is copied into {entry[0]} through a dtype view or a broadcast")
                pname, param = entry
                self.rec.writes.append(ir.Write(
                    pname, ir.Region(dst.storage_offset() - param.storage_offset(), tuple(shape), dst.stride()),
                    ir.View(fed[0], ir.Region(src.storage_offset(), tuple(shape), src.stride()))))
                return dst
            if entry is not None and isinstance(src, _TensorBase):
                self.give_up(f"a tensor that is not a view of a fed checkpoint tensor is copied into {entry[0]}")
        self.check_untouched("Tensor.copy_", (dst, src) + tuple(rest), kwargs)
        return _COPY(dst, src, *rest, **kwargs)

    def fill(self, original, args, kwargs):
        """`param_view.fill_(v)` / `.zero_()` with a Python scalar, e.g. vocab padding rows: a Full write, as the
        full tier records it (_Recorder._param_write_without_source). Anything else goes to check_untouched."""
        dst = args[0] if args else None
        if isinstance(dst, _TensorBase) and not kwargs:
            entry = self.param_of.get(dst.untyped_storage()._cdata)
            value = 0 if original is _ZERO and len(args) == 1 else (
                args[1] if original is _FILL and len(args) == 2 and type(args[1]) in (bool, int, float) else None)
            if entry is not None and value is not None:
                out = original(*args)
                pname, param = entry
                sizes = tuple(dst.shape)
                self.rec.writes.append(ir.Write(pname, _region_in(dst, param),
                                                ir.View(ir.Full(value, sizes, dtype_name(dst.dtype)),
                                                        ir.full_region(sizes))))
                return out
        self.check_untouched(op_name(original), args, kwargs)
        return original(*args, **kwargs)

    def check_untouched(self, op: str, args, kwargs) -> None:
        for a in _tensor_args(args, kwargs):
            if a.device.type == "meta":
                key = a.untyped_storage()._cdata
                if key in self.source_of:
                    self.give_up(f"{op} on {self.source_of[key][0].name}")
                if key in self.param_of:
                    self.give_up(f"{op} on the parameter {self.param_of[key][0]}")


_ACTIVE_FAST: "_FastRecorder | None" = None


def _fast_hook(original):
    """The fast tier's wrapper of a hooked function (see _FastRecorder)."""
    if original is _COPY:
        def hooked_copy(dst, src=None, *rest, **kwargs):
            fast = _ACTIVE_FAST
            if fast is None:
                return original(dst, src, *rest, **kwargs)
            return fast.sink(dst, src, rest, kwargs)
        return hooked_copy
    if original is _FILL or original is _ZERO:
        def hooked_fill(*args, **kwargs):
            fast = _ACTIVE_FAST
            if fast is None:
                return original(*args, **kwargs)
            return fast.fill(original, args, kwargs)
        return hooked_fill
    name = op_name(original)
    is_factory = original in _FACTORIES

    def hooked(*args, **kwargs):
        fast = _ACTIVE_FAST
        if fast is not None:
            fast.check_untouched(name, args, kwargs)
            if is_factory:
                out = original(*args, **kwargs)
                if isinstance(out, _TensorBase) and out.device.type == "meta":
                    fast.give_up(f"the loader makes a scratch tensor ({name})")
                return out
            if original is _TO and args and isinstance(args[0], _TensorBase) and args[0].device.type != "meta":
                out = original(*args, **kwargs)
                if isinstance(out, _TensorBase) and out.device.type == "meta":
                    fast.give_up("the loader moves a constant tensor to the meta device")  # (see _Recorder.handle)
                return out
        return original(*args, **kwargs)
    return hooked


def _region_in(dst: torch.Tensor, param: torch.Tensor) -> ir.Region:
    return ir.Region(dst.storage_offset() - param.storage_offset(), tuple(dst.shape), tuple(dst.stride()))


def _as_rec(t):
    if isinstance(t, _TensorBase) and type(t) is not RecTensor and t.device.type == "meta":
        return _wrap(t)
    return t


def _tensor_args(args, kwargs) -> list:
    out = []
    for a in args:
        if isinstance(a, _TensorBase):
            out.append(a)
        elif type(a) is list or type(a) is tuple:
            out.extend(x for x in a if isinstance(x, _TensorBase))
    if kwargs:
        out.extend(a for a in kwargs.values() if isinstance(a, _TensorBase))
    return out


def _loader_frame(tb) -> str:
    """The innermost weight-loading function in a traceback: what to name in an error."""
    best = ""
    for frame in traceback.extract_tb(tb):
        if "shardplan" in frame.filename or "/torch/" in frame.filename:
            continue
        if "load" in frame.name:
            best = f"{frame.name} ({frame.filename.rsplit('site-packages/', 1)[-1]}:{frame.lineno})"
    return best


def record_loader(model: torch.nn.Module, tensors: Iterable[tuple[str, tuple[int, ...], str]], *, rank: int,
                  strict: bool = False, tier: str = "auto") -> RankRecording:
    """Record every write `model.load_weights` makes into a parameter from each checkpoint tensor.

    tier "auto": first the fast tier (`_FastRecorder`: plain meta tensors, only the sink hooked), which gives up at
    the first thing it cannot vouch for; then, if it gave up, the full tier on RecTensors (`_Recorder`) from the start.
    tier "full": the full tier only. Both give the same recording wherever the fast tier completes (tested)."""
    param_of: dict[int, tuple[str, torch.Tensor]] = {}
    params: dict[str, ir.TensorMeta] = {}
    for pname, p in list(model.named_parameters()) + list(model.named_buffers()):
        param_of.setdefault(_key(p), (pname, p))
        params.setdefault(pname, ir.TensorMeta(pname, tuple(p.shape), dtype_name(p.dtype)))
    rec = RankRecording(rank=rank, params=params)
    aliases = {pname: p.data for key, (pname, p) in param_of.items()}
    remaining = list(tensors)
    t0 = time.perf_counter()
    # The recording allocates a few small objects per tensor (RecTensor, IR records) on top of the loader's own, and
    # every ~700 allocations CPython's cycle collector runs, its older generations walking the whole heap (the model
    # with its thousands of modules and params): ~25% of a Kimi-K2 rank's recording time. Nothing recorded is cyclic
    # garbage worth collecting mid-load, so the collector is paused for the recording and resumed (not forced) after.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        if tier == "auto":
            fast = _FastRecorder(param_of, rank, params)
            if fast.run(model, remaining):
                fast.rec.seconds = time.perf_counter() - t0
                return fast.rec
            rec.tier_note = fast.anomaly
            for key, (pname, p) in param_of.items():  # undo `param.data = loaded` before the full tier runs
                if p.untyped_storage()._cdata != key:
                    p.data = aliases[pname]
        elif tier != "full":
            raise ValueError(f"tier must be 'auto' or 'full', not {tier!r}")
        rec.tier = "full"
        _record_all(model, remaining, rec, param_of, aliases, strict)
    finally:
        if gc_was_enabled:
            gc.enable()
    rec.seconds = time.perf_counter() - t0
    return rec


def _record_all(model, remaining: list, rec: RankRecording, param_of: dict, aliases: dict, strict: bool) -> None:
    while remaining:
        mode = _Recorder(param_of, rec)
        fed: list[str] = []

        def feed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, shape, dtype in remaining:
                t = RecTensor.make(shape, getattr(torch, dtype))
                mode.add_source(name, t)
                fed.append(name)
                rec.fed.append(name)
                yield name, t

        try:
            with _recording(mode):
                model.load_weights(feed())
                _check_param_storages(mode, aliases)
            remaining = []
        except _ValueRead as e:
            culprits = e.sources or {fed[-1]} if fed else e.sources
            _fallback(rec, culprits, e.op, e.reason, _loader_frame(e.__traceback__), strict)
            remaining = _unfinished(rec, remaining, len(fed), culprits) + remaining[len(fed):]
        except ShardplanError:
            raise
        except Exception as e:  # the loader itself failed on this tensor
            if not fed:
                raise RecordError(f"vLLM's load_weights failed before reading any tensor: {e}") from e
            _fallback(rec, {fed[-1]}, type(e).__name__, str(e).splitlines()[0][:300], _loader_frame(e.__traceback__),
                      strict)
            remaining = _unfinished(rec, remaining, len(fed), {fed[-1]}) + remaining[len(fed):]


def _check_param_storages(mode: "_Recorder", aliases: dict) -> None:
    """`param.data = loaded` (no torch function sees the setter): the parameter now *is* the loaded tensor, its
    storage and geometry, which a plan of copies cannot express. The consumer must run the real loader for it."""
    for key, (pname, p) in mode.param_of.items():
        new_key = p.untyped_storage()._cdata
        if new_key != key:
            p.data = aliases[pname]  # back to the parameter's own storage, for the loads still to come
            leaf = mode.leaf_of.get(new_key)
            if leaf is None:
                raise RecordError(f"the loader replaced the storage of parameter {pname} with a tensor that is not "
                                  f"a checkpoint tensor; shardplan cannot record that")
            sources: set[str] = set()
            ir._collect_sources(leaf, sources)
            raise _ValueRead(sources, "Tensor.data.set", f"the loader replaces the storage of {pname} "
                                                         f"(`param.data = ...`)")


def _unfinished(rec: RankRecording, remaining: list, num_fed: int, culprits: set[str]) -> list:
    """Tensors fed before the aborted load that wrote nothing yet, to feed again to the restarted load_weights: a
    loader may hold a tensor back (to fuse it with a later one) and the abort lost it. Re-feeding one that the loader
    skipped costs nothing; without this it would be wrongly reported as not needed."""
    read: set[str] = set()
    for w in rec.writes:
        ir._collect_sources(w.src.leaf, read)
    return [t for t in remaining[:num_fed] if t[0] not in read and t[0] not in culprits and t[0] not in rec.fallbacks]


def _fallback(rec: RankRecording, culprits: set[str], op: str, reason: str, loader: str, strict: bool) -> None:
    if strict:
        raise UnsupportedLoaderOp(
            f"cannot record the loader for {', '.join(sorted(culprits))}: {op} ({reason}) in {loader or 'the loader'}."
            f" Drop --strict to record it as a fallback (the consumer then receives the whole tensor and runs the "
            f"real loader).")
    for name in culprits:
        rec.fallbacks[name] = ir.Fallback(name, op, reason, loader)
    # a half-recorded tensor must not be replayed: drop whatever it already wrote
    rec.writes = [w for w in rec.writes if not (_sources(w) & culprits)]


def _sources(w: ir.Write) -> set[str]:
    out: set[str] = set()
    ir._collect_sources(w.src.leaf, out)
    return out
