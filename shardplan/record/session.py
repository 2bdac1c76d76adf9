"""One model + one layout + one dtype: the unit that `shardplan record` and `shardplan verify` work on."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from shardplan import models
from shardplan.plan import ir
from shardplan.plan.compile import PlanBody, check_layer_invariance, compile_plans, extend_layers
from shardplan.plan.inspect import group_bytes
from shardplan.plan.layout import Layout
from shardplan.plan.names import layer_of, without_layer
from shardplan.plan.planfile import encode
from shardplan.plan.placement import slot_sources
from shardplan.record import eplb, fp8
from shardplan.runtime.quantize import quantizer_id
from shardplan.record.build import build_for_recording, loading_context, make_vllm_config
from shardplan.record.checkpoint import checkpoint_tensors
from shardplan.record.configs import check_architecture, hf_view, shrink_layers_overrides
from shardplan.record.loader import record_loader


@dataclass
class RankStats:
    rank: int
    num_recorded: int
    num_fallback: int
    num_not_needed: int
    nbytes: int
    seconds: float
    device: str
    tier: str = "fast"    # which recorder tier recorded it (record.loader.record_loader)
    tier_note: str = ""   # why the fast tier gave up, when it did


@dataclass
class Recorded:
    """What `RecordSession.record_plans` made: the compiled plan body of every rank asked for, per-rank figures, and
    how it was recorded (sampled layers extended to all, or every layer, and why)."""
    body: PlanBody
    stats: list[RankStats]
    how: str


class RecordSession:
    def __init__(self, model: str, layout: Layout, *, dtype: str = "bfloat16", overrides: Sequence[str] = (),
                 strict: bool = False, tier: str = "auto", eplb_redundant: int | None = None):
        self._model, self._overrides, self.eplb_redundant = model, list(overrides), eplb_redundant
        self.spec = models.resolve_model(model, list(overrides))
        self.layout, self.dtype, self.strict, self.tier = layout, dtype, strict, tier
        view = hf_view(self.spec)  # the config as vLLM's config class reads it: unknown override keys, sizes, named
        check_architecture(self.spec)
        self.vllm_config = make_vllm_config(self.spec.materialize(config=view.config), layout, dtype, self.spec.name)
        from vllm.config import set_current_vllm_config

        # Once vLLM's Transformers backend has built a model, it has decorated that transformers class in place with
        # @support_torch_compile, whose __init__ needs a current vLLM config: listing the tensors of another config of
        # the same class (a transformers meta build) would fail later in this process without one.
        with set_current_vllm_config(self.vllm_config):
            self.tensors = fp8.fp8_checkpoint_tensors(checkpoint_tensors(self.spec, dtype), self.spec.config)
        self.sources = [ir.TensorMeta(n, tuple(s), d) for n, s, d in self.tensors]
        self.eplb = None   # EPLB redundant slots (record/eplb.py): recorded tensors gain one per slot
        if eplb_redundant is not None:
            self.eplb = eplb.eplb_slots(self.tensors, layout, eplb_redundant, self.spec.config, self.spec.name)
            eplb.enable_eplb(self.vllm_config, eplb_redundant)
            self.sources += slot_sources(self.sources, self.eplb)
            self.tensors = eplb.recording_tensors(self.tensors, self.eplb)

    @property
    def vllm_version(self) -> str:
        import vllm

        return vllm.__version__

    def record_rank(self, rank: int) -> tuple[ir.RankPlan, RankStats]:
        t0 = time.perf_counter()
        model, device = build_for_recording(self.vllm_config, self.layout, rank)
        with loading_context(self.vllm_config, self.layout, rank), \
                (eplb.identity_slots() if self.eplb else contextlib.nullcontext()):
            # loaders ask for the TP/EP rank while loading
            recording = record_loader(model, self.tensors, rank=rank, strict=self.strict, tier=self.tier)
        plan = recording.to_plan() if self.eplb is None else eplb.slot_plan(recording.to_plan(), self.eplb)
        del model
        stats = RankStats(rank, len(plan.sources_read()), len(plan.fallbacks), len(plan.not_needed),
                          plan_nbytes(plan, {s.name: s for s in self.sources}), time.perf_counter() - t0, device,
                          recording.tier, recording.tier_note)
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
                     progress: Callable[[RankStats], None] | None = None) -> Recorded:
        """The compiled plans of `ranks`. Unless exhaustive, records every rank on a model cut to the first few
        layers (enough for each class of identical layers to appear twice), checks that same-class layers are renamed
        copies of each other, and extends them to every layer at compile time. Falls back to recording every layer
        whenever a check fails; the result is byte-identical either way (bench/compile_bench.py checks it)."""
        if exhaustive:
            return self._record_all_layers(ranks, progress, "exhaustive (asked)")
        return self._record_sampled(ranks, progress)

    def _record_all_layers(self, ranks, progress, how: str) -> Recorded:
        plans, stats = self.record(ranks, progress)
        return Recorded(compile_plans(plans, self.sources), stats, how)

    def _record_sampled(self, ranks, progress) -> Recorded:
        classes = layer_classes(self.tensors)
        num_layers = len(classes)
        if self.layout.pp > 1 or num_layers < 4:
            return self._record_all_layers(ranks, progress,
                                           "exhaustive (pipeline parallel or too few layers to sample)")
        members: dict[tuple, list[int]] = {}
        for layer, signature in sorted(classes.items()):
            members.setdefault(signature, []).append(layer)
        sampled = sorted({m for ms in members.values() for m in ms[:2]})
        num_sampled = sampled[-1] + 1
        if num_sampled >= num_layers:
            return self._record_all_layers(ranks, progress, "exhaustive (layers do not repeat enough to sample)")
        shrunk = RecordSession(self._model, self.layout, dtype=self.dtype, strict=self.strict,
                               overrides=[*self._overrides, *shrink_layers_overrides(self.spec, num_sampled)],
                               eplb_redundant=self.eplb_redundant)
        expected = [t for t in self.tensors if layer_of(t[0]) < num_sampled]
        if sorted(shrunk.tensors) != sorted(expected):
            return self._record_all_layers(
                ranks, progress, "exhaustive (the cut model's checkpoint differs from the full one's first layers)")
        plans, stats = shrunk.record(ranks, progress)
        reps = {ms[0]: [m for m in ms[1:2] if m < num_sampled] for ms in members.values()}
        problem = check_layer_invariance(plans, reps)
        if problem:
            return self._record_all_layers(ranks, progress, f"exhaustive (sampling check failed: {problem})")
        full_layers = {ms[0]: ms for ms in members.values()}
        drop = {m for ms in members.values() for m in ms[1:2]}
        body = extend_layers(compile_plans(plans, shrunk.sources), full_layers, drop, self.sources)
        how = (f"sampled: recorded layers {sampled} of {num_layers} on every rank, extended to {len(members)} layer "
               f"classes")
        return Recorded(body, [self._stats_from_body(body, s) for s in stats], how)

    def _stats_from_body(self, body: PlanBody, s: RankStats) -> RankStats:
        nbytes = sum(group_bytes(body, s.rank).values())
        num_read = num_sources_read(body, s.rank)
        fallbacks = len(body.fallbacks.get(s.rank, ()))
        return RankStats(s.rank, num_read, fallbacks, len(self.sources) - num_read - fallbacks, nbytes, s.seconds,
                         s.device, s.tier, s.tier_note)

    def encode(self, body: PlanBody) -> bytes:
        """The plan file's bytes for a compiled body (Recorded.body, or compile_plans of recorded RankPlans)."""
        return encode(body, model=self.spec.hf_id or self.spec.name, architecture=self.spec.architecture,
                      config_sha256=self.spec.config_sha256, layout=self.layout, dtype=self.dtype,
                      vllm_version=self.vllm_version, quantizer=self.quantizer, eplb=self.eplb)

    @property
    def quantizer(self) -> str:
        """The quantizer id a plan of a block-FP8 config expects the trainer to use ("" for unquantized configs): the
        recorded checkpoint is the one the reference quantizer makes, so replaying it from BF16 needs that one."""
        block = fp8.block_size(self.spec.config)
        return quantizer_id(block) if block else ""


