"""A vLLM CPU engine in this process, as the live-engine tests and bench/engine_bench.py start it (docs/engine.md; a
test tool, not part of the package).

The recipe for a CPU box: a small KV cache (KV_CACHE_BYTES), eager mode, no tokenizer (prompts as token ids), and at
TP > 1 one OpenMP core per worker (VLLM_CPU_OMP_THREADS_BIND="0|1|..."). vLLM spawns its workers, so
the environment is set before the engine starts and every worker inherits it; a caller's module must not start
anything at import time that a spawned worker would re-run.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

ENV_DEFAULTS = {
    "GLOO_SOCKET_IFNAME": "lo",  # shardplan's `nccl` transport runs over gloo on CPU: keep it on loopback
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def set_cpu_env() -> None:
    """The environment variables of the recipe, where the caller has not set them."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


# the tiny random Qwen3 (dense, or MoE) the live-engine tests and bench/engine_bench.py write their checkpoints for
TINY = dict(
    hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, inter=512, vocab=1024, experts=8, topk=2, moe_inter=128
)


def tiny_qwen3_config(moe: bool) -> dict:
    """config.json of the tiny Qwen3 (`moe`: Qwen3-MoE, every layer sparse) of sizes TINY."""
    t = TINY
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "hidden_size": t["hidden"],
        "num_hidden_layers": t["layers"],
        "num_attention_heads": t["heads"],
        "num_key_value_heads": t["kv_heads"],
        "head_dim": t["head_dim"],
        "intermediate_size": t["inter"],
        "vocab_size": t["vocab"],
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if moe:
        cfg.update(
            num_experts=t["experts"],
            num_experts_per_tok=t["topk"],
            moe_intermediate_size=t["moe_inter"],
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    return cfg


# per worker; vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE (whole GiB) override it, so the recipe leaves that unset.
# 1 GiB per worker made a suite running two engines and their fresh twins at once run out of memory on 24 GB
KV_CACHE_BYTES = 64 << 20


def cpu_engine_kwargs(tp: int) -> dict:
    """`vllm.LLM` keyword arguments of a small eager CPU engine at tensor-parallel size `tp`."""
    return dict(
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        seed=0,
        tensor_parallel_size=tp,
        gpu_memory_utilization=0.5,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
    )


def start_cpu_llm(
    model_dir: str | Path, tp: int, *, shardplan_backend: bool = True, cores: list[int] | None = None, **extra
):
    """A `vllm.LLM` of `model_dir` at TP `tp` on this CPU, with the shardplan weight-transfer backend unless
    `shardplan_backend=False` (a fresh engine to compare with); `cores`: the core of each worker (default: 0, 1, ...;
    one worker alone: vLLM's own choice); `extra` goes to `LLM` as is."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    set_cpu_env()
    workers = tp * int(extra.get("pipeline_parallel_size", 1))  # one core each (vLLM binds per local worker)
    if cores is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in cores[:workers])
    elif workers > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(workers))
    else:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    if shardplan_backend:
        extra.setdefault("weight_transfer_config", WeightTransferConfig(backend="shardplan"))
    return LLM(model=str(model_dir), **cpu_engine_kwargs(tp), **extra)


# vLLM's default grace is 5 s, which its CPU engine core outlives after its workers have exited (it is then killed
# anyway): a test suite starting dozens of engines waited minutes for nothing
SHUTDOWN_GRACE_S = 2.0


def stop_cpu_llm(llm) -> None:
    """Shut the engine's core and workers down now (rather than when the caller's last reference goes, which a
    reference cycle may delay indefinitely)."""
    try:
        llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)
    except Exception:  # noqa: BLE001 - best effort: the engine may be half started or already gone
        pass
    gc.collect()


def greedy_tokens(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The engine's greedy continuation of each prompt (token ids), `max_tokens` each, EOS ignored."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
