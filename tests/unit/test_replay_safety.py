"""Replay never writes into the trainer's tensors, and never allocates more than the plan declares room for.

Hostile plans (built with the project's own writer, as an attacker would) are refused by name at load: by the plan
file reader (PlanOpNotAllowed) and by Replayer for plans built in code (ForeignWriteError, PlanTooLarge), before any
byte is packed or allocated; the interpreter itself never runs an in-place op on a tensor the plan did not make. The
recorder's own form (a clone of the loaded view, then the in-place op) packs, leaving the trainer's tensors bitwise
as they were.
"""

from __future__ import annotations

import resource

import pytest
import torch
from planfile_helpers import encode_plans

from shardplan.errors import ForeignWriteError, PlanTooLarge
from shardplan.plan import interp, ir
from shardplan.plan.file import format as planfile
from shardplan.plan.file import skeletons as planskeleton
from shardplan.runtime.apply import Applier, params_from_plan
from shardplan.runtime.replay import Replayer
from shardplan.runtime.tensors import PackBufferError

SRC = ir.TensorMeta("model.layers.0.w.weight", (4, 4), "float32")
SOURCES = {SRC.name: SRC}
PARAM = ir.TensorMeta("model.layers.0.w.weight", (4, 4), "float32")


def _whole(name=SRC.name, shape=(4, 4)) -> ir.View:
    return ir.View(ir.Source(name), ir.full_region(shape))


def _call(op, *args, inputs, kwargs=(), shape=(4, 4)) -> ir.View:
    return ir.View(ir.Call(op, args, kwargs, inputs), ir.full_region(shape))


def _plan(src: ir.View, dst_shape=(4, 4), param=PARAM) -> ir.RankPlan:
    return ir.RankPlan(0, (param,), (ir.Write(param.name, ir.full_region(dst_shape), src),))


def _file_bytes(plan: ir.RankPlan, sources=SOURCES) -> bytes:
    return encode_plans([plan], list(sources.values()), tp=1, model="t/m", architecture="TForCausalLM")


def _trainer():
    t = torch.arange(16, dtype=torch.float32).reshape(4, 4) + 1
    return {SRC.name: t}, t.clone()


A0 = ir.Arg(0)
FOREIGN = {  # each writes into the trainer's tensor (or a view of it) when run naively
    "zero_ on the source": _call("Tensor.zero_", A0, inputs=(_whole(),)),
    "fill_(nan) on the source": _call("Tensor.fill_", A0, float("nan"), inputs=(_whole(),)),
    "mul_ on a view op of the source": _call(
        "Tensor.mul_", A0, 0.0, inputs=(_call("Tensor.view", A0, (16,), inputs=(_whole(),), shape=(16,)),), shape=(16,)
    ),
    "copy_ into a narrowed source": _call(
        "Tensor.copy_",
        A0,
        ir.Arg(1),
        inputs=(
            ir.View(ir.Source(SRC.name), ir.Region(4, (4,), (1,))),
            ir.View(ir.Full(0.0, (4,), "float32"), ir.full_region((4,))),
        ),
        shape=(4,),
    ),
    "add_ after a mul_ on the source": _call(
        "Tensor.add_", A0, 1.0, inputs=(_call("Tensor.mul_", A0, 2.0, inputs=(_whole(),)),)
    ),
    "contiguous (may be the source itself), then sub_": _call(
        "Tensor.sub_", A0, 1.0, inputs=(_call("Tensor.contiguous", A0, inputs=(_whole(),)),)
    ),
    "torch.cat with out= the source": _call(
        "torch.cat",
        (A0,),
        inputs=(ir.View(ir.Full(0.0, (4, 4), "float32"), ir.full_region((4, 4))), _whole()),
        kwargs=(("out", ir.Arg(1)),),
    ),
}


def _hostile_bytes(plan: ir.RankPlan, monkeypatch) -> bytes:
    """What a writer without the check makes (the project's own writer refuses to write it)."""
    with pytest.raises(planfile.PlanOpNotAllowed, match="<plan being written>"):
        _file_bytes(plan)
    with monkeypatch.context() as m:
        m.setattr(planskeleton.SkeletonRules, "foreign_write", lambda *a: None)
        return _file_bytes(plan)


@pytest.mark.parametrize("what", sorted(FOREIGN))
def test_writes_into_a_trainer_tensor_are_refused_by_name_at_load(what, monkeypatch):
    src = FOREIGN[what]
    plan = _plan(src, tuple(src.region.sizes), ir.TensorMeta(PARAM.name, tuple(src.region.sizes), "float32"))
    assert ir.foreign_write(src.leaf) is not None
    data = _hostile_bytes(plan, monkeypatch)
    with pytest.raises(
        planfile.PlanOpNotAllowed,
        match=r"x\.plan: body.groups\[0\].skeleton.src.leaf.*"
        r"(in-place|out=).*never writes into the trainer's tensors",
    ):
        planfile.decode(data, "x.plan")
    tensors, before = _trainer()
    with pytest.raises(ForeignWriteError, match=r"rank 0: write 0 \(model.layers.0.w.weight\): .*(in-place|out=)"):
        Replayer(plan, SOURCES)
    params = params_from_plan(plan)
    with pytest.raises(ForeignWriteError, match="refusing to replay"):  # the interpreter never runs it either
        interp.apply_reference(plan, tensors, params)
    assert torch.equal(tensors[SRC.name], before)


