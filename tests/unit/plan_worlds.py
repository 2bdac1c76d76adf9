"""Random plans over one sources table, random trainer tensors and the reference comparison, for the runtime's
property tests (test_replay.py, test_columns.py, test_shards.py, test_figures.py): what the tests share, in one place
instead of imported from each other.

Plans are synthesized by hypothesis: random source shapes, random view chains on meta tensors (narrow, transpose,
unsqueeze, expand, select, stepped slices) whose storage_offset/sizes/strides become regions, fused destinations
(several sources stacked or concatenated into one param, permuted destination views, broadcast copies), overlapping
writes (last write wins), dtype conversions, and Call/Full/Update leaves.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from shardplan.plan import ir
from shardplan.plan.compile.compiler import compile_plans
from shardplan.plan.file.format import PlanFile, decode, encode
from shardplan.plan.interp import apply_reference
from shardplan.plan.layout import Layout
from shardplan.runtime.apply import Applier, params_from_plan

DTYPES = ["bfloat16", "float32", "float16"]
NAN = float("nan")


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes, so that NaN == NaN and -0.0 != 0.0: comparisons are bitwise."""
    return t.contiguous().view(-1).view(torch.uint8)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# ---- plan generators --------------------------------------------------------------------------------------------
@st.composite
def view_chain(draw, shape: tuple[int, ...]) -> ir.Region:
    """A random chain of view ops on a meta tensor; its geometry is the region (what the recorder folds it into)."""
    t = torch.empty(shape, device="meta")
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["narrow", "transpose", "unsqueeze", "expand", "select", "step", "flatten"]))
        dims = t.dim()
        if op == "narrow" and dims:
            dim = draw(st.integers(0, dims - 1))
            start = draw(st.integers(0, t.shape[dim] - 1))
            t = t.narrow(dim, start, draw(st.integers(1, t.shape[dim] - start)))
        elif op == "transpose" and dims >= 2:
            t = t.transpose(*draw(st.permutations(range(dims)))[:2])
        elif op == "unsqueeze" and dims < 4:
            t = t.unsqueeze(draw(st.integers(0, dims)))
        elif op == "expand":
            ones = [d for d in range(dims) if t.shape[d] == 1]
            if ones:
                sizes = list(t.shape)
                sizes[draw(st.sampled_from(ones))] = draw(st.integers(2, 3))
                t = t.expand(sizes)
        elif op == "select" and dims >= 2:
            dim = draw(st.integers(0, dims - 1))
            t = t.select(dim, draw(st.integers(0, t.shape[dim] - 1)))
        elif op == "flatten" and dims >= 2 and t.is_contiguous():  # merged dims (view(-1) of whole rows)
            t = t.flatten()
        elif op == "step" and dims:
            dim = draw(st.integers(0, dims - 1))
            if t.shape[dim] >= 2:
                index = [slice(None)] * dim + [slice(draw(st.integers(0, 1)), None, draw(st.integers(2, 3)))]
                t = t[tuple(index)]
    return ir.Region(t.storage_offset(), tuple(t.shape), tuple(t.stride()))


shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)


class World:
    """Sources and per-rank writes being generated."""

    def __init__(self):
        self.sources: dict[str, ir.TensorMeta] = {}
        self.params: dict[str, ir.TensorMeta] = {}
        self.writes: list[ir.Write] = []

    def source(self, shape, dtype) -> str:
        name = f"model.layers.{len(self.sources) % 3}.src{len(self.sources)}.weight"
        self.sources[name] = ir.TensorMeta(name, tuple(shape), dtype)
        return name

    def param(self, shape, dtype, group) -> str:
        name = f"{group}.p{len(self.params)}.weight"
        self.params[name] = ir.TensorMeta(name, tuple(shape), dtype)
        return name

    def meta_tensors(self):
        return {n: torch.empty(m.shape, dtype=getattr(torch, m.dtype), device="meta") for n, m in self.sources.items()}


GROUPS = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.11", "lm_head"]


