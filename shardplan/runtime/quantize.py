"""Quantize on replay: a block-FP8 consumer's bytes (float8_e4m3fn weights, float32 `weight_scale_inv`) packed
straight from the trainer's BF16 (or FP16/FP32) tensors, each rank from its own source boxes.

The reference quantizer (`REFERENCE`, `quantize_blocks`) is the one vLLM ships as `per_block_cast_to_fp8`
(vllm/utils/deep_gemm.py, taken from DeepGEMM's test utilities, the usual BF16 -> block-FP8 conversion for
DeepSeek-V3-style checkpoints): per bn x bk block (zero-padded at the tensor's edge) amax = max|x| in float32,
clamped below at 1e-4; scale = amax / 448 (the largest e4m3 value; a correctly rounded division, see `exact_div`);
fp8 = (x * (1 / scale)) rounded to e4m3 by torch's float32 -> float8_e4m3fn cast (round to nearest even, saturating
only because |x / scale| <= 448); weight_scale_inv = scale (it is the *dequantization* factor despite its name, as in
DeepSeek-V3's own checkpoints and its inference/fp8_cast_bf16.py, which computes bf16 = fp8 * weight_scale_inv).
`tests/integration/test_fp8_quantize.py` checks bitwise equality with vLLM's function.

Blocks never straddle two ranks: vLLM refuses block-FP8 layouts whose TP partitions are not whole blocks, so a rank's
box starts on a block boundary and ends on one or at the tensor's edge; a box that does not is a
`BlockAlignmentError`. Each pack re-quantizes the bound tensors' boxes into staging tensors shaped as those boxes,
then runs an ordinary `Replayer` over the plans with their source regions rebased into the boxes: a rank never
quantizes (or needs) another rank's rows. On CUDA the fused kernel (runtime/fp8kernel.py) quantizes the fp8 segments'
blocks straight into the buffer instead, bitwise the same; this eager path stays for CPU and as its reference.

torch and shardplan's plan/runtime packages only: loads on a trainer without vLLM.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Mapping, Sequence

import numpy as np
import torch

from shardplan.errors import MissingTensorError, ReplayError
from shardplan.plan import ir
from shardplan.plan.columns import columns_of
from shardplan.plan.names import SCALE_SUFFIX
from shardplan.runtime import fp8kernel, quantplan
from shardplan.runtime.pack import PackLayout, as_plans
from shardplan.runtime.replay import BoundReplay, Replayer
from shardplan.runtime.tensors import (
    StaleBindingError,
    TensorLayoutError,
    TensorShapeError,
    capture_graph,
    describe_device,
    ptrs_unchanged,
    resolve_device,
)

REFERENCE = "fp8-e4m3-block-amax448-v1"  # the name plan files give the reference quantizer
QUANTIZERS = (REFERENCE,)
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class QuantizeError(ReplayError):
    """Base of the quantizing replay's errors."""


class QuantizerMismatch(QuantizeError):
    """The plan expects a different quantizer than the one asked for (or none)."""


class QuantizerDTypeError(QuantizeError):
    """A trainer tensor the quantizer reads is not bfloat16, float16 or float32."""


class BlockAlignmentError(QuantizeError):
    """A rank's box of a quantized tensor does not start and end on block boundaries."""


class NonFiniteBlockError(QuantizeError):
    """A source block holds inf or NaN: its scale would be inf/NaN and every fp8 byte of the block wrong."""


def quantizer_id(block: tuple[int, int]) -> str:
    """How a plan file names the reference quantizer with a block size: "fp8-e4m3-block-amax448-v1/128x128"."""
    return f"{REFERENCE}/{block[0]}x{block[1]}"


def parse_quantizer(text: str) -> tuple[str, tuple[int, int]]:
    """(quantizer name, block) of a plan's quantizer id; QuantizerMismatch for anything this module cannot run."""
    name, _, block = (text or "").partition("/")
    dims = block.split("x")
    if name not in QUANTIZERS or len(dims) != 2 or not all(d.isdigit() and int(d) > 0 for d in dims):
        what = "no quantizer (it is not a quantized plan)" if not text else f"quantizer {text!r}"
        raise QuantizerMismatch(
            f"the plan expects {what}; this replay implements {REFERENCE!r}/<bn>x<bk> only. "
            f"Record the plan from a block-FP8 config (quantization_config.weight_block_size), or "
            f"replay an unquantized plan with runtime.replay.Replayer."
        )
    return name, (int(dims[0]), int(dims[1]))


