"""What both recorder tiers share: the recording of one rank, op names, value-read aborts, small tensor helpers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardplan.errors import ShardplanError
from shardplan.plan import ir


class UnsupportedLoaderOp(ShardplanError):
    """A loader op cannot be recorded and `strict=True` asked for an error instead of a fallback."""


class RecordError(ShardplanError):
    """Recording a rank failed for a reason that is not one loader op (that would be a fallback)."""


class LoaderRejectsCheckpoint(RecordError):
    """vLLM's loader asserts on a checkpoint tensor's geometry (a shape that does not fit the model, e.g. an lm_head
    padded beyond vocab_size): vLLM cannot load this checkpoint either, so neither a plan nor a fallback can."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


TensorBase = torch._C.TensorBase  # isinstance against torch.Tensor runs a Python __instancecheck__: hot paths use this


class ValueRead(Exception):
    """Raised inside the loader when it needs data we do not have; unwinds out of load_weights."""

    def __init__(self, sources: set[str], op: str, reason: str):
        super().__init__(f"{op}: {reason}")
        self.sources, self.op, self.reason = sources, op, reason


def op_name(func) -> str:
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    if qual.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + qual.split(".", 1)[1]
    if qual.startswith("_VariableFunctionsClass."):
        # torch.cat, torch.narrow, ... are C functions whose __qualname__ is `_VariableFunctionsClass.cat`: name them
        # as the allowlist and the replayer do (`torch.cat`), or they could never be recorded.
        return "torch." + qual.split(".", 1)[1]
    if qual.endswith(".__get__") or qual.endswith(".__set__"):
        # property access (`t.T`, `t.data`, `t.shape`): func is the getset descriptor's bound __get__, whose
        # __self__ names the attribute; the qualname alone would say "getset_descriptor" for all of them.
        attr = getattr(getattr(func, "__self__", None), "__name__", None) or qual.rsplit(".", 2)[-2]
        return "Tensor." + attr + (".get" if qual.endswith(".__get__") else ".set")
    module = getattr(func, "__module__", "") or ""
    if module.startswith("torch.nn.functional"):
        return "F." + qual
    return "torch." + qual


@dataclass
class RankRecording:
    """What one rank's loader did: writes in recording order plus per-source bookkeeping."""

    rank: int
    params: dict[str, ir.TensorMeta]
    writes: list[ir.Write] = field(default_factory=list)
    fallbacks: dict[str, ir.Fallback] = field(default_factory=dict)
    fed: list[str] = field(default_factory=list)  # names fed to the loader, in order
    ops_seen: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    tier: str = "fast"  # which recorder produced this: "fast" or "full" (see record_loader)
    tier_note: str = ""  # why the fast tier gave up, when it did

    def not_needed(self) -> list[str]:
        read: set[str] = set()
        for w in self.writes:
            ir.sources(w.src.leaf, read)
        # dict.fromkeys: a name fed again after a fallback (see _unfinished) is listed once
        return [n for n in dict.fromkeys(self.fed) if n not in read and n not in self.fallbacks]

    def to_plan(self) -> ir.RankPlan:
        used = sorted({w.param for w in self.writes})
        return ir.RankPlan(
            rank=self.rank,
            params=tuple(self.params[p] for p in used),
            writes=tuple(self.writes),
            fallbacks=tuple(sorted(self.fallbacks.values(), key=lambda f: f.source)),
            not_needed=tuple(sorted(self.not_needed())),
        )


def region_in(dst: torch.Tensor, param: torch.Tensor) -> ir.Region:
    return ir.Region(dst.storage_offset() - param.storage_offset(), tuple(dst.shape), tuple(dst.stride()))


def tensor_args(args, kwargs) -> list:
    out = []
    for a in args:
        if isinstance(a, TensorBase):
            out.append(a)
        elif type(a) is list or type(a) is tuple:
            out.extend(x for x in a if isinstance(x, TensorBase))
    if kwargs:
        out.extend(a for a in kwargs.values() if isinstance(a, TensorBase))
    return out
