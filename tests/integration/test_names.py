"""Checkpoint names without weights (shardplan.record.checkpoint) == what transformers writes.

For every architecture of the coverage sweep that has a config class, a tiny random model of its tiny config is saved
with `save_pretrained` (real safetensors files); the names, shapes and dtypes listed from the config alone must equal
the saved headers exactly, except where the released checkpoints are known to store other names than transformers'
revert gives back (record.checkpoint._DISK_NAME_FIXUPS: Kimi-Linear's dense layer, LongCat-Flash's zero experts,
Inkling's model.llm.* prefix, HYV4's hyper-connection names) and tensors (DISK_ONLY_TENSORS: AXK1's dense-layer norm,
LongCat-Flash-Lite's n-gram embedding), which are then applied to the saved names, or _RELEASED_STATE (OLMo Hybrid),
whose released state is taken from the model instead of save_pretrained's revert. Architectures transformers cannot
build must raise the named NamesError instead.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shardplan import models
from shardplan.record import tiny
from shardplan.record.checkpoint import (
    _DISK_NAME_FIXUPS,
    _LISTED_FROM_RELEASED_CODE,
    _RELEASED_STATE,
    _TEXT_INSIDE,
    DISK_ONLY_TENSORS,
    FLOAT32_ON_DISK,
    NamesError,
    checkpoint_tensors,
    model_class,
    read_safetensors_header,
    transformers_config,
    use_sibling_conversion,
)

ARCHS = tiny.text_decoder_architectures()
WITH_CONFIG = []
for _arch in ARCHS:
    try:
        tiny.model_type_of(_arch)
    except tiny.NoConfigClass:
        continue
    WITH_CONFIG.append(_arch)


def test_the_sweep_has_configs_for_most_architectures():
    assert len(ARCHS) >= 120 and len(WITH_CONFIG) >= 80, (len(ARCHS), len(WITH_CONFIG))


def saved_headers(hf_config, arch: str, out: Path) -> dict:
    import torch
    import transformers

    inside = _TEXT_INSIDE.get(getattr(hf_config, "model_type", ""))
    hf_config = transformers_config(hf_config, arch)  # vLLM's own class (kimi_linear) -> transformers'
    if inside is not None:  # Step3.5's text model exists only inside transformers' multimodal Step3p7 class
        hf_config = getattr(transformers, inside[0])(text_config=hf_config.to_dict())
        cls = getattr(transformers, inside[1])
    else:
        cls = model_class(arch, hf_config)
    torch.manual_seed(0)
    model = cls._from_config(hf_config, dtype=torch.bfloat16)
    use_sibling_conversion(model)  # Inkling's text model saves under its multimodal sibling's released names
    released = _RELEASED_STATE.get(getattr(hf_config, "model_type", ""))
    if released is not None:  # stored as no transformers revert gives back (OLMo Hybrid): the released state
        state = released(model, model.state_dict())
        return {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in state.items()}
    model.save_pretrained(out)
    files = sorted(out.glob("*.safetensors"))
    assert files
    headers = {}
    for f in files:
        headers.update(read_safetensors_header(f))
    if inside is not None:  # the other towers, which a text-only checkpoint does not have
        headers = {n: v for n, v in headers.items() if not n.startswith(inside[3])}
    return headers


def builds_from_defaults(arch: str) -> bool:
    import torch
    import transformers

    from shardplan.record.configs import config_class

    if not isinstance(getattr(transformers, arch, None), type):
        return False
    try:
        hf_config = transformers_config(config_class(tiny.model_type_of(arch))(), arch)
        with torch.device("meta"):
            model_class(arch, hf_config)._from_config(hf_config, dtype=torch.bfloat16)
    except Exception:
        return False
    return True


@pytest.mark.budget(100, reason="builds each architecture's transformers model (Step-3.5's is the largest)")
@pytest.mark.parametrize("arch", WITH_CONFIG)
def test_names_equal_save_pretrained(arch, tmp_path):
    from shardplan.record.configs import hf_view

    config = tiny.tiny_config(arch)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(config))
    spec = models.resolve_model(str(tmp_path / "cfg" / "config.json"))
    try:
        view = hf_view(spec)
    except models.ConfigError:
        pytest.fail(f"the tiny config of {arch} is rejected by its config class")  # tiny.py must fix it
    try:
        expected = saved_headers(view.hf_config, arch, tmp_path / "saved")
    except Exception:
        # only an architecture transformers has no class for (a vLLM-only config), or one whose own default config
        # does not build in transformers, may fail to build; the listing must then say so by name
        assert not builds_from_defaults(arch), f"transformers builds {arch} from its defaults but not the tiny config"
        if view.hf_config.model_type in _LISTED_FROM_RELEASED_CODE:  # Step3: listed from its released model code
            assert checkpoint_tensors(spec)  # (its names: tests/integration/test_coverage.py)
            return
        with pytest.raises(NamesError, match=re.escape(arch)):
            checkpoint_tensors(spec)
        return
    derived = {name: (shape, dtype) for name, shape, dtype in checkpoint_tensors(spec, "bfloat16")}
    # The released DeepSeek-V3-style checkpoints keep these in float32 although transformers builds them in bf16.
    fp32 = FLOAT32_ON_DISK.get(arch, ())
    expected = {n: (s, "float32" if n.endswith(fp32) else d) for n, (s, d) in expected.items()}
    fixup = _DISK_NAME_FIXUPS.get(transformers_config(view.hf_config, arch).model_type)
    if fixup is not None:
        renamed = ((fixup(n, view.text_config), v) for n, v in expected.items())
        expected = {n: v for n, v in renamed if n is not None}
    extra = DISK_ONLY_TENSORS.get(arch)  # what the released checkpoints store beyond transformers' class
    if extra is not None:
        expected.update({n: (s, "bfloat16") for n, s in extra(view.text_config, expected).items()})
    assert set(derived) == set(expected), (
        sorted(set(derived) - set(expected))[:5],
        sorted(set(expected) - set(derived))[:5],
    )
    wrong = {n: (derived[n], expected[n]) for n in derived if derived[n] != expected[n]}
    assert not wrong, list(wrong.items())[:5]


@pytest.mark.parametrize(
    "arch, fused",
    [
        ("GptOssForCausalLM", "mlp.experts.gate_up_proj"),
        ("Llama4ForCausalLM", "feed_forward.experts.gate_up_proj"),
        ("MixtralForCausalLM", None),
        ("Qwen3MoeForCausalLM", None),
    ],
)
def test_experts_fused_or_per_expert_as_the_hub_stores_them(arch, fused, tmp_path):
    """GPT-OSS and Llama 4 hub checkpoints store experts fused; Mixtral and Qwen3-MoE one tensor per expert."""
    (tmp_path / "config.json").write_text(json.dumps(tiny.tiny_config(arch)))
    names = [n for n, _, _ in checkpoint_tensors(models.resolve_model(str(tmp_path / "config.json")))]
    if fused:
        assert any(n.endswith(fused) for n in names) and not any(re.search(r"experts\.\d+\.", n) for n in names)
    else:
        assert any(re.search(r"experts\.7\.", n) for n in names) and not any(n.endswith("gate_up_proj") for n in names)


def test_tied_weights_are_dropped(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny.tiny_config("GPT2LMHeadModel")))
    names = {n for n, _, _ in checkpoint_tensors(models.resolve_model(str(tmp_path / "config.json")))}
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names


# (qwen3.5-397b-a17b lists the released names, which save_pretrained does not write: test_frontier.py)
NEW_BUILTINS = ["gpt-oss-120b", "qwen3-next-80b-a3b", "glm-4.5"]


@pytest.mark.parametrize("short", NEW_BUILTINS)
def test_shrunk_builtins_names_equal_save_pretrained(short, tmp_path):
    from arch_sessions import shrink_overrides

    from shardplan.record.configs import hf_view

    spec = models.resolve_model(short, shrink_overrides(short))
    view = hf_view(spec)
    expected = saved_headers(view.hf_config, spec.architecture, tmp_path)
    derived = {name: (shape, dtype) for name, shape, dtype in checkpoint_tensors(spec, "bfloat16")}
    assert derived == expected


# ---- a full-size public checkpoint ---------------------------------------------------------------------------
def _public_tensors(fixture: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The fixture's rows expanded ({a-b}: every index of the inclusive range)."""
    data = json.loads((Path(__file__).parent / "fixtures" / fixture).read_text())
    out = {}
    for pattern, shape, dtype in data["rows"]:
        names = [""]
        for piece in re.split(r"(\{\d+-\d+\})", pattern):
            m = re.fullmatch(r"\{(\d+)-(\d+)\}", piece)
            values = [str(i) for i in range(int(m[1]), int(m[2]) + 1)] if m else [piece]
            names = [n + v for n in names for v in values]
        out.update((n, (tuple(shape), dtype)) for n in names)
    assert len(out) == data["num_tensors"]
    return out


