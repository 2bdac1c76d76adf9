"""Configs read the way vLLM reads them: through transformers' config classes (record side).

A `ModelSpec` holds the config as the user's JSON plus overrides applied key by key (`models.resolve_model`): that
JSON is the model's identity (its sha256 fingerprints plans) and needs neither transformers nor vLLM, so a trainer can
compute it. What the model *is* comes from the config class vLLM would use for it (transformers' CONFIG_MAPPING, or
vLLM's own registry for model types transformers lacks such as kimi_k2): attribute-map aliases (GPT-2's `n_layer`
is `num_hidden_layers`), nested text configs (Llama 4's `text_config`), and the class defaults for absent fields.

`hf_view(spec)` applies the overrides again, this time through the config class:
* an override may name a field, an alias or a nested key ("text_config.num_hidden_layers=2"); a field the top-level
  config does not have but its text config does goes to the text config (so `num_hidden_layers=2` shrinks Llama 4);
* an override replaces every spelling of its field (the file's `n_layer` and the override's `num_hidden_layers`
  cannot disagree), keeping the spelling the file used;
* a key that is no field, alias or nested key of the config is an `UnknownConfigKey` naming the closest valid keys;
  a leading '+' ("+my_flag=1") adds a new top-level key on purpose.
The result is the JSON vLLM is given (`materialize`), the config object, and its text config with the sizes every
consumer needs checked.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import json
from dataclasses import dataclass
from typing import Any

from shardplan.models import ConfigError, ModelSpec
from shardplan.plan.file.checks import MAX_NUMEL, MAX_WRITES_PER_RANK
from shardplan.record import cpushim, remote

cpushim.activate()  # before any vLLM or transformers import of the record side: vLLM's Qwen3.5 needs torchvision

__all__ = [
    "HFView",
    "ModelTooLarge",
    "TEXT_CONFIG_KEYS",
    "UnknownConfigKey",
    "UnsupportedArchitecture",
    "check_architecture",
    "config_class",
    "hf_view",
]

# Sizes vLLM and our tensor listing read from the text config; after aliases and defaults each must be a positive int.
_REQUIRED_POSITIVE_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# Legacy spellings transformers still accepts as constructor keywords (renamed in transformers 5) and keys every
# config may carry without the class declaring them.
_GENERIC_KEYS = {
    "rope_scaling",
    "torch_dtype",
    "quantization_config",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "max_position_embeddings",
    "rope_theta",
    "head_dim",
    "_name_or_path",
    "auto_map",
    "name_or_path",
}
# Where composite (multimodal) configs keep the language model's config, in the order get_text_config looks.
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config", "thinker_config", "decoder")
# model_types of hub configs that transformers does not register, read by vLLM with the class of another type.
_MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


class UnknownConfigKey(ConfigError):
    """An override names a key that is no field, alias or nested key of the model's config class."""


def config_class(model_type: str):
    """The config class vLLM reads this model_type with, or None when only hub remote code defines it."""
    from transformers import CONFIG_MAPPING

    try:
        from vllm.transformers_utils.config import _CONFIG_REGISTRY
    except ImportError:  # transformers alone (tests without vLLM): its own types and the known aliases
        _CONFIG_REGISTRY = {}
    # vLLM's own class wins where both have one (deepseek_v4, kimi_linear, ...), as in vLLM's get_config
    if model_type in _CONFIG_REGISTRY:
        return _CONFIG_REGISTRY[model_type]
    if model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type]
    alias = _MODEL_TYPE_ALIASES.get(model_type)
    return CONFIG_MAPPING[alias] if alias else None


@dataclass(frozen=True)
class HFView:
    """A spec read through its config class: `config` is the JSON vLLM is given, `hf_config` the config object,
    `text_config` the language model's part of it (hf_config itself for text-only models)."""

    spec: ModelSpec
    config: dict[str, Any]
    hf_config: Any
    text_config: Any

    @property
    def num_hidden_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def num_experts(self) -> int:
        return max(
            int(getattr(self.text_config, k, 0) or 0)
            for k in ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
        )


