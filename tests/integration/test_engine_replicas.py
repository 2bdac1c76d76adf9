"""One EngineSync feeding two replicas of one TP=1 layout (EngineSync(replicas=2)) from one trainer process: two
independent vLLM CPU engines, and one AsyncLLM whose two data-parallel ranks are independent engine cores. Every
version reaches every replica, and each generates what a fresh engine of the trainer's checkpoint generates
(docs/engine.md, "Replicas")."""

from __future__ import annotations

import json

import pytest
from engine_support import (
    PROMPTS,
    TIMEOUT_S,
    AsyncEngine,
    Trainer,
    fresh_tokens,
    greedy,
    make_model,
    record_plan,
    start_llm,
    step_and_sync,
    stop_llm,
)

from shardplan.engine.clients import AsyncLLMClient
from shardplan.engine.protocol import state_key
from shardplan.engine.trainer import EngineSync
from shardplan.sync import SyncConfig


@pytest.mark.budget(220, reason="two live engines and a fresh one per version")
def test_one_trainer_send_updates_two_engine_replicas(tmp_path):
    model = make_model(tmp_path, moe=False)
    plan = record_plan(model, 1, tmp_path / "plans")
    engines = [start_llm(model, 1), start_llm(model, 1)]
    driver = EngineSync(engines, plan, config=SyncConfig(timeout_s=TIMEOUT_S, announce_timeout_s=120), replicas=2)
    trainer = Trainer(model, plan, driver.control, tmp_path / "ckpt", replicas=2)
    try:
        before = greedy(engines[0])
        for version in (1, 2):
            checkpoint, report, sent = step_and_sync(trainer, driver, version)
            assert report.complete, str(report)
            assert [e.name for e in report.engines] == ["llm[0]", "llm[1]"]  # outcomes per engine, named apart
            assert sorted(sent.peers) == ["consumer0", "consumer1"]  # replica 1's plan rank 0 is consumer 1
            states = [e.workers for e in report.engines]
            assert [[(s["replica"], s["version"], s["complete"]) for s in w] for w in states] == [
                [(0, version, True)],
                [(1, version, True)],
            ]
            want = fresh_tokens(checkpoint, 1)
            got = [greedy(e) for e in engines]
            assert got == [want, want], f"version {version}: an engine replica != a fresh engine from {checkpoint}"
            assert want != before
            before = want
    finally:
        trainer.stop()
        for e in engines:
            stop_llm(e)


@pytest.mark.budget(150, reason="a data-parallel engine of two cores, a fresh engine per version")
def test_one_handle_over_two_data_parallel_engine_cores_takes_every_version(tmp_path):
    """`AsyncLLM(data_parallel_size=2)` of a dense model: vLLM runs its DP ranks as two independent engine cores and
    answers each RPC with the first core's reply only. EngineSync([engine], plan, replicas=2): both cores' workers
    join (replica = DP index), both take every version (their states on the control channel say so, whatever the
    replies cover), and requests spread over both cores generate what a fresh engine does."""
    model = make_model(tmp_path, moe=False)
    plan = record_plan(model, 1, tmp_path / "plans")
    engine = AsyncEngine(model, dp=2)
    driver = EngineSync(
        [AsyncLLMClient(engine.engine, engine.loop)],
        plan,
        config=SyncConfig(timeout_s=TIMEOUT_S, announce_timeout_s=120),
        replicas=2,
    )
    trainer = Trainer(model, plan, driver.control, tmp_path / "ckpt", replicas=2)
    prompts = PROMPTS * 2  # the DP load balancer sends some to each core
    try:
        before = engine.greedy(prompts)
        for version in (1, 2):
            checkpoint, report, sent = step_and_sync(trainer, driver, version)
            assert report.complete, str(report)
            assert sorted(sent.peers) == ["consumer0", "consumer1"]
            states = [json.loads(driver.control.try_get(state_key(f"consumer{c}"))) for c in (0, 1)]
            assert [(s["replica"], s["version"], s["complete"]) for s in states] == [
                (0, version, True),
                (1, version, True),
            ]
            want = fresh_tokens(checkpoint, 1)
            got = engine.greedy(prompts)
            assert got == want * 2, f"version {version}: a DP core != a fresh engine from {checkpoint}"
            assert got != before
            before = got
    finally:
        trainer.stop()
        engine.stop()
