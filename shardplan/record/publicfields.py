"""Fields of the real public config.json files that vLLM reads and the config classes' defaults lack (record side).

The coverage sweep's tiny configs start from each config class's defaults (`tiny.tiny_config`). Where vLLM's model
reads a field the class does not declare (the hub files carry it: MiniMax-M2's `rotary_dim`, LongCat-Flash's
`mla_scale_q_lora`, LFM2's `block_dim`, ...) or the class defaults it differently, a tiny config built from the
defaults alone makes vLLM fail on a config no real checkpoint has. So each entry below is the published config's
field set for that architecture, values as published, with where it came from; `tiny.tiny_config` lays it over the
class defaults before shrinking the sizes. An architecture whose vLLM build still fails on such a config is "cannot
run here" with vLLM's own error; one that fails for lack of a field listed nowhere here is a sweep bug.

`source`: the hub repository whose config.json this is, and the public copy the values were read from (the search
index of public repositories; hub files themselves are not fetched from this machine).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PUBLIC_FIELDS"]

_KIMI_LINEAR_LAYERS = {
    "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
    "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
    "head_dim": 128,
    "num_heads": 32,
    "short_conv_kernel_size": 4,
}

# SGLang reads the per-layer MoE flags; transformers' class has mlp_layer_types instead (tiny.py shrinks them alike)
# LongCat-Flash's MLA and zero-expert keys, shared by its n-gram sibling (LongCat-Flash-Lite)
_LONGCAT_FLASH = {
    "attention_method": "MLA",
    "mla_scale_q_lora": True,
    "mla_scale_kv_lora": True,
    "zero_expert_type": "identity",
    "zero_expert_num": 1,
    "norm_topk_prob": True,
    "attention_bias": False,
}

_K_EXAONE = {
    "source": "LGAI-EXAONE/K-EXAONE-236B-A23B config.json (is_moe_layer as in a public test's EXAONE_MOE_CONFIG "
    "quoting the hub file: the first layer dense, the other 47 MoE)",
    "fields": {"is_moe_layer": [False] + [True] * 47},
}

PUBLIC_FIELDS: dict[str, dict[str, Any]] = {
    "MiniMaxM2ForCausalLM": {
        "source": "MiniMaxAI/MiniMax-M2 config.json (values as in public copies: an msmodelslim quantization guide "
        "quoting the BF16 config verbatim, a Go test fixture miniMaxM2FixtureConfig; quantization_config "
        "and auto_map dropped)",
        "fields": {
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 3072,
            "intermediate_size": 1536,
            "max_position_embeddings": 196608,
            "mtp_transformer_layers": 1,
            "num_attention_heads": 48,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 62,
            "num_key_value_heads": 8,
            "num_local_experts": 256,
            "num_mtp_modules": 3,
            "qk_norm_type": "per_layer",
            "rms_norm_eps": 1e-06,
            "rope_theta": 5000000,
            "rotary_dim": 64,
            "scoring_func": "sigmoid",
            "shared_intermediate_size": 0,
            "tie_word_embeddings": False,
            "use_mtp": True,
            "use_qk_norm": True,
            "use_routing_bias": True,
            "vocab_size": 200064,
        },
    },
    "KimiLinearForCausalLM": {
        "source": "moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (values as in public copies: a pinned "
        "reference dict checked against the hub file, DEPENDED_FIELDS of a KDA kernel package, a Rust "
        "released_48b_config test)",
        "fields": {
            "hidden_size": 2304,
            "head_dim": 72,
            "intermediate_size": 9216,
            "num_hidden_layers": 27,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 1024,
            "moe_layer_freq": 1,
            "moe_renormalize": True,
            "moe_router_activation_func": "sigmoid",
            "num_experts": 256,
            "num_experts_per_token": 8,
            "num_shared_experts": 1,
            "routed_scaling_factor": 2.446,
            "use_grouped_topk": True,
            "num_expert_group": 1,
            "topk_group": 1,
            "q_lora_rank": None,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "mla_use_nope": True,
            "num_nextn_predict_layers": 0,
            "linear_attn_config": _KIMI_LINEAR_LAYERS,
            "vocab_size": 163840,
            "eos_token_id": 163586,
        },
    },
    "LongcatFlashForCausalLM": {
        "source": "meituan-longcat/LongCat-Flash-Chat config.json (the MLA and zero-expert keys, as in public copies: "
        "a Swift kLongcatFlashConfigJSON fixture, an unsloth test quoting a LongCat config verbatim)",
        "fields": _LONGCAT_FLASH,
    },
    "LongcatFlashNgramForCausalLM": {
        "source": "meituan-longcat/LongCat-Flash-Lite config.json (LongCat-Flash's MLA and zero-expert keys as above; "
        "the n-gram embedding keys as in public copies: an n-gram fixture generator quoting 'config.json @ HF main' "
        "(vocab 131072, hidden 3072, ratio 78, N=4, K=4, eos 2), a harness test writing the same values)",
        "fields": {
            **_LONGCAT_FLASH,
            "ngram_vocab_size_ratio": 78,
            "emb_neighbor_num": 4,
            "emb_split_num": 4,
        },
    },
    "PhiMoEForCausalLM": {
        "source": "microsoft/Phi-3.5-MoE-instruct config.json (its bias switches, as in a public Rust phi3_5_moe "
        "prefill test's config: attention_bias and lm_head_bias true; transformers' PhimoeConfig defaults both off)",
        "fields": {"attention_bias": True, "lm_head_bias": True},
    },
    "MiMoV2FlashForCausalLM": {
        "source": "XiaomiMiMo/MiMo-V2-Flash config.json (the hybrid sliding-window and MoE keys, as in public copies "
        "of mimo_v2 configs: a GPTQModel test TINY_CONFIG, a C++ loader fixture, an mlx test)",
        "fields": {
            "hybrid_layer_pattern": [0, 1, 1, 1],
            "moe_layer_freq": [0, 1, 1, 1],
            "swa_num_attention_heads": 64,
            "swa_num_key_value_heads": 8,
            "num_key_value_heads": 4,
            "swa_head_dim": 192,
            "swa_v_head_dim": 128,
            "head_dim": 192,
            "v_head_dim": 128,
            "sliding_window": 128,
            "sliding_window_size": 128,
            "add_full_attention_sink_bias": False,
            "add_swa_attention_sink_bias": True,
            "attention_value_scale": 0.707,
            "partial_rotary_factor": 0.334,
            "swa_rope_theta": 10000.0,
            "layernorm_epsilon": 1e-05,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "attention_bias": False,
        },
    },
    "HYV3ForCausalLM": {
        "source": "tencent Hunyuan hy_v3 hub config.json keys vLLM's hy_v3.py reads (expert_hidden_dim, route_norm), "
        "as in a public copy of a legacy hy_v3 config (omlx test_oq_sanitizer_normalizes_legacy_hy_v3_config)",
        "fields": {
            "expert_hidden_dim": 1536,
            "num_shared_experts": 1,
            "first_k_dense_replace": 1,
            "route_norm": True,
            "qk_norm": True,
        },
    },
    "Lfm2ForCausalLM": {
        "source": "LiquidAI/LFM2-1.2B config.json (a Rust test's LFM2_HF_CONFIG_JSON, 'read from the Hub', and "
        "the LFM2.5 config in another public test)",
        "fields": {
            "block_auto_adjust_ff_dim": True,
            "block_dim": 2048,
            "block_ff_dim": 12288,
            "block_multiple_of": 256,
            "block_ffn_dim_multiplier": 1.0,
            "block_norm_eps": 1e-05,
            "block_use_swiglu": True,
            "conv_L_cache": 3,
            "conv_bias": False,
            "conv_dim": 2048,
            "conv_dim_out": 2048,
            "hidden_size": 2048,
            "norm_eps": 1e-05,
            "num_attention_heads": 32,
            "num_heads": 32,
            "num_hidden_layers": 16,
            "num_key_value_heads": 8,
            "intermediate_size": 12288,
            "vocab_size": 65536,
            "max_position_embeddings": 128000,
        },
    },
    "InklingForCausalLM": {
        "source": "thinkingmachines/Inkling-Small config.json text_config (as in public copies: a Rust "
        "INKLING_SMALL fixture, an export tool's CONTRACT_FLAGS and REAL config dict)",
        "fields": {
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "swa_num_attention_heads": 32,
            "swa_num_key_value_heads": 8,
            "swa_head_dim": 128,
            "sliding_window_size": 512,
            "d_rel": 16,
            "rel_extent": 1024,
            "log_scaling_n_floor": 128000,
            "log_scaling_alpha": 0.1,
            "rms_norm_eps": 1e-06,
            "use_embed_norm": True,
            "logits_mup_width_multiplier": 16.0,
            "use_sconv": True,
            "sconv_kernel_size": 4,
            "dense_mlp_idx": 2,
            "dense_intermediate_size": 16384,
            "intermediate_size": 2048,
            "n_routed_experts": 256,
            "num_experts_per_tok": 6,
            "n_shared_experts": 2,
            "route_scale": 8.0,
            "use_gate_bias": True,
            "norm_after_topk": True,
            "shared_expert_sink": True,
            "use_global_scale": True,
            "gate_activation": "sigmoid",
            "q_bias": False,
            "o_bias": False,
            "vocab_size": 201024,
            "unpadded_vocab_size": 200058,
        },
    },
    "Qwen4ExpForCausalLM": {
        "source": "Qwen4-Exp text_config (the QSA indexer keys, which the config class leaves None and its indexed "
        "attention layers divide by; values as in a public copy: a Swift qwen4ExpFixtureConfig test fixture, "
        "text_config of a Qwen4ExpForConditionalGeneration config; output_gate_type, which vLLM requires and the class "
        "leaves None, as in two public qwen4_exp test configs: an mlx TEXT dict, a ModelConfig.from_dir test)",
        "fields": {
            "indexer_budget": 2048,
            "indexer_compress_ratio": 4,
            "indexer_head_dim": 128,
            "indexer_kv_heads": 1,
            "indexer_n_heads": 4,
            "output_gate_type": "sigmoid",
        },
    },
    "DeepseekV4ForCausalLM": {
        "source": "deepseek-ai/DeepSeek-V4-Flash config.json (values as in a public copy: a Rust crate's "
        "OFFICIAL_CONFIG test constant quoting the file verbatim and pinning its sha256; the same values in a "
        "Python DeepSeek-V4-Flash layer-contract module 'frozen from the checkpoint's config.json'); "
        "quantization_config and expert_dtype dropped (the sweep lists BF16 tensors)",
        "fields": {
            "attention_bias": False,
            "hc_eps": 1e-06,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "head_dim": 512,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "index_head_dim": 128,
            "index_n_heads": 64,
            "index_topk": 512,
            "max_position_embeddings": 1048576,
            "moe_intermediate_size": 2048,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "num_attention_heads": 64,
            "num_experts_per_tok": 6,
            "num_hidden_layers": 43,
            "num_hash_layers": 3,
            "num_key_value_heads": 1,
            "num_nextn_predict_layers": 1,
            "o_groups": 8,
            "o_lora_rank": 1024,
            "q_lora_rank": 1024,
            "qk_rope_head_dim": 64,
            "rms_norm_eps": 1e-06,
            "rope_scaling": {
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 16,
                "original_max_position_embeddings": 65536,
                "type": "yarn",
            },
            "rope_theta": 10000,
            "routed_scaling_factor": 1.5,
            "scoring_func": "sqrtsoftplus",
            "sliding_window": 128,
            "swiglu_limit": 10.0,
            "tie_word_embeddings": False,
            "topk_method": "noaux_tc",
            "vocab_size": 129280,
            "compress_rope_theta": 160000,
            "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
        },
    },
    "Step3p5ForCausalLM": {
        "source": "stepfun-ai/Step-3.5-Flash config.json text_config (values as in public copies: an mlx Swift test's "
        "stepWrapperConfigJSON quoting the text_config, a Python Step3p5FlashLikeConfig test dataclass, a config "
        "class default quoting attention_other_setting in full)",
        "fields": {
            "hidden_size": 4096,
            "num_attention_heads": 64,
            "num_attention_groups": 8,
            "head_dim": 128,
            "intermediate_size": 12288,
            "vocab_size": 128896,
            "moe_num_experts": 288,
            "moe_top_k": 8,
            "moe_intermediate_size": 1280,
            "share_expert_dim": 1280,
            "use_head_wise_attn_gate": True,
            "need_fp32_gate": True,
            "use_moe_router_bias": True,
            "moe_router_scaling_factor": 3.0,
            "yarn_only_types": ["full_attention"],
            "sliding_window": 512,
            "attention_other_setting": {
                "attention_type": "sliding_attention",
                "num_attention_heads": 96,
                "num_attention_groups": 8,
                "head_dim": 128,
            },
        },
    },
    # Fields of the published configs that SGLang's models read and transformers' config classes lack (SGLang's own
    # config classes, which its server uses for some of these model types, declare them; the sweep builds
    # transformers' classes in both venvs).
    "DeepseekV2ForCausalLM": {
        "source": "deepseek-ai/DeepSeek-V2-Lite config.json (moe_layer_freq as in a public copy quoting the hub file "
        "with model_type deepseek_v2, 27 layers, 64 routed experts; its routing keys)",
        "fields": {
            "moe_layer_freq": 1,
            "ep_size": 1,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "greedy",
            "num_experts_per_tok": 6,
            "scoring_func": "softmax",
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
        },
    },
    "DeepseekV3ForCausalLM": {
        "source": "deepseek-ai/DeepSeek-V3 config.json (moe_layer_freq as in a public copy quoting the hub file with "
        "model_type deepseek_v3, 256 routed experts; its routing keys)",
        "fields": {
            "moe_layer_freq": 1,
            "ep_size": 1,
            "n_group": 8,
            "topk_group": 4,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
        },
    },
    "DeepseekV32ForCausalLM": {
        "source": "deepseek-ai/DeepSeek-V3.2 config.json (routing and indexer keys as in public copies: a Rust "
        "loader test's deepseek_v32_config() fixture, a DSA kernel table's DeepseekV32ForCausalLM dims)",
        "fields": {
            "moe_layer_freq": 1,
            "n_group": 8,
            "topk_group": 4,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "index_topk": 2048,
            "index_n_heads": 64,
            "index_head_dim": 128,
        },
    },
    "GlmMoeDsaForCausalLM": {
        "source": "zai-org GLM-5 series config.json (moe_layer_freq as in a public C++ test fixture quoting the hub "
        "file: glm_moe_dsa, 78 layers, 256 routed experts; its routing keys)",
        "fields": {
            "moe_layer_freq": 1,
            "ep_size": 1,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
        },
    },
    "Gemma2ForCausalLM": {
        "source": "google/gemma-2-2b config.json (both activation keys, as in a public copy quoting the hub file: "
        "hidden_size 2304, 26 layers)",
        "fields": {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"},
    },
    "Qwen3NextForCausalLM": {
        "source": "Qwen/Qwen3-Next-80B-A3B-Instruct config.json (full_attention_interval as in public copies quoting "
        "the hub file)",
        "fields": {"full_attention_interval": 4},
    },
    "Qwen3_5ForCausalLM": {
        "source": "Qwen/Qwen3.5 dense config.json text_config (full_attention_interval as in public copies quoting "
        "the hub file: 64 layers, hidden_size 5120)",
        "fields": {"full_attention_interval": 4},
    },
    "Qwen3_5MoeForCausalLM": {
        "source": "Qwen/Qwen3.5 MoE config.json text_config (full_attention_interval as in public copies quoting "
        "the hub file: 256 experts, 8 per token)",
        "fields": {"full_attention_interval": 4},
    },
    "HunYuanMoEV1ForCausalLM": {
        "source": "tencent/Hunyuan-A13B-Instruct config.json (the per-layer MoE lists and intermediate_size, as in a "
        "public test's HUNYUAN_MOE_LIST_CONFIG, and the use_* switches, as in a public copy of the hub file: 32 "
        "layers, 64 experts)",
        "fields": {
            "intermediate_size": 3072,  # == every moe_intermediate_size: the tiny config keeps them tied
            "moe_intermediate_size": [3072] * 32,
            "moe_topk": [8] * 32,
            "num_shared_expert": [1] * 32,
            "use_mixed_mlp_moe": True,
            "use_qk_norm": True,
            "use_cla": False,
        },
    },
    "HunYuanDenseV1ForCausalLM": {
        "source": "tencent/Hunyuan-7B-Instruct config.json (the use_* switches, as in a public test's raw_config "
        "quoting it: 32 layers, hidden 4096; Hunyuan-MT-7B's public copy has use_qk_norm true too)",
        "fields": {"use_qk_norm": True, "use_cla": False},
    },
    "ExaoneMoEForCausalLM": _K_EXAONE,
    "ExaoneMoeForCausalLM": _K_EXAONE,
}
