"""Model registry: which model a plan is for, and what its checkpoint holds on disk.

A model is named by a built-in short name, alias or HF id (all case-insensitive), by a local HF checkpoint directory,
or by a config.json path. `resolve_model` turns any of these plus "key=value" overrides into a `ModelSpec`: the
config dict, its sha256 (the plan cache key) and, for a local directory, where the real checkpoint lives.

Built-in configs are the public hub config.json files, stored in `shardplan/configs/<short-name>.json` because this
tool must work without hub access. Each file carries our own bookkeeping under keys starting with "_shardplan"
(HF id, aliases, a note on what was changed; "variant_of" for a second built-in of the same hub repo, e.g. its FP8
checkpoint next to the BF16 one); those keys are stripped before the config is used or written.

This module is the fingerprint side: plain JSON, no torch, transformers or vLLM, so a trainer can find its plan.
Reading a config the way vLLM does (config classes, aliases, nested text configs) is `shardplan.record.configs`;
listing a checkpoint's tensors is `shardplan.record.checkpoint`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping

from shardplan.errors import ShardplanError

__all__ = ["ConfigError", "ModelSpec", "UnknownModelError", "config_sha256", "list_models", "resolve_model"]

CONFIGS_DIR = Path(__file__).with_name("configs")
# Our keys in built-in JSON files ("_shardplan": {hf_id, aliases}, "_shardplan_note": "..."), never model config.
_OWN_KEY_PREFIX = "_shardplan"
# Sizes every consumer (transformers, vLLM, our tensor listing) needs; checked after overrides when the file spells
# them out (record.configs checks them through the config class, with aliases and defaults).
_REQUIRED_POSITIVE_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


class UnknownModelError(ShardplanError):
    """The model spec is neither a built-in (short name, alias, HF id) nor an existing path."""


class ConfigError(ShardplanError):
    """A config.json, checkpoint index/header or override is unusable; the message names the file and field."""


# --------------------------------------------------------------------------------------------------- the spec


def config_sha256(config: Mapping[str, Any]) -> str:
    """sha256 hex of the canonical JSON form of a config: the identity of a model for caching plans."""
    return hashlib.sha256(_canonical_json(config).encode()).hexdigest()


def _canonical_json(config: Mapping[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class ModelSpec:
    """One resolved model: its HF config (after overrides) and where it came from.

    name: built-in short name, or the absolute path given. hf_id: hub id for built-ins, else None.
    source_dir: the local checkpoint directory when one was given (its safetensors describe the real tensors).
    """

    name: str
    hf_id: str | None
    config: dict[str, Any]
    config_sha256: str = ""  # computed from config when left empty
    source_dir: str | None = None
    # The file's config before overrides, and the overrides as (key path, value): record.configs.hf_view applies them
    # again through the config class (aliases, nested text configs), which plain JSON keys cannot express.
    base_config: dict[str, Any] | None = None
    overrides: tuple[tuple[tuple[str, ...], Any], ...] = ()

    def __post_init__(self) -> None:
        if not self.config_sha256:
            object.__setattr__(self, "config_sha256", config_sha256(self.config))

    # config is a dict, so the generated field hash would fail; the sha already identifies the config.
    def __hash__(self) -> int:
        return hash((self.name, self.hf_id, self.config_sha256, self.source_dir))

    @property
    def architecture(self) -> str:
        return self.config["architectures"][0]

    @property
    def origin(self) -> str:
        """Where the config came from, for error messages."""
        if self.hf_id is not None:
            return f"built-in {self.name}"
        if self.source_dir is not None:
            return str(Path(self.source_dir) / "config.json")
        return self.name

    def materialize(self, dir: str | os.PathLike | None = None, config: dict[str, Any] | None = None) -> str:
        """Write config.json (the config after overrides, or `config`: record.configs passes the config as its
        config class reads it) into `dir` and return the directory.

        The default is a per-config directory in the user cache, so repeated runs reuse it and vLLM's
        `ModelConfig(model=<dir>)` sees exactly this config. Only config.json is written: vLLM never loads real
        weights here, and the original checkpoint stays readable (record.checkpoint).
        """
        config = self.config if config is None else config
        target = Path(dir).expanduser() if dir is not None else _cache_root() / "configs" / config_sha256(config)[:16]
        if self.source_dir is not None and target.resolve() == Path(self.source_dir).resolve():
            raise ConfigError(
                f"Refusing to materialize {self.origin} into its own checkpoint directory {target}: that would "
                f"overwrite the original config.json. Pass another directory, or dir=None for the cache."
            )
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        config_path = target / "config.json"
        try:
            target.mkdir(parents=True, exist_ok=True)
            if config_path.is_file() and config_path.read_text() == text:
                return str(target)
            # Write-then-rename so concurrent runs sharing the cache never see a half-written config.json.
            fd, tmp_name = tempfile.mkstemp(dir=target, prefix=".config.", suffix=".json.tmp")
            try:
                with os.fdopen(fd, "w") as tmp:
                    tmp.write(text)
                os.replace(tmp_name, config_path)
            except BaseException:
                Path(tmp_name).unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise ShardplanError(
                f"Cannot write {config_path} for {self.origin}: {exc.strerror or exc}. Pass a writable directory "
                f"to materialize(dir=...) or set XDG_CACHE_HOME to a writable location."
            ) from exc
        return str(target)


def _cache_root() -> Path:
    # Read at call time, not import time, so tests and callers can redirect the cache through the environment.
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardplan"


# --------------------------------------------------------------------------------------------------- built-ins


@dataclass(frozen=True)
class _BuiltIn:
    short_name: str
    hf_id: str
    aliases: tuple[str, ...]
    path: Path
    config: dict[str, Any]  # stripped of our own keys; copied before handing out


@lru_cache(maxsize=1)
def _builtins() -> tuple[dict[str, _BuiltIn], dict[str, str]]:
    """(short name -> built-in, lower-cased lookup key -> short name), loaded once from shardplan/configs/."""
    by_name: dict[str, _BuiltIn] = {}
    lookup: dict[str, str] = {}
    for path in sorted(CONFIGS_DIR.glob("*.json")):
        short = path.stem
        raw = _read_json_object(path, f"built-in {short} ({path})")
        meta = raw.get("_shardplan")
        if not isinstance(meta, dict) or not isinstance(meta.get("hf_id"), str):
            raise ConfigError(
                f"built-in {short} ({path}): field '_shardplan.hf_id' is missing; every built-in "
                f'config needs "_shardplan": {{"hf_id": ..., "aliases": [...]}}.'
            )
        hf_id = meta["hf_id"]
        aliases = tuple(meta.get("aliases", ()))
        by_name[short] = _BuiltIn(short, hf_id, aliases, path, _strip_own_keys(raw))
        # The hub repo's own name ("Kimi-K2-Instruct") is accepted too: it is what people copy from the hub page. A
        # variant ("variant_of": "kimi-k2", e.g. the FP8 checkpoint of the same hub repo) leaves the HF id's names to
        # the built-in it is a variant of and answers to its short name and aliases only.
        hub_names = () if meta.get("variant_of") else (hf_id, hf_id.rsplit("/", 1)[-1])
        for key in (short, *hub_names, *aliases):
            key = key.lower()
            if lookup.get(key, short) != short:
                raise ConfigError(
                    f"built-in {short} ({path}): name {key!r} is already used by built-in "
                    f"{lookup[key]}; aliases must be unique."
                )
            lookup[key] = short
    return by_name, lookup


def list_models() -> list[tuple[str, str, str]]:
    """Built-in models as (short name, HF id, architecture), sorted by short name."""
    by_name, _ = _builtins()
    return [(b.short_name, b.hf_id, b.config["architectures"][0]) for b in by_name.values()]


def _unknown_model_message(spec: str) -> str:
    rows = "\n".join(f"  {short:<18} {hf_id:<40} {arch}" for short, hf_id, arch in list_models())
    looks_like_path = os.sep in spec or spec.startswith((".", "~")) or spec.endswith(".json")
    path_note = f"\nNo file or directory {spec!r} exists either." if looks_like_path else ""
    return (
        f"Unknown model {spec!r}.{path_note}\n"
        f"Built-in models (short name, HF id, architecture; names are case-insensitive):\n{rows}\n"
        f"For any other model, pass a local directory containing its HF config.json (a downloaded snapshot; "
        f"weights are optional), or the path of a config.json file. shardplan never downloads from the hub."
    )


# --------------------------------------------------------------------------------------------------- resolving


def resolve_model(spec: str | os.PathLike, overrides: Iterable[str] | Mapping[str, Any] | None = None) -> ModelSpec:
    """Resolve a model name or path plus overrides to a ModelSpec.

    spec: built-in short name / alias / HF id (case-insensitive), a local directory with config.json, or a
    config.json path. A directory with config.json or a file wins over a built-in name, as in transformers and
    vLLM; a directory without config.json does not.
    overrides: "key=value" strings (value parsed as JSON when it parses, else taken as a string; dotted keys set
    nested values, e.g. "rope_scaling.factor=8") or a dict of key -> value (dotted keys allowed).
    """
    text = os.fspath(spec).strip()
    path = Path(text).expanduser() if text else None
    by_name, lookup = _builtins()
    if path is not None and (path / "config.json").is_file():
        source_dir = path.resolve()
        config_path = source_dir / "config.json"
        name, hf_id, origin = str(source_dir), None, str(config_path)
        base = _strip_own_keys(_read_json_object(config_path, origin))
    elif path is not None and path.is_file():
        config_path = path.resolve()
        # A bare config file says nothing about where the weights are, so there is no source_dir: files that
        # happen to sit next to it are not assumed to belong to it.
        source_dir, name, hf_id, origin = None, str(config_path), None, str(config_path)
        base = _strip_own_keys(_read_json_object(config_path, origin))
    elif text.lower() in lookup:
        # Checked after real checkpoints but before other directories: an output folder named "kimi-k2" in the
        # working directory must not shadow the built-in.
        builtin = by_name[lookup[text.lower()]]
        short = builtin.short_name
        source_dir, name, hf_id, origin = None, short, builtin.hf_id, f"built-in {short} ({builtin.path})"
        base = copy.deepcopy(builtin.config)
    elif path is not None and path.is_dir():
        raise ConfigError(
            f"{path.resolve()} has no config.json. Point at an HF checkpoint directory (one that "
            f"contains config.json) or at a config.json file."
        )
    else:
        raise UnknownModelError(_unknown_model_message(text))

    parsed = _parse_overrides(overrides)
    config = _apply_overrides(base, parsed, origin)
    _validate_config(config, origin, overridden=bool(parsed))
    try:
        sha = config_sha256(config)
    except (TypeError, ValueError) as exc:  # only reachable through dict overrides holding non-JSON values
        raise ConfigError(
            f"{origin}: an override value is not JSON-serialisable ({exc}). Use numbers, strings, "
            f"booleans, null, lists and dicts."
        ) from exc
    return ModelSpec(
        name=name,
        hf_id=hf_id,
        config=config,
        config_sha256=sha,
        source_dir=str(source_dir) if source_dir is not None else None,
        base_config=base,
        overrides=tuple((key_path, copy.deepcopy(value)) for _, key_path, value in parsed),
    )


# Bounds on what a config (or a checkpoint index, an override value) may hold, checked while reading: hub configs are
# a few KB, nest 3-4 levels and hold int64-sized integers at most, so these only stop files that would otherwise end
# in a bare RecursionError / ValueError or take gigabytes to read.
MAX_CONFIG_BYTES = 64 << 20  # the largest hub index.json files (per-tensor weight maps) are a few MB
MAX_CONFIG_DEPTH = 32
MAX_CONFIG_INT = (1 << 63) - 1  # |integer| in the int64 range, as every consumer (torch, vLLM) holds them


class _JsonBound(ValueError):
    """A JSON value beyond the bounds above (raised from inside json.loads)."""


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > 19:  # checked on the text, before int() spends time on (or refuses) thousands of digits
        raise _JsonBound(f"an integer of {digits} digits ({text[:12]}...), beyond the int64 range")
    value = int(text)
    if abs(value) > MAX_CONFIG_INT:
        raise _JsonBound(f"the integer {value}, beyond the int64 range")
    return value


def parse_json(text: str, origin: str, what: str = "JSON") -> Any:
    """`json.loads` with the bounds above; any failure is a ConfigError naming `origin` and the cause."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{origin} holds {len(text)} characters, more than the {MAX_CONFIG_BYTES} a {what} may: "
            f"it is not a model config. Point at the model's own config.json."
        )
    try:
        data = json.loads(text, parse_int=_bounded_int)
    except _JsonBound as exc:
        raise ConfigError(f"{origin} holds {exc}. Fix the value (configs hold sizes that fit in int64).") from None
    except RecursionError:
        raise ConfigError(
            f"{origin} nests arrays/objects deeper than Python's JSON reader can follow (a {what} "
            f"nests a few levels, at most {MAX_CONFIG_DEPTH}). Fix the file."
        ) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{origin} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}. "
            f"Fix the file (or re-download config.json)."
        ) from None
    except ValueError as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ConfigError(f"{origin} cannot be read as JSON: {reason}. Fix the file.") from None
    check_json_value(data, origin)
    return data


