"""The coverage sweep (shardplan.record.coverage) on a sample: verdicts, the report, and the per-architecture timeout.

The full sweep (every text decoder vLLM implements, TP 1/2/4, every rank) runs on demand with
`python -m shardplan.record.coverage` and writes docs/coverage.md; here a hybrid linear-attention MoE, an alias-only
config, a Mamba-2 (A = -exp(A_log) through composed_weight_loader) and Phi (the Transformers backend creates
lm_head.bias while loading) run at TP 2 (with EP where the model has experts), every rank, bitwise, no fallback."""

from __future__ import annotations

import json

import pytest

from shardplan.record import coverage, tiny

MOE = {
    "DeepseekV4ForCausalLM",
    "Step3p5ForCausalLM",
    "InklingForCausalLM",
    "Qwen3NextForCausalLM",
    "MiniMaxM2ForCausalLM",
    "KimiLinearForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "DeepseekV32ForCausalLM",
    "NemotronHForCausalLM",
    "Qwen4ExpForCausalLM",
    "LongcatFlashNgramForCausalLM",
    "AXK1ForCausalLM",
    "HYV4ForCausalLM",
}


# MiniMax-M2 and Kimi-Linear need their public config fields (publicfields.py), Kimi-Linear also vLLM's CPU-worker
# set-up and its dense layer's on-disk names; Qwen3.5 imports torchvision through transformers (record/cpushim)
@pytest.mark.parametrize(
    "arch",
    [
        "Qwen3NextForCausalLM",
        "GPT2LMHeadModel",
        "Mamba2ForCausalLM",
        "PhiForCausalLM",
        "MiniMaxM2ForCausalLM",
        "KimiLinearForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "DeepseekV4ForCausalLM",  # its reference names (no model. prefix, attn.kv_norm, F32 mixers), kernel head sizes
        "Step3p5ForCausalLM",  # its text model only inside transformers' multimodal Step3p7 class
        "InklingForCausalLM",  # released under model.llm.* (its multimodal sibling's conversion, reverted)
        "Zamba2ForCausalLM",  # multi-head shared attention: kv heads = heads, as its class and public configs
        # vLLM's CPU build refuses these for lack of a kernel only (build.gpu_kernel_refusals_answered): DSA sparse
        # attention, a non-gated MoE, QSA's FlashAttention probe, the V2 model runner without Triton
        "DeepseekV32ForCausalLM",
        "NemotronHForCausalLM",
        # tensors the released checkpoints store that transformers' class does not build or names otherwise
        # (record/checkpoint.py: DISK_ONLY_TENSORS, _DISK_NAME_FIXUPS): every param whole-written
        "AXK1ForCausalLM",  # post_mlp_layernorm on the dense first layer too
        "HYV4ForCausalLM",  # the hyper-connection params under their hub names
        "LongcatFlashNgramForCausalLM",  # the n-gram embedding (also needs the V2 model runner answered)
    ],
)
def test_sample_architectures_pass_bitwise(arch, tmp_path):
    row = coverage.run_architecture(arch, tmp_path, tps=(2,))
    assert row["status"] == "pass", row
    ((layout, result),) = row["layouts"].items()
    assert result["ranks"] == result["equal"] == 2 and not result["mismatched"] and not result["fallbacks"]
    assert layout == ("tp2-ep" if arch in MOE else "tp2")


def test_kernel_refusals_are_answered_for_building_only():
    # a live CPU engine must still get vLLM's own refusal: the stand-ins are undone when the build ends
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
    from vllm.platforms import current_platform

    from shardplan.record import build

    before = (type(current_platform).__dict__["get_attn_backend_cls"], FusedMoEConfig.__dict__["__post_init__"])
    with build.gpu_kernel_refusals_answered([]):
        assert type(current_platform).__dict__["get_attn_backend_cls"] is not before[0]
    assert (type(current_platform).__dict__["get_attn_backend_cls"], FusedMoEConfig.__dict__["__post_init__"]) == before


