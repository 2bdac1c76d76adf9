"""Checkpoint tensor names, shapes and dtypes from a config alone, in the hub's on-disk naming (vLLM side only).

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

import re
from typing import Any

from .errors import ShardplanError

__all__ = ["NamesError", "on_disk_tensors"]

# Tensors the real checkpoints store in float32 whatever the model dtype, keyed by architecture (beyond those
# transformers itself keeps in float32). DeepSeek-V3 and Kimi-K2 keep the router's score-correction bias in float32.
FLOAT32_ON_DISK: dict[str, tuple[str, ...]] = {
    "DeepseekV3ForCausalLM": ("e_score_correction_bias",),
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
# (on-disk name, shape, fixed dtype): the dtype a tensor is stored in whatever the model dtype (float32 kept by
# transformers or the released checkpoints, integer tables), None for tensors stored in the model dtype
MetaTensor = tuple[str, tuple[int, ...], "str | None"]


class NamesError(ShardplanError):
    """The checkpoint names of a config cannot be derived: the message names the file, architecture and the fix."""


def on_disk_tensors(view, include_mtp: bool = False) -> tuple[MetaTensor, ...]:
    """(on-disk name, shape, fixed dtype or None) for the model `view` (an hfconfig.HFView) describes, naturally sorted.

    include_mtp: also DeepSeek-V3's multi-token-prediction layers (num_nextn_predict_layers, stored as
    model.layers.<num_hidden_layers + k>), which transformers does not build."""
    import copy

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
        saved.update({
            prefix + "embed_tokens.weight": ((vocab, hidden), None),
            prefix + "enorm.weight": ((hidden,), None),
            prefix + "hnorm.weight": ((hidden,), None),
            prefix + "eh_proj.weight": ((hidden, 2 * hidden), None),
            prefix + "shared_head.norm.weight": ((hidden,), None),
            prefix + "shared_head.head.weight": ((vocab, hidden), None),
        })
    fp32_suffixes = FLOAT32_ON_DISK.get(view.spec.architecture, ())
    return tuple((name, shape, "float32" if name.endswith(fp32_suffixes) else fixed)
                 for name, (shape, fixed) in ((n, saved[n]) for n in natural_sorted(saved)))


def natural_sorted(names) -> list[str]:
    """layers.10 after layers.9, experts.100 after experts.99: the order a human (and the hub index) expects."""
    try:
        return sorted(names, key=lambda name: tuple(int(p) if p.isdigit() else p for p in name.split(".")))
    except TypeError:  # a number and a word at the same place (h.0 vs h.ln): numbers first
        return sorted(names, key=lambda name: tuple((0, int(p), "") if p.isdigit() else (1, 0, p)
                                                    for p in name.split(".")))


def model_class(architecture: str, hf_config):
    """The transformers class save_pretrained would run for this architecture: the class of that name when
    transformers has one (GPT2LMHeadModel, Llama4ForCausalLM), else the causal-LM class registered for the config."""
    import transformers
    from transformers import AutoModelForCausalLM

    cls = getattr(transformers, architecture, None)
    if isinstance(cls, type) and hasattr(cls, "from_pretrained") and hasattr(cls, "config_class") and \
            isinstance(hf_config, cls.config_class or object):
        return cls
    return AutoModelForCausalLM._model_mapping[type(hf_config)]


def saved_state(hf_config, architecture: str, origin: str) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """save_pretrained's state_dict steps on a meta-device model (built in bfloat16): name -> (shape, fixed dtype),
    the fixed dtype being the tensor's own where it is not bfloat16 (float32 kept by transformers, integer tables)."""
    import torch
    import transformers
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    try:
        cls = model_class(architecture, hf_config)
        with torch.device("meta"):
            model = cls._from_config(hf_config, dtype=torch.bfloat16)
    except Exception as exc:  # transformers raises ValueError/KeyError/TypeError/AttributeError for bad configs
        raise NamesError(
            f"{origin}: transformers {transformers.__version__} cannot build {architecture} "
            f"(model_type {getattr(hf_config, 'model_type', '?')!r}) from this config, so its checkpoint names "
            f"cannot be derived: {type(exc).__name__}: {' '.join(str(exc).split())[:400]}. Fix the config field named "
            f"there, or point at a checkpoint directory with safetensors files or a model.safetensors.index.json so "
            f"the names are read from it.") from exc
    state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)
    reverted = _revert(model, state)
    before, after = sum(t.numel() for t in state.values()), sum(t.numel() for t in reverted.values())
    if before != after:
        raise NamesError(
            f"{origin}: transformers {transformers.__version__}'s conversion of {architecture}'s parameters back to "
            f"checkpoint names changed the element count from {before} to {after}, so the names it gives cannot be "
            f"trusted. Point at a checkpoint directory with safetensors files or an index so the real names are read.")
    return {name: (tuple(t.shape), None if t.dtype == torch.bfloat16 else str(t.dtype).removeprefix("torch."))
            for name, t in reverted.items()}


def _revert(model, state: dict) -> dict:
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without load-time conversions: names are stored as built
        return state
    return revert_weight_conversion(model, state)


def layer_filter(num_layers: int, num_mtp: int = 0):
    """Predicate on tensor names: drop layers beyond the (possibly shrunk) config's, keeping num_mtp MTP layers."""
    limit = num_layers + num_mtp

    def keep(name: str) -> bool:
        match = _LAYER_NAME.match(name)
        return match is None or int(match.group(1)) < limit
    return keep


def num_mtp_layers(text_config: Any, include_mtp: bool) -> int:
    return int(getattr(text_config, "num_nextn_predict_layers", 0) or 0) if include_mtp else 0
