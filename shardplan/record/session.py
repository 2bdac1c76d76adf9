"""One model + one layout + one dtype: the unit that `shardplan record` and `shardplan verify` work on."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from shardplan import models
from shardplan.plan import ir
from shardplan.plan.body import PlanBody
from shardplan.plan.compile.compiler import check_layer_invariance, compile_plans, extend_layers, layer_split_templates
from shardplan.plan.compile.extend import body_from_flat, flat_rank
from shardplan.plan.file.format import encode
from shardplan.plan.file.rank import rank_columns
from shardplan.plan.layout import Layout
from shardplan.plan.names import layer_of, without_layer
from shardplan.plan.placement import slot_sources
from shardplan.record import eplb, fp8, remote
from shardplan.record.build import build_for_recording, loading_context, make_vllm_config
from shardplan.record.checkpoint import checkpoint_tensors
from shardplan.record.configs import check_architecture, hf_view, shrink_layers_overrides
from shardplan.record.figures import rank_figures
from shardplan.record.loader import record_loader
from shardplan.record.ranks import extend_ranks
from shardplan.runtime.quantize import quantizer_id


@dataclass
class RankStats:
    rank: int
    num_recorded: int
    num_fallback: int
    num_not_needed: int
    nbytes: int
    seconds: float
    device: str
    tier: str = "fast"  # which recorder tier recorded it (record.loader.record_loader)
    tier_note: str = ""  # why the fast tier gave up, when it did


@dataclass
class Recorded:
    """What `RecordSession.record_plans` made: the compiled plan body of every rank asked for, per-rank figures, and
    how it was recorded (sampled layers extended to all, or every layer, and why)."""

    body: PlanBody
    stats: list[RankStats]
    how: str


class RecordSession:
    def __init__(
        self,
        model: str,
        layout: Layout,
        *,
        dtype: str = "bfloat16",
        overrides: Sequence[str] = (),
        strict: bool = False,
        tier: str = "auto",
        eplb_redundant: int | None = None,
        trust_remote_code: bool = False,
    ):
        self._model, self._overrides, self.eplb_redundant = model, list(overrides), eplb_redundant
        self.spec = models.resolve_model(model, list(overrides))
        self.layout, self.dtype, self.strict, self.tier = layout, dtype, strict, tier
        self.trust_remote_code = trust_remote_code
        if trust_remote_code:  # the checkpoint directory's own code runs from here on, and only it (record/remote.py)
            remote.trust(self.spec)
        with self._hub_off():
            # the config as vLLM's config class reads it: unknown override keys, sizes, named
            view = hf_view(self.spec)
            check_architecture(self.spec)
            config_dir = self.spec.materialize(config=view.config)
            remote.copy_code(self.spec, config_dir)
            self.vllm_config = make_vllm_config(config_dir, layout, dtype, self.spec.name, trust_remote_code)
            from vllm.config import set_current_vllm_config

            # Once vLLM's Transformers backend has built a model, it has decorated that transformers class in place
            # with @support_torch_compile, whose __init__ needs a current vLLM config: listing the tensors of another
            # config of the same class (a transformers meta build) would fail later in this process without one.
            with set_current_vllm_config(self.vllm_config):
                self.tensors = fp8.fp8_checkpoint_tensors(checkpoint_tensors(self.spec, dtype), self.spec.config)
            self.sources = [ir.TensorMeta(n, tuple(s), d) for n, s, d in self.tensors]
            self.eplb = None  # EPLB redundant slots (record/eplb.py): recorded tensors gain one per slot
            if eplb_redundant is not None:
                self.eplb = eplb.eplb_slots(self.tensors, layout, eplb_redundant, self.spec.config, self.spec.name)
                eplb.enable_eplb(self.vllm_config, eplb_redundant)
                self.sources += slot_sources(self.sources, self.eplb)
                self.tensors = eplb.recording_tensors(self.tensors, self.eplb)

    def _hub_off(self):
        """With --trust-remote-code, the hub switched off while vLLM and transformers read the config and build the
        model (remote.hub_offline): the directory's code is all that runs, and nothing is fetched."""
        return remote.hub_offline() if self.trust_remote_code else contextlib.nullcontext()

    def with_overrides(self, overrides: Sequence[str]) -> "RecordSession":
        """The same recording on the config with `overrides` (the cut model of a sampled recording)."""
        return type(self)(self._model, self.layout, overrides=overrides, **self._session_options())

    def _session_options(self) -> dict:
        """What with_overrides carries over (an engine's session adds its own recording options)."""
        return dict(
            dtype=self.dtype,
            strict=self.strict,
            eplb_redundant=self.eplb_redundant,
            trust_remote_code=self.trust_remote_code,
        )

    @property
    def vllm_version(self) -> str:
        import vllm

        return vllm.__version__

    def _record_loader(self, rank: int):
        """Build the rank's model and record its loader: (the recording, the build device). The engine's part."""
        model, device = build_for_recording(self.vllm_config, self.layout, rank)
        with (
            loading_context(self.vllm_config, self.layout, rank),
            eplb.identity_slots() if self.eplb else contextlib.nullcontext(),
        ):
            # loaders ask for the TP/EP rank while loading
            return record_loader(model, self.tensors, rank=rank, strict=self.strict, tier=self.tier), device

    def record_rank(self, rank: int) -> tuple[ir.RankPlan, RankStats]:
        t0 = time.perf_counter()
        with self._hub_off():
            recording, device = self._record_loader(rank)
        plan = recording.to_plan() if self.eplb is None else eplb.slot_plan(recording.to_plan(), self.eplb)
        stats = RankStats(
            rank,
            len(plan.sources_read()),
            len(plan.fallbacks),
            len(plan.not_needed),
            plan_nbytes(plan, {s.name: s for s in self.sources}),
            time.perf_counter() - t0,
            device,
            recording.tier,
            recording.tier_note,
        )
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

    def record_plans(
        self, ranks: Sequence[int], *, exhaustive: bool = False, progress: Callable[[RankStats], None] | None = None
    ) -> Recorded:
        """The compiled plans of `ranks`. Unless exhaustive, records on a model cut to the first few layers (enough
        for each class of identical layers to appear twice), checks that same-class layers are renamed copies of each
        other, and extends them to every layer at compile time; and records only the ranks that determine and check
        each rank class's affine dependence on the rank (record/ranks.py), predicting the others. Falls back to
        recording every layer / more ranks whenever a check fails; the result is byte-identical either way
        (bench/compile_bench.py and tests/unit/test_extend_ranks.py check it)."""
        if exhaustive:
            plans, stats = self.record(ranks, progress)
            return Recorded(compile_plans(plans, self.sources), stats, "exhaustive (asked)")
        return self._record_sampled(ranks, progress)

    def _record_ranks(self, session: "RecordSession", ranks, progress) -> tuple[PlanBody, list, list, str]:
        """(compiled body of every rank in `ranks` on `session`'s model, the plans actually recorded, their stats,
        how the ranks were covered)."""
        plans: list[ir.RankPlan] = []
        stats: list[RankStats] = []

        def record(rank: int):
            plan, s = session.record_rank(rank)
            plans.append(plan)
            stats.append(s)
            if progress:
                progress(s)
            return flat_rank(plan)

        ext = extend_ranks(self.layout, ranks, record, self.num_experts)
        body = body_from_flat(ext.flats, session.sources)
        how = f"ranks {_ranges(sorted(ext.recorded))} recorded ({len(ext.recorded)} of {len(ranks)})"
        if len(ext.recorded) < len(ranks):
            how += ", the others extended affinely in the rank, each rank class's line checked on a recorded rank"
        if ext.notes:
            how += f"; {len(ext.notes)} check(s) failed, so more ranks were recorded (first: {ext.notes[0]})"
        return body, plans, stats, how

    @property
    def num_experts(self) -> int:
        """Routed experts of the model (0 if none): the EP ranks holding one more expert form their own rank class."""
        try:
            return int(self.vllm_config.model_config.get_num_experts() or 0)
        except (AttributeError, TypeError, ValueError):
            return 0

    def _record_all_layers(self, ranks, progress, how: str) -> Recorded:
        body, _, stats, ranks_how = self._record_ranks(self, ranks, progress)
        return Recorded(body, self._stats(body, ranks, stats), f"{how}; {ranks_how}")

    def _record_sampled(self, ranks, progress) -> Recorded:
        classes = layer_classes(self.tensors)
        num_layers = len(classes)
        if self.layout.pp > 1 or num_layers < 4:
            return self._record_all_layers(
                ranks, progress, "exhaustive (pipeline parallel or too few layers to sample)"
            )
        members: dict[tuple, list[int]] = {}
        for layer, signature in sorted(classes.items()):
            members.setdefault(signature, []).append(layer)
        sampled = sorted({m for ms in members.values() for m in ms[:2]})
        num_sampled = sampled[-1] + 1
        if num_sampled >= num_layers:
            return self._record_all_layers(ranks, progress, "exhaustive (layers do not repeat enough to sample)")
        shrunk = self.with_overrides([*self._overrides, *shrink_layers_overrides(self.spec, num_sampled)])
        expected = [t for t in self.tensors if layer_of(t[0]) < num_sampled]
        if sorted(shrunk.tensors) != sorted(expected):
            return self._record_all_layers(
                ranks, progress, "exhaustive (the cut model's checkpoint differs from the full one's first layers)"
            )
        cut_body, plans, stats, ranks_how = self._record_ranks(shrunk, ranks, progress)
        reps = {ms[0]: [m for m in ms[1:2] if m < num_sampled] for ms in members.values()}
        problem = check_layer_invariance(plans, reps) or layer_split_templates(cut_body, reps)
        if problem:
            return self._record_all_layers(ranks, progress, f"exhaustive (sampling check failed: {problem})")
        full_layers = {ms[0]: ms for ms in members.values()}
        # every cut layer but the representatives: interleaved classes (Kimi-Linear's KDA/MLA, Qwen3-Next's) put
        # members of one class between the sampled ones, and extension regenerates them from the representative
        drop = {m for ms in members.values() for m in ms[1:] if m < num_sampled}
        body = extend_layers(cut_body, full_layers, drop, self.sources)
        problem = unwritten_after_extension(cut_body, body, sorted({p.rank for p in plans} | {ranks[len(ranks) // 2]}))
        if problem:
            return self._record_all_layers(ranks, progress, f"exhaustive (extension check failed: {problem})")
        how = (
            f"sampled: recorded layers {sampled} of {num_layers}, extended to {len(members)} layer classes; {ranks_how}"
        )
        multiplicity = {**{m: 0 for m in drop}, **{rep: len(ms) for rep, ms in full_layers.items()}}
        return Recorded(body, self._stats(cut_body, ranks, stats, multiplicity), how)

    def _stats(self, body: PlanBody, ranks, recorded: list[RankStats], multiplicity=None) -> list[RankStats]:
        """Every rank's figures counted from the body (whole model; `multiplicity`: layers per sampled layer), with the
        recording time and tier of the ranks recorded ("extended" for the ones predicted)."""
        figures = rank_figures(body, multiplicity)
        by_rank = {s.rank: s for s in recorded}
        out = []
        for r in ranks:
            s = by_rank.get(r) or RankStats(r, 0, 0, 0, 0, 0.0, "-", "extended")
            num_read, num_fallback, nbytes = figures[r]
            out.append(
                RankStats(
                    r,
                    num_read,
                    num_fallback,
                    len(self.sources) - num_read - num_fallback,
                    nbytes,
                    s.seconds,
                    s.device,
                    s.tier,
                    s.tier_note,
                )
            )
        return out

    def encode(self, body: PlanBody) -> bytes:
        """The plan file's bytes for a compiled body (Recorded.body, or compile_plans of recorded RankPlans)."""
        return encode(
            body,
            model=self.spec.hf_id or self.spec.name,
            architecture=self.spec.architecture,
            config_sha256=self.spec.config_sha256,
            layout=self.layout,
            dtype=self.dtype,
            vllm_version=self.vllm_version,
            quantizer=self.quantizer,
            eplb=self.eplb,
            trust_remote_code=self.trust_remote_code,
            engine=self.engine_info,
        )

    @property
    def engine_info(self):
        """The plan header's `engine` (None: vLLM, the default engine)."""
        return None

    @property
    def quantizer(self) -> str:
        """The quantizer id a plan of a block-FP8 config expects the trainer to use ("" for unquantized configs): the
        recorded checkpoint is the one the reference quantizer makes, so replaying it from BF16 needs that one."""
        block = fp8.block_size(self.spec.config)
        return quantizer_id(block) if block else ""


def unwritten_after_extension(cut_body: PlanBody, body: PlanBody, ranks: Sequence[int]) -> str | None:
    """None when, on each of `ranks`, every param the extended body declares is written, unless its layer-free name
    was unwritten on the cut model too (a fallback's loader writes params the plan cannot name); else a note naming
    one. A second line of defence behind the sampling checks: an extension bug that drops writes (one did: qwen3-next's
    conv1d.weight of 31 layers) shows as a declared param with no write, which vLLM's strict load would refuse to
    leave uninitialised. Costs one instantiation per rank checked."""

    def unwritten(b: PlanBody, rank: int) -> set[str]:
        return set(b.rank_params.get(rank, ())) - set(rank_columns(b, rank, "<extended plan>").written_params())

    def free(name: str) -> str:
        return without_layer(name, layer_of(name))

    for rank in ranks:
        if rank not in body.rank_params:
            continue
        missing = unwritten(body, rank)
        if missing:
            expected = {free(n) for n in unwritten(cut_body, rank)} if rank in cut_body.rank_params else set()
            new = sorted(n for n in missing if free(n) not in expected)
            if new:
                return f"rank {rank}: {len(new)} declared param(s) never written after the extension, e.g. {new[0]}"
    return None


def plan_nbytes(plan: ir.RankPlan, sources: dict[str, ir.TensorMeta]) -> int:
    """Bytes a consumer receives: each write's destination box in the param dtype, plus whole fallback tensors."""
    dtypes = {p.name: p.dtype for p in plan.params}
    total = sum(w.dst.numel * ir.itemsize(dtypes[w.param]) for w in plan.writes)
    total += sum(sources[f.source].numel * ir.itemsize(sources[f.source].dtype) for f in plan.fallbacks)
    return total


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'"""
    out: list[list[int]] = []
    for r in ranks:
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def layer_classes(tensors) -> dict[int, tuple]:
    """layer -> signature (its checkpoint names and shapes with the layer index removed): equal signature, same
    class."""
    out: dict[int, list] = {}
    for name, shape, dtype in tensors:
        layer = layer_of(name)
        if layer >= 0:
            out.setdefault(layer, []).append((without_layer(name, layer), tuple(shape), dtype))
    return {layer: tuple(sorted(sig)) for layer, sig in out.items()}
