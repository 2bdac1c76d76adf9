"""The coverage sweep's rule for elements no listed checkpoint tensor writes: any such element, of a whole param or a
part of one, is a FAIL, except padding vLLM itself allocates and never loads, named with its vLLM source in
coverage.VLLM_PADDING, exactly its rows, and said in the row. Real vLLM loaders on NaN-poisoned models."""

from __future__ import annotations

import dataclasses
import re

from shardplan.record import coverage, tiny


def test_a_partly_unwritten_param_is_a_fail(tmp_path, monkeypatch):
    # the hollow pass the whole-param rule let through: vLLM's Transformers backend sizes HunYuan's fused experts from
    # moe_intermediate_size (left at the published 3072), transformers' class (the listing) from intermediate_size
    # (256): vLLM's loader writes 256 of each expert's 3072 rows and leaves the rest as allocated, as the replay does
    monkeypatch.setitem(
        tiny._FIXES, "HunYuanMoEV1ForCausalLM", {"moe_intermediate_size": [3072, 3072], "intermediate_size": 256}
    )
    row = coverage.run_architecture("HunYuanMoEV1ForCausalLM", tmp_path, tps=(1,))
    assert row["status"] == "FAIL", row
    assert "model.layers.0.mlp.experts.routed_experts.w13_weight (5767168 of 6291456 elements at tp1)" in row["reason"]


def test_per_layer_sizes_shrink_with_their_tied_single_size():
    config = tiny.tiny_config("HunYuanMoEV1ForCausalLM")
    assert config["moe_intermediate_size"] == [64, 64] and config["intermediate_size"] == 64
    assert config["moe_topk"] == [2, 2]
    for arch in tiny.text_decoder_architectures():  # no size anywhere stays unshrunk because it is given per layer
        try:
            config = tiny.tiny_config(arch)
        except tiny.NoConfigClass:
            continue
        for key, size in tiny._SIZES.items():
            value = config.get(key)
            if isinstance(value, list) and all(isinstance(v, int) for v in value):
                assert all(v <= size for v in value), (arch, key, value)


def test_vllm_padding_passes_only_inside_its_cited_rows(tmp_path, monkeypatch):
    # LongCat-Flash-Lite's n-gram table: vLLM pads its rows to a multiple of 64 and its own loader never writes them
    arch = "LongcatFlashNgramForCausalLM"
    row = coverage.run_architecture(arch, tmp_path, tps=(1,))
    assert row["status"] == "pass", row
    assert row["padding"] == [
        "the n-gram table's vocabulary padding rows (tp1: 160 of the 2809600 elements of 1 param over its ranks)"
    ]
    layouts, detail = coverage._cells(row)
    assert (
        "padding the engine allocates and its loader leaves unwritten (cited): the n-gram table's vocabulary padding"
        in detail
    )
    (entry,) = coverage.VLLM_PADDING[arch]
    assert re.search(r"\.py:\d+", entry.cite)
    # one row short of vLLM's padding: the element left over is a FAIL, with its count
    short = dataclasses.replace(
        entry, rows=lambda model, name: (entry.rows(model, name)[0] + 1, entry.rows(model, name)[1])
    )
    monkeypatch.setitem(coverage.VLLM_PADDING, arch, (short,))
    row = coverage.run_architecture(arch, tmp_path / "short", tps=(1,))
    assert row["status"] == "FAIL" and "model.ngram_embeddings.oe_embedder.weight (160 of 2809600" in row["reason"]
    monkeypatch.setitem(coverage.VLLM_PADDING, arch, ())
    row = coverage.run_architecture(arch, tmp_path / "none", tps=(1,))
    assert row["status"] == "FAIL" and "oe_embedder.weight" in row["reason"], row


def test_every_padding_exemption_cites_vllm_source():
    for arch, entries in coverage.VLLM_PADDING.items():
        assert arch in tiny.text_decoder_architectures()
        for entry in entries:
            assert entry.what and re.search(r"vllm/\S+\.py:\d+", entry.cite), (arch, entry)
