"""The other engine handles of shardplan.engine.clients, with real vLLM CPU engines: an in-process AsyncLLM serving on
an asyncio event loop (AsyncLLMClient), and an LLM hosted by a Ray actor (RayClient, Ray pinned to 127.0.0.1), started
once for the module. Per engine a trainer process (transformers, AdamW, no vLLM): after each of two versions the
engine's greedy tokens changed and equal a fresh TP=1 engine's from the saved checkpoint.

Each engine has its own EngineSync: two independent TP=1 engines are both plan rank 0, which one EngineSync refuses
(its consumers are the plan's ranks; engines that together form a DP layout share one). The trainer takes the same steps
from the same checkpoint as test_engine.py's dense TP=1 trainer (same seeds), so in one pytest session the fresh
engines' tokens are shared (engine_support.fresh_tokens keys them by checkpoint bytes).
"""

from __future__ import annotations

import os

import pytest
from engine_support import (
    MAX_TOKENS,
    PROMPTS,
    TIMEOUT_S,
    AsyncEngine,
    Trainer,
    engine_kwargs,
    fresh_tokens,
    make_model,
    prefetch_fresh,
    record_plan,
)

from shardplan.engine.clients import AsyncLLMClient, RayClient, as_client
from shardplan.engine.trainer import EngineSync
from shardplan.sync import SyncConfig


def _ray_engine(model_dir):
    """A Ray actor whose class is vllm.LLM itself (ray.remote(LLM), as vLLM's RL examples do), on a local Ray."""
    import ray
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    env = {
        k: os.environ[k]
        for k in (
            "PYTHONPATH",
            "GLOO_SOCKET_IFNAME",
            "VLLM_CPU_KVCACHE_SPACE",
            "HF_HUB_OFFLINE",
            "TRANSFORMERS_OFFLINE",
            "TOKENIZERS_PARALLELISM",
        )
        if k in os.environ
    }
    ray.init(
        _node_ip_address="127.0.0.1",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=100 << 20,
        runtime_env={"env_vars": env},
        log_to_driver=False,
    )
    os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    actor = ray.remote(num_cpus=0)(LLM).remote(
        model=str(model_dir), **engine_kwargs(1), weight_transfer_config=WeightTransferConfig(backend="shardplan")
    )
    ray.get(actor.get_weight_version.remote(), timeout=900)  # wait for the engine to come up
    return actor


def _ray_greedy(actor) -> list[list[int]]:
    import ray
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = ray.get(
        actor.generate.remote([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False), timeout=300
    )
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


def _two_versions(root, model, plan, engine, greedy):
    """Two AdamW versions through one EngineSync of `engine`: tokens change, state reads are right, and each version's
    tokens equal a fresh engine's from the saved checkpoint."""
    client = as_client(engine)
    driver = EngineSync([client], plan, config=SyncConfig(timeout_s=TIMEOUT_S, announce_timeout_s=120))
    trainer = Trainer(model, plan, driver.control, root / f"ckpt-{client.name}")
    try:
        before, steps = greedy(), []
        for version in (1, 2):
            checkpoint, _ = trainer.call("step", version)
            prefetch_fresh(checkpoint, 1)  # the fresh engine starts while the test goes on
            trainer.send("sync", version)
            report = driver.sync(version)
            trainer.result()
            engine_report = report.engines[0]
            assert report.complete and (engine_report.weight_version, engine_report.paused) == (str(version), False)
            assert [(s["version"], s["complete"]) for s in engine_report.workers] == [(version, True)], str(report)
            got = greedy()
            assert got != before, f"version {version} did not change the tokens"
            steps.append((checkpoint, got))
            before = got
        client.pause()
        assert client.is_paused()
        client.resume()
        assert not client.is_paused() and client.get_weight_version() == "2"
        for version, (checkpoint, got) in enumerate(steps, 1):
            assert fresh_tokens(checkpoint, 1) == got, f"version {version}: {client.name} != a fresh engine"
    finally:
        trainer.stop()
        driver.close()
    return client


@pytest.mark.budget(200, reason="the module's engines (in process, async, Ray-hosted) start in its first test")
def test_async_llm_in_process_takes_two_versions(engines):
    root, model, plan, async_engine, _ = engines
    client = _two_versions(root, model, plan, async_engine.engine, async_engine.greedy)
    assert isinstance(client, AsyncLLMClient) and client.loop is async_engine.loop


def test_ray_hosted_llm_takes_two_versions(engines):
    root, model, plan, _, actor = engines
    client = _two_versions(root, model, plan, actor, lambda: _ray_greedy(actor))
    assert isinstance(client, RayClient)


def test_two_engines_serving_the_same_plan_rank_are_refused_by_name(engines):
    """Independent engines of one layout are each plan rank 0: given without replicas=, init says so (naming
    EngineSync(..., replicas=2)) instead of letting the second join replace the first."""
    from shardplan.engine.errors import EnginePlanMismatch

    root, model, plan, async_engine, actor = engines
    driver = EngineSync([async_engine.engine, actor], plan, config=SyncConfig(timeout_s=TIMEOUT_S))
    with pytest.raises(EnginePlanMismatch, match=r"plan rank 0 .* replicas=2\)"):
        driver.init()


def test_async_client_refuses_the_loops_own_thread(engines):
    """A blocking call from the AsyncLLM's own loop would wait on itself: refused by name instead of hanging."""
    from shardplan.engine.errors import EngineCallFailed

    async_engine = engines[3]
    client = AsyncLLMClient(async_engine.engine, async_engine.loop)

    async def inside():
        client.get_weight_version()

    with pytest.raises(EngineCallFailed, match="deadlock"):
        async_engine.run(inside())
