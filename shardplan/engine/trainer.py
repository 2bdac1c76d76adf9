"""Trainer side of a live-engine sync: no vLLM, transformers or safetensors here.

    plan = PlanFile.read("plans/my-model--tp2--bfloat16.plan")
    sync = EngineSync([llm_or_url_or_actor], plan)                 # the driver: control channel + coordinator
    trainer = TrainerRank(plan, ModuleSource(model, plan), sync.control)   # each trainer rank (here: the same process)
    for step in range(steps):
        train_step(model)
        report = sync.sync(trainer=trainer)    # pause, init (once), start, update || send, finish, resume

With several trainer ranks (or a trainer in another process), each rank builds its own TrainerRank with the driver's
`sync.control` and calls `rank.sync(version)` while the driver calls `sync.sync(version)`.

Sharded trainers (FSDP2 / DTensor, or boxes; shardplan.engine.sharding) send their local shards: the driver gets every
rank's boxes (`EngineSync(..., shards=dtensor_shards(model.state_dict()))` or `placement_shards(...)`) and passes
them to the engines at init; each rank's `ModuleSource(fsdp_model, plan)` finds its DTensors' boxes itself.

Failure semantics (docs/engine.md): an engine whose update did not complete raises SyncIncomplete here, keeps its
weight version "<v>:incomplete" and stays paused; every layer holds one version (v or the one before). The next
complete sync repairs it and resumes it; `resume(force=True)` serves the mixed weights knowingly.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor

from shardplan.engine.clients import EngineClient, as_client
from shardplan.engine.errors import (
    EngineCallFailed,
    EngineError,
    EngineNotInitialized,
    EnginePlanMismatch,
    EngineUpdateFailed,
    SyncIncomplete,
    raise_named,
)
from shardplan.engine.protocol import EngineInitInfo, state_key
from shardplan.engine.sharding import dtensor_shards, local_box, sharded_plan, shards_to_json, whole_expert_holders
from shardplan.errors import MissingTensorError
from shardplan.plan.file.format import PlanFile
from shardplan.plan.interp import to_dtype
from shardplan.plan.names import group_of
from shardplan.runtime.quantize import trainer_meta, trainer_name_of
from shardplan.runtime.shards import ShardLayoutError, TrainerShard
from shardplan.runtime.tensors import TensorShapeError
from shardplan.sync import (
    PART_BYTES,
    Coordinator,
    Replicas,
    ShardedPacker,
    SyncConfig,
    SyncReport,
    TrainerSync,
    spans_of,
)
from shardplan.sync.placement import EplbPacker, expert_sources, make_packer, slot_spans
from shardplan.transport import Control, create, trainer_name
from shardplan.transport.base import consumer_name


def _plan_file(plan) -> PlanFile:
    return plan if isinstance(plan, PlanFile) else PlanFile.read(plan)


class ModuleSource:
    """WeightSource over the trainer's tensors, by checkpoint (HF) name: an nn.Module (its state_dict names, e.g. a
    transformers model), a dict, or a callable returning one. Each group's tensors are converted to the plan's dtype
    when asked (so fp32 master weights ship as the engine's bf16). For a block-FP8 plan (header `quantizer`) the
    trainer holds no fp8 tensors or scales: each quantized `X.weight` is asked for in the plan's dtype (bf16), which
    the packer quantizes (runtime/quantize.py), and `X.weight_scale_inv` not at all.

    Whole tensors by default. Sharded: DTensors (an FSDP2 model's state_dict; Shard/Replicate placements) are found
    by themselves, and every rank's box comes from their placements (`self.shards`); plain local shards need
    `shards=` (every rank's TrainerShard boxes, e.g. shardplan.runtime.shards.tp_shards) and this process's `rank`."""

    def __init__(
        self,
        tensors: torch.nn.Module | Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]],
        plan,
        *,
        shards: Sequence[TrainerShard] | None = None,
        rank: int | None = None,
    ):
        plan_file = _plan_file(plan)
        self._tensors = tensors
        self._staged: dict[str, torch.Tensor] = {}
        read = set()
        for r in plan_file.ranks:
            p = plan_file.rank(r)
            read |= p.sources_read() | {f.source for f in p.fallbacks}
        if plan_file.header.eplb is not None:  # EPLB: any expert can move to any slot, so all are needed
            read = expert_sources(
                [plan_file.rank(r) for r in plan_file.ranks], plan_file.header.eplb, plan_file.sources
            )
        quantizer = plan_file.header.quantizer
        if quantizer:
            read = {trainer_name_of(n, plan_file.sources) for n in read}
        self.metas = {
            n: trainer_meta(plan_file.sources[n], plan_file.sources, plan_file.header.dtype)
            if quantizer
            else plan_file.sources[n]
            for n in sorted(read)
        }
        have = self._all()
        if shards is None and any(isinstance(t, DTensor) for t in have.values()):
            shards = dtensor_shards({n: t for n, t in have.items() if n in self.metas})
            if rank is None:
                rank = torch.distributed.get_rank()
        self.shards = None if shards is None else list(shards)
        self.rank = rank
        if self.shards is not None and rank is None:
            raise ShardLayoutError("ModuleSource(shards=...) needs this trainer's rank=")
        # name -> the box this rank holds (all of it, when whole)
        self._boxes = (
            {n: tuple((0, s) for s in m.shape) for n, m in self.metas.items()}
            if self.shards is None
            else {
                s.name: s.box
                for s in self.shards
                if s.rank == rank and s.name in self.metas and all(a < b for a, b in s.box)
            }
        )
        self.by_group: dict[str, list[str]] = {}
        for n in self._boxes:
            self.by_group.setdefault(group_of(n), []).append(n)
        missing = [n for n in self._boxes if n not in have]
        if missing:
            raise MissingTensorError(
                f"the trainer's tensors lack {len(missing)} that the engines need"
                f"{'' if self.shards is None else f' from rank {rank}'}: "
                f"{missing[:6]}{' ...' if len(missing) > 6 else ''} (names as in the checkpoint)"
            )
        for n, box in self._boxes.items():
            self._check(n, have[n], box)

    def _check(self, name: str, tensor: torch.Tensor, box) -> None:
        whole_shape = self.shards is None or isinstance(tensor, DTensor)  # a plain shard has its box's shape
        if whole_shape and tuple(tensor.shape) != tuple(self.metas[name].shape):
            raise TensorShapeError(
                f"trainer tensor {name!r} has shape {list(tensor.shape)}, the plan expects "
                f"{list(self.metas[name].shape)}: the plan was recorded for another model"
            )
        local, held = local_box(tensor)
        if held is not None and held != tuple(box):
            raise ShardLayoutError(
                f"trainer rank {self.rank}'s DTensor {name!r} holds box {list(held)}, the sync's "
                f"layout says {list(box)}: pass the same shards to every rank and the driver"
            )
        if tuple(local.shape) != tuple(b - a for a, b in box):
            raise TensorShapeError(
                f"trainer rank {self.rank}'s shard of {name!r} has shape {list(local.shape)}, its "
                f"box {list(box)} needs {[b - a for a, b in box]}"
            )

    def _all(self) -> Mapping[str, torch.Tensor]:
        t = self._tensors
        if isinstance(t, torch.nn.Module):
            return t.state_dict(keep_vars=False)
        return t() if callable(t) else t

    def metadata(self):
        return self.metas

    def boxes(self):
        return dict(self._boxes)

    def group(self, group: str):
        """The group's tensors in the plan's dtype. A tensor of another dtype (or not contiguous) is copied into a
        staging tensor of its own, kept across syncs: same storage every sync, so the packer's bound replay is
        reused instead of rebuilt."""
        have = self._all()
        out = {}
        with torch.no_grad():
            for n in self.by_group.get(group, ()):
                t, dtype = local_box(have[n].detach())[0], to_dtype(self.metas[n].dtype)
                if t.dtype == dtype and t.is_contiguous():
                    out[n] = t
                    continue
                staged = self._staged.get(n)
                if staged is None or staged.device != t.device:
                    staged = self._staged[n] = torch.empty(t.shape, dtype=dtype, device=t.device)
                out[n] = staged.copy_(t)
        return out


def sharded_packer(plan_file, shards, rank: int, control=None, *, timeout_s=60.0, device="cpu", replicas=1):
    """Trainer `rank`'s packer of the pieces plan_shards gives it (sync.ShardedPacker); with EPLB slots inside an
    EplbPacker that aliases each slot to this rank's shard of the expert the consumer's placement puts there."""
    packer = ShardedPacker(sharded_plan(plan_file, shards), rank, device=device, replicas=replicas)
    if plan_file.header.eplb is None:
        return packer
    plans = [plan_file.rank(r) for r in plan_file.ranks]
    return EplbPacker(plans, plan_file.sources, plan_file.header.eplb, control, timeout_s=timeout_s, inner=packer)


class TrainerRank:
    """One trainer rank of the sync (shardplan.sync.TrainerSync over a ReplayPacker of every engine rank's plan, or,
    for sharded trainers, a ShardedPacker of the pieces plan_shards gives this rank). `shards`: every trainer rank's
    boxes (default: the source's own, e.g. from its DTensors); the driver must get the same (EngineSync(shards=)).
    `replicas`: the driver's (EngineSync(replicas=N)); EngineSync.trainer_rank passes it."""

    def __init__(
        self,
        plan,
        source,
        control: Control,
        *,
        rank: int = 0,
        transport: str = "nccl",
        transport_options: Mapping | None = None,
        config: SyncConfig | None = None,
        device: torch.device | str = "cpu",
        max_group_bytes: int = PART_BYTES,
        shards: Sequence[TrainerShard] | None = None,
        replicas: int = 1,
    ):
        plan_file = _plan_file(plan)
        plans = [plan_file.rank(r) for r in plan_file.ranks]
        config = config or SyncConfig()
        shards = getattr(source, "shards", None) if shards is None else shards
        if shards is not None and getattr(source, "rank", rank) not in (None, rank):
            raise ShardLayoutError(f"TrainerRank rank={rank} is given the source of trainer rank {source.rank}")
        if shards is None or whole_expert_holders(plan_file, shards):  # the latter: each rank holds a subset whole
            self.packer = make_packer(
                plans,
                plan_file.sources,
                plan_file.header.eplb,
                control,
                timeout_s=config.timeout_s,
                device=device,
                max_group_bytes=max_group_bytes,
                quantizer=plan_file.header.quantizer,
                replicas=replicas,
            )
        else:  # sharded groups are not cut into parts (max_group_bytes): every trainer's part of a group is whole
            self.packer = sharded_packer(
                plan_file, shards, rank, control, timeout_s=config.timeout_s, device=device, replicas=replicas
            )
        options = dict(transport_options or {})
        options.setdefault("timeout_s", config.timeout_s)
        self.transport = create(transport, me=trainer_name(rank), control=control, device=device, **options)
        self.engine = TrainerSync(rank, self.packer, source, self.transport, control, config, device)

    def sync(self, version: int) -> SyncReport:
        return self.engine.sync(version)

    def close(self) -> None:
        self.transport.close()


@dataclass
class EngineOutcome:
    name: str
    complete: bool
    error: str = ""
    weight_version: str = ""
    paused: bool | None = None
    workers: list[dict] | None = None


@dataclass
class EngineSyncReport:
    version: int
    complete: bool
    seconds: float
    engines: list[EngineOutcome] = field(default_factory=list)
    trainer: SyncReport | None = None
    trainer_error: str = ""
    phases: dict[str, float] = field(default_factory=dict)  # seconds: pause, init (first), start, update, finish

    def __str__(self) -> str:
        state = "complete" if self.complete else "INCOMPLETE"
        lines = [
            f"version {self.version}: {state} in {self.seconds:.3f} s "
            + " ".join(f"{k} {v:.3f}" for k, v in self.phases.items())
        ]
        for e in self.engines:
            lines.append(
                f"  {e.name}: {'ok' if e.complete else 'failed'} weight_version={e.weight_version!r}"
                + (f" paused={e.paused}" if e.paused is not None else "")
                + (f" {e.error}" if e.error else "")
            )
        if self.trainer_error:
            lines.append(f"  trainer: {self.trainer_error}")
        return "\n".join(lines)


def _of_replica(state: Mapping, replicas: int) -> str:
    return f" of replica {state.get('replica', 0)}" if replicas > 1 else ""


def _quietly(fn, *args) -> None:
    """Best-effort clean-up call whose failure must not hide the error being handled."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        pass


class EngineSync:
    """The driver of live-engine syncs (one per RL job; the trainer's rank 0, or the controller): hosts the control
    channel and the coordinator, and drives the engines' weight-transfer calls around each version."""

    def __init__(
        self,
        engines: Sequence,
        plan,
        *,
        num_trainers: int | None = None,
        transport: str = "nccl",
        transport_options: Mapping | None = None,
        config: SyncConfig | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        engine_plan_path: str | None = None,
        max_group_bytes: int = PART_BYTES,
        check_config: bool = True,
        shards: Sequence[TrainerShard] | None = None,
        replicas: int = 1,
    ):
        """`shards`: the trainer ranks' boxes when they hold shards (sharding.dtensor_shards / placement_shards, or
        TrainerShard lists); None: every trainer rank holds whole tensors. `num_trainers` defaults to the ranks in
        `shards` (1 without). `replicas`: how many independent replicas of the plan's layout `engines` are, in order:
        the first len(engines) / replicas engines form replica 0, ...; or, with more replicas than engines, each
        engine hosts replicas / len(engines) of them as its vLLM data-parallel ranks (a dense model's DP ranks run as
        independent engine cores: `--data-parallel-size 2` is two replicas). Every replica gets every version from
        the same trainer ranks, each over its own lanes (one engine's failure leaves the others' versions complete)."""
        self.plan_file = _plan_file(plan)
        n = len(engines)
        if (
            isinstance(replicas, bool)
            or not isinstance(replicas, int)
            or replicas < 1
            or (n % replicas and replicas % n)
        ):
            raise EngineError(
                f"replicas={replicas!r}: the engines ({n}) must split into that many equal replicas of the plan's "
                f"layout (in order: the first len(engines) / replicas engines form replica 0, ...), or each host "
                f"replicas / len(engines) of them as its data-parallel ranks"
            )
        self.replicas = replicas
        # per engine: its first replica and how many it hosts whole (0: it is a part of one replica)
        hosted = replicas // n if replicas >= n else 0
        self.hosting = [(i * hosted if hosted else i // (n // replicas), hosted) for i in range(n)]
        self.config = config or SyncConfig()
        self.shards = None if shards is None else list(shards)
        if num_trainers is None:
            num_trainers = 1 if self.shards is None else len({s.rank for s in self.shards})
        self.control = Control.serve(host, port)
        plans = [self.plan_file.rank(r) for r in self.plan_file.ranks]
        # trainers holding an EPLB plan's tensors whole, a subset each, are whole-tensor trainers to the engines
        routed_whole = self.shards is None or whole_expert_holders(self.plan_file, self.shards)
        if routed_whole:
            packer = make_packer(
                plans,
                self.plan_file.sources,
                self.plan_file.header.eplb,
                max_group_bytes=max_group_bytes,
                quantizer=self.plan_file.header.quantizer,
                replicas=replicas,
            )
        else:
            packer = ShardedPacker(
                sharded_plan(self.plan_file, self.shards), min(s.rank for s in self.shards), replicas=replicas
            )
        self.coordinator = Coordinator(
            self.control, spans_of(packer), packer.groups(), num_trainers, self.config, eplb=slot_spans(packer)
        )
        self.engines: list[EngineClient] = [as_client(e) for e in engines]
        names = [e.name for e in self.engines]
        for i, engine in enumerate(self.engines):  # outcomes are per name: two `LLM`s are both "llm"
            if names.count(engine.name) > 1:
                engine.name = f"{names[i]}[{i}]"
        self.init_info = EngineInitInfo(
            control_host=host,
            control_port=self.control.port,
            control_secret=self.control.secret_hex,
            transport=transport,
            transport_options=dict(transport_options or {}),
            plan_path=self.plan_file.path if engine_plan_path is None else engine_plan_path,
            plan_sha256=self.plan_file.digest,
            timeout_s=self.config.timeout_s,
            announce_timeout_s=self.config.announce_timeout_s,
            verify=self.config.verify,
            max_group_bytes=max_group_bytes,
            check_config=check_config,
            trainer_shards={} if routed_whole else shards_to_json(self.shards),
        )
        self.transport, self.transport_options = transport, dict(transport_options or {})
        self.initialized = False
        self.version = 0
        self.incomplete: set[str] = set()  # engines whose last update did not complete (kept paused)

    def trainer_rank(self, source, *, rank: int = 0, device: torch.device | str = "cpu") -> TrainerRank:
        """A TrainerRank of this sync in this process (same plan, control channel, transport and part size)."""
        return TrainerRank(
            self.plan_file,
            source,
            self.control,
            rank=rank,
            transport=self.transport,
            transport_options=self.transport_options,
            config=self.config,
            device=device,
            max_group_bytes=self.init_info.max_group_bytes,
            shards=self.shards,
            replicas=self.replicas,
        )

    def init(self) -> None:
        """init_weight_transfer_engine on every engine (once; sync() calls it): each worker checks the plan against
        its model and joins the sync. Named errors (EnginePlanMismatch, ...) come back here."""
        info = {**self.init_info.to_dict(), "errors_in_state": True}  # why: EngineUpdateInfo.errors_in_state
        served: dict[tuple[int, int], str] = {}
        for engine, (replica, hosted) in zip(self.engines, self.hosting):
            engine.init_weight_transfer_engine(
                {**info, "replica": replica, "replicas": self.replicas, "dp_replicas": max(hosted, 1)}
            )
            states = engine.worker_states() or ()
            refused = [s["init_error"] for s in states if s.get("init_error")]
            if refused:
                raise_named(RuntimeError("; ".join(refused)), f"{engine.name}: init_weight_transfer_engine")
            for state in states:
                rank = state.get("rank")
                if (replica, rank) in served:  # its join replaced the other engine's consumer
                    raise EnginePlanMismatch(
                        f"{engine.name} and {served[replica, rank]} both serve plan rank {rank} of "
                        f"{self.plan_file.path} in replica {replica}: the engines of one replica together form the "
                        f"plan's layout (one engine, or the DP ranks of a dp=N plan); independent engines that "
                        f"each serve the whole layout are replicas: EngineSync(engines, plan, "
                        f"replicas={len(self.engines) if self.replicas == 1 else '...'})"
                    )
                served[replica, rank] = engine.name
        for engine, consumers in zip(self.engines, self._hosted_consumers()):
            # every worker of the replicas an engine hosts joined: its RPC replies may come from one core only
            missing = [c for c in consumers if self.control.try_get(f"join/{consumer_name(c)}") is None]
            if missing:
                raise EngineNotInitialized(
                    f"{engine.name}: init_weight_transfer_engine returned, but {self._named_consumers(missing)} did "
                    f"not join the sync: their workers refused or never got the call (a handle over several engine "
                    f"cores answers with the first core's reply only: see the engine's log for the refusal)"
                )
        self.initialized = True

    def _hosted_consumers(self) -> list[list[int]]:
        """Per engine: the consumer ids of the replicas it hosts whole (none where it is a part of one replica)."""
        world = Replicas.of(self.plan_file.ranks, self.replicas)
        ranks = sorted(self.plan_file.ranks)
        return [
            [world.consumer(r, p) for r in range(first, first + hosted) for p in ranks]
            for first, hosted in self.hosting
        ]

    def _named_consumers(self, consumers: Sequence[int]) -> str:
        world = Replicas.of(self.plan_file.ranks, self.replicas)
        return ", ".join(
            f"plan rank {world.plan_rank(c)}{f' of replica {world.replica(c)}' if self.replicas > 1 else ''}"
            f" ({consumer_name(c)})"
            for c in consumers
        )

    def _published_failures(self, consumers: Sequence[int], version: int) -> list[str]:
        """What the workers' states on the control channel (protocol.state_key) say is not complete at `version`."""
        out = []
        for c in consumers:
            text = self.control.try_get(state_key(consumer_name(c)))
            state = json.loads(text) if text else {}
            if (state.get("version"), state.get("complete")) != (version, True):
                why = state.get("error") or ("incomplete" if state else "no state published")
                out.append(f"{self._named_consumers([c])}: {why}")
        return out

    def sync(
        self, version: int | None = None, *, trainer: TrainerRank | None = None, update_options: Mapping | None = None
    ) -> EngineSyncReport:
        """One version, to every engine: pause, init (first time), start, update (with `trainer` sending in this
        process, if given), finish with the version, resume. Raises SyncIncomplete (with the report) if any engine's
        update did not complete: those engines stay paused, weight version "<v>:incomplete"."""
        version = self.version + 1 if version is None else version
        if version <= self.version:
            raise EngineError(f"version {version} is not newer than the last one synced ({self.version})")
        start, phases = time.monotonic(), {}

        def phase(name, t0):
            phases[name] = time.monotonic() - t0
            return time.monotonic()

        t = time.monotonic()
        for engine in self.engines:
            engine.pause()
        t = phase("pause", t)
        started: list[EngineClient] = []
        try:  # nothing written yet: on any failure here the engines are put back as they were and resumed
            if not self.initialized:
                self.init()
                t = phase("init", t)
            for engine in self.engines:
                engine.start_weight_update()
                started.append(engine)
            # an EPLB plan's schedule may follow the placements the workers publish as their update begins: announced
            # beside the updates (the workers wait for it), not before
            announce_later = self.coordinator.eplb is not None
            if not announce_later:
                self.coordinator.announce(version)
        except BaseException:
            for engine in started:
                _quietly(engine.finish_weight_update, None)  # the backend puts the kernel tensors back
            for engine in self.engines:
                if engine.name not in self.incomplete:  # an engine left incomplete earlier stays paused
                    _quietly(engine.resume)
            raise
        self.version = version
        for engine in self.engines:
            engine.set_weight_version(f"{version}:incomplete")  # until finish says otherwise, even if we die
        t = phase("start", t)
        errors: dict[str, BaseException] = {}
        trainer_out: list = []

        def update(engine):
            try:  # a worker's failure waits in its state (EngineUpdateInfo.errors_in_state)
                engine.update_weights({"version": version, "errors_in_state": True, **(update_options or {})})
                states = engine.worker_states()
                if not states:  # the failure would be in them
                    raise EngineCallFailed(f"{engine.name}: no worker states after update_weights: outcome unknown")
                failed = [s for s in states if (s.get("version"), s.get("complete")) != (version, True)]
                if failed:
                    why = "; ".join(
                        f"plan rank {s['rank']}{_of_replica(s, self.replicas)}: {s.get('error') or 'incomplete'}"
                        for s in failed
                    )
                    raise_named(RuntimeError(why), f"{engine.name}: update_weights", EngineUpdateFailed)
                unpublished = self._published_failures(hosted[engine.name], version)
                if unpublished:  # workers the RPC's replies did not cover (other engine cores)
                    raise_named(
                        RuntimeError("; ".join(unpublished)), f"{engine.name}: update_weights", EngineUpdateFailed
                    )
            except BaseException as e:  # noqa: BLE001 - reported per engine
                errors[engine.name] = e

        def send():
            try:
                trainer_out.append(trainer.sync(version))
            except BaseException as e:  # noqa: BLE001 - reported with the engines' outcome
                trainer_out.append(e)

        announce_error: list[BaseException] = []

        def announce():
            try:
                self.coordinator.announce(version, waiting=True)
            except BaseException as e:  # noqa: BLE001 - every engine's update fails without it: said below
                announce_error.append(e)

        hosted = {e.name: consumers for e, consumers in zip(self.engines, self._hosted_consumers())}
        threads = [
            threading.Thread(target=update, args=(e,), daemon=True, name=f"update {e.name}") for e in self.engines
        ]
        if trainer is not None:
            threads.append(threading.Thread(target=send, daemon=True, name="trainer send"))
        if announce_later:
            threads.append(threading.Thread(target=announce, daemon=True, name="announce"))
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if announce_error:
            why = f"{type(announce_error[0]).__name__}: {announce_error[0]}"
            for engine in self.engines:
                errors[engine.name] = EngineUpdateFailed(
                    f"{engine.name}: version {version} could not be announced ({why}); the update: "
                    f"{errors.get(engine.name, 'no error')}"
                )
        t = phase("update", t)
        report = EngineSyncReport(version, not errors, 0.0, phases=phases)
        if trainer_out:
            if isinstance(trainer_out[0], BaseException):
                report.trainer_error = f"{type(trainer_out[0]).__name__}: {trainer_out[0]}"
            else:
                report.trainer = trainer_out[0]
        for engine in self.engines:
            error = errors.get(engine.name)
            if error is None:
                engine.finish_weight_update(str(version))
                engine.resume()
                self.incomplete.discard(engine.name)
            else:  # workers whose own part completed still hold an open update: close it (no-op elsewhere)
                _quietly(engine.finish_weight_update, None)
                self.incomplete.add(engine.name)
            report.engines.append(self._outcome(engine, error))
        phase("finish", t)
        report.seconds = time.monotonic() - start
        if errors:
            raise SyncIncomplete(
                f"version {version} did not complete on {sorted(errors)}: they stay paused with "
                f"weight version '{version}:incomplete' until a later sync completes or "
                f"resume(force=True)\n{report}",
                report,
            )
        return report

    def _outcome(self, engine: EngineClient, error: BaseException | None) -> EngineOutcome:
        out = EngineOutcome(engine.name, error is None, "" if error is None else f"{type(error).__name__}: {error}")
        try:
            out.weight_version = engine.get_weight_version()
            out.paused = engine.is_paused()
            out.workers = engine.worker_states()
        except Exception as e:  # noqa: BLE001 - a dead engine: its error above already says so
            out.error = out.error or f"state unavailable: {e}"
        return out

    def resume(self, *, force: bool = False) -> None:
        """Resume every engine. Engines whose last update did not complete hold a mix of two versions (per layer):
        refused unless force=True."""
        if self.incomplete and not force:
            raise SyncIncomplete(
                f"{sorted(self.incomplete)} hold an incomplete update (weight version "
                f"'{self.version}:incomplete'); sync again, or resume(force=True) to serve "
                f"the mixed weights knowingly"
            )
        for engine in self.engines:
            engine.resume()
        self.incomplete.clear()

    def close(self) -> None:
        """Release the engines' side of the sync (they keep serving what they hold)."""
        for engine in self.engines:
            try:
                shutdown = getattr(engine, "shutdown_weight_transfer_engine", None)
                if shutdown is not None:
                    shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        self.initialized = False
