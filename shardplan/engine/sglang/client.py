"""Trainer side of live SGLang engines (no SGLang import at module level; the in-process engine path imports its
request types lazily, since that process has SGLang anyway).

`SglangClient` is an EngineClient (shardplan.engine.clients) for `EngineSync`: an in-process `sgl.Engine`, or the
base URL of `python -m sglang.launch_server`. The engine's TP workers join the sync as consumers through the
shardplan loader (registered by the `sglang.srt.plugins` entry point): every call reaches them as
`update_weights_from_tensor(load_format="shardplan.engine.sglang.loader.load")` carrying one command
(commands.py), and each worker answers in the sync's control channel, since SGLang returns one flag for all ranks.

    init      the plan is checked against the engine's resolved server args (`get_server_info`: engine, SGLang version,
              TP/PP, every recording option) before anything is sent; then, inside begin/end_weight_update, every
              worker checks it against its model and joins (worker.py); a refusal comes back as its named error
    start     begin_weight_update (SGLang restores packed layouts)
    update    every worker runs ConsumerSync.sync(v) while the trainer ranks send
    finish    end_weight_update (process_weights_after_loading), flush the cache, set the weight version
    pause     pause_generation(mode="abort") / continue_generation; paused: the tokenizer manager's is_pause (HTTP:
              /ready answers 503, as it does for a server not up or shutting down)

`push` is the colocated shortcut without the sync engine: every rank's bytes packed here and handed over through
`update_weights_from_tensor` (CPU shared memory / CUDA IPC).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid

from shardplan.engine.errors import EngineCallFailed, EngineControlUnreachable, EngineUnsupported, raise_named
from shardplan.engine.sglang.checks import check_server_info
from shardplan.engine.sglang.commands import LOAD_FORMAT, PREFIX, command_payload, reply_key, state_key
from shardplan.plan.file.format import PlanFile
from shardplan.runtime.replay import Replayer
from shardplan.sync import Replicas, SyncConfigError
from shardplan.transport import Control


def check_engine(llm, plan_file: PlanFile) -> None:
    check_server_info(llm.get_server_info(), plan_file)


def push(llm, plan_path: str, tensors) -> tuple:
    """One version, colocated: check, pack every rank's bytes, update the engine inside begin/end_weight_update."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
    from sglang.srt.utils import MultiprocessingSerializer

    plan_file = PlanFile.read(plan_path)
    check_engine(llm, plan_file)
    buffers = [Replayer(plan_file.rank(r), plan_file.sources).pack(tensors) for r in plan_file.header.ranks]
    payload = LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(b) for b in buffers])
    llm.begin_weight_update()
    try:
        return llm.update_weights_from_tensor([(PREFIX + str(plan_path), payload)], load_format=LOAD_FORMAT)
    finally:
        llm.end_weight_update()


class _InProcess:
    """The calls on an in-process `sgl.Engine`."""

    def __init__(self, engine):
        self.engine = engine

    def _run(self, coro):
        return self.engine.loop.run_until_complete(coro)

    def server_info(self) -> dict:
        return self.engine.get_server_info()

    def begin(self):
        return self.engine.begin_weight_update()

    def end(self):
        return self.engine.end_weight_update()

    def command(self, payload: list[str]):
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        req = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payload, load_format=LOAD_FORMAT, flush_cache=False
        )
        return self._run(self.engine.tokenizer_manager.update_weights_from_tensor(req, None))

    def flush_cache(self):
        self.engine.flush_cache()

    def pause(self):
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        self._run(self.engine.tokenizer_manager.pause_generation(PauseGenerationReqInput(mode="abort")))

    def resume(self):
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        self._run(self.engine.tokenizer_manager.continue_generation(ContinueGenerationReqInput()))

    def is_paused(self) -> bool:
        return bool(self.engine.tokenizer_manager.is_pause)

    def set_weight_version(self, version: str):
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        self._run(self.engine.tokenizer_manager.update_weight_version(UpdateWeightVersionReqInput(new_version=version)))

    def get_weight_version(self) -> str:
        return self.engine.get_model_info()["weight_version"]


class _Http:
    """The same calls on `python -m sglang.launch_server` (standard library only)."""

    def __init__(self, base_url: str, timeout_s: float):
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s

    def _request(self, method: str, route: str, body: dict | None = None, ok_codes=(200,)):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base_url + route, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                code, text = resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            code, text = e.code, e.read().decode(errors="replace")
        if code not in ok_codes:
            raise RuntimeError(f"HTTP {code} from {route}: {text[:2000]}")
        try:
            return code, (json.loads(text) if text.strip() else {})
        except json.JSONDecodeError:  # some routes answer plain text (/flush_cache)
            return code, {"text": text}

    def _result(self, route: str, body: dict):
        _, out = self._request("POST", route, body, ok_codes=(200, 400))
        return out.get("success", True), out.get("message", "")

    def server_info(self) -> dict:
        return self._request("GET", "/server_info")[1]

    def begin(self):
        return self._result("/begin_weight_update", {})

    def end(self):
        return self._result("/end_weight_update", {})

    def command(self, payload: list[str]):
        body = {"serialized_named_tensors": payload, "load_format": LOAD_FORMAT, "flush_cache": False}
        return self._result("/update_weights_from_tensor", body)

    def flush_cache(self):
        self._request("POST", "/flush_cache")

    def pause(self):
        self._request("POST", "/pause_generation", {"mode": "abort"})

    def resume(self):
        self._request("POST", "/continue_generation", {})

    def is_paused(self) -> bool:
        # /ready: 503 when paused (or shutting down / not up; /health would run a generation, which waits)
        return self._request("GET", "/ready", ok_codes=(200, 503))[0] == 503

    def set_weight_version(self, version: str):
        self._request("POST", "/update_weight_version", {"new_version": version})

    def get_weight_version(self) -> str:
        return self._request("GET", "/model_info")[1]["weight_version"]


