"""The SGLang side of the coverage sweep (`python -m shardplan.record.coverage --engine sglang`): a small architecture's
verdict is pass against SGLang's own loader, a replay that differs is FAIL naming the tensor, an architecture without a
config class is "cannot" with the reason, a cited SGLang loader bug is that layout's own failure, and the report puts
SGLang's column beside vLLM's ("-" where an engine lacks the architecture).

Gemma is the small case on purpose: SGLang's Gemma loader adds 1 to the norm weights in place on the tensor it is
given, so a harness that hands the real loader the shared checkpoint tensors sees the plan's replay differ."""

from __future__ import annotations

import torch

from shardplan.record import coverage
from shardplan.record.sglang import coverage as sglang_coverage


def test_a_small_architecture_passes_at_every_layout(tmp_path):
    row = sglang_coverage.run_architecture("GemmaForCausalLM", tmp_path, tps=(1, 2))
    assert row["status"] == "pass", row
    assert row["layouts"] == {
        "tp1": {"ranks": 1, "equal": 1, "fallbacks": [], "mismatched": [], "undefined": {}},
        "tp2": {"ranks": 2, "equal": 2, "fallbacks": [], "mismatched": [], "undefined": {}},
    }


def test_a_replay_that_differs_is_FAIL(tmp_path, monkeypatch):
    replayed_by_plan = sglang_coverage.replayed_by_plan

    def broken(builder, rank, plan, checkpoint, real=None):  # one element of the final norm off: the plan's fault
        model = replayed_by_plan(builder, rank, plan, checkpoint, real)
        with torch.no_grad():
            model.model.norm.weight.view(-1)[0] += 1
        return model

    monkeypatch.setattr(sglang_coverage, "replayed_by_plan", broken)
    row = sglang_coverage.run_architecture("GemmaForCausalLM", tmp_path, tps=(1,))
    assert row["status"] == "FAIL" and "model.norm.weight" in row["reason"], row


def test_a_loader_that_derives_inline_and_deletes_its_source_is_verified_through_the_derivation(tmp_path, monkeypatch):
    """MiniCPM3's load_weights ends by deriving the MLA w_kc / w_vc from kv_b_proj and deleting kv_b_proj (no
    post_load_weights to re-run): the replay's kv_b_proj goes through SGLang's own derivation (its load_weights on no
    tensors), so the plan's bytes are judged by the w_kc / w_vc they give, and one byte off there is FAIL."""
    row = sglang_coverage.run_architecture("MiniCPM3ForCausalLM", tmp_path, tps=(1, 2))
    assert row["status"] == "pass", row
    from shardplan.plan import interp

    apply_reference = interp.apply_reference

    def off_by_one(plan, checkpoint, params):
        apply_reference(plan, checkpoint, params)
        with torch.no_grad():
            params["model.layers.1.self_attn.kv_b_proj.weight"].view(-1)[3] += 1

    monkeypatch.setattr(interp, "apply_reference", off_by_one)
    row = sglang_coverage.run_architecture("MiniCPM3ForCausalLM", tmp_path / "off", tps=(1,))
    assert row["status"] == "FAIL" and "model.layers.1.self_attn.w_kc" in row["reason"], row


def test_kimi_linears_tiny_config_names_the_same_layer_kinds_for_sglang_and_transformers(tmp_path):
    """SGLang reads the layer kinds from linear_attn_config, transformers' class (the checkpoint listing) from
    layer_types / mlp_layer_types: the tiny config must say the same in both, or SGLang's loader meets a KDA tensor
    of a layer it built as MLA."""
    row = sglang_coverage.run_architecture("KimiLinearForCausalLM", tmp_path, tps=(1,))
    assert row["status"] == "pass", row


