"""Which inference engine's loaders a plan records: vLLM (no `engine` key in the header, every plan before SGLang
support) or another engine named by the header's `engine` map (docs/plan-format.md, docs/sglang.md).

An engine's recording options are the server args that change which bytes a rank holds (SGLang: the EP size, DP
attention, the MoE runner and all-to-all backends, ...): the plan keeps them so a live engine can refuse a plan
recorded under other args. This module only checks their form; what they mean is the engine's business
(`shardplan.record.sglang.options`). Imports nothing heavy: the trainer reads headers with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardplan.errors import ShardplanError

VLLM = "vllm"
ENGINES = ("sglang",)  # engines a header's `engine` map may name (vLLM is the default, named by no map)
ENGINE_KEYS = ("name", "version", "options")
MAX_OPTIONS = 32
_OPTION_KEY = re.compile(r"[a-z][a-z0-9_]{0,63}")
_OPTION_TEXT = re.compile(r"[0-9A-Za-z._-]{0,64}")
_VERSION = re.compile(r"[0-9A-Za-z.+!_-]{1,64}")
MAX_OPTION_INT = (1 << 31) - 1
# what `vllm_version` holds in a plan of another engine (the field is required; that engine's version is in `engine`)
NO_VLLM = "none"


class EngineInfoError(ShardplanError):
    pass


@dataclass(frozen=True)
class EngineInfo:
    name: str
    version: str
    options: tuple[tuple[str, bool | int | str], ...] = ()  # sorted by key

    def __post_init__(self):
        problem = _problem(self.to_dict())
        if problem:
            raise EngineInfoError(problem)

    def option(self, key: str, default=None):
        return dict(self.options).get(key, default)

    def to_dict(self) -> dict:
        return {"name": self.name, "version": self.version, "options": dict(self.options)}

    @classmethod
    def from_dict(cls, d) -> "EngineInfo":
        problem = _problem(d)
        if problem:
            raise EngineInfoError(problem)
        return cls(d["name"], d["version"], tuple(d["options"].items()))

    def describe(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options)
        return f"{self.name} {self.version}" + (f" ({opts})" if opts else "")


def _problem(d) -> str | None:
    """None when `d` is a well-formed engine map, else the rule it breaks."""
    if type(d) is not dict or tuple(d) != ENGINE_KEYS:
        return f"must be a map with exactly the keys {list(ENGINE_KEYS)}, in that order"
    if d["name"] not in ENGINES or type(d["name"]) is not str:
        return f"name must be one of {list(ENGINES)} (vLLM plans have no engine map)"
    if type(d["version"]) is not str or not _VERSION.fullmatch(d["version"]):
        return "version must be a version string"
    options = d["options"]
    if type(options) is not dict or len(options) > MAX_OPTIONS:
        return f"options must be a map of at most {MAX_OPTIONS} entries"
    keys = list(options)
    if keys != sorted(keys) or not all(type(k) is str and _OPTION_KEY.fullmatch(k) for k in keys):
        return "option keys must be sorted lowercase identifiers"
    for k, v in options.items():
        if type(v) is bool:
            continue
        if type(v) is int:
            if not 0 <= v <= MAX_OPTION_INT:
                return f"option {k} must lie in [0, {MAX_OPTION_INT}]"
        elif type(v) is not str or not _OPTION_TEXT.fullmatch(v):
            return f"option {k} must be a boolean, an integer or a short word ([0-9A-Za-z._-], at most 64)"
    return None


def engine_name(header) -> str:
    """The engine whose loaders a plan header records."""
    return header.engine.name if header.engine is not None else VLLM


def engine_version(header) -> str:
    return header.engine.version if header.engine is not None else header.vllm_version