def test_a_param_no_listed_tensor_writes_is_a_fail(tmp_path, monkeypatch):
    # both loaders leaving a whole param as allocated is bitwise "equal", but the listing missed a tensor
    from shardplan.record import checkpoint

    monkeypatch.setitem(
        checkpoint._DISK_NAME_FIXUPS, "llama", lambda name, config: None if name == "model.norm.weight" else name
    )
    row = coverage.run_architecture("LlamaForCausalLM", tmp_path, tps=(1,))
    assert row["status"] == "FAIL" and "model.norm.weight" in row["reason"], row


def test_deepseek_v32_lists_its_indexer():
    # vLLM reads deepseek_v32 with DeepseekV3Config, whose transformers model class has no DSA indexer; the names
    # come from transformers' DeepseekV32 class
    from shardplan.models import resolve_model
    from shardplan.record.checkpoint import checkpoint_tensors

    spec = resolve_model("deepseek-v3.2", ["num_hidden_layers=4", "n_routed_experts=8", "vocab_size=1000"])
    names = {name for name, _, _ in checkpoint_tensors(spec)}
    for leaf in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"):
        assert f"model.layers.3.self_attn.indexer.{leaf}" in names


def test_tiny_configs_carry_the_public_field_set():
    from shardplan.record.publicfields import PUBLIC_FIELDS

    for arch, entry in PUBLIC_FIELDS.items():
        assert entry["source"].strip(), arch
        config = tiny.tiny_config(arch)
        missing = set(entry["fields"]) - set(config)
        assert not missing, (arch, sorted(missing))


def test_a_tiny_config_its_class_refuses_is_a_fail_not_cannot(tmp_path, monkeypatch):
    # the tiny config is the sweep's own: a config class refusing it is our failure, never "cannot run here"
    monkeypatch.setitem(tiny._FIXES, "LlamaForCausalLM", {"hidden_size": "not a size"})
    row = coverage.run_architecture("LlamaForCausalLM", tmp_path, tps=(1,))
    assert row["status"] == "FAIL" and "hidden_size" in row["reason"], row


def test_an_architecture_without_a_config_class_says_why(tmp_path):
    row = coverage.run_architecture("BailingMoeForCausalLM", tmp_path)
    assert row["status"] == "cannot" and "remote code" in row["reason"] and "--trust-remote-code" in row["reason"]


def test_every_registry_architecture_is_enumerated():
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

    archs = tiny.text_decoder_architectures()
    assert set(_TEXT_GENERATION_MODELS) <= set(archs) and "GPTNeoXForCausalLM" in archs  # + Transformers backend


def test_render_counts_and_rows():
    rows = [
        {"arch": "A", "status": "pass", "reason": "", "layouts": {"tp1": {"ranks": 1, "equal": 1}}, "fallbacks": []},
        {
            "arch": "B",
            "status": "fallback",
            "reason": "",
            "layouts": {"tp2": {"ranks": 2, "equal": 2}},
            "fallbacks": ["x.A_log (Tensor.exp)"],
        },
        {"arch": "C", "status": "cannot", "reason": "a | b", "layouts": {}, "fallbacks": []},
    ]
    text = coverage.render(rows, "vLLM x")
    assert "1 pass, 1 pass with fallbacks, 0 fail, 1 cannot run here" in text
    assert "Of the 2 that vLLM itself can load here, 50% pass" in text
    assert "| B |  | fallback | tp2 2/2 | fallback: x.A_log (Tensor.exp) |" in text and "a \\| b" in text


def test_a_hanging_architecture_costs_one_row(tmp_path, monkeypatch):
    # the worker hangs on Llama (injected: a timing would make the test depend on the machine's speed)
    monkeypatch.setenv("SHARDPLAN_COVERAGE_HANG", "LlamaForCausalLM")
    results = tmp_path / "results.jsonl"
    rows = coverage.sweep(
        ["LlamaForCausalLM", "BailingMoeForCausalLM"], results, timeout=8, resume=False, progress=lambda line: None
    )
    assert [r["arch"] for r in rows] == ["LlamaForCausalLM", "BailingMoeForCausalLM"]
    assert rows[0]["status"] == "cannot" and "timed out after 8 s" in rows[0]["reason"]
    assert rows[1]["status"] == "cannot" and "remote code" in rows[1]["reason"]  # the sweep went on
    assert len([json.loads(line) for line in results.read_text().splitlines()]) == 2


