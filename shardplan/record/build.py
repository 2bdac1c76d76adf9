"""Build a vLLM model for one rank of a layout, in this process, without an engine or GPUs.

Meta-device builds allocate no weights (docs/benchmarks.md, "Recording"); models whose construction reads values
fail there and are rebuilt on the CPU (the caller learns which device was used).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re

import torch

from shardplan.errors import ShardplanError
from shardplan.plan.layout import Layout
from shardplan.record import fp8
from shardplan.record.parallel import fake_parallel_state


class LayoutRejected(ShardplanError):
    pass


class Fp8BlockMisaligned(LayoutRejected):
    """vLLM refuses a block-FP8 model on a layout whose TP partitions are not whole quantization blocks."""


def _quiet_vllm() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    for name in ("vllm", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


@functools.cache
def _patch_for_meta() -> None:
    """The EP expert map is read with torch.where/.item() at build time: keep it a real CPU tensor."""
    from vllm.model_executor.layers.fused_moe import expert_map_manager as emm

    original = emm.ExpertMapManager.__init__

    def __init__(self, *args, **kwargs):
        with torch.device("cpu"):
            original(self, *args, **kwargs)

    emm.ExpertMapManager.__init__ = __init__
    # FP8 layers' CPU kernel probes (AMX, the W8A16 op) are answered by fp8.kernel_probes_patched, for builds only


def make_vllm_config(
    config_dir: str, layout: Layout, dtype: str = "bfloat16", model_name: str = "", trust_remote_code: bool = False
):
    _quiet_vllm()
    from vllm.config import CacheConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig

    label = f"{model_name or config_dir} with layout {layout.tag()}"
    try:
        # max_model_len=None: vLLM derives it from the config (max_position_embeddings, n_positions, ...) as it does
        # when serving; a constant would be refused by models whose config allows fewer positions.
        # served_model_name: only what messages call the model (a built-in's short name, not its cached config dir)
        model_config = ModelConfig(
            model=config_dir,
            skip_tokenizer_init=True,
            dtype=dtype,
            max_model_len=None,
            enforce_eager=True,
            served_model_name=model_name or None,
            trust_remote_code=trust_remote_code,
            # a plan holds a language model's weights: multimodal models are served as `--language-model-only` (their
            # towers not built, their tensors dropped by vLLM's loader); no effect on a text-only model
            language_model_only=True,
        )
        parallel_config = ParallelConfig(
            tensor_parallel_size=layout.tp,
            pipeline_parallel_size=layout.pp,
            data_parallel_size=layout.dp,
            enable_expert_parallel=layout.ep,
        )
        # no prefix caching: it shapes the KV cache, never the weights, and vLLM's CPU platform turns it off for
        # MLA after sizing hybrid (MLA + Mamba) caches for it, then refuses its own config (Kimi-Linear)
        vllm_config = VllmConfig(
            model_config=model_config,
            parallel_config=parallel_config,
            cache_config=CacheConfig(enable_prefix_caching=False),
            load_config=LoadConfig(load_format="dummy"),
        )
        # vLLM checks head divisibility only when it builds the model; ask now so the message names the layout
        model_config.verify_with_parallel_config(parallel_config)
    except ShardplanError:
        raise
    except Exception as e:  # pydantic ValidationError, ValueError, ...
        reason = " ".join(str(e).split())
        # pydantic wraps vLLM's own sentence: keep just that
        reason = re.sub(r"^\d+ validation errors? for \w+ (Value error, )?", "", reason)
        reason = re.split(r" \[type=", reason)[0][:600]
        raise LayoutRejected(
            f"vLLM rejects {label}: {reason.rstrip('.')}. Choose a layout vLLM accepts (TP must divide the "
            f"attention heads; --ep needs a MoE model)."
        ) from None
    if layout.ep and not model_config.is_moe:  # vLLM's own expert-count fields (Step3's moe_num_experts too)
        raise LayoutRejected(
            f"vLLM rejects {label}: --ep (enable_expert_parallel) needs a mixture-of-experts model, "
            f"and this one has no experts. Drop --ep."
        )
    return vllm_config


@functools.cache
def _as_cpu_worker() -> None:
    """On vLLM's CPU platform, what its CPU worker imports before building any model: the module that stands in for
    torch.cuda's Stream/Event (DeepSeek-V4's and Kimi-Linear's layers create them while being built)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        import vllm.v1.worker.cpu.shm  # noqa: F401  (patches torch.cuda on import, as in vllm/v1/worker/cpu_worker.py)

        # Kimi-Linear's fused GEMM + all-reduce imports CUDA-only kernels when built; the weights are the same
        os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")


