"""Tiny configs for every text-decoder architecture vLLM implements: the inputs of the coverage sweep (vLLM side).

For an architecture name from vLLM's model registry, `tiny_config` finds the config class vLLM reads it with
(transformers' causal-LM mapping, vLLM's own config registry, or the class vLLM's implementation is built on), takes
that class's defaults and shrinks every size it knows to a few units: hidden 128, 4 heads over 2 kv heads, 2 layers
(one dense and one MoE where the model has both), 8 experts, small MLA ranks, and a vocabulary of 300 (not a multiple
of 64, so vLLM pads it and the last TP rank gets padding rows). Per-layer lists keep one layer of each kind.
An architecture whose config exists only as hub remote code raises `NoConfigClass` with that reason.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from shardplan.errors import ShardplanError
from shardplan.models import resolve_model
from shardplan.record.configs import TEXT_CONFIG_KEYS, config_class, hf_view
from shardplan.record.publicfields import PUBLIC_FIELDS

__all__ = ["NoConfigClass", "model_type_of", "text_decoder_architectures", "tiny_config"]

# vLLM architecture names that are neither a transformers causal-LM class nor in vLLM's config registry, but whose
# vLLM implementation reads the config of another model_type (the vLLM module named in the comment).
_MODEL_TYPE_OF = {
    "LLaMAForCausalLM": "llama",
    "InternLM3ForCausalLM": "llama",
    "IQuestCoderForCausalLM": "llama",  # llama.py
    "TeleChat3ForCausalLM": "llama",  # llama.py
    "PhiMoEForCausalLM": "phimoe",
    "ExaoneMoEForCausalLM": "exaone_moe",  # phimoe, exaone_moe
    "NemotronHPuzzleForCausalLM": "nemotron_h",  # nemotron_h.py
    "LongcatFlashNgramForCausalLM": "longcat_flash",  # vLLM's _ARCHITECTURE_TO_MODEL_TYPE
    "Step3TextForCausalLM": "step3_text",
    "Step3p5ForCausalLM": "step3p5",  # vLLM configs
}

# Architectures whose vLLM implementation reads the config of vLLM's own model_type, not that of the transformers
# class of the same name (vLLM's InklingForCausalLM reads InklingModelConfig's use_embed_norm, d_rel, ...).
_VLLM_MODEL_TYPE = {"InklingForCausalLM": "inkling_model"}

_SIZES: dict[str, int] = {
    "hidden_size": 128,
    "n_embd": 128,
    "d_model": 128,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "multi_query_group_num": 2,
    "n_head_kv": 2,
    "kv_n_heads": 2,
    "head_dim": 32,
    "kv_channels": 32,
    "attention_head_dim": 32,
    "intermediate_size": 256,
    "n_inner": 256,
    "ffn_hidden_size": 256,
    "ffn_dim": 256,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "expert_intermediate_size": 64,
    "moe_ffn_hidden_size": 64,
    "moe_shared_expert_intermediate_size": 64,
    "num_experts": 8,
    "n_routed_experts": 8,
    "num_local_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "num_selected_experts": 2,
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    "first_k_dense_replace": 1,
    "first_k_dense": 1,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "index_head_dim": 32,
    "index_n_heads": 4,
    "indexer_head_dim": 32,
    "vocab_size": 300,
    "vocab_size_per_layer_input": 300,
    "hidden_size_per_layer_input": 16,
    "n_heads": 4,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "mamba_n_heads": 8,
    "mamba_d_head": 32,
    "mamba_head_dim": 32,
    "mamba_d_state": 16,
    "ssm_state_size": 16,
    "state_size": 16,
    "mamba_n_groups": 1,
    "n_groups": 1,
    "mamba_d_ssm": 256,
    "time_step_rank": 8,
    # sizes of the public fields (publicfields.py) the class defaults lack
    "rotary_dim": 16,
    "swa_head_dim": 32,
    "swa_v_head_dim": 16,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "expert_hidden_dim": 64,
    "block_dim": 128,
    "conv_dim": 128,
    "conv_dim_out": 128,
    "block_ff_dim": 256,
    "zero_expert_num": 2,
    "sliding_window_size": 64,
    "dense_intermediate_size": 256,
}
# Sizes that must agree with others in ways a generic shrink cannot know.
_FIXES: dict[str, dict[str, Any]] = {
    "Mamba2ForCausalLM": {"num_heads": 8, "head_dim": 32, "n_groups": 1},  # hidden * expand == num_heads * head_dim
    "DbrxForCausalLM": {"attn_config": {"rope_theta": 500000.0}},  # the modeling code reads it, the default lacks it
    "Gemma3nForCausalLM": {"num_kv_shared_layers": 0},  # the default shares the kv of 15 layers of 30
    # fields vLLM's implementation reads that the transformers class lacks or defaults differently (hub values)
    "AfmoeForCausalLM": {"score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1},
    "HYV3ForCausalLM": {"first_k_dense_replace": 1},
    # SGLang takes v_head_dim as hidden_size // num_attention_heads (so does the published config: 2560 // 40 == 64)
    "MiniCPM3ForCausalLM": {"v_head_dim": 32},
    "InklingForCausalLM": {
        "vocab_size": 320,
        "padded_vocab_size": 320,
        "unpadded_vocab_size": 300,
        "local_layer_ids": [0],
        "dense_mlp_idx": 1,
        "num_experts": 8,  # the class derives it from n_routed_experts; its defaults' to_dict carries the derived 0
        "num_key_value_heads": 4,  # vLLM's sconv SWA cache needs tp <= kv heads (the public config has 8 of 32)
        "swa_num_key_value_heads": 4,
    },  # layer 0 local and dense, layer 1 global and MoE
    # layer 0 full attention and dense, layer 1 sliding window and MoE (moe_layers_enum: the MoE layers' indices)
    "Step3p5ForCausalLM": {
        "num_hidden_layers": 2,
        "num_attention_groups": 2,
        "attention_other_setting": {
            "attention_type": "sliding_attention",
            "num_attention_heads": 4,
            "num_attention_groups": 2,
            "head_dim": 32,
        },
        "layer_types": ["full_attention", "sliding_attention"],
        "partial_rotary_factors": [0.5, 1.0],
        "moe_layers_enum": "1",
        "mlp_layer_types": ["dense", "sparse"],  # transformers' Step3p7TextConfig reads the layers' kinds here
        # per layer as published (full 5e6, sliding 1e4): SGLang's step3p5.py indexes config.rope_theta[layer_id]
        "rope_theta": [5000000.0, 10000.0],
        "rope_parameters": None,
        # per-layer SwiGLU clamps, none (0) as in most published layers (vLLM's CPU MoE has no clamped backend)
        "swiglu_limits": [0.0, 0.0],
        "swiglu_limits_shared": [0.0, 0.0],
        "use_moe": True,
        "moe_num_experts": 8,
        "moe_top_k": 2,
        "share_expert_dim": 64,
    },
    # one layer of each kind: hash-routed sliding window (ratio 0), compressed with indexer (4), compressed (128)
    "DeepseekV4ForCausalLM": {
        "num_hidden_layers": 3,
        "num_hash_layers": 1,
        "compress_ratios": [0, 4, 128, 0],  # the published list is one longer than the layers (the MTP layer)
        "o_groups": 4,  # vLLM splits the output groups over TP ranks (published 8 for TP <= 8)
        "o_lora_rank": 32,
        # vLLM's fused quant+cache kernels take only the published head sizes
        "head_dim": 512,
        "index_head_dim": 128,
        "qk_rope_head_dim": 64,
    },
    "DeepseekV3ForCausalLM": {"topk_method": "noaux_tc"},
    # top-1 routing as published (Zyphra/ZAYA1-8B, the class default); transformers' ZayaConfig refuses any other
    "ZayaForCausalLM": {"num_experts_per_tok": 1},  # else vLLM builds no e_score_correction_bias
    # transformers reads the shrunk mlp_layer_types (dense, dense, sparse), SGLang first_k_dense_replace: agree
    "GlmMoeDsaForCausalLM": {"first_k_dense_replace": 2},
    # the same for DeepSeek-V3.2 (transformers' DeepseekV32Config lists 3 layers; vLLM reads it as DeepseekV3Config,
    # which shrinks to 2 layers: 3 layers there too, so both build dense, dense, MoE)
    "DeepseekV32ForCausalLM": {"first_k_dense_replace": 2, "num_hidden_layers": 3},
    # SGLang's Qwen3NextConfig derives the layer kinds from the interval, transformers' reads the shrunk layer_types
    # (linear, linear, full): the interval that gives the same
    "Qwen3NextForCausalLM": {"full_attention_interval": 3},
    "Qwen3_5ForCausalLM": {"full_attention_interval": 3},  # the same for Qwen3.5 (SGLang's Qwen3_5 configs)
    "Qwen3_5MoeForCausalLM": {"full_attention_interval": 3},
    # the published is_moe_layer (48 layers) as the shrunk mlp_layer_types (dense, sparse, sparse)
    "ExaoneMoEForCausalLM": {"is_moe_layer": [False, True, True]},
    "ExaoneMoeForCausalLM": {"is_moe_layer": [False, True, True]},
    # multi-head attention, as the public configs have (OLMo-1B-hf 16/16, OLMoE-1B-7B 16/16, phi-2 32/null):
    # SGLang builds their k/v (and OLMoE its k_norm) from num_attention_heads
    "OlmoForCausalLM": {"num_key_value_heads": 4},
    "OlmoeForCausalLM": {"num_key_value_heads": 4},
    "PhiForCausalLM": {"num_key_value_heads": 4, "intermediate_size": 512},  # SGLang's Phi MLP: 4 * hidden, as phi-2
    # value heads twice the key heads' width, as published (Olmo-Hybrid-7B: 96 and 192, open-instruct's preset)
    "OlmoHybridForCausalLM": {"linear_value_head_dim": 64},
    # MoE layers as the released comma string (StepFun's code and vLLM .split(",") it): layer 0 dense, layer 1 MoE
    "Step3TextForCausalLM": {"moe_layers_enum": "1", "share_q_dim": 64, "share_expert_dim": 64, "moe_top_k": 2},
    "Glm4MoeForCausalLM": {"head_dim": 32},
    "Glm4MoeLiteForCausalLM": {"head_dim": 32, "first_k_dense_replace": 1},
    "FalconForCausalLM": {"ffn_hidden_size": 512},  # vLLM's Falcon MLP is 4 * hidden whatever ffn_hidden_size says
    "GPTJForCausalLM": {"rotary_dim": 16},  # the default 64 exceeds the tiny head_dim
    "Lfm2MoeForCausalLM": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},  # default: None
    "Lfm2ForCausalLM": {"layer_types": ["conv", "full_attention"]},
    "Zamba2ForCausalLM": {
        "attention_hidden_size": 256,
        "attention_head_dim": 64,  # the class rule: 2 * hidden
        "num_key_value_heads": 4,  # multi-head: the class sets it to num_attention_heads, as the public configs have
        "hybrid_layer_ids": [2],
    },  # the shrunk layers_block_type's hybrid layer
    # 1-based layer lists: layer 1 (dense MLP, first_k_dense_replace) KDA, layer 2 MLA + MoE; transformers' class
    # lists the kinds again in layer_types / mlp_layer_types (its 27 defaults shrink to 3 layers): all say the same
    "KimiLinearForCausalLM": {
        "num_hidden_layers": 2,
        "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2]},
        "layer_types": ["linear_attention", "full_attention"],
        "mlp_layer_types": ["dense", "sparse"],
    },
}
# Fields whose None default the modeling code does not derive: set like the sizes above.
_NONE_SIZES = ("head_dim", "num_key_value_heads")
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")
_NUM_LAYERS = 2


class NoConfigClass(ShardplanError):
    """No config class for this architecture outside hub remote code (which shardplan never runs)."""


def text_decoder_architectures() -> list[str]:
    """vLLM's text-generation architectures plus those it serves through its Transformers backend, sorted."""
    from vllm.model_executor.models import registry

    backend = {"TransformersForCausalLM", "TransformersMoEForCausalLM"}
    archs = set(registry._TEXT_GENERATION_MODELS)
    archs |= {a for a, (_, cls) in registry._TRANSFORMERS_SUPPORTED_MODELS.items() if cls in backend}
    return sorted(archs)