def test_a_known_vllm_loader_bug_is_cannot_only_with_its_own_error(tmp_path, monkeypatch):
    # DBRX's hub names are refused by vLLM's own load_weights (vllm-project/vllm issue 49004): "cannot", quoting it
    row = coverage.run_architecture("DbrxForCausalLM", tmp_path, tps=(1,))
    assert row["status"] == "cannot" and "KeyError: 'blocks.0.ffn.experts.w13_weight'" in row["reason"], row
    assert "49004" in row["reason"]
    # any other refusal of the same architecture is still the sweep's failure
    monkeypatch.setitem(coverage.VLLM_LOADER_BUGS, "DbrxForCausalLM", ("KeyError: 'another'", "not this"))
    row = coverage.run_architecture("DbrxForCausalLM", tmp_path / "again", tps=(1,))
    assert row["status"] == "FAIL" and "refuses the derived checkpoint" in row["reason"], row


def test_a_config_with_the_public_fields_reaches_vllms_own_verdict(tmp_path, monkeypatch):
    # Qwen4-Exp's class leaves the QSA indexer sizes None (transformers then cannot build it: our FAIL); with the
    # public fields it builds as a GPU engine does and passes; only vLLM's CPU kernel probe refused it before
    row = coverage.run_architecture("Qwen4ExpForCausalLM", tmp_path, tps=(1,))
    assert row["status"] == "pass", row
    import contextlib

    from shardplan.record import build

    monkeypatch.setattr(build, "gpu_kernel_refusals_answered", contextlib.nullcontext)
    row = coverage.run_architecture("Qwen4ExpForCausalLM", tmp_path / "cpu-refusal", tps=(1,))
    assert row["status"] == "cannot" and "requires FlashAttention" in row["reason"], row


def test_olmo_hybrid_lists_the_released_names_and_is_vllms_conv_loader_bug(tmp_path, monkeypatch):
    # allenai/Olmo-Hybrid-7B's names (open-instruct's olmo_core_hybrid.py key maps, read from the released
    # checkpoint): the model's own norm names, the Gated DeltaNet conv split per q/k/v at key, key, value channels
    from shardplan.models import resolve_model
    from shardplan.record.checkpoint import checkpoint_tensors

    row = coverage.run_architecture("OlmoHybridForCausalLM", tmp_path, tps=(1,))
    listed = {name: shape for name, shape, _ in checkpoint_tensors(resolve_model(str(tmp_path / row["arch"])))}
    gdn = {n.removeprefix("model.layers.0.") for n in listed if n.startswith("model.layers.0.")}
    attn = {n.removeprefix("model.layers.2.") for n in listed if n.startswith("model.layers.2.")}
    mlp = {f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert gdn == mlp | {"input_layernorm.weight", "post_attention_layernorm.weight", "linear_attn.A_log"} | {
        f"linear_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj")
    } | {"linear_attn.q_conv1d.weight", "linear_attn.k_conv1d.weight", "linear_attn.v_conv1d.weight"} | {
        "linear_attn.o_norm.weight",
        "linear_attn.dt_bias",
    }
    assert attn == mlp | {"post_attention_layernorm.weight", "post_feedforward_layernorm.weight"} | {
        f"self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
    }
    key, value = (
        listed["model.layers.0.linear_attn.k_proj.weight"][0],
        listed["model.layers.0.linear_attn.v_proj.weight"][0],
    )
    assert key != value and listed["model.layers.0.linear_attn.v_conv1d.weight"][0] == value
    assert listed["model.layers.0.linear_attn.q_conv1d.weight"][0] == key
    # vLLM 0.32's own loader raises on those names (vllm-project/vllm PR 55858): "cannot", quoting it
    assert row["status"] == "cannot" and "PR 55858" in row["reason"], row
    # with that PR's fix (the conv loader reads the shard id the mapper put on the tensor) the row verifies bitwise
    from vllm.model_executor.layers.mamba.gdn import olmo_gdn_linear_attn as gdn_attn

    made = gdn_attn._make_fused_conv1d_weight_loader

    def fixed(dims, tp_size, tp_rank):
        loader = made(dims, tp_size, tp_rank)
        return lambda param, w, shard=None: loader(param, w, getattr(w, "shard_id", None) if shard is None else shard)

    monkeypatch.setattr(gdn_attn, "_make_fused_conv1d_weight_loader", fixed)
    row = coverage.run_architecture("OlmoHybridForCausalLM", tmp_path / "fixed", tps=(2,))
    assert row["status"] == "pass" and row["layouts"]["tp2"]["equal"] == 2, row