@pytest.mark.parametrize("include_mtp", [False, True])
def test_deepseek_v3_names_equal_the_public_full_size_checkpoint(include_mtp):
    """The 91,991 tensors of the public DeepSeek-R1 checkpoint (DeepSeek-V3's architecture and config, block FP8):
    the built-in deepseek-v3 (BF16) lists exactly its tensors in BF16 form (fp8 weights as bfloat16, no
    weight_scale_inv; the router's e_score_correction_bias stays float32), MTP layer 61 only when asked for."""
    public = _public_tensors("deepseek-r1-fp8-tensors.json")
    want = {
        n: (shape, "bfloat16" if dtype == "float8_e4m3fn" else dtype)
        for n, (shape, dtype) in public.items()
        if not n.endswith("_scale_inv") and (include_mtp or not n.startswith("model.layers.61."))
    }
    got = {
        n: (tuple(shape), str(dtype))
        for n, shape, dtype in checkpoint_tensors(models.resolve_model("deepseek-v3"), include_mtp=include_mtp)
    }
    assert sorted(set(want) - set(got))[:5] == [] and sorted(set(got) - set(want))[:5] == []
    assert {n: v for n, v in got.items() if v != want[n]} == {}


def test_deepseek_v3_fp8_lists_the_public_fp8_checkpoint_exactly():
    """The built-in deepseek-v3-fp8 as the recorder lists it (record/fp8.py: which weights are float8_e4m3fn, each
    with a float32 weight_scale_inv of ceil(rows/128) x ceil(cols/128)) == the public DeepSeek-R1 FP8 checkpoint's
    tensors, names, shapes and dtypes (MTP layer 61 left out, as vLLM's DeepseekV3ForCausalLM does not load it)."""
    from shardplan.record.fp8 import fp8_checkpoint_tensors

    public = {
        n: v for n, v in _public_tensors("deepseek-r1-fp8-tensors.json").items() if not n.startswith("model.layers.61.")
    }
    spec = models.resolve_model("deepseek-v3-fp8")
    got = {
        n: (tuple(shape), str(dtype))
        for n, shape, dtype in fp8_checkpoint_tensors(checkpoint_tensors(spec, include_mtp=False), spec.config)
    }
    assert sorted(set(public) - set(got))[:5] == [] and sorted(set(got) - set(public))[:5] == []
    assert {n: v for n, v in got.items() if v != public[n]} == {}