def model_type_of(arch: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # Several model_types can map to one class (llama4 and llama4_text -> Llama4ForCausalLM): the text-only config
    # (no sub-configs) is the one the causal-LM class is built from.
    if arch in _VLLM_MODEL_TYPE:
        return _VLLM_MODEL_TYPE[arch]
    candidates = [
        t for t, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if name == arch and config_class(t) is not None
    ]
    candidates.sort(key=lambda t: bool(getattr(config_class(t), "sub_configs", None)))
    if candidates:
        return candidates[0]
    if arch in _MODEL_TYPE_OF:
        return _MODEL_TYPE_OF[arch]
    raise NoConfigClass(
        f"{arch}: needs remote code: its config class exists only as the model's own code (neither "
        f"transformers nor vLLM ships one); record it from a local checkpoint directory with "
        f"--trust-remote-code, as vLLM does. The sweep has no such directory."
    )


def tiny_config(arch: str) -> dict[str, Any]:
    """A small config.json dict for `arch` (architectures=[arch]), from its config class's defaults."""
    model_type = model_type_of(arch)
    cls = config_class(model_type)
    try:
        defaults = cls().to_dict()
    except Exception as exc:
        raise NoConfigClass(
            f"{arch}: {cls.__name__}() has no defaults ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:200]}); a small shipped config is needed."
        ) from exc
    # vLLM reads some model types with its own class (deepseek_v32 with DeepseekV3Config, deepseek_v4, kimi_linear);
    # transformers' class of the same model_type carries the published defaults for what vLLM's leaves out or None
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    own = getattr(transformers, CONFIG_MAPPING_NAMES.get(model_type, ""), None)
    if isinstance(own, type) and own is not cls:
        try:
            for key, value in own().to_dict().items():  # not per-layer lists: vLLM's class derives those its way
                if defaults.get(key) is None and not isinstance(value, list):
                    defaults[key] = value
        except Exception:  # a transformers class without defaults of its own
            pass
    _merge(defaults, PUBLIC_FIELDS.get(arch, {}).get("fields", {}))
    config = _shrink(defaults)
    for key, value in list(config.items()):  # nested configs (text_config, DBRX's attn_config/ffn_config)
        if isinstance(value, dict) and (key in TEXT_CONFIG_KEYS or key.endswith("_config")):
            config[key] = _shrink(value)
            for generic in ("_name_or_path", "output_attentions", "transformers_version"):
                config[key].pop(generic, None)
    _merge(config, _FIXES.get(arch, {}))
    config["architectures"] = [arch]
    config["model_type"] = model_type
    for key in ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "auto_map"):
        config.pop(key, None)
    return config


