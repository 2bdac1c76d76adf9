"""A small EPLB plan without vLLM: two MoE layers (1 and 2, layer 0 dense), E logical experts in E + R physical slots
over EP ranks, each slot's w2 written from `experts.slot.<p>.down_proj.weight`, as `record --eplb-redundant` makes
them (tests/integration/test_eplb.py proves those against vLLM's loader)."""

from __future__ import annotations

import random

import torch

from shardplan.plan import ir
from shardplan.plan.compile.compiler import compile_plans
from shardplan.plan.file.format import PlanFile, decode, encode, write_plan
from shardplan.plan.layout import Layout
from shardplan.plan.placement import EplbSlots, make_placement, slot_sources

HIDDEN, INTER = 8, 4
MOE_LAYERS = (1, 2)


def eplb_plans(num_experts: int = 4, num_redundant: int = 2, num_ep: int = 2):
    slots = EplbSlots(num_experts, num_redundant, num_ep, MOE_LAYERS)
    real = [ir.TensorMeta("model.layers.0.mlp.down_proj.weight", (HIDDEN, INTER), "bfloat16")]
    real += [
        ir.TensorMeta(f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight", (HIDDEN, INTER), "bfloat16")
        for layer in MOE_LAYERS
        for e in range(num_experts)
    ]
    real += [ir.TensorMeta(f"model.layers.{layer}.input_layernorm.weight", (HIDDEN,), "bfloat16") for layer in range(3)]
    sources = real + slot_sources(real, slots)
    plans = []
    per_rank = slots.slots_per_rank
    for rank in range(num_ep):
        params = [ir.TensorMeta("model.layers.0.mlp.down_proj.weight", (HIDDEN, INTER), "bfloat16")]
        params += [
            ir.TensorMeta(f"model.layers.{layer}.input_layernorm.weight", (HIDDEN,), "bfloat16") for layer in range(3)
        ]
        params += [
            ir.TensorMeta(f"model.layers.{layer}.mlp.experts.w2_weight", (per_rank, HIDDEN, INTER), "bfloat16")
            for layer in MOE_LAYERS
        ]
        writes = [
            ir.Write(p.name, ir.full_region(p.shape), ir.View(ir.Source(p.name), ir.full_region(p.shape)))
            for p in params[:4]
        ]
        for layer in MOE_LAYERS:
            for local in range(per_rank):
                slot = rank * per_rank + local
                writes.append(
                    ir.Write(
                        f"model.layers.{layer}.mlp.experts.w2_weight",
                        ir.Region(local * HIDDEN * INTER, (HIDDEN, INTER), (INTER, 1)),
                        ir.View(
                            ir.Source(f"model.layers.{layer}.mlp.experts.slot.{slot}.down_proj.weight"),
                            ir.full_region((HIDDEN, INTER)),
                        ),
                    )
                )
        plans.append(ir.RankPlan(rank, tuple(params), tuple(writes)))
    return plans, sources, real, slots


def eplb_plan_file(path=None, **kwargs) -> tuple[PlanFile, list[ir.TensorMeta]]:
    """The plan file (written to `path` and read back, when given: what a driver and its engines open)."""
    plans, sources, real, slots = eplb_plans(**kwargs)
    data = encode(
        compile_plans(plans, sources),
        model="toy-moe",
        architecture="ToyMoe",
        config_sha256="0" * 64,
        layout=Layout(tp=slots.num_ep_ranks, ep=True),
        dtype="bfloat16",
        vllm_version="0.32.0",
        eplb=slots,
    )
    if path is not None:
        write_plan(path, data)
        return PlanFile.read(path), real
    return PlanFile(*decode(data)), real


def random_placement(slots: EplbSlots, seed: int):
    rng = random.Random(seed)
    rows = []
    for _ in slots.moe_layers:
        row = list(range(slots.num_logical_experts)) + [
            rng.randrange(slots.num_logical_experts) for _ in range(slots.num_redundant_experts)
        ]
        rng.shuffle(row)
        rows.append(row)
    return make_placement(rows, slots)


def expected_slots(params: dict, placement, slots: EplbSlots, rank: int, tensors: dict) -> None:
    """Assert every slot of `rank` holds, bitwise, the down projection of the expert `placement` puts there."""
    for layer in slots.moe_layers:
        w2 = params[f"model.layers.{layer}.mlp.experts.w2_weight"]
        for local in range(slots.slots_per_rank):
            slot = rank * slots.slots_per_rank + local
            expert = placement.rows[layer][slot]
            want = tensors[f"model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"]
            assert torch.equal(w2[local].view(torch.int16), want.view(torch.int16)), (layer, slot, expert)
