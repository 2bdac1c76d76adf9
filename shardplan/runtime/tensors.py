"""Tensor plumbing shared by the trainer (replay) and the consumer (apply): checks of given tensors, byte views of
storages, and the geometry helpers that turn a region into few large copies. torch and the plan package only."""

from __future__ import annotations

import os
from typing import Callable, Iterable, Sequence

import torch

from shardplan.errors import MissingTensorError, ReplayError
from shardplan.plan import ir
from shardplan.plan.interp import to_dtype


class TensorShapeError(ReplayError):
    """A given tensor's shape differs from the one the plan was recorded against."""


class TensorDTypeError(ReplayError):
    """A given tensor's dtype differs from the one the plan was recorded against."""


class TensorLayoutError(ReplayError):
    """A given tensor is not a contiguous tensor on the expected device (regions address a contiguous base)."""


class StaleBindingError(ReplayError):
    """A bound tensor or buffer no longer has the storage it had at bind time (re-bind after reallocating)."""


class PackBufferError(ReplayError):
    """The `out` buffer has the wrong size, dtype or device for the layout."""


# ---- geometry helpers -----------------------------------------------------------------------------------------
def device_bytes(device: torch.device) -> int:
    """Memory of the device replay allocates on: a CUDA device's total, else the host's physical memory."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf: no bound beyond the plan's own
        return 1 << 62


def check_fits(role: str, nbytes: int, device: torch.device) -> None:
    """PackBufferError, before allocating, when `nbytes` exceed the device's memory (a plan that declares a
    2^48-element param would otherwise end in a bare "can't allocate")."""
    if device.type == "meta":  # stand-ins: nothing is allocated
        return
    have = device_bytes(device)
    if nbytes > have:
        raise PackBufferError(
            f"{role} needs {nbytes} bytes on {device}, which has {have}: the plan declares more "
            f"than this device holds (a corrupt or hostile plan, or the wrong device)"
        )


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def broadcast_region(region: ir.Region, sizes: tuple[int, ...]) -> ir.Region | None:
    """The region as `copy_` reads it into a destination of `sizes` (broadcast dims get stride 0); None if it can't."""
    pad = len(sizes) - len(region.sizes)
    if pad < 0:
        return None
    src_sizes = (1,) * pad + tuple(region.sizes)
    src_strides = (0,) * pad + tuple(region.strides)
    strides = []
    for src_size, size, stride in zip(src_sizes, sizes, src_strides):
        if src_size == size:
            strides.append(stride)
        elif src_size == 1:
            strides.append(0)
        else:
            return None
    return ir.Region(region.offset, tuple(sizes), tuple(strides))


