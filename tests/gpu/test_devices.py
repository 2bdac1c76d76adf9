"""The device as users give it: "cuda", "cuda:0", torch.device("cuda") and None all mean the tensors' device when it is
the current CUDA device (Replayer, Applier, QuantizingReplayer); tensors on another device are named."""

from __future__ import annotations

import pytest
import torch
from gpu_cases import DEVICE, LAYER, NAN, ON_GPU, PLANS, Layer, assert_bits_equal, gpu_tier, reference, trainer_tensors

from shardplan.plan.file.format import PlanFile
from shardplan.runtime.apply import Applier, params_from_plan
from shardplan.runtime.quantize import QuantizingReplayer
from shardplan.runtime.replay import Replayer
from shardplan.runtime.tensors import PackBufferError, StaleBindingError, TensorLayoutError

pytestmark = gpu_tier
SPELLINGS = ["cuda", "cuda:0", torch.device("cuda"), None] if ON_GPU else ["cpu", torch.device("cpu"), None]
OTHER = "cpu" if ON_GPU else "meta"


@pytest.fixture(scope="module")
def llama():
    """llama-3.1-8b TP2 rank 1, layer 3 and lm_head (the issue's reproduction failed on lm_head.weight)."""
    plan_file = PlanFile.read(PLANS / "llama-3.1-8b--tp2--bfloat16.plan")
    layer = Layer(plan_file, 1, LAYER)
    full = plan_file.rank(1)
    extra = tuple(w for w in full.writes if w.param == "lm_head.weight")
    plan = type(layer.plan)(
        1, layer.plan.params + tuple(p for p in full.params if p.name == "lm_head.weight"), layer.plan.writes + extra
    )
    sources = {**layer.sources, "lm_head.weight": plan_file.sources["lm_head.weight"]}
    return plan, sources


@pytest.fixture(scope="module")
def qwen_fp8():
    plan_file = PlanFile.read(PLANS / "qwen3-30b-a3b-fp8--tp4-ep--bfloat16.plan")
    return Layer(plan_file, 2, LAYER)


@pytest.mark.parametrize("device", SPELLINGS, ids=str)
def test_replayer_and_applier_take_every_spelling(llama, device):
    plan, sources = llama
    tensors = trainer_tensors(sources, None, DEVICE)
    want = reference(plan, sources, tensors, None)
    replayer = Replayer(plan, sources, device=device)
    buffer = replayer.pack(tensors)
    assert buffer.device == tensors["lm_head.weight"].device
    params = params_from_plan(plan, DEVICE, fill=NAN)
    Applier(plan, replayer.layout, params).apply(buffer)
    assert_bits_equal(params, want, f"device={device!r}")


@pytest.mark.parametrize("device", SPELLINGS, ids=str)
def test_quantizing_replayer_takes_every_spelling(qwen_fp8, device):
    layer = qwen_fp8
    tensors = trainer_tensors(layer.sources, layer.quantizer, DEVICE)
    want = reference(layer.plan, layer.sources, tensors, layer.quantizer)
    replayer = QuantizingReplayer(layer.plan, layer.sources, quantizer=layer.quantizer, device=device)
    params = params_from_plan(layer.plan, DEVICE, fill=NAN)
    Applier(layer.plan, replayer.layout, params).apply(replayer.pack(tensors))
    assert_bits_equal(params, want, f"device={device!r}")


def test_tensors_on_the_wrong_device_are_named(llama, qwen_fp8):
    plan, sources = llama
    tensors = trainer_tensors(sources, None, DEVICE)
    moved = {**tensors, "lm_head.weight": tensors["lm_head.weight"].to(OTHER)}
    want = "expected cuda:0 (the current device, given as 'cuda')" if ON_GPU else "expected cpu"
    with pytest.raises(
        TensorLayoutError, match=r"'lm_head.weight' is on (cpu|meta), " + want.replace("(", r"\(").replace(")", r"\)")
    ):
        Replayer(plan, sources, device=DEVICE).pack(moved)
    last = max(tensors)  # None: the first tensor's device (in name order), so the last one is named
    with pytest.raises(TensorLayoutError, match=f"'{last}' is on (cpu|meta), expected"):
        Replayer(plan, sources).pack({**tensors, last: tensors[last].to(OTHER)})
    replayer = Replayer(plan, sources, device=DEVICE)
    with pytest.raises(PackBufferError, match="out is on"):
        replayer.pack(tensors, out=torch.zeros(replayer.layout.nbytes, dtype=torch.uint8, device=OTHER))
    params = params_from_plan(plan, DEVICE)
    name = sorted(params)[0]
    params[name] = params[name].to(OTHER)
    with pytest.raises(PackBufferError, match=f"param '{name}' is on"):
        Applier(plan, replayer.layout, params).apply(replayer.pack(tensors))
    layer = qwen_fp8
    tensors = trainer_tensors(layer.sources, layer.quantizer, DEVICE)
    weight = next(n for n in sorted(tensors) if "experts" in n)
    tensors[weight] = tensors[weight].to(OTHER)
    with pytest.raises(TensorLayoutError, match=f"'{weight}' is on (cpu|meta), expected"):
        QuantizingReplayer(layer.plan, layer.sources, quantizer=layer.quantizer, device=DEVICE).pack(tensors)


def test_a_rebound_tensor_is_never_packed_stale(llama, qwen_fp8):
    """The bind-time data pointers are compared at every pack (one C++ pass on CUDA builds of torch): a tensor given
    new storage after bind() is named, by the plain and the quantizing replay (its fused kernel's sources too)."""
    plan, sources = llama
    tensors = trainer_tensors(sources, None, DEVICE)
    bound = Replayer(plan, sources, device=DEVICE).bind(tensors)
    bound.pack()
    tensors["lm_head.weight"].data = tensors["lm_head.weight"].clone()
    with pytest.raises(StaleBindingError, match="'lm_head.weight' no longer has the storage"):
        bound.pack()
    layer = qwen_fp8
    tensors = trainer_tensors(layer.sources, layer.quantizer, DEVICE)
    bound = QuantizingReplayer(layer.plan, layer.sources, quantizer=layer.quantizer, device=DEVICE).bind(tensors)
    bound.pack()
    weight = next(n for n in sorted(tensors) if "experts" in n)
    tensors[weight].data = tensors[weight].clone()
    with pytest.raises(StaleBindingError, match=f"'{weight}' no longer has the storage"):
        bound.pack()
