"""The frontier built-ins (docs/configs.md): DeepSeek-V4-Flash lists its reference tensor names (no model. prefix,
F32 mixers); Kimi-Linear's interleaved layer classes (KDA, KDA, KDA, MLA) sample to the same plan as recording every
layer, byte for byte (members of a class between the sampled layers used to be written twice); the shrunk built-ins
verify bitwise against vLLM's loader at their published layouts."""

from __future__ import annotations

import re

import pytest

from shardplan.plan.layout import Layout
from shardplan.record.session import RecordSession
from shardplan.record.verify import random_checkpoint, verify_rank

KIMI_LINEAR_12 = [
    "num_hidden_layers=12",
    "linear_attn_config.kda_layers=[1,2,3,5,6,7,9,10,11]",
    "linear_attn_config.full_attn_layers=[4,8,12]",
    "num_experts=8",
]


def test_kimi_linear_sampled_equals_exhaustive_byte_for_byte():
    session = RecordSession("kimi-linear-48b-a3b", Layout(tp=2), overrides=KIMI_LINEAR_12)
    sampled = session.record_plans([0, 1])
    assert sampled.how.startswith("sampled"), sampled.how
    exhaustive = session.record_plans([0, 1], exhaustive=True)
    assert session.encode(sampled.body) == session.encode(exhaustive.body)
    assert all(s.num_not_needed >= 0 for s in sampled.stats)


SHRUNK = {
    "kimi-linear-48b-a3b": [
        "num_hidden_layers=4",
        "linear_attn_config.kda_layers=[1,2,3]",
        "linear_attn_config.full_attn_layers=[4]",
        "num_experts=8",
    ],
    "minimax-m2": ["num_hidden_layers=2", "attn_type_list=[1,1]", "num_local_experts=8"],
    # one layer of each kind: hash-routed sliding window, compressed with indexer (ratio 4), compressed (128)
    "deepseek-v4-flash": [
        "num_hidden_layers=3",
        "num_hash_layers=1",
        "compress_ratios=[0,4,128,0]",
        "n_routed_experts=8",
        "vocab_size=1000",
    ],
    # three dense layers, then one MoE layer; every layer MLA with the DSA indexer
    "deepseek-v3.2": ["num_hidden_layers=4", "n_routed_experts=8", "vocab_size=1000"],
    # DeepSeek-V4-Pro's own head layout (128 heads in 16 output groups, q rank 1536, indexer top-k 1024) on a narrower
    # residual stream (hidden 7168 at 8 ranks outgrows a shared test box), layers cut as for Flash
    "deepseek-v4-pro": [
        "num_hidden_layers=3",
        "num_hash_layers=1",
        "compress_ratios=[0,4,128,0]",
        "hidden_size=1024",
        "moe_intermediate_size=256",
        "n_routed_experts=8",
        "vocab_size=1000",
    ],
    # three Gated DeltaNet layers, then one full-attention layer; every layer MoE with a gated shared expert
    "qwen3.5-397b-a17b": [
        "text_config.num_hidden_layers=4",
        'text_config.layer_types=["linear_attention","linear_attention","linear_attention","full_attention"]',
        "text_config.num_experts=8",
        "text_config.vocab_size=1000",
    ],
}


@pytest.mark.budget(150, reason="records and verifies every rank of a shrunk frontier model against vLLM's loader")
@pytest.mark.parametrize(
    "model, tp, ep",
    [
        ("kimi-linear-48b-a3b", 4, False),
        ("minimax-m2", 2, True),
        ("deepseek-v4-flash", 4, True),
        ("deepseek-v3.2", 4, True),
        ("deepseek-v4-pro", 8, True),
        ("qwen3.5-397b-a17b", 8, False),
        ("qwen3.5-397b-a17b", 8, True),
    ],
)
def test_shrunk_frontier_builtins_verify_bitwise(model, tp, ep):
    layout = Layout(tp=tp, ep=ep)
    session = RecordSession(model, layout, overrides=SHRUNK[model])
    checkpoint = random_checkpoint(session.tensors, 0)
    for rank in range(tp):
        plan, _ = session.record_rank(rank)
        assert verify_rank(session.vllm_config, layout, rank, plan, checkpoint).ok


def test_deepseek_v4_lists_its_reference_names():
    # the released headers keep DeepSeek's own names and F32 mixers (public inventories of DeepSeek-V4-Flash); vLLM's
    # deepseek_v4 weight mapper reads exactly these
    from shardplan.models import resolve_model
    from shardplan.record.checkpoint import checkpoint_tensors

    tensors = {name: (shape, dtype) for name, shape, dtype in checkpoint_tensors(resolve_model("deepseek-v4-flash"))}
    assert tensors["embed.weight"] == ((129280, 4096), "bfloat16") and "head.weight" in tensors
    assert tensors["hc_head_fn"][1] == tensors["layers.0.hc_attn_fn"][1] == "float32"
    assert tensors["layers.0.attn.attn_sink"] == ((64,), "float32")
    assert tensors["layers.3.ffn.gate.bias"] == ((256,), "float32")
    assert "layers.2.attn.kv_norm.weight" in tensors and "layers.2.attn.indexer.wq_b.weight" in tensors
    assert tensors["layers.0.ffn.gate.tid2eid"][0] == (129280, 6)
    assert not any(name.startswith("model.") for name in tensors)