@contextlib.contextmanager
def gpu_kernel_refusals_answered(architectures: list[str]):
    """Build as the GPU engine a plan is for would, where vLLM's CPU build refuses a model for lack of a kernel.

    Each refusal below is about which kernel would run (an attention backend, a fused MoE op, a Triton allocator,
    the model runner Triton enables), never about which params exist or how `load_weights` fills them, so a CPU
    build that stops there says nothing about the weights. For building only (recording and verify, which then run
    vLLM's real loader on that same build); a live CPU engine still gets vLLM's own refusal:
    - sparse (DSA) attention: the CPU platform raises when asked for a backend; take its dense MLA backend (a
      backend owns no weights; the indexer's projections are the model's own modules);
    - a non-gated MoE (`is_act_and_mul=False`): FusedMoEConfig refuses non-CUDA platforms as its last check, and
      no CPU MoE kernel takes it;
    - Qwen4-Exp's QSA attention probes for FlashAttention's varlen kernel;
    - without Triton vLLM picks its V1 model runner, which LongCat-Flash-Lite's n-gram embedding refuses;
    - without Triton, layers that set Triton's allocator while being built find vLLM's placeholder lacks it.
    """
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON, triton

    undo = []

    def swap(owner, name, value):
        held = owner.__dict__ if isinstance(owner, type) else vars(owner)
        undo.append((owner, name, held.get(name, _ABSENT)))
        setattr(owner, name, value)

    if current_platform.is_cpu():
        platform_cls = type(current_platform)
        pick = platform_cls.get_attn_backend_cls.__func__

        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            return pick(cls, selected_backend, attn_selector_config._replace(use_sparse=False), num_heads)

        swap(platform_cls, "get_attn_backend_cls", classmethod(get_attn_backend_cls))
        moe_post_init = FusedMoEConfig.__post_init__

        def __post_init__(self):
            try:
                moe_post_init(self)
            except NotImplementedError as e:
                if self.is_act_and_mul or "is_act_and_mul=False" not in str(e):
                    raise

        swap(FusedMoEConfig, "__post_init__", __post_init__)
        # ... and then no CPU MoE kernel takes it: take the backend an SM90 GPU picks for it (Triton), which pads
        # nothing (unquantized_round_up_hidden_size_and_intermediate_size)
        from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as moe_method
        from vllm.model_executor.layers.fused_moe.oracle import unquantized as moe_oracle

        select_moe = moe_method.select_unquantized_moe_backend

        def select_unquantized_moe_backend(moe_config, *args, **kwargs):
            try:
                return select_moe(moe_config, *args, **kwargs)
            except NotImplementedError:
                if moe_config.is_act_and_mul:
                    raise
                triton_moe = moe_oracle.UnquantizedMoeBackend.TRITON
                return triton_moe, moe_oracle.backend_to_kernel_cls(triton_moe)[0]

        swap(moe_method, "select_unquantized_moe_backend", select_unquantized_moe_backend)
        if any(arch.startswith("Qwen4Exp") for arch in architectures):
            # QSA's bound probe, not its source (others would import FA's CUDA symbols); model first: qsa is circular
            from vllm.models.qwen4_exp.nvidia import model as _qwen4_model  # noqa: F401
            from vllm.models.qwen4_exp.nvidia import qsa

            swap(qsa, "is_flash_attn_varlen_func_available", lambda: True)
    if not HAS_TRITON:
        swap(VllmConfig, "use_v2_model_runner", property(lambda self: True))
        swap(triton, "set_allocator", lambda alloc_fn: None)
    try:
        yield
    finally:
        for owner, name, old in reversed(undo):
            if old is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


_ABSENT = object()


def build_model(vllm_config, layout: Layout, rank: int, device: str = "meta") -> torch.nn.Module:
    """The model exactly as global `rank` of `layout` would build it (params uninitialised on CPU, or on meta)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    if device == "meta":
        _patch_for_meta()
    _as_cpu_worker()
    # attention layers register themselves by name in this dict: allow building the same config again
    vllm_config.compilation_config.static_forward_context.clear()
    with (
        fake_parallel_state(layout, rank),
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(vllm_config.model_config.dtype),
        torch.device(device),
        fp8.kernel_probes_patched(vllm_config),
        gpu_kernel_refusals_answered(vllm_config.model_config.architectures or []),
    ):
        try:
            model = initialize_model(vllm_config=vllm_config)
            _forget_pp_missing_layers()
            return model
        except ShardplanError:
            raise
        except Exception as e:
            if fp8.misalignment(str(e)):
                raise Fp8BlockMisaligned(
                    f"vLLM refuses block-FP8 {vllm_config.model_config.served_model_name} on {layout.tag()} "
                    f"(rank {rank}): "
                    f"{' '.join(str(e).split())[:400]} Each TP partition of a quantized weight must be whole "
                    f"{list(fp8.vllm_block_size(vllm_config))} blocks: choose a smaller TP size (or EP for the "
                    f"experts)."
                ) from e
            if device == "meta":
                raise MetaBuildFailed(str(e)) from e
            raise LayoutRejected(
                f"vLLM failed to build the model for rank {rank} of {layout.tag()}: {' '.join(str(e).split())[:600]}"
            ) from e


@contextlib.contextmanager
def loading_context(vllm_config, layout: Layout, rank: int):
    """What vLLM runs `model.load_weights` under on global `rank`: that rank's parallel state, the current vLLM config
    and the model dtype as torch's default dtype. Needed when recording *and* when running the real loader: many
    loaders ask for the TP/EP rank while loading (sharded_weight_loader for Mamba's A/D, DBRX's experts, GPT-OSS,
    Llama 4's experts) and fail, or would see another process's state, outside it."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    with (
        fake_parallel_state(layout, rank),
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(vllm_config.model_config.dtype),
    ):
        yield


def _forget_pp_missing_layers() -> None:
    """vLLM caches each model's pipeline-missing layers by `id(model)` (models/utils.py), built lazily the first time a
    loader asks `is_pp_missing_parameter`. One engine builds one model, so that is safe there; we build many models in
    one process, and a new model that reuses a freed model's id would get the old model's list: its loader then skips
    layers it has (recorded as not needed) or looks up layers it lacks (KeyError). Clear it for every new model."""
    from vllm.model_executor.models import utils as model_utils

    cache = getattr(model_utils, "_model_to_pp_missing_layer_names", None)
    if isinstance(cache, dict):
        cache.clear()


class MetaBuildFailed(Exception):
    """Construction read values on the meta device: the caller rebuilds on CPU."""


def build_for_recording(vllm_config, layout: Layout, rank: int) -> tuple[torch.nn.Module, str]:
    try:
        return build_model(vllm_config, layout, rank, "meta"), "meta"
    except MetaBuildFailed:
        return build_model(vllm_config, layout, rank, "cpu"), "cpu"
