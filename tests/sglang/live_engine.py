"""A live SGLang CPU engine updated by shardplan (run by test_live_engine.py in its own process: SGLang's CPU engine
is chosen at import by SGLANG_USE_CPU_ENGINE=1, and sgl-kernel's CPU ops come from the test shim in cpu_ops/).

    python tests/sglang/live_engine.py WORKDIR TP

Writes a tiny Qwen3 checkpoint (version 0), records its plan with SGLang's CPU-engine loaders, starts an engine on
version 0, then for two trainer versions packs each rank's bytes from HF-named tensors (`Replayer.pack`, no SGLang)
and pushes them through the shardplan loader between begin/end_weight_update; after each, greedy tokens must equal a
fresh engine started on that version's checkpoint. Also: a plan recorded without the CPU engine is refused by name,
and nothing is applied. Prints one JSON line of results."""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import torch
from safetensors.torch import save_file

HERE = pathlib.Path(__file__).resolve().parent
PROMPT = [[1, 5, 7, 9, 11, 13]]


def checkpoint(path: pathlib.Path, seed: int, names) -> dict[str, torch.Tensor]:
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / "qwen3-tiny" / "config.json", path / "config.json")
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        n: (torch.randn(s, generator=gen) * (0.02 if len(s) > 1 else 1) + (1 if len(s) == 1 else 0)).to(
            getattr(torch, d)
        )
        for n, s, d in names
    }
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def engine(path, tp):
    import sglang as sgl

    from shardplan.engine.sglang.loader import LOAD_FORMAT

    return sgl.Engine(
        model_path=str(path),
        device="cpu",
        skip_tokenizer_init=True,
        attention_backend="torch_native",
        sampling_backend="pytorch",
        disable_cuda_graph=True,
        max_total_tokens=2048,
        max_running_requests=2,
        tp_size=tp,
        log_level="error",
        mem_fraction_static=0.4,
        grammar_backend="none",
        custom_weight_loader=[LOAD_FORMAT],
        random_seed=0,
    )


def greedy(llm):
    out = llm.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 12, "temperature": 0})
    return out[0]["output_ids"]


def main():
    work, tp = pathlib.Path(sys.argv[1]), int(sys.argv[2])
    from shardplan.engine.errors import EnginePlanMismatch
    from shardplan.engine.sglang import client
    from shardplan.plan.file.format import write_plan
    from shardplan.plan.layout import Layout
    from shardplan.record.sglang.options import SglangOptions
    from shardplan.record.sglang.session import SglangRecordSession

    s = SglangRecordSession(str(HERE / "qwen3-tiny"), Layout(tp=tp), options=SglangOptions(cpu_engine=True))
    plan_path = work / "plan.plan"
    write_plan(plan_path, s.encode(s.record_plans(list(range(tp))).body))
    foreign = work / "gpu.plan"  # the same plan, but its header says: recorded without the CPU engine
    wrong = SglangRecordSession.__new__(SglangRecordSession)
    wrong.__dict__.update(s.__dict__, options=SglangOptions())
    write_plan(foreign, wrong.encode(s.record_plans(list(range(tp))).body))

    def push(llm, path, tensors):
        return client.push(llm, str(path), tensors)

    names = [(m.name, m.shape, m.dtype) for m in s.sources]
    results = {"tp": tp, "versions": []}
    # one engine at a time (memory): the fresh engines of each version first, then the live one that is updated
    versions = {v: checkpoint(work / f"v{v}", v, names) for v in (0, 1, 2)}
    fresh = {}
    for version in (1, 2):
        fresh_engine = engine(work / f"v{version}", tp)
        fresh[version] = greedy(fresh_engine)
        fresh_engine.shutdown()
    v0 = versions[0]
    live = engine(work / "v0", tp)
    results["v0"] = greedy(live)
    for version in (1, 2):
        ok, message = push(live, plan_path, versions[version])[:2]
        results["versions"].append(
            {"version": version, "ok": ok, "message": message, "updated": greedy(live), "fresh": fresh[version]}
        )
    before = greedy(live)
    try:
        push(live, foreign, v0)
        results["refused"] = {"ok": True, "message": "", "unchanged": greedy(live) == before}
    except EnginePlanMismatch as e:
        results["refused"] = {"ok": False, "message": str(e), "unchanged": greedy(live) == before}
    live.shutdown()
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
