"""Configs read as vLLM reads them (shardplan.record.configs): aliases, nested text configs, defaults, overrides on any
key, named errors for unknown keys / model types / architectures, max_model_len from the config, stable fingerprints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardplan import models
from shardplan.models import ConfigError, resolve_model
from shardplan.record.configs import UnknownConfigKey, UnsupportedArchitecture, hf_view

REPO = Path(__file__).resolve().parents[2]

# A GPT-2 config.json as the hub has them: sizes only under GPT-2's own names (n_layer, n_embd, ...).
GPT2_ALIASES_ONLY = {
    "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 128,
    "n_head": 4,
    "n_positions": 512,
    "n_inner": None,
    "vocab_size": 300,
    "tie_word_embeddings": True,
}
# A composite config whose language model lives in text_config (Llama 4's hub layout).
LLAMA4_NESTED = {
    "architectures": ["Llama4ForConditionalGeneration"],
    "model_type": "llama4",
    "text_config": {
        "model_type": "llama4_text",
        "num_hidden_layers": 4,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 300,
        "intermediate_size": 96,
        "intermediate_size_mlp": 192,
        "num_local_experts": 4,
    },
    "vision_config": {"model_type": "llama4_vision_model"},
}


def write(tmp_path: Path, config: dict, name: str = "ckpt") -> Path:
    path = tmp_path / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return path


def test_aliases_are_read_through_the_config_class(tmp_path):
    view = hf_view(resolve_model(str(write(tmp_path, GPT2_ALIASES_ONLY))))
    text = view.text_config
    assert (text.num_hidden_layers, text.hidden_size, text.num_attention_heads, text.max_position_embeddings) == (
        2,
        128,
        4,
        512,
    )
    assert view.num_hidden_layers == 2


@pytest.mark.parametrize("override, spelled", [("num_hidden_layers=1", "n_layer"), ("n_layer=1", "n_layer")])
def test_an_override_replaces_every_spelling_of_its_field(tmp_path, override, spelled):
    both = dict(GPT2_ALIASES_ONLY, num_hidden_layers=2)  # some hub files spell a size twice
    for config in (GPT2_ALIASES_ONLY, both):
        view = hf_view(resolve_model(str(write(tmp_path, config)), [override]))
        assert view.text_config.num_hidden_layers == 1
        spellings = {k: v for k, v in view.config.items() if k in ("n_layer", "num_hidden_layers")}
        assert spellings == {spelled: 1}


def test_overrides_reach_the_nested_text_config(tmp_path):
    path = str(write(tmp_path, LLAMA4_NESTED))
    for override in ("num_hidden_layers=1", "text_config.num_hidden_layers=1"):
        view = hf_view(resolve_model(path, [override]))
        assert view.num_hidden_layers == 1 and view.config["text_config"]["num_hidden_layers"] == 1
        assert "num_hidden_layers" not in view.config  # routed, not added at the top
    assert hf_view(resolve_model(path)).num_hidden_layers == 4
    assert hf_view(resolve_model(path)).num_experts == 4


@pytest.mark.parametrize(
    "model, override, suggestion",
    [
        ("llama-3.1-8b", "num_hiden_layers=2", "'num_hidden_layers'"),
        ("llama-3.1-8b", "intermediate_sise=64", "'intermediate_size'"),
        ("kimi-k2", "n_routed_expert=8", "'n_routed_experts'"),
        ("nested", "text_config.num_local_expert=2", "'text_config.num_local_experts'"),
    ],
)
def test_unknown_override_key_is_named_with_the_closest_valid_key(tmp_path, model, override, suggestion):
    if model == "nested":
        model = str(write(tmp_path, LLAMA4_NESTED))
    spec = resolve_model(model, [override])  # the fingerprint side needs no config class and accepts it ...
    with pytest.raises(UnknownConfigKey) as info:
        hf_view(spec)  # ... the side that reads the config through its class names the typo
    message = str(info.value)
    assert override.split("=")[0] in message and suggestion in message and "Did you mean" in message
    assert (model if "/" in model else f"built-in {model}") in message


def test_plus_prefix_adds_a_key_on_purpose():
    view = hf_view(resolve_model("llama-3.1-8b", ["+my_flag=1", "num_hidden_layers=2"]))
    assert view.config["my_flag"] == 1 and view.num_hidden_layers == 2


def test_absent_sizes_take_the_class_defaults_and_bad_ones_are_named(tmp_path):
    config = dict(resolve_model("llama-3.1-8b").config)
    del config["hidden_size"]
    from transformers import LlamaConfig

    assert (
        hf_view(resolve_model(str(write(tmp_path, config, "a")))).text_config.hidden_size == LlamaConfig().hidden_size
    )
    path = write(tmp_path, dict(config, num_attention_heads=None), "b")
    with pytest.raises(ConfigError) as info:
        hf_view(resolve_model(str(path)))
    assert str(path) in str(info.value) and "'num_attention_heads'" in str(info.value)
    # an alias is named as the file spells it
    path = write(tmp_path, dict(GPT2_ALIASES_ONLY, n_head=None), "c")
    with pytest.raises(ConfigError, match="config.json: .*field 'n_head'"):
        hf_view(resolve_model(str(path)))


def test_model_type_without_config_class_is_named(tmp_path):
    path = write(tmp_path, dict(GPT2_ALIASES_ONLY, model_type="bogus_remote"))
    with pytest.raises(ConfigError) as info:
        hf_view(resolve_model(str(path)))
    assert str(path) in str(info.value) and "'model_type'" in str(info.value) and "bogus_remote" in str(info.value)


def test_builtin_fingerprints_are_unchanged():
    """Plans in plans/ are found by config sha256: those of the built-ins must not move."""
    from shardplan.plan.file.store import SHIPPED_DIR, scan

    found = 0
    for path, header, error in scan([SHIPPED_DIR]):
        assert header is not None, error
        short = path.name.split("--")[0]
        assert resolve_model(short).config_sha256 == header.config_sha256, path
        found += 1
    assert found >= 10


def test_trainer_side_loads_a_shipped_plan_without_transformers_or_vllm():
    code = (
        "import sys; from shardplan.plan.file import store; "
        "p = store.load_plan('llama-3.1-8b', tp=2, rank=1, check_vllm=False); "
        "bad = [m for m in ('transformers', 'vllm', 'safetensors') if m in sys.modules]; "
        "assert not bad, bad; print(len(p.writes))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 0


# ---- vLLM side ------------------------------------------------------------------------------------------------------
def test_alias_only_config_records_and_verifies_bitwise(tmp_path):
    """The issue's case: a GPT-2 config with only n_layer/n_embd/..., shrunk through an alias override, through vLLM."""
    from shardplan.plan.layout import Layout
    from shardplan.record import verify
    from shardplan.record.session import RecordSession

    path = write(tmp_path, dict(GPT2_ALIASES_ONLY, n_layer=3, n_positions=256))
    session = RecordSession(str(path.parent), Layout(tp=2), overrides=["num_hidden_layers=2"])
    assert session.vllm_config.model_config.hf_text_config.num_hidden_layers == 2
    # max_model_len comes from the config (n_positions), not a constant that would exceed it
    assert session.vllm_config.model_config.max_model_len == 256
    plan, _ = session.record_rank(1)
    checkpoint = verify.random_checkpoint(session.tensors, 0)
    verdict = verify.verify_rank(session.vllm_config, session.layout, 1, plan, checkpoint)
    assert verdict.num_params > 0 and not verdict.mismatched and not plan.fallbacks
    assert not any(".h.2." in n for n, _, _ in session.tensors) and any(".h.1." in n for n, _, _ in session.tensors)