def test_qwen3_5_lists_the_released_names():
    # the released Qwen/Qwen3.5-397B-A17B files: model.language_model.* with the routed experts fused, lm_head
    # (NVIDIA Megatron-Bridge's Qwen35VLMoEBridge maps these names); not transformers' text-class names
    # (model.layers.*, one tensor per expert), and neither the vision tower nor the MTP layer
    from shardplan.models import resolve_model
    from shardplan.record.checkpoint import checkpoint_tensors

    tensors = {name: (shape, dtype) for name, shape, dtype in checkpoint_tensors(resolve_model("qwen3.5-397b-a17b"))}
    layer = "model.language_model.layers.59."
    assert tensors[layer + "mlp.experts.gate_up_proj"] == ((512, 2048, 4096), "bfloat16")
    assert tensors[layer + "mlp.experts.down_proj"] == ((512, 4096, 1024), "bfloat16")
    assert tensors["lm_head.weight"][0] == tensors["model.language_model.embed_tokens.weight"][0] == (248320, 4096)
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in tensors
    assert "model.language_model.layers.3.self_attn.q_proj.weight" in tensors
    assert all(name == "lm_head.weight" or name.startswith("model.language_model.") for name in tensors)
    assert not any(re.search(r"experts\.\d+\.", name) for name in tensors)


def test_qwen3_5_vision_and_mtp_tensors_are_dropped_by_vllms_loader():
    # served --language-model-only (as the plan is recorded), vLLM's own loader takes the released vision tower and
    # MTP tensors and writes nothing from them: a trainer holding them has nothing to send for them
    import torch

    from shardplan.record.build import build_model, loading_context
    from shardplan.record.verify import poison

    layout = Layout(tp=2)
    session = RecordSession("qwen3.5-397b-a17b", layout, overrides=SHRUNK["qwen3.5-397b-a17b"])
    real = build_model(session.vllm_config, layout, 0, "cpu")
    poison(real)
    extra = {
        "model.visual.patch_embed.proj.weight": torch.ones(1152, 3, 2, 16, 16),
        "model.visual.blocks.0.attn.qkv.weight": torch.ones(3456, 1152),
        "mtp.fc.weight": torch.ones(4096, 8192),
        "mtp.layers.0.mlp.experts.0.gate_proj.weight": torch.ones(1024, 4096),
    }
    with torch.no_grad(), loading_context(session.vllm_config, layout, 0):
        real.load_weights(iter(extra.items()))
    assert all(torch.isnan(p).all() for _, p in real.named_parameters())
    assert not any("visual" in name or "mtp" in name for name, _ in real.named_parameters())


def test_verify_words_construction_buffers_apart_from_undefined_bytes(capsys):
    # attention scale buffers (_k_scale, ...) are set when vLLM builds the model, not left uninitialised: verify says
    # so, and keeps "no checkpoint tensor defines them" for parameter bytes only (Kimi-Linear's padding)
    from shardplan import cli

    overrides = [arg for o in SHRUNK["minimax-m2"] for arg in ("--override", o)]
    assert cli.main(["verify", "--model", "minimax-m2", "--tp", "1", *overrides]) == 0
    out = capsys.readouterr().out
    assert "initialised at construction, not by the loader" in out and "_k_scale" in out
    undefined = [line for line in out.splitlines() if "not written by the real loader either" in line]
    assert not any("_scale" in line or "cos_sin_cache" in line for line in undefined), undefined


def test_unwritten_ranges_are_exactly_the_bytes_vllms_loader_leaves_undefined():
    # Kimi-Linear shrunk at TP 2 without EP: vLLM pads each rank's expert intermediate (32 -> its kernel width) and its
    # own load_weights never writes the padding; the plan's unwritten ranges (derived from writes and shapes alone,
    # what the engine zero-fills) must be those elements, no more and no fewer
    import torch
    from arch_sessions import shrink_overrides

    from shardplan.plan.unwritten import unwritten_ranges
    from shardplan.record.build import build_model, loading_context
    from shardplan.record.verify import RankVerdict, compare_models, poison

    layout = Layout(tp=2)
    session = RecordSession("kimi-linear-48b-a3b", layout, overrides=shrink_overrides("kimi-linear-48b-a3b"))
    checkpoint = random_checkpoint(session.tensors, 0)
    plan, _ = session.record_rank(1)
    ranges = unwritten_ranges(plan)
    assert ranges and all(".experts." in name for name in ranges), sorted(ranges)
    real = build_model(session.vllm_config, layout, 1, "cpu")
    poison(real)
    with torch.no_grad(), loading_context(session.vllm_config, layout, 1):
        real.load_weights(iter(list(checkpoint.items())))
    params = dict(real.named_parameters())
    for meta in plan.params:
        nan = torch.isnan(params[meta.name].detach().reshape(-1)).numpy()
        expected = torch.zeros(nan.size, dtype=torch.bool).numpy()
        for lo, hi in ranges.get(meta.name, []):
            expected[lo:hi] = True
        assert (nan == expected).all(), meta.name
    # the coverage sweep's view of the same elements (from the loader's NaNs, not the plan) is the same ranges
    verdict = RankVerdict(1)
    compare_models(real, real, verdict)
    assert verdict.undefined_ranges == ranges
