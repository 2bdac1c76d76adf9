"""A checkpoint's tensors (name, shape, dtype) in the hub's on-disk naming, with or without the checkpoint.

`checkpoint_tensors` reads safetensors headers (or the index) when a local checkpoint is given, and otherwise derives
the list from the config alone (`on_disk_tensors`). It is what a trainer holds and what vLLM's weight loaders consume.

The reference for "on-disk naming" is what transformers itself writes: `save_pretrained` takes the model's
state_dict, drops `_keys_to_ignore_on_save`, removes tied weights (keeping the name the model reloads from) and
reverts transformers 5's load-time conversions (Mixtral's per-expert w1/w3 fused into gate_up_proj at load is split
back; GPT-OSS and Llama 4, whose hub files are fused, stay fused because no conversion applies). `on_disk_tensors` runs
exactly those steps on a model built on the meta device, so it costs no memory and needs no weights; the test suite
checks it against real `save_pretrained` output for every architecture of the coverage sweep.

Dtypes: the model is built in bfloat16; a tensor that transformers keeps in float32 anyway (`_keep_in_fp32_modules`,
float32 buffers) is reported as float32, as save_pretrained writes it. DeepSeek-V3-style routers keep their
e_score_correction_bias in float32 in the released checkpoints too.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import struct
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from shardplan.errors import ShardplanError
from shardplan.models import ConfigError, ModelSpec, _cache_root, _read_json_object, config_sha256
from shardplan.record import configs, remote
from shardplan.record.configs import hf_view

__all__ = ["NamesError", "TensorInfo", "checkpoint_tensors", "on_disk_tensors", "read_safetensors_header"]

# Tensors the real checkpoints store in float32 whatever the model dtype, keyed by architecture (beyond those
# transformers itself keeps in float32). DeepSeek-V3 and Kimi-K2 keep the router's score-correction bias in float32.
FLOAT32_ON_DISK: dict[str, tuple[str, ...]] = {
    "DeepseekV3ForCausalLM": ("e_score_correction_bias",),
    # DeepSeek-V4's released headers (public inventories of deepseek-ai/DeepSeek-V4-Flash: attn_sink, the
    # hyper-connection mixers and the router bias are F32)
    "DeepseekV4ForCausalLM": (
        ".attn_sink",
        "_fn",
        "_base",
        "_scale",
        ".ffn.gate.bias",
    ),
    # Qwen3.5's Gated DeltaNet keeps A_log and its gated norm in F32 in the released headers (public header catalogs
    # of the released Qwen3.5 checkpoints: A_log and linear_attn.norm.weight F32, dt_bias BF16)
    "Qwen3_5MoeForConditionalGeneration": (".linear_attn.A_log", ".linear_attn.norm.weight"),
    # tencent/Hy4-preview's headers (a public bring-up study that read its index and all 131 shard headers: "BF16,
    # plus F32 for the hyper-connection parameters, sinks and router bias")
    "HYV4ForCausalLM": ("_fn", "_base", "_scale", ".learnable_sink_param", ".e_score_correction_bias"),
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
# (on-disk name, shape, fixed dtype): the dtype a tensor is stored in whatever the model dtype (float32 kept by
# transformers or the released checkpoints, integer tables), None for tensors stored in the model dtype
MetaTensor = tuple[str, tuple[int, ...], "str | None"]


class NamesError(ShardplanError):
    """The checkpoint names of a config cannot be derived: the message names the file, architecture and the fix."""


def on_disk_tensors(view, include_mtp: bool = False) -> tuple[MetaTensor, ...]:
    """(on-disk name, shape, fixed dtype or None) for the model `view` (a record.configs.HFView) describes, naturally
    sorted.

    include_mtp: also DeepSeek-V3's multi-token-prediction layers (num_nextn_predict_layers, stored as
    model.layers.<num_hidden_layers + k>), which transformers does not build."""
    text = view.text_config
    num_layers = int(text.num_hidden_layers)
    num_mtp = int(getattr(text, "num_nextn_predict_layers", 0) or 0) if include_mtp else 0
    hf_config = copy.deepcopy(view.hf_config)
    if num_mtp:
        # Each MTP layer is an ordinary decoder layer (dense or MoE by the same rule as the main stack) plus a few
        # extras, so building num_mtp more layers yields its body.
        hf_config.get_text_config().num_hidden_layers = num_layers + num_mtp
    saved = saved_state(hf_config, view.spec.architecture, view.spec.origin)
    hidden, vocab = int(text.hidden_size), int(text.vocab_size)
    for layer in range(num_layers, num_layers + num_mtp):
        # DeepSeek-V3's on-disk MTP extras (as its inference code and vLLM's deepseek_mtp loader name them).
        prefix = f"model.layers.{layer}."
        saved.update(
            {
                prefix + "embed_tokens.weight": ((vocab, hidden), None),
                prefix + "enorm.weight": ((hidden,), None),
                prefix + "hnorm.weight": ((hidden,), None),
                prefix + "eh_proj.weight": ((hidden, 2 * hidden), None),
                prefix + "shared_head.norm.weight": ((hidden,), None),
                prefix + "shared_head.head.weight": ((vocab, hidden), None),
            }
        )
    extra = DISK_ONLY_TENSORS.get(view.spec.architecture)
    if extra is not None:
        saved.update({name: (shape, None) for name, shape in extra(text, saved).items()})
    fp32_suffixes = FLOAT32_ON_DISK.get(view.spec.architecture, ())
    return tuple(
        (name, shape, "float32" if name.endswith(fp32_suffixes) else fixed)
        for name, (shape, fixed) in ((n, saved[n]) for n in natural_sorted(saved))
    )


def natural_sorted(names) -> list[str]:
    """layers.10 after layers.9, experts.100 after experts.99: the order a human (and the hub index) expects."""
    try:
        return sorted(names, key=lambda name: tuple(int(p) if p.isdigit() else p for p in name.split(".")))
    except TypeError:  # a number and a word at the same place (h.0 vs h.ln): numbers first
        return sorted(
            names, key=lambda name: tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))
        )


def model_class(architecture: str, hf_config):
    """The transformers class save_pretrained would run for this architecture: the class of that name when
    transformers has one (GPT2LMHeadModel, Llama4ForCausalLM), else the causal-LM class registered for the config."""
    import transformers
    from transformers import AutoModelForCausalLM

    cls = getattr(transformers, architecture, None)
    if (
        isinstance(cls, type)
        and hasattr(cls, "from_pretrained")
        and hasattr(cls, "config_class")
        and isinstance(hf_config, cls.config_class or object)
    ):
        return cls
    return AutoModelForCausalLM._model_mapping[type(hf_config)]


def transformers_config(hf_config, architecture: str):
    """`hf_config` as transformers' own config class: that of the transformers class named `architecture`, else
    the one for its model_type. vLLM reads some models with its own classes (DeepseekV4Config, KimiLinearConfig,
    InklingModelConfig) or another model's (DeepSeek-V3.2 with DeepseekV3Config, whose model class has no DSA
    indexer), and transformers' model classes are built from their own config classes only. Unchanged where
    transformers has no class of its own."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    own = getattr(getattr(transformers, architecture, None), "config_class", None)
    if not isinstance(own, type):
        if type(hf_config).__module__.startswith("transformers."):
            return hf_config
        own = getattr(transformers, CONFIG_MAPPING_NAMES.get(getattr(hf_config, "model_type", ""), ""), None)
    if not isinstance(own, type) or isinstance(hf_config, own):
        return hf_config
    fields = {k: v for k, v in hf_config.to_dict().items() if k != "model_type"}
    try:
        return own.from_dict(fields)
    except Exception:  # a field vLLM's class leaves None where transformers' wants its own default
        return own.from_dict({k: v for k, v in fields.items() if v is not None})