def hf_view(spec: ModelSpec) -> HFView:
    """Read `spec` through its config class; raises ConfigError / UnknownConfigKey naming the file and field."""
    base = spec.base_config if spec.base_config is not None else spec.config
    model_type = base.get("model_type")
    overrides = dict((path, value) for path, value in spec.overrides)
    if ("model_type",) in overrides:
        model_type = overrides[("model_type",)]
    cls = config_class(model_type) or remote.config_class(spec)
    if cls is None:
        import transformers

        raise ConfigError(
            f"{spec.origin}: field 'model_type' is {model_type!r}, which neither transformers "
            f"{transformers.__version__} nor vLLM has a config class for (only remote code defines it). Pass "
            f"--trust-remote-code with --model pointing at the local checkpoint directory holding its "
            f"configuration_*.py (as vllm serve --trust-remote-code; the code runs), or use the model_type of the "
            f"architecture it is built on, e.g. --override model_type=llama, if the config is a renamed copy of one."
        )
    config = copy.deepcopy(base)
    for path, value in spec.overrides:
        _apply(config, cls, path, value, spec)
    hf_config = _instantiate(cls, config, spec)
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    _check_sizes(text_config, config, spec)
    view = HFView(spec, config, hf_config, text_config)
    _check_scale(view)
    return view


# ------------------------------------------------------------------------------------------------ overrides


def _known_keys(cls, node: dict[str, Any]) -> set[str]:
    """Keys valid in a config of class `cls` whose JSON is `node`: what the file has, the class's fields and
    constructor arguments, its aliases, and the keys every config may carry."""
    keys = set(node) | _GENERIC_KEYS | set(getattr(cls, "attribute_map", {}) or {})
    keys |= set(getattr(cls, "__dataclass_fields__", {}))
    try:
        keys |= {
            p
            for p, v in inspect.signature(cls.__init__).parameters.items()
            if v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL)
        } - {"self"}
    except (TypeError, ValueError):
        pass
    keys |= set(getattr(cls, "sub_configs", {}) or {})
    return {k for k in keys if not k.startswith("__")}


def _text_key(cls) -> str | None:
    subs = getattr(cls, "sub_configs", {}) or {}
    return next((k for k in TEXT_CONFIG_KEYS if k in subs), None)


def _apply(node: dict[str, Any], cls, path: tuple[str, ...], value: Any, spec: ModelSpec, where: str = "") -> None:
    key, rest = path[0], path[1:]
    if key.startswith("+"):  # asked for a new key on purpose
        _set_nested(node, (key[1:], *rest), value)
        return
    known = _known_keys(cls, node)
    text_key = _text_key(cls)
    if key not in known:
        text_cls = (getattr(cls, "sub_configs", {}) or {}).get(text_key) if text_key else None
        if text_cls is not None and key in _known_keys(text_cls, node.get(text_key) or {}):
            child = node.get(text_key)
            if not isinstance(child, dict):
                child = node[text_key] = {}
            _apply(child, text_cls, path, value, spec, f"{where}{text_key}.")
            return
        valid = known | (
            {f"{text_key}.{k}" for k in _known_keys(text_cls, node.get(text_key) or {})}
            if text_cls is not None
            else set()
        )
        close = difflib.get_close_matches(key, sorted(valid), n=3, cutoff=0.6)
        hint = f" Did you mean {', '.join(repr(where + c) for c in close)}?" if close else ""
        raise UnknownConfigKey(
            f"{spec.origin}: override '{where}{'.'.join(path)}' names no field of {cls.__name__} (model_type "
            f"{getattr(cls, 'model_type', '?')!r}), none of its aliases and no nested config.{hint} Fix the key; to "
            f"add a key the config class does not declare on purpose, prefix it with '+' (--override +{key}=...)."
        )
    sub_cls = (getattr(cls, "sub_configs", {}) or {}).get(key)
    if rest:
        child = node.get(key)
        if sub_cls is not None and isinstance(sub_cls, type):
            if not isinstance(child, dict):
                child = node[key] = {}
            _apply(child, sub_cls, rest, value, spec, f"{where}{key}.")
        else:  # a plain mapping field (rope_scaling): its inner keys are checked against what it can hold
            _check_nested(node.get(key), cls, key, rest, spec, where)
            _set_nested(node, path, value)
        return
    aliases = getattr(cls, "attribute_map", {}) or {}
    canonical = aliases.get(key, key)
    spellings = {key, canonical} | {a for a, target in aliases.items() if target == canonical}
    present = [s for s in spellings if s in node]
    spelled = present[0] if len(present) == 1 else canonical
    for s in present:
        del node[s]
    node[spelled] = copy.deepcopy(value)


