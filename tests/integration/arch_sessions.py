"""The architectures the recorder's tests draw from, shrunk, and their recording sessions cached for the process.

    ALL_ARCHS = BUILTINS (the catalog's, shrunk by `shrink_overrides`) + EXTRAS (tests/integration/archs/)
    arch_spec(arch, dtype, root) -> (model, overrides)        # what a RecordSession is built from
    get_session(model, overrides, layout, dtype) -> RecordSession | None (vLLM rejects the layout)
    get_plan(session, key, rank) -> (plan, stats) | None (vLLM refuses to build that rank)

RecordSessions (VllmConfig creation costs seconds) and recorded plans are cached per (model, overrides, layout,
dtype) here, so test_record_archs.py and test_planfile_archs.py share them when both run in one process.
`fp8_overrides` shrinks the block-FP8 built-ins (their quantization_config kept).
"""

from __future__ import annotations

import archs

from shardplan import models
from shardplan.plan import ir
from shardplan.plan.layout import Layout
from shardplan.record.build import LayoutRejected
from shardplan.record.session import RecordSession

BUILTINS = [short for short, _, _ in models.list_models() if not short.endswith("-fp8")]
EXTRAS = archs.extra_names()
ALL_ARCHS = BUILTINS + EXTRAS

# the shrunk Gated DeltaNet (linear attention) of Qwen3-Next and Qwen3.5
_GATED_DELTANET = [
    "linear_num_key_heads=4",
    "linear_num_value_heads=8",
    "linear_key_head_dim=32",
    "linear_value_head_dim=32",
]
_GQA = ["hidden_size=128", "num_attention_heads=4", "num_key_value_heads=2"]


def shrink_overrides(name: str) -> list[str]:
    """Overrides that make a built-in tiny but keep its structure: 2 layers (DeepSeek/Kimi: one dense, one MoE;
    Qwen3-235B: one MoE, one dense via mlp_only_layers), 4 heads over 2 kv heads (so TP 4 replicates kv heads), 4-8
    experts, small MLA ranks, and a vocabulary that is not a multiple of 64 (so vLLM pads it and the last TP rank
    gets zero-filled padding rows)."""
    if name in ("llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b"):
        return ["num_hidden_layers=2", *_GQA, "intermediate_size=256", "vocab_size=300"]
    if name == "mixtral-8x7b":
        return [
            "num_hidden_layers=2",
            *_GQA,
            "intermediate_size=96",
            "num_local_experts=4",
            "num_experts_per_tok=2",
            "vocab_size=300",
        ]
    if name in ("qwen3-30b-a3b", "qwen3-235b-a22b"):
        mixed = ["mlp_only_layers=[1]"] if name == "qwen3-235b-a22b" else []
        return [
            "num_hidden_layers=2",
            *_GQA,
            "head_dim=32",
            "intermediate_size=256",
            "moe_intermediate_size=64",
            "num_experts=4",
            "num_experts_per_tok=2",
            "vocab_size=300",
            *mixed,
        ]
    if name in ("deepseek-v3", "kimi-k2", "deepseek-v3.2"):
        indexer = ["index_n_heads=4", "index_head_dim=32", "index_topk=16"] if name == "deepseek-v3.2" else []
        return [
            *indexer,
            "num_hidden_layers=2",
            "first_k_dense_replace=1",
            "hidden_size=128",
            "num_attention_heads=4",
            "num_key_value_heads=4",
            "intermediate_size=256",
            "moe_intermediate_size=64",
            "n_routed_experts=8",
            "num_experts_per_tok=2",
            "n_group=1",
            "topk_group=1",
            "n_shared_experts=1",
            "q_lora_rank=64",
            "kv_lora_rank=32",
            "qk_nope_head_dim=16",
            "qk_rope_head_dim=16",
            "v_head_dim=16",
            "vocab_size=300",
        ]
    if name == "gpt-oss-120b":
        return [
            "num_hidden_layers=2",
            *_GQA,
            "head_dim=32",
            "intermediate_size=128",
            "num_local_experts=4",
            "num_experts_per_tok=2",
            "vocab_size=300",
            "pad_token_id=0",
            'layer_types=["sliding_attention", "full_attention"]',
        ]
    if name == "qwen3-next-80b-a3b":  # one linear-attention (Gated DeltaNet) layer, one full-attention layer
        return [
            "num_hidden_layers=2",
            "full_attention_interval=2",
            *_GQA,
            "head_dim=32",
            "intermediate_size=256",
            "moe_intermediate_size=64",
            "shared_expert_intermediate_size=64",
            "num_experts=4",
            "num_experts_per_tok=2",
            *_GATED_DELTANET,
            "vocab_size=300",
        ]
    if name in ("glm-4.5", "glm-4.6"):
        return [
            "num_hidden_layers=2",
            "first_k_dense_replace=1",
            *_GQA,
            "head_dim=32",
            "intermediate_size=256",
            "moe_intermediate_size=64",
            "n_routed_experts=8",
            "num_experts_per_tok=2",
            "vocab_size=300",
            "pad_token_id=0",
        ]
    if name == "kimi-linear-48b-a3b":  # three KDA (linear attention) layers, then one MLA layer
        return [
            "num_hidden_layers=4",
            "linear_attn_config.kda_layers=[1,2,3]",
            "linear_attn_config.full_attn_layers=[4]",
            "hidden_size=128",
            "num_attention_heads=4",
            "num_key_value_heads=4",
            "intermediate_size=256",
            "moe_intermediate_size=64",
            "num_experts=8",
            "num_experts_per_token=2",
            "kv_lora_rank=32",
            "qk_nope_head_dim=16",
            "qk_rope_head_dim=16",
            "v_head_dim=16",
            "linear_attn_config.head_dim=32",
            "linear_attn_config.num_heads=4",
            "vocab_size=300",
        ]
    if name == "minimax-m2":
        return [
            "num_hidden_layers=2",
            "attn_type_list=[1,1]",
            *_GQA,
            "head_dim=32",
            "rotary_dim=16",
            "intermediate_size=64",
            "num_local_experts=8",
            "num_experts_per_tok=2",
            "vocab_size=300",
        ]
    if name in (
        "deepseek-v4-flash",
        "deepseek-v4-pro",
    ):  # one layer of each attention kind: hash-routed window, ratio 4 (indexer), 128
        return [
            "num_hidden_layers=3",
            "num_hash_layers=1",
            "compress_ratios=[0,4,128,0]",
            "hidden_size=128",
            "num_attention_heads=4",
            "o_groups=4",  # split over TP ranks: TP 4 needs at least 4
            "o_lora_rank=32",
            "q_lora_rank=64",
            "index_n_heads=4",  # head_dim 512, index_head_dim 128, qk_rope_head_dim 64 kept: vLLM kernels need them
            "moe_intermediate_size=64",
            "n_routed_experts=8",
            "num_experts_per_tok=2",
            "vocab_size=300",
        ]
    if name == "qwen3.5-397b-a17b":  # three linear-attention (Gated DeltaNet) layers, then one full-attention layer
        # the hub config nests the language model's fields under text_config (the multimodal class vLLM serves)
        return [
            f"text_config.{o}"
            for o in (
                "num_hidden_layers=4",
                'layer_types=["linear_attention","linear_attention","linear_attention","full_attention"]',
                *_GQA,
                "head_dim=32",
                "rope_parameters.mrope_section=[2,1,1]",  # mRoPE sections sum to half the rotary dim (32 * 0.25)
                "moe_intermediate_size=64",
                "shared_expert_intermediate_size=64",
                "num_experts=8",
                "num_experts_per_tok=2",
                *_GATED_DELTANET,
                "vocab_size=300",
            )
        ]
    raise KeyError(f"no shrink overrides for built-in {name!r}: add them here")


