"""Fuzzing the plan reader with a fixed seed and budget (CI: a few seconds per family; SHARDPLAN_FUZZ_CASES and
SHARDPLAN_FUZZ_SEED scale and vary it).

Invariant, for every input: loading it (decode, then instantiating, formatting and summarising every rank) either
raises a named PlanFileError whose message names the file and docs/plan-format.md, or gives a plan; never another
exception, a hang (each case runs under a 10 s alarm) or unbounded memory. An unsealed change (the checksum not
recomputed) is never accepted. A resealed change can be accepted only as what the bytes say: the reader's canonical
gate re-encodes what it loaded and compares bytes, so nothing is coerced; such plans are counted and must instantiate
or fail with a named error too. The internal safety net in decode ("does not have the documented structure") must never
fire: every refusal comes from a rule.

Three replay families (issue 23) fuzz what a plan makes replay do: random in-place chains over trainer tensors (packed
only when they modify tensors the plan made, else refused by name; the trainer's tensors never change), allowed ops
with huge arguments (refused by name before any allocation, or packed; memory flat), and trainer plans that differ
from the consumer's only in what they read (whenever the packed bytes differ, the stamps differ).
"""

from __future__ import annotations

import collections
import copy
import os
import random
import resource
import signal
from pathlib import Path

import msgpack
import pytest
from planfile_helpers import encode_plans, raw_parts, reseal, rich_bytes, seal

from shardplan.plan import inspect as plan_inspect
from shardplan.plan.file import format as planfile
from shardplan.plan.file.format import PlanFile, PlanFileError, decode

SEED = int(os.environ.get("SHARDPLAN_FUZZ_SEED", "20261201"))
CASES = int(os.environ.get("SHARDPLAN_FUZZ_CASES", "1000"))
SHIPPED = Path(__file__).resolve().parents[2] / "plans" / "llama-3.1-8b--tp2--bfloat16.plan"
HOLE = "\x00#"
STATS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang("a single plan took more than 10 s of CPU (or 120 s of wall time, for a blocked read) to load")


class deadline:
    """10 s of process CPU time (robust on a loaded CI box) and 120 s of wall time (a read blocked on a FIFO)."""

    def __enter__(self):
        signal.signal(signal.SIGALRM, _alarm)
        signal.signal(signal.SIGVTALRM, _alarm)
        signal.setitimer(signal.ITIMER_VIRTUAL, 10)
        signal.setitimer(signal.ITIMER_REAL, 120)

    def __exit__(self, *exc):
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)


def _corpus() -> dict[str, bytes]:
    return {"rich": rich_bytes(), "llama-tp2": SHIPPED.read_bytes()}


def check(data: bytes, original: bytes, family: str, sealed: bool) -> str:
    """Applies the invariant to one input; returns the outcome's name (an error class or an acceptance)."""
    with deadline():
        try:
            header, body = decode(data, "f.plan")
            outcome = "accepted-identical" if data == original else "accepted-different"
            if data != original:
                assert sealed, "an unsealed change was accepted"
                plan = PlanFile(header, body, "f.plan")
                for rank in plan.ranks:
                    try:
                        rp = plan.rank(rank)
                        rp.format(plan.sources)
                        plan.not_needed(rank)
                        plan_inspect.group_bytes(body, rank)
                    except PlanFileError as e:
                        _named(e)
                        outcome = "accepted, rank refused: " + type(e).__name__
                plan_inspect.op_histogram(body)
        except PlanFileError as e:
            _named(e)
            outcome = type(e).__name__
    STATS[family][outcome] += 1
    return outcome


def _named(e: PlanFileError) -> None:
    text = str(e)
    assert "f.plan" in text and "docs/plan-format.md" in text, text
    assert "does not have the documented structure" not in text, f"safety net fired: {text}"


# ---- structure-aware mutations ---------------------------------------------------------------------------
HOSTILE = [
    -1,
    0,
    1,
    2,
    3,
    7,
    -(1 << 63),
    (1 << 63) - 1,
    (1 << 64) - 1,
    1 << 48,
    (1 << 48) + 1,
    10**12,
    True,
    False,
    None,
    "false",
    "true",
    "",
    "x",
    "{}",
    "{0}",
    "{",
    HOLE,
    "bfloat16",
    "float128",
    "Tensor.reshape",
    "os.system",
    "\x1b[2J",
    1.5,
    float("nan"),
    float("inf"),
    -0.0,
    [],
    {},
    [HOLE],
    [0, 1, 1, None],
    [[0, 1 << 40, 1, None]],
    b"\x00",
    {"tp": 1},
]