def saved_state(hf_config, architecture: str, origin: str) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """save_pretrained's state_dict steps on a meta-device model (built in bfloat16): name -> (shape, fixed dtype),
    the fixed dtype being the tensor's own where it is not bfloat16 (float32 kept by transformers, integer tables)."""
    import transformers
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    by_hand = _LISTED_FROM_RELEASED_CODE.get(getattr(hf_config, "model_type", ""))
    if by_hand is not None and remote.model_class(hf_config) is None:
        return {name: (shape, None) for name, shape in by_hand(hf_config).items()}
    try:
        cls = remote.model_class(hf_config)  # the trusted directory's code (--trust-remote-code), else transformers'
        inside = _TEXT_INSIDE.get(getattr(hf_config, "model_type", ""))
        if cls is None and inside is not None:
            hf_config = transformers_config(hf_config, architecture)
            hf_config = getattr(transformers, inside[0])(text_config=hf_config.to_dict())
            cls = getattr(transformers, inside[1])
        elif cls is None:
            hf_config = transformers_config(hf_config, architecture)
            try:
                cls = model_class(architecture, hf_config)
            except KeyError:  # no transformers class of that name, none registered for the config class
                raise NamesError(
                    f"{origin}: transformers {transformers.__version__} has no model class for {architecture} "
                    f"(model_type {getattr(hf_config, 'model_type', '?')!r}), text or multimodal, so its checkpoint "
                    f"names cannot be derived from the config alone. Point at a checkpoint directory with "
                    f"safetensors files or a model.safetensors.index.json so the names are read from it."
                ) from None
        with torch.device("meta"):
            model = cls._from_config(hf_config, dtype=torch.bfloat16)
    except NamesError:
        raise
    except Exception as exc:  # transformers raises ValueError/KeyError/TypeError/AttributeError for bad configs
        raise NamesError(
            f"{origin}: transformers {transformers.__version__} cannot build {architecture} "
            f"(model_type {getattr(hf_config, 'model_type', '?')!r}) from this config, so its checkpoint names "
            f"cannot be derived: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}. Fix the config field named "
            f"there, or point at a checkpoint directory with safetensors files or a model.safetensors.index.json so "
            f"the names are read from it."
        ) from exc
    state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)
    towers = _STORED_AS_BUILT.get(getattr(hf_config, "model_type", ""), ())
    state = {n: t for n, t in state.items() if not n.startswith(towers)} if towers else state
    reverted = _revert(model, state)
    if inside is not None:  # the multimodal class's other towers, which a text-only checkpoint does not have
        state = {n: t for n, t in state.items() if not n.startswith(inside[2])}
        reverted = {n: t for n, t in reverted.items() if not n.startswith(inside[3])}
    before, after = sum(t.numel() for t in state.values()), sum(t.numel() for t in reverted.values())
    if before != after and getattr(hf_config, "model_type", "") not in _DISK_NAME_FIXUPS:
        raise NamesError(
            f"{origin}: transformers {transformers.__version__}'s conversion of {architecture}'s parameters back to "
            f"checkpoint names changed the element count from {before} to {after}, so the names it gives cannot be "
            f"trusted. Point at a checkpoint directory with safetensors files or an index so the real names are read."
        )
    return {
        name: (tuple(t.shape), None if t.dtype == torch.bfloat16 else str(t.dtype).removeprefix("torch."))
        for name, t in reverted.items()
    }


