"""`--trust-remote-code`: a config class and model code from the user's own checkpoint directory (record side).

Off by default. A model whose config class exists only as hub remote code (BailingMoe, ChatGLM, DeciLM, ...) names it
in config.json's `auto_map`, and the directory holds the Python files. With the flag, as `vllm serve
--trust-remote-code` does, those files are imported and run: `configuration_*.py` to read the config, `modeling_*.py`
to list the checkpoint's tensor names when the directory has no safetensors, and vLLM's own get_config on the copy it
is given. Only a local directory is trusted, never the hub (shardplan downloads nothing); the plan header records that
the recording ran the directory's code (docs/plan-format.md).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from shardplan.models import ConfigError, ModelSpec

__all__ = ["RemoteCodeError", "config_class", "copy_code", "model_class", "trust"]

_TRUSTED: dict[str, dict] = {}  # source dir -> its auto_map, for the directories the user trusted
_CONFIG_DIRS: dict[type, str] = {}  # a config class loaded from a trusted directory -> that directory


class RemoteCodeError(ConfigError):
    """--trust-remote-code was asked for a model that has no local code to trust, or its code cannot be loaded."""


def trust(spec: ModelSpec) -> None:
    """Allow `spec`'s directory's code to run in this process; refuses anything but a local directory whose
    config.json has an auto_map naming its config class."""
    if spec.source_dir is None:
        raise RemoteCodeError(
            f"--trust-remote-code needs --model to be a local checkpoint directory holding config.json and the "
            f"model's configuration_*.py / modeling_*.py files; {spec.origin} is "
            f"{'a built-in' if spec.hf_id else 'a bare config file'}, which has no code to trust. Drop the flag, "
            f"or point at the downloaded snapshot directory."
        )
    auto_map = spec.config.get("auto_map")
    if not (isinstance(auto_map, dict) and isinstance(auto_map.get("AutoConfig"), str)):
        raise RemoteCodeError(
            f"{spec.origin}: --trust-remote-code was given, but config.json has no auto_map.AutoConfig naming the "
            f'config class in this directory (e.g. "auto_map": {{"AutoConfig": "configuration_x.XConfig"}}). '
            f"Add it as the hub snapshot has it, or drop the flag."
        )
    _TRUSTED[str(spec.source_dir)] = auto_map


def trusted(spec: ModelSpec) -> bool:
    return spec.source_dir is not None and str(spec.source_dir) in _TRUSTED


def _load(reference: str, source_dir: str, origin: str):
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    if "--" in reference:  # "repo--module.Class": code from another hub repo, which shardplan never fetches
        raise RemoteCodeError(
            f"{origin}: auto_map entry {reference!r} points at another hub repository; only code "
            f"in {source_dir} is run. Copy that file into the directory and name it locally."
        )
    try:
        return get_class_from_dynamic_module(reference, source_dir, local_files_only=True)
    except Exception as exc:  # a missing file, a syntax error or an import the code needs
        raise RemoteCodeError(
            f"{origin}: cannot load {reference!r} from {source_dir} (--trust-remote-code): "
            f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
        ) from exc


def config_class(spec: ModelSpec):
    """The config class the trusted directory's auto_map names, or None when `spec` is not trusted."""
    if not trusted(spec):
        return None
    cls = _load(_TRUSTED[str(spec.source_dir)]["AutoConfig"], str(spec.source_dir), spec.origin)
    _CONFIG_DIRS[cls] = str(spec.source_dir)
    return cls


def model_class(hf_config):
    """The causal-LM class the trusted directory names for a config of one of its classes, else None."""
    source_dir = _CONFIG_DIRS.get(type(hf_config))
    if source_dir is None:
        return None
    auto_map = _TRUSTED[source_dir]
    reference = auto_map.get("AutoModelForCausalLM") or auto_map.get("AutoModel")
    if not isinstance(reference, str):
        raise RemoteCodeError(
            f"{source_dir}/config.json: auto_map names no AutoModelForCausalLM, so the checkpoint's "
            f"tensor names cannot be derived from its code; put the safetensors files (or "
            f"model.safetensors.index.json) in the directory so they are read from them."
        )
    return _load(reference, source_dir, f"{source_dir}/config.json")


def copy_code(spec: ModelSpec, target: str) -> None:
    """The trusted directory's Python files next to the config.json vLLM is given (vLLM imports them from there)."""
    if trusted(spec):
        for path in sorted(Path(spec.source_dir).glob("*.py")):
            shutil.copyfile(path, Path(target) / path.name)