def test_a_param_no_listed_tensor_writes_is_FAIL_bar_cited_padding(tmp_path, monkeypatch):
    """The vLLM rows' rule: both loaders leaving elements as built compares "equal". SGLang's text-only Llama4 loader
    (LlamaForCausalLM's) maps no expert name, so every routed expert stays as built (FAIL without its citation in
    SGLANG_LOADER_DROPS); Falcon-H1's q_norm / k_norm, which SGLang builds and never reads, pass only as
    SGLANG_PADDING names them, and the row says so."""
    monkeypatch.setattr(sglang_coverage, "SGLANG_LOADER_DROPS", {})
    row = sglang_coverage.run_architecture("Llama4ForCausalLM", tmp_path, tps=(1,))
    assert row["status"] == "FAIL", row
    assert "model.layers.0.feed_forward.experts.w13_weight (every element at tp1)" in row["reason"]
    row = sglang_coverage.run_architecture("FalconH1ForCausalLM", tmp_path / "falcon", tps=(1,))
    assert row["status"] in ("pass", "fallback") and "q_norm / k_norm" in row["padding"][0], row
    monkeypatch.setitem(sglang_coverage.SGLANG_PADDING, "FalconH1ForCausalLM", ())
    row = sglang_coverage.run_architecture("FalconH1ForCausalLM", tmp_path / "unexempted", tps=(1,))
    assert row["status"] == "FAIL" and "model.layers.0.q_norm.weight (every element at tp1)" in row["reason"], row


def test_a_cited_sglang_loader_bug_is_that_layouts_own_failure_only_while_it_raises_that(tmp_path, monkeypatch):
    """GPT-OSS BF16 under EP: SGLang's weight_loader_fused copies all experts into the rank's local ones (its issue
    22784). Those layouts say so with SGLang's error; TP1 still passes; any other error is still the sweep's FAIL."""
    row = sglang_coverage.run_architecture("GptOssForCausalLM", tmp_path, tps=(1, 2))
    assert row["status"] == "pass", row
    assert row["layouts"]["tp1"] == {"ranks": 1, "equal": 1, "fallbacks": [], "mismatched": [], "undefined": {}}
    ep = row["layouts"]["tp2-ep"]
    assert ep["error"].startswith("SGLang's own loader fails") and "issue 22784" in ep["detail"], ep
    assert "must match the size of tensor b (8)" in ep["detail"] and "tp2-ep" in row["reason"], row
    monkeypatch.setitem(sglang_coverage.SGLANG_LOADER_BUGS, "GptOssForCausalLM", ("another error", "why"))
    row = sglang_coverage.run_architecture("GptOssForCausalLM", tmp_path / "other", tps=(2,))
    assert row["status"] == "FAIL" and "refuses the derived checkpoint at tp2-ep" in row["reason"], row


def test_no_config_class_is_cannot_with_the_reason(tmp_path):
    row = sglang_coverage.run_architecture("BailingMoeForCausalLM", tmp_path)
    assert row["status"] == "cannot" and "remote code" in row["reason"], row


def test_the_report_has_sglang_beside_vllm():
    vllm = [
        {"arch": "A", "status": "pass", "reason": "", "layouts": {"tp1": {"ranks": 1, "equal": 1}}, "fallbacks": []},
        {"arch": "OnlyVllm", "status": "cannot", "reason": "x", "layouts": {}, "fallbacks": []},
    ]
    sglang = [
        {"arch": "A", "status": "FAIL", "reason": "differs", "layouts": {"tp1": {"ranks": 1, "equal": 0}}},
        {"arch": "OnlySglang", "status": "not run", "reason": "later", "layouts": {}, "fallbacks": []},
        {"arch": "B", "status": "pass", "reason": "r", "fallbacks": [], "layouts": {"tp1": {"ranks": 1, "equal": 1}}},
    ]
    sglang[-1]["layouts"]["tp2-ep"] = {"error": "SGLang's own loader fails on the real checkpoint names", "detail": "d"}
    text = coverage.render(vllm, "vLLM x", sglang, "SGLang y")
    assert "**SGLang (SGLang y): 1 pass, 0 pass with fallbacks, 1 fail, 0 cannot run here**, 2 of the 3" in text
    assert "| A |  | pass | tp1 1/1 | FAIL | tp1 0/1 | SGLang: differs |" in text
    assert "| OnlyVllm |  | cannot |  | - |  | vLLM: x |" in text
    assert "| OnlySglang |  | - |  | not run |  | SGLang: later |" in text
    assert "| B |  | - |  | pass | tp1 1/1, tp2-ep loader fails | SGLang: r |" in text


