"""Inside each SGLang TP worker (scheduler process): this worker's consumer of the sync engine.

The trainer side's commands (shardplan.engine.sglang.commands) arrive through the shardplan loader:

    init     find the plan, refuse a mismatch by name (the trainer's plan by sha256; engine, SGLang version, layout,
             recording options, model config; every param of the live model written by the plan with its shape
             and dtype), then join the sync as consumer<rank> over the init's control channel and transport
    update   ConsumerSync.sync(version): each group is received into one of two buffers, checksummed and written
             into the pre-processing params (the engine is inside begin/end_weight_update, which restored packed
             layouts; end re-runs process_weights_after_loading); then the model's post_load_weights (derived
             tensors such as DeepSeek's MLA w_kc / w_vc), which SGLang itself skips after update_weights_from_tensor

A command never raises into SGLang (an exception in a custom loader kills the scheduler): the outcome is written into
the control channel (commands.reply_key / state_key), where the trainer side reads it. A failed update leaves every
group either at the new version (applied whole) or at the one before; state says (version, complete=False), and the
next complete update repairs it: the plan writes every param.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from shardplan.engine.errors import EngineNotInitialized, EnginePlanMismatch, EngineUnsupported
from shardplan.engine.protocol import EngineInitInfo
from shardplan.engine.sglang.checks import plan_problems
from shardplan.engine.sglang.commands import reply_key, state_key
from shardplan.engine.sharding import worker_sharded_plan
from shardplan.models import resolve_model
from shardplan.plan.columns import columns_of
from shardplan.plan.file.format import PlanFile
from shardplan.plan.interp import to_dtype
from shardplan.runtime.shards import ShardedPlan
from shardplan.sync import ApplyUnpacker, ConsumerSync, Replicas, ShardedUnpacker, SyncConfig, SyncConfigError
from shardplan.transport import Control, create
from shardplan.transport.base import consumer_name

logger = logging.getLogger("shardplan.engine.sglang")


@dataclass
class _Joined:
    plan_file: PlanFile
    rank: int
    info: EngineInitInfo
    consumer: ConsumerSync
    error: str = ""
    sharded: ShardedPlan | None = None


_JOINED: _Joined | None = None  # this process's consumer (one TP worker per scheduler process)


def world_rank() -> int:
    """SGLang's rank numbering, as the plan's (record/sglang/build.py): pp_rank * tp_size + tp_rank."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    return p.pp_rank * p.tp_size + p.tp_rank


def run(model: torch.nn.Module, command: dict) -> None:
    """One command; never raises (see the module doc)."""
    rank = world_rank()
    consumer_id = int(command.get("offset", 0)) + rank  # the id the client reads replies under (sync.Replicas)
    host, port = command["control"]
    control = _JOINED.consumer.control if _JOINED is not None else None
    outcome: dict = {"rank": rank, "ok": True, "error": ""}
    try:
        if control is None or (control.host, control.port) != (host, int(port)):
            control = Control(host, int(port), connect_timeout_s=float(command.get("timeout_s", 30.0)))
        if command["op"] == "init":
            init(model, EngineInitInfo(**command["info"]), control)
        elif command["op"] == "update":
            update(model, int(command["version"]))
        else:
            raise EngineUnsupported(f"unknown shardplan command {command['op']!r}")
    except BaseException as e:  # noqa: BLE001 - reported through the control channel, never into SGLang
        outcome.update(ok=False, error=f"{type(e).__name__}: {e}")
        logger.error("shardplan: consumer%d: %s failed: %s", rank, command["op"], outcome["error"])
        if _JOINED is not None:
            _JOINED.error = outcome["error"]
    outcome.update(state())
    if control is None:
        return  # the control channel is unreachable: the trainer side names this rank after its timeout
    try:
        control.set(state_key(consumer_id), json.dumps(state()))
        control.set(reply_key(command["id"], consumer_id), json.dumps(outcome))
    except Exception as e:  # noqa: BLE001
        logger.error("shardplan: consumer%d cannot reach the control channel %s:%s: %s", rank, host, port, e)


def state() -> dict:
    if _JOINED is None:
        return {"rank": world_rank(), "version": None, "complete": None, "joined": False}
    st = _JOINED.consumer.state
    return {
        "rank": _JOINED.rank,
        "replica": _JOINED.info.replica,
        "version": st.version,
        "complete": st.complete,
        "joined": True,
        "error": _JOINED.error,
    }


def _server_args():
    from sglang.srt.runtime_context import get_context

    return get_context().server_args


