"""Which quantization a plan was recorded for (its header) and which one a live engine runs (its vLLM ModelConfig):
the engine backend refuses a plan whose mode differs, by name (shardplan.engine.backend; the live refusal is in
tests/integration/test_engine.py::test_foreign_plans_are_refused_by_name)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardplan.engine.backend import engine_quantization, plan_quantization

BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.mark.parametrize(
    "quantization, checkpoint, mode",
    [
        (None, None, "none"),
        ("fp8", BLOCK, "checkpoint block-fp8"),
        ("fp8", SimpleNamespace(**BLOCK), "checkpoint block-fp8"),  # a transformers config object
        ("fp8", {"quant_method": "fp8", "activation_scheme": "static"}, "checkpoint fp8"),  # per-tensor FP8
        ("awq", {"quant_method": "awq"}, "checkpoint awq"),
        ("fp8", None, "online fp8"),  # quantization="fp8", bf16 weights
    ],
)
def test_engine_quantization(quantization, checkpoint, mode):
    hf = SimpleNamespace() if checkpoint is None else SimpleNamespace(quantization_config=checkpoint)
    assert engine_quantization(SimpleNamespace(quantization=quantization, hf_config=hf)) == mode


@pytest.mark.parametrize(
    "quantizer, mode", [("", "none"), ("fp8-e4m3-block-amax448-v1/128x128", "checkpoint block-fp8")]
)
def test_plan_quantization(quantizer, mode):
    assert plan_quantization(SimpleNamespace(quantizer=quantizer)) == mode


def test_only_equal_modes_meet():
    """The modes the plan side can name never equal an online engine's: such an engine is always refused."""
    online = engine_quantization(SimpleNamespace(quantization="fp8", hf_config=SimpleNamespace()))
    assert online not in {
        plan_quantization(SimpleNamespace(quantizer=q)) for q in ("", "fp8-e4m3-block-amax448-v1/128x128")
    }