def test_laguna_is_cannot_only_while_vllm_drops_its_correction_bias(tmp_path, monkeypatch):
    # the hub's mlp.experts.e_score_correction_bias is listed; vLLM 0.32's loader writes it nowhere (the param moved
    # under routed_experts): "cannot", every other param bitwise
    row = coverage.run_architecture("LagunaForCausalLM", tmp_path, tps=(2,))
    assert row["status"] == "cannot" and "41184" in row["reason"], row
    assert row["layouts"]["tp2-ep"]["equal"] == 2 and not row["layouts"]["tp2-ep"]["mismatched"]
    # any other param left unwritten is still the listing's failure
    monkeypatch.setitem(
        coverage.VLLM_LOADER_DROPS, "LagunaForCausalLM", (".mlp.experts.e_score_correction_bias", ".x", "")
    )
    row = coverage.run_architecture("LagunaForCausalLM", tmp_path / "again", tps=(1,))
    assert row["status"] == "FAIL" and "e_score_correction_bias" in row["reason"], row


def test_step3_text_lists_stepfuns_released_names_and_verifies(tmp_path):
    # transformers has no Step3 class: the names come from StepFun's released model code (separate q/k/v, the
    # low-rank query's inter_norm and wq, stacked experts [E, I, H] / [E, H, I], a shared expert on MoE layers)
    from shardplan.models import resolve_model
    from shardplan.record.build import LayoutRejected
    from shardplan.record.checkpoint import checkpoint_tensors
    from shardplan.record.session import RecordSession

    row = coverage.run_architecture("Step3TextForCausalLM", tmp_path, tps=(2,))
    assert row["status"] == "pass" and row["layouts"]["tp2-ep"]["equal"] == 2, row  # EP: vLLM's moe_num_experts
    config = tiny.tiny_config("Step3TextForCausalLM")
    hidden, experts, inter = config["hidden_size"], config["moe_num_experts"], config["moe_intermediate_size"]
    listed = {name: shape for name, shape, _ in checkpoint_tensors(resolve_model(str(tmp_path / row["arch"])))}
    attn = {f"self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "inter_norm", "wq")}
    norms = {"input_layernorm.weight", "post_attention_layernorm.weight"}
    for layer, ffn in ((0, {"mlp"}), (1, {"moe", "share_expert"})):
        names = {n.removeprefix(f"model.layers.{layer}.") for n in listed if n.startswith(f"model.layers.{layer}.")}
        mlps = {f"{f}.{p}_proj.weight" for f in ffn for p in ("gate", "up", "down")}
        assert names == attn | norms | mlps | ({"moe.gate.weight"} if layer else set()), names
    assert listed["model.layers.1.moe.gate_proj.weight"] == (experts, inter, hidden)
    assert listed["model.layers.1.moe.down_proj.weight"] == (experts, hidden, inter)
    assert listed["model.layers.0.self_attn.q_proj.weight"] == (config["share_q_dim"], hidden)
    # a dense model with --ep is still refused by vLLM's own expert count
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps(tiny.tiny_config("LlamaForCausalLM")))
    with pytest.raises(LayoutRejected, match="--ep"):
        RecordSession(str(llama), coverage.Layout(tp=2, ep=True))
