"""The one small Protocol every transport adapter implements, the control channel, and the peer errors.

The sync engine (`shardplan.sync`) moves bytes between two kinds of endpoints: trainer ranks (senders) and consumer
(inference) ranks (receivers). Per sync it calls, on each rank:

    transport.register(buffers)            once, at construction: the buffers every byte goes out of / lands in
    transport.connect({peer: epoch})       at the start of every sync: the peers of this version and their epochs
    transport.send(peer, view, tag)        trainer: a view of a registered staging buffer -> the consumer
    transport.recv(peer, view, tag)        consumer: a view of a registered receive buffer <- the trainer
    pending.wait(timeout_s)                both: block until that one transfer finished, or raise a PeerError
    transport.close()

`tag` says where the bytes land on the consumer (receive slot and byte offset) so one-sided adapters (Mooncake writes,
NIXL pulls) can address the consumer's registered buffer directly; two-sided adapters (torch.distributed NCCL/gloo)
match sends and receives per peer pair in posting order, which the engine keeps identical on both sides.

A one-sided adapter (`one_sided = True`) returns an already-finished Pending from `recv`: the consumer learns that the
bytes arrived from the trainer's "done" mark on the control channel, which the trainer sets only after `send`'s
Pending finished.

Peers are named "trainer<i>" / "consumer<j>": the names appear in every error and in control-channel keys. Epochs
count a rank's incarnations (a restart or a failed sync bumps it): an adapter re-opens its connection to a peer whose
epoch changed, so state left behind by a failed transfer (unmatched receives, a half-dead socket) is never reused.

Why no collectives: NCCL and gloo collectives hang when one member dies. Every adapter therefore talks per peer pair,
and every wait has a deadline.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping, Protocol, Sequence

import torch

from shardplan.errors import ShardplanError

Peer = str


def trainer_name(rank: int) -> Peer:
    return f"trainer{rank}"


def consumer_name(rank: int) -> Peer:
    return f"consumer{rank}"


# ---- errors --------------------------------------------------------------------------------------------------------
class PeerError(ShardplanError):
    """A transfer with one peer failed. `peer` names it ("trainer1", "consumer3")."""

    def __init__(self, peer: Peer, message: str):
        super().__init__(f"{peer}: {message}")
        self.peer, self.detail = peer, message

    def __reduce__(self):  # keep (peer, message) across pickling (Ray, multiprocessing)
        return (type(self), (self.peer, self.detail))


class PeerTimeout(PeerError):
    """A peer did not answer within the timeout (stalled, overloaded, or dead without closing its connections)."""


class PeerDied(PeerError):
    """A peer's process or connection is gone (connection reset, actor died, transfer refused)."""


class PeerAborted(PeerError):
    """A peer gave up on this sync because of a third rank; the message says which and why."""


class ControlUnreachable(PeerDied):
    """The control channel's server cannot be reached (wrong host or port, or the driver is gone)."""


class ControlForged(PeerError):
    """A control-channel value without a valid MAC under this sync's secret: written by someone without the secret,
    or copied from another key. Refused; the message names the key."""


class UnknownTransport(ShardplanError):
    """A transport name that no adapter has; the message lists the names there are."""


class MissingDependency(ShardplanError):
    """An optional transport was chosen whose package is not installed; the message has the install command."""


# ---- the Protocol ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Tag:
    """Where one transfer's bytes land on the consumer: `nbytes` at `offset` of receive buffer `slot`."""

    version: int
    group: int  # index of the weight group in the schedule
    slot: int  # index into the consumer's registered receive buffers (double buffering: group % 2)
    offset: int  # byte offset inside that buffer
    nbytes: int


class Pending(Protocol):
    def wait(self, timeout_s: float, check: Callable[[], str | None] | None = None) -> None:
        """Return once the transfer finished; raise PeerTimeout / PeerDied (naming the peer) otherwise.

        `check`, when given, is polled while waiting (every ~50 ms); when it returns a message (the peer wrote an abort
        mark), the wait raises PeerAborted with it. The engine's two-sided pipeline uses it instead of control-channel
        round trips per group (see shardplan.sync); one-sided adapters' waits may ignore it."""