@st.composite
def fused_writes(draw, world: World) -> None:
    """k sources of one shape, one view chain, written into one param: stacked (k, *P) or concatenated (k*P0, ...),
    the destination optionally permuted and broadcast along size-1 source dims."""
    shape, src_dtype = draw(shapes), draw(st.sampled_from(DTYPES))
    region = draw(view_chain(shape))
    names = [world.source(shape, src_dtype) for _ in range(draw(st.integers(1, 3)))]
    sizes = tuple(draw(st.integers(1, 3)) if s == 1 and draw(st.booleans()) else s for s in region.sizes)
    perm = draw(st.permutations(range(len(sizes))))
    inverse = [perm.index(d) for d in range(len(sizes))]
    permuted = tuple(sizes[p] for p in perm)
    concat = bool(permuted) and draw(st.booleans())
    # slots: where each source lands along the fused dim; irregular slots (some left unwritten) when drawn so
    slots = draw(st.permutations(range(len(names) + draw(st.integers(0, 3)))))[: len(names)]
    num_slots = max(slots) + 1
    shape_p = ((num_slots * permuted[0],) + permuted[1:]) if concat else (num_slots,) + permuted
    param = world.param(shape_p, draw(st.sampled_from(DTYPES)), draw(st.sampled_from(GROUPS)))
    p = torch.empty(shape_p, device="meta")
    for i, name in zip(slots, names):
        dst = (p[i * permuted[0] : (i + 1) * permuted[0]] if concat else p[i]).permute(inverse)
        # a recorded source region may keep fewer dims than the destination: copy_ broadcasts leading dims
        src = region
        if len(src.sizes) and src.sizes[0] == 1 and draw(st.booleans()):
            src = ir.Region(src.offset, src.sizes[1:], src.strides[1:])
        world.writes.append(ir.Write(param, _region(dst), ir.View(ir.Source(name), src)))


def _region(t: torch.Tensor) -> ir.Region:
    return ir.Region(t.storage_offset(), tuple(t.shape), tuple(t.stride()))


@st.composite
def computed_write(draw, world: World) -> None:
    """A write whose source is a Call, Full or Update leaf (goes through the reference interpreter)."""
    kind = draw(st.sampled_from(["reshape", "cat", "index_select", "to", "update", "full", "chunk", "neg_exp"]))
    dtype = draw(st.sampled_from(DTYPES))
    a, b = draw(st.integers(2, 5)), draw(st.integers(2, 5))
    if kind == "full":
        leaf = ir.Full(draw(st.sampled_from([0.0, 1.5, -2.0])), (a, b), dtype)
    else:
        x = world.source((a, b), dtype)
        whole = ir.View(ir.Source(x), ir.full_region((a, b)))
        transposed = ir.View(ir.Source(x), ir.Region(0, (b, a), (1, b)))
        if kind == "reshape":  # reshape of a transposed view needs a copy: not a pure view
            leaf = ir.Call("Tensor.reshape", (ir.Arg(0), (-1,)), (), (transposed,))
        elif kind == "cat":
            y = world.source((draw(st.integers(1, 3)), b), dtype)
            leaf = ir.Call(
                "torch.cat",
                ((ir.Arg(0), ir.Arg(1)),),
                (("dim", 0),),
                (whole, ir.View(ir.Source(y), ir.full_region(world.sources[y].shape))),
            )
        elif kind == "index_select":
            index = tuple(draw(st.lists(st.integers(0, a - 1), min_size=1, max_size=4)))
            leaf = ir.Call("Tensor.index_select", (ir.Arg(0), 0, ir.Const("int64", (len(index),), index)), (), (whole,))
        elif kind == "to":
            leaf = ir.Call("Tensor.to", (ir.Arg(0), ir.DType(draw(st.sampled_from(DTYPES)))), (), (transposed,))
        elif kind == "chunk":
            leaf = ir.Call("Tensor.chunk", (ir.Arg(0), 2), (("dim", 1),), (whole,), 1)
        elif kind == "neg_exp":  # the Mamba family's A: -exp(A_log.float())
            leaf = neg_exp(transposed, (b, a))
        else:
            value = ir.View(ir.Full(3.0, (1, b), dtype), ir.full_region((1, b)))
            leaf = ir.Update(ir.Source(x), ir.Region(b * draw(st.integers(0, a - 1)), (1, b), (b, 1)), value)
    shape = _leaf_shape(leaf, world)
    region = draw(view_chain(shape))
    param = world.param(region.sizes or (1,), draw(st.sampled_from(DTYPES)), draw(st.sampled_from(GROUPS)))
    dst = ir.full_region(region.sizes) if region.sizes else ir.Region(0, (), ())
    world.writes.append(ir.Write(param, dst, ir.View(leaf, region)))


def neg_exp(view: ir.View, shape: tuple[int, ...]) -> ir.Call:
    as_float = ir.View(ir.Call("Tensor.float", (ir.Arg(0),), (), (view,)), ir.full_region(shape))
    exp = ir.View(ir.Call("torch.exp", (ir.Arg(0),), (), (as_float,)), ir.full_region(shape))
    return ir.Call("Tensor.neg", (ir.Arg(0),), (), (exp,))


def _leaf_shape(leaf, world: World) -> tuple[int, ...]:
    from shardplan.plan.interp import eval_leaf

    return tuple(eval_leaf(leaf, world.meta_tensors(), "meta").shape)


