"""The fused FP8 pack on CUDA as a trainer runs it, past the bitwise layer checks (test_plans.py): a block holding inf
or NaN is named on the graph path (the flag read from pinned memory the graph wrote) and without the graph, and the
next pack is clean; the scale segments are stored by the kernel itself; graph stages run in order while the ops of a
stage overlap."""

from __future__ import annotations

import pytest
import torch
from gpu_cases import DEVICE, LAYER, NAN, ON_GPU, PLANS, Layer, assert_bits_equal, gpu_tier, reference, trainer_tensors

from shardplan.plan.file.format import PlanFile
from shardplan.runtime.apply import Applier, params_from_plan
from shardplan.runtime.quantize import NonFiniteBlockError, QuantizingReplayer
from shardplan.runtime.tensors import capture_graph

pytestmark = [*gpu_tier, pytest.mark.skipif(not ON_GPU, reason="the fused kernel and CUDA graphs need CUDA")]


@pytest.fixture(scope="module")
def qwen_tp4():
    """Qwen3-30B-A3B FP8 TP4 rank 1: 192-row shards of 128-row blocks, scales upsampled by the loader."""
    return Layer(PlanFile.read(PLANS / "qwen3-30b-a3b-fp8--tp4--bfloat16.plan"), 1, LAYER)


def _applied(layer, layout, buffer):
    params = params_from_plan(layer.plan, DEVICE, fill=NAN)
    Applier(layer.plan, layout, params).apply(buffer)
    return params


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graph", "no-graph"])
def test_a_nonfinite_block_is_named_and_the_next_pack_is_clean(qwen_tp4, cuda_graph):
    layer = qwen_tp4
    tensors = trainer_tensors(layer.sources, layer.quantizer, DEVICE)
    want = reference(layer.plan, layer.sources, tensors, layer.quantizer)
    replayer = QuantizingReplayer(layer.plan, layer.sources, quantizer=layer.quantizer, device=DEVICE)
    bound = replayer.bind(tensors, cuda_graph=cuda_graph)
    assert bound.kernel is not None, bound.fused_error
    assert (bound._graph is not None) == cuda_graph
    weight = next(w for w in bound.kernel.plan.weights if "experts" in w)
    (r0, _), (c0, _) = replayer.boxes[weight]
    for bad in (float("inf"), float("nan")):
        tensors[weight][r0 + 5, c0 + 7] = bad
        with pytest.raises(NonFiniteBlockError, match=f"'{weight}' holds {bad} at \\[{r0 + 5}, {c0 + 7}\\]"):
            bound.pack()
        tensors[weight][r0 + 5, c0 + 7] = 1.0
        want_now = reference(layer.plan, layer.sources, tensors, layer.quantizer)
        assert_bits_equal(_applied(layer, replayer.layout, bound.pack()), want_now, f"the pack after a {bad} block")
    del want


def test_scale_segments_are_stored_by_the_kernel(qwen_tp4):
    """No gather launches: each block's scale goes from its program straight to the places the scale segments read
    (up to fp8kernel.MAX_SCALE_OUTS of them: the loader upsamples this plan's scales)."""
    layer = qwen_tp4
    tensors = trainer_tensors(layer.sources, layer.quantizer, DEVICE, seed=3)
    replayer = QuantizingReplayer(layer.plan, layer.sources, quantizer=layer.quantizer, device=DEVICE)
    bound = replayer.bind(tensors, cuda_graph=False)
    assert bound.kernel.scale_outs > 1 and len(bound.kernel._gathered) == 0
    assert_bits_equal(
        _applied(layer, replayer.layout, bound.pack()),
        reference(layer.plan, layer.sources, tensors, layer.quantizer),
        "direct scales",
    )


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graph", "no-graph"])
def test_tensors_bound_again_at_new_addresses_pack_from_the_cached_tables(qwen_tp4, cuda_graph):
    """A source handing new tensors every sync: each bind takes the launch tables built once for the geometry and
    adds the new addresses; three rounds of fresh tensors (other allocations, other values), each bitwise the CPU
    reference, the tables built once."""
    layer = qwen_tp4
    replayer = QuantizingReplayer(layer.plan, layer.sources, quantizer=layer.quantizer, device=DEVICE)
    keep = []  # the earlier rounds' tensors stay allocated: each round's land elsewhere
    for seed in (5, 6, 7):
        tensors = trainer_tensors(layer.sources, layer.quantizer, DEVICE, seed=seed)
        keep.append(tensors)
        bound = replayer.bind(tensors, cuda_graph=cuda_graph)
        assert bound.kernel is not None, bound.fused_error
        assert_bits_equal(
            _applied(layer, replayer.layout, bound.pack()),
            reference(layer.plan, layer.sources, tensors, layer.quantizer),
            f"round {seed}",
        )
    assert len(replayer.fused_plan()._tables) == 1


def test_graph_stages_run_in_order_and_a_stage_overlaps():
    n = 1 << 22
    a, b = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    x, y, z = torch.empty_like(a), torch.empty_like(a), torch.empty_like(a)
    graph = capture_graph(
        [[lambda: x.copy_(a), lambda: y.copy_(b)], [lambda: torch.add(x, y, out=z)]], torch.device(DEVICE), branches=2
    )
    for _ in range(3):
        a.normal_()
        b.normal_()
        z.fill_(NAN)
        graph.replay()
        assert torch.equal(z, a + b)
