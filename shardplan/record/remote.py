"""`--trust-remote-code`: a config class and model code from the user's own checkpoint directory (record side).

Off by default. A model whose config class exists only as hub remote code (BailingMoe, ChatGLM, DeciLM, ...) names it
in config.json's `auto_map`, and the directory holds the Python files. With the flag, as `vllm serve
--trust-remote-code` does, those files are imported and run: `configuration_*.py` to read the config, `modeling_*.py`
to list the checkpoint's tensor names when the directory has no safetensors, and vLLM's own get_config on the copy it
is given. Only code inside that local directory runs: `trust` checks every auto_map entry before shardplan, vLLM or
transformers resolves any class (transformers would otherwise fetch a "repo--module.Class" entry from the hub and
import an absolute path from anywhere, even for a model_type it knows, as vLLM's config read resolves auto_map
itself), `copy_code` checks the config.json vLLM is given again, and the recording runs with the hub switched off
(`hub_offline`). The plan header records that the recording ran the directory's code (docs/plan-format.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

from shardplan.models import ConfigError, ModelSpec

__all__ = ["RemoteCodeError", "check_auto_map", "config_class", "copy_code", "hub_offline", "model_class", "trust"]

_TRUSTED: dict[str, dict] = {}  # source dir -> its auto_map, for the directories the user trusted
_CONFIG_DIRS: dict[type, str] = {}  # a config class loaded from a trusted directory -> that directory


class RemoteCodeError(ConfigError):
    """--trust-remote-code was asked for a model that has no local code to trust, or its code cannot be loaded."""


def trust(spec: ModelSpec) -> None:
    """Allow `spec`'s directory's code to run in this process; refuses anything but a local directory whose
    config.json has an auto_map naming its config class, every entry of it a file directly in that directory."""
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
    check_auto_map(spec.config, spec.source_dir, spec.origin)
    _TRUSTED[str(spec.source_dir)] = auto_map


def trusted(spec: ModelSpec) -> bool:
    return spec.source_dir is not None and str(spec.source_dir) in _TRUSTED


def check_auto_map(config: dict[str, Any], source_dir: str, origin: str) -> None:
    """Refuse every auto_map entry of `config` (the top-level one transformers and vLLM read, and any nested in a
    sub-config) that would run code from anywhere but a file directly in `source_dir`: the value of every key, a
    "module.Class" string or a list of them (AutoTokenizer's (slow, fast) pair, either of which may be null)."""
    for auto_map in _auto_maps(config):
        if not isinstance(auto_map, dict):
            raise RemoteCodeError(
                f"{origin}: auto_map is {type(auto_map).__name__} {_short(auto_map)}, not an object of "
                f'"AutoX": "module.Class" entries; --trust-remote-code runs only code in {source_dir}. Write it as the '
                f'hub snapshot has it (e.g. {{"AutoConfig": "configuration_x.XConfig"}}).'
            )
        for key, value in auto_map.items():
            entries = list(value) if isinstance(value, (list, tuple)) else [value]
            for entry in entries:
                if entry is None and isinstance(value, (list, tuple)):
                    continue  # a tokenizer pair without its slow or fast class
                problem = _entry_problem(entry, source_dir)
                if problem:
                    raise RemoteCodeError(
                        f"{origin}: auto_map[{key!r}] entry {_short(entry)} {problem[0]}; --trust-remote-code runs "
                        f"only code in {source_dir}, so nothing was loaded. {problem[1]}"
                    )


def _auto_maps(node: Any) -> Iterator[Any]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "auto_map":
                yield value
            else:
                yield from _auto_maps(value)
    elif isinstance(node, list):
        for value in node:
            yield from _auto_maps(value)


def _entry_problem(entry: Any, source_dir: str) -> tuple[str, str] | None:
    """(what is wrong with one auto_map entry, what to do), or None for a "module.Class" whose module.py is a file
    directly in `source_dir` (a symlink there counts: hub snapshots link their files to the cache's blobs)."""
    form = 'Name a class in a file directly in the directory, as "module.Class" (e.g. "configuration_x.XConfig").'
    if not isinstance(entry, str):
        return f"is {type(entry).__name__}, not a 'module.Class' string", form
    if "--" in entry:  # "repo--module.Class": transformers would fetch module.py from that hub repository
        repo, _, reference = entry.partition("--")
        return (
            f"points at the hub repository {repo!r}, which is never contacted",
            f"Copy that repository's {reference.split('.')[0]}.py into the directory and name it locally "
            f"({reference!r}).",
        )
    if os.path.isabs(entry) or entry.startswith("\\"):
        return "is an absolute path, outside the directory", f"Copy the file into the directory. {form}"
    if ".." in entry.replace("\\", "/").split("/"):
        return "climbs out of the directory with '..'", f"Copy the file into the directory. {form}"
    if "/" in entry or "\\" in entry:
        return (
            "names a file in a subdirectory (transformers' save_pretrained writes remote code directly into the "
            "checkpoint directory, and only those files are given to vLLM)",
            f"Move the file into the directory itself. {form}",
        )
    module, dot, cls = entry.partition(".")
    if not (dot and module and cls) or "." in cls:
        return "is not of the form 'module.Class'", form
    if not (Path(source_dir) / f"{module}.py").is_file():
        return (
            f"names {module}.py, which is not a file in the directory",
            "Add that file from the model's hub snapshot to the directory, or remove the entry.",
        )
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


# huggingface_hub reads HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) once, when it is imported, into
# huggingface_hub.constants.HF_HUB_OFFLINE: setting the environment later changes nothing in this process. That constant
# is what counts: every request through huggingface_hub's session (get_session's request hook) raises while it is
# true, transformers (5.x) has no flag of its own and asks huggingface_hub.is_offline_mode() (which returns it) before
# cached_file / get_cached_module_file, and vLLM passes local_files_only=huggingface_hub.constants.HF_HUB_OFFLINE. The
# environment is set too, for any process started meanwhile and for a huggingface_hub imported meanwhile.
_OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """The Hugging Face hub switched off while inside (whatever the user's environment says), restored after."""
    import huggingface_hub.constants as hub

    saved_env = {name: os.environ.get(name) for name in _OFFLINE_ENV}
    saved = hub.HF_HUB_OFFLINE
    os.environ.update({name: "1" for name in _OFFLINE_ENV})
    hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = saved
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _load(reference: str, source_dir: str, origin: str):
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    problem = _entry_problem(reference, source_dir)  # trust() refused these already; checked again where code runs
    if problem:
        raise RemoteCodeError(f"{origin}: auto_map entry {reference!r} {problem[0]}; only code in {source_dir} is run.")
    try:
        with hub_offline():
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
    """The trusted directory's Python files next to the config.json vLLM is given (vLLM imports them from there).

    That config.json's auto_map is checked against the directory first (vLLM resolves it itself), and Python files a
    recording of another directory left in `target` (a cache directory shared by equal configs) are removed, so the
    copy holds this directory's code and nothing else."""
    if not trusted(spec):
        return
    config_path = Path(target) / "config.json"
    check_auto_map(
        json.loads(config_path.read_text()), str(spec.source_dir), f"{config_path} (the copy of {spec.origin})"
    )
    sources = {path.name: path for path in Path(spec.source_dir).glob("*.py") if path.is_file()}
    for stale in Path(target).glob("*.py"):
        if stale.name not in sources:
            stale.unlink(missing_ok=True)
    for name, path in sorted(sources.items()):
        shutil.copyfile(path, Path(target) / name)
