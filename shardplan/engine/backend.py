"""`shardplan` weight-transfer backend for vLLM (>= 0.32): each worker joins shardplan's sync engine as a consumer.

Selected with `--weight-transfer-config '{"backend": "shardplan"}'` (or `LLM(weight_transfer_config=...)`), registered
in every vLLM process by the `vllm.general_plugins` entry point (shardplan.engine.plugin). The trainer side
(shardplan.engine.trainer.EngineSync) drives it through vLLM's own RPCs / HTTP routes:

    init_weight_transfer_engine(EngineInitInfo)   once: find and check the plan, map this worker to its plan rank,
                                                  join the sync as consumer<rank> (control channel, transport)
    start_weight_update()                         layerwise reload begins (shardplan.engine.reload)
    update_weights(EngineUpdateInfo(version))     ConsumerSync.sync(version): groups arrive, are applied into the
                                                  pre-processing params and processed module by module; the reload is
                                                  finalized before returning, complete or not
    finish_weight_update()                        nothing left to do (the reload already ended)

A failed update raises (SyncFailed naming the peers), or with errors_in_state (EngineSync's way) returns; the model is
whole again first: every layer holds either this version (its update completed and was processed) or what it held
before. `state()` says which (version, complete, error); the trainer side keeps the engine paused and its weight version
"<v>:incomplete" (docs/engine.md).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from shardplan.engine.eplb import EngineEplb
from shardplan.engine.errors import (
    EngineControlUnreachable,
    EngineError,
    EngineNotInitialized,
    EnginePlanMismatch,
    EngineUnsupported,
)
from shardplan.engine.protocol import EngineInitInfo, EngineUpdateInfo, state_key
from shardplan.engine.reload import ReloadUnpacker
from shardplan.engine.sharding import worker_sharded_plan
from shardplan.models import resolve_model
from shardplan.plan.file.format import PlanFile
from shardplan.plan.file.store import load_plan
from shardplan.plan.layout import Layout
from shardplan.plan.placement import EplbPlanMismatch, check_engine_slots
from shardplan.sync import ConsumerSync, Replicas, SyncConfig, SyncConfigError, SyncState
from shardplan.sync.placement import check_bound, publish_placement
from shardplan.transport import Control, create
from shardplan.transport.base import ControlUnreachable, consumer_name

logger = logging.getLogger("shardplan.engine")


@dataclass
class ShardplanInitInfo(EngineInitInfo, WeightTransferInitInfo):
    pass


@dataclass
class ShardplanUpdateInfo(EngineUpdateInfo, WeightTransferUpdateInfo):
    pass


def engine_layout(parallel_config) -> Layout:
    return Layout(
        tp=parallel_config.tensor_parallel_size,
        pp=parallel_config.pipeline_parallel_size,
        dp=parallel_config.data_parallel_size,
        ep=bool(parallel_config.enable_expert_parallel),
    )


def worker_plan_rank(parallel_config, layout: Layout, dp_replicas: int = 1) -> tuple[int, int]:
    """vLLM's worker (data-parallel index, pipeline stage, tensor-parallel rank) -> (replica offset, the plan's global
    rank): shardplan numbers ranks as vLLM's world (dp x pp x tp, tp fastest; shardplan.plan.layout). vLLM runs a
    dense model's DP ranks as independent engine cores of data_parallel_size 1 that keep their DP index: such a
    worker is plan rank (0, pp, tp) of replica offset = its DP index, when the driver said this engine hosts that
    many replicas (EngineInitInfo.dp_replicas), and refused otherwise."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    dp_rank = getattr(parallel_config, "data_parallel_index", None)
    if dp_rank is None:
        dp_rank = parallel_config.data_parallel_rank
    offset = 0
    if dp_rank >= layout.dp:  # vLLM runs a dense model's DP ranks as engines of data_parallel_size 1
        if layout.dp != 1 or dp_rank >= dp_replicas:
            raise EnginePlanMismatch(
                f"this worker is data-parallel rank {dp_rank} of an engine whose vLLM data_parallel_size is "
                f"{layout.dp} (a dense model's DP ranks run as independent engines), and the driver said this engine "
                f"hosts {dp_replicas} replica(s): drive it as its DP ranks' replicas, EngineSync([engine, ...], plan, "
                f"replicas=<DP size x engines>) (docs/engine.md)"
            )
        offset, dp_rank = dp_rank, 0
    rank = layout.rank_of(dp_rank=dp_rank, pp_rank=get_pp_group().rank_in_group, tp_rank=get_tp_group().rank_in_group)
    return offset, rank


