"""An SGLang plan is just another plan: `shardplan record --engine sglang` writes a plan file whose header names the
engine and its recording options; sampled layers and extended ranks give the same bytes as recording everything;
`load_plan(engine="sglang")` finds it; the trainer-side runtime (Replayer -> buffer -> Applier, no SGLang) fills a
NaN-poisoned SGLang model exactly as SGLang's own `load_weights` does; and SGLang options given without
`--engine sglang`, or a plain --dp, are refused by name."""

from __future__ import annotations

import re

import pytest
import torch
from arch_sessions import shrink_overrides

from shardplan.cli import main
from shardplan.plan.file import store
from shardplan.plan.file.format import PlanFile, decode
from shardplan.plan.layout import Layout
from shardplan.record import verify
from shardplan.record.sglang.options import SglangOptions
from shardplan.record.sglang.session import SglangRecordSession
from shardplan.record.sglang.verify import _poison_all, compare, module_tensors
from shardplan.runtime.apply import Applier
from shardplan.runtime.pack import PackLayout
from shardplan.runtime.replay import Replayer


def _record(tmp_path, *extra: str, model="qwen3-30b-a3b", layers=6) -> PlanFile:
    args = ["record", "--engine", "sglang", "--model", model, *extra, "--out", str(tmp_path)]
    for o in [o for o in shrink_overrides(model) if not o.startswith("num_hidden_layers")] + [
        f"num_hidden_layers={layers}"
    ]:
        args += ["--override", o]
    assert main(args) == 0
    (path,) = tmp_path.glob("*.plan")
    return PlanFile.read(path)


@pytest.mark.parametrize(
    "extra, tag, ep_size, dp_size",
    [
        (["--tp", "4", "--ep", "--ep-size", "2"], "tp4-ep-sglang-ep2", 2, 1),
        (["--tp", "4", "--ep", "--enable-dp-attention", "--dp", "2"], "tp4-ep-sglang-ep4-dpattn2", 4, 2),
        (["--tp", "2", "--pp", "2"], "tp2-pp2-sglang", 1, 1),
    ],
)
def test_sampled_and_extended_equals_exhaustive(tmp_path, extra, tag, ep_size, dp_size):
    model = "deepseek-v3" if "--enable-dp-attention" in extra else "qwen3-30b-a3b"
    sampled = _record(tmp_path / "s", *extra, model=model)
    exhaustive = _record(tmp_path / "e", *extra, "--exhaustive", model=model)
    assert sampled.path.endswith(f"--{tag}--bfloat16.plan"), sampled.path
    assert open(sampled.path, "rb").read() == open(exhaustive.path, "rb").read()
    h = sampled.header
    assert h.vllm_version == "none" and h.engine.name == "sglang" and h.engine.version == "0.5.23"
    options = SglangOptions.from_engine_info(h.engine)
    assert (options.ep_size, options.dp_size) == (ep_size, dp_size)


def test_load_plan_finds_it_by_engine(tmp_path, monkeypatch):
    plan = _record(tmp_path, "--tp", "2", "--ep", model="qwen3-30b-a3b", layers=2)
    overrides = [o for o in shrink_overrides("qwen3-30b-a3b") if not o.startswith("num_hidden_layers")] + [
        "num_hidden_layers=2"
    ]
    found = store.load_plan("qwen3-30b-a3b", tp=2, ep=True, overrides=overrides, engine="sglang", path=plan.path)
    assert found.header == plan.header
    with pytest.raises(store.PlanNotFound, match="records sglang's loaders, not vllm's"):
        store.load_plan("qwen3-30b-a3b", tp=2, ep=True, overrides=overrides, path=plan.path)


@pytest.mark.parametrize(
    "model, layout, options",
    [
        ("deepseek-v3", Layout(tp=2, ep=True), SglangOptions(ep_size=2)),
        ("qwen3-30b-a3b", Layout(tp=4, ep=True), SglangOptions(ep_size=2, dp_size=2)),
    ],
)
def test_runtime_replay_fills_an_sglang_model_like_its_loader(model, layout, options):
    """Through the plan file and the trainer's runtime: pack the rank's bytes from HF-named tensors, apply them to the
    params of a NaN-poisoned SGLang model, run SGLang's post_load_weights (as end_weight_update does) ==
    load_weights."""
    s = SglangRecordSession(model, layout, options=options, overrides=shrink_overrides(model))
    recorded = s.record_plans(list(range(layout.world_size)))
    plan_file = PlanFile(*decode(s.encode(recorded.body)), "<sglang plan>")
    checkpoint = verify.random_checkpoint(s.tensors, 11)
    for rank in range(layout.world_size):
        plan = plan_file.rank(rank)
        real = s.builder.build(rank, "cpu")
        _poison_all(real)
        with torch.no_grad(), s.builder.as_rank(rank):
            real.load_weights(iter(list(checkpoint.items())))
        replayed = s.builder.build(rank, "cpu")
        _poison_all(replayed)
        params = dict(replayed.named_parameters())
        replayer = Replayer(plan, plan_file.sources)
        with torch.no_grad():
            Applier(plan, PackLayout.from_plans(plan, 256, None), params).apply(replayer.pack(checkpoint))
            with s.builder.as_rank(rank):
                if hasattr(replayed, "post_load_weights"):
                    replayed.post_load_weights()
        verdict = verify.RankVerdict(rank)
        compare(module_tensors(real), module_tensors(replayed), verdict)
        assert verdict.ok, (rank, verdict.mismatched)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--ep-size", "2", "--tp", "2", "--ep"], "--ep-size is an SGLang server arg: add --engine sglang"),
        (["--engine", "sglang", "--tp", "2", "--dp", "2"], "data-parallel replicas"),
        (["--engine", "sglang", "--tp", "4", "--ep", "--ep-size", "3"], "ep_size \\(3\\) to divide tp_size"),
    ],
)
def test_cli_refuses_engine_args_by_name(tmp_path, capsys, argv, match):
    assert main(["record", "--model", "qwen3-30b-a3b", *argv, "--out", str(tmp_path)]) == 2
    assert re.search(match, capsys.readouterr().err)