def _merge(config: dict[str, Any], fixes: dict[str, Any]) -> None:
    for key, value in fixes.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            _merge(config[key], value)
        else:
            config[key] = copy.deepcopy(value)


def _shrink(defaults: dict[str, Any]) -> dict[str, Any]:
    config = copy.deepcopy(defaults)
    for key in _NONE_SIZES:
        if key in config and config[key] is None:
            config[key] = _SIZES[key]
    old_layers = next((int(config[k]) for k in _LAYER_COUNTS if isinstance(config.get(k), int)), None)
    ties = _tied_sizes(config)
    for key, size in _SIZES.items():
        value = config.get(key)
        if _is_size(value) and value > 0:
            config[key] = _shrunk(key, value)
        elif isinstance(value, list) and value and all(_is_size(v) for v in value):
            # a size given per layer (Hunyuan-A13B's moe_intermediate_size and moe_topk, Gemma 3n's
            # intermediate_size) shrinks layer by layer like the single value: an unshrunk entry is a hollow pass
            # (vLLM builds it at full size, the checkpoint's class perhaps from another field, small)
            config[key] = [_shrunk(key, v) if v > 0 else v for v in value]
    for scalar, per_layer in ties.items():
        config[scalar] = config[per_layer][0]
    if isinstance(config.get("rope_parameters"), dict) or isinstance(config.get("rope_scaling"), dict):
        for key in ("rope_parameters", "rope_scaling"):
            params = config.get(key)
            if isinstance(params, dict) and params.get("rope_type") in ("yarn", "deepseek_yarn"):
                params.setdefault("original_max_position_embeddings", 4096)
    for key in _TOKEN_IDS:
        value = config.get(key)
        if isinstance(value, int) and value >= config.get("vocab_size", 1 << 30):
            config[key] = min(2, config["vocab_size"] - 1)
        elif isinstance(value, list):
            config[key] = [v if v < config.get("vocab_size", 1 << 30) else 2 for v in value]
    if old_layers:
        picks = _layer_picks(config, old_layers)
        for key in _LAYER_COUNTS:
            if isinstance(config.get(key), int):
                config[key] = len(picks)
        for key, value in list(config.items()):
            if isinstance(value, list) and len(value) == old_layers and old_layers > 1:
                config[key] = [value[i] for i in picks]
        for key in ("mlp_only_layers",):
            if isinstance(config.get(key), list):
                config[key] = [i for i in config[key] if i < len(picks)]
        for key, value in list(config.items()):  # per-layer dicts keyed by layer index (Gemma 4's per_layer_config)
            if isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
                renumber = {old: new for new, old in enumerate(picks)}
                config[key] = {
                    type(k)(renumber[int(k)]) if isinstance(k, int) else str(renumber[int(k)]): v
                    for k, v in value.items()
                    if int(k) in renumber
                }
    return config


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shrunk(key: str, value: int) -> int:
    return min(value, _SIZES[key]) if key in ("n_group", "topk_group", "num_expert_group") else _SIZES[key]