class SglangClient:
    """EngineClient of one SGLang engine: an in-process `sgl.Engine`, or the base URL of its HTTP server."""

    def __init__(self, engine, name: str | None = None, timeout_s: float = 600.0):
        if isinstance(engine, str):
            self.calls, self.name = _Http(engine, timeout_s), name or engine.rstrip("/")
        else:
            self.calls, self.name = _InProcess(engine), name or "sglang-engine"
        self.control: Control | None = None
        self.world: list[int] = []  # the workers' consumer ids (plan ranks, shifted by the replica: sync.Replicas)
        self.offset = 0  # this engine's first consumer id
        self.reply_timeout_s = 30.0

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - re-raised as the named error it carries
            raise_named(e, f"{self.name}: {what}")

    # -- the weight-transfer calls of EngineSync --------------------------------------------------------------------
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        info = self._call("server_info", self.calls.server_info)
        plan_file = PlanFile.read(init_info["plan_path"])
        check_server_info(info, plan_file)  # refused here by name, before anything reaches a worker
        ranks = range(int(info["tp_size"]) * int(info["pp_size"]))
        try:
            replicas = Replicas.of(ranks, int(init_info.get("replicas", 1)))
            self.offset = replicas.consumer(int(init_info.get("replica", 0)), 0)
        except SyncConfigError as e:
            raise EngineUnsupported(f"{self.name}: init info: {e}") from None
        self.world = [self.offset + r for r in ranks]
        self.control = Control(
            init_info["control_host"],
            int(init_info["control_port"]),
            connect_timeout_s=init_info["timeout_s"],
            secret=init_info.get("control_secret") or None,
        )
        self.reply_timeout_s = float(init_info["timeout_s"])
        self._session("init", lambda: self._command({"op": "init", "info": init_info}, int(info["tp_size"]), "init"))

    def start_weight_update(self) -> None:
        self._ok("begin_weight_update", self.calls.begin)

    def update_weights(self, update_info: dict) -> None:
        tp = len(self.world)  # payload per TP rank (pp ranks read the same index)
        self._command({"op": "update", "version": int(update_info["version"])}, tp, "update_weights")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._ok("end_weight_update", self.calls.end)
        self._call("flush_cache", self.calls.flush_cache)  # KV computed with the old weights must not be reused
        if weight_version is not None:
            self.set_weight_version(weight_version)

    def pause(self) -> None:
        self._call("pause", self.calls.pause)

    def resume(self) -> None:
        self._call("resume", self.calls.resume)

    def is_paused(self) -> bool:
        return self._call("is_paused", self.calls.is_paused)

    def set_weight_version(self, version: str) -> None:
        self._call("update_weight_version", self.calls.set_weight_version, version)

    def get_weight_version(self) -> str:
        return self._call("weight_version", self.calls.get_weight_version)

    def worker_states(self) -> list[dict] | None:
        if self.control is None:
            return None
        return [json.loads(self.control.try_get(state_key(c)) or "{}") or {"rank": c - self.offset} for c in self.world]

    # -- helpers ------------------------------------------------------------------------------------------------
    def _ok(self, what: str, fn) -> None:
        result = self._call(what, fn)
        ok, message = (result[0], result[1]) if isinstance(result, (tuple, list)) else (True, "")
        if not ok:
            raise EngineCallFailed(f"{self.name}: {what} failed: {message}")

    def _session(self, what: str, fn) -> None:
        self._ok("begin_weight_update", self.calls.begin)
        try:
            fn()
        finally:
            self._ok("end_weight_update", self.calls.end)

    def _command(self, command: dict, tp_size: int, what: str) -> None:
        command = {
            **command,
            "id": uuid.uuid4().hex[:12],
            "control": [self.control.host, self.control.port],
            "secret": self.control.secret_hex,
            "timeout_s": self.reply_timeout_s,
            "offset": self.offset,  # each worker answers as consumer offset + its rank
        }
        self._ok(what, lambda: self.calls.command(command_payload(command, tp_size)))
        # the call returns once every worker ran the command (SGLang barriers its TP group); the replies are there
        deadline = time.monotonic() + self.reply_timeout_s
        errors, silent = [], []
        for r in self.world:
            text = None
            while text is None and time.monotonic() < deadline:
                text = self.control.try_get(reply_key(command["id"], r))
                if text is None:
                    time.sleep(0.05)
            if text is None:
                silent.append(r)
                continue
            self.control.delete(reply_key(command["id"], r))  # read once: not kept (one key per command and worker)
            reply = json.loads(text)
            if not reply["ok"]:
                errors.append(f"{reply['error']} [consumer{r}]")  # the error's class first: raise_named finds it
        if errors:
            raise_named(RuntimeError("; ".join(errors)), f"{self.name}: {what}")
        if silent:
            raise EngineControlUnreachable(
                f"{self.name}: {what}: workers {['consumer%d' % r for r in silent]} did not answer within "
                f"{self.reply_timeout_s} s in the control channel {self.control.host}:{self.control.port} (unreachable "
                f"from the engine, or the shardplan loader is not registered: install shardplan in the engine's "
                f"environment, or pass --custom-weight-loader {LOAD_FORMAT})"
            )
