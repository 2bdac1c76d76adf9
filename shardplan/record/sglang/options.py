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

from dataclasses import dataclass, fields

from shardplan.errors import ShardplanError
from shardplan.plan.file.engines import EngineInfo
from shardplan.plan.layout import Layout

ENGINE = "sglang"


class SglangOptionError(ShardplanError):
    pass


@dataclass(frozen=True)
class SglangOptions:
    """Server args of `sglang.launch_server` / `sgl.Engine` (same names), plus the CPU engine switch."""

    ep_size: int = 1  # --ep-size: the MoE expert-parallel width, a divisor of --tp-size
    dp_size: int = 1  # --dp-size with --enable-dp-attention: attention over tp/dp ranks
    enable_dp_lm_head: bool = False  # --enable-dp-lm-head (needs DP attention)
    moe_dense_tp_size: int = 0  # --moe-dense-tp-size (0: unset, dense MLPs use the full TP)
    moe_runner_backend: str = "auto"  # --moe-runner-backend
    moe_a2a_backend: str = "none"  # --moe-a2a-backend (deepep, mooncake, ...)
    ep_num_redundant_experts: int = 0  # --ep-num-redundant-experts (EPLB's extra physical expert slots)
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
        out = dict(
            tp_size=layout.tp,
            pp_size=layout.pp,
            ep_size=self.ep_size,
            moe_runner_backend=self.moe_runner_backend,
            moe_a2a_backend=self.moe_a2a_backend,
            ep_num_redundant_experts=self.ep_num_redundant_experts,
            enable_dp_lm_head=self.enable_dp_lm_head,
        )
        if self.dp_attention:
            out.update(dp_size=self.dp_size, enable_dp_attention=True)
        if self.moe_dense_tp_size:
            out["moe_dense_tp_size"] = self.moe_dense_tp_size
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
        dp_attention = bool(getattr(server_args, "enable_dp_attention", False))
        return cls(
            ep_size=int(server_args.ep_size),
            dp_size=int(server_args.dp_size) if dp_attention else 1,
            enable_dp_lm_head=bool(server_args.enable_dp_lm_head),
            moe_dense_tp_size=int(server_args.moe_dense_tp_size or 0),
            moe_runner_backend=str(server_args.moe_runner_backend),
            moe_a2a_backend=str(server_args.moe_a2a_backend),
            ep_num_redundant_experts=int(server_args.ep_num_redundant_experts),
            cpu_engine=bool(cpu_engine),
        )

    def differences(self, other: "SglangOptions") -> list[str]:
        return [
            f"{f.name}: plan {getattr(self, f.name)!r}, engine {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

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
