"""Unit tests of the recorder, independent of any real model.

Each test writes a tiny `torch.nn.Module` whose `load_weights(weights)` uses one loader idiom, builds it on the meta
device, records it with `record_loader`, replays the plan with the reference interpreter into a NaN-poisoned CPU copy,
and compares bit for bit with the same `load_weights` run on real tensors. Each also checks the *shape* of the plan
(a pure view stays a `Source` leaf, a copy becomes the expected `Call`, a constant is recorded by value, ...), so a
recorder that got the values right by falling back, or by recording the wrong thing, fails too.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardplan.plan import interp, ir
from shardplan.plan.layout import Layout
from shardplan.record.loader import record_loader
from shardplan.record.parallel import fake_parallel_state
from shardplan.record.recording import LoaderRejectsCheckpoint, RecordError, UnsupportedLoaderOp

NAN = float("nan")


class Toy(torch.nn.Module):
    """Parameters of the given shapes (requires_grad=False, as vLLM's) and a loader function `fn(model, name, t)`."""

    def __init__(self, params: dict[str, tuple[int, ...]], fn, dtype=torch.float32, **attrs):
        super().__init__()
        for name, shape in params.items():
            self.register_parameter(name, torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))
        self.fn = fn
        for k, v in attrs.items():
            setattr(self, k, v)

    def load_weights(self, weights):
        for name, t in weights:
            self.fn(self, name, t)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def checkpoint(sources: dict[str, tuple[tuple[int, ...], torch.dtype]], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=gen).to(dtype) for n, (shape, dtype) in sources.items()}


def run(
    make, sources, *, rank: int = 0, allow_nan: tuple[str, ...] = (), strict: bool = False, tier: str | None = None
):
    """Record `make()`'s loader on meta, replay it, and compare with the real loader. Returns (plan, recording).

    sources: name -> shape (float32) or name -> (shape, dtype). Every parameter the plan writes must be fully
    written (no NaN left) unless listed in allow_nan. The recording is made by both tiers (record_loader's "auto",
    which tries the fast tier first, and "full"): their plans must be equal; `tier` ("fast"/"full"), when given, is
    the tier "auto" must have ended up with."""
    sources = {
        n: (v if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], torch.dtype) else (v, torch.float32))
        for n, v in sources.items()
    }
    tensors = [(n, tuple(s), str(d).removeprefix("torch.")) for n, (s, d) in sources.items()]
    with torch.device("meta"):
        meta = make()
    rec = record_loader(meta, tensors, rank=rank, strict=strict)
    plan = rec.to_plan()
    if tier is not None:
        assert rec.tier == tier, f"recorded by the {rec.tier} tier ({rec.tier_note}), expected the {tier} tier"
    with torch.device("meta"):
        meta = make()
    full = record_loader(meta, tensors, rank=rank, strict=strict, tier="full")
    assert full.tier == "full"
    assert full.to_plan() == plan, "the fast and the full tier recorded different plans"

    ckpt = checkpoint(sources)
    pristine = {n: t.clone() for n, t in ckpt.items()}
    real = make()
    replayed = make()
    for m in (real, replayed):
        for p in m.parameters():
            p.data.fill_(NAN)
    # the real loader gets the tensors the plan covers (fallbacks would go through the real loader on both sides; the
    # toy loaders here are stateless, so leaving them out of both is the same comparison); it may modify its input
    fallbacks = {f.source for f in plan.fallbacks}
    with torch.no_grad():
        real.load_weights(iter([(n, t.clone()) for n, t in ckpt.items() if n not in fallbacks]))
    interp.apply_reference(plan, ckpt, dict(replayed.named_parameters()))
    for n in ckpt:  # replay never modifies the trainer's tensors, even where the loader works in place
        assert torch.equal(bits(ckpt[n]), bits(pristine[n])), f"replay modified source {n}"
    for name, p in real.named_parameters():
        q = dict(replayed.named_parameters())[name]
        assert torch.equal(bits(p), bits(q)), f"{name}: replay differs from the real loader\n{p}\n{q}"
    for meta_p in plan.params:
        if meta_p.name not in allow_nan:
            assert not torch.isnan(dict(replayed.named_parameters())[meta_p.name]).any(), f"{meta_p.name} has holes"
    return plan, rec


def leaves(plan: ir.RankPlan) -> list:
    return [w.src.leaf for w in plan.writes]


def ops(plan: ir.RankPlan) -> list[str]:
    out: list[str] = []
    for w in plan.writes:
        ir.literal_ops(w.src.leaf, out)
    return out


def assert_pure_views(plan: ir.RankPlan, n: int | None = None) -> None:
    assert plan.writes and all(ir.is_pure_view(w) for w in plan.writes), [ir.leaf_str(x, {}) for x in leaves(plan)]
    assert not plan.fallbacks
    if n is not None:
        assert len(plan.writes) == n


# ---- the fast tier: plain meta tensors, only sinks hooked; gives up (to the full tier) on anything else -----------
def test_fast_tier_records_plain_views_and_padding_fills():
    def fn(m, name, t):
        m.w.data[:2].copy_(t.t().narrow(0, 1, 2))
        m.w.data[2:].fill_(0.0)  # vocab padding rows: a Full write, no source read
        m.v.data.copy_(t[0], non_blocking=True)

    plan, rec = run(lambda: Toy({"w": (3, 3), "v": (3,)}, fn), {"x": (3, 3)}, tier="fast")
    assert rec.tier_note == ""
    assert [type(w.src.leaf).__name__ for w in plan.writes] == ["Source", "Full", "Source"]