ONLINE_UNPROVEN = (
    "; online quantization (`quantization=...` over an unquantized checkpoint) is not supported: no "
    "plan is recorded for it and no machine here has run it (docs/engine.md)"
)


def plan_quantization(header) -> str:
    """The quantization of the engine a plan was recorded for, from its header: "none", or "checkpoint block-fp8"
    (the header's `quantizer`, which block-FP8 checkpoints need: the trainer quantizes its bf16 tensors)."""
    if header.quantizer.startswith("fp8-") and "/" in header.quantizer:
        return "checkpoint block-fp8"
    return "none" if not header.quantizer else f"checkpoint {header.quantizer}"


def engine_quantization(model_config) -> str:
    """The live engine's quantization, in plan_quantization's words: "none", "checkpoint block-fp8" (an FP8
    checkpoint with weight_block_size), "checkpoint <method>" (another quantized checkpoint), or "online <method>"
    (`quantization=` given over an unquantized checkpoint: vLLM quantizes at load)."""
    method = getattr(model_config, "quantization", None)
    if not method:
        return "none"
    hf = getattr(model_config, "hf_config", None)
    checkpoint = getattr(hf, "quantization_config", None)
    if checkpoint is None:
        return f"online {method}"
    get = checkpoint.get if isinstance(checkpoint, dict) else lambda k, d=None: getattr(checkpoint, k, d)
    if method == "fp8" and get("weight_block_size"):
        return "checkpoint block-fp8"
    return f"checkpoint {get('quant_method', method)}"


def _error_text(e: BaseException) -> str:
    text = str(e)
    return text if text.startswith(type(e).__name__) else f"{type(e).__name__}: {text}"


