"""The pieces of the live SGLang integration that need no engine: the `sglang.srt.plugins` entry point is installed
and, opted in (SHARDPLAN_SGLANG=1), registers the shardplan loader on SGLang's ModelRunner through its hook registry
(once, and without duplicating a --custom-weight-loader given by hand); a command crosses SGLang's own deserializer
(SafeUnpickler) as an empty tensor whose name carries it; `as_client` takes an in-process sgl.Engine; the trainer side
refuses a plan whose options differ from the engine's resolved server args by name, before anything is sent."""

from __future__ import annotations

import importlib.metadata
import pathlib
from types import SimpleNamespace

import pytest

from shardplan.engine.clients import as_client
from shardplan.engine.errors import EnginePlanMismatch
from shardplan.engine.sglang import plugin
from shardplan.engine.sglang.checks import check_server_info
from shardplan.engine.sglang.client import SglangClient
from shardplan.engine.sglang.commands import LOAD_FORMAT, command_payload, parse
from shardplan.plan.file.format import PlanFile, decode
from shardplan.plan.layout import Layout
from shardplan.record import cpushim
from shardplan.record.sglang.options import SglangOptions
from shardplan.record.sglang.session import SglangRecordSession

QWEN3_TINY = str(pathlib.Path(__file__).resolve().parent / "qwen3-tiny")


def test_the_entry_point_registers_the_loader_on_every_model_runner(monkeypatch):
    monkeypatch.setenv("SHARDPLAN_SGLANG", "1")  # the opt-in (without it: tests/unit/test_sglang_commands.py)
    (ep,) = [e for e in importlib.metadata.entry_points(group="sglang.srt.plugins") if e.name == "shardplan"]
    assert ep.value == "shardplan.engine.sglang.plugin:register"
    cpushim.activate()
    from sglang.srt.plugins.hook_registry import HookRegistry

    ep.load()()
    ep.load()()  # SGLang may load plugins more than once per process
    hooks = [h for _, h, _ in HookRegistry._hooks[plugin.TARGET]]
    assert hooks.count(plugin._add_loader) == 1
    HookRegistry.apply_hooks()
    from sglang.srt.model_executor.model_runner import ModelRunner

    for given in ([], [LOAD_FORMAT], ["my.loader"]):
        loaders = list(given)
        runner = SimpleNamespace(weight_updater=SimpleNamespace(custom_weight_loaders=loaders))
        plugin._add_loader(None, runner)
        assert loaders.count(LOAD_FORMAT) == 1 and set(given) <= set(loaders)
    assert ModelRunner.init_weight_updater.__wrapped__.__qualname__ == "ModelRunner.init_weight_updater"  # hooked


def test_a_command_crosses_sglangs_deserializer():
    from sglang.srt.utils import MultiprocessingSerializer

    command = {"op": "update", "version": 7, "id": "x", "control": ["127.0.0.1", 1]}
    payload = command_payload(command, 2)
    assert len(payload) == 2
    ((name, tensor),) = MultiprocessingSerializer.deserialize(payload[1])
    assert parse(name) == command and tensor.numel() == 0 and tensor.to("cpu").numel() == 0
    assert parse("model.layers.0.mlp.up_proj.weight") is None


def test_as_client_takes_an_in_process_engine():
    Engine = type("Engine", (), {"__module__": "sglang.srt.entrypoints.engine"})
    client = as_client(Engine())
    assert isinstance(client, SglangClient) and client.name == "sglang-engine"


def test_server_args_that_differ_from_the_plan_are_refused_by_name():
    s = SglangRecordSession(QWEN3_TINY, Layout(tp=2), options=SglangOptions())  # SGLang's GPU loaders
    plan_file = PlanFile(*decode(s.encode(s.record_plans([0, 1]).body)), "tiny.plan")
    info = dict(tp_size=2, pp_size=1, ep_size=1, dp_size=1, device="cuda", moe_runner_backend="auto")
    info.update(enable_dp_attention=False, enable_dp_lm_head=False, moe_dense_tp_size=None)
    info.update(moe_a2a_backend="none", ep_num_redundant_experts=0)
    check_server_info(info, plan_file)
    with pytest.raises(EnginePlanMismatch, match=r"layout: plan tp2, engine tp4 pp1.*nothing was sent"):
        check_server_info({**info, "tp_size": 4}, plan_file)
    with pytest.raises(EnginePlanMismatch, match="cpu_engine: plan False, engine True"):
        check_server_info({**info, "device": "cpu"}, plan_file)
    with pytest.raises(EnginePlanMismatch, match="ep_size: plan 1, engine 2"):
        check_server_info({**info, "ep_size": 2}, plan_file)