@pytest.mark.parametrize(
    "idiom",
    [
        "imul",
        "data_alias_mul",
        "cat",
        "contiguous",
        "to_dtype",
        "dtype_view",
        "broadcast",
        "scratch",
        "setitem",
        "param_storage",
        "value_read_swallowed",
    ],
)
def test_fast_tier_gives_up_on_what_it_cannot_see(idiom):
    """Each idiom changes the loaded values or the copy's meaning in a way the fast tier's sink cannot see from the
    source's geometry alone: it must give up, and the full tier's recording must still equal the real loader."""

    def fn(m, name, t):
        if idiom == "imul":
            t *= 2.0  # not a hooked method: caught by the version counter at the sink
            m.w.data.copy_(t)
        elif idiom == "data_alias_mul":
            t.data.mul_(2.0)  # .data has its own version counter: caught by the hook on mul_
            m.w.data.copy_(t)
        elif idiom == "cat":
            m.w.data.copy_(torch.cat([t[2:], t[:2]]))
        elif idiom == "contiguous":
            m.w.data.copy_(t.view(2, 2).t().contiguous().view(4))
        elif idiom == "to_dtype":
            m.w.data.copy_(t.to(torch.float16))
        elif idiom == "dtype_view":
            m.w.data.view(torch.int32).copy_(t.view(torch.int32))
        elif idiom == "broadcast":
            m.w.data.copy_(t[:1])
        elif idiom == "scratch":
            s = torch.zeros(4, device=t.device)
            s[1:].copy_(t[1:])
            m.w.data.copy_(s)
        elif idiom == "setitem":
            m.w.data[:] = t
        elif idiom == "param_storage":
            m.w.data = t
        elif idiom == "value_read_swallowed":
            try:
                t[0].zero_()  # the fast tier gives up here; the loader swallows it and carries on
            except Exception:
                pass
            m.w.data.copy_(t)

    plan, rec = run(
        lambda: Toy({"w": (4,)}, fn), {"x": (4,)}, tier="full", allow_nan=("w",) if idiom == "param_storage" else ()
    )
    assert rec.tier_note, "a give-up must say why"
    if idiom == "param_storage":  # the full tier cannot express it either: a fallback, the real loader runs for it
        assert [f.source for f in plan.fallbacks] == ["x"] and "storage" in plan.fallbacks[0].reason
    else:
        assert not plan.fallbacks and plan.sources_read() == {"x"}


def test_recordings_do_not_nest():
    # a loader that starts another recording (both tiers refuse it, the full one with a named error)
    def fn(m, name, t):
        record_loader(Toy({"v": (4,)}, lambda *a: None), [("y", (4,), "float32")], rank=0)
        m.w.data.copy_(t)

    with torch.device("meta"):
        model = Toy({"w": (4,)}, fn)
    with pytest.raises(RecordError, match="do not nest"):
        record_loader(model, [("x", (4,), "float32")], rank=0)


def test_param_data_assignment_is_a_fallback_and_the_rest_is_recorded():
    # no torch function sees `param.data = t`: both tiers check the parameters' storages after the load
    def fn(m, name, t):
        if name == "x":
            m.w.data = t
        elif name == "y":
            m.v.data.copy_(t)

    plan, rec = run(
        lambda: Toy({"w": (4,), "v": (4,)}, fn), {"skipped": (4,), "x": (4,), "y": (4,)}, tier="full", allow_nan=("w",)
    )
    assert [f.source for f in plan.fallbacks] == ["x"] and plan.sources_read() == {"y"}
    assert plan.not_needed == ("skipped",)


# ---- view ops: fold into one Source view ------------------------------------------------------------------------
def test_narrow():
    def fn(m, name, t):
        m.w.data.copy_(t.narrow(0, 2, 3).narrow(1, 1, 4))

    plan, _ = run(lambda: Toy({"w": (3, 4)}, fn), {"x": (6, 5)})
    assert_pure_views(plan, 1)
    assert plan.writes[0].src.region == ir.Region(2 * 5 + 1, (3, 4), (5, 1))


def test_view():
    def fn(m, name, t):
        m.w.data.copy_(t.view(4, 6))

    plan, _ = run(lambda: Toy({"w": (4, 6)}, fn), {"x": (24,)})
    assert_pure_views(plan, 1)


def test_reshape_as_view():
    def fn(m, name, t):
        m.w.data.copy_(t.reshape(2, 12)[:, 3:9].reshape(2, 2, 3)[1])

    plan, _ = run(lambda: Toy({"w": (2, 3)}, fn), {"x": (4, 6)})
    assert_pure_views(plan, 1)
    assert "Tensor.reshape" not in ops(plan)


def test_reshape_needing_copy():
    # view -> transpose -> reshape (Bloom's query_key_value repack): the last reshape must copy
    def fn(m, name, t):
        m.w.data.copy_(t.view(2, 3, 4).transpose(0, 1).reshape(6, 4))

    plan, _ = run(lambda: Toy({"w": (6, 4)}, fn), {"x": (6, 4)})
    assert ops(plan) == ["Tensor.reshape"]
    call = plan.writes[0].src.leaf
    assert isinstance(call, ir.Call) and isinstance(call.inputs[0].leaf, ir.Source)
    assert call.inputs[0].region.strides == (4, 12, 1)  # the transposed view is the reshape's input


