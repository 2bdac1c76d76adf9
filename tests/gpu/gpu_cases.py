"""What the GPU tier's tests share: the device, one decoder layer of a shipped plan, random trainer tensors on the
device, and the reference (plan.interp.apply_reference on CPU copies; for block-FP8 plans the reference quantizer's
checkpoint of them) that every result is compared with, bit for bit, destinations NaN-poisoned.

SHARDPLAN_GPU_TIER_DEVICE=cpu runs the tier's logic on a CPU box (a dry run: the CUDA paths themselves need a GPU).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from shardplan.plan import ir
from shardplan.plan.file.format import PlanFile
from shardplan.plan.interp import apply_reference, to_dtype
from shardplan.plan.names import SCALE_SUFFIX
from shardplan.runtime.apply import params_from_plan
from shardplan.runtime.quantize import parse_quantizer, quantize_blocks, trainer_name_of

DEVICE = os.environ.get("SHARDPLAN_GPU_TIER_DEVICE", "cuda")
ON_GPU = DEVICE == "cuda"
gpu_tier = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        ON_GPU and not torch.cuda.is_available(),
        reason=(
            "the GPU tier needs a CUDA device (torch.cuda.is_available() is False): `make test-gpu` on a GPU machine"
        ),
    ),
]
PLANS = Path(__file__).resolve().parents[2] / "plans"
NAN = float("nan")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8).cpu()


def assert_bits_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for name in sorted(want):
        if not torch.equal(bits(got[name]), bits(want[name])):
            raise AssertionError(f"{what}: {name} differs from the reference interpreter's bytes")


class Layer:
    """Consumer `rank`'s writes into decoder layer `layer` of a plan file (params named `...layers.<layer>.`)."""

    def __init__(self, plan_file: PlanFile, rank: int, layer: int):
        full = plan_file.rank(rank)
        key = f"layers.{layer}."
        writes = tuple(w for w in full.writes if key in w.param)
        names = {w.param for w in writes}
        self.plan = ir.RankPlan(rank, tuple(p for p in full.params if p.name in names), writes)
        read: set[str] = set()
        for w in writes:
            ir.sources(w.src.leaf, read)
        self.sources = {n: plan_file.sources[n] for n in sorted(read)}
        self.quantizer = plan_file.header.quantizer or None


LAYER = 3  # a decoder layer past the dense ones (MoE where the model has experts; full attention in Qwen3-Next)


def trainer_tensors(
    sources: dict[str, ir.TensorMeta], quantizer: str | None, device, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random trainer tensors on `device`, as the trainer holds them: block-FP8 weights in bfloat16 under the weight
    name (no scales); each 128-row band scaled differently, so blocks get distinct scales."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, meta in sources.items():
        trainer = trainer_name_of(name, sources) if quantizer else name
        if trainer in out:
            continue
        meta = sources[trainer]
        dtype = torch.bfloat16 if meta.dtype == "float8_e4m3fn" else to_dtype(meta.dtype)
        if dtype.is_floating_point:
            t = torch.randn(meta.shape, generator=gen, device=device)
            if t.dim() == 2:
                t *= (
                    torch.rand((math.ceil(t.shape[0] / 128), 1), generator=gen, device=device).repeat_interleave(
                        128, 0
                    )[: t.shape[0]]
                    * 8
                )
            out[trainer] = t.to(dtype)
        else:
            out[trainer] = torch.randint(0, 100, meta.shape, generator=gen, device=device).to(dtype)
    return out


def reference(
    plan: ir.RankPlan, sources, tensors: dict[str, torch.Tensor], quantizer: str | None
) -> dict[str, torch.Tensor]:
    """The plan applied by the reference interpreter on CPU copies (the reference quantizer's checkpoint of them for
    a block-FP8 plan), into NaN-poisoned params."""
    cpu = {n: t.cpu() for n, t in tensors.items()}
    if quantizer:
        _, block = parse_quantizer(quantizer)
        for name, meta in sources.items():
            if meta.dtype == "float8_e4m3fn" and name + SCALE_SUFFIX in sources:
                cpu[name], cpu[name + SCALE_SUFFIX] = quantize_blocks(cpu[name], block)
    params = params_from_plan(plan, "cpu", fill=NAN)
    apply_reference(plan, cpu, params)
    return params


def shipped_plans() -> list[str]:
    return sorted(p.name for p in PLANS.glob("*.plan"))
