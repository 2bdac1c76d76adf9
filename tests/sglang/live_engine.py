"""Live SGLang CPU engines updated by shardplan's sync engine (run by test_live_engine.py in its own process: SGLang's
CPU engine is chosen at import by SGLANG_USE_CPU_ENGINE=1, and sgl-kernel's CPU ops come from the test shim in
cpu_ops/).

    python tests/sglang/live_engine.py WORKDIR TP [http|moe|mla|replicas]

Writes tiny Qwen3 checkpoints (versions 0, 1, 2; `moe`: tiny Qwen3-MoE, 8 experts, top-2; `mla`: tiny Kimi-K2, i.e.
DeepSeek-V3's MLA + MoE with a shared expert and sigmoid routing with a correction bias, one dense layer), records their
plan with SGLang's CPU-engine loaders, notes the greedy tokens of a fresh engine on versions 1 and 2, then starts one
engine on version 0 (no --custom-weight-loader: the `sglang.srt.plugins` entry point registers the shardplan loader,
opted in with SHARDPLAN_SGLANG=1; the plans in WORKDIR, SHARDPLAN_SGLANG_PLAN_DIRS) and
drives it with `EngineSync` as vLLM engines are driven: its TP workers join the sync as consumers over the `nccl`
transport (gloo on CPU) and the trainer sends from HF-named tensors. In order:
  * a plan whose header says "not the CPU engine" is refused by name before anything is sent; one recorded for
    another model config (rms_norm_eps) is refused by every worker, by name; the engine's tokens are unchanged;
  * version 1 synced: tokens == the fresh engine's on checkpoint 1;
  * version 2 with a trainer that fails after its first groups: SyncIncomplete, the engine paused with weight version
    "2:incomplete", its workers (2, complete=False);
  * version 3 (checkpoint 2) repairs it: resumed, "3", tokens == the fresh engine's on checkpoint 2;
  * version 4 (checkpoint 1) from two sharded trainer ranks (Megatron TP2 boxes), each sending only its shards
    (EngineSync(shards=)): tokens == the fresh engine's on checkpoint 1.
`http`: the same engine as `python -m sglang.launch_server`, driven through its HTTP routes (SglangClient(url)).
`replicas` (TP1): two replicas of the layout from one trainer, an in-process engine and an HTTP server; the second is
killed mid-sync in version 2 (replicas_run).
`moe`, `mla`: in process, without the refusals (they are the dense case's; the MoE layers run SGLang's own torch-native
path on this CPU engine; MLA runs SGLang's `intel_amx` attention backend on the shim's two attention kernels: see
cpu_ops/). kimi-k2-tiny/config.json is shardplan/configs/kimi-k2.json under the tests' shrink overrides
(tests/integration/arch_sessions.py) without its token ids (outside the tiny vocabulary).
Prints one JSON line of results."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import torch
from safetensors.torch import save_file

HERE = pathlib.Path(__file__).resolve().parent
PROMPT = [1, 5, 7, 9, 11, 13]
ENGINE_ARGS = dict(
    device="cpu",
    skip_tokenizer_init=True,
    attention_backend="torch_native",
    sampling_backend="pytorch",
    disable_cuda_graph=True,
    max_total_tokens=2048,
    max_running_requests=2,
    mem_fraction_static=0.4,
    grammar_backend="none",
    random_seed=0,
)


def checkpoint(path: pathlib.Path, model: pathlib.Path, seed: int, names) -> dict[str, torch.Tensor]:
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(model / "config.json", path / "config.json")
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        n: (torch.randn(s, generator=gen) * (0.02 if len(s) > 1 else 1) + (1 if len(s) == 1 else 0)).to(
            getattr(torch, d)
        )
        for n, s, d in names
    }
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


MODELS = {
    "": "qwen3-tiny",
    "http": "qwen3-tiny",
    "replicas": "qwen3-tiny",
    "moe": "qwen3-moe-tiny",
    "mla": "kimi-k2-tiny",
}
ATTENTION = {"mla": "intel_amx"}  # SGLang's torch_native backend cannot serve MLA's prefill


def engine(path, tp, mode):
    import sglang as sgl

    args = dict(ENGINE_ARGS, attention_backend=ATTENTION.get(mode, ENGINE_ARGS["attention_backend"]))
    return sgl.Engine(model_path=str(path), tp_size=tp, log_level="error", **args)


def greedy(llm):
    out = llm.generate(input_ids=[PROMPT], sampling_params={"max_new_tokens": 12, "temperature": 0})
    return out[0]["output_ids"]


class Server:
    """`python -m sglang.launch_server` on a free port; greedy tokens through /generate."""

    def __init__(self, path, tp):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(path), "--tp-size", str(tp)]
        args += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error"]
        for k, v in ENGINE_ARGS.items():
            flag = "--" + k.replace("_", "-")
            args += [flag] if v is True else [flag, str(v)]
        self.url = f"http://127.0.0.1:{self.port}"
        # its own process group: the scheduler (TP worker) processes go with the server on shutdown() and kill()
        self.proc = subprocess.Popen(args, env=os.environ.copy(), start_new_session=True)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang.launch_server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        raise RuntimeError("sglang.launch_server did not come up")

    def generate(self):
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
        req = urllib.request.Request(
            self.url + "/generate", json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())["output_ids"]

    def shutdown(self):
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self):
        """The server and its TP workers die at once, as a crashed node's would."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(60)