def _nodes(tree):
    """Paths to every node, iteratively, not below depth 40 (a deep nest from an earlier edit is one target)."""
    stack = [((), tree)]
    while stack:
        path, node = stack.pop()
        yield path
        if len(path) < 40:
            items = enumerate(node) if isinstance(node, list) else node.items() if isinstance(node, dict) else ()
            stack.extend((path + (k,), x) for k, x in items)


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _deep(depth: int):
    """A marker that _sealed replaces by `depth` nested msgpack arrays (msgpack's packer stops at 512 levels)."""
    return f"\x00NEST{depth}\x00"


def _with_nests(data: bytes) -> bytes:
    for depth in (2, 25, 30, 100, 200, 900, 5000):
        marker = msgpack.packb(_deep(depth))
        data = data.replace(marker, b"\x92\xa1t" * depth + msgpack.packb(HOLE))
    return data


def mutate(rng: random.Random, parts, nodes):
    """One random edit of the (header, body) tree; returns a description."""
    path = rng.choice(nodes)
    if not path:
        return "none"
    parent, key = _get(parts, path[:-1]), path[-1]
    op = rng.randrange(8)
    if op <= 2:
        value = copy.deepcopy(rng.choice(HOSTILE))
        parent[key] = value
        return f"{path} = {value!r}"
    if op == 3 and isinstance(parent[key], int) and not isinstance(parent[key], bool):
        parent[key] += rng.choice((-1, 1, -2, 2, 1 << 20, -(1 << 20)))
        return f"{path} += small"
    if op == 4 and isinstance(parent, list):
        del parent[key]
        return f"del {path}"
    if op == 5 and isinstance(parent, list):
        parent.insert(key, parent[key])  # shared, not copied: msgpack writes it twice
        return f"dup {path}"
    if op == 6 and isinstance(parent, list) and len(parent) > 1:
        other = rng.randrange(len(parent))
        parent[key], parent[other] = parent[other], parent[key]
        return f"swap {path} {other}"
    if isinstance(parent, dict) and rng.random() < 0.5:
        del parent[key]
        return f"del key {path}"
    depth = rng.choice((2, 30, 100, 900))
    parent[key] = _deep(depth)
    return f"{path} = nest({depth})"


def _sealed(rng, parts) -> bytes | None:
    try:
        h, b = parts
        hb, bb = _with_nests(msgpack.packb(h, use_bin_type=True)), _with_nests(msgpack.packb(b, use_bin_type=True))
        return seal(None, None, header_bytes=hb, body_bytes=bb)
    except (OverflowError, ValueError, TypeError):  # a value msgpack itself cannot hold
        return None


@pytest.mark.parametrize("name", ["rich", "llama-tp2"])
def test_structure_aware_mutations(name):
    original = _corpus()[name]
    rng = random.Random(f"{SEED}-structure-{name}")
    base = raw_parts(original)
    nodes = list(_nodes(list(base)))
    for case in range(CASES):
        parts = copy.deepcopy(list(base))
        what = [
            mutate(rng, parts, nodes if i == 0 else list(_nodes(parts))) for i in range(rng.choice((1, 1, 1, 2, 3)))
        ]
        data = _sealed(rng, parts)
        if data is not None:
            try:
                check(data, original, f"structure-{name}", sealed=True)
            except (AssertionError, Hang, Exception) as e:
                raise AssertionError(f"seed {SEED}, case {case}: {what}: {type(e).__name__}: {e}") from e


