"""Extra architectures for the recorder's property tests, and what each one's vLLM loader exercises.

Every sub-directory holds a hand-written, tiny `config.json` (hidden 128, 2 layers, few heads/experts, vocab ~300-400)
for an architecture that vLLM 0.32 serves and transformers 5 can build on the meta device (the checkpoint's tensor
names come from that build, see `shardplan.record.checkpoint.checkpoint_tensors`). `ARCHS` says which loader behaviour
each one is here for; docs/recording.md has the same table with results.

Two architectures (GPT-OSS, Llama 4) store their experts fused on disk (`mlp.experts.gate_up_proj` [E, H, 2I]), which
`checkpoint_tensors` used to refuse to list from a config alone (it lists them now, as save_pretrained writes them). For
those, `model_dir` writes a checkpoint directory with the config and a *header-only* `model.safetensors` (names, shapes,
dtypes; no data), whose names are exactly transformers' parameter names: for these two models they are the hub's on-disk
names.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Arch:
    behaviours: str  # what the loader does that the recorder must get right
    fallback: str | None = None  # regex of checkpoint names that must (and alone may) be fallbacks
    fused_on_disk: bool = False  # needs a header-only checkpoint dir (see module docstring)


ARCHS: dict[str, Arch] = {
    "falcon": Arch(
        "(1) torch.cat of three reshaped narrows of one fused query_key_value (new_decoder_architecture, "
        "grouped kv): a Call with several inputs from one source; (2) reshape of a non-contiguous narrow"
    ),
    "bloom": Arch(
        "(2) query_key_value view -> transpose -> reshape that needs a copy; (6) construction reads alibi "
        "slopes with .tolist(), so the model cannot be built on meta and is recorded on the CPU"
    ),
    "gpt2": Arch("Conv1D weights transposed with .t() before sharding (a pure strided view); tied lm_head"),
    "phi3": Arch(
        "fused qkv_proj / gate_up_proj checkpoint tensors split by vLLM's own shard narrowing (one source, "
        "several writes)"
    ),
    "gemma": Arch("multi-query attention (1 kv head, replicated under TP); tied embeddings"),
    "granitemoe": Arch("fused per-layer expert tensors [E, 2I, H] split with chunk + unbind (multi-output views)"),
    "gpt_oss": Arch(
        "(3) in-place zero_() of the loaded down_proj bias on TP ranks != 0; (2) permute(0, 2, 1)"
        ".contiguous() copies; attention sinks; EP slicing of fused experts",
        fused_on_disk=True,
    ),
    "llama4": Arch(
        "(2) q/k rotary permutation view -> transpose -> reshape (copy); (4) with EP, fused experts indexed "
        "with the model's expert-map indices moved to the loaded tensor's device: a constant index "
        "tensor whose values are recorded",
        fused_on_disk=True,
    ),
    "mamba2": Arch(
        "(8) composed_weight_loader writes -exp(A) computed from the parameter after loading A_log into "
        "it: recorded as one computed write over the loaded value (torch.exp); sharded_weight_loader asks "
        "for the TP rank while loading"
    ),
    "mamba": Arch(
        "(8) mamba_mixer's A_weight_loader: -torch.exp(A_log.float()) of the whole loaded tensor, then "
        "split per TP rank; tied embeddings"
    ),
    "phi": Arch(
        "(9) served through vLLM's Transformers backend, which creates lm_head.bias while loading (only when "
        "the checkpoint has one): a parameter the plan must declare and write whole"
    ),
    "gpt_neox": Arch(
        "(7) served through vLLM's Transformers backend automatically (GPTNeoXForCausalLM maps to "
        "TransformersForCausalLM); per-head interleaved query_key_value"
    ),
    "llama_transformers": Arch(
        "(7) architectures=[TransformersForCausalLM]: a Llama through the Transformers "
        "backend, as model_impl='transformers' would"
    ),
    "qwen3_moe_transformers": Arch(
        "(7) architectures=[TransformersMoEForCausalLM]: Qwen3-MoE experts through the "
        "Transformers backend's fused MoE, with and without EP"
    ),
}


def extra_names() -> list[str]:
    return sorted(p.name for p in HERE.iterdir() if (p / "config.json").is_file())


def config(name: str) -> dict:
    return json.loads((HERE / name / "config.json").read_text())


def num_experts(cfg: dict) -> int:
    return max(int(cfg.get(k) or 0) for k in ("n_routed_experts", "num_experts", "num_local_experts"))


def is_moe(cfg: dict) -> bool:
    return num_experts(cfg) > 0


def model_dir(name: str, dtype: str, root: Path) -> str:
    """What to pass to RecordSession for an extra architecture: its config dir, or a header-only checkpoint dir."""
    if not ARCHS[name].fused_on_disk:
        return str(HERE / name)
    target = root / f"{name}-{dtype}"
    if not (target / "model.safetensors").is_file():
        _write_header_only_checkpoint(HERE / name, target, dtype)
    return str(target)


_SAFETENSORS_CODE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def _write_header_only_checkpoint(src: Path, target: Path, dtype: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((src / "config.json").read_text())
    hf_config = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    header = {
        name: {"dtype": _SAFETENSORS_CODE[dtype], "shape": list(t.shape), "data_offsets": [0, 0]}
        for name, t in model.state_dict().items()
    }
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", tmp / "config.json")
    blob = json.dumps(header).encode()
    with open(tmp / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)


def expected_fallback(name: str, tensor_name: str) -> bool:
    pattern = ARCHS[name].fallback if name in ARCHS else None
    return bool(pattern and re.search(pattern, tensor_name))


def examples(ci: int, thorough: int) -> int:
    """Hypothesis example budget for the active profile (tests/conftest.py registers "ci" and "thorough")."""
    return thorough if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "thorough" else ci