@pytest.mark.parametrize("how", ["transpose", "t", "T", "mT", "data.t"])
def test_transpose(how):
    def fn(m, name, t):
        src = {
            "transpose": lambda: t.transpose(0, 1),
            "t": lambda: t.t(),
            "T": lambda: t.T,
            "mT": lambda: t.mT,
            "data.t": lambda: t.data.t(),
        }[how]()
        m.w.data.copy_(src)

    plan, _ = run(lambda: Toy({"w": (5, 3)}, fn), {"x": (3, 5)})
    assert_pure_views(plan, 1)
    assert plan.writes[0].src.region.strides == (1, 5)


@pytest.mark.parametrize("how", ["T", "data"])
def test_ops_on_property_views_are_recorded(how):
    # `t.T` / `t.data` return plain tensors from a RecTensor; an op on them must still be seen (it used to be lost)
    def fn(m, name, t):
        v = t.T if how == "T" else t.data.t()
        m.w.data.copy_(v.contiguous())

    plan, _ = run(lambda: Toy({"w": (5, 3)}, fn), {"x": (3, 5)})
    assert ops(plan) == ["Tensor.contiguous"]


def test_permute():
    def fn(m, name, t):
        m.w.data.copy_(t.permute(2, 0, 1))

    plan, _ = run(lambda: Toy({"w": (4, 2, 3)}, fn), {"x": (2, 3, 4)})
    assert_pure_views(plan, 1)


def test_unsqueeze_squeeze():
    def fn(m, name, t):
        if name == "a":
            m.w.data.copy_(t.unsqueeze(-1))
        else:
            m.v.data.copy_(t.squeeze(0))

    plan, _ = run(lambda: Toy({"w": (6, 1), "v": (6,)}, fn), {"a": (6,), "b": (1, 6)})
    assert_pure_views(plan, 2)


def test_expand_and_broadcast_copy():
    def fn(m, name, t):
        if name == "row":
            m.w.data.copy_(t.unsqueeze(0).expand(4, -1))  # explicit expand
        else:
            m.v.data.copy_(t)  # copy_ broadcasts [6] over [3, 6]

    plan, _ = run(lambda: Toy({"w": (4, 6), "v": (3, 6)}, fn), {"row": (6,), "bias": (6,)})
    assert_pure_views(plan, 2)
    assert all(w.src.region.strides[0] == 0 for w in plan.writes)


def test_getitem_slices_ints_ellipsis():
    def fn(m, name, t):
        m.a.data.copy_(t[1, ..., 2:5])
        m.b.data.copy_(t[:, ::2, -1])
        m.c.data.copy_(t[..., None, 0])

    plan, _ = run(lambda: Toy({"a": (4, 3), "b": (3, 2), "c": (3, 4, 1)}, fn), {"x": (3, 4, 6)})
    assert_pure_views(plan, 3)


def test_chunk_split_unbind_keep_their_output():
    def fn(m, name, t):
        m.c.data.copy_(t.chunk(3, dim=0)[1])  # the middle chunk, not the first
        first, second = t.split([2, 4], dim=0)  # both outputs of split
        m.s0.data.copy_(first)
        m.s1.data.copy_(second)
        for i, row in enumerate(t.unbind(1)):  # every output of unbind
            m.u.data[i].copy_(row)

    plan, _ = run(lambda: Toy({"c": (2, 3), "s0": (2, 3), "s1": (4, 3), "u": (3, 6)}, fn), {"x": (6, 3)})
    assert_pure_views(plan, 6)
    by_param = {w.param: w.src.region for w in plan.writes}
    assert by_param["c"].offset == 2 * 3 and by_param["s1"].offset == 2 * 3


# ---- ops that materialise a tensor: recorded as Calls -------------------------------------------------------------
def test_contiguous():
    def fn(m, name, t):
        m.w.data.copy_(t.t().contiguous())

    plan, _ = run(lambda: Toy({"w": (5, 3)}, fn), {"x": (3, 5)})
    assert ops(plan) == ["Tensor.contiguous"]


def test_cat_of_two_pieces_of_one_source():
    # Falcon's query_key_value: pieces of one fused tensor, reordered and concatenated
    def fn(m, name, t):
        m.w.data.copy_(torch.cat([t[4:].t(), t[:4].t()], dim=1))

    plan, _ = run(lambda: Toy({"w": (3, 6)}, fn), {"x": (6, 3)})
    assert ops(plan) == ["torch.cat"]
    call = plan.writes[0].src.leaf
    assert len(call.inputs) == 2 and {v.leaf for v in call.inputs} == {ir.Source("x")}
    assert [v.region.offset for v in call.inputs] == [4 * 3, 0]


def test_to_dtype():
    # the precision lost in the round trip must be reproduced bit for bit
    def fn(m, name, t):
        m.w.data.copy_(t.to(torch.float16).to(torch.float32))
        m.h.data.copy_(t.to(dtype=torch.bfloat16))

    plan, _ = run(lambda: Toy({"w": (4, 4), "h": (4, 4)}, fn), {"x": (4, 4)})
    assert ops(plan).count("Tensor.to") == 3
    assert ir.DType("float16") in plan.writes[0].src.leaf.inputs[0].leaf.args


