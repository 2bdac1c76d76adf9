"""The SGLang command channel never kills the server (an exception in a custom loader kills SGLang's scheduler): one
test per malformed call into the shardplan loader, with SGLang stubbed. None raises; each failure is answered by name
in the control channel when the command says where (and is well formed enough to), else logged by name, and the
worker's state says it failed. Waits are bounded by the worker's limit, plan paths confined to the server's plan
directories, a non-plan file's bytes never leave, and the plugin registers nothing without the opt-in."""

from __future__ import annotations

import itertools
import json
import logging
import socket
import sys
import threading
import time
import types

import pytest
import torch

from shardplan.engine.sglang import loader, plugin, worker
from shardplan.engine.sglang.commands import COMMAND, reply_key
from shardplan.transport import Control

SECRET = b"TOPSECRET-0123456789abcdef" * 4
LIMIT_S = 2.0  # SHARDPLAN_SGLANG_MAX_WAIT_S in these tests
_ids = itertools.count()


@pytest.fixture(scope="module")
def control():
    return Control.serve("127.0.0.1")


@pytest.fixture
def plans(tmp_path, monkeypatch, control):
    """SGLang stubbed (rank 0 of TP1), the worker fresh, the server's plan directory and wait limit, and the control
    channel's secret (an SGLang server is started with SHARDPLAN_CONTROL_SECRET, docs/transports.md)."""
    hooks = types.SimpleNamespace(_hooks={}, register=lambda t, h, k: hooks._hooks.setdefault(t, []).append((t, h, k)))
    parallel = types.SimpleNamespace(pp_rank=0, tp_size=1, tp_rank=0)
    stubs = {
        "sglang.srt.runtime_context": dict(
            get_parallel=lambda: parallel, get_context=lambda: types.SimpleNamespace(server_args=None)
        ),
        "sglang.srt.model_loader.loader": dict(post_load_weights=lambda model: None),
        "sglang.srt.plugins.hook_registry": dict(HookRegistry=hooks, HookType=types.SimpleNamespace(AFTER="after")),
    }
    for name in ("sglang", "sglang.srt", "sglang.srt.model_loader", "sglang.srt.plugins", *stubs):
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**stubs.get(name, {})))
    monkeypatch.setattr(worker, "_JOINED", None)
    monkeypatch.setattr(worker, "_ERROR", "", raising=False)
    monkeypatch.setenv("SHARDPLAN_SGLANG_PLAN_DIRS", str(tmp_path / "plans"))
    monkeypatch.setenv("SHARDPLAN_SGLANG_MAX_WAIT_S", str(LIMIT_S))
    monkeypatch.delenv("SHARDPLAN_SGLANG", raising=False)
    monkeypatch.setenv("SHARDPLAN_CONTROL_SECRET", control.secret_hex)
    (tmp_path / "plans").mkdir()
    return tmp_path / "plans"


@pytest.fixture
def send(plans, control, caplog):
    """Hand the loader one call; return the failure as the control channel answers it, else as logged."""
    model = torch.nn.Linear(2, 2)

    def send(entries, answered=None) -> str:
        entries = [(entries, torch.empty(0))] if isinstance(entries, str) else entries
        caplog.clear()
        raised, t = [], time.monotonic()
        with caplog.at_level(logging.ERROR, "shardplan.engine.sglang"):
            thread = threading.Thread(target=lambda: raised.append(_attempt(loader.load, model, entries)), daemon=True)
            thread.start()  # a thread: a call blocked past the worker's limit fails here, not by hanging the test
            thread.join(LIMIT_S + 10.0)
        assert not thread.is_alive(), f"the loader was still blocked after {time.monotonic() - t:.1f} s"
        assert raised == [None], raised  # nothing may escape: SGLang's scheduler dies on a loader exception
        error = worker.state()["error"]  # the worker's state says it failed
        assert error and error in caplog.text, (error, caplog.text)  # and its log names it
        if answered is not None:
            reply = json.loads(control.try_get(reply_key(answered, 0)) or "{}")
            assert reply.get("ok") is False and reply["error"] == error, reply
        return error

    return send


def _attempt(fn, *args):
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - the test's assertion names it
        return e


