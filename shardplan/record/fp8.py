"""Block-FP8 checkpoints (DeepSeek-V3 / Kimi-K2 style) on a CPU without FP8 kernels: the build patches and the
checkpoint's tensor list.

A config whose `quantization_config` is `{"quant_method": "fp8", "weight_block_size": [bn, bk], ...}` describes a
checkpoint where every quantized linear `X.weight` is float8_e4m3fn and carries `X.weight_scale_inv` in float32, one
scale per bn x bk block (`[ceil(rows/bn), ceil(cols/bk)]`). vLLM picks its FP8 GEMM kernel while *constructing* each
layer, and on this AVX2 build no CPU FP8 kernel qualifies (docs: /work/shared/notes/vllm-engine.md section 4), so the
build fails before a single weight is loaded. We never run those kernels (only `load_weights`), so for the duration of
a build we answer "yes" to the two capability probes that kernel choice reads, and restore them afterwards.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any, Iterator, Mapping

import torch

from shardplan.errors import ShardplanError
from shardplan.plan.names import SCALE_SUFFIX

FP8_DTYPE = "float8_e4m3fn"
# vLLM's validate_fp8_block_shape sentences (quantization/utils/fp8_utils.py): a partition not a multiple of the block
_MISALIGNED = re.compile(r"is not divisible by\s+weight quantization block_[nk]")


class Fp8ConfigError(ShardplanError):
    """A quantization_config shardplan cannot record (not block FP8 e4m3, or a malformed block size)."""


def block_size(config: Mapping[str, Any] | Any) -> tuple[int, int] | None:
    """(block_n, block_k) of a block-FP8 `quantization_config` (in an HF config dict or a transformers config), or None
    when the config is not block-quantized FP8."""
    quant = (
        config.get("quantization_config")
        if isinstance(config, Mapping)
        else getattr(config, "quantization_config", None)
    )
    if not quant:
        return None
    if not isinstance(quant, Mapping):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    if quant.get("quant_method") != "fp8" or quant.get("weight_block_size") is None:
        return None
    size = quant["weight_block_size"]
    if not isinstance(size, (list, tuple)) or len(size) != 2 or not all(isinstance(s, int) and s > 0 for s in size):
        raise Fp8ConfigError(
            f"quantization_config.weight_block_size must be two positive ints such as [128, 128], got {size!r}"
        )
    if quant.get("fmt", "e4m3") != "e4m3":
        raise Fp8ConfigError(f"quantization_config.fmt {quant.get('fmt')!r}: only e4m3 block FP8 is supported")
    return int(size[0]), int(size[1])


def not_converted(config: Mapping[str, Any]) -> tuple[str, ...]:
    quant = config.get("quantization_config") or {}
    return tuple(quant.get("modules_to_not_convert") or quant.get("ignored_layers") or ())


def is_quantized(name: str, shape, config: Mapping[str, Any]) -> bool:
    """Whether the FP8 checkpoint stores `name` in fp8 with a block scale: the 2-D weights of a decoder layer's linear
    projections (`*_proj.weight`, and MLA's `kv_a_proj_with_mqa.weight`: attention, dense MLP, shared and routed
    experts), as in DeepSeek-V3's, DeepSeek-R1's and Kimi-K2's hub checkpoints (tests/integration/test_names.py checks
    the R1 checkpoint's 91,991 tensors); embeddings, norms, the router (`mlp.gate`) and the LM head stay in the model
    dtype."""
    if len(shape) != 2 or not name.endswith(("_proj.weight", "_proj_with_mqa.weight")) or ".layers." not in name:
        return False
    module = name.removesuffix(".weight")
    return not any(
        skip and (module == skip or module.startswith(skip + ".") or f".{skip}." in f".{module}.")
        for skip in not_converted(config)
    )


def scale_shape(shape, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def fp8_checkpoint_tensors(tensors: list, config: Mapping[str, Any]) -> list:
    """The BF16 checkpoint's (name, shape, dtype) list as the block-FP8 checkpoint of the same model lists it: each
    quantized weight in float8_e4m3fn followed by its float32 `weight_scale_inv`. A list that already has scales (read
    from a real FP8 checkpoint's headers) is returned unchanged."""
    block = block_size(config)
    if block is None or any(name.endswith(SCALE_SUFFIX) for name, _, _ in tensors):
        return tensors
    out = []
    for name, shape, dtype in tensors:
        if is_quantized(name, shape, config):
            out.append((name, tuple(shape), FP8_DTYPE))
            out.append((name + SCALE_SUFFIX, scale_shape(shape, block), "float32"))
        else:
            out.append((name, shape, dtype))
    return out


def vllm_block_size(vllm_config) -> tuple[int, int] | None:
    return block_size(vllm_config.model_config.hf_config)


@contextlib.contextmanager
def kernel_probes_patched(vllm_config) -> Iterator[None]:
    """While building a block-FP8 model: `torch.cpu._is_amx_tile_supported` and
    `vllm._custom_ops._supports_cpu_fp8_w8a16` answer True (kernel choice only; nothing runs them), then both are
    restored. A no-op for any other config."""
    if vllm_block_size(vllm_config) is None:
        yield
        return
    from vllm import _custom_ops as ops

    saved_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    saved_w8a16 = getattr(ops, "_supports_cpu_fp8_w8a16", None)
    torch.cpu._is_amx_tile_supported = lambda: True
    ops._supports_cpu_fp8_w8a16 = True
    try:
        yield
    finally:
        if saved_amx is not None:
            torch.cpu._is_amx_tile_supported = saved_amx
        ops._supports_cpu_fp8_w8a16 = saved_w8a16


def misalignment(reason: str) -> bool:
    return bool(_MISALIGNED.search(" ".join(reason.split())))