def exact_div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor, correctly rounded on every device. torch on CUDA computes `tensor / python_float` as a multiply
    by the reciprocal, 1 ulp off in ~45% of blocks (measured on an H200, torch 2.11), which then moves fp8 bytes; a
    tensor divisor gets a true division on CPU and CUDA alike."""
    return torch.div(x, torch.full_like(x, divisor))


def quantize_blocks(x: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference quantizer: 2-D `x` -> (fp8 [rows, cols], float32 scales [ceil(rows/bn), ceil(cols/bk)])."""
    if x.dtype not in INPUT_DTYPES:
        raise QuantizerDTypeError(f"the block quantizer takes bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() != 2:
        raise QuantizeError(f"the block quantizer takes a 2-D tensor, got shape {list(x.shape)}")
    rows, cols = x.shape
    bn, bk = block
    padded = torch.zeros((math.ceil(rows / bn) * bn, math.ceil(cols / bk) * bk), dtype=x.dtype, device=x.device)
    padded[:rows, :cols] = x
    blocks = padded.view(-1, bn, padded.shape[1] // bk, bk)
    amax = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(AMAX_FLOOR)
    scale = exact_div(amax, E4M3_MAX)
    fp8 = (blocks * (1.0 / scale)).to(torch.float8_e4m3fn)
    return fp8.view_as(padded)[:rows, :cols].contiguous(), scale.view(blocks.shape[0], blocks.shape[2])


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |x| of each block of the last two dims of `x` in float32 ([..., row blocks, column blocks]; NaN where a
    block holds NaN; zero-padded at the edge), before the quantizer's floor: what the holders of a block cut between
    trainers exchange (runtime.shards.CutGroup). A max is exact in x's dtype, so it is taken there."""
    *lead, rows, cols = x.shape
    bn, bk = block
    padded_rows, padded_cols = math.ceil(rows / bn) * bn, math.ceil(cols / bk) * bk
    if (padded_rows, padded_cols) != (rows, cols):
        padded = torch.zeros((*lead, padded_rows, padded_cols), dtype=x.dtype, device=x.device)
        padded[..., :rows, :cols] = x
        x = padded
    blocks = x.reshape(*lead, padded_rows // bn, bn, padded_cols // bk, bk)
    return blocks.abs().amax(dim=(-3, -1)).float()


def check_finite(name: str, x: torch.Tensor, box: tuple[tuple[int, int], ...], block: tuple[int, int]) -> None:
    """NonFiniteBlockError naming the first block of `x` (the `box` of trainer tensor `name`) holding inf/NaN."""
    bad = ~torch.isfinite(x)
    if not bool(bad.any()):
        return
    row, col = (int(i) for i in bad.nonzero()[0])
    row, col = row + box[0][0], col + box[1][0]
    raise NonFiniteBlockError(
        f"trainer tensor {name!r} holds {x[row - box[0][0], col - box[1][0]].item()} at [{row}, {col}] (block "
        f"[{row // block[0]}, {col // block[1]}] of {list(block)}): its fp8 scale would not be finite. Fix the "
        f"weights (or skip this sync) before packing."
    )


def trainer_name_of(name: str, sources: Mapping[str, ir.TensorMeta]) -> str:
    """The trainer tensor a block-FP8 plan's checkpoint tensor comes from: a scale `X.weight_scale_inv` of an fp8
    `X.weight` comes from the weight; anything else from itself."""
    weight = name.removesuffix(SCALE_SUFFIX)
    if weight != name and weight in sources and sources[weight].dtype == "float8_e4m3fn":
        return weight
    return name


def trainer_meta(meta: ir.TensorMeta, sources: Mapping[str, ir.TensorMeta], dtype: str) -> ir.TensorMeta:
    """What the trainer holds for a plan's checkpoint tensor: a quantized fp8 weight in `dtype` (the plan's model
    dtype, which the quantizer reads), anything else as the plan says."""
    if meta.dtype == "float8_e4m3fn" and meta.name + SCALE_SUFFIX in sources:
        return ir.TensorMeta(meta.name, meta.shape, dtype)
    return meta


class QuantizingReplayer:
    """Packs block-FP8 consumer ranks' bytes from the trainer's high-precision tensors.

    `plans`: RankPlans recorded against the FP8 checkpoint (fp8 `X.weight`, float32 `X.weight_scale_inv`);
    `sources`: that checkpoint's tensor table (as the plan file's). The trainer binds its own tensors under the
    *weight* names (`X.weight`, bfloat16/float16/float32, full shape); it holds no scales. `quantizer`: the id the
    plan file names (`PlanHeader.quantizer`, e.g. "fp8-e4m3-block-amax448-v1/128x128"); any other quantizer, or none,
    is refused (QuantizerMismatch). `scales_with_reads`: refuse (BlockAlignmentError) a plan whose fp8 reads of
    partial blocks lie outside the scale blocks that plan reads (a plan of a layout that is not whole blocks); off for
    a sharded trainer's sub-plans, whose consumer may get those scales from another trainer rank. Other options go to
    `Replayer`."""

    def __init__(
        self,
        plans: ir.RankPlan | Sequence[ir.RankPlan],
        sources: Mapping[str, ir.TensorMeta],
        *,
        quantizer: str,
        scales_with_reads: bool = True,
        **replayer_options,
    ):
        _, self.block = parse_quantizer(quantizer)
        self._scales_with_reads = scales_with_reads
        self.quantizer = quantizer
        self.plans = as_plans(plans)
        self.sources = sources
        # columnar (runtime/quantplan.py): tensors by id, names only where a caller asks
        ids, cols = quantplan.common_ids(self.plans, sources)
        reads = quantplan.plan_reads(ids, cols)
        read = quantplan.distinct(reads.src, np.asarray(sorted(reads.whole), dtype=np.int64))
        weight_of = ids.renamed(read, quantplan.drop_scale)
        # the quantized weights: fp8 [rows, cols] tensors with a scale table, read themselves or through their scales
        cand = quantplan.distinct(read, weight_of)
        cand_scale = ids.renamed(cand, quantplan.add_scale)
        rows, cols_, two, dtype = quantplan.metas(ids, sources, cand)
        s_rows, s_cols, s_two, _ = quantplan.metas(ids, sources, np.maximum(cand_scale, 0))
        ok = (dtype == "float8_e4m3fn") & two & (cand_scale >= 0) & s_two
        weights, scales = cand[ok], cand_scale[ok]
        rows, cols_, s_rows, s_cols = rows[ok], cols_[ok], s_rows[ok], s_cols[ok]
        box = self._boxes(ids, reads, weights, scales, (rows, cols_, s_rows, s_cols), cols)
        self.boxes = quantplan.Boxes(ids, weights, box)
        self._scale_ids = scales
        # the bytes sit where the consumer's own layout (of the plans as recorded) puts them: rebased sources can
        # order a group's segments differently (the layout breaks ties by source geometry)
        layout = PackLayout.from_plans(
            self.plans, replayer_options.get("alignment", 256), replayer_options.get("max_group_bytes")
        )
        bn, bk = self.block
        b_rows, b_cols = box[:, 1] - box[:, 0], box[:, 3] - box[:, 2]
        override = [
            np.concatenate([weights, scales]),
            np.concatenate([b_rows, -(-b_rows // bn)]),
            np.concatenate([b_cols, -(-b_cols // bk)]),
            np.repeat(np.asarray([0, 1], dtype=np.int64), [len(weights), len(scales)]),  # quantplan.STAGED_DTYPES
        ]
        order = np.argsort(override[0], kind="stable")
        staged = quantplan.StagedIds(ids, sources, [x[order] for x in override])
        rebased = quantplan.rebased_plans(self.plans, cols, staged, reads, self._steps, self._moved, self._rebase_view)
        del self._moved, self._steps
        self.inner = Replayer(rebased, staged.table, layout=layout, **replayer_options)
        self.plans = self.inner.plans  # the rebased plans (same params, writes and source names)
        self._groups: dict[str, QuantizingReplayer] = {}
        self._finish()

    def _boxes(self, ids, reads, weights, scales, shapes, cols) -> np.ndarray:
        """[n, 4] (r0, r1, c0, c1) of each weight: the union of what the plans read of it and of its scale, widened to
        whole blocks; the whole tensor where a read is not a plain box (or goes through an Update's base). Checks
        the fp8 reads' blocks (_uncovered) and keeps the reads to rebase (`self._moved`)."""
        rows, cols_, s_rows, s_cols = shapes
        bn, bk = self.block
        n = len(weights)
        # which tensor each read reads, as a row of the stacked tables [weights, scales]: one gather by tensor id
        at = np.full(int(max(reads.src.max(initial=-1), weights.max(initial=-1), scales.max(initial=-1))) + 2, -1)
        at[weights] = np.arange(n)
        at[scales] = np.arange(n, 2 * n)
        kk = at[reads.src]
        mine = np.flatnonzero(kk >= 0)
        kk = kk[mine]
        is_s = kk >= n
        k = np.where(is_s, kk - n, kk)  # the weight
        t_rows, t_cols = np.concatenate([rows, s_rows]), np.concatenate([cols_, s_cols])
        got = quantplan.boxes_of(reads.offset[mine], reads.klass[mine], reads.sizes, reads.strides, t_cols[kk])
        r0, r1, c0, c1, valid, pair, self._steps = got
        full = np.zeros(n, dtype=bool)
        full[k[~valid]] = True
        full |= np.isin(weights, sorted(reads.whole)) | np.isin(scales, sorted(reads.whole))
        fr, fc = np.where(is_s, bn, 1), np.where(is_s, bk, 1)
        lo_r, hi_r, lo_c, hi_c = rows.copy(), np.zeros(n, np.int64), cols_.copy(), np.zeros(n, np.int64)
        np.minimum.at(lo_r, k, r0 * fr)
        np.maximum.at(hi_r, k, np.minimum(r1 * fr, rows[k]))
        np.minimum.at(lo_c, k, c0 * fc)
        np.maximum.at(hi_c, k, np.minimum(c1 * fc, cols_[k]))
        lo_r, lo_c, hi_r, hi_c = lo_r // bn * bn, lo_c // bk * bk, -(-hi_r // bn) * bn, -(-hi_c // bk) * bk
        box = np.stack([lo_r, np.minimum(hi_r, rows), lo_c, np.minimum(hi_c, cols_)], axis=1)
        box[full] = np.stack([np.zeros(n, np.int64), rows, np.zeros(n, np.int64), cols_], axis=1)[full]
        plan = reads.plan[mine]
        if self._scales_with_reads:
            self._uncovered(ids, weights, rows, cols_, k, plan, ~is_s, is_s, valid & ~full[k], (r0, r1, c0, c1))
        # reads to rebase: into the box (a scale's, in blocks), unless the box is the whole tensor; per stacked row
        b_r0 = np.concatenate([box[:, 0], box[:, 0] // bn])
        b_c0 = np.concatenate([box[:, 2], box[:, 2] // bk])
        b_cols = np.concatenate([box[:, 3] - box[:, 2], -(-box[:, 3] // bk) - box[:, 2] // bk])
        b_rows = np.concatenate([box[:, 1] - box[:, 0], -(-box[:, 1] // bn) - box[:, 0] // bn])
        keep = (b_r0 == 0) & (b_c0 == 0) & (b_cols == t_cols) & (b_rows == t_rows)  # the whole tensor
        keep |= np.concatenate([full, full])
        write = reads.write[mine]
        move = np.flatnonzero(valid & ~keep[kk] & (write >= 0))
        km = kk[move]
        new_off = (r0[move] - b_r0[km]) * b_cols[km] + (c0[move] - b_c0[km])
        self._moved = (plan[move], write[move], new_off, pair[move], b_cols[km])
        return box

    def _uncovered(self, ids, weights, rows, cols_, k, plan, is_w, is_s, checked, box) -> None:
        """BlockAlignmentError unless every fp8 read is whole blocks (or stops at the tensor's edge) or lies in scale
        blocks the same rank reads (a refined scale grid: vLLM's loader upsamples those scales)."""
        bn, bk = self.block
        r0, r1, c0, c1 = box
        aligned = (r0 % bn == 0) & ((r1 % bn == 0) | (r1 == rows[k])) & (c0 % bk == 0)
        aligned &= (c1 % bk == 0) | (c1 == cols_[k])
        check = np.flatnonzero(checked & is_w & ~aligned)
        if not len(check):
            return
        scale = np.flatnonzero(checked & is_s)
        key = k * len(self.plans) + plan
        bad = quantplan.uncovered(
            key[check],
            (r0[check] // bn, -(-r1[check] // bn)),
            (c0[check] // bk, -(-c1[check] // bk)),
            key[scale],
            (r0[scale], r1[scale]),
            (c0[scale], c1[scale]),
        )
        if bad < 0:
            return
        i = check[bad]
        weight = ids.name(int(weights[k[i]]))
        rank = self.plans[int(plan[i])].rank
        raise BlockAlignmentError(
            f"rank {rank} reads rows/cols {[[int(r0[i]), int(r1[i])], [int(c0[i]), int(c1[i])]]} of {weight!r} "
            f"({[int(rows[k[i]]), int(cols_[k[i]])]}), which are not whole {list(self.block)}-blocks and not within "
            f"the scale blocks it reads, so its fp8 bytes would depend on scales it never receives. The plan's "
            f"layout is not block-aligned for block {list(self.block)} (record it from a config with this "
            f"weight_block_size)."
        )

    def _rebase_leaf(self, leaf):
        if isinstance(leaf, ir.Call):
            inputs = tuple(self._rebase_view(v) for v in leaf.inputs)
            return leaf if inputs == leaf.inputs else dataclasses.replace(leaf, inputs=inputs)
        if isinstance(leaf, ir.Update):  # a Source base is read whole (_boxes gave it the whole tensor)
            base, value = self._rebase_leaf(leaf.base), self._rebase_view(leaf.value)
            return leaf if (base, value) == (leaf.base, leaf.value) else ir.Update(base, leaf.region, value)
        return leaf

    def _rebase_view(self, view: ir.View) -> ir.View:
        """`view` (of a computed write) with every read of a quantized weight or scale re-expressed in its box."""
        leaf = view.leaf
        if not isinstance(leaf, ir.Source):
            new = self._rebase_leaf(leaf)
            return view if new is leaf else ir.View(new, view.region)
        name = leaf.name
        weight = name.removesuffix(SCALE_SUFFIX)
        if weight not in self.boxes:
            return view
        box = self.boxes[weight]
        shape = self.sources[name].shape
        if name != weight:
            box = tuple((lo // b, math.ceil(hi / b)) for (lo, hi), b in zip(box, self.block))
        if box == ((0, shape[0]), (0, shape[1])):
            return view
        return ir.View(leaf, quantplan.rebase(view.region, shape, box))

    # -- the Replayer surface the sync's packers use (sync/adapters.py ReplayPacker) --
    def _finish(self) -> None:
        self.layout = self.inner.layout

    @property
    def weights(self) -> list[str]:
        return list(self.boxes)

    @property
    def quantized(self) -> tuple[str, ...]:
        """The weights a pack of this layout reads (their fp8 bytes or scales), sorted (names built at first use)."""
        got = self.__dict__.get("_quantized")
        if got is None:
            segments = self.layout.segments
            first_ref = segments.ref_start[:-1]
            found, names = [], set()
            weights, scales = self.boxes.weight_ids, self._scale_ids
            for plan in self.plans:
                mine = first_ref[segments.ref_rank[first_ref] == plan.rank]
                cols = columns_of(plan)
                index = segments.ref_index[mine]
                src = cols.src[index]
                found.append(np.flatnonzero(np.isin(weights, src) | np.isin(scales, src)))
                for i in index[src < 0].tolist():
                    ir.sources(cols.computed[i].src.leaf, names)
            got = set(self.boxes.names_of(np.unique(np.concatenate(found + [np.zeros(0, np.int64)])).tolist()))
            got |= {n for n in map(self.trainer_name, names) if n in self.boxes}
            got = self._quantized = tuple(sorted(got))
        return got

    def fused_plan(self) -> fp8kernel.FusedQuantPlan:
        """Which segments the fused CUDA kernel packs, and its programs (plan-only: built once, at the first CUDA
        bind)."""
        if self.__dict__.get("_fused_plan") is None:
            boxes = {w: self.boxes[w] for w in self.quantized}
            self._fused_plan = fp8kernel.FusedQuantPlan.build(
                self.inner, boxes, self.block, self.quantized, {w: w + SCALE_SUFFIX for w in boxes}
            )
        return self._fused_plan

    def _derived(self, inner: Replayer) -> "QuantizingReplayer":
        sub = object.__new__(QuantizingReplayer)
        sub.__dict__.update(
            # plan-only caches of this layout stay here: a group or subset reads and quantizes less
            {
                k: v
                for k, v in self.__dict__.items()
                if k not in ("_groups", "_quantized", "_fused_plan", "_sources_read")
            }
        )
        sub.inner, sub._groups = inner, {}
        sub._finish()
        return sub

    def for_group(self, group: str) -> "QuantizingReplayer":
        """One weight group (as Replayer.for_group); a pack quantizes only the group's weights."""
        if group not in self._groups:
            self._groups[group] = self._derived(self.inner.for_group(group))
        return self._groups[group]

    def subset(self, segments: Sequence[int]) -> "QuantizingReplayer":
        """Only the listed segments (as Replayer.subset)."""
        return self._derived(self.inner.subset(segments))

    @property
    def device(self):
        return self.inner.device

    def trainer_name(self, name: str) -> str:
        """The trainer tensor a checkpoint tensor of the plan comes from: a quantized weight's scale from the weight."""
        weight = name.removesuffix(SCALE_SUFFIX)
        if name == weight:
            return name
        if "_box_names" not in self.__dict__:  # one name set: a box lookup by name is ~90 us, spans ask per segment
            self._box_names = frozenset(self.boxes)
        return weight if weight in self._box_names else name

    def sources_read(self) -> frozenset[str]:
        """Trainer tensors a pack reads (weight names for quantized tensors; no scales). Plan-only: kept (every bind
        reads it; a sync binds again each version for sources that hand new tensors)."""
        if "_sources_read" not in self.__dict__:
            self._sources_read = frozenset(self.trainer_name(n) for n in self.inner.sources_read())
        return self._sources_read

    def bind(
        self, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None, **options
    ) -> "QuantizingBoundReplay":
        return QuantizingBoundReplay(self, tensors, out, **options)

    def pack(self, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        return self.bind(tensors, out).pack()


SPIN_S = 0.05  # pack() polls its graph's end event this long before a blocking wait


def wait_for(event: "torch.cuda.Event") -> None:
    """Wait for `event` by polling it (returns within microseconds of the GPU reaching it; a blocking synchronize
    woke tens of microseconds late on the H200 host, a fifth of a small layer's pack), blocking after SPIN_S."""
    if SPIN_S > 0:
        deadline = time.perf_counter() + SPIN_S
        while not event.query():
            if time.perf_counter() > deadline:
                break
        else:
            return
    event.synchronize()


def _reads_storage(op, storage_ptr: int) -> bool:
    """Whether a replay op may read the storage at `storage_ptr` (an op without its view pairs: assumed so)."""
    pairs = getattr(op, "pairs", None)
    if pairs is None:
        return True
    return any(src.untyped_storage().data_ptr() == storage_ptr for _, src in pairs)


class QuantizingBoundReplay:
    """Bound quantizing replay. On CUDA (with Triton) the fused kernel (runtime/fp8kernel.py) quantizes the fp8
    segments' blocks straight into `out` in one launch per source dtype, and the ordinary replay packs the other
    segments (scales from the kernel's staging vector); `fused` False (or no CUDA/Triton) takes the eager path: staging
    boxes (fp8 + float32 scales) re-quantized by the reference quantizer on every `pack()`, then the ordinary replay.
    A block holding inf or NaN raises NonFiniteBlockError naming it: on the eager path before any byte is written, on
    the fused path after the launch (the buffer's bytes are then unspecified; pack() never returns it)."""

    def __init__(
        self,
        replayer: QuantizingReplayer,
        tensors: Mapping[str, torch.Tensor],
        out,
        *,
        fused: bool | None = None,
        **options,
    ):
        self.replayer = replayer
        self.sources: dict[str, tuple[torch.Tensor, tuple]] = {}
        watched: dict[str, torch.Tensor] = {}
        given, device = replayer.inner.device, None
        for weight in replayer.quantized:
            box = replayer.boxes[weight]
            t = tensors.get(weight)
            meta = replayer.sources[weight]
            if t is None:
                raise MissingTensorError(
                    f"trainer tensor {weight!r} is missing: the FP8 plan quantizes it from a "
                    f"{list(meta.shape)} bfloat16/float16/float32 tensor"
                )
            if t.dtype not in INPUT_DTYPES:
                raise QuantizerDTypeError(
                    f"trainer tensor {weight!r} is {str(t.dtype).removeprefix('torch.')}: the "
                    f"block quantizer takes bfloat16, float16 or float32 (pass the trainer's "
                    f"high-precision weight, not an already quantized one)"
                )
            if tuple(t.shape) != tuple(meta.shape):
                raise TensorShapeError(
                    f"trainer tensor {weight!r} has shape {list(t.shape)}, the plan expects {list(meta.shape)}"
                )
            want = given if given is not None else device
            if want is not None and t.device != resolve_device(want):
                raise TensorLayoutError(
                    f"trainer tensor {weight!r} is on {t.device}, expected "
                    f"{describe_device(want)}: move it there or give the device it is on"
                )
            device = device or t.device
            self.sources[weight] = (t[box[0][0] : box[0][1], box[1][0] : box[1][1]], box)
            watched[weight] = t
        # the quantizer reads these through views (eager) or raw addresses (fused), which keep the old storage after
        # `t.data = x` or `set_`: pack() compares their data pointers (the inner replay checks only what it reads)
        self._watched_names, self._watched = list(watched), list(watched.values())
        self._watched_ptrs = [t.data_ptr() for t in self._watched]
        self._watched_index = list(range(len(self._watched)))
        device = resolve_device(given) or device or torch.device("cpu")
        self.device = device
        # what the trainer bound (the sync's binding cache compares these with the tensors of the next sync)
        self.tensors = {n: tensors[n] for n in replayer.sources_read() if n in tensors}
        self.fused_error = None if fused is not False else "fused=False"
        if self.fused_error is None:
            self.fused_error = fp8kernel.available(device, replayer.block)
        if self.fused_error is None:
            bad = [w for w in replayer.fused_plan().weights if self.sources[w][0].stride(1) != 1]
            if bad:
                self.fused_error = f"trainer tensor {bad[0]!r} has column stride {self.sources[bad[0]][0].stride(1)}"
        if fused and self.fused_error is not None:
            raise QuantizeError(f"the fused FP8 kernel cannot run here: {self.fused_error}")
        if self.fused_error is None:
            self._bind_fused(tensors, out, options)
        else:
            self._bind_eager(tensors, out, options)

    def _bind_eager(self, tensors, out, options) -> None:
        replayer, device = self.replayer, self.device
        self.staged = {}
        for weight in replayer.quantized:
            for name in (weight, weight + SCALE_SUFFIX):
                meta = replayer.inner.sources[name]
                self.staged[name] = torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device=device)
        others = {n: t for n, t in tensors.items() if n not in self.staged}
        self.inner: BoundReplay = replayer.inner.bind({**others, **self.staged}, out, **options)
        self.out = self.inner.out
        self.kernel = self._graph = None

    def _bind_fused(self, tensors, out, options) -> None:
        """Kernel for the fused weights' fp8 segments, eager staging for the weights it cannot serve (a computed or
        non-box read of their fp8), the ordinary replay (a subset of the layout) for the rest."""
        replayer, device = self.replayer, self.device
        plan = replayer.fused_plan()
        if out is None:
            out = torch.zeros(replayer.layout.nbytes, dtype=torch.uint8, device=device)
        self.sources = {w: self.sources[w] for w in plan.eager if w in self.sources}  # eager-quantized ones only
        self.staged = {}
        for weight in self.sources:
            for name in (weight, weight + SCALE_SUFFIX):
                meta = replayer.inner.sources[name]
                self.staged[name] = torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device=device)
        self.scales = torch.empty(max(plan.scale_numel, 1), dtype=torch.float32, device=device)
        self.staged.update({w + SCALE_SUFFIX: t for w, t in plan.staged_scales(self.scales).items()})
        self.kernel = plan.binding(tensors, out, self.scales)
        rest = replayer.inner.subset(plan.rest)
        rest.device = device  # (a subset reading no trainer tensor must still bind to the buffer's device)
        staged_names = set(self.staged) | set(plan.weights)
        others = {n: t for n, t in tensors.items() if n not in staged_names}
        cuda_graph = options.pop("cuda_graph", None)
        self.inner = rest.bind({**others, **self.staged}, out, cuda_graph=False, **options)
        self.out = self.inner.out
        self._graph = None
        if cuda_graph or (cuda_graph is None and device.type == "cuda"):
            # the rest's copies run beside the kernel (graph branches), those reading its staged scales after it
            scales_at = self.scales.untyped_storage().data_ptr()
            after = [op for op in self.inner._ops if _reads_storage(op, scales_at)]
            beside = [op for op in self.inner._ops if not _reads_storage(op, scales_at)]
            # the inf/NaN flag travels to pinned host memory inside the graph, then is cleared for the next replay:
            # pack() waits for the graph and reads it (no copy launched and no .item() after the replay)
            self._host_flag = torch.zeros(1, dtype=torch.int32).pin_memory()
            self._host_flag_view = self._host_flag.numpy()
            self._done = torch.cuda.Event()
            flag, host = self.kernel.flag, self._host_flag
            to_host = [lambda: host.copy_(flag, non_blocking=True)]
            try:
                self._graph = capture_graph(
                    [[self.kernel.launch] + beside, after, to_host, [lambda: flag.zero_()]], device, branches=8
                )
            except Exception as exc:  # auto mode: eager launches are correct, only slower
                if cuda_graph:
                    raise
                self.inner.graph_error = f"{type(exc).__name__}: {exc}"
            self.kernel.flag.zero_()  # (capture ran the kernel once on the bind-time values)
            self._host_flag.zero_()

    def quantize(self) -> None:
        """The eager path's staging (the weights the fused kernel does not serve, on the fused path)."""
        block = self.replayer.block
        with torch.no_grad():
            for weight, (view, box) in self.sources.items():
                fp8, scale = quantize_blocks(view, block)
                # a block's amax (hence its scale) is inf/NaN exactly when the block holds one: one check on the small
                # scale tensor, and the element-wise search only to name the culprit
                if not bool(torch.isfinite(scale).all()):
                    check_finite(weight, view, box, block)
                self.staged[weight].copy_(fp8)
                self.staged[weight + SCALE_SUFFIX].copy_(scale)

    def check(self) -> None:
        """Raise StaleBindingError if a bound tensor or the buffer was reallocated since bind()."""
        self.inner.check()
        if not ptrs_unchanged(self._watched, self._watched_ptrs, self._watched_index):
            name = next(
                w for w, t, p in zip(self._watched_names, self._watched, self._watched_ptrs) if t.data_ptr() != p
            )
            raise StaleBindingError(
                f"{name!r} no longer has the storage it had at bind(): call bind() again "
                f"after reallocating trainer tensors"
            )

    def pack(self, *, check: bool = True) -> torch.Tensor:
        """Fill `self.out`. With the CUDA graph the check runs on the host while the GPU replays it (the kernel's and
        views' storages are held by the binding: a re-bound tensor's old bytes are read, never freed memory) and
        raises before the buffer is returned; otherwise it runs first."""
        graph = self._graph
        if graph is not None and not self.sources and not self.inner._eager_ops:  # the usual CUDA pack, lean
            graph.replay()
            self._done.record()
            if check:
                self.check()
            wait_for(self._done)
            if self._host_flag_view[0]:
                self._name_nonfinite()
            return self.out
        if graph is None and check:
            self.check()
        if self.kernel is None:
            self.quantize()
            return self.inner.pack(check=False)
        self.quantize()
        with torch.no_grad():
            if self._graph is not None:
                self._graph.replay()
                self._done.record()
                if check:
                    self.check()
            else:
                self.kernel.launch()
                for op in self.inner._ops:
                    op()
            for op in self.inner._eager_ops:
                op()
        if self._graph is not None:
            wait_for(self._done)
            bad = bool(self._host_flag_view[0])
        else:
            bad = self.kernel.nonfinite()  # (a host read: waits for the launch)
        if bad:
            self._name_nonfinite()
        return self.out

    def _name_nonfinite(self) -> None:
        """NonFiniteBlockError naming the first inf/NaN the fused kernel met."""
        for weight, t in zip(self.kernel.plan.weights, self.kernel.tensors):
            box = self.replayer.boxes[weight]
            check_finite(weight, t[box[0][0] : box[0][1], box[1][0] : box[1][1]], box, self.replayer.block)
        raise NonFiniteBlockError("the fused FP8 kernel met inf or NaN in a block it quantized")

    @property
    def num_launches(self) -> int:
        if self.kernel is None:
            return self.inner.num_launches
        if self._graph is not None:
            return 1 + len(self.inner._eager_ops)
        return len(self.kernel.launches) + len(self.inner._ops) + len(self.inner._eager_ops)
