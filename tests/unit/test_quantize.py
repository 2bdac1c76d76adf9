"""runtime/quantize.py without vLLM: the quantizing replay on hand-made FP8 plans (two TP ranks of one [256, 384]
weight), checked against the reference quantizer run on the whole tensor, and its named errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardplan.plan import ir
from shardplan.runtime import fp8kernel
from shardplan.runtime.quantize import (
    BlockAlignmentError,
    NonFiniteBlockError,
    QuantizeError,
    QuantizerDTypeError,
    QuantizerMismatch,
    QuantizingReplayer,
    quantize_blocks,
    quantizer_id,
)
from shardplan.runtime.replay import Replayer
from shardplan.runtime.tensors import StaleBindingError

W, S = "layer.proj.weight", "layer.proj.weight_scale_inv"
SHAPE = (256, 384)
BLOCK = (128, 128)
QID = quantizer_id(BLOCK)
SOURCES = {
    W: ir.TensorMeta(W, SHAPE, "float8_e4m3fn"),
    S: ir.TensorMeta(S, (2, 3), "float32"),
    "norm": ir.TensorMeta("norm", (384,), "bfloat16"),
}


def rows_plan(rank: int, lo: int, hi: int, scale_rows: tuple[int, int] | None = None) -> ir.RankPlan:
    """Rank reads rows [lo, hi) of the weight, their scale rows (or `scale_rows`), and the whole norm (a copied bf16
    tensor)."""
    cols, rows = SHAPE[1], hi - lo
    s_lo, s_hi = scale_rows or (lo // BLOCK[0], -(-hi // BLOCK[0]))
    params = (
        ir.TensorMeta("w", (rows, cols), "float8_e4m3fn"),
        ir.TensorMeta("s", (s_hi - s_lo, 3), "float32"),
        ir.TensorMeta("n", (384,), "bfloat16"),
    )
    writes = (
        ir.Write(
            "w", ir.full_region((rows, cols)), ir.View(ir.Source(W), ir.Region(lo * cols, (rows, cols), (cols, 1)))
        ),
        ir.Write(
            "s", ir.full_region((s_hi - s_lo, 3)), ir.View(ir.Source(S), ir.Region(s_lo * 3, (s_hi - s_lo, 3), (3, 1)))
        ),
        ir.Write("n", ir.full_region((384,)), ir.View(ir.Source("norm"), ir.full_region((384,)))),
    )
    return ir.RankPlan(rank, params, writes)


def trainer_tensors(seed: int, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {W: (torch.randn(SHAPE, generator=gen) * 3).to(dtype), "norm": torch.randn(384, generator=gen).bfloat16()}


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rank=st.sampled_from([0, 1, None]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
)
def test_pack_equals_reference_checkpoint(seed, rank, dtype):
    """Each rank's buffer (or both ranks in one buffer) == the ordinary replay of the reference FP8 checkpoint of the
    whole tensor: quantizing only the rank's box gives the same bytes."""
    plans = [rows_plan(0, 0, 128), rows_plan(1, 128, 256)]
    plans = plans if rank is None else plans[rank]
    tensors = trainer_tensors(seed, dtype)
    fp8, scale = quantize_blocks(tensors[W], BLOCK)
    expected = Replayer(plans, SOURCES).pack({W: fp8, S: scale, "norm": tensors["norm"]})
    replayer = QuantizingReplayer(plans, SOURCES, quantizer=QID)
    assert replayer.sources_read() == {W, "norm"}
    if rank is not None:
        assert replayer.boxes[W] == ((128 * rank, 128 * rank + 128), (0, 384))  # the rank's own rows only
    bound = replayer.bind(tensors)
    assert torch.equal(bound.pack(), expected)
    tensors[W].mul_(2)  # in-place update: the next pack re-quantizes
    fp8, scale = quantize_blocks(tensors[W], BLOCK)
    assert torch.equal(bound.pack(), Replayer(plans, SOURCES).pack({W: fp8, S: scale, "norm": tensors["norm"]}))


