"""What the trainer side sends a live SGLang engine's shardplan loader, and where the workers answer. No SGLang here.

SGLang 0.5.23 reaches every TP worker with a caller's data through `update_weights_from_tensor(named_tensors,
load_format=<custom loader>)` (the in-process `sgl.Engine` method and the HTTP route alike; only between
begin/end_weight_update). The shardplan loader takes two kinds of entries:

* `shardplan:<plan path>` -> this rank's packed bytes (colocated push, `client.push`);
* `shardplan-sync:<json command>` with an empty tensor: a command of the sync engine ("init": check the plan and
  join the sync as consumer<rank>; "update": receive version v over the sync's transport and apply it).

SGLang answers a custom loader call with one success flag for all ranks, and an exception inside it kills the
scheduler. So the loader never raises on a command: each worker writes its outcome (ok, error, version, complete)
into the sync's control channel under `reply_key(command id, rank)`, and its latest state under `state_key(rank)`;
the trainer side reads them from there (`client.SglangClient`).
"""

from __future__ import annotations

import base64
import json
import pickle
import struct

from shardplan.engine.protocol import state_key as protocol_state_key
from shardplan.transport.base import consumer_name

LOAD_FORMAT = "shardplan.engine.sglang.loader.load"
PREFIX = "shardplan:"
COMMAND = "shardplan-sync:"


def reply_key(command_id: str, rank: int) -> str:
    return f"sglang/{command_id}/consumer{rank}"


def state_key(consumer_id: int) -> str:
    return protocol_state_key(consumer_name(consumer_id))  # where the driver reads every worker's state


def command_payload(command: dict, tp_size: int) -> list[str]:
    """`serialized_named_tensors` of update_weights_from_tensor (one base64 payload per TP rank) for one command:
    the pickle of `[(name, torch.Tensor())]`, written opcode by opcode so that the tensor is `torch.Tensor.__new__`
    (an empty CPU tensor) and not a shared-memory handle: data SGLang's SafeUnpickler accepts (`torch.Tensor` is on
    its list) that can cross HTTP from another host."""
    name = (COMMAND + json.dumps(command)).encode()
    blob = (
        pickle.PROTO + b"\x02" + pickle.EMPTY_LIST
        + pickle.BINUNICODE + struct.pack("<I", len(name)) + name
        + pickle.GLOBAL + b"torch\nTensor\n" + pickle.EMPTY_TUPLE + pickle.NEWOBJ
        + pickle.TUPLE2 + pickle.APPEND + pickle.STOP
    )  # fmt: skip
    return [base64.b64encode(blob).decode()] * tp_size


def parse(name: str) -> dict | None:
    """The command in a named tensor's name, or None for a packed-bytes entry."""
    return json.loads(name[len(COMMAND) :]) if name.startswith(COMMAND) else None