def check_json_value(value: Any, origin: str) -> None:
    """Depth and integer bounds of a parsed config value (also values given as Python objects: dict overrides)."""
    stack = [(value, 0, "")]
    while stack:
        node, depth, where = stack.pop()
        if isinstance(node, (dict, list, tuple)):
            if depth >= MAX_CONFIG_DEPTH:
                what = f"field {where!r}" if where else "the value"
                raise ConfigError(
                    f"{origin}: {what} nests more than {MAX_CONFIG_DEPTH} levels "
                    f"deep; a model config nests a few. Fix the file or the override."
                )
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for k, v in items:
                stack.append((v, depth + 1, f"{where}.{k}" if where else str(k)))
        elif isinstance(node, int) and not isinstance(node, bool) and abs(node) > MAX_CONFIG_INT:
            what = f"field {where!r}" if where else "the value"
            raise ConfigError(
                f"{origin}: {what} is an integer of {node.bit_length()} bits, beyond the int64 range. Fix the value."
            )


def _read_json_object(path: Path, origin: str) -> dict[str, Any]:
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{origin} is {size} bytes, more than the {MAX_CONFIG_BYTES} a config or index may: "
                f"it is not a model config. Point at the model's own config.json."
            )
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"Cannot read {origin}: {exc.strerror or exc}.") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{origin} is not UTF-8 text ({exc.reason}); it should be a JSON config.") from exc
    data = parse_json(text, origin, "config")
    if not isinstance(data, dict):
        raise ConfigError(f"{origin} must hold a JSON object (an HF config), not a {type(data).__name__}.")
    return data


