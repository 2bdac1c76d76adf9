"""Golden printouts: a plan prints like code and its pack layout like a table; both are what users read
(`shardplan inspect`, docs), so a change to either is a visible change, made on purpose (re-generate with
SHARDPLAN_REGOLD=1)."""

from __future__ import annotations

import os
import pathlib

from shardplan.plan import ir
from shardplan.runtime.pack import PackLayout

GOLDEN = pathlib.Path(__file__).with_name("golden")


def _plan() -> tuple[ir.RankPlan, dict[str, ir.TensorMeta]]:
    """Rank 1 of a TP2 layer shaped like vLLM's Llama loader: fused qkv rows, o_proj columns, a norm, a padded
    vocab row filled without a source, a dtype conversion, and one fallback."""
    h, shard = 8, 4
    sources = {
        n: ir.TensorMeta(n, s, d)
        for n, s, d in [
            ("model.layers.0.self_attn.q_proj.weight", (h, h), "bfloat16"),
            ("model.layers.0.self_attn.k_proj.weight", (h, h), "bfloat16"),
            ("model.layers.0.self_attn.v_proj.weight", (h, h), "bfloat16"),
            ("model.layers.0.self_attn.o_proj.weight", (h, h), "bfloat16"),
            ("model.layers.0.input_layernorm.weight", (h,), "float32"),
            ("model.embed_tokens.weight", (6, h), "bfloat16"),
            ("model.layers.0.mlp.experts.e_score_correction_bias", (4,), "float32"),
        ]
    }
    qkv, o = "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    norm, embed = "model.layers.0.input_layernorm.weight", "model.embed_tokens.weight"
    writes = [
        ir.Write(
            qkv,
            ir.Region(j * shard * h, (shard, h), (h, 1)),
            ir.View(ir.Source(f"model.layers.0.self_attn.{p}_proj.weight"), ir.Region(shard * h, (shard, h), (h, 1))),
        )
        for j, p in enumerate("qkv")
    ]
    writes.append(ir.Write(o, ir.full_region((h, shard)), ir.View(ir.Source(o), ir.Region(shard, (h, shard), (h, 1)))))
    writes.append(ir.Write(norm, ir.full_region((h,)), ir.View(ir.Source(norm), ir.full_region((h,)))))
    writes.append(ir.Write(embed, ir.full_region((3, h)), ir.View(ir.Source(embed), ir.Region(3 * h, (3, h), (h, 1)))))
    writes.append(
        ir.Write(
            embed, ir.Region(3 * h, (1, h), (h, 1)), ir.View(ir.Full(0.0, (1, h), "bfloat16"), ir.full_region((1, h)))
        )
    )
    params = (
        ir.TensorMeta(embed, (4, h), "bfloat16"),
        ir.TensorMeta(norm, (h,), "bfloat16"),
        ir.TensorMeta(o, (h, shard), "bfloat16"),
        ir.TensorMeta(qkv, (3 * shard, h), "bfloat16"),
    )
    fallback = ir.Fallback(
        "model.layers.0.mlp.experts.e_score_correction_bias",
        "Tensor.item",
        "reads values",
        "vllm.model_executor.models.deepseek_v2.load_weights",
    )
    return ir.RankPlan(1, params, tuple(writes), (fallback,)), sources


def _check(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("SHARDPLAN_REGOLD"):
        path.write_text(text + "\n")
    assert text + "\n" == path.read_text(), f"{name} changed:\n{text}"


def test_rank_plan_prints_like_code():
    plan, sources = _plan()
    _check("rank_plan.txt", plan.format(sources))


def test_pack_layout_prints_as_a_table():
    plan, _ = _plan()
    _check("pack_layout.txt", PackLayout.from_plans(plan, alignment=64).format())
    _check("pack_layout_parts.txt", PackLayout.from_plans(plan, alignment=64, max_group_bytes=96).format())


def test_pack_layout_digest_covers_destinations():
    plan, _ = _plan()
    moved = list(plan.writes)
    moved[0], moved[1] = (
        ir.Write(moved[0].param, moved[1].dst, moved[0].src),
        ir.Write(moved[1].param, moved[0].dst, moved[1].src),
    )
    other = ir.RankPlan(plan.rank, plan.params, tuple(moved), plan.fallbacks)
    assert PackLayout.from_plans(plan).nbytes == PackLayout.from_plans(other).nbytes
    assert PackLayout.from_plans(plan).digest != PackLayout.from_plans(other).digest
    assert PackLayout.from_plans(plan).digest == PackLayout.from_plans(_plan()[0]).digest