@pytest.mark.parametrize("idiom", ["attribute", "computed", "moved_to_loaded_device"])
def test_index_with_constant_index_tensor_from_the_model(idiom):
    perm = torch.tensor([3, 0, 2, 1])

    def fn(m, name, t):
        if idiom == "attribute":
            idx = m.perm
        elif idiom == "computed":
            idx = torch.arange(4).flip(0)
        else:  # Llama 4's EP expert indices: `(expert_map != -1).nonzero().flatten().to(loaded.device)`
            idx = (m.expert_map != -1).nonzero().flatten().to(t.device)
        m.w.data.copy_(t.index_select(0, idx))
        m.v.data.copy_(t[idx])

    expected = {"attribute": perm, "computed": torch.arange(4).flip(0), "moved_to_loaded_device": torch.tensor([1, 3])}[
        idiom
    ]
    shape = (len(expected), 3)
    expert_map = torch.tensor(
        [-1, 0, -1, 1]
    )  # CPU, as shardplan.record.build keeps vLLM's expert maps when building on meta
    plan, _ = run(
        lambda: Toy({"w": shape, "v": shape}, fn, perm=perm.clone(), expert_map=expert_map.clone()), {"x": (4, 3)}
    )
    assert not plan.fallbacks, plan.fallbacks
    assert sorted(ops(plan)) == ["Tensor.__getitem__", "Tensor.index_select"]
    consts = [a for leaf in leaves(plan) for a in leaf.args if isinstance(a, ir.Const)]
    assert len(consts) == 2 and all(c.values == tuple(expected.tolist()) for c in consts)


def test_index_tensor_on_meta_is_a_fallback():
    # a model buffer built on meta has no values: that cannot be recorded, and must not be guessed
    class M(Toy):
        def __init__(self):
            super().__init__({"w": (2, 3)}, lambda m, n, t: m.w.data.copy_(t.index_select(0, m.idx)))
            self.register_buffer(
                "idx",
                torch.tensor([1, 0]) if torch.empty(0).device.type != "meta" else torch.empty(2, dtype=torch.long),
            )

    plan, _ = run(M, {"x": (4, 3)})
    assert [f.source for f in plan.fallbacks] == ["x"] and "meta" in plan.fallbacks[0].reason


def test_inplace_ops_on_the_loaded_tensor():
    # GPT-OSS zeroes the down_proj bias on TP ranks != 0; some loaders scale in place before copying
    def fn(m, name, t):
        if name == "bias":
            if m.rank != 0:
                t.zero_()
            m.b.data.copy_(t)
        else:
            t.mul_(0.5)
            t[0].add_(1.0)
            m.w.data.copy_(t)

    for rank in (0, 1):
        plan, _ = run(lambda: Toy({"b": (4,), "w": (3, 4)}, fn, rank=rank), {"bias": (4,), "x": (3, 4)}, rank=rank)
        by_param = {w.param: w.src.leaf for w in plan.writes}
        assert isinstance(by_param["w"], ir.Update) and "Tensor.mul_" in ir.literal_ops(by_param["w"])
        if rank:
            assert "Tensor.zero_" in ir.literal_ops(by_param["b"])
        else:
            assert by_param["b"] == ir.Source("bias")


def test_inplace_op_seen_through_an_earlier_alias():
    # `view` taken before the in-place op must see the new values, as in eager torch
    def fn(m, name, t):
        alias = t[1]
        t.mul_(3.0)
        m.w.data.copy_(alias)

    plan, _ = run(lambda: Toy({"w": (4,)}, fn), {"x": (2, 4)})
    assert "Tensor.mul_" in ops(plan)


def test_setitem_into_param():
    def fn(m, name, t):
        i = int(name[-1])
        m.w.data[i] = t  # int index
        m.v.data[2 * i : 2 * i + 2] = t  # slice, broadcast over 2 rows

    plan, _ = run(lambda: Toy({"w": (2, 4), "v": (4, 4)}, fn), {"e0": (4,), "e1": (4,)}, allow_nan=("v",))
    assert_pure_views(plan, 4)
    assert sorted(w.dst.offset for w in plan.writes if w.param == "w") == [0, 4]


def test_zero_filled_padding_rows_without_reading_the_source():
    # VocabParallelEmbedding: copy the shard, then fill the padding rows with 0
    def fn(m, name, t):
        m.w[: t.shape[0]].data.copy_(t)
        m.w[t.shape[0] :].data.fill_(0)

    plan, _ = run(lambda: Toy({"w": (8, 3)}, fn), {"x": (5, 3)})
    fulls = [w for w in plan.writes if isinstance(w.src.leaf, ir.Full)]
    assert len(fulls) == 1 and fulls[0].src.leaf.value == 0 and fulls[0].dst == ir.Region(15, (3, 3), (3, 1))
    assert not any(isinstance(w.src.leaf, ir.Source) and w.dst.offset == 15 for w in plan.writes)


def test_one_source_copied_to_two_places():
    def fn(m, name, t):
        m.a.data.copy_(t)
        m.b.data[1].copy_(t[0])

    plan, _ = run(lambda: Toy({"a": (2, 3), "b": (2, 3)}, fn), {"x": (2, 3)}, allow_nan=("b",))
    assert_pure_views(plan, 2)
    assert {w.param for w in plan.writes} == {"a", "b"}