@st.composite
def overwrite(draw, world: World) -> None:
    """Overwrite part of an earlier write's destination (last write wins): a narrowed sub-box of its index space."""
    w = world.writes[draw(st.integers(0, len(world.writes) - 1))]
    if not w.dst.sizes:
        return
    start = draw(st.integers(0, w.dst.sizes[0] - 1))
    length = draw(st.integers(1, w.dst.sizes[0] - start))
    dst = ir.Region(w.dst.offset + start * w.dst.strides[0], (length,) + w.dst.sizes[1:], w.dst.strides)
    dtype = world.params[w.param].dtype
    if draw(st.booleans()):
        src = ir.View(ir.Full(draw(st.sampled_from([7.0, -0.0])), dst.sizes, dtype), ir.full_region(dst.sizes))
    else:  # a second source of the same shape, same sub-box
        name = (
            world.source(world.sources[w.src.leaf.name].shape, world.sources[w.src.leaf.name].dtype)
            if ir.is_pure_view(w)
            else None
        )
        if name is None:
            return
        src_region = ir.Region(w.src.region.offset, w.src.region.sizes, w.src.region.strides)
        full = ir.Write(w.param, w.dst, ir.View(ir.Source(name), src_region))
        world.writes.append(full)
        return
    world.writes.append(ir.Write(w.param, dst, src))


@st.composite
def worlds(
    draw, max_ranks: int = 3, computed: bool = True, overwrites: bool = True
) -> tuple[list[ir.RankPlan], dict[str, ir.TensorMeta]]:
    """Plans for 1..max_ranks consumer ranks over one sources table. Ranks share some writes (replicated params:
    identical bytes, packed once) and differ in others."""
    world = World()
    for _ in range(draw(st.integers(1, 5))):
        draw(fused_writes(world))
    if computed:
        for _ in range(draw(st.integers(0, 2))):
            draw(computed_write(world))
    for _ in range(draw(st.integers(0, 2)) if overwrites else 0):
        draw(overwrite(world))
    num_ranks = draw(st.integers(1, max_ranks))
    plans = []
    for rank in range(num_ranks):
        keep = [w for w in world.writes if rank == 0 or draw(st.booleans())]
        names = {w.param for w in keep}
        params = tuple(m for n, m in world.params.items() if n in names)
        plans.append(ir.RankPlan(rank * 2 + 1, params, tuple(keep)))
    return plans, world.sources


def random_tensors(sources: dict[str, ir.TensorMeta], seed: int, flat: bool = False) -> dict[str, torch.Tensor]:
    """Random trainer tensors; flat: all of them views of one byte buffer at mixed alignments (as in trainers that
    keep parameters in one flat buffer), which exercises the same-storage and width fallbacks."""
    gen = torch.Generator().manual_seed(seed)
    values = {n: torch.randn(m.shape, generator=gen).to(getattr(torch, m.dtype)) for n, m in sources.items()}
    if not flat:
        return values
    total = sum(v.numel() * v.element_size() + 16 for v in values.values()) + 16
    storage = torch.empty(total, dtype=torch.uint8)
    out, offset = {}, 2
    for name, v in values.items():
        itemsize = v.element_size()
        offset = (offset + itemsize - 1) // itemsize * itemsize
        view = torch.empty(0, dtype=v.dtype).set_(
            storage.untyped_storage(), offset // itemsize, v.shape, ir.contiguous_strides(v.shape)
        )
        view.copy_(v)
        out[name] = view
        offset += v.numel() * itemsize + itemsize * int(torch.randint(0, 3, (1,), generator=gen))
    return out


def reference_params(plan: ir.RankPlan, tensors) -> dict[str, torch.Tensor]:
    params = params_from_plan(plan, fill=NAN)
    apply_reference(plan, tensors, params)
    return params


def assert_matches_reference(plan: ir.RankPlan, applier: Applier, params, tensors) -> None:
    want = reference_params(plan, tensors)
    for name, t in params.items():
        assert bits_equal(t, want[name]), f"rank {plan.rank} param {name} differs from the reference"
        mask = applier.coverage_mask(name)
        assert torch.isnan(t[~mask].float()).all(), f"{name}: an element outside the plan's regions was written"
    for name in applier.coverage():
        assert name in params


def plan_file_of(plans, sources) -> PlanFile:
    """The plans compiled, encoded and decoded as a plan file (one TP rank per plan)."""
    data = encode(
        compile_plans(plans, list(sources.values())),
        model="test/model",
        architecture="TestForCausalLM",
        config_sha256="0" * 64,
        layout=Layout(tp=len(plans)),
        dtype="bfloat16",
        vllm_version="0.32.0",
    )
    return PlanFile(*decode(data, "x.plan"), "x.plan")
