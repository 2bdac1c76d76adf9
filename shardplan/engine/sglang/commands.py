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
the trainer side reads them from there (`client.SglangClient`). A command is checked against a strict schema before
anything acts on it (`parse`: the envelope, which says where to answer; `check`: the rest): CommandError names the
field.
"""

from __future__ import annotations

import base64
import json
import math
import pickle
import re
import struct
from dataclasses import MISSING, fields

from shardplan.engine.errors import EngineUnsupported
from shardplan.engine.protocol import EngineInitInfo
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


MAX_CHARS, MAX_DEPTH, MAX_STR, MAX_INT = 256 << 20, 8, 4096, 2**62  # a command's JSON; nesting; any string; |ints|
# where and how long to answer; `secret`: the control channel's (hex), as EngineInitInfo.control_secret: this call
# crossed SGLang's own API, whose access rules (--api-key) guard it
ENVELOPE = {"id": str, "control": list, "offset": int, "timeout_s": float, "secret": str}
OPS = {"init": {"op": str, "info": dict}, "update": {"op": str, "version": int}}
INFO = {f.name: type(f.default) if f.default is not MISSING else f.default_factory for f in fields(EngineInitInfo)}
POSITIVE = ("timeout_s", "announce_timeout_s", "max_group_bytes", "replicas", "dp_replicas", "port")


class CommandError(EngineUnsupported):
    """A malformed shardplan command, named by its field: refused before anything acts on it."""


def _field(command: dict, key: str, want: type, where: str = "command field", required: bool = True):
    if key not in command:
        if required:
            raise CommandError(f"{where} {key!r} is missing")
        return None
    value, where = command[key], f"{where} {key!r}"
    if (want is bool) != isinstance(value, bool) or not isinstance(value, (int, float) if want is float else want):
        raise CommandError(f"{where}: expected {want.__name__}, got {type(value).__name__}")
    if not isinstance(value, (dict, list)):
        _walk(value, (where,), 0)
    if isinstance(value, (int, float)) and (value < 0 or value == 0 and key in POSITIVE):
        raise CommandError(f"{where}: {value} is {'negative' if value < 0 else 'not positive'}")
    return value


def _walk(value, where, depth: int) -> None:
    """Depth, numbers and string sizes of a JSON value; `where`: its path, a tuple joined only when it is refused."""
    problem = ""
    if depth > MAX_DEPTH:
        problem = f"nested deeper than {MAX_DEPTH} levels"
    elif type(value) is list and set(map(type, value)) <= {int} and max(map(abs, value), default=0) <= MAX_INT:
        return  # a list of ints (trainer_shards' boxes: millions of them), checked without a call per int
    elif isinstance(value, float) and not math.isfinite(value) or isinstance(value, int) and abs(value) > MAX_INT:
        problem = "not a finite number within +-2**62"
    elif isinstance(value, str) and len(value) > MAX_STR:
        problem = f"{len(value)} characters, more than {MAX_STR}"
    if problem:
        raise CommandError(f"{'.'.join(map(str, where))[:300]}: {problem}")
    for key, item in value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ():
        if isinstance(key, str) and len(key) > MAX_STR:
            raise CommandError(f"{'.'.join(map(str, where))[:300]}: a key of {len(key)} characters")
        _walk(item, (*where, key), depth + 1)


def parse(name: str) -> dict | None:
    """The command in a named tensor's name, its envelope checked (CommandError), or None for a packed-bytes entry."""
    if not name.startswith(COMMAND):
        return None
    if len(name) > MAX_CHARS:
        raise CommandError(f"command: {len(name)} characters, more than {MAX_CHARS}")
    try:
        command = json.loads(name[len(COMMAND) :])
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep for the decoder
        raise CommandError(f"command: not JSON ({type(e).__name__}: {str(e)[:100]})") from None
    if not isinstance(command, dict):
        raise CommandError(f"command: expected a JSON object, got {type(command).__name__}")
    for key, want in ENVELOPE.items():
        _field(command, key, want, required=key in ("id", "control"))
    if not re.fullmatch(r"[\w-]{1,64}", command["id"], re.A):
        raise CommandError("command field 'id': 1-64 letters, digits, '_' or '-' expected")
    control = command["control"]
    if len(control) != 2 or not isinstance(control[0], str) or not 0 < len(control[0]) < 256:
        raise CommandError("command field 'control': [host, port] expected")
    if _field({"port": control[1]}, "port", int, "command field 'control'") > 65535:
        raise CommandError("command field 'control': port out of range")
    if not re.fullmatch(r"(?:[0-9a-f]{2}){0,64}", command.get("secret", ""), re.A):
        raise CommandError("command field 'secret': up to 64 bytes as lowercase hex expected")
    return command


def check(command: dict) -> None:
    """CommandError naming the first field of a parsed command outside the schema (op, its fields, info)."""
    _walk(command, ("command",), 0)
    op = _field(command, "op", str)
    if op not in OPS:
        raise CommandError(f"command field 'op': expected one of {sorted(OPS)}, got {op[:40]!r}")
    unknown = set(command) - {*ENVELOPE, *OPS[op]}
    if unknown:
        raise CommandError(f"command: unknown field(s) {sorted(unknown)[:8]} for op {op!r}")
    for key, want in OPS[op].items():
        _field(command, key, want)
    for key in command.get("info", {}):
        if key not in INFO:
            raise CommandError(f"command field 'info': unknown field {key[:80]!r}")
        _field(command["info"], key, INFO[key], "info field")
