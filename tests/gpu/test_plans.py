"""One decoder layer of every shipped plan, on a sampled consumer rank, replayed on the GPU as a trainer does: pack
(Replayer, or QuantizingReplayer for block-FP8 plans: the fused kernel and the eager quantizer), with and without the
CUDA graph, applied with and without it, bit for bit the reference interpreter's result on CPU copies."""

from __future__ import annotations

import pytest
import torch
from gpu_cases import (
    DEVICE,
    LAYER,
    NAN,
    ON_GPU,
    PLANS,
    Layer,
    assert_bits_equal,
    gpu_tier,
    reference,
    shipped_plans,
    trainer_tensors,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from shardplan.plan.file.format import PlanFile
from shardplan.runtime.apply import Applier, params_from_plan
from shardplan.runtime.quantize import QuantizingReplayer
from shardplan.runtime.replay import Replayer

pytestmark = gpu_tier
GRAPHS = (True, False) if ON_GPU else (False,)


@pytest.mark.parametrize("name", shipped_plans())
@settings(max_examples=1, deadline=None)
@given(data=st.data())
def test_layer_replays_bitwise(name, data):
    plan_file = PlanFile.read(PLANS / name)
    rank = data.draw(st.sampled_from(plan_file.ranks), label="rank")
    layer = Layer(plan_file, rank, LAYER)
    assert layer.plan.writes, f"{name}: rank {rank} writes nothing in layer {LAYER}"
    tensors = trainer_tensors(layer.sources, layer.quantizer, DEVICE, seed=rank)
    want = reference(layer.plan, layer.sources, tensors, layer.quantizer)
    if layer.quantizer:
        replayer = QuantizingReplayer(layer.plan, layer.sources, quantizer=layer.quantizer, device=DEVICE)
        binds = [dict(cuda_graph=g) for g in GRAPHS] + [dict(fused=False)]
    else:
        replayer = Replayer(layer.plan, layer.sources, device=DEVICE)
        binds = [dict(cuda_graph=g) for g in GRAPHS]
    for options in binds:
        bound = replayer.bind(tensors, **options)
        if layer.quantizer and ON_GPU and options.get("fused") is not False:
            assert bound.kernel is not None, bound.fused_error  # the fused kernel packed it
        buffer = bound.pack()
        for apply_graph in GRAPHS:
            params = params_from_plan(layer.plan, DEVICE, fill=NAN)
            applier = Applier(layer.plan, replayer.layout, params, cuda_graph=apply_graph)
            applier.apply(buffer)
            assert_bits_equal(
                params, want, f"{name} rank {rank} layer {LAYER} pack {options} apply cuda_graph={apply_graph}"
            )
        if ON_GPU and options.get("cuda_graph"):
            assert (bound._graph if layer.quantizer else bound._graph) is not None, "no CUDA graph was captured"
        del bound, buffer
    del tensors
    if ON_GPU:
        torch.cuda.empty_cache()