def _named(method):
    """vLLM's collective_rpc passes a worker's exception on as its message only: put the error's class name in front
    so the trainer side can raise the same named error (shardplan.engine.errors.raise_named)."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except EngineError as e:
            text = _error_text(e)
            if text == str(e):
                raise
            raise type(e)(text) from None

    return wrapper


class ShardplanWeightTransferEngine(WeightTransferEngine[ShardplanInitInfo, ShardplanUpdateInfo]):
    init_info_cls = ShardplanInitInfo
    update_info_cls = ShardplanUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.consumer: ConsumerSync | None = None
        self.unpacker, self.rank, self.last_error, self.init_error = None, None, "", ""
        self.replica = 0
        self.eplb: EngineEplb | None = None
        self.placement_stale = False  # the last update's placement changed under it (EplbPlacementChanged)
        self.last_update: dict = {}  # the last update's seconds per step and memory (bench/engine_bench.py)

    def _not_initialized(self) -> EngineNotInitialized:
        why = f" (it was refused: {self.init_error})" if self.init_error else ""
        return EngineNotInitialized(f"init_weight_transfer_engine has not run on this worker{why}")

    # -- init: find and check the plan, join the sync --------------------------------------------------------------
    def init_transfer_engine(self, init_info: ShardplanInitInfo) -> None:
        self.init_error = ""
        try:
            self._join(init_info)
        except Exception as e:
            if not init_info.errors_in_state:
                raise
            self.init_error = _error_text(e)

    @_named
    def _join(self, init_info: ShardplanInitInfo) -> None:
        pc = self.parallel_config
        layout = engine_layout(pc)
        plan_file = self._find_plan(init_info, layout)
        self.eplb = self._check_eplb(plan_file)
        offset, rank = worker_plan_rank(pc, layout, int(init_info.dp_replicas))
        plan = plan_file.rank(rank)
        replica = int(init_info.replica) + offset
        try:  # one EngineSync feeding several replicas of the layout: this worker's consumer id (sync.Replicas)
            consumer_id = Replicas.of(plan_file.ranks, int(init_info.replicas)).consumer(replica, rank)
        except SyncConfigError as e:
            raise EngineUnsupported(f"init info: {e}") from None
        sharded = worker_sharded_plan(plan_file, init_info.trainer_shards)  # sharded trainers: as they plan it
        # every connect below is bounded by timeout_s; the new control channel is reached before the old sync is
        # left, so a wrong control_port is named within timeout_s and the engine keeps the sync it had
        config = SyncConfig(
            timeout_s=init_info.timeout_s, verify=init_info.verify, announce_timeout_s=init_info.announce_timeout_s
        )
        control = Control(
            init_info.control_host,
            int(init_info.control_port),
            connect_timeout_s=config.timeout_s,
            secret=init_info.control_secret or None,
        )
        try:
            control.prewarm(1)
        except ControlUnreachable as e:
            raise EngineControlUnreachable(str(e)) from None
        if self.consumer is not None:  # init again (a new trainer run): leave the old sync cleanly
            self.shutdown()
        self.unpacker = ReloadUnpacker(
            self.model, plan, plan_file.sources, max_group_bytes=init_info.max_group_bytes, sharded=sharded
        )
        name = consumer_name(consumer_id)
        options = dict(init_info.transport_options)
        options.setdefault("timeout_s", config.timeout_s)
        transport = create(init_info.transport, me=name, control=control, device=self.device, **options)
        self.consumer = ConsumerSync(consumer_id, self.unpacker, transport, control, config, device=self.device)
        self.rank, self.control, self.placement_stale = rank, control, False
        self.replica = replica
        sharded_note = "" if sharded is None else f", from {len(sharded.trainer_ranks)} sharded trainer ranks"
        logger.info(
            f"shardplan: worker is plan rank {rank} of {plan_file.path} ({layout.tag()}), replica {self.replica}, "
            f"joined the sync as {name} "
            f"over {init_info.transport}{sharded_note}"
        )

    def _check_eplb(self, plan_file) -> EngineEplb | None:
        """EnginePlanMismatch unless the plan's EPLB slots are the engine's (docs/eplb.md); the worker's EPLB reader."""
        pc = self.parallel_config
        enabled = bool(getattr(pc, "enable_eplb", False))
        num_redundant = int(pc.eplb_config.num_redundant_experts) if enabled else 0
        try:
            check_engine_slots(plan_file.header.eplb, enabled, num_redundant, plan_file.path)
        except EplbPlanMismatch as e:
            raise EnginePlanMismatch(f"EplbPlanMismatch: {e}") from None
        if not enabled:
            return None
        return EngineEplb(self.model, plan_file.header.eplb, bool(pc.eplb_config.use_async))

    def _find_plan(self, info: ShardplanInitInfo, layout: Layout):
        """The plan file (given, or found by fingerprint) checked against the live engine; EnginePlanMismatch names
        the first field that differs."""
        import vllm

        model_dir = self.model_config.model
        dtype = str(self.model_config.dtype).removeprefix("torch.")
        if info.plan_path:
            plan_file = PlanFile.read(info.plan_path)
        else:
            try:
                plan_file = load_plan(model_dir, tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep, dtype=dtype)
            except Exception as e:  # noqa: BLE001 - PlanNotFound / StalePlan / a model shardplan cannot resolve
                raise EnginePlanMismatch(f"no usable plan for {model_dir} at {layout.tag()} {dtype}: {e}") from None
        header, where = plan_file.header, plan_file.path
        hint = (
            f"record the plan for this engine: shardplan record --model {model_dir} --tp {layout.tp}"
            + (f" --pp {layout.pp}" if layout.pp > 1 else "")
            + (f" --dp {layout.dp}" if layout.dp > 1 else "")
            + (" --ep" if layout.ep else "")
            + (f" --dtype {dtype}" if dtype != "bfloat16" else "")
        )
        if info.plan_sha256 and info.plan_sha256 != plan_file.digest:
            raise EnginePlanMismatch(
                f"{where} (sha256 {plan_file.digest[:12]}) is not the "
                f"trainer's plan ({info.plan_sha256[:12]}): both sides must read the same file"
            )
        if header.layout != layout:
            raise EnginePlanMismatch(
                f"{where} is for layout {header.layout.tag()}, the engine runs {layout.tag()}; {hint}"
            )
        if header.dtype != dtype:
            raise EnginePlanMismatch(f"{where} is for dtype {header.dtype}, the engine runs {dtype}; {hint}")
        planned, running = plan_quantization(header), engine_quantization(self.model_config)
        if planned != running:
            raise EnginePlanMismatch(
                f"{where} is for an engine with quantization {planned!r}, the engine runs "
                f"{running!r}: the params it writes would have other dtypes and shapes"
                f"{ONLINE_UNPROVEN if running.startswith('online') else ''}; {hint}"
            )
        here = vllm.__version__.split("+")[0]
        if header.vllm_version.split("+")[0] != here:
            raise EnginePlanMismatch(
                f"{where} was recorded with vLLM {header.vllm_version}, the "
                f"engine runs vLLM {here}: its loaders may differ; {hint}"
            )
        if info.check_config:
            try:
                sha = resolve_model(model_dir).config_sha256
            except Exception as e:  # noqa: BLE001 - the message says how to proceed
                raise EnginePlanMismatch(
                    f"cannot read the engine's model config {model_dir!r} to "
                    f"compare it with {where}'s ({e}); pass check_config=False to skip this "
                    f"check knowingly"
                ) from None
            if sha != header.config_sha256:
                raise EnginePlanMismatch(
                    f"{where} was recorded for model config "
                    f"{header.config_sha256[:12]} ({header.model}), the engine serves "
                    f"{model_dir} (config {sha[:12]}); {hint}"
                )
        return plan_file

    # -- one sync ------------------------------------------------------------------------------------------------------
    @_named
    def start_weight_update(self) -> None:
        if self.consumer is None:
            raise self._not_initialized()
        self._rss_before = _reset_peak_rss()
        t0 = time.perf_counter()
        self.unpacker.begin()
        self._start_s = time.perf_counter() - t0

    @_named
    def receive_weights(self, update_info: ShardplanUpdateInfo) -> None:
        if self.consumer is None:
            raise self._not_initialized()
        for key in ("rerun_moe_prepack", "defer_gemm", "receive_in_place", "prefault_pool"):
            setattr(self.unpacker, key, bool(getattr(update_info, key)))
        self.unpacker.set_keep_pool(bool(update_info.keep_pool))
        t0, cpu0 = time.perf_counter(), sum(os.times()[:2])  # this process's user + sys CPU, every thread
        try:
            placement = None
            if self.eplb is not None:  # drain an in-flight rebalance, then say which expert each slot holds
                placement = self.eplb.before_update()
                publish_placement(self.control, int(update_info.version), self.consumer.name, placement)
            report = self.consumer.sync(int(update_info.version))
            if placement is not None:  # the trainers bound to it, and the engine still holds it
                self.placement_stale = True
                check_bound(
                    self.control,
                    report.version,
                    self.consumer.name,
                    report.peers,
                    placement,
                    self.consumer.config.timeout_s,
                )
                self.eplb.after_update(placement)
                self.placement_stale = False
            self.last_error = ""
        except BaseException as e:
            self.last_error = _error_text(e)
            if not (update_info.errors_in_state and isinstance(e, Exception)):
                raise
        finally:
            with torch.no_grad():
                self.unpacker.end(self.model_config)
            seconds = dict(self.unpacker.seconds)
            seconds["start"] = getattr(self, "_start_s", 0.0)
            seconds["update"] = time.perf_counter() - t0
            self.last_update = {
                "seconds": seconds,
                "process_by_class": dict(self.unpacker.process_by_class),
                "cpu_seconds": {**self.unpacker.cpu_seconds, "update": sum(os.times()[:2]) - cpu0},
                "pid": os.getpid(),
                "pools_allocated": self.unpacker.pools_allocated,
                "in_place_bytes": self.unpacker.in_place_bytes,
                "rss_before": getattr(self, "_rss_before", None),
                "rss_peak": _peak_rss(),
            }
            self._publish_state()

    def _publish_state(self) -> None:
        """Leave this worker's state on the control channel (protocol.state_key), where the driver reads every
        worker's: best effort, since a state that is not there reads as an incomplete update."""
        try:
            state = {k: v for k, v in self.state().items() if k != "last_update"}
            self.control.set(state_key(self.consumer.name), json.dumps(state))
        except Exception as e:  # noqa: BLE001
            logger.warning(f"shardplan: {self.consumer.name} could not publish its state: {e}")

    def finish_weight_update(self) -> None:
        if self.unpacker is not None:
            self.unpacker.end(self.model_config)  # a start without an update: put the kernel tensors back

    def state(self) -> dict:
        """(version, complete) of the weights this worker holds, and the last sync's error."""
        st = self.consumer.state if self.consumer is not None else SyncState(0, True)
        return {
            "rank": self.rank,
            "replica": self.replica,
            "version": st.version,
            "complete": st.complete and not self.placement_stale,
            "error": self.last_error,
            "init_error": self.init_error,
            "last_update": self.last_update,
            # elements no checkpoint tensor defines, zeroed at every update (docs/configs.md)
            "zero_filled": self.unpacker.zero_filled if self.unpacker is not None else 0,
        }

    def shutdown(self) -> None:
        if self.consumer is not None:
            try:
                self.consumer.transport.close()
            finally:
                self.consumer = None


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> int | None:
    """This process's RSS now, after resetting its peak (Linux: writing 5 to /proc/self/clear_refs resets VmHWM), so
    the peak read after the update is the update's own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status_bytes("VmRSS")


def _peak_rss() -> int | None:
    return _status_bytes("VmHWM")
