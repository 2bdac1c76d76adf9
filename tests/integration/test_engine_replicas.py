"""One EngineSync feeding two independent vLLM CPU engines (two replicas of one TP=1 layout, EngineSync(replicas=2))
from one trainer process: every version reaches both, and each generates what a fresh engine of the trainer's
checkpoint generates (docs/engine.md, "Replicas")."""

from __future__ import annotations

from engine_support import TIMEOUT_S, Trainer, fresh_tokens, greedy, make_model, record_plan, start_llm, stop_llm

from shardplan.engine.trainer import EngineSync
from shardplan.sync import SyncConfig


def test_one_trainer_send_updates_two_engine_replicas(tmp_path):
    model = make_model(tmp_path, moe=False)
    plan = record_plan(model, 1, tmp_path / "plans")
    engines = [start_llm(model, 1), start_llm(model, 1)]
    driver = EngineSync(engines, plan, config=SyncConfig(timeout_s=TIMEOUT_S, announce_timeout_s=120), replicas=2)
    trainer = Trainer(model, plan, driver.control, tmp_path / "ckpt", replicas=2)
    try:
        before = greedy(engines[0])
        for version in (1, 2):
            checkpoint, _ = trainer.call("step", version)
            trainer.send("sync", version)
            report = driver.sync(version)
            sent = trainer.result()
            assert report.complete, str(report)
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