@pytest.mark.parametrize("factory", ["zeros", "ones", "full", "new_zeros"])
def test_scratch_tensor_filled_then_copied(factory):
    # a loader that builds a full-size tensor, fills parts of it from the checkpoint, and copies it in: the rows it
    # does not fill keep the factory's value (they used to become NaN in the plan)
    def fn(m, name, t):
        buf = {
            "zeros": lambda: torch.zeros(4, 3, dtype=t.dtype, device=t.device),
            "ones": lambda: torch.ones((4, 3), dtype=t.dtype, device=t.device),
            "full": lambda: torch.full((4, 3), 2.5, dtype=t.dtype, device=t.device),
            "new_zeros": lambda: m.w.data.new_zeros(4, 3),
        }[factory]()
        buf[1:3] = t
        buf[3] = t[0]  # a second write into the (now tracked) scratch tensor
        m.w.data.copy_(buf)

    plan, _ = run(lambda: Toy({"w": (4, 3)}, fn), {"x": (2, 3)})
    assert not plan.fallbacks and plan.sources_read() == {"x"}


def test_setitem_into_the_loaded_tensor():
    def fn(m, name, t):
        t[0] = 0.0
        t[1, 1:] = t[2, :2]
        m.w.data.copy_(t)

    plan, _ = run(lambda: Toy({"w": (3, 3)}, fn), {"x": (3, 3)})
    assert isinstance(plan.writes[0].src.leaf, ir.Update)


# ---- what a plan cannot express: fallbacks ------------------------------------------------------------------------
def load_scale(m, name, t):
    """A loader that looks at values: `.item()` on one tensor, `bool(t.any())` on another."""
    if name == "scale":
        m.s.data.fill_(t.item())
    elif name == "maybe":
        m.w.data[0].copy_(t[0])  # a partial write before the value read: must be dropped
        if bool(t.any()):
            m.w.data[1].copy_(t[1])
    else:
        m.v.data.copy_(t)


def test_value_reads_are_fallbacks_and_the_rest_is_recorded():
    make = lambda: Toy({"s": (1,), "w": (2, 3), "v": (3,)}, load_scale)  # noqa: E731
    plan, rec = run(make, {"a": (3,), "scale": (), "maybe": (2, 3), "b": (3,)})
    fb = {f.source: f for f in plan.fallbacks}
    assert set(fb) == {"scale", "maybe"}
    assert fb["scale"].op == "Tensor.item" and fb["maybe"].op == "Tensor.any"
    assert all("load_scale" in f.loader for f in fb.values())
    assert plan.sources_read() == {"a", "b"}  # recorded before and after the fallbacks
    assert all(w.param == "v" for w in plan.writes)  # the partial write of "maybe" was dropped
    assert not plan.not_needed


def test_strict_raises_naming_tensor_op_and_loader():
    make = lambda: Toy({"s": (1,), "w": (2, 3), "v": (3,)}, load_scale)  # noqa: E731
    with pytest.raises(UnsupportedLoaderOp) as err:
        run(make, {"a": (3,), "scale": (), "b": (3,)}, strict=True)
    msg = str(err.value)
    assert "scale" in msg and "Tensor.item" in msg and "load_scale" in msg