def sharded_sync(handle, plan_path, tensors, config, client_of) -> dict:
    """Version 4 from two sharded trainer ranks, each sending only its boxes (Megatron TP2: column-parallel linears
    split by rows, row-parallel ones by columns, MLA's down-projections and norms whole on both; rank 1 from a
    thread): a new EngineSync(shards=), whose init re-joins the workers with the shards."""
    import threading

    from shardplan.engine.trainer import EngineSync, ModuleSource
    from shardplan.plan.file.format import PlanFile
    from shardplan.runtime.shards import local_tensors, tp_shards
    from shardplan.simulate.trainers import megatron_split_dim

    sources = {n: m for n, m in PlanFile.read(plan_path).sources.items() if n in tensors}
    shards = tp_shards(sources, 2, lambda n: megatron_split_dim(n, sources[n]))
    sync = EngineSync([handle], str(plan_path), config=config, shards=shards)
    ranks = [
        sync.trainer_rank(
            ModuleSource(local_tensors(shards, t, tensors), sync.plan_file, shards=shards, rank=t), rank=t
        )
        for t in (0, 1)
    ]
    sent = []
    sender = threading.Thread(target=lambda: sent.append(ranks[1].sync(4)))
    sender.start()
    report = sync.sync(4, trainer=ranks[0])
    sender.join()
    for r in ranks:
        r.close()
    client = client_of(sync)
    out = {
        "complete": report.complete,
        "bytes_by_trainer": [report.trainer.nbytes, sent[0].nbytes if sent else 0],
        "weight_version": client.get_weight_version(),
        "workers": client.worker_states(),
    }
    sync.close()
    return out


def acting_at_group(n: int, act, tensors, plan_file):
    """The trainer's source of `tensors`, calling act() when the sync fetches its n-th group (a failure mid-sync)."""
    from shardplan.engine.trainer import ModuleSource

    class Source(ModuleSource):
        calls = 0

        def group(self, group):
            Source.calls += 1
            if Source.calls == n:
                act()
            return super().group(group)

    return Source(tensors, plan_file)