def check_plan(model: torch.nn.Module, plan_file: PlanFile, info: EngineInitInfo, rank: int) -> None:
    """EnginePlanMismatch naming every difference between the plan and this worker's engine."""
    where = plan_file.path
    if info.plan_sha256 and info.plan_sha256 != plan_file.digest:
        raise EnginePlanMismatch(
            f"{where} (sha256 {plan_file.digest[:12]}) is not the trainer's plan ({info.plan_sha256[:12]}): both "
            f"sides must read the same file"
        )
    server_args = _server_args()
    problems = plan_problems(plan_file, server_args, [rank], os.environ.get("SGLANG_USE_CPU_ENGINE", "") == "1")
    if info.check_config and not problems:
        try:
            sha = resolve_model(server_args.model_path).config_sha256
        except Exception as e:  # noqa: BLE001 - the message says how to proceed
            problems.append(
                f"cannot read the engine's model config {server_args.model_path!r} ({e}); pass "
                f"check_config=False to skip this check knowingly"
            )
        else:
            if sha != plan_file.header.config_sha256:
                problems.append(
                    f"model config: plan {plan_file.header.config_sha256[:12]} ({plan_file.header.model}), engine "
                    f"{server_args.model_path} ({sha[:12]})"
                )
    if problems:
        raise EnginePlanMismatch(
            f"{where} does not match this SGLang engine (rank {rank}): " + "; ".join(problems) + ". Record the plan "
            "with the engine's model and server args: shardplan record --engine sglang ... (docs/sglang.md)"
        )
    if plan_file.header.eplb is not None:
        raise EngineUnsupported(f"{where}: EPLB slots are not supported on SGLang engines yet (docs/sglang.md)")
    plan = plan_file.rank(rank)
    params = dict(model.named_parameters())
    wrong = []
    for meta in plan.params:
        live = params.get(meta.name)
        if live is None or tuple(live.shape) != tuple(meta.shape) or live.dtype != to_dtype(meta.dtype):
            got = "absent" if live is None else f"{str(live.dtype).removeprefix('torch.')}{list(live.shape)}"
            wrong.append(f"{meta.name}: plan {meta.dtype}{list(meta.shape)}, engine {got}")
    written = set(columns_of(plan).written_params())
    unwritten = [n for n in params if n not in written]
    if unwritten and not plan.fallbacks:
        wrong.append(
            f"the plan never writes {len(unwritten)} param(s) of the live model, e.g. {unwritten[:4]} (an update "
            f"would report a complete version over their old values)"
        )
    if wrong:
        raise EnginePlanMismatch(f"{where} rank {rank} does not fit the live model: " + "; ".join(wrong[:8]))


def _unpacker(
    model: torch.nn.Module, plan_file: PlanFile, rank: int, max_group_bytes: int, sharded: ShardedPlan | None
) -> ApplyUnpacker | ShardedUnpacker:
    """Over the params as they are now: begin_weight_update may have swapped packed params for loader-layout ones."""
    if sharded is not None:  # every trainer's part of each group (sharded_plan refuses fallbacks)
        return ShardedUnpacker(sharded, rank, dict(model.named_parameters()))
    plan = plan_file.rank(rank)
    return ApplyUnpacker(
        plan,
        dict(model.named_parameters()),
        max_group_bytes=max_group_bytes,
        sources=plan_file.sources,
        fallback_loader=lambda name, t: model.load_weights([(name, t)]),
    )


def init(model: torch.nn.Module, info: EngineInitInfo, control: Control) -> None:
    global _JOINED
    if not info.plan_path:
        raise EnginePlanMismatch("the SGLang engine needs the plan's path in the init info (EngineSync plan=...)")
    rank = world_rank()
    plan_file = PlanFile.read(info.plan_path)
    check_plan(model, plan_file, info, rank)
    sharded = worker_sharded_plan(plan_file, info.trainer_shards)  # refused before the old sync is left
    if _JOINED is not None:  # init again (a new trainer run): leave the old sync
        _JOINED.consumer.transport.close()
        _JOINED = None
    config = SyncConfig(timeout_s=info.timeout_s, verify=info.verify, announce_timeout_s=info.announce_timeout_s)
    device = next(model.parameters()).device
    options = dict(info.transport_options)
    options.setdefault("timeout_s", config.timeout_s)
    try:  # one EngineSync feeding several replicas of the layout: this engine's consumer ids (sync.Replicas)
        consumer_id = Replicas.of(plan_file.ranks, int(info.replicas)).consumer(int(info.replica), rank)
    except SyncConfigError as e:
        raise EngineUnsupported(f"init info: {e}") from None
    name = consumer_name(consumer_id)
    transport = create(info.transport, me=name, control=control, device=device, **options)
    unpacker = _unpacker(model, plan_file, rank, info.max_group_bytes, sharded)
    consumer = ConsumerSync(consumer_id, unpacker, transport, control, config, device=device)
    _JOINED = _Joined(plan_file, rank, info, consumer, sharded=sharded)
    logger.info("shardplan: SGLang worker is plan rank %d of %s, joined the sync as %s", rank, plan_file.path, name)


def update(model: torch.nn.Module, version: int) -> None:
    from sglang.srt.model_loader.loader import post_load_weights

    if _JOINED is None:
        raise EngineNotInitialized("init has not run on this SGLang worker")
    j = _JOINED
    j.consumer.unpacker = _unpacker(model, j.plan_file, j.rank, j.info.max_group_bytes, j.sharded)
    try:
        with torch.no_grad():
            j.consumer.sync(version)
        j.error = ""
    finally:  # derived tensors follow whatever the params now hold, complete or not
        with torch.no_grad():
            post_load_weights(model)
