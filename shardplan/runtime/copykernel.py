"""One Triton launch for many strided copies on CUDA: the copies a bound replay or apply would launch one by one (a
strided copy per run, a batched cat per stack, a foreach copy of the rest) become rows of one table of boxes, and one
kernel moves them all, inside the CUDA graph (by default): no drain between kernels, most of what a graph lost to copy.

A copy pair (destination view, source view, same shape and element size) is a box: its dims jointly collapsed, the
innermost contiguous in both (else the pair keeps its torch copy), the dims above the row dim enumerated on the host.
Each box is cut into programs of BLOCK units (a unit: VEC elements of the launch's element type, 16 bytes where every
address and stride allows), moved TILE units a step. A program's row: source and destination element offsets of its
first row (from the launch's base tensors: the lowest storage on each side), their row strides, the box's width in
units, the column where the program starts and how many units it moves. Triton is imported only when a CUDA bind
launches it (the CPU venv has none); `BoxCopy.run_reference` runs the same table with torch on any device.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import numpy as np
import torch

BLOCK, TILE = 1024, 256  # units (16 B) a program moves, TILE a step (unrolled): fastest of those tried on the H200
NUM_WARPS = 4
_ELEM = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def pair_op(fn: Callable, pairs: list, label: str) -> Callable:
    """`fn` (a torch copy) with the (destination, source) view pairs it copies, for `fuse`."""
    fn.pairs, fn.label = pairs, label
    return fn


def _box(dst: torch.Tensor, src: torch.Tensor):
    """(byte sizes, dst byte strides, src byte strides) with the innermost dim contiguous in both, or None."""
    if dst.shape != src.shape or dst.element_size() != src.element_size() or dst.dtype != src.dtype:
        return None
    if dst.device != src.device or dst.numel() == 0:
        return None
    size = dst.element_size()
    dims = [(n, d * size, s * size) for n, d, s in zip(dst.shape, dst.stride(), src.stride()) if n != 1]
    if not dims:
        dims = [(1, size, size)]
    merged = [list(dims[-1])]
    for n, d, s in reversed(dims[:-1]):
        inner = merged[0]
        if d == inner[0] * inner[1] and s == inner[0] * inner[2]:
            inner[0] *= n
        else:
            merged.insert(0, [n, d, s])
    if merged[-1][1] != size or merged[-1][2] != size:
        return None  # innermost not contiguous on both sides (a transposed read): torch copies it
    sizes = [n for n, _, _ in merged]
    sizes[-1] *= size  # bytes
    return sizes, [d for _, d, _ in merged], [s for _, _, s in merged]


def split(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list, list]:
    """(pairs the kernel copies, pairs torch copies)."""
    mine, rest = [], []
    for p in pairs:
        (mine if _box(*p) is not None else rest).append(p)
    return mine, rest


class BoxCopy:
    """The kernel's tables for a list of (dst, src) view pairs whose destinations do not overlap (one launch per
    element width: normally one)."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], block: int = 0, tile: int = 0):
        self.block = block = block or BLOCK
        self.tile, self.num_warps = math.gcd(tile or TILE, block), NUM_WARPS  # (a tile divides the block)
        boxes = []  # per box: dst address, src address, rows, cols bytes, dst row stride, src row stride
        self.dst_tensors, self.src_tensors = [], []
        for dst, src in pairs:
            sizes, dst_strides, src_strides = _box(dst, src)
            cols = sizes[-1]
            rows, d_row, s_row = (sizes[-2], dst_strides[-2], src_strides[-2]) if len(sizes) > 1 else (1, cols, cols)
            outer = sizes[:-2]
            d0, s0 = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
            for n, d, s in zip(outer, dst_strides, src_strides):
                k = np.arange(n, dtype=np.int64)
                d0 = (d0[:, None] + k[None, :] * d).ravel()
                s0 = (s0[:, None] + k[None, :] * s).ravel()
            n = len(d0)
            boxes.append(
                np.stack(
                    [
                        d0 + dst.data_ptr(),
                        s0 + src.data_ptr(),
                        np.full(n, rows),
                        np.full(n, cols),
                        np.full(n, d_row),
                        np.full(n, s_row),
                    ],
                    axis=1,
                )
            )
            self.dst_tensors.append(dst)
            self.src_tensors.append(src)
        self.device = pairs[0][0].device if pairs else None
        self.dst_base = min(self.dst_tensors, key=lambda t: t.untyped_storage().data_ptr(), default=None)
        self.src_base = min(self.src_tensors, key=lambda t: t.untyped_storage().data_ptr(), default=None)
        table = np.concatenate(boxes).astype(np.int64) if boxes else np.zeros((0, 6), dtype=np.int64)
        self.launches = []
        self._bound = None
        if not len(table):
            return
        dst_base = self.dst_base.untyped_storage().data_ptr()
        src_base = self.src_base.untyped_storage().data_ptr()
        # the widest unit (16, 8, 4, 2, 1 bytes) dividing every address, width and stride of a box
        g = np.gcd.reduce([table[:, 0] - dst_base, table[:, 1] - src_base, table[:, 3], table[:, 4], table[:, 5]])
        g = np.gcd(np.gcd(g, 16), math.gcd(dst_base, src_base, 16))
        for unit in sorted(set(g.tolist()), reverse=True):
            b = table[g == unit]
            elem = min(unit, 4)
            vec = unit // elem
            units = b[:, 2] * (b[:, 3] // unit)  # units per box
            progs = -(-units // block)
            box = np.repeat(np.arange(len(b)), progs)
            first = np.repeat(np.cumsum(progs) - progs, progs)
            start = (np.arange(len(box)) - first) * block  # the program's first unit in its box
            cols = b[box, 3] // unit
            row0, col0 = start // cols, start % cols
            rows_table = np.stack(
                [
                    (b[box, 1] - src_base + row0 * b[box, 5]) // elem,
                    b[box, 5] // elem,
                    (b[box, 0] - dst_base + row0 * b[box, 4]) // elem,
                    b[box, 4] // elem,
                    cols,
                    col0,
                    np.minimum(block, units[box] - start),
                ],
                axis=1,
            )
            if (cols + block >= 1 << 31).any():
                raise ValueError("a box row of 2**31 units or more (the kernel's in-program offsets are int32)")
            self.launches.append((np.ascontiguousarray(rows_table), elem, vec))

    @property
    def num_programs(self) -> int:
        return sum(len(t) for t, _, _ in self.launches)

    def _bind(self):
        if self._bound is None:
            self._bound = [
                (
                    torch.from_numpy(t).to(self.device),
                    _storage(self.src_base, _ELEM[elem]),
                    _storage(self.dst_base, _ELEM[elem]),
                    vec,
                )
                for t, elem, vec in self.launches
            ]
        return self._bound

    def launch(self) -> None:
        """Enqueue every copy on the current stream: one kernel per element width (capturable in a CUDA graph)."""
        kernel = _kernel()
        for table, src, dst, vec in self._bind():
            kernel[(len(table),)](table, src, dst, VEC=vec, BLOCK=self.block, TILE=self.tile, num_warps=self.num_warps)

    def run_reference(self) -> None:
        """The programs one by one with torch on the tensors' device: what the kernel computes (checks the tables)."""
        for table, elem, vec in self.launches:
            spans = _spans(self.src_tensors, elem), _spans(self.dst_tensors, elem)
            for s, s_stride, d, d_stride, cols, col0, count in table.tolist():
                j = col0 + np.arange(count)
                r, c = j // cols, j % cols
                lane = np.arange(vec)
                si = (s + r * s_stride + c * vec)[:, None] + lane
                di = (d + r * d_stride + c * vec)[:, None] + lane
                _scatter(spans[1], di.ravel(), _gather(spans[0], si.ravel()))


def _storage(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    storage = t.untyped_storage()
    return torch.empty(0, dtype=dtype, device=t.device).set_(storage, 0, (storage.nbytes() // dtype.itemsize,), (1,))


def _spans(tensors, elem: int) -> list:
    """(start, stop, storage view) of each storage in elements from the base (the lowest storage)."""
    base = min(t.untyped_storage().data_ptr() for t in tensors)
    out, seen = [], set()
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        start = (st.data_ptr() - base) // elem
        out.append((start, start + st.nbytes() // elem, _storage(t, _ELEM[elem])))
    return out


def _locate(spans, index: np.ndarray):
    for start, stop, view in spans:
        inside = (index >= start) & (index < stop)
        if inside.all():
            return view, index - start
    raise AssertionError("a program reads or writes outside the pairs' storages")


def _gather(spans, index):
    view, at = _locate(spans, index)
    return view[torch.from_numpy(at).to(view.device)]


def _scatter(spans, index, values):
    view, at = _locate(spans, index)
    view[torch.from_numpy(at).to(view.device)] = values


def fuse(ops: Sequence[Callable], device: torch.device) -> list[Callable]:
    """`ops` with every pair the kernel can copy moved into one BoxCopy launch (first; the destinations of all ops must
    be disjoint), the other pairs in one foreach copy, ops without pairs kept. Unchanged where the kernel cannot run."""
    if available(device) is not None:
        return list(ops)
    pairs = [p for op in ops for p in getattr(op, "pairs", ())]
    mine, rest = split(pairs)
    if not mine:
        return list(ops)
    copy = BoxCopy(mine)
    out = [pair_op(lambda: copy.launch(), mine, f"box copy x{len(mine)} ({copy.num_programs} programs)")]
    out[0].box_copy = copy
    if rest:
        dsts, srcs = [d for d, _ in rest], [s for _, s in rest]
        out.append(pair_op(lambda: torch._foreach_copy_(dsts, srcs), rest, f"foreach_copy x{len(rest)}"))
    out += [op for op in ops if not hasattr(op, "pairs")]
    return out


def available(device: torch.device) -> str | None:
    """None when the kernel can run on `device`, else why not."""
    if device.type != "cuda":
        return f"the box-copy kernel runs on CUDA, the tensors are on {device}"
    try:
        _kernel()
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    return None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_boxes_kernel(table, src_base, dst_base, VEC: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr):
        row = table + tl.program_id(0).to(tl.int64) * 7
        src = tl.load(row)
        src_stride = tl.load(row + 1)
        dst = tl.load(row + 2)
        dst_stride = tl.load(row + 3)
        cols = tl.load(row + 4).to(tl.int32)
        col0 = tl.load(row + 5).to(tl.int32)
        count = tl.load(row + 6).to(tl.int32)
        for k in tl.static_range(BLOCK // TILE):
            i = k * TILE + tl.arange(0, TILE)
            if col0 + count <= cols:  # inside one row: no division
                s = src + (col0 + i).to(tl.int64) * VEC
                d = dst + (col0 + i).to(tl.int64) * VEC
            else:
                j = col0 + i
                r = j // cols
                c = (j - r * cols).to(tl.int64) * VEC
                r = r.to(tl.int64)
                s = src + r * src_stride + c
                d = dst + r * dst_stride + c
            if VEC == 1:
                x = tl.load(src_base + s, mask=i < count)
                tl.store(dst_base + d, x, mask=i < count)
            else:  # VEC elements a unit: one 16-byte access where the alignment hints hold
                s = tl.multiple_of(s, VEC)
                d = tl.multiple_of(d, VEC)
                lane = tl.arange(0, VEC)[None, :]
                mask = (i < count)[:, None]
                x = tl.load(src_base + s[:, None] + lane, mask=mask)
                tl.store(dst_base + d[:, None] + lane, x, mask=mask)

    return copy_boxes_kernel
