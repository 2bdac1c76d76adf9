"""Fuzzing the plan reader with a fixed seed and budget (CI: a few seconds per family; SHARDPLAN_FUZZ_CASES and
SHARDPLAN_FUZZ_SEED scale and vary it).

Invariant, for every input: loading it (decode, then instantiating, formatting and summarising every rank) either
raises a named PlanFileError whose message names the file and docs/plan-format.md, or gives a plan; never another
exception, a hang (each case runs under a 10 s alarm) or unbounded memory. An unsealed change (the checksum not
recomputed) is never accepted. A resealed change can be accepted only as what the bytes say: the reader's canonical
gate re-encodes what it loaded and compares bytes, so nothing is coerced; such plans are counted and must instantiate
or fail with a named error too. The internal safety net in decode ("does not have the documented structure") must never
fire: every refusal comes from a rule.
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

from planfile_helpers import raw_parts, reseal, rich_bytes, seal
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
HOSTILE = [-1, 0, 1, 2, 3, 7, -(1 << 63), (1 << 63) - 1, (1 << 64) - 1, 1 << 48, (1 << 48) + 1, 10 ** 12, True, False,
           None, "false", "true", "", "x", "{}", "{0}", "{", HOLE, "bfloat16", "float128", "Tensor.reshape",
           "os.system", "\x1b[2J", 1.5, float("nan"), float("inf"), -0.0, [], {}, [HOLE], [0, 1, 1, None],
           [[0, 1 << 40, 1, None]], b"\x00", {"tp": 1}]


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
        parent.insert(key, parent[key])   # shared, not copied: msgpack writes it twice
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
    except (OverflowError, ValueError, TypeError):   # a value msgpack itself cannot hold
        return None


@pytest.mark.parametrize("name", ["rich", "llama-tp2"])
def test_structure_aware_mutations(name):
    original = _corpus()[name]
    rng = random.Random(f"{SEED}-structure-{name}")
    base = raw_parts(original)
    nodes = list(_nodes(list(base)))
    for case in range(CASES):
        parts = copy.deepcopy(list(base))
        what = [mutate(rng, parts, nodes if i == 0 else list(_nodes(parts)))
                for i in range(rng.choice((1, 1, 1, 2, 3)))]
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
        if choice == 0:     # an index claiming 10^k writes
            b[3][g][3][0][3] = [[0, 10 ** rng.randrange(1, 15), rng.choice((1, 2, 7)), None]]
        elif choice == 1:   # a source table claiming 10^k names
            b[0][1][3] = [[0, 10 ** rng.randrange(1, 15), 1, None]]
            h["num_sources"] = rng.choice((6, 10 ** rng.randrange(1, 9)))
        elif choice == 2:   # header counts that match a huge index
            n = 10 ** rng.randrange(3, 9)
            b[3][g][3] = [[0, 2, 1, [[0, n, 1, None]]]]
            h["num_writes"] = [n + 3, n + 3]
        elif choice == 3:   # huge shapes
            b[rng.choice((0, 1))][0][1] = [rng.choice((1 << 31, 1 << 47, 1 << 62)), rng.choice((1, 1 << 20))]
        elif choice == 4:   # deep nesting anywhere
            path = rng.choice(list(_nodes([h, b]))[1:])
            _get([h, b], path[:-1])[path[-1]] = _deep(rng.choice((25, 200, 900, 5000)))
        else:               # hostile preamble lengths
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
        start = rng.randrange(planfile.PREAMBLE_BYTES, len(original) - 32)   # inside header or body, resealed
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
        p.write_bytes(planfile.MAGIC[:rng.randrange(9)] + rng.randbytes(rng.randrange(64)))
        paths.append(p)
    for path in paths:
        with deadline(), pytest.raises(PlanFileError) as info:
            PlanFile.read(path)
        assert str(path) in str(info.value)
        STATS["odd-files"][type(info.value).__name__] += 1


def test_zz_report_and_memory():
    """Prints what the families above produced (pytest -s), and bounds the memory all of them together used."""
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for family, counter in sorted(STATS.items()):
        print(f"fuzz {family}: {sum(counter.values())} inputs: " + ", ".join(f"{k} {v}" for k, v in
                                                                        counter.most_common()))
    print(f"peak RSS {peak_mib:.0f} MiB (seed {SEED}, {CASES} cases per family)")
    assert peak_mib < 3000