def test_step3p5s_tiny_config_has_one_entry_per_layer_and_sglang_builds_it(tmp_path):
    """transformers' Step3p7TextConfig (the listing's class here) reads the layer kinds from mlp_layer_types, SGLang's
    Step3p5 indexes rope_theta / swiglu_limits by layer: every per-layer list must have num_hidden_layers entries."""
    from shardplan.plan.layout import Layout
    from shardplan.record.sglang.session import SglangRecordSession
    from shardplan.record.tiny import sweep_start

    row, model_dir, has_experts = sweep_start("Step3p5ForCausalLM", tmp_path)
    assert not row["status"] and has_experts, row
    session = SglangRecordSession(str(model_dir), Layout(tp=1))
    assert "model.layers.1.moe.experts.w13_weight" in dict(session.builder.build(0, "meta").named_parameters())


def test_zayas_tiny_config_routes_top_1_as_published():
    from transformers import ZayaConfig

    from shardplan.record.tiny import tiny_config

    fields = {k: v for k, v in tiny_config("ZayaForCausalLM").items() if k not in ("architectures", "model_type")}
    assert ZayaConfig(**fields).num_experts_per_tok == 1  # the class's validator refuses any other


def test_tiny_configs_name_the_same_dense_layers_in_mlp_layer_types_and_first_k_dense_replace():
    """SGLang's DeepSeek-style models take the dense layers from first_k_dense_replace, transformers' classes (the
    checkpoint listing) from mlp_layer_types: where a tiny config has both they must agree, or SGLang's loader meets
    a dense MLP tensor of a layer it built as MoE (DeepSeek-V3.2: KeyError 'model.layers.1.mlp.gate_up_proj.weight')."""
    from shardplan.record.tiny import NoConfigClass, tiny_config

    checked = []
    for arch in sglang_coverage.text_decoder_architectures():
        try:
            config = tiny_config(arch)
        except NoConfigClass:
            continue
        kinds, first_dense = config.get("mlp_layer_types"), config.get("first_k_dense_replace")
        if isinstance(kinds, list) and isinstance(first_dense, int):
            dense = [i for i, kind in enumerate(kinds) if kind == "dense"]
            assert dense == list(range(first_dense)), (arch, kinds, first_dense)
            checked.append(arch)
    assert "DeepseekV32ForCausalLM" in checked, checked


def test_a_config_field_sglang_reads_that_real_configs_lack_is_cannot_only_where_cited(tmp_path, monkeypatch):
    """SGLang's Mamba2 reads config.intermediate_size, which neither transformers' Mamba2Config nor a published
    Mamba2 config has: "cannot" with the citation; without the citation the same error is the tiny config's FAIL."""
    row = sglang_coverage.run_architecture("Mamba2ForCausalLM", tmp_path / "cited", tps=(1,))
    assert row["status"] == "cannot" and "config.intermediate_size" in row["reason"], row
    monkeypatch.setattr(sglang_coverage, "SGLANG_CONFIG_GAPS", {})
    row = sglang_coverage.run_architecture("Mamba2ForCausalLM", tmp_path / "uncited", tps=(1,))
    assert row["status"] == "FAIL" and "intermediate_size" in row["reason"], row


def test_params_a_cited_sglang_loader_drops_are_cannot_and_uncited_they_are_FAIL(tmp_path, monkeypatch):
    """SGLang's text-only Llama4ForCausalLM inherits Llama's loader, which skips the released fused experts: the
    routed experts stay unwritten by SGLang's own load of a real checkpoint, "cannot" with the citation only."""
    row = sglang_coverage.run_architecture("Llama4ForCausalLM", tmp_path / "cited", tps=(1,))
    assert row["status"] == "cannot" and "llama.py" in row["reason"], row
    monkeypatch.setattr(sglang_coverage, "SGLANG_LOADER_DROPS", {})
    row = sglang_coverage.run_architecture("Llama4ForCausalLM", tmp_path / "uncited", tps=(1,))
    assert row["status"] == "FAIL" and "feed_forward.experts.w13_weight" in row["reason"], row