# On-disk names transformers' revert does not give back, by model_type: name -> new name, or None to drop it.
def _kimi_linear_disk_name(name: str, config) -> str | None:
    # the load-time renaming `block_sparse_moe.` -> `mlp.` also catches the dense first layer, whose tensors the
    # released checkpoint stores as `mlp.{gate,up,down}_proj` (moonshotai/Kimi-Linear-48B-A3B-Instruct)
    return re.sub(r"^(model\.layers\.\d+\.)block_sparse_moe\.(gate_proj|up_proj|down_proj)\.", r"\1mlp.\2.", name)


def _longcat_flash_disk_name(name: str, config) -> str | None:
    # transformers allocates gate_up rows for the zero (identity) experts too; no checkpoint stores those
    match = re.search(r"\.mlp\.experts\.(\d+)\.", name)
    return None if match and int(match.group(1)) >= int(config.n_routed_experts) else name


_DEEPSEEK_V4_NAMES = (
    (re.compile(r"^model\.embed_tokens\."), "embed."),
    (re.compile(r"^model\.hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    (re.compile(r"^model\.(layers\.\d+\.attn)\.norm\."), r"\1.kv_norm."),
    (re.compile(r"^model\."), ""),
)


def _deepseek_v4_disk_name(name: str, config) -> str | None:
    # DeepSeek-V4 ships its reference implementation's names with no model. prefix (embed.weight, hc_head_fn,
    # layers.N.attn.kv_norm.weight, as in public inventories of the released headers and vLLM's deepseek_v4 weight
    # mapper); transformers' revert keeps its module prefix and turns attn.kv_norm into attn.norm
    for pattern, disk in _DEEPSEEK_V4_NAMES:
        name = pattern.sub(disk, name, count=1)
    return name


_INKLING_TEXT_PREFIXES = (
    ("model.embed_tokens.embed_norm.", "model.llm.embed_norm."),
    ("model.embed_tokens.", "model.llm.embed."),
    ("model.layers.", "model.llm.layers."),
    ("model.norm.", "model.llm.norm."),
    ("lm_head.", "model.llm.unembed."),
)


def _inkling_disk_name(name: str, config) -> str | None:
    # the released Inkling checkpoints keep the text backbone under model.llm.* (transformers' inkling_mm_model
    # conversion renames model.llm.{layers,embed,embed_norm,norm,unembed}; vLLM's InklingForCausalLM maps the same
    # names back); the inside of each layer comes back through that conversion's own reverse (_CONVERSION_OF)
    for prefix, disk in _INKLING_TEXT_PREFIXES:
        if name.startswith(prefix):
            return disk + name[len(prefix) :]
    return name


_HY_V4_NAMES = (
    # transformers' hy_v4 conversion is rename-only, but its reverse is ambiguous: `.hc_pre.hc_` -> `.hc_` comes back
    # as an hc_pre. in front of the module, and `.linear_gate` -> `.gate_proj` also catches the MLPs' gate_proj
    (re.compile(r"^model\.hc_pre\.hc_head\."), "model.hc_head."),
    (re.compile(r"^(model\.layers\.\d+)\.hc_pre\.(hc_attn_layer|hc_mlp_layer)\."), r"\1.\2.hc_pre."),
    (re.compile(r"\.mlp\.(shared_experts\.)?linear_gate\."), r".mlp.\1gate_proj."),
)


def _hy_v4_disk_name(name: str, config) -> str | None:
    # tencent/Hy4-preview's names (vLLM's GGUF plugin's HY V4 name map, test_name_map: model.hc_head.hc_head_fn,
    # model.layers.N.hc_attn_layer.hc_pre.hc_fn, mlp.gate_proj, mlp.shared_experts.gate_proj, self_attn.linear_gate;
    # vLLM's hy_v4 loader appends .weight to hc_fn / hc_head_fn itself)
    for pattern, disk in _HY_V4_NAMES:
        name = pattern.sub(disk, name, count=1)
    return name


_DISK_NAME_FIXUPS = {
    "kimi_linear": _kimi_linear_disk_name,
    "hy_v4": _hy_v4_disk_name,
    "longcat_flash": _longcat_flash_disk_name,
    "inkling_text": _inkling_disk_name,
    "deepseek_v4": _deepseek_v4_disk_name,
}


# Tensors the released checkpoints store that transformers' class does not build, by architecture: (text config,
# the names listed so far) -> {name: shape}, stored in the model dtype.
def _axk1_disk_only(config, listed) -> dict[str, tuple[int, ...]]:
    # skt/A.X-K1 stores post_mlp_layernorm at the decoder-layer level on every layer, its dense first layer's too
    # (public inventory of the released model.safetensors.index.json, 976 names: pjordanandrsn/experts4bit-qlora
    # experts4bit_qlora/arch/axk1.py and its test pinning that list); transformers builds the norm on MoE layers only
    # (and drops layer 0's as unexpected), vLLM's AXK1DecoderLayer on every layer and loads it from that name
    names = (f"model.layers.{i}.post_mlp_layernorm.weight" for i in range(int(config.num_hidden_layers)))
    return {name: (int(config.hidden_size),) for name in names if name not in listed}


def _longcat_ngram_disk_only(config, listed) -> dict[str, tuple[int, ...]]:
    # LongCat-Flash-Lite's n-gram embedding, which transformers' LongcatFlash class does not have: k * (n - 1) tables
    # of ratio * vocab + 2i + 1 rows and hidden // (k * (n - 1)) columns, each with a bias-free projection back to
    # hidden (the hub's own modeling_longcat_ngram.py, NgramEmbedding._init_ngram_embeddings; a public inventory of
    # the released index: 12 embedders.i.weight [10223616+2i+1, 256] and 12 post_projs.i.weight [3072, 256]; vLLM's
    # longcat_flash_ngram NgramEmbedding.load_weight reads exactly these names and asserts the rows)
    if getattr(config, "ngram_vocab_size_ratio", None) is None:
        return {}
    tables = int(config.emb_split_num) * (int(config.emb_neighbor_num) - 1)
    hidden, rows = int(config.hidden_size), int(config.ngram_vocab_size_ratio) * int(config.vocab_size)
    prefix = "model.ngram_embeddings."
    out = {f"{prefix}embedders.{i}.weight": (rows + 2 * i + 1, hidden // tables) for i in range(tables)}
    out.update({f"{prefix}post_projs.{i}.weight": (hidden, hidden // tables) for i in range(tables)})
    return out


DISK_ONLY_TENSORS = {
    "AXK1ForCausalLM": _axk1_disk_only,
    "LongcatFlashNgramForCausalLM": _longcat_ngram_disk_only,
}
# model_types whose transformers text model exists only inside a multimodal class (Step3.5: Step3p7's language model,
# whose conversion gives back the released text names model.{embed_tokens,layers,norm}.*): its config class, its model
# class, and the other towers' names before and after the revert, dropped
_TEXT_INSIDE = {
    "step3p5": (
        "Step3p7Config",
        "Step3p7ForConditionalGeneration",
        ("model.vision_model.", "model.multi_modal_projector."),
        ("vision_model.", "vit_large_projector."),
    )
}
# model_types whose released checkpoints store the language model as transformers' multimodal class holds it, so no
# load-time conversion is reverted: Qwen3.5 MoE keeps model.language_model.* with routed experts fused
# (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]: NVIDIA Megatron-Bridge's Qwen35VLMoEBridge maps exactly
# these for Qwen/Qwen3.5-397B-A17B), while transformers' revert would split them per expert. Value: the prefixes of
# the towers vLLM serves without (`--language-model-only`: the vision tower is not built and its tensors are dropped
# by name, as is the MTP layer, which transformers does not build)
_STORED_AS_BUILT = {"qwen3_5_moe": ("model.visual.",)}
# model_types whose text-only transformers class has no load-time conversion of its own while the released
# checkpoints are stored as those of the multimodal sibling: that sibling's conversion is reverted instead
_CONVERSION_OF = {"inkling_text": "inkling_mm_model"}


def _olmo_hybrid_released_state(model, state: dict) -> dict:
    # allenai/Olmo-Hybrid-7B stores the model's own names (open-instruct's olmo_core_hybrid.py key maps, "taken from
    # allenai/Olmo-Hybrid-7B itself", 523 of 523 tensors) with the conv split per q/k/v at key, key, value channels;
    # transformers' revert gives OLMo-core's attention_layer_norm / feedforward_layer_norm and three equal chunks
    out = {}
    for name, tensor in state.items():
        if name.endswith(".linear_attn.conv1d.weight"):
            mixer = model.get_submodule(name.removesuffix(".conv1d.weight"))
            parts = tensor.split([mixer.key_dim, mixer.key_dim, mixer.value_dim])
            out |= {name.replace(".conv1d.", f".{k}_conv1d."): part for k, part in zip("qkv", parts)}
        else:
            out[name] = tensor
    return out


def _step3_text_names(config) -> dict[str, tuple[int, ...]]:
    # no transformers class: the names of StepFun's hub modeling_step3.py (public copies; it only moves the released
    # model.* under model.language_model.*, as the model card's key_mapping says), which vLLM's and SGLang's Step3
    # loaders read: low-rank query (inter_norm, wq), one kv head, stacked experts [E, I, H] / [E, H, I], share_expert
    h, v, layers = int(config.hidden_size), int(config.vocab_size), int(config.num_hidden_layers)
    q, d, heads = int(config.share_q_dim), int(config.head_dim), int(config.num_attention_heads)
    e, i = int(config.moe_num_experts), int(config.moe_intermediate_size)
    enum = getattr(config, "moe_layers_enum", None)
    moe = {int(x) for x in str(enum).split(",") if x.strip()} if enum is not None else set(range(1, layers))
    attn = {"q_proj": (q, h), "k_proj": (d, h), "v_proj": (d, h), "inter_norm": (q,), "wq": (heads * d, q)}
    common = {f"self_attn.{k}": s for k, s in attn.items()} | {"self_attn.o_proj": (h, heads * d)}
    common |= {"input_layernorm": (h,), "post_attention_layernorm": (h,)}
    routed = {"moe.gate": (e, h), "moe.gate_proj": (e, i, h), "moe.up_proj": (e, i, h), "moe.down_proj": (e, h, i)}
    names = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(layers):
        mlp, w = ("share_expert", config.share_expert_dim) if n in moe else ("mlp", config.intermediate_size)
        ffn = {f"{mlp}.{k}_proj": (int(w), h) for k in ("gate", "up")} | {f"{mlp}.down_proj": (h, int(w))}
        parts = common | ffn | (routed if n in moe else {})
        names |= {f"model.layers.{n}.{k}.weight": s for k, s in parts.items()}
    return names


# model_types with no transformers class whose released model code is public: config -> name -> shape
_LISTED_FROM_RELEASED_CODE = {"step3_text": _step3_text_names}
# model_types whose released names transformers' revert does not give back: (model, state_dict) -> released state
_RELEASED_STATE = {"olmo_hybrid": _olmo_hybrid_released_state}


def use_sibling_conversion(model) -> None:
    """Give `model` its multimodal sibling's load-time conversion where `_CONVERSION_OF` names one (transformers'
    revert, and save_pretrained, then give back the released checkpoints' names)."""
    sibling = _CONVERSION_OF.get(getattr(model.config, "model_type", ""))
    if sibling is not None and getattr(model, "_weight_conversions", None) is None:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        model._weight_conversions = get_checkpoint_conversion_mapping(sibling)


def _revert(model, state: dict) -> dict:
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without load-time conversions: names are stored as built
        return state
    if getattr(model.config, "model_type", "") in _STORED_AS_BUILT:
        return state
    if getattr(model.config, "model_type", "") in _RELEASED_STATE:
        return _RELEASED_STATE[model.config.model_type](model, state)
    use_sibling_conversion(model)
    reverted = revert_weight_conversion(model, state)
    fixup = _DISK_NAME_FIXUPS.get(getattr(model.config, "model_type", ""))
    if fixup is None:
        return reverted
    renamed = ((fixup(name, model.config), t) for name, t in reverted.items())
    return {name: t for name, t in renamed if name is not None}


def layer_filter(num_layers: int, num_mtp: int = 0):
    """Predicate on tensor names: drop layers beyond the (possibly shrunk) config's, keeping num_mtp MTP layers."""
    limit = num_layers + num_mtp

    def keep(name: str) -> bool:
        match = _LAYER_NAME.match(name)
        return match is None or int(match.group(1)) < limit

    return keep


def num_mtp_layers(text_config: Any, include_mtp: bool) -> int:
    return int(getattr(text_config, "num_nextn_predict_layers", 0) or 0) if include_mtp else 0


# --------------------------------------------------------------------------------------------------- listing

INDEX_FILE = "model.safetensors.index.json"

# safetensors header dtype codes -> torch dtype names (the spelling used everywhere else in shardplan).
_SAFETENSORS_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
}
# A header larger than this is not a safetensors header (the format itself caps it at 100 MB).
_MAX_HEADER_BYTES = 100_000_000


TensorInfo = tuple[str, tuple[int, ...], str]  # (on-disk name, shape, dtype name)


def read_safetensors_header(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype name) from a .safetensors file's header, without reading tensor data.

    Format: 8-byte little-endian header length, then that many bytes of JSON {name: {dtype, shape, data_offsets}}
    plus an optional "__metadata__" entry.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise ConfigError(
                    f"{path} is not a safetensors file: it is shorter than the 8-byte header length. "
                    f"Re-download it or remove it from the checkpoint directory."
                )
            (header_len,) = struct.unpack("<Q", prefix)
            file_size = os.fstat(f.fileno()).st_size
            if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
                raise ConfigError(
                    f"{path} is not a safetensors file (or is truncated): its header claims "
                    f"{header_len} bytes but the file has {file_size}. Re-download it."
                )
            header_bytes = f.read(header_len)
    except OSError as exc:
        raise ConfigError(f"Cannot read {path}: {exc.strerror or exc}.") from exc
    try:
        header = json.loads(header_bytes)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{path}: the safetensors header is not valid JSON ({exc}). Re-download the file.") from exc
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_code, shape = info["dtype"], tuple(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"{path}: header entry for tensor {name!r} lacks a valid 'dtype'/'shape' "
                f"({exc!r}). Re-download the file."
            ) from exc
        tensors[name] = (shape, _SAFETENSORS_DTYPES.get(dtype_code, str(dtype_code).lower()))
    return tensors


def checkpoint_tensors(spec: ModelSpec, dtype: Any = "bfloat16", include_mtp: bool = False) -> list[TensorInfo]:
    """The checkpoint's tensors as (name, shape, dtype name), in the hub's on-disk naming, sorted by name.

    With a local checkpoint (spec.source_dir holding *.safetensors and/or model.safetensors.index.json) names,
    shapes and dtypes come from the safetensors headers; names listed by the index whose shard files are absent
    take their shape from the config-built model. Otherwise everything comes from the config-built model and
    `dtype` is reported for every tensor except those the real checkpoints keep in float32.

    include_mtp: also list multi-token-prediction layers (DeepSeek-V3's num_nextn_predict_layers, stored as
    model.layers.<num_hidden_layers + k>). Layers beyond num_hidden_layers (+ MTP) are dropped, so a local
    checkpoint resolved with num_hidden_layers=2 lists only what that shrunk config uses.
    """
    dtype_name = _dtype_name(dtype)
    if spec.source_dir is not None:
        source = Path(spec.source_dir)
        if (source / INDEX_FILE).is_file() or any(source.glob("*.safetensors")):
            return _tensors_from_checkpoint_dir(spec, source, dtype_name, include_mtp)
    return _with_dtype(_meta_tensors(spec, include_mtp), dtype_name)


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ShardplanError(
            f"Unknown dtype {dtype!r}: use a torch dtype name such as 'bfloat16', 'float16' or 'float32'."
        )
    return name


def _with_dtype(meta: tuple[tuple[str, tuple[int, ...], str | None], ...], dtype_name: str) -> list[TensorInfo]:
    # fixed: the dtype a tensor is stored in whatever the model dtype (float32 routers, integer tables), or None
    return [(name, shape, fixed or dtype_name) for name, shape, fixed in meta]


def _layer_filter(spec: ModelSpec, include_mtp: bool):
    """Predicate on tensor names: drop layers the (possibly shrunk) config does not have."""
    text = hf_view(spec).text_config
    return layer_filter(int(text.num_hidden_layers), num_mtp_layers(text, include_mtp))


def _tensors_from_checkpoint_dir(spec: ModelSpec, source: Path, dtype_name: str, include_mtp: bool) -> list[TensorInfo]:
    index_path = source / INDEX_FILE
    weight_map: dict[str, str] | None = None
    if index_path.is_file():
        index = _read_json_object(index_path, str(index_path))
        weight_map = index.get("weight_map")
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise ConfigError(
                f"{index_path}: field 'weight_map' is missing or not a mapping of tensor name -> "
                f"shard file. Re-download the index, or delete it to use the shard headers alone."
            )
        shard_files = sorted({source / shard for shard in weight_map.values()})
    else:
        # Without an index, HF-format files are model*.safetensors; some repos (Mistral) also ship a
        # consolidated.safetensors in another naming, which must not be mixed in.
        shard_files = sorted(source.glob("model*.safetensors")) or sorted(source.glob("*.safetensors"))

    on_disk: dict[str, tuple[tuple[int, ...], str]] = {}
    for shard in shard_files:
        if shard.is_file():  # an index without (some of) its shards is allowed: see below
            on_disk.update(read_safetensors_header(shard))

    keep = _layer_filter(spec, include_mtp)
    names = [name for name in (weight_map if weight_map is not None else on_disk) if keep(name)]
    missing = [name for name in names if name not in on_disk]
    if missing:
        # Shard files absent: the index still gives the names, the config-built model gives the shapes.
        by_name = {name: (shape, fixed) for name, shape, fixed in _meta_tensors(spec, include_mtp=True)}
        unknown = [name for name in missing if name not in by_name]
        if unknown:
            shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            raise ConfigError(
                f"{index_path}: {len(unknown)} tensor(s) listed in 'weight_map' have no shard file here and do not "
                f"exist in a {spec.architecture} built from {spec.origin}: {shown}. Put the shard files next to the "
                f"index so their headers can be read (quantized checkpoints need them for the extra tensors)."
            )
        for name in missing:
            shape, fixed = by_name[name]
            on_disk[name] = (shape, fixed or dtype_name)
    return [(name, on_disk[name][0], on_disk[name][1]) for name in sorted(names, key=_natural_key)]


def _natural_key(name: str) -> tuple:
    # layers.10 after layers.9, experts.100 after experts.99: the order a human (and the hub index) expects.
    return tuple(int(part) if part.isdigit() else part for part in name.split("."))


# Built models are the slow part (Kimi-K2: ~70k tensors), so results are kept per (config sha, include_mtp).
_META_CACHE: OrderedDict[tuple[str, str, bool], tuple[tuple[str, tuple[int, ...], str | None], ...]] = OrderedDict()
_META_CACHE_SIZE = 16
_META_LOCK = threading.Lock()


def _meta_tensors(spec: ModelSpec, include_mtp: bool) -> tuple[tuple[str, tuple[int, ...], str | None], ...]:
    """(on-disk name, shape, fixed dtype or None) for the model the config describes, cached per config sha."""
    sha = config_sha256(spec.config)  # recomputed: spec.config is a dict and may have been edited in place
    key = (sha, repr(spec.overrides), include_mtp)  # overrides: an alias override reads differently from the key
    with _META_LOCK:
        if key in _META_CACHE:
            _META_CACHE.move_to_end(key)
            return _META_CACHE[key]
    result = _build_meta_tensors(spec, include_mtp, sha)
    with _META_LOCK:
        _META_CACHE[key] = result
        while len(_META_CACHE) > _META_CACHE_SIZE:
            _META_CACHE.popitem(last=False)
    return result


def _build_meta_tensors(
    spec: ModelSpec, include_mtp: bool, sha: str
) -> tuple[tuple[str, tuple[int, ...], str | None], ...]:
    """From the on-disk names cache when it holds this exact list, else built (and stored there)."""
    key = _names_cache_key(spec, include_mtp, sha)
    path = _names_cache_path(key) if key is not None else None
    cached = _read_names_cache(path, key) if path is not None else None
    if cached is not None:
        return cached
    result = on_disk_tensors(hf_view(spec), include_mtp)
    if path is not None:
        _write_names_cache(path, key, result)
    return result


# ------------------------------------------------------------------------------------------ on-disk names cache
# Building the list is the part of a recording's fixed cost that is shardplan's own (a meta build, transformers'
# weight-conversion revert and a natural sort, paid by every `shardplan record`), so the result is kept
# in $XDG_CACHE_HOME/shardplan/names/ as JSON (never pickle: a cache file is data). The key is everything the list
# depends on: the config (after overrides), include_mtp, the transformers and torch versions, and the source of this
# module and record/configs.py (a change to how names are derived invalidates every entry). Each entry is sealed: it
# holds its full key and a sha256 over the key and its canonical content, so an edited, truncated, swapped or stale
# entry is rebuilt and rewritten (a dropped name would otherwise drop a param from every plan recorded after); a
# cache that cannot be written costs only the rebuild. SHARDPLAN_NAMES_CACHE=0 turns it off.
_NAMES_CACHE_FORMAT = 2


def _names_cache_key(spec: ModelSpec, include_mtp: bool, sha: str) -> str | None:
    if os.environ.get("SHARDPLAN_NAMES_CACHE", "1") == "0":
        return None
    import transformers

    h = hashlib.sha256()
    for part in (
        _NAMES_CACHE_FORMAT,
        sha,
        repr(spec.overrides),
        include_mtp,
        spec.architecture,
        transformers.__version__,
        torch.__version__,
    ):
        h.update(repr(part).encode() + b"\0")
    for module_file in (__file__, configs.__file__):
        h.update(Path(module_file).read_bytes())
    return h.hexdigest()


def _names_cache_path(key: str) -> Path:
    return _cache_root() / "names" / f"{key[:32]}.json"


def _names_seal(key: str, rows: list) -> str:
    """sha256 over the entry's key and its rows in one canonical JSON spelling."""
    text = json.dumps(rows, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(key.encode() + b"\0" + text.encode()).hexdigest()


def _read_names_cache(path: Path, key: str) -> tuple[MetaTensor, ...] | None:
    """The cached list, or None when absent, malformed, of another key, or not matching its seal (then rebuilt)."""
    try:
        raw = json.loads(path.read_text())
        if not (
            isinstance(raw, dict)
            and raw.keys() == {"format", "key", "sha256", "tensors"}
            and raw["format"] == _NAMES_CACHE_FORMAT
            and raw["key"] == key
            and raw["sha256"] == _names_seal(key, raw["tensors"])
        ):
            return None
    except (OSError, ValueError, TypeError, RecursionError):
        return None
    rows = raw["tensors"]
    if not isinstance(rows, list) or not rows:
        return None
    out = []
    for row in rows:
        if not (
            isinstance(row, list)
            and len(row) == 3
            and isinstance(row[0], str)
            and isinstance(row[1], list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in row[1])
            and (row[2] is None or isinstance(row[2], str))
        ):
            return None
        out.append((row[0], tuple(row[1]), row[2]))
    return tuple(out)


def _write_names_cache(path: Path, key: str, tensors: tuple[MetaTensor, ...]) -> None:
    tmp = None
    rows = [[n, list(s), d] for n, s, d in tensors]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"format": _NAMES_CACHE_FORMAT, "key": key, "sha256": _names_seal(key, rows), "tensors": rows}, f)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old entry or the whole new one
    except OSError:  # read-only or full cache directory: the list was built anyway
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
