"""The torch functions a recording hooks, and the one slot saying which recorder is active.

Both recorder tiers see the loader's calls on *plain* tensors (writes into params, scratch-tensor factories, `.to`,
in-place ops) through wrappers installed on these functions only while a recording runs (`hooks_installed`); the
wrappers find the running recorder in `ACTIVE.recorder`. Recordings do not nest: refused here, the one place both
tiers install hooks.
"""

from __future__ import annotations

import contextlib

import torch

from shardplan.record.recording import RecordError


class ActiveRecorder:
    """The recorder whose hooks are installed (None between recordings). Hot paths read `ACTIVE.recorder`."""

    __slots__ = ("recorder",)

    def __init__(self):
        self.recorder = None


ACTIVE = ActiveRecorder()

# the originals of what the tiers need to call or recognise, taken before any hook is installed
COPY = torch.Tensor.copy_
TO = torch.Tensor.to
FILL, ZERO = torch.Tensor.fill_, torch.Tensor.zero_
EMPTY = torch.empty
# What the recorder takes unwritten (torch.empty) memory to hold. One object: NaN != NaN, but tuples (so IR records)
# compare their elements by identity first, so two recordings of the same loader compare equal.
NAN = float("nan")
# factories whose meta results the recorder tracks as constants (see full.Recorder._factory); None: fill value argument
FACTORIES = {
    torch.zeros: 0,
    torch.ones: 1,
    torch.empty: NAN,
    torch.full: None,
    torch.Tensor.new_zeros: 0,
    torch.Tensor.new_ones: 1,
    torch.Tensor.new_empty: NAN,
    torch.Tensor.new_full: None,
}

# Functions whose calls on plain tensors the recorder must see. Wrapped only while a recording runs.
HOOKED_TENSOR_METHODS = (
    "to",
    "copy_",
    "fill_",
    "zero_",
    "__setitem__",
    "new_zeros",
    "new_ones",
    "new_empty",
    "new_full",
    "mul_",
    "add_",
    "sub_",
    "div_",
    "neg_",
    "exp_",
    "clamp_",
    "masked_fill_",
    "index_copy_",
    "index_fill_",
    "index_put_",
    "scatter_",
    "normal_",
    "uniform_",
    "abs_",
    "copysign_",
    "pow_",
    "sqrt_",
    "reciprocal_",
    "addcmul_",
    "addcdiv_",
    "lerp_",
    "t_",
    "transpose_",
    "squeeze_",
    "unsqueeze_",
    "resize_",
    "set_",
    "fill_diagonal_",
    "clamp_min_",
    "clamp_max_",
    "sign_",
    "log_",
    "tanh_",
    "sigmoid_",
    "exponential_",
    "bernoulli_",
)
HOOKED_TORCH_FUNCTIONS = ("zeros", "ones", "empty", "full")
ORIGINAL: dict = {f"Tensor.{n}": getattr(torch.Tensor, n) for n in HOOKED_TENSOR_METHODS}
ORIGINAL.update({f"torch.{n}": getattr(torch, n) for n in HOOKED_TORCH_FUNCTIONS})


@contextlib.contextmanager
def hooks_installed(wrap):
    """Replace each hooked torch function by `wrap(original)` for the block; the originals are back after it,
    whatever happens inside. The caller makes its recorder `ACTIVE.recorder` inside the block (and clears it)."""
    if ACTIVE.recorder is not None:
        raise RecordError("a recording is already running in this thread; recordings do not nest")
    for n in HOOKED_TENSOR_METHODS:
        setattr(torch.Tensor, n, wrap(ORIGINAL[f"Tensor.{n}"]))
    for n in HOOKED_TORCH_FUNCTIONS:
        setattr(torch, n, wrap(ORIGINAL[f"torch.{n}"]))
    try:
        yield
    finally:
        for n in HOOKED_TENSOR_METHODS:
            setattr(torch.Tensor, n, ORIGINAL[f"Tensor.{n}"])
        for n in HOOKED_TORCH_FUNCTIONS:
            setattr(torch, n, ORIGINAL[f"torch.{n}"])
