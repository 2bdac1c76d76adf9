"""One weight update of a live vLLM CPU engine: through shardplan next to vLLM's own way, same engine, same run.

    python bench/engine_bench.py                                  # tiny Qwen3 TP1, tiny Qwen3-MoE TP2
    python bench/engine_bench.py --cases qwen3-30b-a3b --layers 2 # Qwen3-30B-A3B cut to 2 layers, TP2 (~3.6 GB bf16)
    ... --override num_experts=64                                 # cut further (fewer experts) for a small box

shardplan: `EngineSync.sync` with the trainer in this process (ModuleSource over the new checkpoint's tensors):
pause, announce, start, per group pack -> gloo (the `nccl` adapter on CPU) -> apply into the pre-processing params
-> process, finish, resume. Only this rank's bytes travel.
vLLM's own: its `nccl` backend needs CUDA (PyNccl), so on CPU the same engine runs `reload_weights(weights_path=...)`:
layerwise reload + `load_weights` of every full checkpoint tensor, read by every worker from the (page-cached)
safetensors file. That is what its nccl/ipc backends do after the transfer, without the transfer.
Ceiling of the transport, same run (after the engine is shut down): the same per-worker byte counts sent from this
process to one process per worker over gloo TCP on 127.0.0.1, all at once, one message each.

Both update the same engine from checkpoint A to checkpoint B (random bf16 weights); the greedy tokens after each
way are printed side by side (equal for the dense model; for the MoE model vLLM 0.32's own reload skips the CPU
experts' prepack, docs/engine.md, so its tokens differ; MoE cases also time a shardplan sync without the prepack
re-run, the same work as vLLM's reload, whose tokens must then equal vLLM's). Median of --iters updates each,
alternating.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
        "vocab_size": 1024, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
        "bos_token_id": 1, "eos_token_id": 2}
TINY_MOE = dict(TINY, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[],
                norm_topk_prob=True)
PROMPTS = [[5, 17, 99, 300, 7], [42, 43, 44]]


def case_config(name: str, layers: int, overrides: list[str] = ()) -> tuple[dict, int]:
    if name == "tiny-dense":
        return TINY, 1
    if name == "tiny-moe":
        return TINY_MOE, 2
    if name == "qwen3-30b-a3b":
        from shardplan.models import resolve_model
        cfg = dict(resolve_model("qwen3-30b-a3b", [f"num_hidden_layers={layers}", *overrides]).config)
        cfg["max_position_embeddings"] = 2048
        return cfg, 2
    raise SystemExit(f"unknown case {name!r}: tiny-dense, tiny-moe, qwen3-30b-a3b")


def write_checkpoints(root: Path, cfg: dict, tp: int):
    """Checkpoints A (the engine starts from it) and B (the update), and the plan recorded for A's config."""
    from safetensors.torch import save_file

    from shardplan.plan.layout import Layout
    from shardplan.plan.file.format import write_plan
    from shardplan.record.session import RecordSession

    dirs = [root / "A", root / "B"]
    for d in dirs:
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(cfg, indent=1))
    session = RecordSession(str(dirs[0]), Layout(tp=tp))
    tensors_b = None
    for seed, d in enumerate(dirs, 1):
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for name, shape, _ in session.tensors:
            t = torch.randn(shape, generator=g)
            tensors[name] = (1 + 0.1 * t if name.endswith("norm.weight") else 0.02 * t).to(torch.bfloat16)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        tensors_b = tensors
    plan = root / "model.plan"
    write_plan(plan, session.encode(session.record_plans(range(tp)).body))
    return dirs, tensors_b, plan


def _gloo_receiver(port: int, pair: int, nbytes: int, iters: int) -> None:
    """One receiving process of the transport ceiling: `iters` times, `nbytes` from the bench process over gloo."""
    from datetime import timedelta

    import torch.distributed as dist
    store = dist.PrefixStore(f"pair{pair}", dist.TCPStore("127.0.0.1", port, is_master=False))
    pg = dist.ProcessGroupGloo(store, 1, 2, timedelta(seconds=300))
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(iters + 1):
        pg.recv([buf], 0, 0).wait()


