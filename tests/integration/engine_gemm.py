"""Which GEMM vLLM's CPU build uses for unquantized linears and lm_heads, switched per engine for the live-engine
tests (a worker extension: vLLM imports this module in every worker before it loads the model).

`dispatch_cpu_unquantized_gemm` (vllm/model_executor/layers/utils.py) builds, at processing, one of: an sgl packed
copy of the weight (`check_cpu_sgl_kernel`, which needs AMX: `torch.cpu._is_amx_tile_supported`), a oneDNN handle
holding a reordered copy (`ops._supports_onednn`, and oneDNN able to build a bf16 matmul: AVX-512-BF16 or AMX), or
plain `F.linear` on the param. Which one depends on the CPU, so a test passing on one box would prove nothing about
another; SHARDPLAN_TEST_CPU_GEMM pins it:

    sgl     the AMX check answered yes inside check_cpu_sgl_kernel only (its kernels also run on AVX-512 CPUs)
    onednn  sgl off; oneDNN where it can build the primitive
    torch   sgl and oneDNN off: F.linear on the param itself (no derived copy)

On a CPU that cannot run the pinned kernel (AVX2 without AVX-512-BF16: no sgl GEMM, and oneDNN cannot build a bf16
matmul), vLLM's dispatch still takes the pinned branch, and the kernel's entry points it calls are replaced by torch
stand-ins with the same contract: built at processing from the weight, a copy of it in another layout, the linear's
`weight` left with 0 elements by vLLM as with the real kernel. What the tests are about (derived state built from
the weight at processing, going stale if processing is not re-run) is then the same on every CPU; the stand-ins'
arithmetic differs from the real kernels', so tokens are compared only between engines on the same path.

`ENGINE_KWARGS` selects this module as the worker extension; `gemm_kinds` (an RPC) says what each layer got, and
`stale_gemms` which embeddings or lm_heads would compute logits from an earlier weight than they hold.
"""

from __future__ import annotations

import os

ENV = "SHARDPLAN_TEST_CPU_GEMM"
MODES = ("sgl", "onednn", "torch")
ENGINE_KWARGS = {"worker_extension_cls": f"{__name__}.GemmPathExtension"}


def _pin(mode: str) -> None:
    import torch
    import vllm._custom_ops as ops
    from vllm.model_executor.layers import utils

    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: one of {MODES}")
    original = utils.check_cpu_sgl_kernel

    def sgl_check(n, k, dtype):
        if mode != "sgl":
            return False
        amx = torch.cpu._is_amx_tile_supported
        torch.cpu._is_amx_tile_supported = lambda: True
        try:
            return original(n, k, dtype)
        finally:
            torch.cpu._is_amx_tile_supported = amx

    utils.check_cpu_sgl_kernel = sgl_check
    if mode == "torch":
        ops._supports_onednn = False
    elif not runs_natively(mode):
        _stand_in(mode)


def runs_natively(mode: str) -> bool:
    """Whether this CPU runs the pinned kernel itself (else `_stand_in` replaces it)."""
    import torch
    import vllm._custom_ops as ops

    if mode == "sgl":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if mode == "onednn":
        if not ops._supports_onednn:
            return False
        try:  # oneDNN dispatches by ISA itself: ask it
            ops.create_onednn_mm(torch.zeros(64, 64, dtype=torch.bfloat16), 32)
        except RuntimeError:
            return False
    return True


class _PackedCopy:
    """What the stand-ins build in place of a kernel's packed weight: a copy of the [N, K] weight as [K/2, N, 2]
    (VNNI-like pairs along K; K odd: [K, N]), taken when processing builds it."""

    def __init__(self, weight):
        n, k = weight.shape
        self.n, self.k = n, k
        import torch

        packed = weight.contiguous().view(n, k // 2, 2).permute(1, 0, 2) if k % 2 == 0 else weight.t()
        self.data = packed.clone(memory_format=torch.contiguous_format)  # a copy, never a view of the weight

    def linear(self, x, bias):
        import torch

        w = self.data.permute(1, 0, 2).reshape(self.n, self.k) if self.k % 2 == 0 else self.data.t()
        out = torch.nn.functional.linear(x, w)
        return out if bias is None else (out.float() + bias.float()).to(x.dtype)


def _stand_in(mode: str) -> None:
    import torch
    import vllm._custom_ops as ops

    if mode == "sgl":
        torch.ops._C.convert_weight_packed = lambda weight: _PackedCopy(weight.detach())
        ops.weight_packed_linear_cpu = lambda x, packed, n, bias: packed.linear(x, bias)
    else:
        ops._supports_onednn = True
        ops.create_onednn_mm = lambda weight_kn, cache_size=128: _PackedCopy(weight_kn.detach().t())
        ops.onednn_mm = lambda handler, x, bias: handler.linear(x, bias)


if os.environ.get(ENV):
    _pin(os.environ[ENV])


def gemm_kind(layer) -> str | None:
    """What `dispatch_cpu_unquantized_gemm` gave `layer`, read from the closure it left in `layer.cpu_linear`."""
    from shardplan.engine.reload import DeferredGemm

    fn = getattr(layer, "cpu_linear", None)
    if fn is None:
        return None
    if isinstance(fn, DeferredGemm):
        return "deferred"  # dropped by an update, built at the module's first logits call
    free = set(getattr(getattr(fn, "__code__", None), "co_freevars", ()))
    for name, kind in (("handler", "onednn"), ("packed_weight", "sgl"), ("zen_weight", "zentorch")):
        if name in free:
            return kind
    return "torch"


class GemmPathExtension:
    def gemm_kinds(self) -> dict[str, str]:
        model = self.model_runner.get_model()
        return {name: gemm_kind(m) for name, m in model.named_modules() if hasattr(m, "cpu_linear")}

    def shardplan_readers(self) -> list[str]:
        """The modules the shardplan backend re-processes because they share storage with a param it writes."""
        return sorted(name for name, _, _ in self.weight_transfer_engine.unpacker.readers.values())

    def stale_gemms(self) -> list[str]:
        """Modules of UnquantizedEmbeddingMethod whose logits (its `apply`, through the GEMM handle they hold) differ
        from those of a handle built now from the weight they hold, on the same path: a handle built from an earlier
        weight. Builds every deferred handle (call it last)."""
        import torch
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        stale, g = [], torch.Generator().manual_seed(0)
        for name, module in self.model_runner.get_model().named_modules():
            method = getattr(module, "quant_method", None)
            if not isinstance(method, UnquantizedEmbeddingMethod) or not hasattr(module, "cpu_linear"):
                continue
            x = torch.randn(5, module.weight.shape[1], generator=g).to(module.weight.dtype)
            now = torch.nn.Module()
            now.weight = module.weight
            method.process_weights_after_loading(now)
            with torch.inference_mode():
                if not torch.equal(method.apply(module, x), now.cpu_linear(x, module.weight, None)):
                    stale.append(name)
        return stale