def test_reference_quantizer_values():
    x = torch.zeros(130, 130)
    x[0, 0], x[129, 129] = 448.0 * 3, -1.5
    fp8, scale = quantize_blocks(x, BLOCK)
    assert scale.shape == (2, 2) and scale[0, 0] == 3.0 and scale[1, 1] == pytest.approx(1.5 / 448)
    assert scale[0, 1] == pytest.approx(1e-4 / 448)  # an all-zero block: the amax floor
    assert fp8[0, 0].float() == 448.0 and fp8[129, 129].float() == -448.0
    assert (fp8.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:130, :130]).sub(x).abs().max() == 0


def test_quantizer_mismatch_refused():
    for bad in (
        "",
        "fp8-e4m3-block-amax448-v2/128x128",
        "fp8-e4m3-block-amax448-v1",
        "fp8-e4m3-block-amax448-v1/0x128",
    ):
        with pytest.raises(QuantizerMismatch, match="the plan expects"):
            QuantizingReplayer(rows_plan(0, 0, 128), SOURCES, quantizer=bad)


def test_rows_within_the_scale_blocks_read_are_quantized_whole():
    """A rank reading fp8 rows [64, 192) and the scale rows of both blocks they touch (what a refined scale grid
    does, e.g. Qwen3-30B-A3B-FP8 at TP4): both blocks are quantized whole, bytes == the reference checkpoint's."""
    plan = rows_plan(3, 64, 192)
    replayer = QuantizingReplayer(plan, SOURCES, quantizer=QID)
    assert replayer.boxes[W] == ((0, 256), (0, 384))
    tensors = trainer_tensors(7)
    fp8, scale = quantize_blocks(tensors[W], BLOCK)
    assert torch.equal(
        replayer.pack(tensors), Replayer(plan, SOURCES).pack({W: fp8, S: scale, "norm": tensors["norm"]})
    )


def test_scale_blocks_read_by_several_writes_cover_the_rows():
    """The same rank, its two scale rows read by two writes (what the compiler makes of an upsampled scale: one pure
    view per block piece, plan/compile/simplify.py): covered by their union, bytes == the reference checkpoint's."""
    plan = rows_plan(3, 64, 192, scale_rows=(0, 1))
    extra = ir.Write("s2", ir.full_region((1, 3)), ir.View(ir.Source(S), ir.Region(3, (1, 3), (3, 1))))
    plan = ir.RankPlan(3, plan.params + (ir.TensorMeta("s2", (1, 3), "float32"),), plan.writes + (extra,))
    replayer = QuantizingReplayer(plan, SOURCES, quantizer=QID)
    assert replayer.boxes[W] == ((0, 256), (0, 384))
    tensors = trainer_tensors(7)
    fp8, scale = quantize_blocks(tensors[W], BLOCK)
    assert torch.equal(
        replayer.pack(tensors), Replayer(plan, SOURCES).pack({W: fp8, S: scale, "norm": tensors["norm"]})
    )


def test_misaligned_box_refused():
    """fp8 rows [64, 192) with only the second block's scales: the first block's bytes would need a scale the rank
    never receives (a plan recorded for another block size)."""
    with pytest.raises(BlockAlignmentError, match=r"rank 3 reads rows/cols \[\[64, 192\], \[0, 384\]\] of 'layer.proj"):
        QuantizingReplayer(rows_plan(3, 64, 192, scale_rows=(1, 2)), SOURCES, quantizer=QID)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.float64])
def test_dtype_refused(dtype):
    tensors = trainer_tensors(0)
    tensors[W] = tensors[W].float().to(dtype)
    with pytest.raises(QuantizerDTypeError, match="'layer.proj.weight' is"):
        QuantizingReplayer(rows_plan(0, 0, 128), SOURCES, quantizer=QID).bind(tensors)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_block_refused_before_any_byte(bad):
    tensors = trainer_tensors(1)
    replayer = QuantizingReplayer(rows_plan(1, 128, 256), SOURCES, quantizer=QID)
    tensors[W][5, 7] = bad  # rank 0's rows: not this rank's business
    bound = replayer.bind(tensors, torch.full((replayer.layout.nbytes,), 0xAB, dtype=torch.uint8))
    bound.pack()
    tensors[W][200, 300] = bad
    bound.out.fill_(0xAB)
    with pytest.raises(NonFiniteBlockError, match=r"'layer.proj.weight' holds .* at \[200, 300\] \(block \[1, 2\]"):
        bound.pack()
    assert (bound.out == 0xAB).all()  # nothing packed


