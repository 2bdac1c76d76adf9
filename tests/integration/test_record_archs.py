"""Recording + replay == vLLM's real `load_weights`, bit for bit, across architectures, layouts, ranks and dtypes.

For every built-in model (shrunk by `shrink_overrides`) and every extra architecture in tests/archs/, hypothesis draws
a layout (TP 1/2/4, PP 1/2, and for MoE models EP on/off and DP 1/2), a rank, a dtype and a checkpoint seed; the rank
is recorded on the meta device (CPU where the model cannot be built on meta) and checked with `verify.verify_rank`:
both models start NaN-poisoned, one runs vLLM's real loader, the other the recorded plan through the reference
interpreter (plus the real loader for fallback tensors only), and every floating-point parameter and buffer must be
bitwise equal. On top of that, per drawn case:

* no parameter the plan writes is left with an unwritten (NaN) element;
* every checkpoint name is accounted for exactly once: recorded (read by some write), fallback, or not needed;
* non-vacuity: >= 95% of the names are recorded or legitimately not needed on that rank (other PP stages' layers,
  other EP ranks' experts), and the only fallbacks are the ones tests/archs declares for that architecture.

Also: `test_ep_reads_every_expert_once` records every rank of a small EP layout and checks that each per-expert
checkpoint tensor is read by exactly one rank (the one vLLM's linear placement assigns it to);
`test_verify_catches_wrong_plans` checks that the harness itself fails a plan with a dropped or shifted write;
`test_architecture_exercises_its_behaviour` checks that each extra architecture still shows the loader behaviour it is
here for (a cat of one source, a copying reshape, an in-place zero_, a constant index, ...); and two tests pin bugs of
recording many models in one process (vLLM's id-keyed pipeline cache, the Transformers backend's class decoration).

RecordSessions and recorded plans are cached per (model, overrides, layout, dtype) for the process
(tests/integration/arch_sessions.py). HYPOTHESIS_PROFILE=thorough draws many more cases per architecture.
"""

from __future__ import annotations

import re
from dataclasses import replace

import archs
import pytest
from arch_sessions import ALL_ARCHS, BUILTINS, EXTRAS, arch_experts, arch_spec, get_plan, get_session, shrink_overrides
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.control import note as _note

from shardplan.plan import ir
from shardplan.plan.layout import Layout
from shardplan.plan.unwritten import unwritten_ranges
from shardplan.record import verify
from shardplan.record.session import RecordSession


# the block-FP8 built-ins need 128-aligned shrinks and their own checkpoint: tests/integration/test_fp8_quantize.py
def test_every_builtin_and_extra_is_covered():
    for name in BUILTINS:
        shrink_overrides(name)  # raises for a built-in added without shrink overrides
    assert set(EXTRAS) == set(archs.ARCHS), "every tests/archs/<name>/config.json needs an entry in archs.ARCHS"
    assert len(EXTRAS) >= 10


# ---- the property -------------------------------------------------------------------------------------------------
def note(text: str) -> None:
    if currently_in_test_context():  # hypothesis prints notes for failing examples only
        _note(text)