# Fields holding RoPE parameters, whose keys transformers' rope validators know (it only warns on others, so a
# misspelt `rope_scaling.factorr=2` would be recorded with the default factor).
_ROPE_FIELDS = ("rope_scaling", "rope_parameters")
_ROPE_EXTRA_KEYS = {"type", "mscale", "mscale_all_dim", "truncate"}  # yarn's and the legacy spelling of rope_type


def _rope_keys(cls) -> set[str]:
    try:
        from transformers.modeling_rope_utils import RopeParameters

        keys = set(RopeParameters.__annotations__)
    except ImportError:
        keys = set()
    return keys | _ROPE_EXTRA_KEYS | set(getattr(cls, "ignore_keys_at_rope_validation", None) or ())


def _check_nested(mapping: Any, cls, field: str, rest: tuple[str, ...], spec: ModelSpec, where: str) -> None:
    """An override inside a plain mapping field names a key that mapping has, or (RoPE fields) one transformers'
    rope validation knows; a key under '+' ("rope_scaling.+my_key=1") is added on purpose. A new mapping the file
    lacks, with no known schema, takes any key (there is nothing to check against)."""
    schema = _rope_keys(cls) if field in _ROPE_FIELDS else set()
    level, done = mapping, f"{where}{field}"
    for part in rest:
        if part.startswith("+"):
            return
        known = (set(level) if isinstance(level, dict) else set()) | schema
        if known and part not in known:
            close = difflib.get_close_matches(part, sorted(known), n=3, cutoff=0.6)
            hint = f" Did you mean {', '.join(repr(f'{done}.{c}') for c in close)}?" if close else ""
            raise UnknownConfigKey(
                f"{spec.origin}: override '{done}.{part}' names no key of '{done}' (it holds "
                f"{sorted(set(level)) if isinstance(level, dict) else 'nothing yet'}"
                f"{'; RoPE parameters transformers knows: ' + ', '.join(sorted(schema)) if schema else ''}).{hint} "
                f"Fix the key; to add it on purpose, prefix it with '+' (--override {done}.+{part}=...)."
            )
        level, done = level.get(part) if isinstance(level, dict) else None, f"{done}.{part}"