def _names(arch, tmp_path):
    config = tiny.tiny_config(arch)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return {n: s for n, s, _ in checkpoint_tensors(models.resolve_model(str(tmp_path / "config.json")))}


def test_kimi_linear_dense_first_layer_keeps_its_on_disk_mlp_names(tmp_path):
    # moonshotai/Kimi-Linear-48B-A3B-Instruct stores layer 0's dense MLP as mlp.*, the MoE layers as block_sparse_moe.*
    names = _names("KimiLinearForCausalLM", tmp_path)
    assert "model.layers.0.mlp.down_proj.weight" in names
    assert not any(n.startswith("model.layers.0.block_sparse_moe.") for n in names)
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in names


def test_longcat_flash_zero_experts_have_no_tensors(tmp_path):
    config = tiny.tiny_config("LongcatFlashForCausalLM")
    names = _names("LongcatFlashForCausalLM", tmp_path)
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in names if ".experts." in n}
    assert experts == set(range(config["n_routed_experts"]))


def test_hy_v4_lists_the_hub_names_and_f32_mixers(tmp_path):
    # transformers' reverse of its hy_v4 renames misplaces hc_pre and turns the MLPs' gate_proj into linear_gate;
    # tencent/Hy4-preview stores the hub names below, the mixers, sinks and router bias in F32
    names = {n: d for n, _, d in checkpoint_tensors(_spec("HYV4ForCausalLM", tmp_path))}
    for name in (
        "model.hc_head.hc_head_fn",
        "model.layers.0.hc_attn_layer.hc_pre.hc_fn",
        "model.layers.0.hc_mlp_layer.hc_pre.hc_base",
        "model.layers.1.self_attn.learnable_sink_param",
        "model.layers.1.mlp.gate.e_score_correction_bias",
    ):
        assert names.get(name) == "float32", name
    for name in (
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.shared_experts.gate_proj.weight",
        "model.layers.1.self_attn.linear_gate.weight",
    ):
        assert names.get(name) == "bfloat16", name
    assert not any(".hc_pre.hc_attn_layer." in n or ".mlp.linear_gate." in n for n in names)


