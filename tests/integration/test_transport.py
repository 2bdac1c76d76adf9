"""Transport adapters alone: choosing by name, missing optional dependencies, and a trainer/consumer pair per adapter
(bytes land bitwise at the tag's slot and offset; a stalled or dead peer ends the wait with an error naming it; a
restarted peer with a new epoch gets a fresh connection), and the rdt router's one transfer per actor at a time. Ray
adapters are exercised end to end in test_sync.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import time

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # LOOPBACK ONLY
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import pytest
import torch

from shardplan.transport import (
    NAMES,
    Control,
    MissingDependency,
    PeerDied,
    PeerError,
    PeerTimeout,
    Tag,
    UnknownTransport,
    create,
)

TIMEOUT_S = 2.0
NBYTES = 8 << 20  # larger than socket buffers: a send to a peer that never receives cannot complete


def test_unknown_name_lists_the_choices():
    with pytest.raises(
        UnknownTransport, match="unknown transport 'tcp'.*nccl, rdt:nccl, rdt:gloo, rdt:nixl, mooncake:tcp"
    ):
        create("tcp")
    assert NAMES == ("nccl", "rdt:nccl", "rdt:gloo", "rdt:nixl", "mooncake:tcp", "mooncake:rdma")


@pytest.mark.parametrize(
    "name, hidden, words",
    [
        ("mooncake:tcp", ["mooncake", "mooncake.engine"], "pip install mooncake-transfer-engine"),
        ("mooncake:rdma", ["mooncake", "mooncake.engine"], "libibverbs1"),
        ("rdt:gloo", ["ray"], "pip install 'ray>=2.60'"),
        ("rdt:nixl", ["nixl"], "pip install nixl"),
    ],
)
def test_missing_optional_dependency_says_how_to_install(monkeypatch, name, hidden, words):
    for module in hidden:
        monkeypatch.setitem(sys.modules, module, None)  # import of it now raises ImportError
    options = {"me": "trainer0", "control": Control("127.0.0.1", 1)}
    if name.startswith("rdt:"):
        options = {"me": "trainer0", "actor": None, "handles": {}, "router": object()}
    with pytest.raises(MissingDependency) as info:
        create(name, **options)
    assert words in str(info.value)


def test_core_modules_import_no_optional_dependency():
    code = (
        "import sys, shardplan.sync, shardplan.transport, shardplan.transport.nccl;"
        "bad = [m for m in ('ray', 'nixl', 'mooncake', 'vllm') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_peer_errors_pickle_with_the_peer_and_control_timeout_names_it():
    err = pickle.loads(pickle.dumps(PeerTimeout("consumer3", "no answer within 2.0 s")))
    assert isinstance(err, PeerError) and err.peer == "consumer3" and str(err) == "consumer3: no answer within 2.0 s"
    control = Control.serve("127.0.0.1")
    start = time.monotonic()
    with pytest.raises(PeerTimeout, match="trainer1: no answer within 0.3 s \\(bytes of layers.2\\)"):
        control.get("never", 0.3, "trainer1", "bytes of layers.2")
    assert time.monotonic() - start < 2
    control.set("k", "v")
    assert control.try_get("k") == "v" and control.try_get("missing") is None
    assert pickle.loads(pickle.dumps(control)).get("k", 1, "x") == "v"


# ---- a trainer/consumer pair per adapter, in forked processes --------------------------------------------------------
def pattern(n: int, seed: int) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 7 + seed) % 251).to(torch.uint8)


def _consumer(name, control, epoch, mode, conn):
    transport = create(name, me="consumer0", control=control, timeout_s=TIMEOUT_S)
    buffers = [torch.zeros(NBYTES + 4096, dtype=torch.uint8) for _ in range(2)]
    transport.register(buffers)
    control.set(f"ready/{epoch}", "1")
    transport.connect({"consumer0": epoch, "trainer0": 1})
    tag = Tag(1, 0, 1, 256, 4096)
    dst = buffers[1][256 : 256 + 4096]
    transport.recv("trainer0", dst, tag).wait(10)
    if transport.one_sided:
        control.get(f"sent/{epoch}", 10, "trainer0")
    conn.send(bool(torch.equal(dst, pattern(4096, epoch))) and int(buffers[1][:256].sum()) == 0)
    if mode == "die":
        os._exit(3)
    if mode == "stall":
        time.sleep(60)
    conn.send("done")


def _spawn(ctx, *args):
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(*args, child), daemon=True)
    proc.start()
    return proc, parent


@pytest.mark.parametrize("name", ["nccl", "mooncake:tcp"])
def test_pair_bytes_land_then_dead_or_stalled_peer_is_named(name):
    if name.startswith("mooncake"):
        pytest.importorskip("mooncake.engine", exc_type=ImportError)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "shardplan.transport.nccl"])
    control = Control.serve("127.0.0.1")
    trainer = create(name, me="trainer0", control=control, timeout_s=TIMEOUT_S)
    staging = torch.zeros(NBYTES + 4096, dtype=torch.uint8)
    trainer.register([staging])
    procs = []
    try:
        for epoch, mode in ((1, "die"), (2, "stall")):
            proc, conn = _spawn(ctx, name, control, epoch, mode)
            procs.append(proc)
            control.get(f"ready/{epoch}", 60, "consumer0")
            trainer.connect({"trainer0": 1, "consumer0": epoch})  # a new epoch: a fresh connection
            staging[:4096] = pattern(4096, epoch)
            trainer.send("consumer0", staging[:4096], Tag(1, 0, 1, 256, 4096)).wait(10)
            control.set(f"sent/{epoch}", "1")
            assert conn.recv() is True, "bytes differ or landed outside the tag's range"
            if mode == "die":
                proc.join(10)
            start = time.monotonic()
            pending = trainer.send("consumer0", staging[:NBYTES], Tag(1, 1, 0, 0, NBYTES))
            if trainer.one_sided and mode == "stall":
                # a one-sided write lands in a live process even if its program stalls: the engine's control
                # channel (free / done marks) is what notices a stalled consumer, not the transport
                pending.wait(10)
                continue
            with pytest.raises(PeerError) as info:
                # the consumer never receives this (dead, or stalled): the wait must end and name it
                pending.wait(TIMEOUT_S)
            assert info.value.peer == "consumer0"
            assert isinstance(info.value, PeerDied if mode == "die" else PeerTimeout), info.value
            assert time.monotonic() - start < TIMEOUT_S + 2
    finally:
        for proc in procs:
            proc.kill()
        trainer.close()


def test_rdt_router_holds_each_actor_to_one_transfer(ray_session):
    """Ray moves an actor's collective sends and receives on one thread, in arrival order, and a send waits for its
    receive: two trainers crossing transfers to two consumers could each wait on the other (a hang seen about once in
    ten runs of 200 crossing 16 MiB transfers). The router must hold every actor to one transfer at a time: from the
    trainer's `_out_gloo` to the end of the consumer's `_in`, no two transfers that share an actor overlap."""
    ray = ray_session
    from shardplan.transport.rdt import router_actor

    class Rank:
        def __init__(self):
            self.part, self.out_at = torch.arange(1024, dtype=torch.float32), {}

        def _out_gloo(self, key):
            self.out_at[key] = time.monotonic()
            return [self.part]

        def _in(self, payload, sender, tag):
            time.sleep(0.02)  # widen each transfer's window: overlaps, if allowed, cannot slip between them
            return tag, bool(torch.equal(payload[0], torch.arange(1024, dtype=torch.float32))), time.monotonic()

        def out_times(self):
            return self.out_at

    Rank._out_gloo = ray.method(tensor_transport="gloo")(Rank._out_gloo)
    actor_cls = ray.remote(num_cpus=0, max_concurrency=32, enable_tensor_transport=True)(Rank)
    trainers, consumers = [actor_cls.remote() for _ in range(2)], [actor_cls.remote() for _ in range(2)]
    router = router_actor().remote()
    try:
        ray.get(router.regroup.remote(trainers + consumers, "gloo"), timeout=120)
        jobs = [(t, c, r) for r in range(6) for t in range(2) for c in (r % 2, 1 - r % 2)]  # crossing orders
        routed = [
            router.route.remote(trainers[t], f"{c}/{r}", consumers[c], f"trainer{t}", (t, c, r), "gloo")
            for t, c, r in jobs
        ]
        landed = ray.get(ray.get(routed, timeout=120), timeout=120)
        out_at = [ray.get(t.out_times.remote(), timeout=30) for t in trainers]
        # a new membership (restarted actors come back under new ids) keeps only its members' locks
        locks = lambda: sorted(ray.get(router.__ray_call__.remote(lambda r: list(r._actor_locks)), timeout=30))  # noqa: E731
        assert len(locks()) == 4
        ray.get(router.regroup.remote(trainers[:1] + consumers[:1], "gloo"), timeout=120)
        assert locks() == sorted(a._actor_id.hex() for a in (trainers[0], consumers[0]))
    finally:
        for actor in [router, *trainers, *consumers]:
            ray.kill(actor)
    assert all(ok for _, ok, _ in landed), "bytes differ"
    windows: dict[str, list] = {}
    for (t, c, r), _, in_end in landed:
        span = (out_at[t][f"{c}/{r}"], in_end, (t, c, r))
        windows.setdefault(f"trainer{t}", []).append(span)
        windows.setdefault(f"consumer{c}", []).append(span)
    for actor, spans in windows.items():
        spans.sort()
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            assert start >= end, f"{actor}: transfers {first} and {second} (trainer, consumer, round) overlap"
