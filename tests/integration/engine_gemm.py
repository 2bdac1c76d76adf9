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

    def moe_paths(self) -> dict[str, dict]:
        return moe_paths(self.model_runner.get_model())

    def allocate_pp_intermediate_tensors(self) -> None:
        """vLLM 0.32's CPU workers in eager mode never warm up, so a later pipeline stage never allocates the tensors
        it receives the previous stage's activations into and its first step asserts (GPUModelRunner
        .sync_and_gather_intermediate_tensors): allocate them as the warm-up's dummy run would."""
        from vllm.distributed.parallel_state import get_pp_group

        runner = self.model_runner
        if not get_pp_group().is_first_rank and runner.intermediate_tensors is None:
            runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
                batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
            )

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


# ---- the CPU MoE experts' path ---------------------------------------------------------------------------------------
# vLLM 0.32 gives an unquantized MoE layer X86CPUUnquantizedExperts (isa "amx": the intermediate dim zero-padded to a
# multiple of 32, weights prepacked by `prepack_moe_weight(src, dst, "amx")`, computed by `cpu_fused_moe(..., "amx")`)
# where `torch.cpu._is_amx_tile_supported()`, else CPUUnquantizedExperts (isa "vec"). SHARDPLAN_TEST_CPU_MOE pins it:
#
#     vec  the ISA-specific experts classes refused (the portable path, on any CPU)
#     amx  X86CPUUnquantizedExperts; where the CPU has no AMX, its two kernel entry points for isa "amx" are torch
#          stand-ins with the same contract: the prepack writes a copy of each expert's [N, K] weight as [K, N] into
#          the output (raw unprepacked bytes left in the kernel tensors compute something else, as with the real
#          kernel), the compute a plain SwiGLU MoE reading that layout, weighted by vLLM's top-k weights.
#
# `moe_paths` (an RPC) says what each MoE layer got and which branch of shardplan's prepack re-run each update took.
MOE_ENV = "SHARDPLAN_TEST_CPU_MOE"
MOE_MODES = ("vec", "amx")
_MOE = {"stand_in": False, "prepacks": {}}  # per worker: stand-in in use; module id -> branches since the last RPC


def _pin_moe(mode: str) -> None:
    import torch
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    if mode not in MOE_MODES:
        raise ValueError(f"{MOE_ENV}={mode!r}: one of {MOE_MODES}")
    if mode == "vec":
        for cls in (
            cpu_moe.X86CPUUnquantizedExperts,
            cpu_moe.ArmCPUUnquantizedExperts,
            cpu_moe.PowerCPUUnquantizedExperts,
        ):
            cls._supports_current_device = staticmethod(lambda: False)
    elif not torch.cpu._is_amx_tile_supported():
        cpu_moe.X86CPUUnquantizedExperts._supports_current_device = staticmethod(cpu_moe.current_platform.is_cpu)
        _moe_stand_in()
    _record_prepack_branches()


def _moe_stand_in() -> None:
    import torch

    prepack, fused = torch.ops._C.prepack_moe_weight, torch.ops._C.cpu_fused_moe

    def prepack_moe_weight(src, dst, isa):
        if isa != "amx":
            return prepack(src, dst, isa)
        e, n, k = src.shape
        dst.copy_(src.transpose(1, 2).reshape(e, n, k))  # [K, N] per expert, in the [N, K]-shaped output

    def cpu_fused_moe(out, x, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, skip_weighted, act, isa):
        if isa != "amx":
            return fused(out, x, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, skip_weighted, act, isa)
        out.copy_(_swiglu_moe(x, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, skip_weighted, act))

    torch.ops._C.prepack_moe_weight = prepack_moe_weight
    torch.ops._C.cpu_fused_moe = cpu_fused_moe
    _MOE["stand_in"] = True


def _swiglu_moe(x, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, skip_weighted, act):
    """sum over the top-k experts e of weight * w2_e @ (silu(gate_e x) * up_e x), the experts' weights in the
    stand-in prepack's layout (w13: [E, 2I, H] holding [H, 2I]; w2: [E, H, I] holding [I, H])."""
    import torch

    if act != "silu":
        raise NotImplementedError(f"the MoE stand-in computes SwiGLU only, not {act!r}")
    e_count, two_i, hidden = w13.shape
    inter = two_i // 2
    xf, out = x.float(), torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for e in topk_ids.unique().tolist():
        if not 0 <= e < e_count:
            continue
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        h = xf[tokens] @ w13[e].reshape(hidden, two_i).float()
        if w13_bias is not None:
            h = h + w13_bias[e].float()
        y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].reshape(inter, -1).float()
        if w2_bias is not None:
            y = y + w2_bias[e].float()
        if not skip_weighted:
            y = y * topk_weights[tokens, slots].float()[:, None]
        out.index_add_(0, tokens, y)
    return out.to(x.dtype)


def _record_prepack_branches() -> None:
    """Note, per MoE layer, which branch of shardplan's prepack re-run each update took: "kernel tensors" (written
    straight into them) or "generic" (the experts' own process_weights_after_loading)."""
    from shardplan.engine import reload

    into = reload._prepack_into_kernel_tensors

    def recorded(module, experts, info):
        done = into(module, experts, info)
        _MOE["prepacks"].setdefault(id(module), []).append("kernel tensors" if done else "generic")
        return done

    reload._prepack_into_kernel_tensors = recorded


def moe_paths(model) -> dict[str, dict]:
    """Per unquantized MoE layer: its experts class and isa, whether the intermediate dim was padded, whether the
    torch stand-ins compute it, and the prepack re-run branches taken since the last call (then forgotten)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    paths = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or getattr(method, "moe_kernel", None) is None:
            continue
        experts = method.moe_kernel.fused_experts
        cfg, isa = experts.moe_config, getattr(experts, "isa", None)
        padded = getattr(experts, "_padded_intermediate_size", lambda c: c.intermediate_size_per_partition)(cfg)
        paths[name] = {
            "experts": type(experts).__name__,
            "isa": isa,
            "padded": padded != cfg.intermediate_size_per_partition,
            "stand_in": _MOE["stand_in"] and isa == "amx",
            "prepacks": _MOE["prepacks"].pop(id(module), []),
        }
    return paths


if os.environ.get(MOE_ENV):
    _pin_moe(os.environ[MOE_ENV])
