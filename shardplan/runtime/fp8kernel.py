"""The fused block-FP8 quantizing pack on CUDA: one Triton launch (per source dtype) quantizes every block that a
QuantizingReplayer's fp8 segments read, straight from the trainer's tensors, writing the fp8 bytes into the pack buffer
where the segments sit and each block's float32 scale into one staging vector, from which the ordinary replay packs
the scale segments (a few bytes, in whatever geometry the loader chose: vLLM upsamples scales for refined grids).

A program quantizes one bn x bk block exactly as the reference quantizer does (runtime/quantize.py,
`quantize_blocks`: the whole block, zero-padded at the tensor's edge) and stores the block's fp8 bytes that fall in
one segment's window: a segment may start or end inside a block (Qwen3-30B-A3B's 192-row TP shards of 128-row
blocks); a block no segment reads in fp8 only gets its scale. The programs are plan-only work (`FusedQuantPlan`,
built once per QuantizingReplayer); a bind adds the tensors' addresses (`FusedQuantBinding`). Triton is imported only
when a CUDA bind launches it (the CPU venv has none); `FusedQuantPlan.run_reference` runs the same programs with
torch, for checks without a GPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from shardplan.plan import ir
from shardplan.runtime.tensors import broadcast_region, collapse

FP8 = "float8_e4m3fn"
NUM_WARPS = 4  # per 128 x 128 program: 128 elements a thread (docs/benchmarks.md: 4, 8, 16 and cache hints)
MAX_SCALE_OUTS = 8  # a block's scale goes to at most this many buffer places from the kernel itself, else a gather
# programs: weight id, block row, block col (of the weight), out (byte offset in the buffer where the block's [0, 0]
# element would sit), out_stride (bytes per row there), window [r0, r1) x [c0, c1) (block coordinates: the elements the
# segment holds; empty for a scale-only program), scale (element offset in the staging vector)
PROGRAM_COLUMNS = ("weight", "block_row", "block_col", "out", "out_stride", "r0", "r1", "c0", "c1", "scale")
# a launch's table: the same with the weight and block turned into the source element offset (from the launch's
# source base), its row stride and the block's rows and cols inside the tensor; then SCALE_OUTS float32 offsets in the
# buffer where the block's scale goes (-1: none)
TABLE_COLUMNS = ("src", "src_stride", "rows", "cols", "out", "out_stride", "r0", "r1", "c0", "c1", "scale")


def _segment_box(region: ir.Region, dst_sizes, shape) -> tuple[int, int, int, int] | None:
    """(row0, row1, col0, col1) when a segment's bytes (source `region` read in destination shape `dst_sizes`) are a
    plain row-major box of a contiguous [rows, cols] tensor of `shape` (a TP narrow, an EP expert, a whole tensor),
    else None (transposed, strided or broadcast reads)."""
    region = broadcast_region(region, tuple(dst_sizes))
    if region is None or any(stride == 0 and size > 1 for size, stride in zip(region.sizes, region.strides)):
        return None
    sizes, strides = collapse(region.sizes, region.strides)
    cols = shape[1]
    row0, col0 = divmod(region.offset, cols)
    if len(sizes) == 1 and strides == (1,):
        n = sizes[0]
        if col0 + n <= cols:
            return row0, row0 + 1, col0, col0 + n
        if col0 == 0 and n % cols == 0:
            return row0, row0 + n // cols, 0, cols
        return None
    if len(sizes) == 2 and strides == (cols, 1) and col0 + sizes[1] <= cols:
        return row0, row0 + sizes[0], col0, col0 + sizes[1]
    return None


@dataclass(frozen=True)
class FusedQuantPlan:
    """Which segments of a QuantizingReplayer's layout the kernel packs, and its programs (PROGRAM_COLUMNS)."""

    block: tuple[int, int]
    weights: tuple[str, ...]  # the weights the kernel quantizes (programs' weight ids index this)
    boxes: Mapping[str, tuple]  # each one's quantized box ((r0, r1), (c0, c1)), block-aligned at its start
    scale_offsets: Mapping[str, int]  # element offset of each one's staged scales in the staging vector
    scale_numel: int
    segments: tuple[int, ...]  # layout segments whose bytes the kernel writes
    rest: tuple[int, ...]  # the other segments (the ordinary replay packs them)
    eager: tuple[str, ...]  # quantized weights the kernel cannot serve (staged by the eager quantizer)
    programs: np.ndarray  # [n, len(PROGRAM_COLUMNS)] int64
    gather: tuple[np.ndarray, np.ndarray]  # scale segments' elements: (staging index, float32 index in the buffer)

    @classmethod
    def build(
        cls, inner, boxes: Mapping[str, tuple], block: tuple[int, int], quantized, scale_names: Mapping[str, str]
    ) -> "FusedQuantPlan":
        """`inner`: the QuantizingReplayer's Replayer (plans rebased into the staged boxes); `quantized`: the weights
        its packs read (fp8 or scales); `scale_names`: each weight's scale tensor."""
        weight_of_scale = {scale: weight for weight, scale in scale_names.items()}
        bn, bk = block
        table = inner.layout.segments
        by_rank = {p.rank: p for p in inner.plans}
        fused: dict[str, list] = {}
        scale_reads: list[tuple] = []
        eager: set[str] = set()
        rest: list[int] = []
        for i in range(len(table)):
            ref = int(table.ref_start[i])
            w = by_rank[int(table.ref_rank[ref])].writes[int(table.ref_index[ref])]
            leaf = w.src.leaf
            if not isinstance(leaf, ir.Source):
                eager.update(n for n in ir.sources(leaf) if n in boxes)  # a computed write reads the staged fp8
                rest.append(i)
                continue
            if leaf.name not in boxes:
                weight = weight_of_scale.get(leaf.name)
                if weight in boxes and table.dtypes[table.dtype[i]] == "float32":
                    scale_reads.append((i, weight, w.src.region))  # gathered from the staging vector
                else:
                    rest.append(i)  # a tensor that is not quantized
                continue
            box = None
            if table.dtypes[table.dtype[i]] == FP8:
                (r0, r1), (c0, c1) = boxes[leaf.name]
                shape = tuple(table.shape[i, : table.shape_ndim[i]].tolist())
                local = _segment_box(w.src.region, shape, (r1 - r0, c1 - c0))
                if local is not None:
                    box = (local[0] + r0, local[1] + r0, local[2] + c0, local[3] + c0)
            if box is None:
                eager.add(leaf.name)
            fused.setdefault(leaf.name, []).append((i, box))
        weights = tuple(w for w in sorted(quantized) if w not in eager)
        segments = []
        for name in eager:
            rest += [i for i, _ in fused.get(name, ())]
        scale_offsets, numel = {}, 0
        programs = []
        for wid, name in enumerate(weights):
            (r0, r1), (c0, c1) = boxes[name]
            grid = (math.ceil((r1 - r0) / bn), math.ceil((c1 - c0) / bk))
            scale_offsets[name] = numel
            numel += -(-grid[0] * grid[1] // 4) * 4  # 16-byte aligned staged scale tensors
            covered = np.zeros(grid, dtype=bool)
            for i, (ar0, ar1, ac0, ac1) in fused.get(name, ()):
                segments.append(i)
                nc = ac1 - ac0
                br, bc = np.meshgrid(
                    np.arange(ar0 // bn, -(-ar1 // bn)), np.arange(ac0 // bk, -(-ac1 // bk)), indexing="ij"
                )
                br, bc = br.ravel(), bc.ravel()
                covered[br - r0 // bn, bc - c0 // bk] = True
                out = int(table.offset[i]) + (br * bn - ar0) * nc + (bc * bk - ac0)
                programs.append(
                    np.stack(
                        [
                            np.full_like(br, wid),
                            br,
                            bc,
                            out,
                            np.full_like(br, nc),
                            np.maximum(ar0 - br * bn, 0),
                            np.minimum(ar1 - br * bn, bn),
                            np.maximum(ac0 - bc * bk, 0),
                            np.minimum(ac1 - bc * bk, bk),
                            scale_offsets[name] + (br - r0 // bn) * grid[1] + (bc - c0 // bk),
                        ],
                        axis=1,
                    )
                )
            br, bc = np.nonzero(~covered)  # blocks whose scale is read but no fp8 byte: scale-only programs
            if len(br):
                br, bc = br + r0 // bn, bc + c0 // bk
                zero = np.zeros_like(br)
                programs.append(
                    np.stack(
                        [
                            np.full_like(br, wid),
                            br,
                            bc,
                            zero,
                            zero,
                            zero,
                            zero,
                            zero,
                            zero,
                            scale_offsets[name] + (br - r0 // bn) * grid[1] + (bc - c0 // bk),
                        ],
                        axis=1,
                    )
                )
        programs = (
            np.concatenate(programs).astype(np.int64)
            if programs
            else np.zeros((0, len(PROGRAM_COLUMNS)), dtype=np.int64)
        )
        # scale segments of the kernel's weights: one gather from the staging vector (a refined scale grid's upsampled
        # reads are hundreds of tiny broadcast views: one kernel each in the ordinary replay)
        gather_src, gather_dst = [], []
        for i, weight, region in scale_reads:
            if weight not in scale_offsets:
                rest.append(i)
                continue
            shape = tuple(table.shape[i, : table.shape_ndim[i]].tolist())
            full = broadcast_region(region, shape)
            index = np.full(shape, full.offset, dtype=np.int64)
            for d, (size, stride) in enumerate(zip(full.sizes, full.strides)):
                index += (np.arange(size, dtype=np.int64) * stride).reshape(
                    (1,) * d + (size,) + (1,) * (len(shape) - d - 1)
                )
            segments.append(i)
            gather_src.append(scale_offsets[weight] + index.ravel())
            gather_dst.append(int(table.offset[i]) // 4 + np.arange(index.size, dtype=np.int64))
        gather = (
            np.concatenate(gather_src) if gather_src else np.zeros(0, dtype=np.int64),
            np.concatenate(gather_dst) if gather_dst else np.zeros(0, dtype=np.int64),
        )
        return cls(
            block,
            weights,
            {n: boxes[n] for n in weights},
            scale_offsets,
            numel,
            tuple(sorted(segments)),
            tuple(sorted(rest)),
            tuple(sorted(eager)),
            programs,
            gather,
        )

    def tables(self, tensors: list[torch.Tensor], ptrs: list[int], out: torch.Tensor) -> "_Tables":
        """The launches' tables for tensors of this geometry, each program's source offset taken from its own tensor's
        start (a bind adds the tensor's distance from the launch's base), on out's device; cached per geometry."""
        key = (
            out.device,
            out.data_ptr() % 16,
            tuple((t.dtype, tuple(t.shape), t.stride(0), p % 16) for t, p in zip(tensors, ptrs)),
        )
        cache = self.__dict__.setdefault("_tables", {})
        if key not in cache:
            if len(cache) >= 8:
                cache.pop(next(iter(cache)))
            cache[key] = _Tables.build(self, tensors, ptrs, out)
        return cache[key]

    def staged_scales(self, scales: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each kernel-quantized weight's staged scale tensor (a view of the staging vector `scales`)."""
        bn, bk = self.block
        out = {}
        for name in self.weights:
            (r0, r1), (c0, c1) = self.boxes[name]
            grid = (math.ceil((r1 - r0) / bn), math.ceil((c1 - c0) / bk))
            at = self.scale_offsets[name]
            out[name] = scales[at : at + grid[0] * grid[1]].view(grid)
        return out

    def run_reference(
        self, tensors: Mapping[str, torch.Tensor], out: torch.Tensor, scales: torch.Tensor, quantize_blocks
    ) -> None:
        """The programs run one by one with the reference quantizer `quantize_blocks` (runtime/quantize.py's; torch,
        any device): what the kernel computes."""
        bn, bk = self.block
        fp8 = out.view(torch.float8_e4m3fn)
        for wid, br, bc, at, stride, r0, r1, c0, c1, scale in self.programs.tolist():
            x = tensors[self.weights[wid]][br * bn : (br + 1) * bn, bc * bk : (bc + 1) * bk]
            q, s = quantize_blocks(x, self.block)
            scales[scale] = s[0, 0]
            for r in range(r0, r1):
                fp8[at + r * stride + c0 : at + r * stride + c1] = q[r, c0:c1]
        src, dst = (torch.from_numpy(a).to(out.device) for a in self.gather)
        out.view(torch.float32)[dst] = scales[src]

    def binding(
        self, tensors: Mapping[str, torch.Tensor], out: torch.Tensor, scales: torch.Tensor
    ) -> "FusedQuantBinding":
        return FusedQuantBinding(self, tensors, out, scales)


@dataclass
class _Tables:
    """A geometry's launch tables (FusedQuantPlan.tables), on the host: per launch the table (TABLE_COLUMNS, `src`
    relative to the program's own tensor), each row's weight index (for its tensor's address), the dtype, vector
    widths and FULL; the scale gather's index pairs (on the device: read-only, shared by the bindings)."""

    launches: list
    scale_outs: int
    gather: tuple[torch.Tensor, torch.Tensor]

    @classmethod
    def build(cls, plan: FusedQuantPlan, tensors: list[torch.Tensor], ptrs: list[int], out: torch.Tensor) -> "_Tables":
        # each block's scale is stored by its program at the buffer places the scale segments read (the gather's
        # pairs, by staging index); a fan-out above MAX_SCALE_OUTS keeps the gather kernels instead
        g_src, g_dst = plan.gather
        order = np.argsort(g_src, kind="stable")
        g_src, g_dst = g_src[order], g_dst[order]
        lo = np.searchsorted(g_src, plan.programs[:, 9], "left")
        fan = np.searchsorted(g_src, plan.programs[:, 9], "right") - lo
        scale_outs = int(fan.max(initial=0))
        direct = scale_outs <= MAX_SCALE_OUTS
        if not direct:
            scale_outs = 0
        dests = np.full((len(plan.programs), scale_outs), -1, dtype=np.int64)
        for k in range(scale_outs):
            has = fan > k
            dests[has, k] = g_dst[lo[has] + k]
        bn, bk = plan.block
        progs = plan.programs
        wid = progs[:, 0]
        misaligned = np.asarray([p % 16 for p in ptrs] + [0], dtype=np.int64)  # (the key: the same for the geometry)
        row_stride = np.asarray([t.stride(0) for t in tensors] + [0], dtype=np.int64)
        shape = np.asarray([t.shape for t in tensors] + [(0, 0)], dtype=np.int64).reshape(-1, 2)
        dtypes = [t.dtype for t in tensors]
        launches = []
        for dtype in sorted(set(dtypes), key=str):
            mine = np.asarray([d == dtype for d in dtypes] + [False])[wid]
            if not mine.any():
                continue
            p = progs[mine]
            w = p[:, 0]
            itemsize = dtype.itemsize
            src = p[:, 1] * bn * row_stride[w] + p[:, 2] * bk
            rows = np.minimum(bn, shape[w, 0] - p[:, 1] * bn)
            cols = np.minimum(bk, shape[w, 1] - p[:, 2] * bk)
            if (row_stride[w] * bn >= 1 << 31).any() or (p[:, 4] * bn >= 1 << 31).any():
                raise ValueError("a block's row offsets overflow 32 bits (the kernel's in-block offsets are int32)")
            table = np.concatenate(
                [np.stack([src, row_stride[w], rows, cols] + [p[:, k] for k in range(3, 10)], axis=1), dests[mine]],
                axis=1,
            )
            vec = 16 // itemsize
            aligned = (
                (src % vec == 0)
                & (row_stride[w] % vec == 0)
                & (cols % vec == 0)
                & (p[:, 3] % 16 == 0)
                & (p[:, 4] % 16 == 0)
                & (p[:, 7] % 16 == 0)
                & (p[:, 8] % 16 == 0)
            )
            # 16-byte aligned tensors (torch's allocations are): each one's distance from the base is whole vectors
            if any(m for m, d in zip(misaligned.tolist(), dtypes) if d == dtype) or out.data_ptr() % 16:
                aligned[:] = False
            full = (
                aligned
                & (rows == bn)
                & (cols == bk)
                & (p[:, 5] == 0)
                & (p[:, 6] == bn)
                & (p[:, 7] == 0)
                & (p[:, 8] == bk)
            )
            for kind, is_aligned, is_full in (
                (full, True, True),
                (aligned & ~full, True, False),
                (~aligned, False, False),
            ):  # whole blocks, aligned others, the rest
                if kind.any():
                    launches.append(
                        (
                            np.ascontiguousarray(table[kind]),
                            np.ascontiguousarray(w[kind]),
                            dtype,
                            vec if is_aligned else 1,
                            16 if is_aligned else 1,
                            is_full,
                        )
                    )
        gather = plan.gather if not direct else (np.zeros(0, dtype=np.int64),) * 2
        return cls(launches, scale_outs, tuple(torch.from_numpy(a).to(out.device) for a in gather))


class FusedQuantBinding:
    """The plan's programs with the bound tensors' addresses: one table (and launch) per source dtype and kind: whole
    blocks wholly in their segment (no masks), other 16-byte aligned rows (the kernel is told so and moves 16-byte
    vectors), the rest. `flag` turns 1 when a block held inf or NaN.

    Everything but the source addresses depends only on the plan and the tensors' geometry (shapes, strides, dtypes,
    16-byte alignment): built once per geometry (`FusedQuantPlan.tables`, host memory); a bind copies those tables,
    adds each program's tensor address and uploads them. So binding new tensors every sync (a source that gathers or
    converts per layer, cut-block staging) costs one numpy add and one upload per launch, not the table build."""

    def __init__(
        self, plan: FusedQuantPlan, tensors: Mapping[str, torch.Tensor], out: torch.Tensor, scales: torch.Tensor
    ):
        self.plan, self.out, self.scales = plan, out, scales
        self.tensors = [tensors[name] for name in plan.weights]
        # the launches address these storages (raw pointers, in a CUDA graph too): kept alive, so that a tensor
        # re-bound by `t.data = x` is read from its old bytes, never from freed memory, until the check names it
        self._storages = [t.untyped_storage() for t in self.tensors]
        ptrs = [t.data_ptr() for t in self.tensors]
        static = plan.tables(self.tensors, ptrs, out)
        self.scale_outs = static.scale_outs
        self.flag = torch.zeros(1, dtype=torch.int32, device=out.device)
        ptr = np.asarray(ptrs, dtype=np.int64)
        self.launches = []
        for table, weight, dtype, vec_src, vec_out, full in static.launches:
            base = min(p for p, t in zip(ptrs, self.tensors) if t.dtype == dtype)
            table = table.copy()
            table[:, 0] += (ptr[weight] - base) // dtype.itemsize
            base_tensor = next(t for p, t in zip(ptrs, self.tensors) if t.dtype == dtype and p == base)
            self.launches.append((torch.from_numpy(table).to(out.device), base_tensor, vec_src, vec_out, full))
        self._out_fp8 = out.view(torch.float8_e4m3fn)
        self._out_f32 = out.view(torch.float32)
        self._gather_src, self._gather_dst = static.gather
        self._gathered = torch.empty(len(self._gather_src), dtype=torch.float32, device=out.device)

    @property
    def num_programs(self) -> int:
        return len(self.plan.programs)

    def launch(self) -> None:
        """Enqueue the quantization of every block on the current stream (capturable in a CUDA graph)."""
        kernel = _kernel()
        bn, bk = self.plan.block
        for table, base, vec_src, vec_out, full in self.launches:
            kernel[(len(table),)](
                table,
                base,
                self._out_fp8,
                self.scales,
                self._out_f32,
                self.flag,
                BLOCK_R=bn,
                BLOCK_C=bk,
                VEC_SRC=vec_src,
                VEC_OUT=vec_out,
                FULL=full,
                SCALE_OUTS=self.scale_outs,
                num_warps=NUM_WARPS,
            )
        if len(self._gathered):
            torch.index_select(self.scales, 0, self._gather_src, out=self._gathered)
            self._out_f32.index_copy_(0, self._gather_dst, self._gathered)

    def nonfinite(self) -> bool:
        """Whether a launch since the last call met inf or NaN (waits for the stream: a host read)."""
        if not int(self.flag.item()):
            return False
        self.flag.zero_()
        return True


def available(device: torch.device, block: tuple[int, int]) -> str | None:
    """None when the fused kernel can run on `device` for this block size, else why not."""
    if device.type != "cuda":
        return f"the fused kernel runs on CUDA, the tensors are on {device}"
    if any(b & (b - 1) for b in block):
        return f"block {list(block)}: the fused kernel takes power-of-two block dims"
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
    def quantize_blocks_kernel(
        table,
        src_base,
        out_base,
        scale_base,
        out_f32,
        flag,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
        VEC_SRC: tl.constexpr,
        VEC_OUT: tl.constexpr,
        FULL: tl.constexpr,
        SCALE_OUTS: tl.constexpr,
    ):
        row = table + tl.program_id(0).to(tl.int64) * (11 + SCALE_OUTS)
        src = tl.multiple_of(tl.load(row), VEC_SRC)
        src_stride = tl.multiple_of(tl.load(row + 1).to(tl.int32), VEC_SRC)
        out = tl.multiple_of(tl.load(row + 4), VEC_OUT)
        out_stride = tl.multiple_of(tl.load(row + 5).to(tl.int32), VEC_OUT)
        scale_at = tl.load(row + 10)
        r = tl.arange(0, BLOCK_R)[:, None]
        c = tl.arange(0, BLOCK_C)[None, :]
        src_ptrs = src_base + src + (r * src_stride + c)
        out_ptrs = out_base + out + (r * out_stride + c)
        if FULL:  # a whole block inside the tensor, all of it in the segment: no masks
            x = tl.load(src_ptrs).to(tl.float32)
        else:
            rows = tl.load(row + 2).to(tl.int32)
            cols = tl.multiple_of(tl.load(row + 3).to(tl.int32), VEC_SRC)
            x = tl.load(src_ptrs, mask=(r < rows) & (c < cols), other=0.0).to(tl.float32)
        # inf or NaN anywhere makes amax inf (max ignores NaN, so NaN counts as inf): one reduction for both
        amax = tl.max(tl.max(tl.where(x == x, tl.abs(x), float("inf")), axis=1), axis=0)
        scale = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)  # correctly rounded, as the reference's exact_div
        inv = tl.math.div_rn(1.0, scale)  # as torch's 1.0 / scale
        q = (x * inv).to(tl.float8e4nv)
        if FULL:
            tl.store(out_ptrs, q)
        else:
            r0 = tl.load(row + 6).to(tl.int32)
            r1 = tl.load(row + 7).to(tl.int32)
            c0 = tl.multiple_of(tl.load(row + 8).to(tl.int32), VEC_OUT)
            c1 = tl.multiple_of(tl.load(row + 9).to(tl.int32), VEC_OUT)
            tl.store(out_ptrs, q, mask=(r >= r0) & (r < r1) & (c >= c0) & (c < c1))
        tl.store(scale_base + scale_at, scale)
        for k in tl.static_range(SCALE_OUTS):  # the scale segments' places of this block's scale
            at = tl.load(row + 11 + k)
            if at >= 0:
                tl.store(out_f32 + at, scale)
        if amax == float("inf"):
            tl.atomic_max(flag, 1)

    return quantize_blocks_kernel