def test_architecture_vllm_does_not_implement_is_named(tmp_path):
    from shardplan.plan.layout import Layout
    from shardplan.record.session import RecordSession

    path = write(tmp_path, dict(GPT2_ALIASES_ONLY, architectures=["GPT2LMHeadModle"]))
    with pytest.raises(UnsupportedArchitecture) as info:
        RecordSession(str(path.parent), Layout(tp=1))
    assert str(path) in str(info.value) and "GPT2LMHeadModle" in str(info.value)
    assert "GPT2LMHeadModel" in str(info.value)  # the closest name vLLM knows


def test_unknown_override_key_stops_a_record_session():
    from shardplan.plan.layout import Layout
    from shardplan.record.session import RecordSession

    with pytest.raises(UnknownConfigKey, match="num_hidden_layers"):
        RecordSession("llama-3.1-8b", Layout(tp=1), overrides=["num_hiden_layers=2"])


def test_public_names():
    from shardplan.record import checkpoint

    for name in ("ConfigError", "ModelSpec", "UnknownModelError", "config_sha256", "list_models", "resolve_model"):
        assert hasattr(models, name)
    for name in ("checkpoint_tensors", "read_safetensors_header", "on_disk_tensors"):  # moved out of models
        assert hasattr(checkpoint, name)


# ------------------------------------------------------------------------------------------ bounds, decoding, nesting

LLAMA_TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 128,
}


def _with_raw(tmp_path: Path, name: str, raw_value: str) -> Path:
    path = tmp_path / name / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(LLAMA_TINY)[:-1] + ', "x": ' + raw_value + "}")
    return path.parent