def _tied_sizes(config: dict[str, Any]) -> dict[str, str]:
    """Single sizes the config gives equal to every entry of a per-layer size list, each with that list's key: they
    stay equal when shrunk (Hunyuan-A13B's intermediate_size 3072, which transformers' experts are built from, and
    moe_intermediate_size [3072] * 32, which vLLM's Transformers backend sizes its fused experts from)."""
    ties = {}
    for per_layer, values in config.items():
        if per_layer in _SIZES and isinstance(values, list) and values and all(_is_size(v) for v in values):
            if len(set(values)) == 1 and values[0] > 0:
                for scalar in _SIZES:
                    if scalar != per_layer and _is_size(config.get(scalar)) and config[scalar] == values[0]:
                        ties[scalar] = per_layer
    return ties


def _layer_picks(config: dict[str, Any], num_layers: int) -> list[int]:
    """Layers to keep: the first of every kind in each per-layer list, at least _NUM_LAYERS."""
    picks = set(range(min(_NUM_LAYERS, num_layers)))
    for value in config.values():
        if isinstance(value, list) and len(value) == num_layers and num_layers > 1:
            seen: dict[str, int] = {}
            for i, item in enumerate(value):
                seen.setdefault(repr(item), i)
            picks |= set(seen.values())
    return sorted(picks)[:8]


