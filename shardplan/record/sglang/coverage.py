"""Coverage sweep, SGLang side: every text-decoder architecture SGLang implements, recorded and verified bitwise.

    python -m shardplan.record.coverage --engine sglang [--arch NAME ...] [--resume] --results FILE

The sweep machinery (worker process, timeout, resume, rendering) is record/coverage.py's; the tiny configs are the vLLM
sweep's (`tiny.tiny_config`, one home). Per architecture and TP 1, 2, 4 (SGLang's --ep-size = TP at TP > 1 for models
with experts), every rank is recorded with SGLang's own loader (SglangRecordSession) and checked as
`shardplan verify --engine sglang` does: two CPU builds by SGLang, NaN-poisoned; SGLang's `load_weights` on one, the
plan (then SGLang's `post_load_weights`) on the other; every parameter, buffer and tensor attribute compared bitwise.
Verdicts as vLLM's: "cannot" only where SGLang itself refuses the config or layout or fails to build the model (its
error quoted), or its own loader fails on the real checkpoint names with a cited bug (SGLANG_LOADER_BUGS: that layout
only, only while it raises that error), reads a config field no real config has (SGLANG_CONFIG_GAPS) or drops the
real checkpoint's tensors for cited params (SGLANG_LOADER_DROPS: only while exactly those stay unwritten);
SGLang's loader refusing the checkpoint we listed otherwise, a recording error, a differing replay or any element of a
parameter that no listed tensor writes (the same rule as vLLM's rows, bar the params SGLANG_PADDING names with SGLang's
source) is FAIL.
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

from shardplan.plan.layout import Layout
from shardplan.record.sglang.build import SglangLayoutRejected, import_sglang
from shardplan.record.sglang.options import SglangOptions
from shardplan.record.sglang.session import SglangRecordSession, sglang_version
from shardplan.record.sglang.verify import loaded_by_sglang, replayed_by_plan, verify_models
from shardplan.record.tiny import SWEEP_TPS, short_error, sweep_start
from shardplan.record.verify import (
    Padding,
    note_unwritten,
    only_dropped,
    padding_summary,
    random_checkpoint,
    undefined_reason,
)

__all__ = ["text_decoder_architectures", "run_architecture", "versions"]

TPS = SWEEP_TPS

# SGLang loaders that fail on the real checkpoint names at some layouts (a bug in SGLang itself, cited): that layout is
# "SGLang's own loader fails" with its error, only under expert parallelism and only while the error contains this.
SGLANG_LOADER_BUGS: dict[str, tuple[str, str]] = {
    "GptOssForCausalLM": (
        "must match the size of tensor b (8) at non-singleton dimension 0",  # the tiny config's 8 experts, whole
        "SGLang's GptOssForCausalLM._load_normal_weights hands the BF16 checkpoint's fused experts (all of them, "
        "mlp.experts.gate_up_proj / down_proj as transformers saves them) to FusedMoE.weight_loader_fused, which "
        "copies them whole into the EP rank's local experts; only its MXFP4 path narrows to the rank's experts "
        "(sgl-project/sglang issue 22784, 'gpt-oss-120b EP=8 crashes with tensor size mismatch in "
        "weight_loader_fused', open; its fix PR 22787 closed unmerged)",
    ),
}

# SGLang models that read a config field no published config of theirs carries and the config class SGLang pins lacks
# (cited): SGLang cannot build them from a real checkpoint either, so the row is "cannot" while it fails on that field.
SGLANG_CONFIG_GAPS: dict[str, tuple[str, str]] = {
    "Mamba2ForCausalLM": (
        "intermediate_size",
        "sglang/srt/models/mamba2.py:72 and configs/mamba2.py:48 (SGLang 0.5.23) read config.intermediate_size; "
        "transformers' Mamba2Config (5.19.0, the version SGLang pins) has no such field (its mixer derives "
        "expand * hidden_size) and the published Mamba2 configs (state-spaces/mamba2-*, converted to transformers' "
        "format) carry expand, not intermediate_size",
    ),
}

# SGLang loaders that drop the real checkpoint's tensors for some params at every layout (cited): where exactly these
# params stay unwritten and nothing else differs, the row is "cannot" (SGLang itself cannot load a real checkpoint).
SGLANG_LOADER_DROPS: dict[str, tuple[tuple[str, ...], str]] = {
    "Llama4ForCausalLM": (
        (".feed_forward.experts.w13_weight", ".feed_forward.experts.w2_weight"),  # name endings, every layer's
        "SGLang 0.5.23's text-only Llama4ForCausalLM (sglang/srt/models/llama4.py) inherits "
        "LlamaForCausalLM.load_weights (llama.py:701-774), which has no expert mapping: the released fused "
        "feed_forward.experts.gate_up_proj / down_proj (as transformers lists and meta-llama's Llama-4 checkpoints "
        "hold them) match no param and are skipped; only Llama4ForConditionalGeneration's loader (mllama4.py:773-834) "
        "maps them to experts.w13_weight / w2_weight",
    ),
}

# Per architecture, params SGLang allocates that its loader never writes and its forward never reads (cited): a row
# passes with them unwritten only inside exactly these rows, and says so (as coverage.VLLM_PADDING for vLLM).
SGLANG_PADDING: dict[str, tuple[Padding, ...]] = {
    "FalconH1ForCausalLM": (
        Padding(
            r"model\..*\.[qk]_norm\.weight",
            "q_norm / k_norm that SGLang builds and never uses (Falcon-H1 has no QK norm)",
            lambda model, name: (0, model.get_parameter(name).shape[0]),
            "sglang/srt/models/falcon_h1.py:220-221 (SGLang 0.5.23) builds q_norm and k_norm in every decoder layer; "
            "nothing in the file reads them and no checkpoint tensor maps to them (transformers' FalconH1 and vLLM's "
            "falcon_h1.py have none)",
        ),
    ),
}

# Registry entries that are no standalone text decoder: draft / MTP / NextN heads of another model, multimodal
# wrappers, SGLang's torch-native demos and out-of-tree stand-ins.
_NOT_TEXT_DECODERS = (
    "NextN",
    "MTP",
    "Eagle",
    "DFlash",
    "DSpark",
    "Assistant",
    "VL",
    "OCR",
    "Llava",
    "ASR",
    "MultiModal",
    "MultiModality",
    "Vision",
    "Phi4MM",
    "TorchNative",
    "MindSpore",
)


def text_decoder_architectures() -> list[str]:
    """SGLang's registered causal-LM architectures, less drafts, MTP heads and multimodal wrappers; sorted."""
    import_sglang()
    from sglang.srt.models.registry import ModelRegistry

    return sorted(
        a
        for a in ModelRegistry.models
        if (a.endswith("ForCausalLM") or a.endswith("LMHeadModel") or a.startswith("ChatGLM"))
        and not any(m in a for m in _NOT_TEXT_DECODERS)
    )