# ---- the fused kernel's programs (runtime/fp8kernel.py), run by their torch reference on CPU --------------------
def _fused_on_cpu(monkeypatch):
    """The fused path with each launch replaced by the programs' torch reference (the kernel itself: tests/gpu)."""
    monkeypatch.setattr(fp8kernel, "available", lambda device, block: None)
    monkeypatch.setattr(
        fp8kernel.FusedQuantBinding,
        "launch",
        lambda self: self.plan.run_reference(
            dict(zip(self.plan.weights, self.tensors)), self.out, self.scales, quantize_blocks
        ),
    )


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), data=st.data())
def test_fused_programs_pack_the_eager_bytes(seed, data):
    """Row shards on and off block boundaries (a refined scale grid: Qwen3-30B-A3B-FP8 TP4's 192-row shards), one
    rank or several in one buffer, a transposed read (left to the eager quantizer): the fused path's buffer == the
    eager path's, bit for bit, and the kernel packs every box-shaped fp8 segment."""
    monkeypatch = pytest.MonkeyPatch()
    try:
        _fused_on_cpu(monkeypatch)
        cuts = data.draw(st.sampled_from([[0, 128, 256], [0, 64, 192, 256], [0, 256], [64, 192]]))
        plans = [rows_plan(r, lo, hi) for r, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:]))]
        plans = data.draw(st.sampled_from([plans, plans[:1], plans[-1:]]))
        transposed = data.draw(st.booleans())
        if transposed:  # rank 9 reads a [128, 128] block transposed: not a box, so the weight goes eager
            t = ir.Write("t", ir.full_region((128, 128)), ir.View(ir.Source(W), ir.Region(0, (128, 128), (1, 384))))
            ts = ir.Write("ts", ir.full_region((1, 1)), ir.View(ir.Source(S), ir.Region(0, (1, 1), (3, 1))))
            plans = plans + [
                ir.RankPlan(
                    9,
                    (ir.TensorMeta("t", (128, 128), "float8_e4m3fn"), ir.TensorMeta("ts", (1, 1), "float32")),
                    (t, ts),
                )
            ]
        if data.draw(st.booleans()):  # an upsampled scale read (stride 0), as vLLM's loader makes for refined grids
            up = ir.Write("su", ir.full_region((2, 2, 3)), ir.View(ir.Source(S), ir.Region(0, (2, 2, 3), (3, 0, 1))))
            plans = plans + [ir.RankPlan(7, (ir.TensorMeta("su", (2, 2, 3), "float32"),), (up,))]
        replayer = QuantizingReplayer(plans, SOURCES, quantizer=QID)
        tensors = trainer_tensors(seed, data.draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])))
        eager = replayer.bind(tensors, fused=False).pack().clone()
        bound = replayer.bind(tensors, torch.full((replayer.layout.nbytes,), 0xAB, dtype=torch.uint8))
        plan = replayer.fused_plan()
        assert bound.kernel is not None and bound.fused_error is None
        assert plan.eager == ((W,) if transposed else ())
        assert bool(plan.segments) != transposed
        bound.out[:] = 0  # padding is never written
        assert torch.equal(bound.pack(), eager)
        tensors[W].mul_(-3)  # in-place update: the next pack re-quantizes
        assert torch.equal(bound.pack(), replayer.bind(tensors, fused=False).pack())
    finally:
        monkeypatch.undo()