def _strip_own_keys(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if not k.startswith(_OWN_KEY_PREFIX)}


def _parse_overrides(overrides: Iterable[str] | Mapping[str, Any] | None) -> list[tuple[str, tuple[str, ...], Any]]:
    """Overrides as (original text, key path, value)."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        items = [(f"{key}={_safe_repr(value)}", str(key), value) for key, value in overrides.items()]
    else:
        if isinstance(overrides, str):  # one override passed bare instead of in a list
            overrides = [overrides]
        items = []
        for text in overrides:
            if not isinstance(text, str) or "=" not in text:
                raise ConfigError(
                    f"Bad override {_safe_repr(text)}: expected key=value, e.g. num_hidden_layers=2 or "
                    f"rope_scaling.factor=8.0."
                )
            key, raw = text.split("=", 1)
            raw = raw.strip()
            try:
                value = json.loads(raw, parse_int=_bounded_int)
            except _JsonBound as exc:
                raise ConfigError(
                    f"Bad override {_short(text)}: the value is {exc}. Configs hold sizes that fit in int64."
                ) from None
            except RecursionError:
                raise ConfigError(
                    f"Bad override {_short(text)}: the value nests deeper than Python's JSON reader "
                    f"can follow (at most {MAX_CONFIG_DEPTH} levels)."
                ) from None
            except ValueError:
                value = raw  # not JSON: a plain string such as torch_dtype=bfloat16
            items.append((text, key, value))
    parsed = []
    for text, key, value in items:
        check_json_value(value, f"override {_short(text)}")
        key_path = tuple(part.strip() for part in key.strip().split("."))
        if len(key_path) > MAX_CONFIG_DEPTH:
            raise ConfigError(
                f"Bad override {_short(text)}: the key has {len(key_path)} dotted parts; a config nests "
                f"at most {MAX_CONFIG_DEPTH} levels."
            )
        if not all(key_path):
            raise ConfigError(
                f"Bad override {text!r}: the key {key.strip()!r} has an empty part; use key=value or dotted.key=value."
            )
        parsed.append((text, key_path, value))
    return parsed


def _safe_repr(value: Any) -> str:
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int of thousands of digits, a self-nested list
        return f"<{type(value).__name__} that cannot be shown>"
    return text if len(text) <= 80 else text[:77] + "..."


def _short(text: str) -> str:
    return repr(text) if len(text) <= 80 else repr(text[:77] + "...")


def _apply_overrides(
    config: dict[str, Any], overrides: list[tuple[str, tuple[str, ...], Any]], origin: str
) -> dict[str, Any]:
    config = copy.deepcopy(config)
    for text, key_path, value in overrides:
        node = config
        for depth, part in enumerate(key_path[:-1]):
            child = node.setdefault(part, {})  # a missing parent becomes a new mapping
            if not isinstance(child, dict):
                parent = ".".join(key_path[: depth + 1])
                raise ConfigError(
                    f"Bad override {text!r} for {origin}: field '{parent}' is {json.dumps(child)}, not a mapping, "
                    f"so '{'.'.join(key_path)}' cannot be set inside it. Set the whole field instead, e.g. "
                    f"'{parent}={{\"{key_path[depth + 1]}\": ...}}'."
                )
            node = child
        node[key_path[-1]] = copy.deepcopy(value)
    return config


def _validate_config(config: dict[str, Any], origin: str, overridden: bool) -> None:
    where = f"{origin} (after overrides)" if overridden else origin

    def fail(field: str, problem: str, example: str) -> None:
        raise ConfigError(f"{where}: field '{field}' {problem}. Fix config.json or pass an override such as {example}.")

    archs = config.get("architectures")
    if not (isinstance(archs, list) and archs and all(isinstance(a, str) and a for a in archs)):
        fail(
            "architectures",
            "is missing" if archs is None else f"must be a non-empty list of class names, got {json.dumps(archs)}",
            "'architectures=[\"LlamaForCausalLM\"]'",
        )
    model_type = config.get("model_type")
    if not (isinstance(model_type, str) and model_type):
        fail(
            "model_type",
            "is missing" if model_type is None else f"must be a string, got {json.dumps(model_type)}",
            "model_type=llama",
        )
    # Absent sizes are not an error here: the config class supplies aliases (GPT-2's n_layer) and defaults, and
    # record.configs.hf_view checks the sizes as vLLM reads them. A size spelled out in the file must still be sane.
    for field in _REQUIRED_POSITIVE_INTS:
        if field not in config:
            continue
        value = config[field]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            fail(field, f"must be a positive integer, got {json.dumps(value)}", f"{field}=<int>")