SWEEP_TPS = (1, 2, 4)


def short_error(exc: BaseException, limit: int = 600) -> str:
    """An exception as one line of at most `limit` characters, for a coverage row."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[:limit] + " ..."


def sweep_start(arch: str, workdir: Path) -> tuple[dict, Path, bool]:
    """What both engines' coverage sweeps do first for `arch`: a result row, its tiny config written to
    workdir/arch/config.json, and whether the model has experts. A row whose status is already set is the verdict
    (no config class: cannot; its config class rejects the tiny config: FAIL -- the tiny config is ours)."""
    row: dict = {"arch": arch, "status": "", "reason": "", "layouts": {}, "fallbacks": [], "model_type": ""}
    model_dir = workdir / arch
    try:
        config = tiny_config(arch)
    except NoConfigClass as exc:
        return dict(row, status="cannot", reason=str(exc)), model_dir, False
    row["model_type"] = config["model_type"]
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    try:
        has_experts = hf_view(resolve_model(str(model_dir))).num_experts > 0
    except Exception as exc:  # noqa: BLE001 - any refusal of our tiny config is the sweep's failure
        reason = f"its config class rejects the tiny config: {short_error(exc)}"
        return dict(row, status="FAIL", reason=reason), model_dir, False
    return row, model_dir, has_experts
