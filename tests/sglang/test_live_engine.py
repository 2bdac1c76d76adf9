"""A live SGLang CPU engine (tiny Qwen3 dense, TP1) updated by shardplan: after each of two trainer versions, pushed
as plan-packed bytes through `shardplan.engine.sglang.loader` between begin/end_weight_update, its greedy tokens equal
a fresh engine started on that version's checkpoint; a plan recorded under other server args (not the CPU engine) is
refused naming the option, and the engine's output is unchanged. Runs tests/sglang/live_engine.py in its own process
(SGLANG_USE_CPU_ENGINE=1 at import; sgl-kernel's one CPU op from the test shim in cpu_ops/)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def test_live_engine_follows_two_trainer_versions(tmp_path):
    env = dict(
        os.environ,
        SGLANG_USE_CPU_ENGINE="1",
        PYTHONPATH=os.pathsep.join([str(HERE / "cpu_ops"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, str(HERE / "live_engine.py"), str(tmp_path), "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    tokens = [result["v0"]]
    for v in result["versions"]:
        assert v["ok"], v["message"]
        assert v["updated"] == v["fresh"], v
        tokens.append(v["updated"])
    assert len({tuple(t) for t in tokens}) == 3, f"the versions must generate differently to prove anything: {tokens}"
    refused = result["refused"]
    assert not refused["ok"] and "cpu_engine" in refused["message"] and refused["unchanged"], refused