def test_hostile_sizes_and_nesting():
    original = _corpus()["rich"]
    rng = random.Random(f"{SEED}-sizes")
    for case in range(CASES // 4):
        h, b = raw_parts(original)
        g = rng.randrange(len(b[3]))
        choice = rng.randrange(6)
        if choice == 0:  # an index claiming 10^k writes
            b[3][g][3][0][3] = [[0, 10 ** rng.randrange(1, 15), rng.choice((1, 2, 7)), None]]
        elif choice == 1:  # a source table claiming 10^k names
            b[0][1][3] = [[0, 10 ** rng.randrange(1, 15), 1, None]]
            h["num_sources"] = rng.choice((6, 10 ** rng.randrange(1, 9)))
        elif choice == 2:  # header counts that match a huge index
            n = 10 ** rng.randrange(3, 9)
            b[3][g][3] = [[0, 2, 1, [[0, n, 1, None]]]]
            h["num_writes"] = [n + 3, n + 3]
        elif choice == 3:  # huge shapes
            b[rng.choice((0, 1))][0][1] = [rng.choice((1 << 31, 1 << 47, 1 << 62)), rng.choice((1, 1 << 20))]
        elif choice == 4:  # deep nesting anywhere
            path = rng.choice(list(_nodes([h, b]))[1:])
            _get([h, b], path[:-1])[path[-1]] = _deep(rng.choice((25, 200, 900, 5000)))
        else:  # hostile preamble lengths
            data = bytearray(original)
            data[12:28] = rng.randbytes(16)
            check(bytes(data), original, "sizes", sealed=False)
            continue
        data = _sealed(rng, [h, b])
        if data is not None:
            check(data, original, "sizes", sealed=True)


@pytest.mark.parametrize("name", ["rich", "llama-tp2"])
def test_truncations_and_byte_flips(name):
    original = _corpus()[name]
    rng = random.Random(f"{SEED}-bytes-{name}")
    cuts = range(len(original)) if len(original) <= 4096 else rng.sample(range(len(original)), 4096)
    for cut in cuts:
        assert check(original[:cut], original, "truncation", sealed=False) == "PlanTruncated" or cut < 8
    for case in range(CASES):
        data = bytearray(original)
        for _ in range(rng.choice((1, 1, 2, 8))):
            data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
        check(bytes(data), original, "flip", sealed=False)
        start = rng.randrange(planfile.PREAMBLE_BYTES, len(original) - 32)  # inside header or body, resealed
        data = bytearray(original)
        for _ in range(rng.choice((1, 1, 2, 4))):
            data[rng.randrange(start, len(data) - 32)] ^= rng.randrange(1, 256)
        check(reseal(bytes(data)), original, "flip-resealed", sealed=True)


def test_odd_files(tmp_path):
    rng = random.Random(f"{SEED}-files")
    os.mkfifo(tmp_path / "fifo.plan")
    (tmp_path / "dir.plan").mkdir()
    (tmp_path / "dangling.plan").symlink_to(tmp_path / "nothing")
    (tmp_path / "loop.plan").symlink_to(tmp_path / "loop.plan")
    paths = [tmp_path / n for n in ("fifo.plan", "dir.plan", "dangling.plan", "loop.plan")] + [Path("/dev/zero")]
    for i in range(50):
        p = tmp_path / f"random{i}.plan"
        p.write_bytes(planfile.MAGIC[: rng.randrange(9)] + rng.randbytes(rng.randrange(64)))
        paths.append(p)
    for path in paths:
        with deadline(), pytest.raises(PlanFileError) as info:
            PlanFile.read(path)
        assert str(path) in str(info.value)
        STATS["odd-files"][type(info.value).__name__] += 1


# ---- replay families (issue 23): in-place ops on sources, oversized op outputs, source-only layout differences -------
def _replay_imports():
    import torch

    from shardplan.plan import interp, ir
    from shardplan.plan.compile.compiler import compile_plans
    from shardplan.plan.file import skeletons
    from shardplan.plan.layout import Layout
    from shardplan.runtime.replay import Replayer

    return torch, interp, ir, compile_plans, skeletons, Layout, Replayer


def _random_leaf_over(rng: random.Random, ir, src):
    """A value leaf over `src` (a View of a 4x4 float32 source): an in-place op on the source itself, on a view op of
    it, or on a copy (the recorder's form), possibly chained and wrapped."""
    A0 = ir.Arg(0)
    full = ir.full_region((4, 4))
    target = src
    for _ in range(rng.randrange(3)):  # view-ish ops that may return the trainer's own storage
        op = rng.choice(
            [
                "Tensor.view",
                "Tensor.contiguous",
                "Tensor.float",
                "Tensor.to",
                "Tensor.reshape",
                "Tensor.__getitem__",
                "Tensor.clone",
                "Tensor.mul",
                "torch.exp",
            ]
        )
        args = {
            "Tensor.view": (A0, (4, 4)),
            "Tensor.reshape": (A0, (4, 4)),
            "Tensor.to": (A0, ir.DType("float32")),
            "Tensor.__getitem__": (A0, ir.Slice(None, None, None)),
            "Tensor.mul": (A0, 1.0),
        }.get(op, (A0,))
        target = ir.View(ir.Call(op, args, (), (target,)), full)
    for _ in range(rng.randrange(1, 3)):
        op = rng.choice(sorted(ir.INPLACE_OPS))
        extra = {
            "Tensor.zero_": (),
            "Tensor.fill_": (rng.choice([0.0, float("nan"), -1.0]),),
            "Tensor.copy_": (ir.Arg(1),),
        }.get(op, (rng.choice([0.5, 2.0, -1.0]),))
        inputs = (target,) + ((ir.View(ir.Full(7.0, (4, 4), "float32"), full),) if op == "Tensor.copy_" else ())
        kwargs = (("out", A0),) if rng.random() < 0.05 else ()
        target = ir.View(ir.Call(op, (A0,) + extra, kwargs, inputs), full)
    if rng.random() < 0.3:
        target = ir.View(ir.Call("Tensor.neg", (A0,), (), (target,)), full)
    return target


def test_inplace_ops_on_sources():
    """Random in-place chains over trainer tensors: a plan either targets only tensors it made (then it packs, and
    pack == the reference interpreter), or it is refused by name by the file reader, Replayer and the interpreter.
    Either way the trainer's tensors stay bitwise as they were."""
    torch, interp, ir, compile_plans, skeletons, Layout, Replayer = _replay_imports()
    from shardplan.runtime.apply import params_from_plan

    rng = random.Random(f"{SEED}-inplace")
    meta = ir.TensorMeta("model.layers.0.w.weight", (4, 4), "float32")
    for case in range(CASES // 10):  # each case writes, reads and packs a plan file: the slowest family per case
        src = ir.View(ir.Source(meta.name), rng.choice([ir.full_region((4, 4)), ir.Region(0, (4, 4), (1, 4))]))
        value = _random_leaf_over(rng, ir, src)
        plan = ir.RankPlan(0, (meta,), (ir.Write(meta.name, ir.full_region((4, 4)), value),))
        trainer = {meta.name: torch.randn(4, 4, generator=torch.Generator().manual_seed(case))}
        before = trainer[meta.name].clone()
        refused = ir.foreign_write(value.leaf)
        signal.signal(signal.SIGVTALRM, _alarm)
        saved = skeletons.SkeletonRules.foreign_write
        skeletons.SkeletonRules.foreign_write = lambda *a: None  # a writer without the check
        try:
            data = encode_plans([plan], [meta], tp=1, model="t/m", architecture="TForCausalLM")
        finally:
            skeletons.SkeletonRules.foreign_write = saved
        try:
            if refused:
                with pytest.raises(planfile.PlanOpNotAllowed, match="never writes into the trainer's tensors"):
                    decode(data, "f.plan")
                with pytest.raises(interp.ForeignWriteError):
                    Replayer(plan, {meta.name: meta})
                with pytest.raises(interp.ForeignWriteError):
                    interp.apply_reference(plan, trainer, params_from_plan(plan))
                outcome = "refused"
            else:
                header, body = decode(data, "f.plan")
                loaded = PlanFile(header, body, "f.plan").rank(0)
                buf = Replayer(loaded, {meta.name: meta}).pack(trainer)
                params = params_from_plan(plan)
                interp.apply_reference(plan, trainer, params)
                assert torch.equal(
                    buf[:64].view(torch.float32).view(4, 4).nan_to_num(7.5), params[meta.name].nan_to_num(7.5)
                )
                outcome = "packed"
            assert torch.equal(trainer[meta.name], before), "a trainer tensor was modified"
        except (AssertionError, Exception) as e:
            raise AssertionError(
                f"seed {SEED}, case {case}: {ir.leaf_str(value.leaf, {})}: {type(e).__name__}: {e}"
            ) from e
        STATS["replay-inplace"][outcome] += 1
    assert STATS["replay-inplace"]["refused"] and STATS["replay-inplace"]["packed"]


def test_oversized_op_outputs():
    """Allowed ops with random (often huge) arguments over a 4-element source: Replayer either refuses the plan by
    name (PlanTooLarge / PlanError naming the rank, write and op) before allocating anything, or packs it; memory
    stays flat across the family."""
    torch, interp, ir, compile_plans, skeletons, Layout, Replayer = _replay_imports()
    rng = random.Random(f"{SEED}-oversized")
    meta = ir.TensorMeta("model.layers.0.b.weight", (4,), "float32")
    param = ir.TensorMeta("model.layers.0.p.weight", (4,), "float32")
    A0, src = ir.Arg(0), ir.View(ir.Source(meta.name), ir.full_region((4,)))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for case in range(CASES // 5):
        big = rng.choice([1, 2, 3, 10**3, 10**5, 10**9, 10**12, 1 << 48])
        kind = rng.randrange(6)
        if kind == 0:
            leaf = ir.Call("Tensor.repeat", (A0, rng.choice([1, big]), big), (), (src,))
        elif kind == 1:
            leaf = ir.Call("Tensor.repeat_interleave", (A0, big), (), (src,))
        elif kind == 2:
            expanded = ir.View(ir.Call("Tensor.expand", (A0, (big, 4)), (), (src,)), ir.Region(0, (4,), (1,)))
            leaf = ir.Call("Tensor.contiguous", (A0,), (), (expanded,))
        elif kind == 3:
            zero = ir.View(ir.Source(meta.name), ir.Region(0, (big, rng.choice([1, big])), (0, 0)))
            leaf = ir.Call(rng.choice(["Tensor.contiguous", "Tensor.clone", "Tensor.neg"]), (A0,), (), (zero,))
        elif kind == 4:
            leaf = ir.Full(0.0, (big, rng.choice([1, 4, big])), "float32")
        else:
            leaf = ir.Call("torch.cat", ((A0,) * rng.choice([1, 2, 64]),), (("dim", 0),), (src,))
        value = ir.View(leaf, ir.Region(0, (4,), (1,)))
        plan = ir.RankPlan(0, (param,), (ir.Write(param.name, ir.full_region((4,)), value),))
        signal.signal(signal.SIGVTALRM, _alarm)
        signal.setitimer(signal.ITIMER_VIRTUAL, 10)
        try:
            replayer = Replayer(plan, {meta.name: meta})
            replayer.pack({meta.name: torch.arange(4.0)})
            outcome = "packed"
        except interp.PlanError as e:
            assert "rank 0: write 0 (model.layers.0.p.weight)" in str(e), e
            outcome = type(e).__name__
        except Exception as e:
            raise AssertionError(f"seed {SEED}, case {case}: {ir.leaf_str(leaf, {})}: {type(e).__name__}: {e}") from e
        finally:
            signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        STATS["replay-oversized"][outcome] += 1
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0 < 200
    assert STATS["replay-oversized"]["PlanTooLarge"] and STATS["replay-oversized"]["packed"]


def _source_only_change(rng: random.Random, ir, plan, other, sources):
    """A plan with the same destinations as `plan` and (possibly) other reads: a description and the plan."""
    writes = list(plan.writes)
    pure = [i for i, w in enumerate(writes) if ir.is_pure_view(w)]
    kind = rng.randrange(5)
    if kind == 0 and len(pure) > 1:  # swap the sources of two writes of equal source sizes
        i, j = rng.sample(pure, 2)
        if writes[i].src.region.sizes == writes[j].src.region.sizes:
            writes[i], writes[j] = (
                ir.Write(writes[i].param, writes[i].dst, writes[j].src),
                ir.Write(writes[j].param, writes[j].dst, writes[i].src),
            )
        return "swap", writes
    if kind == 1:  # the next slice: shift one source region by one step of its first dim, within bounds
        i = rng.choice(pure)
        r = writes[i].src.region
        step = r.strides[0] * rng.choice([-1, 1]) if r.strides else 0
        shifted = ir.Region(r.offset + step, r.sizes, r.strides)
        lo, hi = shifted.extent()
        if lo >= 0 and hi <= sources[writes[i].src.leaf.name].numel:
            writes[i] = ir.Write(writes[i].param, writes[i].dst, ir.View(writes[i].src.leaf, shifted))
        return "shift", writes
    if kind == 2:  # the other rank's reads into this rank's destinations
        return "other-rank", [ir.Write(w.param, w.dst, o.src) for w, o in zip(writes, other.writes)]
    if kind == 3:  # another source of the same shape and dtype
        i = rng.choice(pure)
        name = writes[i].src.leaf.name
        same = [s.name for s in sources.values() if (s.shape, s.dtype) == (sources[name].shape, sources[name].dtype)]
        writes[i] = ir.Write(writes[i].param, writes[i].dst, ir.View(ir.Source(rng.choice(same)), writes[i].src.region))
        return "rename", writes
    return "same", writes


def test_source_only_layout_differences():
    """A trainer plan that differs from the consumer's only in what its writes read (swapped, shifted, renamed or the
    other rank's sources): whenever the bytes it packs differ from the consumer's plan's, the trainer's stamp differs
    from the consumer's (both sides refuse before any byte moves); the same plan stamps alike on both sides."""
    torch, interp, ir, compile_plans, skeletons, Layout, Replayer = _replay_imports()
    from planfile_helpers import rich_plans

    from shardplan.runtime.apply import params_from_plan
    from shardplan.sync.adapters import ApplyUnpacker, ReplayPacker

    rng = random.Random(f"{SEED}-stamps")
    plans, source_list = rich_plans()
    sources = {s.name: s for s in source_list}
    tensors = {
        s.name: torch.randn(s.shape, generator=torch.Generator().manual_seed(i)).to(getattr(torch, s.dtype))
        for i, s in enumerate(source_list)
    }
    for case in range(CASES // 5):
        rank = rng.randrange(2)
        consumer = plans[rank]
        what, writes = _source_only_change(rng, ir, consumer, plans[1 - rank], sources)
        trainer_plan = ir.RankPlan(rank, consumer.params, tuple(writes), consumer.fallbacks)
        try:
            differ = not torch.equal(
                Replayer(consumer, sources).pack(tensors), Replayer(trainer_plan, sources).pack(tensors)
            )
            trainer = ReplayPacker([trainer_plan], sources).stamp(rank)
            mine = ApplyUnpacker(
                consumer, params_from_plan(consumer), sources=sources, fallback_loader=lambda n, t: None
            ).stamp()
            if differ:
                assert trainer != mine, "other bytes, same stamp: the consumer would apply them"
            elif writes == list(consumer.writes):
                assert trainer == mine, "the same plan stamps differently"
        except AssertionError as e:
            raise AssertionError(f"seed {SEED}, case {case}: {what}: {e}") from e
        STATS["replay-stamps"][f"{what}, {'other bytes, refused' if differ else 'same bytes'}"] += 1
    assert sum(n for k, n in STATS["replay-stamps"].items() if "refused" in k)


@pytest.fixture(scope="module", autouse=True)
def _peak_rss_from_this_module():
    """In a whole-suite process the lifetime peak belongs to earlier modules (real-size models): reset the kernel's
    high-water mark (VmHWM) so the bound below measures the fuzz families alone."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux: the lifetime peak (ru_maxrss) below is then the bound
    _BASELINE_MIB.append(_status_mib("VmRSS") or 0.0)
    yield


_BASELINE_MIB: list[float] = []


def _status_mib(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _peak_mib() -> float:
    """Peak RSS growth since this module started (above what earlier modules left resident)."""
    peak = _status_mib("VmHWM")
    if peak is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return peak - _BASELINE_MIB[0]


def test_zz_report_and_memory():
    """Prints what the families above produced (pytest -s), and bounds the memory all of them together used."""
    peak_mib = _peak_mib()
    for family, counter in sorted(STATS.items()):
        print(
            f"fuzz {family}: {sum(counter.values())} inputs: " + ", ".join(f"{k} {v}" for k, v in counter.most_common())
        )
    print(f"peak RSS growth {peak_mib:.0f} MiB (seed {SEED}, {CASES} cases per family)")
    assert peak_mib < 2500
