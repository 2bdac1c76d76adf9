"""`shardplan record --engine sglang`: SGLang's own `load_weights` recorded on the meta device, compiled into an
ordinary plan (the plan format, compiler, replay runtime and transports are the vLLM path's; docs/sglang.md).

Everything but the build and the load is `RecordSession`'s: checkpoint names from the config, the two recorder tiers,
sampled layers, rank extension, compile. The SGLang parts: the model is built by SGLang for a faked rank
(build.SglangBuilder), loaded under that rank's RuntimeContext with `post_load_weights` deferred, and the header names
the engine, its version and the recording options (options.SglangOptions).
"""

from __future__ import annotations

import importlib.metadata
from typing import Sequence

from shardplan import models
from shardplan.plan import ir
from shardplan.plan.file.engines import NO_VLLM
from shardplan.plan.layout import Layout
from shardplan.record import fp8
from shardplan.record.checkpoint import checkpoint_tensors
from shardplan.record.configs import hf_view
from shardplan.record.loader import record_loader
from shardplan.record.session import RecordSession
from shardplan.record.sglang.build import SglangBuilder, post_load_deferred
from shardplan.record.sglang.options import SglangOptionError, SglangOptions


def sglang_version() -> str:
    return importlib.metadata.version("sglang").split("+")[0]


class SglangRecordSession(RecordSession):
    engine = "sglang"

    def __init__(
        self,
        model: str,
        layout: Layout,
        *,
        dtype: str = "bfloat16",
        overrides: Sequence[str] = (),
        strict: bool = False,
        tier: str = "auto",
        options: SglangOptions | None = None,
        eplb_redundant: int | None = None,
    ):
        if eplb_redundant is not None:
            raise SglangOptionError(
                "--eplb-redundant is vLLM's EPLB; SGLang's redundant experts are "
                "--ep-num-redundant-experts (an SGLang recording option)"
            )
        self.options = options or SglangOptions(ep_size=layout.tp if layout.ep else 1)
        self._model, self._overrides, self.eplb_redundant, self.eplb = model, list(overrides), None, None
        self.trust_remote_code = False  # SGLang's models are built without remote code
        self.spec = models.resolve_model(model, list(overrides))
        self.layout, self.dtype, self.strict, self.tier = layout, dtype, strict, tier
        view = hf_view(self.spec)
        self.builder = SglangBuilder(
            self.spec.materialize(config=view.config), layout, self.options, dtype, self.spec.name
        )
        self.tensors = fp8.fp8_checkpoint_tensors(checkpoint_tensors(self.spec, dtype), self.spec.config)
        self.sources = [ir.TensorMeta(n, tuple(s), d) for n, s, d in self.tensors]

    def _session_options(self) -> dict:
        return dict(dtype=self.dtype, strict=self.strict, tier=self.tier, options=self.options)

    @property
    def vllm_version(self) -> str:
        return NO_VLLM

    @property
    def num_experts(self) -> int:
        return self.builder.num_experts

    def _record_loader(self, rank: int):
        model = self.builder.build(rank, "meta")
        with self.builder.as_rank(rank), post_load_deferred(model):
            return record_loader(model, self.tensors, rank=rank, strict=self.strict, tier=self.tier), "meta"

    @property
    def engine_info(self):
        return self.options.engine_info(sglang_version())