class Transport(Protocol):
    one_sided: bool  # True: recv() is a no-op, arrival is announced on the control channel by the sender

    def register(self, buffers: Sequence[torch.Tensor]) -> None:
        """Called once per endpoint with every buffer it will send from or receive into (never grown later)."""

    def connect(self, peers: Mapping[Peer, int]) -> None:
        """Called at the start of every sync with this version's peers and their epochs. Must not raise for one bad
        peer: record the error and raise it from that peer's next send/recv."""

    def send(self, peer: Peer, src: torch.Tensor, tag: Tag) -> Pending: ...

    def recv(self, peer: Peer, dst: torch.Tensor, tag: Tag) -> Pending: ...

    def close(self) -> None: ...

    # optional: abort(peer) -> None. After this side failed mid-sync with `peer` (its abort marks set), end the
    # connection so the peer's posted transfers fail at once; for adapters whose waits cannot poll the marks (gloo)


class Done:
    """An already-finished Pending (one-sided receive, empty transfer)."""

    def wait(self, timeout_s: float, check=None) -> None:
        return None


class Failed:
    """A Pending that re-raises an error recorded earlier (e.g. connect() could not reach the peer)."""

    def __init__(self, error: Exception):
        self.error = error

    def wait(self, timeout_s: float, check=None) -> None:
        raise self.error