def test_axk1_and_longcat_flash_lite_list_what_transformers_does_not_build(tmp_path):
    axk1 = {n: s for n, s, _ in checkpoint_tensors(_spec("AXK1ForCausalLM", tmp_path / "a"))}
    assert axk1["model.layers.0.post_mlp_layernorm.weight"] == (128,)  # the dense first layer's, as released
    config = tiny.tiny_config("LongcatFlashNgramForCausalLM")
    lite = {n: s for n, s, _ in checkpoint_tensors(_spec("LongcatFlashNgramForCausalLM", tmp_path / "b"))}
    tables = config["emb_split_num"] * (config["emb_neighbor_num"] - 1)
    rows, dim = config["ngram_vocab_size_ratio"] * config["vocab_size"], config["hidden_size"] // tables
    for i in range(tables):
        assert lite[f"model.ngram_embeddings.embedders.{i}.weight"] == (rows + 2 * i + 1, dim)
        assert lite[f"model.ngram_embeddings.post_projs.{i}.weight"] == (config["hidden_size"], dim)
    assert not any(
        ".ngram_embeddings." in n for n, _, _ in checkpoint_tensors(_spec("LongcatFlashForCausalLM", tmp_path / "c"))
    )


def _spec(arch, directory):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(tiny.tiny_config(arch)))
    return models.resolve_model(str(directory / "config.json"))


def test_an_architecture_without_a_transformers_class_says_so_and_how_to_proceed(tmp_path, monkeypatch):
    # Step3's text model (step3_text) as if its released model code were not known: transformers ships no model
    # class for it, text or multimodal, so the names can only come from a checkpoint directory; the error says
    # exactly that (not "fix the config field")
    from shardplan.record import checkpoint, tiny
    from shardplan.record.checkpoint import NamesError

    monkeypatch.delitem(checkpoint._LISTED_FROM_RELEASED_CODE, "step3_text")
    monkeypatch.setenv("SHARDPLAN_NAMES_CACHE", "0")
    monkeypatch.setattr(checkpoint, "_META_CACHE", type(checkpoint._META_CACHE)())  # nothing listed before counts
    row, model_dir, _ = tiny.sweep_start("Step3TextForCausalLM", tmp_path)
    assert not row["status"]
    with pytest.raises(NamesError) as info:
        checkpoint_tensors(models.resolve_model(str(model_dir)))
    message = str(info.value)
    assert "has no model class for Step3TextForCausalLM" in message and "'step3_text'" in message
    assert "model.safetensors.index.json" in message and "Fix the config field" not in message
