"""The engine backend's unpacker (engine/reload.py) on models vLLM builds on CPU, without an engine process: a plan
that leaves a module of the live model unwritten is refused at init, by name, instead of the update reporting a
complete version while that module keeps its old weights (finalize_layerwise_reload restores unwritten layers); the
elements no checkpoint tensor defines (Kimi-Linear's expert padding at TP 2) are zeroed once their module is
materialized, whatever storage it got."""

from __future__ import annotations

import functools

import pytest
import torch
from arch_sessions import shrink_overrides
from tiny_models import TINY, tiny

from shardplan.engine.errors import EnginePlanMismatch
from shardplan.engine.reload import ReloadUnpacker
from shardplan.plan import ir
from shardplan.plan.layout import Layout
from shardplan.plan.names import group_order
from shardplan.record.build import build_model
from shardplan.record.session import RecordSession

SHRUNK = {
    "llama-3.1-8b": tiny("llama-3.1-8b", tie_word_embeddings="true"),
    "qwen3-30b-a3b": TINY["qwen3-30b-a3b"],
    "kimi-linear-48b-a3b": shrink_overrides("kimi-linear-48b-a3b"),
}


@functools.cache
def _live(model: str, ep: bool, rank: int):
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    session = RecordSession(model, Layout(tp=2, ep=ep), overrides=SHRUNK[model])
    plan, _ = session.record_rank(rank)
    live = build_model(session.vllm_config, session.layout, rank, "cpu")
    record_metadata_for_reloading(live)  # what vLLM does once a model is loaded
    return live, plan, {m.name: m for m in session.sources}, session


@pytest.mark.parametrize("model, ep, rank", [("llama-3.1-8b", False, 1), ("qwen3-30b-a3b", True, 0)])
def test_a_whole_plan_is_taken(model, ep, rank):
    live, plan, sources, _ = _live(model, ep, rank)
    ReloadUnpacker(live, plan, sources)  # tied lm_head (llama) is written through embed_tokens


@pytest.mark.parametrize(
    "model, ep, rank, dropped",
    [
        ("llama-3.1-8b", False, 1, "model.layers.1.mlp.down_proj.weight"),
        ("qwen3-30b-a3b", True, 0, "model.layers.0.mlp.experts.routed_experts.w2_weight"),  # its module stays written
    ],
)
def test_a_plan_missing_a_module_is_refused(model, ep, rank, dropped):
    live, plan, sources, _ = _live(model, ep, rank)
    assert dropped in {p.name for p in plan.params}
    cut = ir.RankPlan(
        rank, tuple(p for p in plan.params if p.name != dropped), tuple(w for w in plan.writes if w.param != dropped)
    )
    with pytest.raises(EnginePlanMismatch, match="never writes 1 param.*" + dropped.replace(".", r"\.")):
        ReloadUnpacker(live, cut, sources)


def test_elements_no_checkpoint_defines_are_zeroed_in_every_update():
    live, plan, sources, session = _live("kimi-linear-48b-a3b", False, 1)
    unpacker = ReloadUnpacker(live, plan, sources)
    assert unpacker.zero_filled > 0 and unpacker.undefined
    module, [(attr, spans), *_] = next(iter(unpacker.undefined.items()))
    group = next(g for g, modules in unpacker.group_modules.items() if any(m is module for m in modules))
    unpacker.begin()
    try:
        # the sync's pool holds the bytes of earlier modules (here: all-ones bytes, NaN as bfloat16); they must not
        # show through the padding
        unpacker._pool_size = sum(p.nbytes + 4096 for p in plan.params)
        unpacker._pool = torch.full((unpacker._pool_size,), 255, dtype=torch.uint8)
        unpacker._pool_uses = torch._C._storage_Use_Count(unpacker._pool.untyped_storage()._cdata)
        unpacker._materialize(group)
        flat = getattr(module, attr).detach().view(-1)
        assert all(bool((flat[lo:hi] == 0).all()) for lo, hi in spans)
    finally:
        unpacker.end(session.vllm_config.model_config)


def _update(unpacker, model_config, buffers, snapshots):
    """One update as shardplan.sync's ConsumerSync drives it (each segment a message of its own; receives of two groups
    posted ahead, the next posted once a group is applied): each message's bytes land where receive_targets says,
    and the receive buffer holds poison (0xFF) where they went elsewhere, so apply reading them would show."""
    groups = sorted(buffers, key=group_order)
    posted = {}

    def post(group):
        spans = [(s.offset, s.offset + s.nbytes) for s in unpacker.layout.group(group).segments if s.nbytes]
        landing = buffers[group].clone()
        for (lo, hi), target in zip(spans, unpacker.receive_targets(group, spans)):
            if target is not None:
                target.copy_(buffers[group][lo:hi])
                landing[lo:hi] = 255
        posted[group] = landing

    unpacker.begin()
    try:
        for group in groups[:2]:
            post(group)
        for i, group in enumerate(groups):
            unpacker.apply(group, posted.pop(group))
            if i + 2 < len(groups):
                post(groups[i + 2])
    finally:
        unpacker.end(model_config)
    return snapshots


@pytest.mark.parametrize("model, ep, rank", [("llama-3.1-8b", False, 1), ("qwen3-30b-a3b", True, 0)])
def test_bytes_received_into_the_params_are_what_processing_sees(model, ep, rank, monkeypatch):
    """receive_in_place: segments that are one contiguous range of one param land in the materialized param itself
    (modules materialized ahead, in group order, within the room the last sync's pool leaves) and apply skips them.
    What every module holds in its written params when it is processed equals, bitwise, an update with every byte
    through the buffer."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    _, plan, sources, session = _live(model, ep, rank)
    live = build_model(session.vllm_config, session.layout, rank, "cpu")  # as an engine serves it: processed
    record_metadata_for_reloading(live)
    with set_current_vllm_config(session.vllm_config):
        process_weights_after_loading(live, session.vllm_config.model_config, torch.device("cpu"))
    unpacker = ReloadUnpacker(live, plan, sources)
    g = torch.Generator().manual_seed(rank)
    buffers = {
        name: torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for name, n in unpacker.sizes().items()
    }
    snapshots: dict[str, dict[str, torch.Tensor]] = {}
    names = {id(m): n for n, m in live.named_modules()}
    process = unpacker._process

    written = {(id(m), a) for m, a in unpacker.targets.values()}  # (others, e.g. _expert_map: vLLM's to restore)

    def snapshot_then_process(module):
        tensors = get_layer_tensors(module).items()
        snapshots[names[id(module)]] = {k: t.detach().clone() for k, t in tensors if (id(module), k) in written}
        process(module)

    monkeypatch.setattr(unpacker, "_process", snapshot_then_process)
    config = session.vllm_config.model_config
    runs = []
    for in_place in (False, True, False):  # the first sizes the pool: nothing is received in place in it
        unpacker.receive_in_place, snapshots = in_place, {}
        runs.append((_update(unpacker, config, buffers, snapshots), unpacker.in_place_bytes))
    assert [b for _, b in runs][::2] == [0, 0] and runs[1][1] > 0, [b for _, b in runs]
    (through_buffer, _), (received, _) = runs[2], runs[1]
    assert through_buffer.keys() == received.keys() and through_buffer
    for module, tensors in through_buffer.items():
        for k, t in tensors.items():
            assert torch.equal(t.reshape(-1).view(torch.uint8), received[module][k].reshape(-1).view(torch.uint8)), (
                module,
                k,
            )
