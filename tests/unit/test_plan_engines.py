"""Plans of another engine than vLLM (plan/file/engines.py): the header's `engine` map, its rules, and the store
choosing by engine. SGLang itself is not needed: tests/sglang records and verifies real SGLang plans."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from planfile_helpers import raw_parts, rich_plans, seal

from shardplan.models import resolve_model
from shardplan.plan.compile.compiler import compile_plans
from shardplan.plan.file import format as planfile
from shardplan.plan.file import store
from shardplan.plan.file.engines import NO_VLLM, EngineInfo, EngineInfoError, engine_name, engine_version
from shardplan.plan.file.format import PlanFieldError, PlanFile, decode
from shardplan.plan.layout import Layout
from shardplan.record.sglang.options import SglangOptionError, SglangOptions

SPEC = resolve_model("llama-3.1-8b")


def _plan(engine: EngineInfo | None, vllm_version: str = "0.32.0") -> bytes:
    plans, sources = rich_plans()
    return planfile.encode(
        compile_plans(plans, sources),
        model=SPEC.hf_id,
        architecture=SPEC.architecture,
        config_sha256=SPEC.config_sha256,
        layout=Layout(tp=2),
        dtype="bfloat16",
        vllm_version=vllm_version,
        engine=engine,
    )


SGL = SglangOptions(ep_size=1, moe_runner_backend="triton").engine_info("0.5.23")


def test_engine_map_round_trips_and_vllm_plans_have_none():
    header = PlanFile(*decode(_plan(SGL, NO_VLLM), "s.plan"), "s.plan").header
    assert header.engine == SGL and engine_name(header) == "sglang" and engine_version(header) == "0.5.23"
    assert SglangOptions.from_engine_info(header.engine) == SglangOptions(moe_runner_backend="triton")
    plain = PlanFile(*decode(_plan(None), "v.plan"), "v.plan").header
    assert plain.engine is None and engine_name(plain) == "vllm" and engine_version(plain) == "0.32.0"
    assert "engine" not in raw_parts(_plan(None))[0]  # vLLM plans' bytes are what they were before


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda e: e.update(name="trtllm"), "name must be one of"),
        (lambda e: e.pop("version"), "exactly the keys"),
        (lambda e: e.update(version="0.5 23"), "version"),
        (lambda e: e["options"].update(zz_opt=[1]), "boolean, an integer or a short word"),
        (lambda e: e["options"].update(ep_size=-1), "must lie in"),
        (lambda e: e["options"].update(ep_size="x" * 65), "short word"),
        (lambda e: e.update(options={"b": 1, "a": 2}), "sorted"),
        (lambda e: e.update(options={"Bad-Key": 1}), "sorted lowercase identifiers"),
    ],
)
def test_malformed_engine_maps_are_refused_by_name(mutate, match):
    h, b = raw_parts(_plan(SGL, NO_VLLM))
    mutate(h["engine"])
    with pytest.raises(PlanFieldError, match=match) as info:
        decode(seal(h, b), "x.plan")
    assert "header.engine" in str(info.value)


def test_engine_key_only_last():
    h, b = raw_parts(_plan(SGL, NO_VLLM))
    reordered = {"engine": h.pop("engine"), **h}
    with pytest.raises(PlanFieldError, match="header keys"):
        decode(seal(reordered, b), "x.plan")


def test_the_writer_refuses_a_bad_engine():
    with pytest.raises(EngineInfoError):
        EngineInfo("sglang", "0.5.23", (("b", 1), ("a", 1)))


def test_store_chooses_by_engine(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("SHARDPLAN_PLAN_PATH", str(tmp_path / "plans"))
    monkeypatch.setattr(store, "installed_vllm_version", lambda: "0.32.0")
    monkeypatch.setattr(store, "installed_engine_version", lambda e: {"vllm": "0.32.0", "sglang": "0.5.23"}[e])
    (tmp_path / "plans").mkdir()
    planfile.write_plan(tmp_path / "plans" / "s.plan", _plan(SGL, NO_VLLM))
    # only an SGLang plan: a vLLM consumer must not get it
    with pytest.raises(store.PlanNotFound, match="--engine sglang|no cached plan"):
        store.load_plan("llama-3.1-8b", tp=2)
    assert store.load_plan("llama-3.1-8b", tp=2, engine="sglang").header.engine == SGL
    with pytest.raises(store.PlanNotFound, match="records sglang's loaders, not vllm's"):
        store.load_plan("llama-3.1-8b", tp=2, path=tmp_path / "plans" / "s.plan")
    planfile.write_plan(tmp_path / "plans" / "v.plan", _plan(None))
    assert store.load_plan("llama-3.1-8b", tp=2).header.engine is None
    # a different installed SGLang: stale, named
    monkeypatch.setattr(store, "installed_engine_version", lambda e: {"vllm": "0.32.0", "sglang": "0.6.0"}[e])
    with pytest.raises(store.StalePlan, match="SGLang 0.5.23, but SGLang 0.6.0"):
        store.load_plan("llama-3.1-8b", tp=2, engine="sglang")


def test_sglang_options_check_layouts_by_name():
    with pytest.raises(SglangOptionError, match="Drop --dp"):
        SglangOptions().check_layout(Layout(tp=4, dp=2))
    with pytest.raises(SglangOptionError, match="ep_size \\(3\\) to divide tp_size"):
        SglangOptions(ep_size=3).check_layout(Layout(tp=4, ep=True))
    with pytest.raises(SglangOptionError, match="--ep means"):
        SglangOptions(ep_size=1).check_layout(Layout(tp=4, ep=True))
    with pytest.raises(SglangOptionError, match="needs DP attention"):
        SglangOptions(enable_dp_lm_head=True)
    with pytest.raises(SglangOptionError, match="must be a int"):
        SglangOptions(ep_size="2")
    a, b = SglangOptions(ep_size=4, moe_a2a_backend="deepep"), SglangOptions(ep_size=4)
    assert a.differences(b) == ["moe_a2a_backend: plan 'deepep', engine 'none'"]
    assert a.tag() == "sglang-ep4-deepep"
    assert SglangOptions(ep_size=8, dp_size=8, enable_dp_lm_head=True).server_args(Layout(tp=8, ep=True)) == dict(
        tp_size=8,
        pp_size=1,
        ep_size=8,
        moe_runner_backend="auto",
        moe_a2a_backend="none",
        ep_num_redundant_experts=0,
        enable_dp_lm_head=True,
        dp_size=8,
        enable_dp_attention=True,
    )


@settings(max_examples=60, deadline=None)
@given(
    ep_size=st.sampled_from([1, 2, 4, 8]),
    dp_size=st.sampled_from([1, 2, 8]),
    dp_lm_head=st.booleans(),
    dense_tp=st.sampled_from([0, 1, 2]),
    runner=st.sampled_from(["auto", "triton"]),
    a2a=st.sampled_from(["none", "deepep"]),
    redundant=st.sampled_from([0, 16]),
    cpu_engine=st.booleans(),
)
def test_sglang_options_read_back_from_the_server_args_they_write(
    ep_size, dp_size, dp_lm_head, dense_tp, runner, a2a, redundant, cpu_engine
):
    """A live engine started with a plan's server args reads back the plan's options: the two directions agree."""
    assume(dp_size > 1 or not dp_lm_head)
    options = SglangOptions(ep_size, dp_size, dp_lm_head, dense_tp, runner, a2a, redundant, cpu_engine)
    layout = Layout(tp=8, ep=ep_size > 1)
    written = options.server_args(layout)
    # SGLang's ServerArgs defaults for what a plan leaves unset
    server = SimpleNamespace(**{"dp_size": 1, "enable_dp_attention": False, "moe_dense_tp_size": None, **written})
    assert SglangOptions.from_server_args(server, cpu_engine) == options
    assert set(written) <= set(SglangOptions.layout_server_args())
