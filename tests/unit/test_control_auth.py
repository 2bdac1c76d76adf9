"""The control channel proves a shared secret: every value is sealed with an HMAC over (key, value) under the secret
Control.serve made; a value written without it (a raw TCPStore client on the port) or copied to another key is
refused by name (ControlForged), and the secret travels with the Control (pickled) or SHARDPLAN_CONTROL_SECRET."""

import pickle
from datetime import timedelta

import pytest
import torch

from shardplan.transport import Control, ControlForged, PeerError


def _raw(control: Control) -> torch.distributed.TCPStore:
    """A client that knows the address but not the secret."""
    return torch.distributed.TCPStore(control.host, control.port, is_master=False, timeout=timedelta(seconds=10))


def test_a_client_without_the_secret_cannot_write_an_abort_mark_or_a_forged_value():
    control = Control.serve("127.0.0.1")
    raw = _raw(control)
    raw.set("free/3/consumer0/0", "abort: consumer0 gave up: forged")
    with pytest.raises(ControlForged, match=r"consumer0: control key 'free/3/consumer0/0': .*refused") as e:
        control.get("free/3/consumer0/0", 1.0, "consumer0", "receive slot")
    assert isinstance(e.value, PeerError) and e.value.peer == "consumer0"
    raw.set("eplb/placement/3/consumer1", '{"forged": 1}')
    with pytest.raises(ControlForged, match="eplb/placement/3/consumer1"):
        control.get("eplb/placement/3/consumer1", 5.0, "consumer1")  # waits: a TCPStore set is not acknowledged
    # a sealed value copied under another key (another version) fails: the MAC binds the key
    control.set("result/3/consumer0", '{"ok": true}')
    raw.set("result/4/consumer0", raw.get("result/3/consumer0"))
    assert control.get("result/3/consumer0", 5.0, "consumer0") == '{"ok": true}'
    with pytest.raises(ControlForged, match="result/4/consumer0"):
        control.get("result/4/consumer0", 5.0, "consumer0")
    # a value sealed under another secret fails too
    other = Control(control.host, control.port, secret=b"x" * 32)
    other.set("join/consumer0", "{}")
    with pytest.raises(ControlForged, match="join/consumer0"):
        control.get("join/consumer0", 5.0, "consumer0")


def test_the_secret_travels_with_the_control_and_by_env(monkeypatch):
    control = Control.serve("127.0.0.1")
    assert control.secret and len(control.secret_hex) == 64
    copy = pickle.loads(pickle.dumps(control))
    assert copy.secret == control.secret
    copy.set("k", "v")
    assert control.get("k", 1.0, "trainer0") == "v"
    assert Control(control.host, control.port).get("k", 5.0, "trainer0") != "v"  # no secret: the sealed text
    monkeypatch.setenv("SHARDPLAN_CONTROL_SECRET", control.secret_hex)
    assert Control(control.host, control.port).try_get("k") == "v"  # a rank on another host: by env
    assert Control(control.host, control.port, secret=control.secret_hex).try_get("k") == "v"  # or by argument
    served = Control.serve("127.0.0.1")  # a driver given the env secret serves with it (e.g. for SGLang servers)
    assert served.secret == control.secret
    monkeypatch.delenv("SHARDPLAN_CONTROL_SECRET")
    assert Control.serve("127.0.0.1").secret != control.secret  # otherwise a fresh one per serve
