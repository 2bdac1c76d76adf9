"""The live-engine integration's trainer side (shardplan.engine: trainer, clients, protocol, errors) loads with vLLM,
transformers and safetensors unimportable, and names its errors."""

from __future__ import annotations

import pytest
import torch
from blocked_imports import run_without_vllm

from shardplan.engine.clients import HttpClient, as_client
from shardplan.engine.errors import EngineCallFailed, EnginePlanMismatch, EplbRebalanceInFlight, raise_named
from shardplan.engine.protocol import EngineInitInfo


@pytest.mark.slow  # subprocesses / whole shipped plans: `make test`, not `make test-fast`
def test_trainer_side_imports_without_vllm_transformers_safetensors():
    out = run_without_vllm("""
        import shardplan.engine, shardplan.engine.trainer, shardplan.engine.clients
        import shardplan.engine.protocol, shardplan.engine.errors, shardplan.engine.sharding
        print('ok')
    """)
    assert out.strip() == "ok"


def test_worker_errors_come_back_as_the_named_class():
    """collective_rpc passes a worker's exception on as text; the backend puts the class name in front of it."""
    with pytest.raises(EplbRebalanceInFlight, match="rebalance"):
        raise_named(
            RuntimeError("Worker failed with error 'EplbRebalanceInFlight: an async rebalance may be in flight'"),
            "llm: init_weight_transfer_engine",
        )
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

    info = EngineInitInfo(
        control_host="127.0.0.1",
        control_port=1234,
        transport="mooncake:tcp",
        transport_options={"device_name": ""},
        plan_sha256="ab" * 32,
    )
    assert EngineInitInfo(**json.loads(json.dumps(info.to_dict()))) == info


def test_dtensor_placements_give_torchs_boxes_for_every_rank():
    """placement_boxes follows DTensor's own chunking (uneven: the first chunks are larger, trailing ranks may hold
    nothing), nests Shard on a 2-D mesh left to right, and takes Replicate as the whole dim."""
    from torch.distributed.tensor import Replicate, Shard

    from shardplan.engine.sharding import placement_boxes

    assert placement_boxes((5, 4), [0, 1], [Shard(0)]) == {0: ((0, 3), (0, 4)), 1: ((3, 5), (0, 4))}
    assert placement_boxes((2, 4), [0, 1, 2], [Shard(0)])[2] == ((2, 2), (0, 4))  # torch.chunk: rank 2 gets none
    mesh = [[0, 1], [2, 3]]
    assert placement_boxes((8, 6), mesh, [Shard(0), Shard(1)]) == {
        0: ((0, 4), (0, 3)),
        1: ((0, 4), (3, 6)),
        2: ((4, 8), (0, 3)),
        3: ((4, 8), (3, 6)),
    }
    assert placement_boxes((8, 6), mesh, [Shard(0), Shard(0)])[2] == ((4, 6), (0, 6))
    assert placement_boxes((8, 6), mesh, [Replicate(), Shard(1)])[3] == ((0, 8), (3, 6))


def test_placements_without_one_box_per_rank_are_refused_by_name():
    from torch.distributed.tensor import Partial, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from shardplan.engine.sharding import placement_boxes
    from shardplan.runtime.shards import ShardLayoutError

    with pytest.raises(ShardLayoutError, match="Partial"):
        placement_boxes((4,), [0, 1], [Partial()], "w")
    with pytest.raises(ShardLayoutError, match="w: placement _StridedShard"):
        placement_boxes((4,), [[0, 1], [2, 3]], [Shard(0), _StridedShard(0, split_factor=2)], "w")
    with pytest.raises(ShardLayoutError, match="2 placements for a 1-D mesh"):
        placement_boxes((4,), [0, 1], [Shard(0), Shard(0)], "w")


def test_trainer_shards_travel_as_json():
    import json

    from torch.distributed.tensor import Shard

    from shardplan.engine.sharding import placement_shards, shards_from_json, shards_to_json
    from shardplan.runtime.shards import ShardLayoutError

    shards = placement_shards({"a.weight": (6, 4), "b.weight": (3,)}, [0, 1], lambda n: [Shard(0)])
    assert shards_from_json(json.loads(json.dumps(shards_to_json(shards)))) == shards
    with pytest.raises(ShardLayoutError, match="trainer_shards is not"):
        shards_from_json({"a.weight": [[0]]})


def test_sglang_client_deletes_each_workers_reply_once_read():
    """A SGLang engine's workers answer every command (init, every update) under a key of its own in the sync's
    control store: read once, so the client deletes it (the store would keep one per command and worker otherwise)."""
    import base64
    import json
    import pickle

    from shardplan.engine.sglang.client import SglangClient
    from shardplan.engine.sglang.commands import parse, reply_key
    from shardplan.transport import Control

    control = Control.serve("127.0.0.1")
    ids = []

    class Calls:  # what the workers' loader does with a command: answer each under its reply key
        def command(self, payload):
            command = parse(pickle.loads(base64.b64decode(payload[0]))[0][0])
            ids.append(command["id"])
            for r in client.world:
                control.set(reply_key(command["id"], r), json.dumps({"ok": True}))
            return True, ""

    client = SglangClient(object(), name="fake")
    client.calls, client.control, client.world, client.reply_timeout_s = Calls(), control, [0, 1], 5.0
    client.update_weights({"version": 1})
    client.update_weights({"version": 2})
    assert len(set(ids)) == 2
    assert all(control.try_get(reply_key(i, r)) is None for i in ids for r in (0, 1))