def collapse(sizes: Sequence[int], strides: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Fewest dims walking the same elements in the same (row-major) order: size-1 dims dropped, mergeable dims
    merged. The packed side is contiguous, so only the strided side's strides decide what merges."""
    out_sizes: list[int] = []
    out_strides: list[int] = []
    for size, stride in zip(sizes, strides):
        if size == 1:
            continue
        if out_sizes and out_strides[-1] == stride * size:
            out_sizes[-1] *= size
            out_strides[-1] = stride
        else:
            out_sizes.append(size)
            out_strides.append(stride)
    if not out_sizes:
        return (1,), (1,)
    return tuple(out_sizes), tuple(out_strides)


# Element types used to move same-dtype bytes in wider units: fewer index computations per byte in the copy kernels.
WIDE_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def widen(
    itemsize: int, sizes: tuple[int, ...], strides: tuple[int, ...], byte_offsets: Iterable[int], max_width: int = 8
) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Largest width (bytes) at which a strided view can be re-read as wider elements: innermost dim contiguous and
    every stride, size and offset divisible. Returns (width, sizes, strides) in units of that width."""
    byte_offsets = list(byte_offsets)
    width = max_width
    while width > itemsize:
        ratio = width // itemsize
        if (
            strides[-1] == 1
            and sizes[-1] % ratio == 0
            and all(s % ratio == 0 for s in strides[:-1])
            and all(o % width == 0 for o in byte_offsets)
        ):
            return width, sizes[:-1] + (sizes[-1] // ratio,), tuple(s // ratio for s in strides[:-1]) + (1,)
        width //= 2
    return itemsize, sizes, strides


def storage_view(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D `dtype` tensor over t's whole storage (offset 0): lets one `as_strided` address any byte range of it in
    any element width, without autograd or view-dtype restrictions."""
    storage = t.untyped_storage()
    itemsize = dtype.itemsize
    return torch.empty(0, dtype=dtype, device=t.device).set_(storage, 0, (storage.nbytes() // itemsize,), (1,))


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# CUDA builds of torch compare many tensors' data pointers in one C++ loop (made for CUDA-graph trees' static inputs);
# a Python data_ptr() call per tensor dominated a pack of a thousand small sources (docs/benchmarks.md)
_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def ptrs_unchanged(tensors: list[torch.Tensor], ptrs: list[int], index: list[int]) -> bool:
    """Every tensor still has the data pointer it had at bind time (`ptrs`; `index`: range(len(tensors)))."""
    if _PTRS_EQUAL is not None:
        return _PTRS_EQUAL(tensors, ptrs, index)
    return list(map(torch.Tensor.data_ptr, tensors)) == ptrs


# ---- devices ---------------------------------------------------------------------------------------------------
def resolve_device(device: torch.device | str | None) -> torch.device | None:
    """The device `device` names, with its index filled in as torch allocates on it: "cuda" (or torch.device("cuda"))
    is the current CUDA device, so it compares equal to the `cuda:N` a tensor reports. None stays None."""
    if device is None:
        return None
    device = torch.device(device)
    if device.index is None and device.type not in ("cpu", "meta"):
        module = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, ...: the backend's current device
        if module is not None and hasattr(module, "current_device") and module.is_available():
            return torch.device(device.type, module.current_device())
    return device


def describe_device(device: torch.device | str) -> str:
    """How an error names an expected device: its resolution, and what was given when that differs."""
    given = torch.device(device)
    resolved = resolve_device(given)
    return str(resolved) if resolved == given else f"{resolved} (the current device, given as {str(given)!r})"


# ---- validation of given tensors ------------------------------------------------------------------------------
def check_tensor(role: str, name: str, t, meta: ir.TensorMeta, device: torch.device | None) -> None:
    """Named error naming the tensor and what the plan expected, for a missing, mis-shaped, mistyped, strided or
    misplaced tensor. `role` is "trainer tensor" or "param"."""
    want = f"{meta.dtype}{list(meta.shape)}"
    if t is None:
        raise MissingTensorError(f"{role} {name!r} is missing: the plan expects a {want} tensor")
    if not isinstance(t, torch.Tensor):
        raise MissingTensorError(f"{role} {name!r} is a {type(t).__name__}, not a tensor: the plan expects {want}")
    if tuple(t.shape) != tuple(meta.shape):
        raise TensorShapeError(f"{role} {name!r} has shape {list(t.shape)}, the plan expects {want}")
    if t.dtype != to_dtype(meta.dtype):
        raise TensorDTypeError(
            f"{role} {name!r} has dtype {str(t.dtype).removeprefix('torch.')}, the plan expects {want}"
        )
    if not t.is_contiguous():
        raise TensorLayoutError(
            f"{role} {name!r} is not contiguous (strides {list(t.stride())}): plan regions "
            f"address a contiguous {want} tensor; pass t.contiguous()"
        )
    if device is not None and t.device != resolve_device(device):
        raise TensorLayoutError(
            f"{role} {name!r} is on {t.device}, expected {describe_device(device)}: move it "
            f"there or give the device it is on"
        )


GRAPH_BRANCHES = 1  # streams a stage of a captured graph forks into by default (docs/benchmarks.md: overlapping
# copies lost 10-22 points on apply, gained 0-2 on pack; the quantizing pack asks for its own)


def capture_graph(
    stages: Sequence[Sequence[Callable[[], object]]], device: torch.device, *, branches: int | None = None
) -> "torch.cuda.CUDAGraph":
    """Run the ops once on a side stream (lazy init, workspaces), then capture them into a CUDA graph. The ops must
    not allocate or synchronize (copies between prepared views don't). `stages` run in order; the ops of one stage
    write disjoint bytes and read none that another op of the stage writes, so they are captured on up to `branches`
    forked streams (default GRAPH_BRANCHES): parallel branches of the graph, whose kernels overlap instead of each
    draining the GPU before the next starts."""
    if device.type != "cuda":
        raise ReplayError(f"a CUDA graph needs CUDA tensors, these are on {device}")
    branches = GRAPH_BRANCHES if branches is None else branches
    stages = [list(stage) for stage in stages if stage]
    width = max([min(len(s), max(branches, 1)) for s in stages] + [1])
    stream = torch.cuda.Stream(device)
    forks = [torch.cuda.Stream(device) for _ in range(width - 1)]
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), torch.no_grad():
        for stage in stages:
            for op in stage:
                op()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        main = torch.cuda.current_stream(device)
        for stage in stages:
            lanes = [main] + forks[: min(len(stage), width) - 1]
            for lane in lanes[1:]:
                lane.wait_stream(main)
            for k, op in enumerate(stage):
                with torch.cuda.stream(lanes[k % len(lanes)]):
                    op()
            for lane in lanes[1:]:
                main.wait_stream(lane)
    return graph