def replicas_run(work, plan_path, versions, config) -> dict:
    """Two replicas of the TP1 layout from one trainer (EngineSync(replicas=2)): an in-process engine (replica 0) and
    an HTTP server (replica 1), both on checkpoint 0. Version 1 reaches both. Version 2: the server and its worker are
    killed after the trainer's first groups (a node lost mid-sync): SyncIncomplete names that replica, the in-process
    one completes, resumes and generates version 2's tokens. Version 3: the server restarted on checkpoint 0 and a new
    EngineSync over both; it completes on both."""
    from shardplan.engine.errors import SyncIncomplete
    from shardplan.engine.sglang.client import SglangClient
    from shardplan.engine.trainer import EngineSync, ModuleSource

    live, server = engine(work / "v0", 1, ""), Server(work / "v0", 1)
    out = {}
    try:
        out["v0"] = [greedy(live), server.generate()]
        sync = EngineSync([live, SglangClient(server.url)], str(plan_path), config=config, replicas=2)
        clients = sync.engines
        trainer = sync.trainer_rank(ModuleSource(versions[1], sync.plan_file))
        report = sync.sync(1, trainer=trainer)
        trainer.close()
        out["v1"] = {
            "complete": report.complete,
            "peers": sorted(report.trainer.peers),
            "tokens": [greedy(live), server.generate()],
            "weight_versions": [c.get_weight_version() for c in clients],
            "workers": [[(w["replica"], w["version"], w["complete"]) for w in c.worker_states()] for c in clients],
        }

        trainer = sync.trainer_rank(acting_at_group(3, server.kill, versions[2], sync.plan_file))
        try:
            sync.sync(2, trainer=trainer)
            out["v2"] = {"raised": False}
        except SyncIncomplete as e:
            outcomes = {o.name: o for o in e.report.engines}
            out["v2"] = {
                "raised": True,
                "message": str(e)[:3000],
                "complete": {name: o.complete for name, o in outcomes.items()},
                "tokens": greedy(live),
                "paused": clients[0].is_paused(),
                "weight_version": clients[0].get_weight_version(),
            }
        trainer.close()
        sync.close()
        # the lost replica restarted (on checkpoint 0) and joined by a new EngineSync: version 3 completes on both
        server = Server(work / "v0", 1)
        sync = EngineSync([live, SglangClient(server.url)], str(plan_path), config=config, replicas=2)
        trainer = sync.trainer_rank(ModuleSource(versions[1], sync.plan_file))
        report = sync.sync(3, trainer=trainer)
        trainer.close()
        out["v3"] = {
            "complete": report.complete,
            "tokens": [greedy(live), server.generate()],
            "weight_versions": [c.get_weight_version() for c in sync.engines],
        }
        sync.close()
    finally:  # never leave an engine behind
        server.shutdown()
        live.shutdown()
    return out


