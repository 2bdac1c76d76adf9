"""Inside each SGLang TP worker (scheduler process): this worker's consumer of the sync engine.

The trainer side's commands (shardplan.engine.sglang.commands) arrive through the shardplan loader:

    init     find the plan, refuse a mismatch by name (the trainer's plan by sha256; engine, SGLang version, layout,
             recording options, model config; every param of the live model written by the plan with its shape
             and dtype), then join the sync as consumer<rank> over the init's control channel and transport
    update   ConsumerSync.sync(version): each group is received into one of two buffers, checksummed and written
             into the pre-processing params (the engine is inside begin/end_weight_update, which restored packed
             layouts; end re-runs process_weights_after_loading); then the model's post_load_weights (derived
             tensors such as DeepSeek's MLA w_kc / w_vc), which SGLang itself skips after update_weights_from_tensor

A command never raises into SGLang (an exception in a custom loader kills the scheduler): it is checked against a
strict schema first (commands.parse / check), every wait is bounded by this server's limit (max_wait_s), plans are read
only from its plan directories (read_plan); the outcome is written into the control channel (commands.reply_key /
state_key), where the trainer side reads it, or logged by name where none is reachable (failed). A failed update
leaves every group either at the new version (applied whole) or at the one before; state says (version,
complete=False), and the next complete update repairs it: the plan writes every param.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from shardplan.engine.errors import EngineNotInitialized, EnginePlanMismatch, EngineUnsupported
from shardplan.engine.protocol import EngineInitInfo
from shardplan.engine.sglang.checks import plan_problems
from shardplan.engine.sglang.commands import CommandError, check, parse, reply_key, state_key
from shardplan.engine.sharding import worker_sharded_plan
from shardplan.models import resolve_model
from shardplan.plan.columns import columns_of
from shardplan.plan.file.format import PlanFile
from shardplan.plan.file.store import search_dirs
from shardplan.plan.interp import to_dtype
from shardplan.runtime.shards import ShardedPlan
from shardplan.sync import ApplyUnpacker, ConsumerSync, Replicas, ShardedUnpacker, SyncConfig, SyncConfigError
from shardplan.transport import Control, create
from shardplan.transport.base import ControlUnreachable, consumer_name

logger = logging.getLogger("shardplan.engine.sglang")


@dataclass
class _Joined:
    plan_file: PlanFile
    rank: int
    info: EngineInitInfo
    consumer: ConsumerSync
    sharded: ShardedPlan | None = None


_JOINED: _Joined | None = None  # this process's consumer (one TP worker per scheduler process)
_ERROR = ""  # the last failure of a command or push on this worker, "" after a success
WAIT_ENV, PLAN_DIRS_ENV = "SHARDPLAN_SGLANG_MAX_WAIT_S", "SHARDPLAN_SGLANG_PLAN_DIRS"


def world_rank() -> int:
    """SGLang's rank numbering, as the plan's (record/sglang/build.py): pp_rank * tp_size + tp_rank."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    return p.pp_rank * p.tp_size + p.tp_rank


def max_wait_s() -> float:
    """The longest any wait of a command may take: this server's SHARDPLAN_SGLANG_MAX_WAIT_S (default 600 s); a command
    may ask for less (its timeout_s, info.timeout_s ...), never more. Reaching the control channel: at most 30 s."""
    limit = float(os.environ.get(WAIT_ENV) or 600.0)
    if not 0 < limit < math.inf:
        raise CommandError(f"{WAIT_ENV}={limit}: a positive number of seconds expected (this server's setting)")
    return limit


