"""Live SGLang CPU engines (tiny Qwen3 dense, Qwen3-MoE, Kimi-K2-style MLA + MoE) driven by `EngineSync` as vLLM engines
are: the TP workers join the sync as consumers (the shardplan loader registered by the `sglang.srt.plugins` entry point,
no --custom-weight-loader), the trainer sends from HF-named tensors; after each complete version the greedy tokens equal
a fresh engine's on that checkpoint (also from two sharded trainer ranks, each sending only its boxes); a trainer
failing mid-sync leaves the engine paused with weight version "<v>:incomplete" and its workers incomplete until the next
sync repairs it; plans for other server args or another model config are refused by name (the second by the workers
themselves, through the control channel) with the engine unchanged. In-process `sgl.Engine` at TP1 and TP2 (gloo), and
the HTTP server at TP1; the MoE at TP2 (MoE-TP: SGLang's CPU MoE path has no EP, its moe_forward_native indexes experts
by the -1 ids EP gives other ranks' experts), the MLA + MoE model at TP1 (its derived w_kc / w_vc follow the update: the
worker runs post_load_weights). Each case runs tests/sglang/live_engine.py in its own process (SGLANG_USE_CPU_ENGINE=1
at import; sgl-kernel's CPU ops from the test shim in cpu_ops/)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("live")  # shared: the HTTP case reuses the TP1 case's fresh-engine tokens


def run(work, tp: int, *extra: str) -> dict:
    env = dict(
        os.environ,
        SGLANG_USE_CPU_ENGINE="1",
        SGLANG_CPU_OMP_THREADS_BIND="|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)),
        PYTHONPATH=os.pathsep.join([str(HERE / "cpu_ops"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    out = work / f"tp{tp}{'-'.join(('', *extra))}"
    out.mkdir(exist_ok=True)
    for f in work.glob("fresh-*.json"):
        (out / f.name).write_bytes(f.read_bytes())
    proc = subprocess.run(
        [sys.executable, str(HERE / "live_engine.py"), str(out), str(tp), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    for f in out.glob("fresh-*.json"):
        (work / f.name).write_bytes(f.read_bytes())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT ") :])


def check(result: dict) -> None:
    fresh = result["fresh"]
    assert len({tuple(t) for t in (result["v0"], fresh["1"], fresh["2"])}) == 3, (
        f"the versions must generate differently to prove anything: {result}"
    )
    v1 = result["v1"]
    assert v1["complete"] and v1["weight_version"] == "1" and v1["tokens"] == fresh["1"], v1
    v2 = result["v2"]
    assert v2["raised"] and "trainer failed mid-sync" in v2["message"], v2
    assert v2["paused"] and v2["weight_version"] == "2:incomplete" and v2["resume_refused"], v2
    # every worker took part in version 2; the one(s) whose bytes stopped say incomplete
    assert all(w["version"] == 2 for w in v2["workers"]) and not all(w["complete"] for w in v2["workers"]), v2
    v3 = result["v3"]
    assert v3["complete"] and not v3["paused"] and v3["weight_version"] == "3", v3
    assert all((w["version"], w["complete"]) == (3, True) for w in v3["workers"]), v3["workers"]
    assert v3["tokens"] == fresh["2"], v3
    v4 = result["v4"]  # two sharded trainer ranks, each from its own boxes
    assert v4["complete"] and v4["weight_version"] == "4" and min(v4["bytes_by_trainer"]) > 0, v4
    assert all((w["version"], w["complete"]) == (4, True) for w in v4["workers"]), v4["workers"]
    assert v4["tokens"] == fresh["1"], v4


@pytest.mark.budget(300, reason="a live and a fresh SGLang CPU engine; four versions, one failing mid-sync")
@pytest.mark.parametrize("tp", [1, 2])
def test_engine_sync_drives_an_in_process_engine(work, tp):
    result = run(work, tp)
    check(result)
    refusals = result["refusals"]
    assert "cpu_engine" in refusals["cpu_engine"] and "nothing was sent" in refusals["cpu_engine"], refusals
    assert "model config" in refusals["model config"] and "consumer0" in refusals["model config"], refusals
    assert result["after_refusals"] == result["v0"]


@pytest.mark.budget(240, reason="an SGLang HTTP server, and fresh engines unless this worker made them already")
def test_engine_sync_drives_the_http_server(work):
    check(run(work, 1, "http"))


@pytest.mark.budget(240, reason="a live and a fresh SGLang CPU MoE engine")
@pytest.mark.parametrize("tp, mode", [(2, "moe"), (1, "mla")])  # two engine cases: CI time
def test_engine_sync_drives_a_moe_engine(work, tp, mode):
    check(run(work, tp, mode))


@pytest.mark.budget(300, reason="an in-process engine and a server, the server killed and restarted, fresh engines")
def test_engine_sync_feeds_two_replicas_and_a_lost_one_leaves_the_other_complete(work):
    """EngineSync([in-process engine, HTTP server], plan, replicas=2): version 1 reaches both replicas (consumer ids 0
    and 1, each worker's state says its replica); version 2 loses the HTTP replica mid-sync (server and worker killed):
    SyncIncomplete names it, and the in-process replica completes, resumes and generates the fresh engine's tokens;
    version 3 reaches both after the server is restarted and joined by a new EngineSync."""
    result = run(work, 1, "replicas")
    fresh = result["fresh"]
    v1 = result["v1"]
    assert v1["complete"] and v1["peers"] == ["consumer0", "consumer1"], v1
    assert v1["tokens"] == [fresh["1"], fresh["1"]] and result["v0"][0] != fresh["1"], result
    assert v1["weight_versions"] == ["1", "1"], v1
    assert v1["workers"] == [[[0, 1, True]], [[1, 1, True]]], v1
    v2 = result["v2"]
    assert v2["raised"] and list(v2["complete"].values()) == [True, False], v2
    assert v2["tokens"] == fresh["2"] and not v2["paused"] and v2["weight_version"] == "2", v2
    v3 = result["v3"]  # the lost replica restarted and joined by a new EngineSync: both take the next version
    assert v3["complete"] and v3["tokens"] == [fresh["1"], fresh["1"]] and v3["weight_versions"] == ["3", "3"], v3
