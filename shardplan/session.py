"""One model + one layout + one dtype: the unit that `shardplan record` and `shardplan verify` work on."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from . import ir
from .layout import Layout


@dataclass
class RankStats:
    rank: int
    num_recorded: int
    num_fallback: int
    num_not_needed: int
    nbytes: int
    seconds: float
    device: str


class RecordSession:
    def __init__(self, model: str, layout: Layout, *, dtype: str = "bfloat16", overrides: Sequence[str] = (),
                 strict: bool = False):
        from . import models  # vLLM side only
        from .build import make_vllm_config

        self.spec = models.resolve_model(model, list(overrides))
        self.layout, self.dtype, self.strict = layout, dtype, strict
        self.vllm_config = make_vllm_config(self.spec.materialize(), layout, dtype, self.spec.name)
        self.tensors = models.checkpoint_tensors(self.spec, dtype)
        self.sources = [ir.TensorMeta(n, tuple(s), d) for n, s, d in self.tensors]

    @property
    def vllm_version(self) -> str:
        import vllm

        return vllm.__version__

    def record_rank(self, rank: int) -> tuple[ir.RankPlan, RankStats]:
        from .build import build_for_recording
        from .record import record_loader

        t0 = time.perf_counter()
        model, device = build_for_recording(self.vllm_config, self.layout, rank)
        recording = record_loader(model, self.tensors, rank=rank, strict=self.strict)
        plan = recording.to_plan()
        del model
        stats = RankStats(rank, len(plan.sources_read()), len(plan.fallbacks), len(plan.not_needed),
                          plan_nbytes(plan, {s.name: s for s in self.sources}), time.perf_counter() - t0, device)
        return plan, stats

    def record(self, ranks: Iterable[int], progress: Callable[[RankStats], None] | None = None):
        plans, stats = [], []
        for rank in ranks:
            plan, s = self.record_rank(rank)
            plans.append(plan)
            stats.append(s)
            if progress:
                progress(s)
        return plans, stats

    def record_plans(self, ranks: Sequence[int], *, exhaustive: bool = False,
                     progress: Callable[[RankStats], None] | None = None):
        return self.record(ranks, progress)

    def encode(self, plans: Sequence[ir.RankPlan]) -> bytes:
        from .compile import compile_plans
        from .planfile import encode

        body = compile_plans(plans, self.sources)
        return encode(body, model=self.spec.hf_id or self.spec.name, architecture=self.spec.architecture,
                      config_sha256=self.spec.config_sha256, layout=self.layout, dtype=self.dtype,
                      vllm_version=self.vllm_version)


_ITEMSIZE = {"float64": 8, "float32": 4, "int64": 8, "int32": 4, "bfloat16": 2, "float16": 2, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype, 4)


def plan_nbytes(plan: ir.RankPlan, sources: dict[str, ir.TensorMeta]) -> int:
    """Bytes a consumer receives: each write's destination box in the param dtype, plus whole fallback tensors."""
    dtypes = {p.name: p.dtype for p in plan.params}
    total = sum(w.dst.numel * itemsize(dtypes[w.param]) for w in plan.writes)
    total += sum(sources[f.source].numel * itemsize(sources[f.source].dtype) for f in plan.fallbacks)
    return total
