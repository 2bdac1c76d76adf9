"""Trainer-side handles on the engines a sync updates: an in-process `LLM` or `AsyncLLM`, a Ray actor, or the base URL
of a `vllm serve` started with VLLM_SERVER_DEV_MODE=1. No vLLM import here (the trainer may not have it).

Each client has vLLM's VLLMWeightSyncClient methods (init_weight_transfer_engine, start_weight_update,
update_weights, finish_weight_update), so vLLM's own HTTPVLLMWeightSyncClient / RayVLLMWeightSyncClient fit where
these do, plus what the failure semantics need: pause / resume / is_paused and the weight version.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Protocol

from shardplan.engine.errors import EngineCallFailed, raise_named
from shardplan.engine.protocol import STATE_RPC
from shardplan.engine.sglang.client import SglangClient


class EngineClient(Protocol):
    name: str

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...
    def start_weight_update(self) -> None: ...
    def update_weights(self, update_info: dict[str, Any]) -> None: ...
    def finish_weight_update(self, weight_version: str | None = None) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def is_paused(self) -> bool: ...
    def set_weight_version(self, version: str) -> None: ...
    def get_weight_version(self) -> str: ...
    def worker_states(self) -> list[dict] | None: ...


class _Calls:
    name = "engine"

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised as the named error it carries
            raise_named(e, f"{self.name}: {what}")


class LLMClient(_Calls):
    """An in-process `vllm.LLM`. Pausing is vLLM's level-0 sleep (scheduling stops, requests queue); note that a
    `generate` call on a paused LLM waits until it is resumed."""

    def __init__(self, llm, name: str = "llm"):
        self.llm, self.name = llm, name

    def init_weight_transfer_engine(self, init_info):
        self._call("init_weight_transfer_engine", self.llm.init_weight_transfer_engine, {"init_info": init_info})

    def start_weight_update(self):
        self._call("start_weight_update", self.llm.start_weight_update)

    def shutdown_weight_transfer_engine(self):
        self._call("shutdown_weight_transfer_engine", self.llm.shutdown_weight_transfer_engine)

    def update_weights(self, update_info):
        self._call("update_weights", self.llm.update_weights, {"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        self._call("finish_weight_update", self.llm.finish_weight_update, weight_version)
        self.llm.reset_prefix_cache()  # KV blocks computed with the old weights must not be reused

    def pause(self):
        self._call("pause", self.llm.sleep, level=0)

    def resume(self):
        self._call("resume", self.llm.wake_up, tags=["scheduling"])

    def is_paused(self) -> bool:
        return bool(self.llm.llm_engine.is_sleeping())

    def set_weight_version(self, version):
        self.llm.update_weight_version(version)

    def get_weight_version(self):
        return self.llm.get_weight_version()

    def worker_states(self):
        return self.llm.collective_rpc(STATE_RPC)


class AsyncLLMClient(_Calls):
    """An in-process `vllm.v1.engine.async_llm.AsyncLLM` serving on an asyncio event loop. Its methods are coroutines
    on that loop; the driver's calls are blocking, so each is scheduled on the loop (run_coroutine_threadsafe) and
    waited for: call `EngineSync.sync` from another thread, e.g. `await asyncio.to_thread(sync.sync, version)` in an
    async RL loop (from the loop's own thread it would deadlock, refused by name). `loop`: the AsyncLLM's loop;
    default: the loop of its output handler (running once the engine served a request or was built inside a loop).
    Pausing is vLLM's pause_generation(mode="abort") (in-flight requests end, caches cleared)."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop | None = None, name: str = "async-llm"):
        self.engine, self.name = engine, name
        handler = getattr(engine, "output_handler", None)
        self.loop = loop or (handler.get_loop() if handler is not None else None)
        if self.loop is None:
            raise TypeError(
                "AsyncLLMClient needs the AsyncLLM's event loop: pass loop= (the loop it serves on), or "
                "build the AsyncLLM inside that loop"
            )

    def _run(self, what: str, method: str, *args, **kwargs):
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            raise EngineCallFailed(
                f"{self.name}: {what} called from the AsyncLLM's own event loop thread would deadlock; "
                f"run the sync in another thread (await asyncio.to_thread(sync.sync, version))"
            )
        return self._call(
            what,
            lambda: asyncio.run_coroutine_threadsafe(getattr(self.engine, method)(*args, **kwargs), self.loop).result(),
        )

    # the weight-transfer calls go through collective_rpc with plain dicts, as AsyncLLM's own methods do with vLLM's
    # request objects (which would need vLLM on the trainer side)
    def init_weight_transfer_engine(self, init_info):
        self._run(
            "init_weight_transfer_engine",
            "collective_rpc",
            "init_weight_transfer_engine",
            kwargs={"init_info": init_info},
        )

    def start_weight_update(self):
        self._run("start_weight_update", "start_weight_update")

    def shutdown_weight_transfer_engine(self):
        self._run("shutdown_weight_transfer_engine", "shutdown_weight_transfer_engine")

    def update_weights(self, update_info):
        self._run("update_weights", "collective_rpc", "update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        self._run("finish_weight_update", "finish_weight_update", weight_version)
        self._run("reset_prefix_cache", "reset_prefix_cache")  # KV blocks of the old weights must not be reused

    def pause(self):
        self._run("pause", "pause_generation", mode="abort", clear_cache=True)

    def resume(self):
        self._run("resume", "resume_generation")

    def is_paused(self) -> bool:
        return bool(self._run("is_paused", "is_paused"))

    def set_weight_version(self, version):
        self._run("update_weight_version", "update_weight_version", version)

    def get_weight_version(self):
        return self._run("get_weight_version", "get_weight_version")

    def worker_states(self):
        return self._run("worker_states", "collective_rpc", STATE_RPC)


class HttpClient(_Calls):
    """`vllm serve ... --weight-transfer-config '{"backend": "shardplan"}'` with VLLM_SERVER_DEV_MODE=1 (which
    enables the /pause, /resume, weight-transfer and /weight_info routes). Standard library only."""

    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s
        self.name = self.base_url

    def _request(self, method: str, route: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base_url + route, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"HTTP {e.code} from {route}: {e.read().decode(errors='replace')[:2000]}") from None
        return json.loads(text) if text.strip() else {}

    def init_weight_transfer_engine(self, init_info):
        self._call(
            "init_weight_transfer_engine",
            self._request,
            "POST",
            "/init_weight_transfer_engine",
            {"init_info": init_info},
        )

    def start_weight_update(self):
        self._call("start_weight_update", self._request, "POST", "/start_weight_update")

    def shutdown_weight_transfer_engine(self):
        self._call("shutdown_weight_transfer_engine", self._request, "POST", "/shutdown_weight_transfer_engine")

    def update_weights(self, update_info):
        self._call("update_weights", self._request, "POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        body = {"weight_version": weight_version} if weight_version is not None else None
        self._call("finish_weight_update", self._request, "POST", "/finish_weight_update", body)

    def pause(self):
        self._call("pause", self._request, "POST", "/pause?" + urllib.parse.urlencode({"mode": "abort"}))

    def resume(self):
        self._call("resume", self._request, "POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._call("is_paused", self._request, "GET", "/is_paused")["is_paused"])

    def set_weight_version(self, version):
        self._call("update_weight_version", self._request, "POST", "/update_weight_version", {"new_version": version})

    def get_weight_version(self):
        return self._call("weight_info", self._request, "GET", "/weight_info")["weight_version"]

    def worker_states(self):
        out = self._call("collective_rpc", self._request, "POST", "/collective_rpc", {"method": STATE_RPC})
        return out.get("results", out) if isinstance(out, dict) else out


class RayClient(_Calls):
    """A Ray actor hosting an LLM: an actor class that subclasses vllm.LLM (`ray.remote(LLM)`, as vLLM's RL examples
    do) or wraps one with the same method names. Whether it is paused is read through Ray's `__ray_call__` (the
    actor's `llm_engine.is_sleeping()`)."""

    def __init__(self, handle, name: str = "ray-engine"):
        self.handle, self.name = handle, name

    def _get(self, what: str, method: str, *args, **kwargs):
        import ray

        return self._call(what, lambda: ray.get(getattr(self.handle, method).remote(*args, **kwargs)))

    def init_weight_transfer_engine(self, init_info):
        self._get("init_weight_transfer_engine", "init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self):
        self._get("start_weight_update", "start_weight_update")

    def update_weights(self, update_info):
        self._get("update_weights", "update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        self._get("finish_weight_update", "finish_weight_update", weight_version)
        self._get("reset_prefix_cache", "reset_prefix_cache")

    def pause(self):
        self._get("pause", "sleep", level=0)

    def resume(self):
        self._get("resume", "wake_up", tags=["scheduling"])

    def is_paused(self) -> bool:
        import ray

        return bool(
            self._call(
                "is_paused",
                lambda: ray.get(self.handle.__ray_call__.remote(lambda actor: actor.llm_engine.is_sleeping())),
            )
        )

    def set_weight_version(self, version):
        self._get("update_weight_version", "update_weight_version", version)

    def get_weight_version(self):
        return self._get("get_weight_version", "get_weight_version")

    def worker_states(self):
        return self._get("worker_states", "collective_rpc", STATE_RPC)


def as_client(engine, name: str | None = None) -> EngineClient:
    """An EngineClient for an LLM, a Ray actor handle, a base URL, or anything already shaped like one."""
    if isinstance(engine, str):
        return HttpClient(engine)
    if all(hasattr(engine, m) for m in ("pause", "resume", "update_weights", "get_weight_version")):
        return engine
    if type(engine).__module__.startswith("sglang."):  # an in-process sgl.Engine (docs/sglang.md)
        return SglangClient(engine, name)
    if type(engine).__name__ == "ActorHandle":
        return RayClient(engine, name or "ray-engine")
    if hasattr(engine, "pause_generation") and asyncio.iscoroutinefunction(getattr(engine, "update_weights", None)):
        return AsyncLLMClient(engine, name=name or "async-llm")
    if hasattr(engine, "llm_engine") and hasattr(engine, "update_weights"):
        return LLMClient(engine, name or "llm")
    raise TypeError(
        f"cannot drive {type(engine).__name__}: pass a vllm.LLM or AsyncLLM, a Ray actor handle, the base URL of a "
        f"`vllm serve` (VLLM_SERVER_DEV_MODE=1), an sgl.Engine or SglangClient(url), or an object with the "
        f"EngineClient methods"
    )