def command(store, **fields) -> dict:
    out = {"op": "update", "id": f"t{next(_ids)}", "control": [store.host, store.port], "timeout_s": 5.0}
    out.update({"offset": 0, "version": 1, **fields})
    return {k: v for k, v in out.items() if v is not ...}  # ...: the field left out


def text(cmd) -> str:
    return COMMAND + (cmd if isinstance(cmd, str) else json.dumps(cmd))


def answered(send, cmd) -> str:
    return send(text(cmd), answered=cmd["id"])


def init(control, plan_path: str) -> dict:
    return command(control, op="init", version=..., info={"plan_path": plan_path})


# ---- not a command object: logged by name (no control channel to answer in) ----------------------------------------
def test_garbled_json(send):
    assert "command: not JSON" in send(COMMAND + '{"op": "update", "id": ')


def test_a_json_list(send, control):
    assert "expected a JSON object, got list" in send(text([command(control)]))


def test_an_empty_object(send):
    assert "command field 'id' is missing" in send(text({}))


def test_a_string(send):
    assert "expected a JSON object, got str" in send(text('"update"'))


def test_a_number(send):
    assert "expected a JSON object, got int" in send(text("7"))


def test_null(send):
    assert "expected a JSON object, got NoneType" in send(text("null"))


def test_a_bad_control_address(send, control):
    assert "command field 'control': expected list" in send(text(command(control, control="127.0.0.1:1")))
    assert "command field 'control': [host, port]" in send(text(command(control, control=["127.0.0.1"])))
    assert "command field 'control': port out of range" in send(text(command(control, control=["127.0.0.1", 70000])))


def test_a_bad_offset(send, control):
    assert "command field 'offset': expected int, got str" in send(text(command(control, offset="x")))


def test_a_negative_offset(send, control):
    assert "command field 'offset': -1 is negative" in send(text(command(control, offset=-1)))


def test_deep_nesting(send, control):
    assert "not JSON (RecursionError" in send(COMMAND + "[" * 100_000 + "]" * 100_000)
    nested = command(control, op="init", version=..., info={"transport_options": {"a": [[[[[[[[1]]]]]]]]}})
    assert "nested deeper than 8 levels" in answered(send, nested)


def test_a_huge_int(send, control):
    assert "not JSON (ValueError" in send(
        text(json.dumps(command(control)).replace('"version": 1', '"version": ' + "1" * 5000))
    )
    assert "command.version: not a finite number" in answered(send, command(control, version=10**30))


def test_nan_and_inf(send, control):
    assert "command.version: not a finite number" in answered(send, command(control, version=float("nan")))
    assert "command field 'timeout_s': not a finite number" in send(text(command(control, timeout_s=float("inf"))))


def test_a_name_that_is_not_shardplans(send):
    error = send([("model.embed_tokens.weight", torch.ones(4))])
    assert "takes 'shardplan:<plan path>' entries, not 'model.embed_tokens.weight'" in error


# ---- a command with a reachable control channel: answered there by name -------------------------------------------
def test_a_missing_field(send, control):
    assert "command field 'op' is missing" in answered(send, command(control, op=...))
    assert "command field 'version' is missing" in answered(send, command(control, version=...))


def test_a_wrong_type_per_field(send, control):
    logged = {"id": 7, "control": {"host": "x"}, "offset": 1.5, "timeout_s": "5"}
    for field, value in logged.items():
        assert f"command field {field!r}: expected" in send(text(command(control, **{field: value})))
    for field, value in {"op": 1, "version": "1", "info": []}.items():
        cmd = command(control, op="init", version=..., info={}) if field == "info" else command(control)
        assert f"command field {field!r}: expected" in answered(send, {**cmd, field: value})
    info = {"plan_path": 1, "timeout_s": "30", "verify": 1, "replicas": True, "transport_options": []}
    for field, value in info.items():
        assert f"info field {field!r}: expected" in answered(send, init(control, "x") | {"info": {field: value}})


def test_unknown_extra_fields(send, control):
    assert "unknown field(s) ['evil']" in answered(send, command(control, evil=1))
    assert "'info': unknown field 'evil'" in answered(send, init(control, "x") | {"info": {"evil": 1}})


