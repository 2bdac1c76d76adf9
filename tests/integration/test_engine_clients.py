"""The other engine handles of shardplan.engine.clients, with real vLLM CPU engines: an in-process AsyncLLM serving on
an asyncio event loop (AsyncLLMClient), and an LLM hosted by a Ray actor (RayClient, Ray pinned to 127.0.0.1). One
EngineSync drives both engines in every sync; one trainer process (transformers, AdamW, no vLLM). After each of two
versions both engines' greedy tokens changed and equal a fresh TP=1 engine's from the saved checkpoint.

The trainer takes the same steps from the same checkpoint as test_engine.py's dense TP=1 trainer (same seeds), so in
one pytest session the fresh engines' tokens are shared (engine_support.fresh_tokens keys them by checkpoint bytes).
"""
from __future__ import annotations

import asyncio
import os
import threading

import pytest
from engine_support import (MAX_TOKENS, PROMPTS, TIMEOUT_S, Trainer, engine_kwargs, fresh_tokens, make_model,
                            record_plan)

from shardplan.engine.clients import AsyncLLMClient, RayClient, as_client
from shardplan.engine.trainer import EngineSync
from shardplan.sync import SyncConfig


class AsyncEngine:
    """An AsyncLLM built and serving on its own event loop thread (as in an async server)."""

    def __init__(self, model_dir):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="async-llm loop")
        self.thread.start()
        self.engine = self.run(self._start(str(model_dir)), 900)

    async def _start(self, model_dir):
        from vllm.config import WeightTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        args = AsyncEngineArgs(model=model_dir, weight_transfer_config=WeightTransferConfig(backend="shardplan"),
                               **engine_kwargs(1))
        return AsyncLLM.from_engine_args(args)

    def run(self, coro, timeout_s: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def greedy(self) -> list[list[int]]:
        from vllm import SamplingParams
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

        async def one(i, prompt):
            last = None
            async for out in self.engine.generate({"prompt_token_ids": prompt}, params, request_id=f"r{i}-{id(params)}"):
                last = out
            return list(last.outputs[0].token_ids)

        async def every():
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))
        return self.run(every())

    def stop(self):
        try:
            self.engine.shutdown()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def _ray_engine(model_dir):
    """A Ray actor whose class is vllm.LLM itself (ray.remote(LLM), as vLLM's RL examples do), on a local Ray."""
    import ray
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    env = {k: os.environ[k] for k in ("PYTHONPATH", "GLOO_SOCKET_IFNAME", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE",
                                      "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM") if k in os.environ}
    ray.init(_node_ip_address="127.0.0.1", num_cpus=2, include_dashboard=False, object_store_memory=100 << 20,
             runtime_env={"env_vars": env}, log_to_driver=False)
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    actor = ray.remote(num_cpus=0)(LLM).remote(model=str(model_dir), **engine_kwargs(1),
                                                weight_transfer_config=WeightTransferConfig(backend="shardplan"))
    ray.get(actor.get_weight_version.remote(), timeout=900)   # wait for the engine to come up
    return actor


def _ray_greedy(actor) -> list[list[int]]:
    import ray
    from vllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = ray.get(actor.generate.remote([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False),
                   timeout=300)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    import ray
    root = tmp_path_factory.mktemp("clients")
    model = make_model(root, moe=False)
    plan = record_plan(model, 1, root / "plans")
    async_engine = AsyncEngine(model)
    try:
        actor = _ray_engine(model)
    except BaseException:
        async_engine.stop()
        raise
    yield root, model, plan, async_engine, actor
    async_engine.stop()
    ray.shutdown()


def test_one_sync_updates_an_async_llm_and_a_ray_hosted_llm(engines):
    import ray
    root, model, plan, async_engine, actor = engines
    clients = [as_client(async_engine.engine), as_client(actor)]
    assert isinstance(clients[0], AsyncLLMClient) and clients[0].loop is async_engine.loop
    assert isinstance(clients[1], RayClient)
    driver = EngineSync(clients, plan, config=SyncConfig(timeout_s=TIMEOUT_S, announce_timeout_s=120))
    trainer = Trainer(model, plan, driver.control, root / "ckpt")
    try:
        before = (async_engine.greedy(), _ray_greedy(actor))
        assert before[0] == before[1]
        steps = []
        for version in (1, 2):
            checkpoint, _ = trainer.call("step", version)
            trainer.send("sync", version)
            report = driver.sync(version)
            trainer.result()
            assert report.complete, str(report)
            for engine in report.engines:
                assert (engine.weight_version, engine.paused) == (str(version), False), str(report)
                assert [(s["version"], s["complete"]) for s in engine.workers] == [(version, True)]
            got = (async_engine.greedy(), _ray_greedy(actor))
            assert got[0] == got[1] and got[0] != before[0], f"version {version}"
            steps.append((checkpoint, got[0]))
            before = got
        # the state reads go through each handle: AsyncLLM's is_paused, the Ray actor's llm_engine via __ray_call__
        clients[0].pause()
        clients[1].pause()
        assert clients[0].is_paused() and clients[1].is_paused()
        clients[0].resume()
        clients[1].resume()
        assert not clients[0].is_paused() and not clients[1].is_paused()
        assert ray.get(actor.get_weight_version.remote()) == "2"
        for version, (checkpoint, got) in enumerate(steps, 1):
            assert fresh_tokens(checkpoint, 1) == got, f"version {version}: engines != a fresh engine"
    finally:
        trainer.stop()


def test_async_client_refuses_the_loops_own_thread(engines):
    """A blocking call from the AsyncLLM's own loop would wait on itself: refused by name instead of hanging."""
    from shardplan.engine.errors import EngineCallFailed
    async_engine = engines[3]
    client = AsyncLLMClient(async_engine.engine, async_engine.loop)

    async def inside():
        client.get_weight_version()
    with pytest.raises(EngineCallFailed, match="deadlock"):
        async_engine.run(inside())