def main():
    work, tp = pathlib.Path(sys.argv[1]).resolve(), int(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else ""
    os.environ["SHARDPLAN_SGLANG"] = "1"  # the plugin's opt-in, inherited by every engine process (docs/sglang.md)
    os.environ["SHARDPLAN_SGLANG_PLAN_DIRS"] = str(work)  # where the workers may read plans: this run's
    http = mode == "http"
    model = HERE / MODELS[mode]
    from shardplan.engine.errors import EnginePlanMismatch, SyncIncomplete
    from shardplan.engine.sglang.client import SglangClient
    from shardplan.engine.trainer import EngineSync, ModuleSource
    from shardplan.plan.file.format import write_plan
    from shardplan.plan.layout import Layout
    from shardplan.record.sglang.options import SglangOptions
    from shardplan.record.sglang.session import SglangRecordSession
    from shardplan.sync import SyncConfig

    s = SglangRecordSession(str(model), Layout(tp=tp), options=SglangOptions(cpu_engine=True))
    body = s.record_plans(list(range(tp))).body
    plan_path = work / "plan.plan"
    write_plan(plan_path, s.encode(body))
    names = [(m.name, m.shape, m.dtype) for m in s.sources]
    versions = {v: checkpoint(work / f"v{v}", model, v, names) for v in (0, 1, 2)}
    results = {"tp": tp, "mode": mode}
    # one engine at a time (memory): the fresh engines of versions 1 and 2 first, then the live one that is updated
    # (a second run in the same WORKDIR, e.g. the HTTP one, reuses them: the checkpoints are the same)
    cached = work / f"fresh-tp{tp}-{MODELS[mode]}.json"
    fresh = {int(k): v for k, v in json.loads(cached.read_text()).items()} if cached.exists() else {}
    for version in (1, 2):
        if version not in fresh:
            fresh_engine = engine(work / f"v{version}", tp, mode)
            fresh[version] = greedy(fresh_engine)
            fresh_engine.shutdown()
    cached.write_text(json.dumps(fresh))
    results["fresh"] = fresh
    config = SyncConfig(timeout_s=20)  # the consumer notices a failed trainer after it (gloo)
    if mode == "replicas":
        results.update(replicas_run(work, plan_path, versions, config))
        print("RESULT " + json.dumps(results), flush=True)
        return
    if http:
        server = Server(work / "v0", tp)
        handle, generate = SglangClient(server.url), server.generate
    else:
        live = engine(work / "v0", tp, mode)
        handle, generate = live, lambda: greedy(live)
    try:
        results["v0"] = generate()

        if not mode:  # refusals (dense in-process only: the same checks run for every handle and model)
            gpu_plan = work / "gpu.plan"  # the same plan, but its header says: recorded without the CPU engine
            wrong = SglangRecordSession.__new__(SglangRecordSession)
            wrong.__dict__.update(s.__dict__, options=SglangOptions())
            write_plan(gpu_plan, wrong.encode(body))
            other = SglangRecordSession(
                str(model),
                Layout(tp=tp),
                options=SglangOptions(cpu_engine=True),
                overrides=["rms_norm_eps=1e-5"],
            )
            other_plan = work / "other.plan"
            write_plan(other_plan, other.encode(other.record_plans(list(range(tp))).body))
            refusals = {}
            for key, path in (("cpu_engine", gpu_plan), ("model config", other_plan)):
                sync = EngineSync([handle], str(path), config=config)
                trainer = sync.trainer_rank(ModuleSource(versions[1], sync.plan_file))
                try:
                    sync.sync(1, trainer=trainer)
                    refusals[key] = "not refused"
                except EnginePlanMismatch as e:
                    refusals[key] = str(e)
                trainer.close()
                sync.close()
            results["refusals"] = refusals
            results["after_refusals"] = generate()

        sync = EngineSync([handle], str(plan_path), config=config)
        client = sync.engines[0]
        trainer = sync.trainer_rank(ModuleSource(versions[1], sync.plan_file))
        report = sync.sync(1, trainer=trainer)
        trainer.close()
        results["v1"] = {
            "tokens": generate(),
            "complete": report.complete,
            "weight_version": client.get_weight_version(),
        }

        def fail():
            raise RuntimeError("trainer failed mid-sync (test)")

        failing = sync.trainer_rank(acting_at_group(3, fail, versions[2], sync.plan_file))
        try:
            sync.sync(2, trainer=failing)
            results["v2"] = {"raised": False}
        except SyncIncomplete as e:
            results["v2"] = {
                "raised": True,
                "message": str(e)[:2000],
                "paused": client.is_paused(),
                "weight_version": client.get_weight_version(),
                "workers": client.worker_states(),
            }
        failing.close()
        try:
            sync.resume()
            results["v2"]["resume_refused"] = False
        except SyncIncomplete:
            results["v2"]["resume_refused"] = True
        trainer = sync.trainer_rank(ModuleSource(versions[2], sync.plan_file))  # a restarted trainer, say
        report = sync.sync(3, trainer=trainer)
        trainer.close()
        results["v3"] = {
            "tokens": generate(),
            "complete": report.complete,
            "paused": client.is_paused(),
            "weight_version": client.get_weight_version(),
            "workers": client.worker_states(),
        }
        sync.close()
        results["v4"] = sharded_sync(handle, plan_path, versions[1], config, client_of=lambda sync: sync.engines[0])
        results["v4"]["tokens"] = generate()
    finally:  # never leave an engine behind
        if http:
            server.shutdown()
        else:
            live.shutdown()
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