def versions() -> str:
    return f"SGLang {sglang_version()}, transformers {md.version('transformers')}, torch {md.version('torch')}"


def _ours(exc: BaseException) -> bool:
    """SGLang reading a field the tiny config lacks: the sweep's config, not SGLang, is at fault (as vLLM's)."""
    return "Config' object has no attribute" in str(exc)


def run_architecture(arch: str, workdir: Path, tps=TPS, seed: int = 0) -> dict:
    """Record and verify every rank of `arch`'s tiny config at each TP against SGLang's loader; a result row."""
    row, model_dir, has_experts = sweep_start(arch, workdir)
    if row["status"]:
        return row
    for tp in tps:
        ep = has_experts and tp > 1
        layout = Layout(tp=tp, ep=ep)
        try:
            session = SglangRecordSession(str(model_dir), layout, options=SglangOptions(ep_size=tp if ep else 1))
        except SglangLayoutRejected as exc:
            if _ours(exc):
                return dict(
                    row, status="FAIL", reason=f"the tiny config lacks a field SGLang reads: {short_error(exc)}"
                )
            row["layouts"][layout.tag()] = {
                "error": "SGLang rejects the config or layout",
                "detail": short_error(exc, 300),
            }
            continue
        except Exception as exc:
            return dict(
                row, status="FAIL", reason=f"cannot list the checkpoint or parse the config: {short_error(exc)}"
            )
        checkpoint = random_checkpoint(session.tensors, seed + tp)
        result = {"ranks": layout.world_size, "equal": 0, "fallbacks": [], "mismatched": [], "undefined": {}}
        for rank in range(layout.world_size):
            try:  # SGLang's own build first: where it fails, this layout cannot run here at all
                session.builder.build(rank, "meta")
            except Exception as exc:
                gap = SGLANG_CONFIG_GAPS.get(arch)
                if gap is not None and f"has no attribute '{gap[0]}'" in str(exc):
                    result = {"error": "SGLang reads a config field real configs lack", "detail": gap[1]}
                    break
                if _ours(exc):
                    return dict(
                        row, status="FAIL", reason=f"the tiny config lacks a field SGLang reads: {short_error(exc)}"
                    )
                result = {"error": f"SGLang's own build fails on rank {rank}", "detail": short_error(exc)}
                break
            try:  # SGLang's loader refusing the checkpoint we derived is our listing's failure
                real = loaded_by_sglang(session.builder, rank, checkpoint)
            except Exception as exc:
                known = SGLANG_LOADER_BUGS.get(arch)
                if known and ep and known[0] in short_error(exc):
                    result = {
                        "error": f"SGLang's own loader fails on the real checkpoint names on rank {rank}",
                        "detail": f"{short_error(exc)}: {known[1]}",
                    }
                    break
                return dict(
                    row,
                    status="FAIL",
                    reason=f"SGLang's loader refuses the derived checkpoint at {layout.tag()} rank {rank}: "
                    f"{short_error(exc)}",
                )
            try:
                plan, _ = session.record_rank(rank)
                replayed = replayed_by_plan(session.builder, rank, plan, checkpoint, real)
            except Exception as exc:
                return dict(
                    row,
                    status="FAIL",
                    reason=f"recording/replay raised at {layout.tag()} rank {rank}: {short_error(exc)}",
                )
            verdict = verify_models(real, replayed, rank)
            result["equal"] += verdict.ok
            result["mismatched"] += verdict.mismatched
            # any element no listed tensor writes, as vLLM's rows, bar SGLANG_PADDING's
            note_unwritten(result, SGLANG_PADDING.get(arch, ()), real, verdict)
            for f in plan.fallbacks:
                entry = f"{f.source} ({f.op})"
                if entry not in result["fallbacks"]:
                    result["fallbacks"].append(entry)
            del real, replayed
        row["layouts"][layout.tag()] = result
    done = [r for r in row["layouts"].values() if "ranks" in r]
    refused = "; ".join(f"{t}: {r['error']}: {r['detail']}" for t, r in row["layouts"].items() if "error" in r)
    if not done:
        return dict(row, status="cannot", reason=refused[:500])
    mismatched = sorted({m for r in done for m in r["mismatched"]})
    row["fallbacks"] = sorted({f for r in done for f in r["fallbacks"]})
    if mismatched:
        return dict(row, status="FAIL", reason=f"replay differs from SGLang's loader in {mismatched[:5]}")
    undefined = undefined_reason(row["layouts"], "SGLang")
    drops = SGLANG_LOADER_DROPS.get(arch)
    if drops and only_dropped(row["layouts"], drops[0]):
        return dict(row, status="cannot", reason=f"SGLang's own loader drops the real checkpoint's tensors: {drops[1]}")
    if undefined:
        return dict(row, status="FAIL", reason=undefined + "; only SGLANG_PADDING's (cited) may stay unwritten")
    row["padding"] = padding_summary(row["layouts"])
    return dict(row, status="fallback" if row["fallbacks"] else "pass", reason=refused[:800])