# ---- control channel -------------------------------------------------------------------------------------------------
class Control:
    """The control channel: a small key-value store (torch's TCPStore) every rank of a sync reaches.

    It carries what must never hang on a dead peer: the coordinator's announcement of each version, the schedule,
    "slot free" / "bytes done" marks with checksums, per-rank results, and adapter rendezvous data. Every read has a
    deadline and names the peer it waited for. Picklable: it pickles as its address and reconnects (Ray actors,
    spawned processes). Host the server (`Control.serve`) in the process that outlives the ranks: the RL driver or
    the launcher.

    Clients come from a per-process pool and are used by one thread at a time: a TCPStore client serialises its
    operations (a blocking wait would stall every other thread), and opening one occasionally takes seconds on some
    machines (seen in a gVisor sandbox), so they are opened ahead (`prewarm`) and reused.
    """

    _pools: dict[tuple[str, int], list] = {}
    _pool_lock = threading.Lock()

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float = 60.0,
        secret: bytes | str | None = None,
        _server: torch.distributed.TCPStore | None = None,
    ):
        # secret: the driver's (Control.serve makes one; bytes or hex); None: $SHARDPLAN_CONTROL_SECRET (hex) if set,
        # else unauthenticated (values neither sealed nor checked: only for a store nobody else can reach)
        # connect_timeout_s: how long opening a client may take (a wrong port or a dead server is named after it)
        if not (
            isinstance(connect_timeout_s, (int, float))
            and not isinstance(connect_timeout_s, bool)
            and math.isfinite(connect_timeout_s)
            and connect_timeout_s > 0
        ):
            raise ValueError(
                f"Control: connect_timeout_s must be a positive finite number of seconds, got {connect_timeout_s!r}"
            )
        self.host, self.port, self.connect_timeout_s = host, port, float(connect_timeout_s)
        self._server = _server
        secret = (os.environ.get(SECRET_ENV) or None) if secret is None else secret
        self.secret: bytes | None = bytes.fromhex(secret) if isinstance(secret, str) else secret

    @classmethod
    def serve(cls, host: str = "127.0.0.1", port: int = 0, secret: bytes | str | None = None) -> "Control":
        """Host the store on (host, port); every value is sealed with `secret` (default: $SHARDPLAN_CONTROL_SECRET,
        else a fresh random one): clients prove it through this object (pickled) or `secret_hex`."""
        secret = secret or os.environ.get(SECRET_ENV) or secrets.token_bytes(32)
        # TCPStore's own server listens on every interface whatever host says: bind (host, port) here, hand it the fd
        port, fd = _listen(host, port)
        server = torch.distributed.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60), use_libuv=True,
            master_listen_fd=fd,
        )  # fmt: skip
        with Control._pool_lock:
            # clients pooled for an earlier server that had this port talk to a closed socket ("got 0 bytes")
            Control._pools.pop((host, server.port), None)
        control = cls(host, server.port, secret=secret, _server=server)
        control.prewarm(2)
        return control

    def __reduce__(self):
        return (_control, (self.host, self.port, self.connect_timeout_s, self.secret))

    @property
    def secret_hex(self) -> str:
        """The secret as hex (what SHARDPLAN_CONTROL_SECRET takes); empty when unauthenticated."""
        return self.secret.hex() if self.secret else ""

    def _seal(self, key: str, value: str) -> str:
        return value if self.secret is None else _mac(self.secret, key, value) + value

    def _open(self, key: str, raw: bytes, peer: Peer) -> str:
        """The value of `key` once its MAC (bound to the key) checks; ControlForged naming the key otherwise."""
        text = raw.decode(errors="replace")
        if self.secret is None:
            return text
        mac, value = text[:MAC_CHARS], text[MAC_CHARS:]
        if not hmac.compare_digest(mac.encode(), _mac(self.secret, key, value).encode()):
            raise ControlForged(
                peer, f"control key {key!r}: value without a valid MAC under this sync's secret (written without "
                "the secret, or copied from another key); refused"
            )  # fmt: skip
        return value

    def _new_client(self) -> torch.distributed.TCPStore:
        # TCPStore retries a refused connect until its timeout: bounded by connect_timeout_s, then named
        timeout = timedelta(seconds=self.connect_timeout_s)
        try:
            client = torch.distributed.TCPStore(self.host, self.port, is_master=False, timeout=timeout)
        except Exception as e:  # DistNetworkError / RuntimeError: refused, unreachable, timed out
            raise ControlUnreachable(
                "control",
                f"cannot reach the control channel at {self.host}:{self.port} within "
                f"{self.connect_timeout_s:.1f} s ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:200]}); check the host and port the "
                f"driver serves it on",
            ) from None
        client.set_timeout(timedelta(seconds=60))  # waits set their own deadlines; others never block for long
        return client

    def lease(self) -> torch.distributed.TCPStore:
        """A client for this thread's exclusive use; give it back with `release` (or keep it, e.g. a NCCL pair)."""
        with Control._pool_lock:
            pool = Control._pools.setdefault((self.host, self.port), [])
            if pool:
                return pool.pop()
        return self._new_client()

    def release(self, client: torch.distributed.TCPStore) -> None:
        with Control._pool_lock:
            Control._pools.setdefault((self.host, self.port), []).append(client)

    def prewarm(self, num_clients: int) -> None:
        """Open clients until the pool holds `num_clients` (call at startup, where a slow connect costs nothing)."""
        with Control._pool_lock:
            missing = num_clients - len(Control._pools.setdefault((self.host, self.port), []))
        for _ in range(missing):
            self.release(self._new_client())

    def _call(self, fn):
        client = self.lease()
        try:
            return fn(client)
        finally:
            self.release(client)

    # every value goes through _seal / _open here (add's counters carry none: epochs are trusted via sealed joins)
    def set(self, key: str, value: str) -> None:
        self._call(lambda s: s.set(key, self._seal(key, value)))

    def add(self, key: str, amount: int) -> int:
        return self._call(lambda s: s.add(key, amount))

    def delete(self, key: str) -> None:
        self._call(lambda s: s.delete_key(key))

    def try_get(self, key: str, peer: Peer = "control") -> str | None:
        raw = self._call(lambda s: s.get(key) if s.check([key]) else None)
        return None if raw is None else self._open(key, raw, peer)

    def get(self, key: str, timeout_s: float, peer: Peer, what: str = "") -> str:
        """Value of `key`, waiting at most `timeout_s`; PeerTimeout(peer) when it never appears."""
        client = self.lease()
        try:
            client.wait([key], timedelta(seconds=max(timeout_s, 0.001)))
            raw = client.get(key)
        except Exception as e:  # DistStoreError on timeout; anything else (server gone) is just as final
            if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                raise PeerTimeout(
                    peer, f"no answer within {timeout_s:.1f} s{' (' + what + ')' if what else ''}"
                ) from None
            raise PeerDied(peer, f"control channel failed while waiting for {what or key}: {e}") from e
        finally:
            self.release(client)
        return self._open(key, raw, peer)


SECRET_ENV = "SHARDPLAN_CONTROL_SECRET"
MAC_CHARS = 64  # hex HMAC-SHA256 in front of every sealed value


def _mac(secret: bytes, key: str, value: str) -> str:
    # the key is bound: a value copied to another key (another version, rank or group) fails
    return hmac.new(secret, f"{len(key)}:{key}:{value}".encode(), hashlib.sha256).hexdigest()


def _listen(host: str, port: int) -> tuple[int, int]:
    """(port, fd) of a socket listening on `host`'s first address only (port 0: a free one)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(1024)
    return sock.getsockname()[1], sock.detach()  # the store owns the fd from here


def _control(host: str, port: int, connect_timeout_s: float, secret: bytes | None = None) -> Control:
    return Control(host, port, connect_timeout_s=connect_timeout_s, secret=secret)


def deadline_after(timeout_s: float) -> float:
    return time.monotonic() + timeout_s


def left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.0)
