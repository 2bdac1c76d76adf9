"""Stand-in engines for driver tests (no vLLM): what EngineSync sees of a TP engine whose workers join the sync as
consumers (ConsumerSync over ApplyUnpacker, or ShardedUnpacker for sharded trainers, re-planned from the init info as
the backend does), with the state a vLLM engine exposes (paused, weight version, workers' published states); and the
trainer side of a sharded sync run in this one process (`sync_from_sharded_trainers`)."""

from __future__ import annotations

import json
import threading

from shardplan.engine.errors import raise_named
from shardplan.engine.protocol import state_key
from shardplan.engine.sharding import sharded_plan, shards_from_json
from shardplan.engine.trainer import ModuleSource
from shardplan.plan.file.format import PlanFile
from shardplan.runtime.apply import params_from_plan
from shardplan.sync import ApplyUnpacker, ConsumerSync, Replicas, ShardedUnpacker, SyncConfig
from shardplan.sync.placement import check_bound, publish_placement
from shardplan.transport import Control, create

TIMEOUT_S = 5.0


class FlakyUnpacker(ApplyUnpacker):
    fail_at: str | None = None

    def apply(self, group, buffer):
        if group == self.fail_at:
            raise RuntimeError(f"injected failure applying {group}")
        super().apply(group, buffer)


class StandInEngine:
    """What EngineSync sees of a TP engine whose workers are `ranks` (EngineClient methods)."""

    def __init__(self, name, plans, ranks):
        self.name, self.plans, self.ranks = name, plans, ranks
        self.paused, self.version, self.refuse_init, self.timeout_s = False, "default", None, TIMEOUT_S
        self.errors, self.states_unavailable, self.unpublished = {}, False, False
        self.placements = None  # EPLB: (version, consumer id) -> the Placement its workers hold, published per update
        self.params = {r: params_from_plan(plans[r], fill=float("nan")) for r in ranks}
        self.consumers = {}

    def init_weight_transfer_engine(self, info):
        if self.refuse_init:
            raise_named(RuntimeError(f"Worker failed with error 'EnginePlanMismatch: {self.refuse_init}'"), self.name)
        control = Control(info["control_host"], info["control_port"], secret=info.get("control_secret") or None)
        sharded = None
        if info["trainer_shards"]:  # what the backend does for sharded trainers (engine.backend)
            sharded = sharded_plan(PlanFile.read(info["plan_path"]), shards_from_json(info["trainer_shards"]))
        # consumer ids as the backend numbers them: replica * world + plan rank
        self.replica, replicas = info["replica"], Replicas.of(range(len(self.plans)), info["replicas"])
        for r in self.ranks:
            if sharded is not None:
                unpacker = ShardedUnpacker(sharded, r, self.params[r])
            else:
                unpacker = FlakyUnpacker(self.plans[r], self.params[r], max_group_bytes=info["max_group_bytes"])
            c = replicas.consumer(self.replica, r)
            transport = create(info["transport"], me=f"consumer{c}", control=control, timeout_s=self.timeout_s)
            self.consumers[r] = ConsumerSync(c, unpacker, transport, control, SyncConfig(timeout_s=self.timeout_s))

    def start_weight_update(self):
        pass

    def update_weights(self, update_info):
        errors = []
        for c in self.consumers.values() if self.placements is not None else ():  # as the backend does for EPLB
            placement = self.placements(update_info["version"], int(c.name[8:]))
            publish_placement(c.control, update_info["version"], c.name, placement)

        def run(c):
            try:
                report = c.sync(update_info["version"])
                if self.placements is not None:  # as the backend does: the trainers bound to the published one
                    placement = self.placements(update_info["version"], int(c.name[8:]))
                    check_bound(c.control, report.version, c.name, report.peers, placement, TIMEOUT_S)
            except Exception as e:  # noqa: BLE001
                errors.append((c, e))

        threads = [threading.Thread(target=run, args=(c,)) for c in self.consumers.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        plan_rank = {c: r for r, c in self.consumers.items()}
        self.errors = {plan_rank[c]: f"{type(e).__name__}: {e}" for c, e in errors}
        for state, c in zip(self._states(), self.consumers.values()):  # as the backend: on the control channel
            if not self.unpublished:
                c.control.set(state_key(c.name), json.dumps(state))
        if errors and not update_info.get("errors_in_state"):  # as the backend: raised, or left in the state
            raise_named(errors[0][1], f"{self.name}: update_weights")

    def finish_weight_update(self, weight_version=None):
        if weight_version is not None:
            self.version = weight_version

    def pause(self):
        self.paused = True

    def resume(self):
        self.paused = False

    def is_paused(self):
        return self.paused

    def set_weight_version(self, version):
        self.version = version

    def get_weight_version(self):
        return self.version

    def worker_states(self):
        return None if self.states_unavailable else self._states()

    def _states(self):
        return [
            {
                "rank": r,
                "replica": self.replica,
                "version": c.state.version,
                "complete": c.state.complete,
                "error": self.errors.get(r, ""),
            }
            for r, c in self.consumers.items()
        ]


def sync_from_sharded_trainers(sync, version: int, local_of, shards, ranks=(0, 1)):
    """One version from sharded trainer ranks in this process, each sending only `local_of(rank)` (its shards under
    the checkpoint names): the first with the driver's sync, the others from threads. (driver report, the other
    ranks' SyncReports)."""
    trainers = [
        sync.trainer_rank(ModuleSource(local_of(t), sync.plan_file, shards=shards, rank=t), rank=t) for t in ranks
    ]
    sent = []
    threads = [threading.Thread(target=lambda r=r: sent.append(r.sync(version))) for r in trainers[1:]]
    for thread in threads:
        thread.start()
    report = sync.sync(version, trainer=trainers[0])
    for thread in threads:
        thread.join()
    for r in trainers:
        r.close()
    return report, sent