def test_an_oversize_plan_path(send, control):
    assert "command.info.plan_path: 5000 characters" in answered(send, init(control, "/p" * 2500))


def test_a_plan_path_outside_the_allowed_dirs(send, control, plans):
    (plans.parent / "other.plan").write_bytes(SECRET)
    error = answered(send, init(control, str(plans.parent / "other.plan")))
    assert "is outside the plan directories this server allows" in error and "TOPSECRET" not in error
    assert "outside" in answered(send, init(control, str(plans / ".." / "other.plan")))


def test_etc_shadow(send, control):
    error = answered(send, init(control, "/etc/shadow"))
    assert "'/etc/shadow' is outside the plan directories" in error and "root" not in error


def test_a_symlink_escaping_the_allowed_dir(send, control, plans):
    (plans.parent / "secret").write_bytes(SECRET)
    (plans / "link.plan").symlink_to(plans.parent / "secret")
    error = answered(send, init(control, str(plans / "link.plan")))
    assert "is outside the plan directories" in error and "TOPSECRET" not in error


def test_a_non_plan_file_inside_the_allowed_dir(send, control, plans, caplog):
    (plans / "fake.plan").write_bytes(SECRET)
    error = answered(send, init(control, str(plans / "fake.plan")))
    assert "is not a readable shardplan plan (PlanCorrupt)" in error
    assert "TOPSECRET" not in error and "TOPSECRET" not in caplog.text


def test_a_command_mixed_with_weight_bytes(send, control):
    cmd = command(control)
    mixed = [(text(cmd), torch.empty(0)), ("shardplan:/x.plan", torch.ones(8, dtype=torch.uint8))]
    assert "mixes shardplan-sync commands with weight bytes" in send(mixed, answered=cmd["id"])
    cmd = command(control)
    assert "mixes" in send([(text(cmd), torch.ones(8, dtype=torch.uint8))], answered=cmd["id"])


# ---- waits: the worker's limit, not the command's -------------------------------------------------------------------
def test_an_unreachable_control_address(send, control):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    t = time.monotonic()
    assert "ControlUnreachable" in send(text(command(control, control=["127.0.0.1", port], timeout_s=1e6)))
    assert time.monotonic() - t < LIMIT_S + 3.0


def test_a_silent_control_address_ends_within_the_workers_limit(send, control):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # accepts (the kernel does) and never answers
        cmd, t = command(control, control=["127.0.0.1", s.getsockname()[1]], timeout_s=1e6), time.monotonic()
        error = send(text(cmd))
        took = time.monotonic() - t
    assert took < LIMIT_S + 3.0 and "did not answer in 2.0 s" in error, (took, error)


# ---- the plugin ------------------------------------------------------------------------------------------------------
def test_the_plugin_registers_nothing_without_the_opt_in(plans, monkeypatch, caplog):
    hooks = sys.modules["sglang.srt.plugins.hook_registry"].HookRegistry._hooks
    with caplog.at_level(logging.INFO, "shardplan.engine.sglang"):
        plugin.register()  # an SGLang server where shardplan is merely installed
    assert plugin.TARGET not in hooks and "SHARDPLAN_SGLANG=1" in caplog.text
    monkeypatch.setenv("SHARDPLAN_SGLANG", "1")
    plugin.register()
    assert [h for _, h, _ in hooks[plugin.TARGET]] == [plugin._add_loader]


# ---- the control channel's secret travels in the envelope ----------------------------------------------------------
def test_the_envelope_carries_the_control_secret(send, control, monkeypatch):
    """A worker started without SHARDPLAN_CONTROL_SECRET answers, sealed, with the secret its command carried (the
    test reads the reply through a Control holding the secret: an unsealed one would raise ControlForged); a
    malformed secret is refused by name."""
    monkeypatch.delenv("SHARDPLAN_CONTROL_SECRET")
    error = answered(send, command(control, secret=control.secret_hex))  # an update before any init: answered
    assert "ControlForged" not in error and "CommandError" not in error, error
    assert "command field 'secret'" in send(text(command(control, secret="XYZ")))