def _run_tables(self) -> None:
    """The kernel's launch tables (fp8kernel.TABLE_COLUMNS) interpreted with torch: each row's block read at its
    `src` element offset from the launch's base tensor (masked to rows x cols, zero-padded), quantized by the
    reference, its window stored, its scale staged and stored at its buffer places."""
    bn, bk = self.plan.block
    fp8, f32 = self.out.view(torch.float8_e4m3fn), self.out.view(torch.float32)
    for table, base, *_ in self.launches:
        storage = base.untyped_storage()  # the test's tensors of one dtype share one storage
        flat = torch.empty(0, dtype=base.dtype).set_(storage, 0, (storage.nbytes() // base.element_size(),))
        start = (base.data_ptr() - storage.data_ptr()) // base.element_size()
        for src, stride, rows, cols, at, out_stride, r0, r1, c0, c1, scale, *dests in table.tolist():
            x = torch.zeros(BLOCK, dtype=base.dtype)
            for r in range(rows):
                x[r, :cols] = flat[start + src + r * stride : start + src + r * stride + cols]
            q, sc = quantize_blocks(x, BLOCK)
            self.scales[scale] = sc[0, 0]
            for r in range(r0, r1):
                fp8[at + r * out_stride + c0 : at + r * out_stride + c1] = q[r, c0:c1]
            for d in dests:
                if d >= 0:
                    f32[d] = sc[0, 0]
    if len(self._gathered):
        self._out_f32.index_copy_(0, self._gather_dst, self.scales.index_select(0, self._gather_src))


def _two_weights_plan() -> tuple[ir.RankPlan, dict]:
    """A rank reading rows [64, 256) of one quantized weight (blocks cut by its box) and all of another."""
    v, vs = "layer.up.weight", "layer.up.weight_scale_inv"
    sources = dict(
        SOURCES, **{v: ir.TensorMeta(v, (384, 256), "float8_e4m3fn"), vs: ir.TensorMeta(vs, (3, 2), "float32")}
    )
    plan = rows_plan(0, 64, 256)
    params = plan.params + (ir.TensorMeta("v", (384, 256), "float8_e4m3fn"), ir.TensorMeta("vs", (3, 2), "float32"))
    writes = plan.writes + (
        ir.Write("v", ir.full_region((384, 256)), ir.View(ir.Source(v), ir.full_region((384, 256)))),
        ir.Write("vs", ir.full_region((3, 2)), ir.View(ir.Source(vs), ir.full_region((3, 2)))),
    )
    return ir.RankPlan(0, params, writes), sources


def _in_one_storage(tensors: dict, gap: int) -> dict:
    """The tensors copied into one flat buffer per dtype, `gap` elements apart (16-byte aligned or not)."""
    out = {}
    for dtype in {t.dtype for t in tensors.values()}:
        names = [n for n, t in tensors.items() if t.dtype == dtype]
        flat = torch.empty(sum(tensors[n].numel() + gap for n in names) + gap, dtype=dtype)
        at = gap
        for n in names:
            out[n] = flat[at : at + tensors[n].numel()].view(tensors[n].shape)
            out[n].copy_(tensors[n])
            at += tensors[n].numel() + gap
    return out


@pytest.mark.parametrize("gap", [64, 3])
def test_fused_tables_rebind_to_new_tensors(monkeypatch, gap):
    """The launch tables (built once per tensor geometry, FusedQuantPlan.tables) take each bind's addresses: tensors
    bound again at other addresses (a source handing new tensors every sync) pack the eager bytes, bit for bit, from
    the cached tables; 16-byte aligned and misaligned layouts (gap 3 elements: the unaligned launch kind)."""
    monkeypatch.setattr(fp8kernel, "available", lambda device, block: None)
    monkeypatch.setattr(fp8kernel.FusedQuantBinding, "launch", _run_tables)
    plan, sources = _two_weights_plan()
    replayer = QuantizingReplayer(plan, sources, quantizer=QID)
    gen = torch.Generator().manual_seed(gap)
    for round in range(3):
        tensors = _in_one_storage(
            {
                W: (torch.randn(SHAPE, generator=gen) * 3).bfloat16(),
                "layer.up.weight": torch.randn((384, 256), generator=gen).bfloat16(),
                "norm": torch.randn(384, generator=gen).bfloat16(),
            },
            gap,
        )
        bound = replayer.bind(tensors, torch.zeros(replayer.layout.nbytes, dtype=torch.uint8))  # (padding: 0)
        assert bound.kernel is not None and len(replayer.fused_plan().weights) == 2
        kinds = {(vec, full) for _, _, vec, _, full in bound.kernel.launches}
        assert (1, False) in kinds if gap == 3 else (8, True) in kinds, kinds
        assert torch.equal(bound.pack(), replayer.bind(tensors, fused=False).pack()), round
    assert len(replayer.fused_plan()._tables) == 1  # one geometry: built once, bound three times


def test_fused_path_names_a_non_finite_block_and_a_stale_tensor(monkeypatch):
    _fused_on_cpu(monkeypatch)
    monkeypatch.setattr(
        fp8kernel.FusedQuantBinding,
        "launch",
        lambda self: (
            self.plan.run_reference(dict(zip(self.plan.weights, self.tensors)), self.out, self.scales, quantize_blocks),
            self.flag.fill_(int(not all(torch.isfinite(t).all() for t in self.tensors))),
        ),
    )
    tensors = trainer_tensors(3)
    bound = QuantizingReplayer(rows_plan(1, 128, 256), SOURCES, quantizer=QID).bind(tensors)
    assert bound.kernel is not None
    tensors[W][200, 300] = float("inf")
    with pytest.raises(NonFiniteBlockError, match=r"'layer.proj.weight' holds inf at \[200, 300\] \(block \[1, 2\]"):
        bound.pack()
    tensors[W].data = torch.zeros(SHAPE, dtype=torch.bfloat16)
    with pytest.raises(StaleBindingError, match="layer.proj.weight"):
        bound.pack()


def test_fused_kernel_needs_cuda():
    with pytest.raises(QuantizeError, match="fused FP8 kernel cannot run here: .*CUDA"):
        QuantizingReplayer(rows_plan(0, 0, 128), SOURCES, quantizer=QID).bind(trainer_tensors(0), fused=True)


@pytest.mark.parametrize("swap", ["data", "set_"])
def test_eager_path_names_a_tensor_whose_storage_was_swapped(swap):
    """The eager quantizer reads the trainer's weights through views made at bind(), which keep the old storage:
    a swapped weight must be named, not quantized from its old bytes."""
    tensors = trainer_tensors(3)
    bound = QuantizingReplayer(rows_plan(1, 128, 256), SOURCES, quantizer=QID).bind(tensors, fused=False)
    bound.pack()
    new = torch.zeros(SHAPE, dtype=torch.bfloat16)
    if swap == "data":
        tensors[W].data = new
    else:
        tensors[W].set_(new)
    with pytest.raises(StaleBindingError, match="layer.proj.weight"):
        bound.pack()


# ---- the columnar build (runtime/quantplan.py) -----------------------------------------------------------------------
def _covered_block_by_block(read, scale_boxes) -> bool:
    (r0, r1), (c0, c1) = read
    have = {(i, j) for (a, b), (c, d) in scale_boxes for i in range(a, b) for j in range(c, d)}
    return all((i, j) in have for i in range(r0, r1) for j in range(c0, c1))


_span = st.tuples(st.integers(0, 6), st.integers(1, 4)).map(lambda t: (t[0], t[0] + t[1]))


@settings(max_examples=200, deadline=None)
@given(
    reads=st.lists(st.tuples(st.integers(0, 2), _span, _span), min_size=1, max_size=5),
    scales=st.lists(st.tuples(st.integers(0, 2), _span, _span), max_size=8),
)
def test_coverage_check_equals_block_by_block(reads, scales):
    """quantplan.uncovered (one segmented numpy pass) names the first read whose blocks some scale read of the same
    key misses, exactly as a block-by-block check does (overlapping boxes, holes, either orientation)."""
    import numpy as np

    from shardplan.runtime import quantplan

    def arrays(items):
        keys = np.asarray([k for k, _, _ in items], dtype=np.int64).reshape(-1)
        rows = tuple(np.asarray([r[i] for _, r, _ in items], dtype=np.int64).reshape(-1) for i in (0, 1))
        cols = tuple(np.asarray([c[i] for _, _, c in items], dtype=np.int64).reshape(-1) for i in (0, 1))
        return keys, rows, cols

    got = quantplan.uncovered(*arrays(reads), *arrays(scales))
    expect = next(
        (
            i
            for i, (k, r, c) in enumerate(reads)
            if not _covered_block_by_block((r, c), [(sr, sc) for sk, sr, sc in scales if sk == k])
        ),
        -1,
    )
    assert got == expect


def test_build_from_a_plan_file_makes_no_write_objects_or_names(monkeypatch):
    """A plan file's rank builds its QuantizingReplayer on columns: no `ir.Write` per write and no tensor name spelled
    out (a Qwen3-30B-A3B FP8 rank has ~56k writes and ~18k quantized weights; per-object work cost seconds), and
    the boxes are the rank's own TP rows, widened to whole blocks."""
    from pathlib import Path

    from shardplan.plan.columns import TableSourceIds, WriteColumns
    from shardplan.plan.file.format import PlanFile

    plan_file = PlanFile.read(str(Path(__file__).resolve().parents[2] / "plans/qwen3-30b-a3b-fp8--tp4--bfloat16.plan"))
    plan = plan_file.rank(1)
    calls = []
    monkeypatch.setattr(WriteColumns, "write", lambda self, i: calls.append(("write", i)))
    real_name = TableSourceIds.name
    monkeypatch.setattr(TableSourceIds, "name", lambda self, i: calls.append(("name", i)) or real_name(self, i))
    replayer = QuantizingReplayer(plan, plan_file.sources, quantizer=plan_file.header.quantizer)
    assert calls == []
    monkeypatch.undo()
    down = "model.layers.5.mlp.experts.7.down_proj.weight"  # [2048, 768]: rank 1 reads cols [192, 384)
    assert replayer.boxes[down] == ((0, 2048), (128, 384))
    assert replayer.boxes["model.layers.5.mlp.experts.7.gate_proj.weight"] == ((128, 384), (0, 2048))
    assert "model.layers.5.mlp.experts.7.down_proj.weight_scale_inv" not in replayer.boxes
    group = replayer.for_group(replayer.layout.groups[4].name)  # (embeddings, then layer 0, ...)
    assert down.replace("5", "3", 1) in group.quantized and down not in group.quantized
    assert len(group.quantized) == 128 * 3 + 4  # experts' gate/up/down, attention's q/k/v/o


def test_a_plan_with_nothing_to_quantize_builds_as_a_plain_replay():
    """A plan file with no FP8 weight (a BF16 engine's plan handed to the quantizing replay, as a trainer does before
    the engine refuses the plan's quantization mode by name) builds, quantizes nothing and packs what Replayer packs
    (the columnar build once indexed its empty table of staged weights)."""
    from pathlib import Path

    from shardplan.plan.file.format import PlanFile

    plan_file = PlanFile.read(str(Path(__file__).resolve().parents[2] / "plans/llama-3.1-8b--tp2--bfloat16.plan"))
    plan = plan_file.rank(1)
    replayer = QuantizingReplayer(plan, plan_file.sources, quantizer=QID)
    plain = Replayer(plan, plan_file.sources)
    assert replayer.boxes == {} and all(not replayer.for_group(g.name).quantized for g in replayer.layout.groups)
    assert [(g.name, g.nbytes) for g in replayer.layout.groups] == [(g.name, g.nbytes) for g in plain.layout.groups]


def test_a_subset_reads_its_own_sources_after_the_whole_layout_was_asked():
    """sources_read is kept per replayer (plan-only); a subset or group derived afterwards must not inherit the whole
    layout's set: the sync binds and checks exactly the names a subset reads (it got all of them before)."""
    plan, sources = _two_weights_plan()
    cold = QuantizingReplayer(plan, sources, quantizer=QID)
    warm = QuantizingReplayer(plan, sources, quantizer=QID)
    whole = warm.sources_read()
    subsets = [
        (cold.subset([i]).sources_read(), warm.subset([i]).sources_read()) for i in range(len(warm.layout.segments))
    ]
    assert all(own == got for own, got in subsets), subsets
    assert any(own < whole for own, _ in subsets), (whole, subsets)
