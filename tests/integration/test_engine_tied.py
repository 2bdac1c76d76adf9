"""Tied embeddings in live vLLM CPU engines: after an update, the lm_head's derived GEMM state holds the new weights.

On CPU, vLLM's processing of an lm_head builds a GEMM handle from its weight (an sgl packed copy or a oneDNN handle
holding a reordered copy, engine_gemm). A tied lm_head's weight is embed_tokens' weight: no checkpoint tensor writes
it, so a layerwise reload never processes it again and its handle keeps the old embedding while the gather reads the
new one. The backend re-processes every module sharing storage with a written param (engine/reload.py). An
embedding's handle serves logits only: after an update it is dropped and built at the module's first logits call
(engine/reload.py: DeferredGemm), which a model computing its logits through embed_tokens (Command R, Gemma 2) makes at
once, and a model that only looks embed_tokens up never does; `stale_gemms` checks every handle against one built from
the weight its module holds.

Per case (tiny random Llama / Qwen3 / Command R with tie_word_embeddings, written by transformers' save_pretrained, at
TP1 / TP2 (and a Llama at PP=2), with the GEMM path pinned: a packed copy or plain F.linear), a trainer process takes
two AdamW steps and syncs each; the engine's greedy tokens must equal a fresh engine's (same layout, same GEMM path)
from the trainer's checkpoint. Then vLLM's own `reload_weights` of checkpoint 1 into the engine holding version 2: right
with F.linear or where the copy is embed_tokens' own (it loads it), wrong with a tied lm_head's packed copy (vLLM 0.32's
bug; the assertion fails once vLLM fixes it, and then says so).
"""

from __future__ import annotations

import pytest
import torch
from engine_support import (
    TIMEOUT_S,
    VOCAB,
    Trainer,
    fresh_tokens,
    greedy,
    prefetch_fresh,
    record_plan,
    start_llm,
    stop_llm,
)

from shardplan.engine.trainer import EngineSync
from shardplan.sync import SyncConfig

# (architecture, TP, GEMM path, the module computing the logits, PP): each tied-lm_head architecture at TP1 and TP2,
# each with and without a packed copy (sgl and oneDNN both build one); Command R computes its logits through
# embed_tokens itself, the module the plan writes (as Gemma 2), so the embedding's handle must follow the update too.
# At PP=2 the last stage holds an embedding of its own, tied to its lm_head, which the plan writes as well.
CASES = {
    "llama-tp1-onednn": ("llama", 1, "onednn", "lm_head", 1),
    "llama-tp2-torch": ("llama", 2, "torch", "lm_head", 1),
    "llama-pp2-onednn": ("llama", 1, "onednn", "lm_head", 2),
    "qwen3-tp1-torch": ("qwen3", 1, "torch", "lm_head", 1),
    "qwen3-tp2-sgl": ("qwen3", 2, "sgl", "lm_head", 1),
    "cohere-tp1-onednn": ("cohere", 1, "onednn", "model.embed_tokens", 1),
}


def make_tied_model(root, arch: str):
    """A tiny random model with tie_word_embeddings, as transformers saves it (lm_head stored once, as the
    embedding). Built in a fresh process: vLLM's Transformers backend, once another test of this process used it,
    has wrapped transformers' own model classes (LlamaModel's __init__ then asks for a vLLM config)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_make_tied_model, root, arch).result(timeout=300)


def _make_tied_model(root, arch: str):
    from transformers import AutoModelForCausalLM, CohereConfig, LlamaConfig, Qwen3Config

    common = dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = {"llama": LlamaConfig, "qwen3": Qwen3Config, "cohere": CohereConfig}[arch](**common)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    path = root / arch
    model.save_pretrained(path)
    return path


@pytest.mark.budget(240, reason="a live engine and a fresh engine per version for each tied-lm_head case")
@pytest.mark.parametrize("case", list(CASES))
def test_tied_lm_head_follows_the_update(case, tmp_path):
    from safetensors import safe_open

    arch, tp, gemm, logits, pp = CASES[case]
    model = make_tied_model(tmp_path, arch)
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # tied: the checkpoint holds the embedding only
    plan = record_plan(model, tp, tmp_path / "plans", pp=pp)
    llm = start_llm(model, tp, gemm=gemm, pp=pp)
    trainer = None
    try:
        kinds = llm.collective_rpc("gemm_kinds")  # (per worker; the logits module is on the last stage)
        assert [k[logits] for k in kinds if logits in k] == [gemm] * tp, kinds  # the path this case is about was taken
        driver = EngineSync([llm], plan, config=SyncConfig(timeout_s=TIMEOUT_S, announce_timeout_s=120))
        trainer = Trainer(model, plan, driver.control, tmp_path / "ckpt", save_pretrained=True)
        tokens, steps = greedy(llm), []
        for version in (1, 2):
            checkpoint, _ = trainer.call("step", version)
            prefetch_fresh(checkpoint, tp, gemm, logits, pp=pp)  # the fresh engine starts while the test goes on
            trainer.send("sync", version)
            report = driver.sync(version)
            trainer.result()
            assert report.complete, str(report)
            new = greedy(llm)
            assert new != tokens, f"version {version} did not change the engine's tokens"
            steps.append((checkpoint, new))
            tokens = new
        readers = [] if logits == "model.embed_tokens" else ["lm_head"]
        kinds = llm.collective_rpc("gemm_kinds")
        found = llm.collective_rpc("shardplan_readers")  # found through the shared storage
        assert found == [readers if logits in k else [] for k in kinds], found
        assert [k[logits] for k in kinds if logits in k] == [gemm] * tp, kinds
        if logits != "model.embed_tokens":  # only looked up: its handle was dropped and never built again
            assert [k["model.embed_tokens"] for k in kinds] == ["deferred"] * tp * pp, kinds
        assert llm.collective_rpc("stale_gemms") == [[]] * tp * pp  # every handle, built now if deferred, is current
        fresh = [fresh_tokens(checkpoint, tp, gemm, logits, pp=pp) for checkpoint, _ in steps]
        for version, ((checkpoint, got), want) in enumerate(zip(steps, fresh), 1):
            assert got == want, f"version {version}: engine != fresh engine from {checkpoint}"

        # vLLM's own reload of checkpoint 1 into the engine holding version 2
        llm.collective_rpc("reload_weights", kwargs={"weights_path": steps[0][0]})
        llm.reset_prefix_cache()
        reloaded = greedy(llm)
        if gemm == "torch" or logits == "model.embed_tokens":  # no copy, or the copy's module is loaded
            assert reloaded == fresh[0]
        else:
            assert reloaded != fresh[0], (
                "vLLM's reload_weights now gives a fresh engine's tokens with a packed tied lm_head: its bug "
                "(the lm_head's handle is not rebuilt) is fixed in this vLLM; update docs/engine.md"
            )
    finally:
        if trainer is not None:
            trainer.stop()
        stop_llm(llm)
