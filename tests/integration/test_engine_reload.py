"""The engine backend's unpacker (engine/reload.py) on models vLLM builds on CPU, without an engine process: a plan
that leaves a module of the live model unwritten is refused at init, by name, instead of the update reporting a
complete version while that module keeps its old weights (finalize_layerwise_reload restores unwritten layers)."""

from __future__ import annotations

import functools

import pytest
from tiny_models import TINY, tiny

from shardplan.engine.errors import EnginePlanMismatch
from shardplan.engine.reload import ReloadUnpacker
from shardplan.plan import ir
from shardplan.plan.layout import Layout
from shardplan.record.build import build_model
from shardplan.record.session import RecordSession

SHRUNK = {"llama-3.1-8b": tiny("llama-3.1-8b", tie_word_embeddings="true"), "qwen3-30b-a3b": TINY["qwen3-30b-a3b"]}


@functools.cache
def _live(model: str, ep: bool, rank: int):
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    session = RecordSession(model, Layout(tp=2, ep=ep), overrides=SHRUNK[model])
    plan, _ = session.record_rank(rank)
    live = build_model(session.vllm_config, session.layout, rank, "cpu")
    record_metadata_for_reloading(live)  # what vLLM does once a model is loaded
    return live, plan, {m.name: m for m in session.sources}


@pytest.mark.parametrize("model, ep, rank", [("llama-3.1-8b", False, 1), ("qwen3-30b-a3b", True, 0)])
def test_a_whole_plan_is_taken(model, ep, rank):
    live, plan, sources = _live(model, ep, rank)
    ReloadUnpacker(live, plan, sources)  # tied lm_head (llama) is written through embed_tokens


@pytest.mark.parametrize(
    "model, ep, rank, dropped",
    [
        ("llama-3.1-8b", False, 1, "model.layers.1.mlp.down_proj.weight"),
        ("qwen3-30b-a3b", True, 0, "model.layers.0.mlp.experts.routed_experts.w2_weight"),  # its module stays written
    ],
)
def test_a_plan_missing_a_module_is_refused(model, ep, rank, dropped):
    live, plan, sources = _live(model, ep, rank)
    assert dropped in {p.name for p in plan.params}
    cut = ir.RankPlan(
        rank, tuple(p for p in plan.params if p.name != dropped), tuple(w for w in plan.writes if w.param != dropped)
    )
    with pytest.raises(EnginePlanMismatch, match="never writes 1 param.*" + dropped.replace(".", r"\.")):
        ReloadUnpacker(live, cut, sources)
