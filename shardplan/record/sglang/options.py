"""The SGLang server args that change which bytes a rank holds: recording options, kept in the plan header.

SGLang's layouts depend on more than TP/PP/EP sizes (docs/sglang.md): the EP size may be any divisor of TP (MoE-TP
is what is left), DP attention shards attention over TP/dp ranks only, `enable_dp_lm_head` shards the vocabulary
over the attention-TP group, `moe_dense_tp_size` the dense MLPs, the MoE runner / all-to-all backends pick other MoE
classes, redundant EPLB experts add physical slots, and `SGLANG_USE_CPU_ENGINE=1` switches every linear to a padded
CPU path. A plan is recorded under exactly these values and its header's `engine.options` holds them (all of them,
defaults included), so a live engine can compare them with its own resolved server args and refuse a plan recorded
under others. Imports nothing heavy (the trainer and the engine side read it without recording).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from shardplan.errors import ShardplanError
from shardplan.plan.file.engines import EngineInfo
from shardplan.plan.layout import Layout

ENGINE = "sglang"


class SglangOptionError(ShardplanError):
    pass


@dataclass(frozen=True)
class SglangOptions:
    """Server args of `sglang.launch_server` / `sgl.Engine` (same names), plus the CPU engine switch."""

    # metadata "server_arg": the ServerArgs field each option is read from (from_server_args) and written to
    # (server_args); cpu_engine is the SGLANG_USE_CPU_ENGINE environment switch, not a server arg.
    ep_size: int = field(default=1, metadata={"server_arg": "ep_size"})  # a divisor of --tp-size
    dp_size: int = field(
        default=1, metadata={"server_arg": "dp_size"}
    )  # with --enable-dp-attention: attention over tp/dp ranks
    enable_dp_lm_head: bool = field(default=False, metadata={"server_arg": "enable_dp_lm_head"})  # needs DP attention
    moe_dense_tp_size: int = field(default=0, metadata={"server_arg": "moe_dense_tp_size"})  # 0: unset (None), full TP
    moe_runner_backend: str = field(default="auto", metadata={"server_arg": "moe_runner_backend"})
    moe_a2a_backend: str = field(default="none", metadata={"server_arg": "moe_a2a_backend"})  # deepep, mooncake, ...
    ep_num_redundant_experts: int = field(default=0, metadata={"server_arg": "ep_num_redundant_experts"})  # EPLB slots
    cpu_engine: bool = False  # SGLANG_USE_CPU_ENGINE=1: SGLang's CPU engine (padded CPU linears)

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not type(f.default):
                raise SglangOptionError(f"SGLang option {f.name} must be a {type(f.default).__name__}, got {value!r}")
        if self.ep_size < 1 or self.dp_size < 1 or self.moe_dense_tp_size < 0 or self.ep_num_redundant_experts < 0:
            raise SglangOptionError(
                f"SGLang options: sizes must be positive (ep_size, dp_size) or >= 0 "
                f"(moe_dense_tp_size, ep_num_redundant_experts), got {self}"
            )
        if self.enable_dp_lm_head and self.dp_size == 1:
            raise SglangOptionError(
                "--enable-dp-lm-head needs DP attention (--dp-size > 1 with --enable-dp-attention), as SGLang requires"
            )

    @property
    def dp_attention(self) -> bool:
        return self.dp_size > 1

    def check_layout(self, layout: Layout) -> None:
        """SGLang's layout is tp x pp ranks (DP attention lives inside the TP group); the plan's layout says whether
        experts are split (ep true iff ep_size > 1) and these options say how."""
        if layout.dp != 1:
            raise SglangOptionError(
                f"layout {layout.tag()}: SGLang's data-parallel replicas each load what one TP group loads, so a plan "
                f"of --tp {layout.tp} serves every replica; DP attention is --enable-dp-attention --dp-size N, inside "
                f"the TP group. Drop --dp (or add --enable-dp-attention)."
            )
        if layout.ep != (self.ep_size > 1):
            raise SglangOptionError(
                f"layout {layout.tag()} with SGLang ep_size {self.ep_size}: --ep means --ep-size "
                f"> 1 (give --ep-size, default the TP size)"
            )
        for name, size in (("ep_size", self.ep_size), ("dp_size", self.dp_size)):
            if layout.tp % size:
                raise SglangOptionError(f"SGLang needs {name} ({size}) to divide tp_size ({layout.tp})")
        if self.moe_dense_tp_size and layout.tp % self.moe_dense_tp_size:
            raise SglangOptionError(
                f"SGLang needs moe_dense_tp_size ({self.moe_dense_tp_size}) to divide tp_size ({layout.tp})"
            )

    def server_args(self, layout: Layout) -> dict:
        """The ServerArgs fields of a rank of `layout` under these options."""
        out = dict(tp_size=layout.tp, pp_size=layout.pp)
        out.update(
            (f.metadata["server_arg"], getattr(self, f.name)) for f in fields(self) if "server_arg" in f.metadata
        )
        if self.dp_attention:
            out["enable_dp_attention"] = True
        else:
            del out["dp_size"]
        if not self.moe_dense_tp_size:
            del out["moe_dense_tp_size"]
        return out

    def to_header(self) -> tuple[tuple[str, bool | int | str], ...]:
        return tuple(sorted((f.name, getattr(self, f.name)) for f in fields(self)))

    def engine_info(self, version: str) -> EngineInfo:
        return EngineInfo(ENGINE, version, self.to_header())

    @classmethod
    def from_engine_info(cls, info: EngineInfo) -> "SglangOptions":
        if info.name != ENGINE:
            raise SglangOptionError(f"the plan records {info.name}'s loaders, not SGLang's")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(dict(info.options)) - known)
        if unknown:
            raise SglangOptionError(
                f"the plan's SGLang options {unknown} are unknown to this shardplan: it was "
                f"recorded by a newer one. Re-record it, or upgrade shardplan."
            )
        return cls(**dict(info.options))

    @classmethod
    def from_server_args(cls, server_args, cpu_engine: bool) -> "SglangOptions":
        """The options a live engine runs with, read from its (resolved) ServerArgs."""
        read = {}
        for f in fields(cls):
            if "server_arg" in f.metadata:
                value = getattr(server_args, f.metadata["server_arg"])
                read[f.name] = type(f.default)(f.default if value is None else value)
        if not getattr(server_args, "enable_dp_attention", False):
            read["dp_size"] = 1
        return cls(**read, cpu_engine=bool(cpu_engine))

    def differences(self, other: "SglangOptions") -> list[str]:
        return [
            f"{f.name}: plan {getattr(self, f.name)!r}, engine {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    @classmethod
    def layout_server_args(cls) -> tuple[str, ...]:
        """Every ServerArgs field a layout check reads from a live engine."""
        named = tuple(f.metadata["server_arg"] for f in fields(cls) if "server_arg" in f.metadata)
        return ("tp_size", "pp_size", "enable_dp_attention", *named)

    def tag(self) -> str:
        """File-name-safe summary of the non-default options: 'sglang', 'sglang-dpattn4-deepep', ..."""
        parts = ["sglang"]
        d = SglangOptions()
        if self.ep_size > 1:
            parts.append(f"ep{self.ep_size}")
        if self.dp_attention:
            parts.append(f"dpattn{self.dp_size}")
        if self.enable_dp_lm_head:
            parts.append("dplmhead")
        if self.moe_dense_tp_size:
            parts.append(f"densetp{self.moe_dense_tp_size}")
        if self.moe_runner_backend != d.moe_runner_backend:
            parts.append(self.moe_runner_backend.replace("_", ""))
        if self.moe_a2a_backend != d.moe_a2a_backend:
            parts.append(self.moe_a2a_backend.replace("_", ""))
        if self.ep_num_redundant_experts:
            parts.append(f"eplb{self.ep_num_redundant_experts}")
        if self.cpu_engine:
            parts.append("cpu")
        return "-".join(parts)