@pytest.mark.parametrize(
    "raw, needle",
    [
        ("[" * 200_000 + "]" * 200_000, "nests arrays/objects deeper"),
        ("[" * 40 + "]" * 40, "nests more than 32 levels"),
        ("9" * 5000, "an integer of 5000 digits"),
        ("-" + "9" * 20, "an integer of 20 digits"),
        (str(1 << 63), "beyond the int64 range"),
    ],
)
def test_config_file_beyond_the_bounds_is_a_named_error(tmp_path, raw, needle):
    # used to end in a bare RecursionError / ValueError (int-string conversion limit)
    with pytest.raises(ConfigError, match="config.json") as info:
        resolve_model(str(_with_raw(tmp_path, "c", raw)))
    assert needle in str(info.value)
    assert resolve_model(str(_with_raw(tmp_path, "ok", str((1 << 63) - 1)))).config["x"] == (1 << 63) - 1


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["num_hidden_layers=" + "9" * 5000], "integer of 5000 digits"),
        ({"num_hidden_layers": 10**5000}, "beyond the int64 range"),
        (["x=" + "[" * 100_000 + "]" * 100_000], "deeper than Python's JSON reader"),
        ({"x": json.loads("[" * 40 + "]" * 40)}, "nests more than 32 levels"),
        (["a." * 40 + "b=1"], "41 dotted parts"),
    ],
)
def test_override_beyond_the_bounds_is_a_named_error(overrides, needle):
    with pytest.raises(ConfigError, match="override") as info:
        resolve_model("llama-3.1-8b", overrides)
    assert needle in str(info.value)


def test_non_finite_floats_are_decoded_as_transformers_does(tmp_path):
    """transformers 5 writes inf/nan as {"__float__": "Infinity"} (GraniteMoeHybrid's time_step_limit) and
    from_pretrained decodes them; shardplan used to refuse the file."""
    from transformers import AutoConfig, GraniteMoeHybridConfig

    config = GraniteMoeHybridConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        intermediate_size=128,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["mamba", "attention"],
        mamba_n_heads=4,
        mamba_d_head=32,
        shared_intermediate_size=128,
        time_step_limit=(0.0, float("inf")),
    )
    config.architectures = ["GraniteMoeHybridForCausalLM"]
    config.save_pretrained(tmp_path / "granite")
    assert '"__float__": "Infinity"' in (tmp_path / "granite" / "config.json").read_text()
    view = hf_view(resolve_model(str(tmp_path / "granite")))
    assert (
        tuple(view.text_config.time_step_limit)
        == tuple(AutoConfig.from_pretrained(tmp_path / "granite").time_step_limit)
        == (0.0, float("inf"))
    )
    assert view.config["time_step_limit"][1] == {"__float__": "Infinity"}  # vLLM gets the file's own spelling
    with pytest.raises(ConfigError, match=r"GraniteMoeHybridConfig rejects this config: .*time_step_limit"):
        hf_view(resolve_model(str(tmp_path / "granite"), ['time_step_limit=[0.0, {"__float__": "Lots"}]']))


def test_nested_override_keys_are_checked_like_top_level_ones():
    with pytest.raises(
        UnknownConfigKey,
        match=r"'rope_scaling.factorr' names no key of 'rope_scaling'.*"
        r"Did you mean 'rope_scaling.factor'",
    ):
        hf_view(resolve_model("llama-3.1-8b", ["rope_scaling.factorr=2"]))
    assert hf_view(resolve_model("llama-3.1-8b", ["rope_scaling.factor=2"])).config["rope_scaling"]["factor"] == 2
    assert (
        hf_view(resolve_model("kimi-k2", ["num_hidden_layers=2", "rope_scaling.beta_fast=2"])).config["rope_scaling"][
            "beta_fast"
        ]
        == 2
    )
    on_purpose = hf_view(resolve_model("llama-3.1-8b", ["rope_scaling.+factorr=2"])).config["rope_scaling"]
    assert on_purpose["factorr"] == 2 and on_purpose["factor"] == 8.0
    with pytest.raises(UnknownConfigKey, match=r"'rope_scaling.mscalee'"):  # a new mapping: RoPE keys only
        hf_view(resolve_model("qwen3-30b-a3b", ["rope_scaling={}", "rope_scaling.mscalee=1"]))


def test_absurd_model_sizes_are_refused_before_anything_is_built(monkeypatch):
    from shardplan.record import checkpoint, configs

    monkeypatch.setattr(checkpoint, "saved_state", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(
        configs.ModelTooLarge,
        match=r"1000000 layers x 0 experts is an estimated 16000008 "
        r"checkpoint tensors.*1048576 writes a plan holds per rank",
    ):
        checkpoint.checkpoint_tensors(resolve_model("llama-3.1-8b", ["num_hidden_layers=1000000"]))
    with pytest.raises(configs.ModelTooLarge, match=r"hidden_size 16777216 x vocab_size 16777217"):
        hf_view(resolve_model("llama-3.1-8b", ["hidden_size=16777216", "vocab_size=16777217"]))
    kimi = hf_view(resolve_model("kimi-k2"))
    assert configs.estimated_tensors(kimi) == 71_256  # the largest built-in (69,975 tensors): 15x under the bound
