"""The recording tensor of the full tier: a meta tensor subclass with a checkpoint tensor's shape and dtype and no
data, through which `full.Recorder` sees every torch call made on a loaded tensor."""

from __future__ import annotations

import torch

from shardplan.record.hooks import ACTIVE, EMPTY
from shardplan.record.recording import dtype_name

_META = torch.device("meta")
make_subclass = torch.Tensor._make_subclass


def wrap(base: torch.Tensor) -> "RecTensor":
    """A RecTensor sharing `base`'s meta storage and geometry; `base` (a plain tensor) stays its `_plain` alias."""
    r = make_subclass(RecTensor, base)
    r._plain, r._shape, r._dtype, r._storage_key = base, base.shape, base.dtype, base.untyped_storage()._cdata
    return r


# pure view ops: the output shares the input's storage, its geometry is the whole record
FAST_VIEWS = {
    torch.Tensor.narrow,
    torch.Tensor.view,
    torch.Tensor.t,
    torch.Tensor.transpose,
    torch.Tensor.select,
    torch.Tensor.unsqueeze,
    torch.Tensor.squeeze,
    torch.Tensor.permute,
    torch.Tensor.expand,
}
NO_SUBCLASS_TF = torch._C.DisableTorchFunctionSubclass
PASSTHROUGH = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.stride,
    torch.Tensor.numel,
    torch.Tensor.storage_offset,
    torch.Tensor.element_size,
    torch.Tensor.is_contiguous,
    torch.Tensor.__len__,
    torch.Tensor.untyped_storage,
    torch.Tensor.is_floating_point,
    torch.Tensor.data_ptr,
    torch.Tensor.get_device,
    torch.Tensor.ndimension,
    torch.Tensor.nelement,
    torch.Tensor.shape.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.is_cuda.__get__,
    torch.Tensor.is_meta.__get__,
    torch.Tensor.requires_grad.__get__,
    torch.Tensor.layout.__get__,
    torch.Tensor.is_sparse.__get__,
    torch.Tensor.is_quantized.__get__,
}


class RecTensor(torch.Tensor):
    """A metadata-only checkpoint tensor: meta storage, real shape/dtype. All the recording is done by `Recorder`,
    which identifies these tensors by storage. The subclass's own __torch_function__ does nothing but make torch list
    RecTensor in `types` when one is among a call's arguments: the recorder's fast path for every other call is then
    `if not types`, without scanning arguments (the loader makes ~20 torch calls per tensor, mostly on params)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        rec = ACTIVE.recorder
        self = args[0] if args else None
        if type(self) is RecTensor and not kwargs:
            # The two hot cases, ~2 per tensor in vLLM's loaders, answered on the plain meta alias `_plain` (same
            # storage and geometry): no context manager, no second trip through torch's dispatch. Metadata queries
            # (size(), dim(), ...) outside a recording or from the recorder itself:
            if func in PASSTHROUGH or rec is None or rec.busy:
                return func(self._plain, *args[1:])
            # A pure view op (narrow, view, transpose, ...) while no loader scratch tensor exists: its output shares
            # the loaded tensor's storage, so its geometry is its whole record (see Recorder.handle for the rest).
            if func in FAST_VIEWS and not rec.num_scratch:
                out = func(self._plain, *args[1:])
                rec.fast_counts[func] = rec.fast_counts.get(func, 0) + 1
                r = make_subclass(RecTensor, out)
                r._plain, r._shape, r._dtype, r._storage_key = out, out.shape, out.dtype, self._storage_key
                return r
        if rec is None or rec.busy or func in PASSTHROUGH:
            with NO_SUBCLASS_TF():
                return func(*args, **kwargs) if kwargs else func(*args)
        return rec.dispatch(func, types, args, kwargs)

    @staticmethod
    def make(shape, dtype: torch.dtype) -> "RecTensor":
        rec = ACTIVE.recorder
        if rec is not None and rec.full_mode is not None:
            # fed lazily, so possibly while the recorder's mode is active: keep this torch.empty out of it (the mode
            # would take it for a loader scratch tensor, see Recorder._factory)
            with torch._C.DisableTorchFunction():
                base = EMPTY(shape, dtype=dtype, device="meta")
        else:
            base = EMPTY(shape, dtype=dtype, device="meta")
        r = make_subclass(RecTensor, base)
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
        with NO_SUBCLASS_TF():
            self._plain = torch.Tensor.as_strided(
                self, torch.Tensor.size(self), torch.Tensor.stride(self), torch.Tensor.storage_offset(self)
            )
            self._shape, self._dtype = self._plain.shape, self._plain.dtype
            self._storage_key = self._plain.untyped_storage()._cdata


def storage_key(t: torch.Tensor) -> int:
    """What identifies a tensor's storage while recording (RecTensors cache it)."""
    if type(t) is RecTensor:
        return t._storage_key
    return t.untyped_storage()._cdata