def test_op_outside_the_allowlist_is_a_fallback():
    def load_log(m, name, t):
        m.w.data.copy_(-torch.log(t.float()) if name == "A_log" else t)

    plan, _ = run(lambda: Toy({"w": (4,)}, load_log), {"A_log": (4,)})
    assert [(f.source, f.op) for f in plan.fallbacks] == [("A_log", "torch.log")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_exp_of_the_loaded_tensor_is_recorded(dtype):
    # vLLM's mamba_mixer A_weight_loader: `weight_loader(param, -torch.exp(loaded_weight.float()))`, split per TP rank
    def load_a(m, name, t):
        m.w.data.copy_((-torch.exp(t.float())).split(4, dim=0)[m.tp_rank])

    for rank in (0, 1):
        plan, _ = run(lambda: Toy({"w": (4, 3)}, load_a, tp_rank=rank), {"A_log": ((8, 3), dtype)})
        # (float() of a float32 tensor returns it: a view, no op)
        assert not plan.fallbacks and ops(plan) == ["Tensor.neg", "torch.exp"] + ["Tensor.float"] * (
            dtype != torch.float32
        )


def test_vllm_composed_weight_loader_is_recorded():
    # vLLM's own helper (Mamba2's A: `-torch.exp(x.float())`; Plamo3's norms: `x + offset`): load, then
    # `param.data.copy_(fn(param))`. Recorded as one computed write over the loaded value, which replaces the plain one.
    from vllm.model_executor.model_loader.weight_utils import composed_weight_loader, default_weight_loader

    def make():
        toy = Toy({"A": (6,), "norm": (6,), "w": (6,)}, None)
        toy.A.weight_loader = composed_weight_loader(
            lambda p, t: p.data.copy_(t.narrow(0, 6, 6)), lambda x: -torch.exp(x.float())
        )
        toy.norm.weight_loader = composed_weight_loader(default_weight_loader, lambda x: x + 1.0)
        toy.fn = lambda m, name, t: getattr(getattr(m, name.split("_")[0]), "weight_loader", default_weight_loader)(
            getattr(m, name.split("_")[0]), t
        )
        return toy

    plan, rec = run(make, {"A_log": ((12,), torch.bfloat16), "norm_weight": ((6,), torch.bfloat16), "w_weight": (6,)})
    assert not plan.fallbacks and rec.tier == "full"
    assert sorted(w.param for w in plan.writes) == ["A", "norm", "w"]  # one write each: the plain loads replaced
    assert {"torch.exp", "Tensor.neg", "Tensor.add"} <= set(ops(plan)), ops(plan)


def test_composed_loader_over_a_partly_written_param_is_a_fallback():
    # fn reads the whole parameter; elements no write reached would be whatever torch.empty left: not replayable
    from vllm.model_executor.model_loader.weight_utils import composed_weight_loader

    def make():
        toy = Toy({"A": (6,)}, lambda m, name, t: m.A.weight_loader(m.A, t))
        toy.A.weight_loader = composed_weight_loader(lambda p, t: p.data[:3].copy_(t), lambda x: -torch.exp(x))
        return toy

    with torch.device("meta"):
        meta = make()
    rec = record_loader(meta, [("A_log", (3,), "float32")], rank=0)
    assert [(f.source, f.op) for f in rec.to_plan().fallbacks] == [("A_log", "composed_weight_loader")]
    assert not rec.writes


def test_param_created_while_loading_is_a_destination():
    # vLLM's Transformers backend registers `lm_head.bias` only when the checkpoint has one (CausalMixin.load_weights)
    def load(m, name, t):
        if name == "bias":
            m.register_parameter("bias", torch.nn.Parameter(torch.empty(6), requires_grad=False))
            m.bias.data[:4].copy_(t)
            m.bias.data[4:].fill_(0)
        else:
            m.w.data.copy_(t)

    with torch.device("meta"):
        meta = Toy({"w": (3,)}, load)
    rec = record_loader(meta, [("w", (3,), "float32"), ("bias", (4,), "float32")], rank=0)
    plan = rec.to_plan()
    assert rec.tier == "full" and not plan.fallbacks and [p.name for p in plan.params] == ["bias", "w"]
    ckpt = checkpoint({"w": ((3,), torch.float32), "bias": ((4,), torch.float32)})
    real = Toy({"w": (3,)}, load)
    real.load_weights(ckpt.items())
    replayed = Toy({"w": (3,)}, load)
    replayed.register_parameter("bias", torch.nn.Parameter(torch.full((6,), NAN), requires_grad=False))
    interp.apply_reference(plan, ckpt, dict(replayed.named_parameters()))
    assert torch.equal(bits(real.bias), bits(replayed.bias)) and torch.equal(bits(real.w), bits(replayed.w))


def test_value_computed_from_a_loaded_parameter_is_a_fallback():
    # vLLM's composed_weight_loader (Mamba's A): load, then `param.copy_(fn(param))`. The plan cannot read
    # parameters; replaying the plain load would be wrong, so the tensor falls back instead of being lost.
    def load_composed(m, name, t):
        m.w.data.copy_(t)
        if name == "A_log":
            m.w.data.copy_(-torch.exp(m.w.float()))

    plan, _ = run(lambda: Toy({"w": (4,)}, load_composed), {"A_log": (4,)})
    assert [(f.source, f.op) for f in plan.fallbacks] == [("A_log", "Tensor.copy_")]
    assert not plan.writes


def test_inplace_op_on_a_loaded_parameter_is_a_fallback():
    def load_then_scale(m, name, t):
        m.w.data.copy_(t)
        if name == "x":
            m.w.data.mul_(2.0)

    plan, _ = run(lambda: Toy({"w": (4,)}, load_then_scale), {"x": (4,), "y": (4,)})
    assert [(f.source, f.op) for f in plan.fallbacks] == [("x", "Tensor.mul_")]
    assert plan.sources_read() == {"y"}


def test_loader_exception_is_a_fallback_naming_the_tensor():
    def load_picky(m, name, t):
        if name == "bad":
            raise KeyError("no such parameter")
        m.w.data.copy_(t)

    plan, _ = run(lambda: Toy({"w": (4,)}, load_picky), {"bad": (4,), "good": (4,)})
    assert [(f.source, f.op) for f in plan.fallbacks] == [("bad", "KeyError")]
    assert plan.sources_read() == {"good"}


class _BrokenStr(Exception):
    def __str__(self):
        raise RuntimeError("__str__ fails")


@pytest.mark.parametrize(
    "exc, reason",
    [
        (ValueError(), "(no message)"),
        (RuntimeError("\n\n  \n"), "(no message)"),
        (KeyError(("a", 1)), "('a', 1)"),
        (RuntimeError(b"\xff\x00"), "b'\\xff\\x00'"),
        (TypeError(None, 3), "(None, 3)"),
        (_BrokenStr(7), "(7,)"),
        (RuntimeError("first\nsecond"), "first"),
    ],
)
def test_loader_exception_of_any_message_is_a_fallback_naming_it(exc, reason):
    # an empty message (vLLM's bare asserts), non-str args or a failing __str__ used to end in a recorder traceback
    def load_picky(m, name, t):
        if name == "bad":
            raise exc
        m.w.data.copy_(t)

    plan, _ = run(lambda: Toy({"w": (4,)}, load_picky), {"bad": (4,), "good": (4,)})
    assert [(f.source, f.op, f.reason) for f in plan.fallbacks] == [("bad", type(exc).__name__, reason)]
    assert plan.sources_read() == {"good"}


def test_loader_assert_on_a_tensors_geometry_is_a_named_error():
    # vLLM's default_weight_loader asserts `param.size() == loaded_weight.size()`: its real loader fails the same way,
    # so no fallback (that would fail on the consumer); the error names the tensor and quotes the assert
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    with torch.device("meta"):
        m = Toy({"w": (4,)}, lambda m, name, t: default_weight_loader(m.w, t))
    for tier in ("auto", "full"):
        with pytest.raises(
            LoaderRejectsCheckpoint,
            match=r"tensor padded \[8\] float32 on rank 3: AssertionError: "
            r"Attempted to load .* at `assert param.size\(\) ==",
        ):
            record_loader(m, [("good", (4,), "float32"), ("padded", (8,), "float32")], rank=3, tier=tier)


def test_loader_failing_before_reading_anything_is_an_error():
    class Broken(torch.nn.Module):
        def load_weights(self, weights):
            raise RuntimeError("broken")

    with torch.device("meta"):
        m = Broken()
    with pytest.raises(RecordError):
        record_loader(m, [("x", (2,), "float32")], rank=0)


def test_tensor_held_back_by_the_loader_survives_a_fallback():
    # q is held until k arrives; an unrelated tensor falls back in between, which restarts load_weights:
    # q must be fed again, not reported as not needed
    def load_fused(m, name, t):
        if name == "q":
            m.pending = t
        elif name == "scale":
            m.s.data.fill_(t.item())
        else:
            m.w.data.copy_(torch.cat([m.pending, t]))

    plan, _ = run(lambda: Toy({"w": (4,), "s": (1,)}, load_fused), {"q": (2,), "scale": (), "k": (2,)})
    assert [f.source for f in plan.fallbacks] == ["scale"]
    assert plan.sources_read() == {"q", "k"} and not plan.not_needed


def test_not_needed_names():
    def load_some(m, name, t):
        if name.startswith("skip"):
            return
        m.w.data.copy_(t)

    plan, _ = run(lambda: Toy({"w": (4,)}, load_some), {"skip.a": (4,), "x": (4,), "skip.b": (2,)})
    assert plan.not_needed == ("skip.a", "skip.b")
    assert plan.sources_read() == {"x"} and not plan.fallbacks


# ---- the fake parallel state ----------------------------------------------------------------------------------------
def _ps():
    import vllm.distributed.parallel_state as ps

    return ps


def test_parallel_state_inside_the_block():
    ps = _ps()
    layout = Layout(tp=2, pp=2, dp=2)
    for rank in range(layout.world_size):
        with fake_parallel_state(layout, rank):
            dp_rank, pp_rank, tp_rank = layout.coords(rank)
            assert ps.get_tensor_model_parallel_rank() == tp_rank
            assert ps.get_tensor_model_parallel_world_size() == 2
            assert ps.get_pp_group().rank_in_group == pp_rank and ps.get_pp_group().world_size == 2
            assert ps.get_dp_group().rank_in_group == dp_rank
            assert ps.get_ep_group().ranks == layout.ep_ranks(rank)


def test_parallel_state_restored_after_the_block_and_after_an_exception():
    ps = _ps()
    names = ("_TP", "_PP", "_DP", "_EP", "_WORLD")
    before = {n: getattr(ps, n, None) for n in names}
    with fake_parallel_state(Layout(tp=4), 3):
        assert ps._TP is not before["_TP"]
    assert {n: getattr(ps, n, None) for n in names} == before
    with pytest.raises(ZeroDivisionError):
        with fake_parallel_state(Layout(tp=2), 1):
            1 / 0
    assert {n: getattr(ps, n, None) for n in names} == before
    # nested: the outer state comes back after the inner block
    with fake_parallel_state(Layout(tp=4), 2):
        with fake_parallel_state(Layout(tp=2), 1):
            assert ps.get_tensor_model_parallel_rank() == 1
        assert ps.get_tensor_model_parallel_rank() == 2 and ps.get_tensor_model_parallel_world_size() == 4


def load_tp_shard(m, name, t):
    """Asks for the TP rank while loading, as sharded_weight_loader / DBRX / GPT-OSS do."""
    ps = _ps()
    rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    shard = t.shape[0] // size
    m.w.data.copy_(t.narrow(0, rank * shard, shard))


def _record_tp(rank: int, layout: Layout) -> ir.RankPlan:
    with torch.device("meta"):
        m = Toy({"w": (3, 5)}, load_tp_shard)
    with fake_parallel_state(layout, rank):
        return record_loader(m, [("x", (12, 5), "float32")], rank=rank).to_plan()


def test_ranks_recorded_one_after_another_are_independent():
    layout = Layout(tp=4)
    first = [_record_tp(r, layout) for r in range(4)]
    again = [_record_tp(r, layout) for r in (3, 1, 0, 2)]
    assert [p.writes for p in first] == [again[(3, 1, 0, 2).index(r)].writes for r in range(4)]
    assert [p.writes[0].src.region.offset for p in first] == [0, 15, 30, 45]
    # and each replays to what the real loader does on that rank
    x = torch.randn(12, 5)
    for rank, plan in enumerate(first):
        real, replayed = Toy({"w": (3, 5)}, load_tp_shard), Toy({"w": (3, 5)}, load_tp_shard)
        with fake_parallel_state(layout, rank), torch.no_grad():
            real.load_weights([("x", x)])
        interp.apply_reference(plan, {"x": x}, dict(replayed.named_parameters()))
        assert torch.equal(real.w, replayed.w)


def test_loader_asking_for_the_rank_outside_a_parallel_state_falls_back():
    # what recording used to do with loaders that read the TP rank while loading (RecordSession now records inside
    # the rank's parallel state): without one, vLLM's accessor raises and the tensor becomes a fallback
    ps = _ps()
    if ps._TP is not None:
        pytest.skip("a real vLLM parallel state is initialised in this process")
    with torch.device("meta"):
        m = Toy({"w": (3, 5)}, load_tp_shard)
    plan = record_loader(m, [("x", (12, 5), "float32")], rank=0).to_plan()
    assert [f.source for f in plan.fallbacks] == ["x"]


def test_record_is_deterministic():
    def fn(m, name, t):
        m.w.data.copy_(torch.cat([t.t()[1:], t.t()[:1]]).mul(2.0))

    plans = []
    for _ in range(2):
        with torch.device("meta"):
            m = Toy({"w": (4, 3)}, fn)
        plans.append(record_loader(m, [("x", (3, 4), "float32")], rank=0).to_plan())
    assert plans[0] == plans[1]
    assert ops(plans[0]) == ["Tensor.mul", "torch.cat"]
    assert math.isclose(plans[0].writes[0].src.leaf.args[1], 2.0)


def test_padded_lm_head_checkpoint_is_a_named_error_not_a_traceback(tmp_path, capsys):
    """A local checkpoint whose lm_head has 256 rows for a vocab of 128: vLLM's VocabParallelEmbedding.weight_loader
    asserts (with no message), so vLLM cannot load it; `shardplan record` names the tensor and exits 2."""
    import engine_support as es

    from shardplan import cli

    cfg = dict(es.config(False), vocab_size=128)
    tensors = es.random_tensors(False, 1)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:128]
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:256]
    model = es.write_checkpoint(tmp_path / "padded", cfg, tensors)
    code = cli.main(["record", "--model", str(model), "--tp", "2", "--out", str(tmp_path / "plans")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "rejects checkpoint tensor lm_head.weight [256, 256] bfloat16" in err
    assert "AssertionError (no message)" in err
    assert "at `assert loaded_weight.shape[output_dim] == self.org_vocab_size`" in err
    assert "vocab_parallel_embedding.py" in err and "Traceback" not in err


def test_loader_mutating_its_loaded_weight_replays_without_touching_the_trainers_tensors(tmp_path):
    """A loader that scales its loaded_weight in place (and bumps a row of it) before copying: recorded, written to a
    plan file, packed through the sync's ReplayPacker and a TrainerRank's packer three times (every sync): the
    trainer's tensors stay bitwise as they were (no compounding edit), and each consumer's params equal the real
    loader's."""
    from shardplan.engine.trainer import ModuleSource, TrainerRank
    from shardplan.plan.compile.compiler import compile_plans
    from shardplan.plan.file import format as planfile
    from shardplan.sync.adapters import ApplyUnpacker, ReplayPacker
    from shardplan.transport.base import Control

    def load_scaled(m, name, t):
        shard = t.narrow(0, 4 * m.rank, 4)
        shard.mul_(0.5)
        shard[1].add_(1.0)
        m.w.data.copy_(shard)

    make = lambda rank: Toy({"w": (4, 6)}, load_scaled, dtype=torch.bfloat16, rank=rank)  # noqa: E731
    name, sources = "model.layers.0.mlp.w.weight", [ir.TensorMeta("model.layers.0.mlp.w.weight", (8, 6), "bfloat16")]
    plans = []
    for rank in (0, 1):
        with torch.device("meta"):
            meta = make(rank)
        plan = record_loader(meta, [(name, (8, 6), "bfloat16")], rank=rank).to_plan()
        assert "Tensor.mul_" in ops(plan) and not plan.fallbacks
        plans.append(plan)
    path = tmp_path / "toy.plan"
    data = planfile.encode(
        compile_plans(plans, sources),
        model="t/toy",
        architecture="ToyForCausalLM",
        config_sha256="0" * 64,
        layout=Layout(tp=2),
        dtype="bfloat16",
        vllm_version="0.32.0",
    )
    planfile.write_plan(path, data)
    plan_file = planfile.PlanFile.read(path)
    trainer = {name: torch.randn(8, 6).to(torch.bfloat16)}
    pristine = bits(trainer[name]).clone()
    control = Control.serve("127.0.0.1")
    rank = TrainerRank(str(path), ModuleSource(trainer, plan_file), control)
    packers = {
        "ReplayPacker": ReplayPacker([plan_file.rank(r) for r in (0, 1)], plan_file.sources),
        "TrainerRank": rank.packer,
    }
    try:
        for how, packer in packers.items():
            for consumer in (0, 1):
                real = make(consumer)
                with torch.no_grad():
                    real.load_weights([(name, trainer[name].clone())])
                for _ in range(3):
                    replayed = {"w": torch.full((4, 6), NAN, dtype=torch.bfloat16)}
                    unpacker = ApplyUnpacker(plan_file.rank(consumer), replayed)
                    for group in packer.groups():
                        spans = packer.spans(consumer, group)
                        out = torch.zeros(unpacker.sizes()[group], dtype=torch.uint8)
                        packer.pack(consumer, group, {name: trainer[name]}, out, range(len(spans)))
                        unpacker.apply(group, out)
                    assert torch.equal(bits(trainer[name]), pristine), f"{how} modified the trainer's tensor"
                    assert torch.equal(bits(replayed["w"]), bits(real.w)), f"{how}, consumer {consumer}"
    finally:
        rank.close()