def test_the_recorders_form_packs_and_leaves_the_trainer_tensor_untouched():
    # what the recorder writes for `t.mul_(0.5); t[1].add_(1.0); param.copy_(t)`: each in-place op on a clone
    clone = ir.Call("Tensor.clone", (A0,), (), (_whole(),))
    scaled = ir.Update(
        ir.Source(SRC.name),
        ir.full_region((4, 4)),
        _call("Tensor.mul_", A0, 0.5, inputs=(ir.View(clone, ir.full_region((4, 4))),)),
    )
    row = ir.Call("Tensor.clone", (A0,), (), (ir.View(scaled, ir.Region(4, (4,), (1,))),))
    bumped = ir.Update(
        scaled,
        ir.Region(4, (4,), (1,)),
        _call("Tensor.add_", A0, 1.0, inputs=(ir.View(row, ir.full_region((4,))),), shape=(4,)),
    )
    plan = _plan(ir.View(bumped, ir.full_region((4, 4))))
    assert ir.foreign_write(plan.writes[0].src.leaf) is None
    header, body = planfile.decode(_file_bytes(plan), "x.plan")
    loaded = planfile.PlanFile(header, body, "x.plan").rank(0)
    tensors, before = _trainer()
    replayer = Replayer(loaded, SOURCES)
    bound = replayer.bind(tensors)
    for _ in range(3):  # every sync: no compounding
        buffer = bound.pack()
        assert torch.equal(tensors[SRC.name], before)
    params = params_from_plan(loaded, fill=float("nan"))
    Applier(loaded, replayer.layout, params).apply(buffer)
    want = before * 0.5
    want[1] += 1.0
    assert torch.equal(params[PARAM.name], want)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


BIG = ir.TensorMeta("model.layers.0.b.weight", (4,), "float32")
OVERSIZED = {  # name -> (value view, the op the error names); each would allocate >= 16 GB if replayed
    "repeat(1e5, 1e5)": (
        _call("Tensor.repeat", A0, 10**5, 10**5, inputs=(_whole(BIG.name, (4,)),), shape=(4,)),
        "Tensor.repeat",
    ),
    "repeat_interleave(1e12)": (
        _call("Tensor.repeat_interleave", A0, 10**12, inputs=(_whole(BIG.name, (4,)),), shape=(4,)),
        "Tensor.repeat_interleave",
    ),
    "expand(1e9, 4).contiguous()": (
        _call(
            "Tensor.contiguous",
            A0,
            inputs=(_call("Tensor.expand", A0, (10**9, 4), inputs=(_whole(BIG.name, (4,)),), shape=(4,)),),
            shape=(4,),
        ),
        "Tensor.expand",
    ),  # counted already as a view: a legit expand never exceeds its destination
    "stride-0 source view, contiguous": (
        _call(
            "Tensor.contiguous",
            A0,
            inputs=(ir.View(ir.Source(BIG.name), ir.Region(0, (10**6, 10**6), (0, 0))),),
            shape=(4,),
        ),
        "Tensor.contiguous",
    ),
    "full(2^40)": (ir.View(ir.Full(0.0, (1 << 40,), "float32"), ir.Region(0, (4,), (1,))), "full"),
    "clone of a view past its value": (
        ir.View(ir.Call("Tensor.clone", (A0,), (), (_whole(BIG.name, (4,)),)), ir.Region(2, (4,), (1,))),
        r"reads elements \[2, 6\) of a value",
    ),
}


@pytest.mark.parametrize("what", sorted(OVERSIZED))
def test_oversized_op_outputs_are_refused_before_any_allocation(what):
    src, named = OVERSIZED[what]
    param = ir.TensorMeta("model.layers.0.p.weight", (4,), "float32")
    plan = ir.RankPlan(0, (param,), (ir.Write(param.name, ir.full_region((4,)), src),))
    before = _rss_mb()
    with pytest.raises(interp.PlanError, match=rf"rank 0: write 0 \(model.layers.0.p.weight\): .*{named}") as info:
        Replayer(plan, {BIG.name: BIG})
    if "full" in what or "repeat" in what or "contiguous" in what:
        assert isinstance(info.value, PlanTooLarge) and "more than the 1048576 this write may" in str(info.value)
    assert _rss_mb() - before < 100  # sized on meta: nothing was allocated


def test_a_param_larger_than_the_device_is_refused_before_allocating():
    # a 2^48-element param filled by broadcasting one source element: every size is as declared, but no device
    # holds it; bind and params_from_plan refuse it by name instead of a bare "can't allocate"
    huge = ir.TensorMeta("model.layers.0.p.weight", (1 << 24, 1 << 24), "float32")
    src = ir.View(ir.Source(BIG.name), ir.Region(0, (1 << 24, 1 << 24), (0, 0)))
    plan = ir.RankPlan(0, (huge,), (ir.Write(huge.name, ir.full_region(huge.shape), src),))
    replayer = Replayer(plan, {BIG.name: BIG})
    before = _rss_mb()
    with pytest.raises(PackBufferError, match=r"packing this layout needs 1125899906842624 bytes on cpu"):
        replayer.bind({BIG.name: torch.ones(4)})
    with pytest.raises(PackBufferError, match=r"rank 0's params needs 1125899906842624 bytes"):
        params_from_plan(plan)
    assert _rss_mb() - before < 100


def test_sizes_are_checked_at_load_not_per_pack(monkeypatch):
    # the runtime hot path: pack runs the prepared ops only
    clone = ir.Call("Tensor.clone", (A0,), (), (_whole(),))
    plan = _plan(ir.View(clone, ir.full_region((4, 4))))
    tensors, _ = _trainer()
    bound = Replayer(plan, SOURCES).bind(tensors)
    monkeypatch.setattr(interp, "check_write_sizes", lambda *a, **k: pytest.fail("sized per pack"))
    monkeypatch.setattr(ir, "foreign_write", lambda *a, **k: pytest.fail("checked per pack"))
    assert torch.equal(bound.pack().view(torch.float32)[:16].view(4, 4), tensors[SRC.name])
