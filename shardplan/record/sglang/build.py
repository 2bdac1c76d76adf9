"""Build an SGLang model for one rank of a layout, in this process, on the meta device, with no torch.distributed.

SGLang keeps every rank and group in one `ParallelContext` of a `RuntimeContext`, and ships what is needed to fake
one: `runtime_context.create_context(server_args, ranks=SpawnRanks(world_rank=r))` derives every rank (TP, PP,
attention TP/DP/CP, MoE EP/TP/DP) from the world rank exactly as SGLang's launcher does, `use_context` makes it
current for a block and restores the previous one by identity, and linear layers take a `_LogicalGroup` (rank, size)
where no process group exists. Only the group handles are ours (`_FakeGroup`: rank and size, no communicator). The
server args are a "dummy" ServerArgs (model_path="dummy": SGLang's own test path, which skips hardware-dependent
default resolution) carrying the recording options (options.py); the model config and quantization config are SGLang's
own (`ModelConfig`, `_get_quantization_config`, `_initialize_model`), never with remote code.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from typing import Iterator

import torch

from shardplan.errors import ShardplanError
from shardplan.plan.layout import Layout
from shardplan.record import cpushim
from shardplan.record.recording import RecordError
from shardplan.record.sglang.options import SglangOptions

CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
_GROUPS = ("tp", "pp", "attn_tp", "attn_cp", "moe_ep", "moe_tp", "moe_dp")


class SglangLayoutRejected(ShardplanError):
    """SGLang refuses to build the model for this layout or these options."""


class SglangNotInstalled(ShardplanError):
    pass


_imported_cpu_engine: list[bool] = []  # SGLANG_USE_CPU_ENGINE as it was when this process imported sglang


def import_sglang(cpu_engine: bool = False):
    """Import sglang with SGLANG_USE_CPU_ENGINE set as `cpu_engine` asks. SGLang reads it once, at import (module-level
    `_is_cpu` flags pick the linear loaders), so one process records one of the two: a second choice is refused."""
    if not _imported_cpu_engine:
        if "sglang" in sys.modules:  # imported by someone else: take the state it was imported with
            _imported_cpu_engine.append(os.environ.get(CPU_ENGINE_ENV, "") == "1")
        else:
            if cpu_engine:
                os.environ[CPU_ENGINE_ENV] = "1"
            elif os.environ.get(CPU_ENGINE_ENV, "") == "1":
                os.environ.pop(CPU_ENGINE_ENV)
            _imported_cpu_engine.append(cpu_engine)
    if _imported_cpu_engine[0] != cpu_engine:
        raise RecordError(
            f"this process imported SGLang with {CPU_ENGINE_ENV}={'1' if _imported_cpu_engine[0] else ''}"
            f" and SGLang reads it only at import: record {'with' if cpu_engine else 'without'} "
            f"--sglang-cpu-engine in another process"
        )
    cpushim.activate()  # SGLang's config package imports torchvision.transforms; text models never call it
    for name in ("sglang", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import sglang  # noqa: F401
        from sglang.srt import runtime_context  # noqa: F401
    except ImportError as e:
        raise SglangNotInstalled(
            f"--engine sglang needs SGLang (`make setup-sglang` builds .venv-sglang on a CPU "
            f"machine; `pip install -e '.[sglang]'` on a GPU one): {e}"
        ) from None
    return sglang


class _FakeGroup:
    """A process group handle as model construction and loading read it: rank and size, no communicator."""

    def __init__(self, name: str, rank: int, size: int):
        self.unique_name, self.rank_in_group, self.world_size = f"shardplan_fake_{name}", rank, size
        self.ranks, self.rank, self.local_rank = list(range(size)), rank, rank
        self.first_rank, self.last_rank = 0, size - 1
        self.is_first_rank, self.is_last_rank = rank == 0, rank == size - 1
        self.device_group = self.cpu_group = None

    def __repr__(self):
        return f"{self.unique_name}({self.rank_in_group}/{self.world_size})"


def server_args(options: SglangOptions, layout: Layout, dtype: str):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path="dummy",
        dtype=dtype,
        trust_remote_code=False,
        skip_tokenizer_init=True,
        **options.server_args(layout),
    )


def rank_context(options: SglangOptions, layout: Layout, rank: int, dtype: str):
    """An SGLang RuntimeContext of global `rank` (world = pp x tp, tp fastest, as SGLang numbers it)."""
    from sglang.srt import runtime_context as rc

    layout.coords(rank)  # LayoutError for a rank outside the layout
    try:
        ctx = rc.create_context(
            server_args(options, layout, dtype), role="scheduler", ranks=rc.SpawnRanks(world_rank=rank)
        )
    except (ValueError, AssertionError, RuntimeError) as e:
        raise SglangLayoutRejected(
            f"SGLang rejects {layout.tag()} with {options}: {' '.join(str(e).split())[:500]}"
        ) from None
    p = ctx.parallel
    groups = {f"{g}_group": _FakeGroup(g, getattr(p, f"{g}_rank"), getattr(p, f"{g}_size")) for g in _GROUPS}
    groups["world_group"] = _FakeGroup("world", rank, layout.tp * layout.pp)
    p.override_permanently(**groups)
    return ctx


@contextlib.contextmanager
def _rope_without_vllm() -> Iterator[None]:
    """SGLang's RotaryEmbedding imports vllm._custom_ops on a machine that is neither CUDA nor its CPU engine; its
    `_is_cpu` flag picks the pure-torch path instead. It changes the RoPE kernel only, no weight."""
    import sglang.srt.layers.rotary_embedding.base as rope
    from sglang.srt import platforms

    saved = rope._is_cpu
    rope._is_cpu = True
    # Some RoPE variants (DeepSeek's YaRN) ask the platform for a device to put their cache on; on a machine without
    # an accelerator SGLang's platform has none: the CPU (a cache, not a weight)
    platform = platforms.current_platform
    had_own = "get_device" in vars(platform)
    original = platform.get_device

    def get_device(device_id=None):
        try:
            return original(device_id) if device_id is not None else original()
        except NotImplementedError:
            return "cpu"

    platform.get_device = get_device
    try:
        yield
    finally:
        rope._is_cpu = saved
        if had_own:
            platform.get_device = original
        else:
            del platform.get_device


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


class SglangBuilder:
    """One model config + options + layout: SGLang's model config, and a RuntimeContext per rank."""

    def __init__(self, config_dir: str, layout: Layout, options: SglangOptions, dtype: str, label: str):
        options.check_layout(layout)
        import_sglang(options.cpu_engine)
        from sglang.srt import runtime_context as rc
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.configs.model_config import ModelConfig

        self.layout, self.options, self.dtype, self.label = layout, options, dtype, label
        self._contexts: dict[int, object] = {}
        with rc.use_context(self.context(0)):
            try:
                self.model_config = ModelConfig(config_dir, trust_remote_code=False, dtype=dtype)
            except Exception as e:
                raise SglangLayoutRejected(
                    f"SGLang cannot read the config of {label}: {' '.join(str(e).split())[:500]}"
                ) from None
        self.load_config = LoadConfig()

    def context(self, rank: int):
        if rank not in self._contexts:
            self._contexts[rank] = rank_context(self.options, self.layout, rank, self.dtype)
        return self._contexts[rank]

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.model_config.dtype

    @contextlib.contextmanager
    def as_rank(self, rank: int) -> Iterator[None]:
        """What SGLang builds and loads a model under on `rank`: its context and the model dtype as the default."""
        from sglang.srt import runtime_context as rc

        with rc.use_context(self.context(rank)), default_dtype(self.torch_dtype):
            yield

    def build(self, rank: int, device: str = "meta") -> torch.nn.Module:
        from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model

        with self.as_rank(rank), _rope_without_vllm(), torch.device(device):
            try:
                quant_config = _get_quantization_config(self.model_config, self.load_config)
                return _initialize_model(self.model_config, self.load_config, quant_config)
            except ShardplanError:
                raise
            except Exception as e:
                raise SglangLayoutRejected(
                    f"SGLang failed to build {self.label} for rank {rank} of "
                    f"{self.layout.tag()} ({self.options.tag()}): {type(e).__name__}: "
                    f"{' '.join(str(e).split())[:600]}"
                ) from e

    @functools.cached_property
    def num_experts(self) -> int:
        cfg = self.model_config.hf_text_config
        return max(
            int(getattr(cfg, k, 0) or 0)
            for k in ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
        )


@contextlib.contextmanager
def post_load_deferred(model: torch.nn.Module) -> Iterator[None]:
    """SGLang models derive tensors at the end of `load_weights` (`post_load_weights`: DeepSeek's MLA w_kc/w_vc from
    kv_b_proj, FP8 requantization). They are not loader writes of checkpoint bytes: a plan records the loader layout,
    and SGLang re-derives them itself when a weight update bypasses the loader (`end_weight_update` runs
    `post_load_weights` when no load_weights ran in the session). So the recording runs the loader without them."""
    if not hasattr(model, "post_load_weights"):
        yield
        return
    model.post_load_weights = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del model.post_load_weights