def plan_nbytes(plan: ir.RankPlan, sources: dict[str, ir.TensorMeta]) -> int:
    """Bytes a consumer receives: each write's destination box in the param dtype, plus whole fallback tensors."""
    dtypes = {p.name: p.dtype for p in plan.params}
    total = sum(w.dst.numel * ir.itemsize(dtypes[w.param]) for w in plan.writes)
    total += sum(sources[f.source].numel * ir.itemsize(sources[f.source].dtype) for f in plan.fallbacks)
    return total


def layer_classes(tensors) -> dict[int, tuple]:
    """layer -> signature (its checkpoint names and shapes with the layer index removed): equal signature, same class."""
    out: dict[int, list] = {}
    for name, shape, dtype in tensors:
        layer = layer_of(name)
        if layer >= 0:
            out.setdefault(layer, []).append((without_layer(name, layer), tuple(shape), dtype))
    return {layer: tuple(sorted(sig)) for layer, sig in out.items()}


def num_sources_read(body, rank: int) -> int:
    """Distinct checkpoint tensors a rank reads, counted from the templates without building names."""

    seen: set = set()
    for g in body.groups:
        sources = _source_slots(g.skeleton)
        if not sources:
            continue
        rows = g.instances(rank)
        for text, cols in sources:
            if "layers.{}." in text:
                cols = [1] + cols  # the source's layer index is fitted on the param layer (variable 1)
            for row in {tuple(r) for r in rows[:, cols].tolist()} if cols else {()}:
                seen.add((text, row))
    for w in body.ordered.get(rank, ()):
        for name in ir.sources(w.src.leaf):
            seen.add((name, ()))
    return len(seen)


def _source_slots(skeleton) -> list[tuple[str, list[int]]]:
    """(source name template, its variable columns) for each Source in a write skeleton."""
    out, pos = [], 2

    def walk(node):
        nonlocal pos
        if isinstance(node, tuple) and node:
            if node[0] == "S" and len(node) == 2 and isinstance(node[1], str):
                n = node[1].count("{}") - (1 if "layers.{}." in node[1] else 0)
                out.append((node[1], list(range(pos, pos + n))))
                pos += n
                return
            for child in node:
                walk(child)
    walk(skeleton[3])
    return out