def connect(host: str, port: int, timeout_s: float, secret: str | None = None) -> Control:
    """The control channel at host:port (sealed with `secret`, hex), answering within timeout_s. TCPStore's connect
    waits forever on an address that accepts and never answers: it runs in a thread, left behind then (blocked on
    that socket)."""
    control, done = Control(host, port, connect_timeout_s=timeout_s, secret=secret), []
    thread = threading.Thread(target=lambda: done.append(_attempt(control.prewarm, 1)), daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not done or done[0] is not None:
        raise done[0] if done else ControlUnreachable("control", f"{host}:{port} did not answer in {timeout_s:.1f} s")
    return control


def _attempt(fn, *args) -> Exception | None:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - handed to the caller's thread
        return e
    return None


def run(model: torch.nn.Module, name: str, refuse: str = "") -> None:
    """One command (a `shardplan-sync:` entry's name); never raises (see the module doc). `refuse`: a reason to refuse
    it, answered in its control channel."""
    global _ERROR
    rank, command, control = world_rank(), None, None
    outcome: dict = {"rank": rank, "ok": True, "error": ""}
    try:
        command, limit = parse(name), max_wait_s()
        host, port = command["control"]
        control = _JOINED.consumer.control if _JOINED is not None else None
        secret = command.get("secret", "")
        if control is None or (control.host, control.port, control.secret_hex) != (host, port, secret):
            control = connect(host, port, min(command.get("timeout_s", 30.0), limit, 30.0), secret or None)
        check(command)
        if refuse:
            raise CommandError(refuse)
        if command["op"] == "init":
            init(model, EngineInitInfo(**command["info"]), control, limit)
        else:
            update(model, command["version"])
        _ERROR = ""
    except BaseException as e:  # noqa: BLE001 - answered in the control channel or logged, never raised into SGLang
        outcome.update(ok=False, error=f"{type(e).__name__}: {e}")
        failed(outcome["error"], f"consumer{rank}")
    if control is None:
        return  # no control channel: logged (failed); the trainer side names this rank after its timeout
    consumer_id = command.get("offset", 0) + rank
    try:
        control.set(state_key(consumer_id), json.dumps(state()))
        control.set(reply_key(command["id"], consumer_id), json.dumps({**state(), **outcome}))
    except Exception as e:  # noqa: BLE001
        failed(f"cannot answer in the control channel {control.host}:{control.port}: {e}", f"consumer{rank}")


def failed(error: str, where: str = "loader") -> None:
    """A failure: logged by name and kept in this worker's state (its "error") until a command or push succeeds."""
    global _ERROR
    _ERROR = error
    logger.error("shardplan: %s: %s", where, error)


def read_plan(path: str) -> PlanFile:
    """The plan at `path`, only inside the plan directories this server allows (SHARDPLAN_SGLANG_PLAN_DIRS, separated
    by os.pathsep; default: shardplan's plan search dirs), resolved first (symlinks, ..). A file that does not read
    as a plan is named by its error's class only: none of its bytes leave this process."""
    named = [Path(d) for d in os.environ.get(PLAN_DIRS_ENV, "").split(os.pathsep) if d]
    real = Path(path).resolve()
    if not any(real.is_relative_to(d.resolve()) for d in named or search_dirs()):
        raise CommandError(f"plan_path {path!r} is outside the plan directories this server allows ({PLAN_DIRS_ENV})")
    try:
        return PlanFile.read(real)
    except Exception as e:  # noqa: BLE001 - its message may quote the file's bytes
        raise CommandError(f"plan_path {path!r} is not a readable shardplan plan ({type(e).__name__})") from None


def state() -> dict:
    if _JOINED is None:
        return {"rank": world_rank(), "version": None, "complete": None, "joined": False, "error": _ERROR}
    st = _JOINED.consumer.state
    return {
        "rank": _JOINED.rank,
        "replica": _JOINED.info.replica,
        "version": st.version,
        "complete": st.complete,
        "joined": True,
        "error": _ERROR,
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


def init(model: torch.nn.Module, info: EngineInitInfo, control: Control, limit_s: float) -> None:
    global _JOINED
    if not info.plan_path:
        raise EnginePlanMismatch("the SGLang engine needs the plan's path in the init info (EngineSync plan=...)")
    rank = world_rank()
    plan_file = read_plan(info.plan_path)
    check_plan(model, plan_file, info, rank)
    sharded = worker_sharded_plan(plan_file, info.trainer_shards)  # refused before the old sync is left
    if _JOINED is not None:  # init again (a new trainer run): leave the old sync
        _JOINED.consumer.transport.close()
        _JOINED = None
    timeouts = dict(timeout_s=min(info.timeout_s, limit_s), announce_timeout_s=min(info.announce_timeout_s, limit_s))
    config = SyncConfig(verify=info.verify, **timeouts)
    device = next(model.parameters()).device
    options = dict(info.transport_options)
    options["timeout_s"] = min(options.get("timeout_s", config.timeout_s), limit_s)
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
    finally:  # derived tensors follow whatever the params now hold, complete or not
        with torch.no_grad():
            post_load_weights(model)
