"""Sharded trainers on the GPU: two TP trainer ranks hold halves of every tensor (boxes); each packs its pieces of a
decoder layer for both consumer ranks with the sync engine's ShardedPacker, each consumer applies both parts with
ShardedUnpacker: bit for bit the reference interpreter on the full tensors. Block-FP8 plans from sharded BF16
trainers (boxes of whole 128-blocks, two DP replicas): each trainer quantizes its own boxes (the fused kernel over its
local shards), bitwise the reference quantizer's checkpoint of the full tensors; and from three trainers whose even
row splits cut 128-blocks (the holders exchange block amaxes, then quantize staged boxes on the GPU)."""

from __future__ import annotations

import pytest
import torch
from gpu_cases import DEVICE, LAYER, NAN, PLANS, Layer, assert_bits_equal, gpu_tier, reference, trainer_tensors

from shardplan.plan.file.format import PlanFile
from shardplan.runtime.apply import params_from_plan
from shardplan.runtime.shards import (
    local_tensors,
    plan_shards,
    replicate,
    tp_shards,
)
from shardplan.sync import ShardedPacker, ShardedUnpacker

pytestmark = gpu_tier


@pytest.mark.parametrize("name", ["llama-3.1-8b--tp2--bfloat16.plan", "qwen3-30b-a3b--tp4--bfloat16.plan"])
def test_sharded_packer_over_boxes(name):
    plan_file = PlanFile.read(PLANS / name)
    layers = [Layer(plan_file, r, LAYER) for r in (0, 1)]
    sources = {n: m for layer in layers for n, m in layer.sources.items()}
    full = trainer_tensors(sources, None, DEVICE)
    shards = tp_shards(sources, 2, lambda n: 0 if len(sources[n].shape) == 2 else None)
    _sync_and_check(name, [layer.plan for layer in layers], sources, shards, full, None)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-fp8--tp4--bfloat16.plan", "qwen3-30b-a3b-fp8--tp4-ep--bfloat16.plan"])
def test_sharded_fp8_trainers_quantize_their_own_boxes(name):
    quantizer, layers, sources, full, held = _fp8_layers(name, (1, 2))
    shards = replicate(tp_shards(held, 2, lambda n: 0 if len(held[n].shape) == 2 else None, block=lambda n: 128), 2, 2)
    _sync_and_check(name, [layer.plan for layer in layers], sources, shards, full, quantizer)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b-fp8--tp4--bfloat16.plan", "qwen3-30b-a3b-fp8--tp4-ep--bfloat16.plan"])
def test_fp8_trainers_whose_boxes_cut_blocks(name):
    quantizer, layers, sources, full, held = _fp8_layers(name, (0, 1))
    shards = tp_shards(held, 5, lambda n: 0 if len(held[n].shape) == 2 else None)  # 768 expert rows -> 154: cut
    assert any(
        c.held != c.padded
        for boxes in plan_shards([], sources, shards, quantizer=quantizer).cut.values()
        for c in boxes.values()
    )
    _sync_and_check(name, [layer.plan for layer in layers], sources, shards, full, quantizer)


def _fp8_layers(name, ranks):
    """A block-FP8 plan's decoder layer for `ranks`: its quantizer, layers, sources, the full trainer tensors (bf16
    weights, no scales) and the sources a trainer holds."""
    plan_file = PlanFile.read(PLANS / name)
    quantizer = plan_file.header.quantizer
    layers = [Layer(plan_file, r, LAYER) for r in ranks]
    sources = {n: m for layer in layers for n, m in layer.sources.items()}
    full = trainer_tensors(sources, quantizer, DEVICE)
    return quantizer, layers, sources, full, {n: m for n, m in sources.items() if n in full}


def _sync_and_check(name, plans, sources, shards, full, quantizer):
    sharded = plan_shards(plans, sources, shards, quantizer=quantizer or "")
    packers = {t: ShardedPacker(sharded, t, device=DEVICE) for t in sorted({s.rank for s in shards})}
    partials = {}  # blocks cut between trainers: what the sync exchanges on the control channel
    for t, packer in packers.items():
        for group in packer.amax_groups():
            partials.setdefault(group, {})[t] = packer.partial_amaxes(group, local_tensors(shards, t, full))
    for t, packer in packers.items():
        for group in packer.amax_groups():
            packer.set_amaxes(group, partials[group])
    for plan in plans:
        c = plan.rank
        params = params_from_plan(plan, DEVICE, fill=NAN)
        unpacker = ShardedUnpacker(sharded, c, params)
        for group, size in unpacker.sizes().items():
            buffer = torch.zeros(size, dtype=torch.uint8, device=DEVICE)
            for t, packer in packers.items():
                spans = packer.spans(c, group)
                mine = [i for i, s in enumerate(spans) if t in s.only]
                if mine:
                    packer.pack(c, group, local_tensors(shards, t, full), buffer, mine)
            unpacker.apply(group, buffer)
        assert_bits_equal(params, reference(plan, sources, full, quantizer), f"{name} consumer {c}")
