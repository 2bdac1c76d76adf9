"""The README's trainer example, run as written on the GPU (llama-3.1-8b TP2 rank 1: where `device="cuda"` once
failed; only the params are NaN-poisoned), checked bit for bit against the reference interpreter on CPU copies for
layer 0, the embeddings and lm_head. tests/integration/test_installed.py runs the same lines on CPU from the wheel."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from gpu_cases import DEVICE, ON_GPU, assert_bits_equal, gpu_tier, reference, trainer_tensors

from shardplan.plan import ir
from shardplan.plan.file import load_plan

pytestmark = gpu_tier + [pytest.mark.skipif(not ON_GPU, reason="16 GB of trainer tensors: on the GPU only")]
README = Path(__file__).resolve().parents[2] / "README.md"


def readme_block() -> str:
    text = README.read_text()
    block = re.search(r"<!-- trainer example -->\s*```python\n(.*?)```", text, re.S).group(1)
    for old, new in [
        ('params_from_plan(plan, device="cuda")', 'params_from_plan(plan, device="cuda", fill=float("nan"))'),
    ]:
        assert old in block, f"README's trainer block no longer says {old!r}: update this test with it"
        block = block.replace(old, new)
    return block


def test_readme_trainer_lines_run_on_cuda():
    plan_file = load_plan("llama-3.1-8b", tp=2)
    trainer_tensors_ = trainer_tensors(plan_file.sources, None, DEVICE)
    plan = plan_file.rank(1)
    namespace = {"trainer_tensors": trainer_tensors_}
    exec(compile(readme_block(), str(README), "exec"), namespace)
    assert namespace["buffer"].device.type == "cuda"
    sample = {n for n in namespace["params"] if ".layers.0." in n or "embed" in n or n == "lm_head.weight"}
    writes = tuple(w for w in plan.writes if w.param in sample)
    sub = ir.RankPlan(1, tuple(p for p in plan.params if p.name in sample), writes)
    read: set[str] = set()
    for w in writes:
        ir.sources(w.src.leaf, read)
    want = reference(sub, None, {n: trainer_tensors_[n] for n in read}, None)
    assert_bits_equal(namespace["params"], want, "README lines")