def check_rank(arch: str, session: RecordSession, layout: Layout, rank: int, plan: ir.RankPlan, seed: int) -> None:
    names = [n for n, _, _ in session.tensors]
    recorded = plan.sources_read()
    fallbacks = {f.source for f in plan.fallbacks}
    not_needed = set(plan.not_needed)
    note(
        f"{arch} {layout.tag()} rank {rank} {session.dtype}: {len(recorded)} recorded, {len(fallbacks)} fallback, "
        f"{len(not_needed)} not needed of {len(names)}; fallbacks: {sorted(fallbacks)}"
    )

    # every name exactly once: recorded, fallback or not needed (a loader that stopped early would leave names out)
    assert not (recorded & fallbacks) and not (recorded & not_needed) and not (fallbacks & not_needed)
    assert recorded | fallbacks | not_needed == set(names)
    # only the declared fallbacks, and non-vacuity on the rest
    unexpected = sorted(n for n in fallbacks if not archs.expected_fallback(arch, n))
    assert not unexpected, f"unexpected fallbacks: {[f for f in plan.fallbacks if f.source in unexpected]}"
    scored = [n for n in names if not archs.expected_fallback(arch, n)]
    ok = sum(1 for n in scored if n in recorded or n in not_needed)
    assert ok >= 0.95 * len(scored), f"only {ok} of {len(scored)} names recorded or not needed"
    assert plan.writes, "an empty plan proves nothing"

    checkpoint = verify.random_checkpoint(session.tensors, seed)
    verdict = verify.verify_rank(session.vllm_config, layout, rank, plan, checkpoint)
    assert verdict.num_params > 0
    assert not verdict.mismatched, f"replay differs from vLLM's loader in {verdict.mismatched}"
    planned = {p.name for p in plan.params}
    holes = sorted(planned & set(verdict.unwritten))
    if arch in UNDEFINED_PADDING and not layout.ep:  # elements no checkpoint tensor defines, NaN in both models
        holes = [h for h in holes if not (".experts." in h and verdict.undefined[h][0] < verdict.undefined[h][1])]
    assert not holes, f"params the plan writes still hold NaN after replay: {holes}"
    # what the engine zeroes (derived from writes and shapes alone) is what the real loader leaves undefined
    derived = {name: sum(hi - lo for lo, hi in spans) for name, spans in unwritten_ranges(plan).items()}
    assert derived == {n: verdict.undefined[n][0] for n in planned & set(verdict.undefined)}


@pytest.mark.budget(100, reason="records and verifies every rank of each architecture against vLLM's loader")
@pytest.mark.parametrize("arch", ALL_ARCHS)
@settings(
    max_examples=archs.examples(ci=5, thorough=40),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(data=st.data())
def test_replay_equals_real_loader(arch, data, arch_root):
    experts = arch_experts(arch)
    moe = experts > 0
    # first elements are what hypothesis tries first: TP 2 (sharding), EP on
    tp = data.draw(st.sampled_from([2, 4, 1]), label="tp")
    pp = data.draw(st.sampled_from([1, 2]), label="pp")
    ep = data.draw(st.sampled_from([True, False]), label="ep") if moe else False
    dp = data.draw(st.sampled_from([1, 2]), label="dp") if moe else 1
    dtype = data.draw(st.sampled_from(["bfloat16", "float16"]), label="dtype")
    layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep)
    # more EP ranks than experts leaves a rank without experts, which vLLM's loaders do not handle (Llama 4 indexes
    # its first local expert) although vLLM accepts the layout
    assume(not ep or dp * tp <= experts)
    model, overrides = arch_spec(arch, dtype, arch_root)
    session = get_session(model, overrides, layout, dtype)
    assume(session is not None)  # vLLM rejects the layout for this model (e.g. TP does not divide the heads)
    rank = data.draw(st.integers(0, layout.world_size - 1), label="rank")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    recorded = get_plan(session, (model, overrides, layout, dtype), rank)
    assume(recorded is not None)  # vLLM refuses to build this layout
    plan, stats = recorded
    note(f"recorded on {stats.device} in {stats.seconds:.2f}s")
    check_rank(arch, session, layout, rank, plan, seed)


