"""Tests for shardplan.models: built-in configs, resolution, overrides, errors, and on-disk tensor listings."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import pytest

from shardplan.errors import ShardplanError
from shardplan.models import (
    ConfigError,
    ModelSpec,
    UnknownModelError,
    config_sha256,
    list_models,
    resolve_model,
)
from shardplan.record import checkpoint
from shardplan.record.checkpoint import checkpoint_tensors, read_safetensors_header

BUILTINS = {
    "kimi-k2": "moonshotai/Kimi-K2-Instruct",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-Instruct-v0.1",
    # late-2026 additions; their tensor listings are checked against save_pretrained in test_names.py
    "gpt-oss-120b": "openai/gpt-oss-120b",
    "qwen3-next-80b-a3b": "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "glm-4.5": "zai-org/GLM-4.5",
    "glm-4.6": "zai-org/GLM-4.6",
    # frontier MoEs (docs/configs.md cites the public config files)
    "minimax-m2": "MiniMaxAI/MiniMax-M2",
    "kimi-linear-48b-a3b": "moonshotai/Kimi-Linear-48B-A3B-Instruct",
    "deepseek-v4-flash": "deepseek-ai/DeepSeek-V4-Flash",
    "deepseek-v3.2": "deepseek-ai/DeepSeek-V3.2",
    "deepseek-v4-pro": "deepseek-ai/DeepSeek-V4-Pro",
    "qwen3.5-397b-a17b": "Qwen/Qwen3.5-397B-A17B",  # the multimodal hub config; its language model is the plan
    # block-FP8 checkpoints (quantization_config kept); the first two are variants of the BF16 built-ins above
    "kimi-k2-fp8": "moonshotai/Kimi-K2-Instruct",
    "deepseek-v3-fp8": "deepseek-ai/DeepSeek-V3",
    "qwen3-30b-a3b-fp8": "Qwen/Qwen3-30B-A3B-FP8",
}
VARIANTS = {"kimi-k2-fp8": "kimi-k2", "deepseek-v3-fp8": "deepseek-v3"}  # their HF id names resolve to the BF16 one

# Public facts about each model (from the hub config.json files and model cards).
KNOWN_FACTS = {
    # Qwen/Qwen3.5-397B-A17B (docs/configs.md): the multimodal class; text_config: 45 Gated DeltaNet + 15
    # full-attention layers, all MoE (fields not at the top level are read from text_config)
    "qwen3.5-397b-a17b": dict(
        architectures=["Qwen3_5MoeForConditionalGeneration"],
        model_type="qwen3_5_moe",
        tie_word_embeddings=False,
        hidden_size=4096,
        num_hidden_layers=60,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024,
        num_attention_heads=32,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=64,
        vocab_size=248320,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 15,
    ),
    # deepseek-ai/DeepSeek-V4-Flash config.json (docs/configs.md); its reference tensor names: test_frontier.py
    "deepseek-v4-flash": dict(
        architectures=["DeepseekV4ForCausalLM"],
        hidden_size=4096,
        num_hidden_layers=43,
        n_routed_experts=256,
        num_experts_per_tok=6,
        moe_intermediate_size=2048,
        num_attention_heads=64,
        head_dim=512,
        o_groups=8,
        num_hash_layers=3,
        hc_mult=4,
        vocab_size=129280,
        compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0],
    ),
    # DeepSeek-V3.2 (docs/configs.md): V3's dims and routing plus the DSA lightning indexer
    "deepseek-v3.2": dict(
        architectures=["DeepseekV32ForCausalLM"],
        model_type="deepseek_v32",
        hidden_size=7168,
        num_hidden_layers=61,
        n_routed_experts=256,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        num_attention_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        index_topk=2048,
        index_n_heads=64,
        index_head_dim=128,
        vocab_size=129280,
    ),
    # deepseek-ai/DeepSeek-V4-Pro config.json (docs/configs.md: a verbatim public copy, each value cross-checked)
    "deepseek-v4-pro": dict(
        architectures=["DeepseekV4ForCausalLM"],
        hidden_size=7168,
        num_hidden_layers=61,
        n_routed_experts=384,
        num_experts_per_tok=6,
        moe_intermediate_size=3072,
        num_attention_heads=128,
        head_dim=512,
        q_lora_rank=1536,
        o_groups=16,
        o_lora_rank=1024,
        index_topk=1024,
        routed_scaling_factor=2.5,
        num_hash_layers=3,
        hc_mult=4,
        vocab_size=129280,
        compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0],
    ),
    "kimi-k2": dict(
        architectures=["DeepseekV3ForCausalLM"],
        hidden_size=7168,
        num_hidden_layers=61,
        n_routed_experts=384,
        vocab_size=163840,
        first_k_dense_replace=1,
        moe_intermediate_size=2048,
        num_attention_heads=64,
        n_shared_experts=1,
        num_experts_per_tok=8,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
    ),
    "deepseek-v3": dict(
        architectures=["DeepseekV3ForCausalLM"],
        hidden_size=7168,
        num_hidden_layers=61,
        n_routed_experts=256,
        vocab_size=129280,
        first_k_dense_replace=3,
        num_attention_heads=128,
        moe_intermediate_size=2048,
        intermediate_size=18432,
        num_nextn_predict_layers=1,
        n_group=8,
        topk_group=4,
    ),
    "qwen3-235b-a22b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        num_hidden_layers=94,
        num_experts=128,
        hidden_size=4096,
        head_dim=128,
        num_key_value_heads=4,
        num_attention_heads=64,
        moe_intermediate_size=1536,
        num_experts_per_tok=8,
        vocab_size=151936,
    ),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        num_hidden_layers=48,
        num_experts=128,
        hidden_size=2048,
        moe_intermediate_size=768,
        num_attention_heads=32,
        num_key_value_heads=4,
    ),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"],
        num_hidden_layers=32,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=128256,
        num_key_value_heads=8,
        rope_theta=500000.0,
    ),
    "llama-3.1-70b": dict(
        architectures=["LlamaForCausalLM"],
        num_hidden_layers=80,
        hidden_size=8192,
        intermediate_size=28672,
        vocab_size=128256,
        num_attention_heads=64,
        num_key_value_heads=8,
    ),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"],
        num_hidden_layers=28,
        hidden_size=3584,
        intermediate_size=18944,
        vocab_size=152064,
        num_key_value_heads=4,
        num_attention_heads=28,
    ),
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"],
        num_hidden_layers=32,
        num_local_experts=8,
        intermediate_size=14336,
        vocab_size=32000,
        hidden_size=4096,
        num_experts_per_tok=2,
    ),
    "gpt-oss-120b": dict(
        architectures=["GptOssForCausalLM"],
        num_hidden_layers=36,
        num_local_experts=128,
        hidden_size=2880,
        intermediate_size=2880,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=201088,
        num_experts_per_tok=4,
        sliding_window=128,
    ),
    "qwen3-next-80b-a3b": dict(
        architectures=["Qwen3NextForCausalLM"],
        num_hidden_layers=48,
        num_experts=512,
        hidden_size=2048,
        num_experts_per_tok=10,
        full_attention_interval=4,
        head_dim=256,
        linear_num_value_heads=32,
        linear_num_key_heads=16,
        vocab_size=151936,
    ),
    "glm-4.5": dict(
        architectures=["Glm4MoeForCausalLM"],
        num_hidden_layers=92,
        n_routed_experts=160,
        hidden_size=5120,
        num_attention_heads=96,
        num_key_value_heads=8,
        first_k_dense_replace=3,
        moe_intermediate_size=1536,
        vocab_size=151552,
        max_position_embeddings=131072,
    ),
    "glm-4.6": dict(
        architectures=["Glm4MoeForCausalLM"],
        num_hidden_layers=92,
        n_routed_experts=160,
        hidden_size=5120,
        max_position_embeddings=202752,
    ),
}

# Overrides that shrink each built-in to 2 layers with few experts, keeping one dense and one MoE layer where the
# model has both kinds.
SHRINK = {
    "kimi-k2": ["num_hidden_layers=2", "n_routed_experts=4"],
    "deepseek-v3": [
        "num_hidden_layers=2",
        "n_routed_experts=4",
        "first_k_dense_replace=1",
        "n_group=1",
        "topk_group=1",
    ],
    "qwen3-235b-a22b": ["num_hidden_layers=2", "num_experts=4", "mlp_only_layers=[1]"],
    "qwen3-30b-a3b": ["num_hidden_layers=2", "num_experts=4"],
    "llama-3.1-8b": ["num_hidden_layers=2"],
    "llama-3.1-70b": ["num_hidden_layers=2"],
    "qwen2.5-7b": ["num_hidden_layers=2"],
    "mixtral-8x7b": ["num_hidden_layers=2", "num_local_experts=4"],
}


# vLLM's own cache, as it resolves before the fixture below redirects XDG_CACHE_HOME: reusing it keeps the vLLM test
# fast after its first run (vLLM caches each architecture's inspection there).
USER_VLLM_CACHE = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm"
)


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("VLLM_CACHE_ROOT", USER_VLLM_CACHE)


# ------------------------------------------------------------------------------------------ expected tensors
# Written independently of transformers, from the architectures' published checkpoint layouts.


def expected_tensors(cfg: dict, dtype: str = "bfloat16") -> dict[str, tuple[tuple[int, ...], str]]:
    arch = cfg["architectures"][0]
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = (V, H)
    fp32 = set()
    for i in range(L):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        heads = cfg["num_attention_heads"]
        if arch == "DeepseekV3ForCausalLM":
            nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
            qr, kvr = cfg["q_lora_rank"], cfg["kv_lora_rank"]
            out.update(
                {
                    p + "self_attn.q_a_proj.weight": (qr, H),
                    p + "self_attn.q_a_layernorm.weight": (qr,),
                    p + "self_attn.q_b_proj.weight": (heads * (nope + rope), qr),
                    p + "self_attn.kv_a_proj_with_mqa.weight": (kvr + rope, H),
                    p + "self_attn.kv_a_layernorm.weight": (kvr,),
                    p + "self_attn.kv_b_proj.weight": (heads * (nope + vd), kvr),
                    p + "self_attn.o_proj.weight": (H, heads * vd),
                }
            )
        else:
            hd = cfg.get("head_dim") or H // heads
            kv = cfg["num_key_value_heads"]
            out.update(
                {
                    p + "self_attn.q_proj.weight": (heads * hd, H),
                    p + "self_attn.k_proj.weight": (kv * hd, H),
                    p + "self_attn.v_proj.weight": (kv * hd, H),
                    p + "self_attn.o_proj.weight": (H, heads * hd),
                }
            )
            if arch == "Qwen2ForCausalLM":
                out.update(
                    {
                        p + "self_attn.q_proj.bias": (heads * hd,),
                        p + "self_attn.k_proj.bias": (kv * hd,),
                        p + "self_attn.v_proj.bias": (kv * hd,),
                    }
                )
            if arch == "Qwen3MoeForCausalLM":
                out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})

        def swiglu(prefix, inter, names=("gate_proj", "up_proj", "down_proj")):
            gate, up, down = names
            out.update(
                {
                    prefix + f"{gate}.weight": (inter, H),
                    prefix + f"{up}.weight": (inter, H),
                    prefix + f"{down}.weight": (H, inter),
                }
            )

        if arch == "DeepseekV3ForCausalLM":
            if i >= cfg["first_k_dense_replace"] and i % cfg["moe_layer_freq"] == 0:
                E, mi = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
                for e in range(E):
                    swiglu(p + f"mlp.experts.{e}.", mi)
                out[p + "mlp.gate.weight"] = (E, H)
                out[p + "mlp.gate.e_score_correction_bias"] = (E,)
                fp32.add(p + "mlp.gate.e_score_correction_bias")
                swiglu(p + "mlp.shared_experts.", mi * cfg["n_shared_experts"])
            else:
                swiglu(p + "mlp.", cfg["intermediate_size"])
        elif arch == "Qwen3MoeForCausalLM":
            if i not in cfg["mlp_only_layers"] and (i + 1) % cfg["decoder_sparse_step"] == 0:
                E = cfg["num_experts"]
                for e in range(E):
                    swiglu(p + f"mlp.experts.{e}.", cfg["moe_intermediate_size"])
                out[p + "mlp.gate.weight"] = (E, H)
            else:
                swiglu(p + "mlp.", cfg["intermediate_size"])
        elif arch == "MixtralForCausalLM":
            E = cfg["num_local_experts"]
            for e in range(E):
                swiglu(p + f"block_sparse_moe.experts.{e}.", cfg["intermediate_size"], ("w1", "w3", "w2"))
            out[p + "block_sparse_moe.gate.weight"] = (E, H)
        else:
            swiglu(p + "mlp.", cfg["intermediate_size"])
    return {name: (shape, "float32" if name in fp32 else dtype) for name, shape in out.items()}


def as_dict(tensors):
    return {name: (shape, dtype) for name, shape, dtype in tensors}


# ------------------------------------------------------------------------------------------ registry


def test_list_models_names_every_builtin():
    listed = {short: (hf_id, arch) for short, hf_id, arch in list_models()}
    assert {short: hf_id for short, (hf_id, _) in listed.items()} == BUILTINS
    assert listed["kimi-k2"][1] == "DeepseekV3ForCausalLM"
    assert listed["mixtral-8x7b"][1] == "MixtralForCausalLM"


@pytest.mark.parametrize("short", sorted(BUILTINS))
def test_builtin_resolves_by_every_name(short):
    hf_id = BUILTINS[short]
    reference = resolve_model(short)
    assert reference.name == short and reference.hf_id == hf_id and reference.source_dir is None
    for spelling in (short.upper(), hf_id, hf_id.lower(), hf_id.upper(), hf_id.split("/")[1], f"  {short}  "):
        spec = resolve_model(spelling)
        if short in VARIANTS and spelling.strip().lower() != short:
            assert spec.name == VARIANTS[short] and spec.config_sha256 != reference.config_sha256, spelling
            continue
        assert (spec.name, spec.hf_id, spec.config_sha256) == (short, hf_id, reference.config_sha256), spelling
    assert not any(key.startswith("_shardplan") for key in reference.config)
    assert reference.config_sha256 == config_sha256(reference.config)
    assert reference.architecture == reference.config["architectures"][0]


@pytest.mark.parametrize("short", sorted(KNOWN_FACTS))
def test_builtin_values_match_public_facts(short):
    config = resolve_model(short).config
    for field, value in KNOWN_FACTS[short].items():
        assert config.get(field, config.get("text_config", {}).get(field)) == value, (short, field)
    assert config["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("short", ["kimi-k2", "deepseek-v3"])
def test_deepseek_family_describes_bf16_checkpoint_without_remote_code(short):
    config = resolve_model(short).config
    assert "quantization_config" not in config and "auto_map" not in config
    assert config["model_type"] == "deepseek_v3"  # Kimi's hub "kimi_k2" is unknown to transformers AutoConfig
    assert config["rope_scaling"]["type"] == "yarn"


@pytest.mark.parametrize(
    "short,bf16",
    [("kimi-k2-fp8", "kimi-k2"), ("deepseek-v3-fp8", "deepseek-v3"), ("qwen3-30b-a3b-fp8", "qwen3-30b-a3b")],
)
def test_fp8_builtins_are_the_bf16_config_plus_the_public_quantization_config(short, bf16):
    fp8, base = resolve_model(short).config, resolve_model(bf16).config
    quant = fp8.pop("quantization_config")
    assert fp8 == base
    assert {k: quant[k] for k in ("quant_method", "fmt", "activation_scheme", "weight_block_size")} == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    if short.startswith("qwen3"):  # the LM head and every layer's router stay in BF16, as in the hub config
        assert quant["modules_to_not_convert"] == ["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in range(48)]
    else:
        assert set(quant) == {"quant_method", "fmt", "activation_scheme", "weight_block_size"}


def test_aliases_are_case_insensitive():
    assert resolve_model("KIMI-K2-INSTRUCT").name == "kimi-k2"
    assert resolve_model("Mixtral").name == "mixtral-8x7b"
    assert resolve_model("meta-llama/Meta-Llama-3.1-8B-Instruct").name == "llama-3.1-8b"


def test_unknown_model_lists_builtins_and_local_options():
    with pytest.raises(UnknownModelError) as info:
        resolve_model("gpt-17")
    message = str(info.value)
    assert isinstance(info.value, ShardplanError)
    assert "gpt-17" in message
    for short, hf_id in BUILTINS.items():
        assert short in message and hf_id in message
    assert "config.json" in message and "directory" in message


def test_missing_path_says_so(tmp_path):
    with pytest.raises(UnknownModelError, match="No file or directory"):
        resolve_model(str(tmp_path / "nope" / "config.json"))


# ------------------------------------------------------------------------------------------ broken configs


def write_config(directory: Path, config: dict | str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def test_invalid_json_names_the_file_and_position(tmp_path):
    path = write_config(tmp_path / "ckpt", '{"hidden_size": 8,\n  oops}')
    for spec in (path.parent, path):
        with pytest.raises(ConfigError) as info:
            resolve_model(str(spec))
        assert str(path) in str(info.value) and "line 2" in str(info.value)


# Absent sizes (hidden_size, num_hidden_layers, ...) take the config class's defaults, as in vLLM: see test_configs.py.
@pytest.mark.parametrize("field", ["architectures", "model_type"])
def test_missing_required_field_names_file_and_field(tmp_path, field):
    config = dict(resolve_model("llama-3.1-8b").config)
    del config[field]
    path = write_config(tmp_path / "ckpt", config)
    with pytest.raises(ConfigError) as info:
        resolve_model(str(path))
    assert str(path) in str(info.value) and f"'{field}'" in str(info.value)
    # The same field can be supplied by an override.
    fix = {"architectures": '["LlamaForCausalLM"]', "model_type": "llama"}.get(field, "8")
    assert resolve_model(str(path), [f"{field}={fix}"]).config[field] is not None


def test_wrong_type_and_non_object(tmp_path):
    config = dict(resolve_model("qwen2.5-7b").config, hidden_size="big")
    with pytest.raises(ConfigError, match="'hidden_size' must be a positive integer"):
        resolve_model(str(write_config(tmp_path / "a", config)))
    with pytest.raises(ConfigError, match="JSON object"):
        resolve_model(str(write_config(tmp_path / "b", "[1, 2]")))


def test_directory_without_config(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve_model(str(tmp_path))
    # An output folder named like a built-in does not shadow it; a real checkpoint directory does.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kimi-k2").mkdir()
    assert resolve_model("kimi-k2").hf_id == "moonshotai/Kimi-K2-Instruct"
    write_config(tmp_path / "kimi-k2", resolve_model("llama-3.1-8b").config)
    assert resolve_model("kimi-k2").source_dir == str(tmp_path / "kimi-k2")


# ------------------------------------------------------------------------------------------ overrides


def test_overrides_values_nested_and_dict_form():
    base = resolve_model("kimi-k2")
    spec = resolve_model(
        "kimi-k2",
        [
            "num_hidden_layers=2",
            "rope_scaling.factor=8.0",
            "torch_dtype=float16",
            "eos_token_id=[1, 2]",
            "new_block.inner.x=true",
        ],
    )
    config = spec.config
    assert config["num_hidden_layers"] == 2 and isinstance(config["num_hidden_layers"], int)
    assert config["rope_scaling"]["factor"] == 8.0
    assert config["rope_scaling"]["original_max_position_embeddings"] == 4096  # siblings kept
    assert config["torch_dtype"] == "float16" and config["eos_token_id"] == [1, 2]
    assert config["new_block"] == {"inner": {"x": True}}
    assert spec.config_sha256 != base.config_sha256
    assert resolve_model("kimi-k2").config["num_hidden_layers"] == 61  # the built-in is not modified
    as_dict_form = resolve_model(
        "kimi-k2",
        {
            "num_hidden_layers": 2,
            "rope_scaling.factor": 8.0,
            "torch_dtype": "float16",
            "eos_token_id": [1, 2],
            "new_block.inner.x": True,
        },
    )
    assert as_dict_form.config_sha256 == spec.config_sha256
    assert resolve_model("kimi-k2", "num_hidden_layers=3").config["num_hidden_layers"] == 3  # single string


@pytest.mark.parametrize(
    "override, needle",
    [
        ("foo", "key=value"),
        ("=3", "empty part"),
        ("rope_scaling..factor=2", "empty part"),
        ("num_hidden_layers.x=1", "'num_hidden_layers' is 61"),
    ],
)
def test_bad_overrides(override, needle):
    with pytest.raises(ConfigError) as info:
        resolve_model("kimi-k2", [override])
    assert needle in str(info.value) and override.split("=")[0].split(".")[0] in str(info.value)


def test_override_through_null_and_invalidating_override():
    with pytest.raises(ConfigError, match=r"'rope_scaling' is null, not a mapping.*rope_scaling="):
        resolve_model("qwen3-30b-a3b", ["rope_scaling.factor=4"])
    with pytest.raises(ConfigError, match=r"built-in llama-3.1-8b .*\(after overrides\).*'hidden_size'"):
        resolve_model("llama-3.1-8b", ["hidden_size=0"])


# ------------------------------------------------------------------------------------------ local + materialize


def test_local_dir_and_config_path(tmp_path):
    config = dict(resolve_model("qwen2.5-7b").config, _shardplan={"hf_id": "x", "aliases": []})
    path = write_config(tmp_path / "my-ckpt", config)
    by_dir = resolve_model(str(path.parent))
    assert by_dir.source_dir == str(path.parent.resolve()) and by_dir.name == str(path.parent.resolve())
    assert by_dir.hf_id is None and "_shardplan" not in by_dir.config
    assert by_dir.config_sha256 == resolve_model("qwen2.5-7b").config_sha256
    by_file = resolve_model(str(path), ["num_hidden_layers=3"])
    assert by_file.source_dir is None and by_file.name == str(path.resolve())
    assert by_file.config["num_hidden_layers"] == 3
    assert by_file.origin == str(path.resolve())


def test_materialize_writes_only_config(tmp_path):
    spec = resolve_model("mixtral-8x7b", ["num_hidden_layers=2"])
    out = Path(spec.materialize())
    assert out == tmp_path / "xdg-cache" / "shardplan" / "configs" / spec.config_sha256[:16]
    assert json.loads((out / "config.json").read_text()) == spec.config
    assert spec.materialize() == str(out)  # idempotent
    assert [p.name for p in out.iterdir()] == ["config.json"]

    # A local checkpoint's weights are never copied; materializing into the checkpoint itself is refused.
    ckpt = tmp_path / "ckpt"
    write_config(ckpt, spec.config)
    (ckpt / "model.safetensors").write_bytes(b"\0" * 16)
    local = resolve_model(str(ckpt))
    target = Path(local.materialize(tmp_path / "elsewhere"))
    assert sorted(p.name for p in target.iterdir()) == ["config.json"]
    with pytest.raises(ConfigError, match="overwrite the original config.json"):
        local.materialize(ckpt)


def test_spec_is_hashable_and_frozen():
    spec = resolve_model("llama-3.1-8b")
    assert spec in {spec}
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"
    assert ModelSpec("x", None, {"a": 1}).config_sha256 == config_sha256({"a": 1})


# ------------------------------------------------------------------------------------------ checkpoint tensors


@pytest.mark.parametrize("short", sorted(SHRINK))  # the families expected_tensors knows
def test_checkpoint_tensors_per_expert_names_match_config(short):
    spec = resolve_model(short, SHRINK[short])
    tensors = checkpoint_tensors(spec)
    assert as_dict(tensors) == expected_tensors(spec.config)
    assert [name for name, _, _ in tensors] == sorted(
        (name for name, _, _ in tensors), key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")]
    )
    assert config_sha256(spec.config) == spec.config_sha256  # listing must not modify the config


def test_expert_names_are_hub_names():
    names = {name for name, _, _ in checkpoint_tensors(resolve_model("mixtral-8x7b", SHRINK["mixtral-8x7b"]))}
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names
    assert not any("gate_up_proj" in n or ".mlp." in n for n in names)
    names = {name for name, _, _ in checkpoint_tensors(resolve_model("deepseek-v3", SHRINK["deepseek-v3"]))}
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in names
    assert not any("gate_up_proj" in n for n in names)


def test_dtype_argument_and_float32_bias():
    spec = resolve_model("deepseek-v3", SHRINK["deepseek-v3"])
    dtypes = {name: dtype for name, _, dtype in checkpoint_tensors(spec, dtype="float16")}
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == "float32"
    assert {d for n, d in dtypes.items() if not n.endswith("e_score_correction_bias")} == {"float16"}
    import torch

    assert checkpoint_tensors(spec, dtype=torch.float16) == checkpoint_tensors(spec, dtype="float16")
    with pytest.raises(ShardplanError, match="Unknown dtype"):
        checkpoint_tensors(spec, dtype="bfloat17")


def test_tied_embeddings_have_no_lm_head():
    spec = resolve_model("qwen2.5-7b", ["num_hidden_layers=1", "tie_word_embeddings=true"])
    names = {name for name, _, _ in checkpoint_tensors(spec)}
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert as_dict(checkpoint_tensors(spec)) == expected_tensors(spec.config)


def test_mtp_layers_only_on_request():
    spec = resolve_model("deepseek-v3", SHRINK["deepseek-v3"])
    without = as_dict(checkpoint_tensors(spec))
    with_mtp = as_dict(checkpoint_tensors(spec, include_mtp=True))
    assert not any(n.startswith("model.layers.2.") for n in without)
    extra = {n: v for n, v in with_mtp.items() if n not in without}
    H, V = 7168, 129280
    assert extra["model.layers.2.eh_proj.weight"] == ((H, 2 * H), "bfloat16")
    assert extra["model.layers.2.shared_head.head.weight"] == ((V, H), "bfloat16")
    for part in ("enorm", "hnorm", "shared_head.norm"):
        assert extra[f"model.layers.2.{part}.weight"] == ((H,), "bfloat16")
    assert extra["model.layers.2.embed_tokens.weight"] == ((V, H), "bfloat16")
    # The MTP block itself is a MoE decoder layer, like the main layer 1.
    assert extra["model.layers.2.mlp.experts.3.down_proj.weight"] == ((H, 2048), "bfloat16")
    assert extra["model.layers.2.mlp.gate.e_score_correction_bias"] == ((4,), "float32")
    assert set(with_mtp) - set(without) == set(extra) and len(extra) == 6 + len(
        [n for n in without if n.startswith("model.layers.1.")]
    )
    assert checkpoint_tensors(resolve_model("kimi-k2", SHRINK["kimi-k2"]), include_mtp=True) == checkpoint_tensors(
        resolve_model("kimi-k2", SHRINK["kimi-k2"])
    )  # Kimi-K2 ships no MTP layers


def test_hub_model_type_kimi_k2_and_unknown_model_type(tmp_path):
    # A downloaded Kimi-K2 config says model_type "kimi_k2": it is listed as the DeepSeek-V3 it is built on.
    config = dict(resolve_model("kimi-k2", SHRINK["kimi-k2"]).config, model_type="kimi_k2")
    spec = resolve_model(str(write_config(tmp_path / "k2", config)))
    assert spec.config["model_type"] == "kimi_k2"
    assert as_dict(checkpoint_tensors(spec)) == expected_tensors(config)
    with pytest.raises(ConfigError, match="field 'model_type' is 'bogus'"):
        checkpoint_tensors(resolve_model(spec.name, ["model_type=bogus"]))


def test_kimi_k2_full_size_count_and_cache():
    import torch  # noqa: F401  imports are not part of the call being timed
    import transformers.core_model_loading  # noqa: F401

    spec = resolve_model("kimi-k2")
    checkpoint._META_CACHE.clear()
    tensors = checkpoint_tensors(spec)
    cfg = spec.config
    dense_layers = cfg["first_k_dense_replace"]
    moe_layers = cfg["num_hidden_layers"] - dense_layers
    attention = 7  # q_a, q_a_norm, q_b, kv_a_with_mqa, kv_a_norm, kv_b, o
    per_dense = attention + 2 + 3  # + two layer norms + gate/up/down
    per_moe = attention + 2 + 3 * cfg["n_routed_experts"] + 2 + 3  # + router weight, bias + shared expert
    assert len(tensors) == 3 + dense_layers * per_dense + moe_layers * per_moe == 69975
    # cached per config sha (speed: bench/compile_bench.py; a timed test would fail on a loaded box)
    assert checkpoint_tensors(spec) is tensors or checkpoint_tensors(spec) == tensors
    assert len(checkpoint._META_CACHE) == 1


# ------------------------------------------------------------------------------------------ safetensors

TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=32,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)


def write_tiny_checkpoint(directory: Path, with_index: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """Two shards of a tiny Llama; norms stored in float32 as some real checkpoints do."""
    import torch
    from safetensors.torch import save_file

    write_config(directory, TINY_LLAMA)
    expected = {
        name: (shape, "float32" if "norm" in name else "bfloat16")
        for name, (shape, _) in expected_tensors(TINY_LLAMA).items()
    }
    shards = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for name, (shape, dtype) in expected.items():
        shard = "model-00001-of-00002.safetensors" if ".layers.1." not in name else "model-00002-of-00002.safetensors"
        shards[shard][name] = torch.zeros(shape, dtype=getattr(torch, dtype))
    for shard, tensors in shards.items():
        save_file(tensors, str(directory / shard), metadata={"format": "pt"})
    if with_index:
        weight_map = {name: shard for shard, tensors in shards.items() for name in tensors}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return expected


def test_read_safetensors_header(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file(
        {
            "a.weight": torch.zeros(3, 4, dtype=torch.bfloat16),
            "b": torch.zeros(5, dtype=torch.float32),
            "c": torch.zeros((), dtype=torch.int64),
        },
        str(tmp_path / "t.safetensors"),
        metadata={"k": "v"},
    )
    assert read_safetensors_header(tmp_path / "t.safetensors") == {
        "a.weight": ((3, 4), "bfloat16"),
        "b": ((5,), "float32"),
        "c": ((), "int64"),
    }
    (tmp_path / "short.safetensors").write_bytes(b"abc")
    with pytest.raises(ConfigError, match="short.safetensors"):
        read_safetensors_header(tmp_path / "short.safetensors")
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(ConfigError, match="huge.safetensors.*truncated"):
        read_safetensors_header(tmp_path / "huge.safetensors")


@pytest.mark.parametrize("with_index", [True, False])
def test_checkpoint_tensors_from_local_safetensors(tmp_path, with_index):
    expected = write_tiny_checkpoint(tmp_path / "ckpt", with_index)
    spec = resolve_model(str(tmp_path / "ckpt"))
    assert as_dict(checkpoint_tensors(spec, dtype="float16")) == expected  # on-disk dtypes win
    shrunk = resolve_model(str(tmp_path / "ckpt"), ["num_hidden_layers=1"])
    assert as_dict(checkpoint_tensors(shrunk)) == {n: v for n, v in expected.items() if ".layers.1." not in n}


def test_index_without_shards_takes_shapes_from_config(tmp_path):
    ckpt = tmp_path / "ckpt"
    expected = write_tiny_checkpoint(ckpt, with_index=True)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    listed = as_dict(checkpoint_tensors(resolve_model(str(ckpt))))
    assert set(listed) == set(expected)
    for name, (shape, dtype) in listed.items():
        # Layer 1's shard is gone: its shapes come from the model, its dtype is the requested one.
        assert (shape, dtype) == ((expected[name][0], "bfloat16") if ".layers.1." in name else expected[name])

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.1.self_attn.q_proj.weight_scale_inv"] = "model-00002-of-00002.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"model.safetensors.index.json.*weight_scale_inv.*shard files"):
        checkpoint_tensors(resolve_model(str(ckpt)))


# ------------------------------------------------------------------------------------------ acceptance


@pytest.mark.parametrize("short", sorted(BUILTINS))
def test_transformers_accepts_materialized_config(short):
    from transformers import AutoConfig

    spec = resolve_model(short)
    hf_config = AutoConfig.from_pretrained(spec.materialize())
    # Qwen3_5MoeTextConfig for qwen3_5_moe_text: compared without underscores on both sides; vLLM registers
    # DeepseekV3Config for deepseek_v32 (names then come from its own class: checkpoint.transformers_config)
    got, model_type = type(hf_config).__name__.lower().replace("_", ""), spec.config["model_type"]
    assert got.startswith(model_type.replace("_", "")) or got == {"deepseek_v32": "deepseekv3config"}.get(model_type)
    text, spelled = hf_config.get_text_config(), spec.config.get("text_config", spec.config)
    assert text.hidden_size == spelled["hidden_size"]
    assert text.num_hidden_layers == spelled["num_hidden_layers"]


def test_vllm_accepts_every_builtin(monkeypatch):
    from vllm.config import ModelConfig
    from vllm.model_executor.models import registry

    # On a cold vLLM cache the first ModelConfig per architecture inspects the model class in a fresh Python
    # subprocess (there only to keep CUDA uninitialised; ~7 s each). This CPU-only test inspects in-process.
    if hasattr(registry, "_run_in_subprocess"):
        monkeypatch.setattr(registry, "_run_in_subprocess", lambda fn: fn())

    specs = [resolve_model(short) for short in sorted(BUILTINS)]
    dirs = [spec.materialize() for spec in specs]

    def build(model_dir):
        return ModelConfig(
            model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024, enforce_eager=True
        )

    for spec, model_dir in zip(specs, dirs):
        model_config = build(model_dir)
        assert model_config.architectures == spec.config["architectures"]
        spelled = spec.config.get("text_config", spec.config)
        assert model_config.hf_text_config.num_hidden_layers == spelled["num_hidden_layers"]
        assert model_config.get_vocab_size() == spelled["vocab_size"]


def test_names_cache_on_disk_is_used_checked_and_rebuilt(tmp_path, monkeypatch):
    """The checkpoint name list is kept on disk (the recording's own fixed cost): a hit returns the same list without a
    build, a corrupt or malformed entry is rebuilt, another config or transformers version is another entry, and
    SHARDPLAN_NAMES_CACHE=0 keeps nothing."""
    monkeypatch.setenv("SHARDPLAN_NAMES_CACHE", "1")  # tests/conftest.py turns it off for every other test
    spec = resolve_model("qwen3-30b-a3b", ["num_hidden_layers=2", "num_experts=4"])
    checkpoint._META_CACHE.clear()
    built = checkpoint_tensors(spec)
    entries = list((tmp_path / "xdg-cache" / "shardplan" / "names").glob("*.json"))
    assert len(entries) == 1
    builds = []
    real = checkpoint.on_disk_tensors
    monkeypatch.setattr(checkpoint, "on_disk_tensors", lambda *a, **k: builds.append(1) or real(*a, **k))
    checkpoint._META_CACHE.clear()
    assert checkpoint_tensors(spec) == built and builds == []  # from disk, no build
    for bad in (
        "{not json",
        json.dumps({"format": 1, "tensors": [["a", [2, -1], None]]}),
        json.dumps({"format": 99, "tensors": [["a", [2], None]]}),
        json.dumps([1, 2]),
    ):
        entries[0].write_text(bad)
        checkpoint._META_CACHE.clear()
        assert checkpoint_tensors(spec) == built  # rebuilt, and the entry rewritten whole
        assert json.loads(entries[0].read_text())["format"] == checkpoint._NAMES_CACHE_FORMAT
    assert len(builds) == 4
    other = resolve_model("qwen3-30b-a3b", ["num_hidden_layers=2", "num_experts=2"])
    checkpoint._META_CACHE.clear()
    assert checkpoint_tensors(other) != built
    import transformers

    monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".other")
    checkpoint._META_CACHE.clear()
    assert checkpoint_tensors(spec) == built
    assert len(list(entries[0].parent.glob("*.json"))) == 3 and len(builds) == 6
    monkeypatch.setenv("SHARDPLAN_NAMES_CACHE", "0")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "elsewhere"))
    checkpoint._META_CACHE.clear()
    assert checkpoint_tensors(spec) == built and not (tmp_path / "elsewhere").exists()


def _record_body(spec_args: list[str]) -> bytes:
    from shardplan.plan.layout import Layout
    from shardplan.record.session import RecordSession

    session = RecordSession("qwen3-30b-a3b", Layout(tp=2), overrides=spec_args)
    return session.encode(session.record_plans(range(2)).body)


def test_names_cache_entries_are_sealed_and_any_edit_is_rebuilt(tmp_path, monkeypatch):
    """Each entry holds its full key and a sha256 over key and rows: every edit below (a dropped norm, a changed shape
    or dtype, swapped names, an entry under another key's file name, a forged key or seal, an extra field) reads as a
    miss, is rebuilt and rewritten, and the plan recorded through the edited cache equals the uncached one."""
    monkeypatch.setenv("SHARDPLAN_NAMES_CACHE", "1")
    overrides = ["num_hidden_layers=2", "num_experts=4"]
    spec = resolve_model("qwen3-30b-a3b", overrides)
    checkpoint._META_CACHE.clear()
    built = checkpoint_tensors(spec)
    (entry,) = (tmp_path / "xdg-cache" / "shardplan" / "names").glob("*.json")
    pristine = json.loads(entry.read_text())
    other = resolve_model("qwen3-30b-a3b", ["num_hidden_layers=2", "num_experts=2"])
    checkpoint._META_CACHE.clear()
    checkpoint_tensors(other)
    (other_entry,) = set(entry.parent.glob("*.json")) - {entry}
    rows = pristine["tensors"]
    norm = next(i for i, r in enumerate(rows) if r[0].endswith("input_layernorm.weight"))
    resealed = lambda e: {**e, "sha256": checkpoint._names_seal(e["key"], e["tensors"])}  # noqa: E731

    def edited(fn):
        e = json.loads(json.dumps(pristine))
        fn(e)
        return e

    edits = {
        "norm dropped": edited(lambda e: e["tensors"].pop(norm)),
        "shape changed": edited(lambda e: e["tensors"][norm][1].__setitem__(0, 7)),
        "dtype changed": edited(lambda e: e["tensors"][norm].__setitem__(2, "float32")),
        "names swapped": edited(
            lambda e: e["tensors"].__setitem__(
                slice(0, 2), [[e["tensors"][1][0]] + e["tensors"][0][1:], [e["tensors"][0][0]] + e["tensors"][1][1:]]
            )
        ),
        "row duplicated": edited(lambda e: e["tensors"].append(e["tensors"][norm])),
        "seal edited": edited(lambda e: e.__setitem__("sha256", "0" * 64)),
        "extra field": edited(lambda e: e.__setitem__("note", 1)),
        "other key, resealed": resealed(edited(lambda e: e.__setitem__("key", "f" * 64))),
        "norm dropped, resealed under the other key": resealed(
            edited(lambda e: (e["tensors"].pop(norm), e.__setitem__("key", json.loads(other_entry.read_text())["key"])))
        ),
        "another config's entry": json.loads(other_entry.read_text()),
    }
    builds = []
    real = checkpoint.on_disk_tensors
    monkeypatch.setattr(checkpoint, "on_disk_tensors", lambda *a, **k: builds.append(1) or real(*a, **k))
    for i, (what, content) in enumerate(edits.items()):
        entry.write_text(json.dumps(content))
        checkpoint._META_CACHE.clear()
        assert checkpoint_tensors(spec) == built, what
        assert len(builds) == i + 1, f"{what}: served from the edited entry"
        assert json.loads(entry.read_text()) == pristine, f"{what}: not rewritten whole"
    checkpoint._META_CACHE.clear()
    assert checkpoint_tensors(spec) == built and len(builds) == len(edits)  # the rewritten entry is a hit
    # a plan recorded through an edited entry is the plan recorded without the cache
    entry.write_text(json.dumps(edits["norm dropped"]))
    checkpoint._META_CACHE.clear()
    cached = _record_body(overrides)
    monkeypatch.setenv("SHARDPLAN_NAMES_CACHE", "0")
    checkpoint._META_CACHE.clear()
    assert cached == _record_body(overrides)
