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
from typing import Mapping, Sequence

import torch

from shardplan.errors import MissingTensorError, ReplayError
from shardplan.plan import ir
from shardplan.plan.names import SCALE_SUFFIX
from shardplan.runtime import fp8kernel
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


# ---- plan geometry -----------------------------------------------------------------------------------------------
def _row_col(region: ir.Region, cols: int) -> tuple[int, int, list[tuple[int, int]]] | None:
    """A region of a contiguous [rows, cols] tensor as a start (row, col) plus one (row step, col step) per dim,
    when no dim carries from columns into rows; else None."""
    row0, col0 = divmod(region.offset, cols)
    steps, col_hi = [], col0
    for size, stride in zip(region.sizes, region.strides):
        if size == 1 or stride == 0:
            steps.append((0, 0))
        elif stride % cols == 0:
            steps.append((stride // cols, 0))
        elif 0 < stride < cols:
            steps.append((0, stride))
            col_hi += (size - 1) * stride
        else:
            return None
    return (row0, col0, steps) if col_hi < cols else None


def _region_box(region: ir.Region, shape) -> tuple[tuple[int, int], tuple[int, int]] | None:
    rc = _row_col(region, shape[1])
    if rc is None or region.numel == 0:
        return None
    row0, col0, steps = rc
    row_hi = row0 + sum((n - 1) * r for n, (r, _) in zip(region.sizes, steps))
    col_hi = col0 + sum((n - 1) * c for n, (_, c) in zip(region.sizes, steps))
    return (row0, row_hi + 1), (col0, col_hi + 1)


def _blocks_covered(box, scale_boxes, block: tuple[int, int]) -> bool:
    """Every block that element `box` touches lies in one of `scale_boxes` (in blocks): one scale read may cover
    them, or several (the compiler splits an upsampled scale into pure views: plan/compile/simplify.py). Checked on the
    grid the boxes' edges cut the touched blocks into (a few cells), not block by block."""
    (r0, r1), (c0, c1) = box
    rows = (r0 // block[0], math.ceil(r1 / block[0]))
    cols = (c0 // block[1], math.ceil(c1 / block[1]))
    if any(
        s_r0 <= rows[0] and rows[1] <= s_r1 and s_c0 <= cols[0] and cols[1] <= s_c1
        for (s_r0, s_r1), (s_c0, s_c1) in scale_boxes
    ):
        return True

    def cuts(lo: int, hi: int, dim: int) -> list[int]:
        return sorted({lo, hi} | {e for sbox in scale_boxes for e in sbox[dim] if lo < e < hi})

    row_cuts, col_cuts = cuts(*rows, 0), cuts(*cols, 1)
    return all(
        any(s_r0 <= i < s_r1 and s_c0 <= j < s_c1 for (s_r0, s_r1), (s_c0, s_c1) in scale_boxes)
        for i in row_cuts[:-1]
        for j in col_cuts[:-1]
    )  # each cell by its first block


def _source_views(view: ir.View, name: str) -> list[ir.View] | None:
    """Every View of source `name` in a write's source tree (through the inputs of computed writes), or None when
    the tree reads it some other way (an Update's base): such a read needs the whole tensor."""
    leaf = view.leaf
    if isinstance(leaf, ir.Source):
        return [view] if leaf.name == name else []
    if isinstance(leaf, ir.Call):
        out: list[ir.View] = []
        for v in leaf.inputs:
            got = _source_views(v, name)
            if got is None:
                return None
            out += got
        return out
    if isinstance(leaf, ir.Update):
        if name in ir.sources(leaf.base):
            return None
        return _source_views(leaf.value, name)
    return []


def _rebase(region: ir.Region, shape, box) -> ir.Region:
    """`region` of the full [rows, cols] tensor, re-expressed in a contiguous tensor holding only `box`."""
    row0, col0, steps = _row_col(region, shape[1])
    box_cols = box[1][1] - box[1][0]
    return ir.Region(
        (row0 - box[0][0]) * box_cols + (col0 - box[1][0]), region.sizes, tuple(r * box_cols + c for r, c in steps)
    )


class QuantizingReplayer:
    """Packs block-FP8 consumer ranks' bytes from the trainer's high-precision tensors.

    `plans`: RankPlans recorded against the FP8 checkpoint (fp8 `X.weight`, float32 `X.weight_scale_inv`);
    `sources`: that checkpoint's tensor table (as the plan file's). The trainer binds its own tensors under the
    *weight* names (`X.weight`, bfloat16/float16/float32, full shape); it holds no scales. `quantizer`: the id the
    plan file names (`PlanHeader.quantizer`, e.g. "fp8-e4m3-block-amax448-v1/128x128"); any other quantizer, or none,
    is refused (QuantizerMismatch). Other options go to `Replayer`."""

    def __init__(
        self,
        plans: ir.RankPlan | Sequence[ir.RankPlan],
        sources: Mapping[str, ir.TensorMeta],
        *,
        quantizer: str,
        **replayer_options,
    ):
        _, self.block = parse_quantizer(quantizer)
        self.quantizer = quantizer
        self.plans = as_plans(plans)
        # only the tensors the plans read (and their weights or scales): a plan file's table names every tensor of
        # the model (~70k for Kimi-K2), and spelling it out cost most of a rank's build
        self._reads("")
        read = set(self._readers)
        self.sources = {n: sources[n] for n in sorted(read)}
        for name, meta in list(self.sources.items()):  # a weight read without its scale, or a scale without it
            other = (
                name.removesuffix(SCALE_SUFFIX)
                if name.endswith(SCALE_SUFFIX)
                else name + SCALE_SUFFIX
                if meta.dtype == "float8_e4m3fn"
                else None
            )
            if other is not None and other not in self.sources and other in sources:
                self.sources[other] = sources[other]
        self.weights = sorted(
            n for n, m in self.sources.items() if m.dtype == "float8_e4m3fn" and n + SCALE_SUFFIX in self.sources
        )
        self.boxes = {name: self._box(name) for name in self.weights}
        self.boxes = {name: box for name, box in self.boxes.items() if box is not None}
        rebased, staged = self._rebased()
        # the bytes sit where the consumer's own layout (of the plans as recorded) puts them: rebased sources can
        # order a group's segments differently (the layout breaks ties by source geometry)
        layout = PackLayout.from_plans(
            self.plans, replayer_options.get("alignment", 256), replayer_options.get("max_group_bytes")
        )
        self.inner = Replayer(rebased, staged, layout=layout, **replayer_options)
        self.plans = self.inner.plans  # the rebased plans (same params, writes and source names)
        self._groups: dict[str, QuantizingReplayer] = {}
        self._finish()

    def _reads(self, name: str):
        if not hasattr(self, "_readers"):  # name -> (rank, write) for every write reading it: one pass over the plans
            self._readers: dict[str, list] = {}
            for plan in self.plans:
                for w in plan.writes:
                    for source in ir.sources(w.src.leaf):
                        self._readers.setdefault(source, []).append((plan.rank, w))
        return self._readers.get(name, ())

    def _box(self, weight: str):
        """The element box of `weight` one pack quantizes: the union of what the plans read of it and of its scale
        (in elements, through the inputs of computed writes too: a refined scale grid reads checkpoint scales and
        upsamples them), widened to whole blocks; the whole tensor when a read is not a plain box."""
        shape, (bn, bk) = self.sources[weight].shape, self.block
        full = ((0, shape[0]), (0, shape[1]))
        lo, hi, used = [shape[0], shape[1]], [0, 0], False
        weight_boxes: dict[int, list] = {}
        scale_boxes: dict[int, list] = {}
        for name, scale in ((weight, (1, 1)), (weight + SCALE_SUFFIX, (bn, bk))):
            for rank, w in self._reads(name):
                views = _source_views(w.src, name)
                if views is None:
                    return full
                for view in views:
                    used = True
                    box = _region_box(view.region, self.sources[name].shape)
                    if box is None:
                        return full
                    (weight_boxes if name == weight else scale_boxes).setdefault(rank, []).append(box)
                    for d in (0, 1):
                        lo[d] = min(lo[d], box[d][0] * scale[d])
                        hi[d] = max(hi[d], min(box[d][1] * scale[d], shape[d]))
        for rank, boxes in weight_boxes.items():
            for box in boxes:
                self._check_covered(weight, rank, box, scale_boxes.get(rank, ()))
        if not used:
            return None
        return tuple(
            (start // b * b, min(math.ceil(stop / b) * b, dim))
            for start, stop, b, dim in zip(lo, hi, self.block, shape)
        )

    def _check_covered(self, weight: str, rank: int, box, scale_boxes) -> None:
        """The fp8 elements a rank reads are whole blocks, or lie in scale blocks the same rank reads (a refined
        scale grid: vLLM's loader upsamples those scales); otherwise the plan is not one for this block size."""
        shape = self.sources[weight].shape
        aligned = all(
            start % size == 0 and (stop % size == 0 or stop == dim)
            for (start, stop), size, dim in zip(box, self.block, shape)
        )
        if not (aligned or _blocks_covered(box, scale_boxes, self.block)):
            raise BlockAlignmentError(
                f"rank {rank} reads rows/cols {[list(b) for b in box]} of {weight!r} ({list(shape)}), which are not "
                f"whole {list(self.block)}-blocks and not within the scale blocks it reads, so its fp8 bytes would "
                f"depend on scales it never receives. The plan's layout is not block-aligned for block "
                f"{list(self.block)} (record it from a config with this weight_block_size)."
            )

    def _rebased(self):
        staged = dict(self.sources)
        for weight, box in self.boxes.items():
            (r0, r1), (c0, c1) = box
            staged[weight] = ir.TensorMeta(weight, (r1 - r0, c1 - c0), "float8_e4m3fn")
            scale = weight + SCALE_SUFFIX
            staged[scale] = ir.TensorMeta(
                scale, (math.ceil((r1 - r0) / self.block[0]), math.ceil((c1 - c0) / self.block[1])), "float32"
            )
        plans = []
        for plan in self.plans:
            writes = [ir.Write(w.param, w.dst, self._rebase_view(w.src)) for w in plan.writes]
            plans.append(dataclasses.replace(plan, writes=tuple(writes)))
        return plans, staged

    def _rebase_leaf(self, leaf):
        if isinstance(leaf, ir.Call):
            inputs = tuple(self._rebase_view(v) for v in leaf.inputs)
            return leaf if inputs == leaf.inputs else dataclasses.replace(leaf, inputs=inputs)
        if isinstance(leaf, ir.Update):  # a Source base is read whole (_box gave it the whole tensor)
            base, value = self._rebase_leaf(leaf.base), self._rebase_view(leaf.value)
            return leaf if (base, value) == (leaf.base, leaf.value) else ir.Update(base, leaf.region, value)
        return leaf

    def _rebase_view(self, view: ir.View) -> ir.View:
        """`view` with every read of a quantized weight or scale re-expressed in its staged box."""
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
        return ir.View(leaf, _rebase(view.region, shape, box))

    # -- the Replayer surface the sync's packers use (sync/adapters.py ReplayPacker) --
    def _finish(self) -> None:
        self.layout = self.inner.layout
        read = self.inner.sources_read()
        self.quantized = tuple(w for w in self.boxes if w in read or w + SCALE_SUFFIX in read)

    def fused_plan(self) -> fp8kernel.FusedQuantPlan:
        """Which segments the fused CUDA kernel packs, and its programs (plan-only: built once, at the first CUDA
        bind)."""
        if self.__dict__.get("_fused_plan") is None:
            self._fused_plan = fp8kernel.FusedQuantPlan.build(
                self.inner, self.boxes, self.block, self.quantized, {w: w + SCALE_SUFFIX for w in self.boxes}
            )
        return self._fused_plan

    def _derived(self, inner: Replayer) -> "QuantizingReplayer":
        sub = object.__new__(QuantizingReplayer)
        sub.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("_groups", "_readers", "_fused_plan")})
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
        return weight if name != weight and weight in self.boxes else name

    def sources_read(self) -> set[str]:
        """Trainer tensors a pack reads (weight names for quantized tensors; no scales)."""
        return {self.trainer_name(n) for n in self.inner.sources_read()}

    def bind(
        self, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None, **options
    ) -> "QuantizingBoundReplay":
        return QuantizingBoundReplay(self, tensors, out, **options)

    def pack(self, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        return self.bind(tensors, out).pack()


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
            try:
                self._graph = capture_graph([self.kernel.launch] + self.inner._ops, device)
            except Exception as exc:  # auto mode: eager launches are correct, only slower
                if cuda_graph:
                    raise
                self.inner.graph_error = f"{type(exc).__name__}: {exc}"
            self.kernel.flag.zero_()  # (capture ran the kernel once on the bind-time values)

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
        if check:
            self.check()
        if self.kernel is None:
            self.quantize()
            return self.inner.pack(check=False)
        self.quantize()
        with torch.no_grad():
            if self._graph is not None:
                self._graph.replay()
            else:
                self.kernel.launch()
                for op in self.inner._ops:
                    op()
            for op in self.inner._eager_ops:
                op()
        if self.kernel.nonfinite():  # (a host read: waits for the launch) name the first culprit
            for weight, t in zip(self.kernel.plan.weights, self.kernel.tensors):
                box = self.replayer.boxes[weight]
                check_finite(weight, t[box[0][0] : box[0][1], box[1][0] : box[1][1]], box, self.replayer.block)
            raise NonFiniteBlockError("the fused FP8 kernel met inf or NaN in a block it quantized")
        return self.out

    @property
    def num_launches(self) -> int:
        if self.kernel is None:
            return self.inner.num_launches
        if self._graph is not None:
            return 1 + len(self.inner._eager_ops)
        return len(self.kernel.launches) + len(self.inner._ops) + len(self.inner._eager_ops)