def gloo_ceiling(nbytes_per_peer: list[int], iters: int) -> list[float]:
    """The transport alone, same run: the bench process sends each engine worker's byte count to its own process
    over gloo TCP on 127.0.0.1 (what the `nccl` adapter runs on CPU), all peers at once, one message each; the first
    round (connection set-up) is dropped. Seconds per round."""
    import multiprocessing as mp
    import threading
    from datetime import timedelta

    import torch.distributed as dist
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_gloo_receiver, args=(server.port, i, n, iters), daemon=True)
             for i, n in enumerate(nbytes_per_peer)]
    for p in procs:
        p.start()
    groups = [dist.ProcessGroupGloo(dist.PrefixStore(f"pair{i}", server), 0, 2, timedelta(seconds=300))
              for i in range(len(procs))]
    bufs = [torch.ones(n, dtype=torch.uint8) for n in nbytes_per_peer]
    out = []
    for _ in range(iters + 1):
        t = time.perf_counter()
        threads = [threading.Thread(target=lambda g=g, b=b: g.send([b], 1, 0).wait()) for g, b in zip(groups, bufs)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        out.append(time.perf_counter() - t)
    for p in procs:
        p.join(60)
    return out[1:]


def run_case(name: str, layers: int, iters: int, overrides: list[str] = ()) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig

    from shardplan.engine.trainer import EngineSync, ModuleSource
    from shardplan.sync import SyncConfig

    cfg, tp = case_config(name, layers, overrides)
    root = Path(tempfile.mkdtemp(prefix=f"engine-bench-{name}-"))
    t0 = time.perf_counter()
    (a, b), tensors_b, plan = write_checkpoints(root, cfg, tp)
    setup_s = time.perf_counter() - t0
    if name == "qwen3-30b-a3b":   # give the generator's and save_file's copies back before the engine loads
        import ctypes
        from safetensors.torch import load_file
        del tensors_b
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        tensors_b = load_file(str(b / "model.safetensors"))
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    llm = LLM(model=str(a), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=256,
              max_num_seqs=4, max_num_batched_tokens=256, seed=0, tensor_parallel_size=tp,
              weight_transfer_config=WeightTransferConfig(backend="shardplan"))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def tokens():
        return [list(o.outputs[0].token_ids) for o in
                llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]

    sync = EngineSync([llm], plan, config=SyncConfig(timeout_s=120))
    trainer = sync.trainer_rank(ModuleSource(tensors_b, sync.plan_file))
    nbytes = sum(trainer.packer.replayers[r].layout.nbytes for r in trainer.packer.consumers())
    full_bytes = sum(t.numel() * t.element_size() for t in tensors_b.values())
    shardplan_s, update_s, vllm_s = [], [], []
    tokens_shardplan = tokens_vllm = None
    moe = "num_experts" in cfg
    skip_s, tokens_skip = [], None   # MoE: shardplan without the CPU prepack re-run (the step vLLM 0.32's reload skips)
    for _ in range(iters):
        report = sync.sync(trainer=trainer)
        shardplan_s.append(report.seconds)
        update_s.append(report.phases["update"])
        tokens_shardplan = tokens()
        if moe:
            skip_s.append(sync.sync(trainer=trainer, update_options={"rerun_moe_prepack": False}).seconds)
            tokens_skip = tokens()
        t = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(b)})
        llm.reset_prefix_cache()
        vllm_s.append(time.perf_counter() - t)
        tokens_vllm = tokens()
    trainer.close()
    per_peer = [trainer.packer.replayers[r].layout.nbytes for r in trainer.packer.consumers()]
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass
    del llm
    gc.collect()
    ceiling_s = gloo_ceiling(per_peer, iters)   # engine gone: the same cores and memory as the syncs had
    return dict(case=name, tp=tp, layers=cfg["num_hidden_layers"], overrides=list(overrides), setup_s=setup_s,
                shipped_bytes=nbytes, ceiling_gloo_s=statistics.median(ceiling_s),
                checkpoint_bytes=full_bytes, shardplan_s=statistics.median(shardplan_s),
                shardplan_update_s=statistics.median(update_s), vllm_reload_s=statistics.median(vllm_s),
                tokens_equal=tokens_shardplan == tokens_vllm,
                shardplan_skip_prepack_s=statistics.median(skip_s) if skip_s else None,
                tokens_equal_skip_prepack=None if tokens_skip is None else tokens_skip == tokens_vllm,
                runs=dict(shardplan=shardplan_s, vllm=vllm_s, gloo=ceiling_s, shardplan_skip_prepack=skip_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="tiny-dense,tiny-moe")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the cut qwen3-30b-a3b")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--override", action="append", default=[],
                        help="KEY=VALUE on the cut qwen3-30b-a3b's config (e.g. num_experts=64 to fit a smaller box)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = [run_case(c, args.layers, args.iters, args.override) for c in args.cases.split(",")]
    from rich.console import Console
    from rich.table import Table
    table = Table(title="one update of a live vLLM CPU engine (median)")
    for col in ("case", "TP", "shipped / checkpoint", "shardplan sync s", "of which update s",
                "gloo send alone s", "vLLM reload_weights s", "vLLM / shardplan", "same tokens"):
        table.add_column(col)
    for r in results:
        table.add_row(f"{r['case']} ({r['layers']} layers{''.join(', ' + o for o in r['overrides'])})", str(r["tp"]),
                      f"{r['shipped_bytes'] / 2**20:.1f} / {r['checkpoint_bytes'] / 2**20:.1f} MiB",
                      f"{r['shardplan_s']:.3f}", f"{r['shardplan_update_s']:.3f}", f"{r['ceiling_gloo_s']:.3f}",
                      f"{r['vllm_reload_s']:.3f}",
                      f"{r['vllm_reload_s'] / r['shardplan_s']:.2f}x", str(r["tokens_equal"]))
    Console(width=160).print(table)
    for r in results:
        if r["shardplan_skip_prepack_s"] is not None:
            print(f"{r['case']}: shardplan sync without the MoE prepack re-run (what vLLM's own reload does): "
                  f"{r['shardplan_skip_prepack_s']:.3f} s; its tokens == vLLM reload's: {r['tokens_equal_skip_prepack']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