def _set_nested(node: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    path = tuple(p[1:] if p.startswith("+") else p for p in path)  # '+': a key added on purpose
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[path[-1]] = copy.deepcopy(value)


# ------------------------------------------------------------------------------------------------ reading


def _instantiate(cls, config: dict[str, Any], spec: ModelSpec):
    import transformers

    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    # what from_pretrained does after reading the file: transformers' own decoding of the non-finite floats its
    # writer encodes (`{"__float__": "Infinity"}`, GraniteMoeHybrid's time_step_limit), then from_dict
    decode = getattr(cls, "_decode_special_floats", None)
    try:
        kwargs = decode(copy.deepcopy(kwargs)) if decode is not None else copy.deepcopy(kwargs)
        return cls.from_dict(kwargs) if hasattr(cls, "from_dict") else cls(**kwargs)
    except Exception as exc:  # config classes raise ValueError/TypeError/KeyError for values they reject
        text = " ".join(str(exc).split())
        raise ConfigError(
            f"{spec.origin}: transformers {transformers.__version__}'s {cls.__name__} rejects this config: "
            f"{type(exc).__name__}: {text[:400]}. Fix the field named there in config.json or with --override."
        ) from exc


def _check_sizes(text_config, config: dict[str, Any], spec: ModelSpec) -> None:
    aliases = {v: k for k, v in (getattr(type(text_config), "attribute_map", {}) or {}).items()}
    declared = set(getattr(type(text_config), "__dataclass_fields__", {})) | set(aliases.values())
    for field in _REQUIRED_POSITIVE_INTS:
        if field == "num_attention_heads" and field not in declared and not hasattr(text_config, field):
            continue  # attention-free models (Mamba) have no heads
        value = getattr(text_config, field, None)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            spelled = field if field in config or aliases.get(field) not in config else aliases[field]
            where = f"{spec.origin} (after overrides)" if spec.overrides else spec.origin
            got = "is missing" if value is None else f"must be a positive integer, got {json.dumps(value, default=str)}"
            raise ConfigError(
                f"{where}: field '{spelled}' {got} in the {type(text_config).__name__} vLLM reads. "
                f"Fix config.json or pass an override such as {field}=<int>."
            )


class ModelTooLarge(ConfigError):
    """The config (after overrides) describes a model no plan can hold; refused before anything is built."""


# Up-front bound on what a config may ask to build (a meta build costs host memory per module, not per byte:
# a huge `num_hidden_layers` exhausts host memory before vLLM fails). Estimated checkpoint tensors: ~16 per decoder
# layer (attention, norms, dense MLP) plus 3 per routed expert; Kimi-K2, the largest built-in, estimates 71,256 (it
# has 69,975). The bound is the plan format's own limit on one rank's writes, and no tensor may hold more elements
# than a plan can address.
_TENSORS_PER_LAYER, _TENSORS_PER_EXPERT = 16, 3


def estimated_tensors(view: HFView) -> int:
    return view.num_hidden_layers * (_TENSORS_PER_LAYER + _TENSORS_PER_EXPERT * view.num_experts) + 8


def _check_scale(view: HFView) -> None:
    text, spec = view.text_config, view.spec
    where = f"{spec.origin} (after overrides)" if spec.overrides else spec.origin
    tensors = estimated_tensors(view)
    if tensors > MAX_WRITES_PER_RANK:
        raise ModelTooLarge(
            f"{where}: {view.num_hidden_layers} layers x {view.num_experts} experts is an estimated {tensors} "
            f"checkpoint tensors ({_TENSORS_PER_LAYER} per layer + {_TENSORS_PER_EXPERT} per expert), more than the "
            f"{MAX_WRITES_PER_RANK} writes a plan holds per rank. Record a shrunk model (--override "
            f"num_hidden_layers=2) or fix the value."
        )
    hidden = int(text.hidden_size)
    for field in ("vocab_size", "intermediate_size", "moe_intermediate_size"):
        width = getattr(text, field, None)
        if isinstance(width, int) and not isinstance(width, bool) and hidden * width > MAX_NUMEL:
            raise ModelTooLarge(
                f"{where}: hidden_size {hidden} x {field} {width} is {hidden * width} elements in one tensor, more "
                f"than the {MAX_NUMEL} a plan can address. Fix the value."
            )


class UnsupportedArchitecture(ConfigError):
    """The config names an architecture vLLM does not implement (natively or through its Transformers backend)."""


def check_architecture(spec: ModelSpec) -> None:
    """Raise UnsupportedArchitecture unless vLLM can build `spec`'s architecture."""
    import transformers
    import vllm
    from vllm.model_executor.models.registry import ModelRegistry

    arch = spec.architecture
    supported = set(ModelRegistry.get_supported_archs())
    if arch in supported or isinstance(getattr(transformers, arch, None), type):
        return  # vLLM's own class, or a transformers class its Transformers backend serves
    close = difflib.get_close_matches(arch, sorted(supported), n=3, cutoff=0.6)
    hint = f" Closest names vLLM knows: {', '.join(close)}." if close else ""
    raise UnsupportedArchitecture(
        f"{spec.origin}: field 'architectures' names {arch!r}, which vLLM {vllm.__version__} does not implement and "
        f"transformers {transformers.__version__} has no class of that name for vLLM's Transformers backend to "
        f"serve.{hint} Fix 'architectures' in config.json (or --override 'architectures=[\"...\"]'); "
        f"`shardplan coverage` lists every text decoder vLLM implements and how each fares."
    )


def shrink_layers_overrides(spec: ModelSpec, num_layers: int) -> list[str]:
    """Overrides that cut `spec` to its first `num_layers` layers: num_hidden_layers plus every per-layer list of the
    text config (GPT-OSS's layer_types, ...) cut to match, which the config classes check."""
    view = hf_view(spec)
    text_key = _text_key(type(view.hf_config))
    node = view.config.get(text_key) if text_key and isinstance(view.config.get(text_key), dict) else view.config
    prefix = f"{text_key}." if node is not view.config else ""
    old = view.num_hidden_layers
    out = [f"num_hidden_layers={num_layers}"]
    for key, value in sorted(node.items()):
        if isinstance(value, list) and len(value) == old and old > 1 and key != "architectures":
            out.append(f"{prefix}{key}={json.dumps(value[:num_layers])}")
        elif isinstance(value, dict):  # layer index lists that together cover every layer (Kimi-Linear's KDA/MLA)
            lists = {
                k: v
                for k, v in value.items()
                if k.endswith("_layers")
                and isinstance(v, list)
                and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
            }
            covered = sorted(i for v in lists.values() for i in v)
            if lists and covered in (list(range(old)), list(range(1, old + 1))):
                base = covered[0]
                for k, v in sorted(lists.items()):
                    out.append(f"{prefix}{key}.{k}={json.dumps([i for i in v if i < num_layers + base])}")
    return out