# ---- the recorder's two tiers agree ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ALL_ARCHS)
@settings(
    max_examples=archs.examples(ci=2, thorough=10),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(data=st.data())
def test_fast_tier_equals_full_tier(arch, data, arch_root):
    """record_loader tries the fast tier (plain meta tensors, sinks only) and hands over to the full tier (RecTensor)
    when it meets anything it cannot vouch for. Where the fast tier completes, its plan must be the full tier's, write
    for write; the built-ins (the models whose recording time matters) must all take the fast tier."""
    experts = arch_experts(arch)
    tp = data.draw(st.sampled_from([2, 4, 1]), label="tp")
    ep = data.draw(st.sampled_from([True, False]), label="ep") if experts else False
    layout = Layout(tp=tp, ep=ep)
    model, overrides = arch_spec(arch, "bfloat16", arch_root)
    session = get_session(model, overrides, layout, "bfloat16")
    assume(session is not None)
    rank = data.draw(st.integers(0, layout.world_size - 1), label="rank")
    recorded = get_plan(session, (model, overrides, layout, "bfloat16"), rank)
    assume(recorded is not None)
    plan, stats = recorded
    note(f"auto: {stats.tier} tier {stats.tier_note}")
    if arch in BUILTINS and arch not in FULL_TIER_BUILTINS:
        assert stats.tier == "fast", f"the fast tier gave up: {stats.tier_note}"
    full_session = replace_tier(session, "full")
    full_plan, full_stats = full_session.record_rank(rank)
    assert full_stats.tier == "full"
    assert plan == full_plan, "the fast and the full tier recorded different plans"


# Built-ins whose real loader leaves part of a param unwritten: the padding no checkpoint tensor defines (verify
# reports it per param; docs/configs.md).
UNDEFINED_PADDING = {"kimi-linear-48b-a3b": "vLLM pads each rank's expert intermediate at TP > 1 without EP"}


# Built-ins whose loaders the fast tier cannot vouch for (recorded exactly by the full tier, only slower).
FULL_TIER_BUILTINS = {
    "gpt-oss-120b": "its expert loader makes a scratch tensor (torch.empty)",
    "qwen3-next-80b-a3b": "Tensor.__setitem__ on the parameter linear_attn.conv1d.weight",
    "qwen3.5-397b-a17b": "Tensor.__setitem__ on the parameter linear_attn.conv1d.weight (Qwen3-Next's Gated DeltaNet)",
    "minimax-m2": "Tensor.to on its routing bias (e_score_correction_bias)",
}


def replace_tier(session: RecordSession, tier: str) -> RecordSession:
    """The same session (config, tensors) recording with another tier."""
    other = object.__new__(RecordSession)
    other.__dict__.update(session.__dict__)
    other.tier = tier
    return other


# ---- expert parallelism: every expert tensor read by exactly one rank ---------------------------------------------
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@pytest.mark.parametrize(
    "arch,layout",
    [
        ("qwen3-30b-a3b", Layout(tp=2, ep=True)),
        ("deepseek-v3", Layout(tp=2, dp=2, ep=True)),
        ("mixtral-8x7b", Layout(tp=4, ep=True)),
    ],
    ids=lambda v: v.tag() if isinstance(v, Layout) else v,
)
def test_ep_reads_every_expert_once(arch, layout):
    overrides = tuple(shrink_overrides(arch))
    session = get_session(arch, overrides, layout, "bfloat16")
    assert session is not None
    expert_names = {n for n, _, _ in session.tensors if _EXPERT.search(n)}
    num_experts = len({int(_EXPERT.search(n).group(1)) for n in expert_names})
    assert expert_names and num_experts >= layout.world_size
    readers: dict[str, list[int]] = {n: [] for n in expert_names}
    for rank in range(layout.world_size):
        plan, _ = get_plan(session, (arch, overrides, layout, "bfloat16"), rank)
        assert not plan.fallbacks
        read = plan.sources_read()
        for n in read & expert_names:
            readers[n].append(rank)
        # linear placement: EP rank i (position in the EP group) holds experts [i*E/n, (i+1)*E/n)
        ep_ranks = layout.ep_ranks(rank)
        per_rank = num_experts // len(ep_ranks)
        i = ep_ranks.index(rank)
        mine = {n for n in expert_names if i * per_rank <= int(_EXPERT.search(n).group(1)) < (i + 1) * per_rank}
        assert read & expert_names == mine, f"rank {rank} reads other ranks' experts or misses its own"
        assert (expert_names - mine) <= set(plan.not_needed)
    assert all(len(r) == 1 for r in readers.values()), {n: r for n, r in readers.items() if len(r) != 1}
    # and the replay of one EP rank is exact
    plan, _ = get_plan(session, (arch, overrides, layout, "bfloat16"), layout.world_size - 1)
    check_rank(arch, session, layout, layout.world_size - 1, plan, seed=1)


# ---- the harness fails wrong plans --------------------------------------------------------------------------------
def test_verify_catches_wrong_plans():
    arch, overrides, layout = "llama-3.1-8b", tuple(shrink_overrides("llama-3.1-8b")), Layout(tp=2)
    session = get_session(arch, overrides, layout, "bfloat16")
    plan, _ = get_plan(session, (arch, overrides, layout, "bfloat16"), 1)
    checkpoint = verify.random_checkpoint(session.tensors, 0)
    assert verify.verify_rank(session.vllm_config, layout, 1, plan, checkpoint).mismatched == []

    # a dropped write leaves NaN where the real loader wrote values
    i = next(i for i, w in enumerate(plan.writes) if w.param.endswith("layers.0.self_attn.o_proj.weight"))
    dropped = replace(plan, writes=plan.writes[:i] + plan.writes[i + 1 :])
    assert plan.writes[i].param in verify.verify_rank(session.vllm_config, layout, 1, dropped, checkpoint).mismatched

    # reading rank 0's shard instead of rank 1's (source region moved to offset 0) gives wrong values
    w = next(w for w in plan.writes if isinstance(w.src.leaf, ir.Source) and "down_proj" in w.src.leaf.name)
    assert w.src.region.offset != 0
    moved = replace(w, src=replace(w.src, region=replace(w.src.region, offset=0)))
    shifted = replace(plan, writes=tuple(moved if x is w else x for x in plan.writes))
    assert w.param in verify.verify_rank(session.vllm_config, layout, 1, shifted, checkpoint).mismatched


# ---- one process, many models -------------------------------------------------------------------------------------
def test_models_recorded_one_after_another_do_not_share_pipeline_state():
    """vLLM caches each model's pipeline-missing layers by id(model) (models/utils.py). shardplan builds and frees many
    models in one process, and a new model that reuses a freed model's id used to inherit its list: layers wrongly
    skipped as not needed, or KeyErrors for layers it lacks (seen with Llama 4 after a few dozen models). Whether ids
    get reused is up to the allocator, so check the contract (every build forgets the cache: a stale entry planted
    under any id is gone) and alternate PP and non-PP models."""
    import gc

    from vllm.model_executor.models import utils as model_utils

    arch, overrides = "llama-3.1-8b", tuple(shrink_overrides("llama-3.1-8b"))
    pp2, flat = Layout(tp=1, pp=2), Layout(tp=1)
    s_pp2, s_flat = get_session(arch, overrides, pp2, "bfloat16"), get_session(arch, overrides, flat, "bfloat16")
    names = {n for n, _, _ in s_flat.tensors}
    checkpoint = verify.random_checkpoint(s_flat.tensors, 0)
    for _ in range(2):
        for session, rank in ((s_pp2, 1), (s_flat, 0), (s_pp2, 0)):
            gc.collect()
            model_utils._model_to_pp_missing_layer_names[12345] = ["model.layers.0."]  # a stale entry
            plan, _ = session.record_rank(rank)
            assert 12345 not in model_utils._model_to_pp_missing_layer_names
            if session is s_flat:
                assert plan.sources_read() == names and not plan.not_needed
            else:
                assert {n for n in plan.sources_read() if n.startswith("model.layers.")} == {
                    n for n in names if n.startswith(f"model.layers.{rank}.")
                }
            verdict = verify.verify_rank(session.vllm_config, session.layout, rank, plan, checkpoint)
            assert not verdict.mismatched


def test_listing_checkpoints_after_the_transformers_backend_built_that_class():
    """vLLM's Transformers backend decorates the transformers model class in place (@support_torch_compile), after
    which building that class needs a current vLLM config: a later session listing the checkpoint of another config
    of the same class (a transformers meta build) must still work."""
    from shardplan.record import checkpoint as shardplan_checkpoint

    layout = Layout(tp=2)
    backend = get_session(str(archs.HERE / "llama_transformers"), (), layout, "bfloat16")
    get_plan(backend, (str(archs.HERE / "llama_transformers"), (), layout, "bfloat16"), 0)
    overrides = [*shrink_overrides("llama-3.1-8b"), "intermediate_size=192"]  # a config not listed before
    shardplan_checkpoint._META_CACHE.clear()
    session = RecordSession("llama-3.1-8b", layout, overrides=overrides)
    assert any(n.endswith("mlp.down_proj.weight") and s == (128, 192) for n, s, _ in session.tensors)


# ---- each extra architecture still exercises what it is here for --------------------------------------------------
def _calls(plan: ir.RankPlan) -> list[ir.Call]:
    out: list[ir.Call] = []

    def walk(leaf):
        if isinstance(leaf, ir.Call):
            out.append(leaf)
            for v in leaf.inputs:
                walk(v.leaf)
        elif isinstance(leaf, ir.Update):
            walk(leaf.base)
            walk(leaf.value.leaf)

    for w in plan.writes:
        walk(w.src.leaf)
    return out


def _one_source(call: ir.Call) -> set[str]:
    names: set[str] = set()
    for v in call.inputs:
        ir.sources(v.leaf, names)
    return names


WITNESSES = {
    # (1) torch.cat with three inputs, all views of one fused query_key_value
    "falcon": (
        Layout(tp=2),
        1,
        lambda plan, device: any(
            c.op == "torch.cat" and len(c.inputs) == 3 and len(_one_source(c)) == 1 for c in _calls(plan)
        ),
    ),
    # (2) a reshape that copies; (6) built on the CPU
    "bloom": (
        Layout(tp=2),
        1,
        lambda plan, device: device == "cpu" and any(c.op == "Tensor.reshape" for c in _calls(plan)),
    ),
    # (3) zero_ of the loaded bias on a TP rank != 0, applied to a clone; (2) permute + contiguous
    "gpt_oss": (
        Layout(tp=2),
        1,
        lambda plan, device: (
            any(isinstance(w.src.leaf, ir.Update) and "Tensor.zero_" in ir.literal_ops(w.src.leaf) for w in plan.writes)
            and any(c.op == "Tensor.contiguous" for c in _calls(plan))
        ),
    ),
    # (4) experts indexed with a constant index tensor whose values are this EP rank's experts
    "llama4": (
        Layout(tp=2, ep=True),
        1,
        lambda plan, device: any(
            c.op == "Tensor.__getitem__" and any(isinstance(a, ir.Const) and a.values == (2, 3) for a in c.args)
            for c in _calls(plan)
        ),
    ),
    # (8) -exp(A_log): composed_weight_loader (mamba2) over the loaded parameter, A_weight_loader (mamba) over the
    # loaded tensor; D/dt_bias (sharded_weight_loader) recorded; no fallback
    "mamba2": (
        Layout(tp=2),
        1,
        lambda plan, device: (
            not plan.fallbacks and _exp_writes(plan) == 2 and any(n.endswith("mixer.D") for n in plan.sources_read())
        ),
    ),
    "mamba": (Layout(tp=2), 1, lambda plan, device: not plan.fallbacks and _exp_writes(plan) == 2),
    # (9) lm_head.bias, created by the loader, declared and written
    "phi": (
        Layout(tp=2),
        1,
        lambda plan, device: (
            not plan.fallbacks
            and "lm_head.bias" in {p.name for p in plan.params}
            and "lm_head.bias" in plan.sources_read()
        ),
    ),
    # multi-output views
    "granitemoe": (Layout(tp=2), 1, lambda plan, device: not _calls(plan) and not plan.fallbacks),
}


def _exp_writes(plan: ir.RankPlan) -> int:
    """Writes of A computed with torch.exp from an A_log checkpoint tensor."""
    return sum(
        w.param.endswith(".A")
        and "torch.exp" in ir.literal_ops(w.src.leaf)
        and all(s.endswith(".A_log") for s in ir.sources(w.src.leaf))
        for w in plan.writes
    )


@pytest.mark.parametrize("arch", sorted(WITNESSES))
def test_architecture_exercises_its_behaviour(arch, arch_root):
    layout, rank, witness = WITNESSES[arch]
    model, overrides = arch_spec(arch, "bfloat16", arch_root)
    session = get_session(model, overrides, layout, "bfloat16")
    plan, stats = get_plan(session, (model, overrides, layout, "bfloat16"), rank)
    assert witness(plan, stats.device), plan.format({s.name: s for s in session.sources})
    # (5) everywhere: vocabulary padding rows written as constants on the last TP rank (vocab is not a multiple of 64)
    assert any(isinstance(w.src.leaf, ir.Full) and w.dst.numel > 0 for w in plan.writes)
    assert stats.device == ("cpu" if arch == "bloom" else "meta")