def fp8_overrides(model: str, tp_max: int = 4) -> list[str]:
    """The FP8 built-ins shrunk (their quantization_config kept). DeepSeek-V3 / Kimi-K2: 2 layers (one dense, one
    MoE), sized so that every TP partition up to `tp_max` is whole 128-blocks: 8 heads with 128-wide q/k heads and v
    heads, dense and expert MLPs of 128 * tp_max, 4 routed + 1 shared expert; the replicated fused q_a/kv_a projection
    (128 + 64 + 128 rows) keeps a partial block, as the real models do. Qwen3-30B-A3B-FP8: 2 MoE layers, 4 experts of
    384 rows, so that TP2 and TP4 give 192- and 96-row expert partitions: not whole 128-blocks, the refined scale grid
    (vLLM: blocks of gcd(128, rows per rank, hidden) = 64 and 32) that the real model has at TP4 (768 / 4 = 192)."""
    if model.startswith("qwen3"):
        return [
            "num_hidden_layers=2",
            "hidden_size=256",
            "num_attention_heads=8",
            "num_key_value_heads=4",
            "head_dim=128",
            "moe_intermediate_size=384",
            "num_experts=4",
            "num_experts_per_tok=2",
            "vocab_size=300",
        ]
    inter = 128 * tp_max
    return [
        "num_hidden_layers=2",
        "first_k_dense_replace=1",
        "hidden_size=256",
        "num_attention_heads=8",
        "num_key_value_heads=8",
        f"intermediate_size={inter}",
        f"moe_intermediate_size={inter}",
        "n_routed_experts=4",
        "num_experts_per_tok=2",
        "n_group=1",
        "topk_group=1",
        "n_shared_experts=1",
        "q_lora_rank=128",
        "kv_lora_rank=128",
        "qk_nope_head_dim=64",
        "qk_rope_head_dim=64",
        "v_head_dim=128",
        "vocab_size=300",
    ]


# ---- cached sessions and plans ------------------------------------------------------------------------------------
def arch_spec(arch: str, dtype: str, root) -> tuple[str, tuple[str, ...]]:
    if arch in BUILTINS:
        return arch, tuple(shrink_overrides(arch))
    return archs.model_dir(arch, dtype, root), ()


def arch_experts(arch: str) -> int:
    if arch in BUILTINS:
        return archs.num_experts(models.resolve_model(arch, shrink_overrides(arch)).config)
    return archs.num_experts(archs.config(arch))


_SESSIONS: dict[tuple, RecordSession | LayoutRejected] = {}
_PLANS: dict[tuple, tuple[ir.RankPlan, object]] = {}


def get_session(model: str, overrides: tuple[str, ...], layout: Layout, dtype: str) -> RecordSession | None:
    """The cached session, or None when vLLM rejects the layout for this model (cached too)."""
    key = (model, overrides, layout, dtype)
    if key not in _SESSIONS:
        try:
            _SESSIONS[key] = RecordSession(model, layout, dtype=dtype, overrides=list(overrides))
        except LayoutRejected as e:
            _SESSIONS[key] = e
    got = _SESSIONS[key]
    return None if isinstance(got, LayoutRejected) else got


def get_plan(session: RecordSession, key: tuple, rank: int):
    """(plan, stats) of one rank, or None when vLLM refuses to build the model for that layout (some checks, e.g.
    Mamba's TP vs. groups, run only when the model is built)."""
    if (key, rank) not in _PLANS:
        try:
            _PLANS[(key, rank)] = session.record_rank(rank)
        except LayoutRejected:
            _PLANS[(key, rank)] = None
    return _PLANS[(key, rank)]
