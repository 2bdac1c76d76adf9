"""`rdt:nccl`, `rdt:gloo`, `rdt:nixl`: Ray Direct Transport between Ray actors that host the sync engine.

Every trainer and consumer rank is a `SyncActor` (threaded, `enable_tensor_transport=True` as RDT requires on the
receiving side); the engine runs inside it exactly as in a plain process. Only the byte moves go through Ray:

- `rdt:nixl` (one-sided): the trainer `ray.put([view], _tensor_transport="nixl")`s a view of its staging buffer
  (registered once with `register_nixl_memory`) and hands the ref to the consumer's `_in` method, which pulls it
  with `set_target_for_ref(ref, [view of its registered receive buffer])`: the bytes land in place, no copy.
- `rdt:gloo` / `rdt:nccl` (two-sided collectives): Ray only lets the process that created a collective group start
  RDT transfers over it, so a small `Router` actor creates the group (`regroup`) and, per transfer, calls
  `consumer._in.remote(trainer._out_gloo.remote(key))`. Ray receives into a fresh tensor; `_in` copies it into the
  receive buffer (one extra copy on the consumer).

The trainer's wait is on the ObjectRef of the consumer's `_in` call: a dead consumer raises ActorDiedError at once
(reported as PeerDied), a stalled one times out (PeerTimeout). All adapters here are `one_sided` for the engine: the
trainer's done mark (set after `_in` returned) tells the consumer its bytes are in place.

Limits (Ray 2.60): an actor can be in one collective group per backend; Ray's torch_gloo group initialises
torch.distributed's *default* process group in every member, so `regroup` names the gloo group "default" (the only
name whose teardown also tears that down) and actors hosting shardplan must not use torch.distributed themselves.
Membership changes (dead consumer excluded, rejoin) need a `regroup` between versions. rdt:nccl is written against
the same Ray API but untested here (no GPU with Ray on our machines). NIXL: the first pull of each actor pair starts
a NIXL agent (~1-6 s on CPU); a driver that `ray.get`s a NIXL object can segfault at exit.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from shardplan.transport.base import (
    Control,
    Done,
    MissingDependency,
    Peer,
    PeerDied,
    PeerTimeout,
    Tag,
    deadline_after,
    left,
)


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise MissingDependency(f"transports 'rdt:*' need Ray ({e}). Install: pip install 'ray>=2.60'") from e
    return ray


def _import_nixl_api():
    _import_ray()
    try:
        import nixl  # noqa: F401  - Ray's NIXL transport needs the package; fail here with the install command
        from ray.experimental import register_nixl_memory, set_target_for_ref
    except ImportError as e:
        raise MissingDependency(f"transport 'rdt:nixl' needs NIXL ({e}). Install: pip install nixl") from e
    return register_nixl_memory, set_target_for_ref


class _Ack:
    """Pending of one RDT transfer: the ObjectRef of the consumer's `_in` call (behind the router's ref when routed)."""

    def __init__(self, ref, peer: Peer, routed: bool, keep: Any = None, cleanup: Callable[[], None] | None = None):
        self.ref, self.peer, self.routed, self.keep, self.cleanup = ref, peer, routed, keep, cleanup

    def wait(self, timeout_s: float, check=None) -> None:  # `check` unused: the lane polls marks itself
        ray = _import_ray()
        deadline = deadline_after(timeout_s)
        try:
            ref = self.ref
            if self.routed:
                ref = ray.get(ref, timeout=max(left(deadline), 0.001))
            ray.get(ref, timeout=max(left(deadline), 0.001))
        except ray.exceptions.GetTimeoutError:
            raise PeerTimeout(self.peer, f"RDT transfer did not finish within {timeout_s:.1f} s") from None
        except ray.exceptions.RayActorError as e:
            raise PeerDied(self.peer, f"actor died: {str(e).splitlines()[0]}") from None
        except ray.exceptions.RayError as e:
            raise PeerDied(self.peer, f"RDT transfer failed: {str(e).splitlines()[0]}") from None
        finally:
            self.keep = None
            if self.cleanup is not None:
                self.cleanup()


class RdtTransport:
    """Lives inside a SyncActor. Options: `backend` ("nccl" | "gloo" | "nixl"), `me`, `actor` (the SyncActor
    instance: outbox for routed sends), `handles` ({peer name: actor handle}, this actor included), `router` (the
    Router handle; collectives only), `timeout_s`."""

    one_sided = True

    def __init__(
        self,
        *,
        backend: str,
        me: Peer,
        actor: Any,
        handles: Mapping[Peer, Any],
        router: Any = None,
        timeout_s: float = 30.0,
        control: Control | None = None,
        device: Any = None,
    ):
        self.ray = _import_ray()
        self.backend, self.me, self.actor, self.timeout_s = backend, me, actor, timeout_s
        self.handles, self.router = dict(handles), router
        if backend == "nixl":
            self._register_nixl, self._set_target = _import_nixl_api()
        elif router is None:
            raise ValueError(f"rdt:{backend} needs a Router actor (shardplan.transport.rdt.router_actor())")
        self.buffers: list[torch.Tensor] = []
        self._keys = itertools.count()

    def register(self, buffers: Sequence[torch.Tensor]) -> None:
        self.buffers = list(buffers)
        if self.backend == "nixl":
            for buf in buffers:  # few big regions, once: per-call registration would dominate small transfers
                self._register_nixl(buf)

    def connect(self, peers: Mapping[Peer, int]) -> None:
        pass  # actor handles are fixed; group membership is the driver's regroup()

    def send(self, peer: Peer, src: torch.Tensor, tag: Tag):
        if tag.nbytes == 0:
            return Done()
        handle = self.handles[peer]
        if self.backend == "nixl":
            ref = self.ray.put([src], _tensor_transport="nixl")
            return _Ack(handle._in.remote([ref], self.me, tag), peer, routed=False, keep=ref)
        key = f"{self.me}/{next(self._keys)}"
        self.actor._outbox[key] = [src]
        routed = self.router.route.remote(self.handles[self.me], key, handle, self.me, tag, self.backend)
        return _Ack(routed, peer, routed=True, cleanup=lambda: self.actor._outbox.pop(key, None))

    def recv(self, peer: Peer, dst: torch.Tensor, tag: Tag):
        return Done()  # bytes are delivered by deliver(); the trainer's done mark announces them

    def deliver(self, payload: list, sender: Peer, tag: Tag) -> None:
        """Consumer side of one transfer (runs in the actor's `_in`): put the bytes at their place."""
        dst = self.buffers[tag.slot].narrow(0, tag.offset, tag.nbytes)
        if self.backend == "nixl":
            ref = payload[0]
            self._set_target(ref, [dst])
            got = self.ray.get(ref, timeout=self.timeout_s)[0]
            if got.data_ptr() != dst.data_ptr():  # Ray fell back to a fresh tensor: still correct, one more copy
                dst.copy_(got)
        else:
            dst.copy_(payload[0])

    def close(self) -> None:
        self.buffers = []


# ---- actors (built lazily so that importing this module never imports Ray) -------------------------------------------
_classes: dict[str, Any] = {}


def sync_actor():
    """The Ray actor class hosting one rank: `sync_actor().remote(name, transport_name, control, build)`.

    `build(name, transport, control)` runs inside the actor and returns the engine (a TrainerSync or ConsumerSync).
    Then: `start(handles, router)` once, `sync(version)` per version, `state()`, `call(fn, *args)` (fn(engine, ...)).
    """
    if "SyncActor" in _classes:
        return _classes["SyncActor"]
    ray = _import_ray()

    @ray.remote(num_cpus=0, max_concurrency=32, enable_tensor_transport=True)
    class SyncActor:
        def __init__(self, name: str, transport_name: str, control: Control, build: Callable, timeout_s: float = 30.0):
            self.name, self.transport_name, self.control, self.build = name, transport_name, control, build
            self.timeout_s = timeout_s
            self._outbox: dict[str, list] = {}
            self.transport = self.engine = None

        def start(self, handles: Mapping[str, Any], router: Any = None) -> bool:
            backend = self.transport_name.removeprefix("rdt:")
            self.transport = RdtTransport(
                backend=backend, me=self.name, actor=self, handles=handles, router=router, timeout_s=self.timeout_s
            )
            self.engine = self.build(self.name, self.transport, self.control)
            return True

        def sync(self, version: int):
            return self.engine.sync(version)

        def state(self):
            return self.engine.state

        def call(self, fn: Callable, *args):
            return fn(self.engine, *args)

        @ray.method(tensor_transport="gloo")
        def _out_gloo(self, key: str):
            return self._outbox[key]

        @ray.method(tensor_transport="nccl")
        def _out_nccl(self, key: str):
            return self._outbox[key]

        def _in(self, payload: list, sender: str, tag: Tag) -> bool:
            self.transport.deliver(payload, sender, tag)
            return True

    _classes["SyncActor"] = SyncActor
    return SyncActor


_TRANSFER_WAIT_S = 120.0  # the router holds an actor's next transfer at most this long behind a stalled one


def router_actor():
    """The Ray actor class that owns the collective group of rdt:gloo / rdt:nccl and starts each transfer."""
    if "Router" in _classes:
        return _classes["Router"]
    ray = _import_ray()

    @ray.remote(num_cpus=0, max_concurrency=64)
    class Router:
        def __init__(self):
            self.group, self.members, self.backend = None, [], None
            self._actor_locks: dict[str, threading.Lock] = {}
            self._locks_lock = threading.Lock()

        def regroup(self, actors: list, backend: str) -> float:
            """(Re)build the collective group over `actors` (call between versions when membership changed)."""
            from ray.experimental.collective import create_collective_group, destroy_collective_group

            start = time.monotonic()
            if self.group is not None:
                try:
                    destroy_collective_group(self.group)
                except Exception:  # noqa: BLE001 - a dead member makes the bulk destroy raise; cleaned per member below
                    pass
                name = self.group.name

                def _gone(actor_self):  # runs in each member: make sure its half of the group is gone
                    import ray.util.collective as col

                    if col.is_group_initialized(name):
                        col.destroy_collective_group(name)
                    return True

                for actor in self.members:
                    try:
                        ray.get(actor.__ray_call__.options(concurrency_group="_ray_system").remote(_gone), timeout=30)
                    except ray.exceptions.RayActorError:
                        pass  # dead member: nothing to clean
            # gloo: Ray's torch_gloo group owns torch.distributed's default group; only "default" is torn down with it
            name = "default" if backend == "gloo" else f"shardplan-{int(start * 1e6)}"
            self.group = create_collective_group(
                list(actors), backend="torch_gloo" if backend == "gloo" else backend, name=name
            )
            self.members, self.backend = list(actors), backend
            with self._locks_lock:  # restarted actors come back under new ids: keep only the members' locks
                ids = {a._actor_id.hex() for a in actors}
                self._actor_locks = {i: lock for i, lock in self._actor_locks.items() if i in ids}
            return time.monotonic() - start

        def route(self, src, key: str, dst, sender: str, tag: Tag, backend: str):
            """Start one transfer once neither of its two actors is in another one, and hold both until it finishes.

            Ray runs each actor's sends and receives on one thread (its `_ray_system` group) in arrival order, and a
            collective send waits for the matching receive; routes of different pairs arrive at different actors in
            different orders, so two trainers sending to two consumers can each wait on the other (seen: a hang in
            about one run in ten of crossing transfers). Holding every actor to one transfer at a time makes such a
            cycle impossible and costs little: each actor moved one transfer at a time anyway. It also keeps a pair's
            untagged transfers from matching crosswise (gloo aborted on "16384 vs 896"). Locks go in sorted order."""
            ids = sorted({src._actor_id.hex(), dst._actor_id.hex()})
            with self._locks_lock:
                locks = [self._actor_locks.setdefault(i, threading.Lock()) for i in ids]
            out = src._out_gloo if backend == "gloo" else src._out_nccl
            with contextlib.ExitStack() as held:
                for lock in locks:
                    held.enter_context(lock)
                ref = dst._in.remote(out.remote(key), sender, tag)
                ray.wait([ref], timeout=_TRANSFER_WAIT_S)  # ready on success or error; a hang is the lane's to time out
            return ref

    _classes["Router"] = Router
    return Router
