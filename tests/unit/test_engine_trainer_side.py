"""The live-engine integration's trainer side (shardplan.engine: trainer, clients, protocol, errors) loads with vLLM,
transformers and safetensors unimportable, and names its errors."""
from __future__ import annotations

import pytest
import torch

from shardplan.engine.clients import HttpClient, as_client
from shardplan.engine.errors import EngineCallFailed, EnginePlanMismatch, EplbNotSupported, raise_named
from shardplan.engine.protocol import EngineInitInfo
from blocked_imports import run_without_vllm


def test_trainer_side_imports_without_vllm_transformers_safetensors():
    out = run_without_vllm("""
        import shardplan.engine, shardplan.engine.trainer, shardplan.engine.clients
        import shardplan.engine.protocol, shardplan.engine.errors
        print('ok')
    """)
    assert out.strip() == "ok"


def test_worker_errors_come_back_as_the_named_class():
    """collective_rpc passes a worker's exception on as text; the backend puts the class name in front of it."""
    with pytest.raises(EplbNotSupported, match="enable_eplb"):
        raise_named(RuntimeError("Worker failed with error 'EplbNotSupported: the engine runs with EPLB "
                                 "(enable_eplb)'"), "llm: init_weight_transfer_engine")
    with pytest.raises(EnginePlanMismatch, match="^http://x: init"):
        raise_named(RuntimeError("HTTP 500 ... EnginePlanMismatch: a.plan is for dtype float16"), "http://x: init")
    with pytest.raises(EngineCallFailed, match="ConnectionRefusedError"):
        raise_named(ConnectionRefusedError("refused"), "http://x: pause")


def test_engine_handles_are_recognised_or_refused_by_name():
    assert isinstance(as_client("http://127.0.0.1:8000/"), HttpClient)
    assert as_client("http://127.0.0.1:8000/").base_url == "http://127.0.0.1:8000"
    with pytest.raises(TypeError, match="cannot drive Tensor"):
        as_client(torch.zeros(1))


def test_init_info_travels_as_plain_json():
    import json
    info = EngineInitInfo(control_host="127.0.0.1", control_port=1234, transport="mooncake:tcp",
                          transport_options={"device_name": ""}, plan_sha256="ab" * 32)
    assert EngineInitInfo(**json.loads(json.dumps(info.to_dict()))) == info
