"""The sync's transfer checksum (shardplan.sync.schedule.checksum): it sees swapped words, compensating changes and
tail bytes, it is the function its docstring defines (a pure-Python reference), and it depends on the bytes alone:
not on thread count, chunking, alignment or which buffer holds them. Ranks computing another checksum (another sync
protocol version) are refused by name."""

from __future__ import annotations

import functools
import json
import random

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import shardplan.sync.schedule as schedule
from shardplan.sync import LayoutMismatch
from shardplan.sync.control import PROTOCOL, join, stamp_protocol, wire_stamp
from shardplan.sync.rank import Rank
from shardplan.sync.schedule import _LAST, _ROW, _mix_int, checksum, checksum_tensor

ROW_BYTES = 8 * _ROW
WORD = st.integers(-(2**63), 2**63 - 1)
# fixed sizes, each with tail bytes: mixed word by word; one level of row and column sums; two levels
SMALL = 8 * 100 + 3
ROWS = 20 * ROW_BYTES + 8 * 17 + 5
LEVELS = (_LAST + 3) * ROW_BYTES + 8 * 9 + 6
SIZES = st.sampled_from([SMALL, ROWS, LEVELS])
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference(data: bytes) -> int:
    """checksum() in plain Python ints, after its docstring: little-endian words (the last zero-padded); while more
    than _LAST, rows of _ROW of them give their column sums (kept) and their row sums (the next words); the column
    sums and the words left, keyed by position, are mixed and summed with the mixed length."""
    m, n = (1 << 64) - 1, len(data)
    data += bytes(-n % 8)
    words = [int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8)]
    terms = []
    while len(words) > _LAST:
        rows = [words[i : i + _ROW] for i in range(0, len(words), _ROW)]
        terms += [sum(row[c] for row in rows if c < len(row)) & m for c in range(_ROW)]
        words = [sum(row) & m for row in rows]
    terms += words
    key = 0x9E3779B97F4A7C15
    total = sum(_mix_int(t + key * (i + 1)) for i, t in enumerate(terms)) + _mix_int(n)
    total &= m
    return total - (1 << 64) if total >> 63 else total


@functools.cache
def buffer(nbytes: int, seed: int = 0) -> torch.Tensor:
    """Random bytes in an 8-byte aligned uint8 tensor (bf16-looking: torch.randn's bits); shared, never written."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((nbytes + 1) // 2, generator=g).to(torch.bfloat16).view(torch.uint8)[:nbytes].clone()


def with_words(buf: torch.Tensor, at: dict[int, int]) -> torch.Tensor:
    """A copy of buf with int64 word i set to at[i]."""
    out = buf.clone()
    words = out[: out.numel() // 8 * 8].view(torch.int64)
    for i, value in at.items():
        words[i] = value
    return out


def wrap(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


@pytest.mark.parametrize(
    "nbytes",
    [0, 1, 7, 8, 9, SMALL, 8 * _LAST - 1, 8 * _LAST, 8 * _LAST + 1, 8 * _LAST + ROW_BYTES, ROWS, 1 << 20, LEVELS + 1],
)
def test_the_checksum_is_the_function_its_docstring_defines(nbytes):
    buf = buffer(nbytes + 3, seed=nbytes)
    want = reference(bytes(buf[:nbytes].numpy()))
    got = checksum_tensor(buf[:nbytes])
    assert got.dtype == torch.int64 and got.dim() == 0 and got.device == buf.device
    assert int(got) == want
    assert checksum(buf[3 : 3 + nbytes]) == reference(bytes(buf[3 : 3 + nbytes].numpy()))  # not 8-byte aligned
    assert checksum(buf[:0]) == 0


@FAST
@given(nbytes=SIZES, data=st.data(), u=WORD, v=WORD)
@example(nbytes=ROWS, data=None, u=0, v=-(2**63))  # words differing in the top bit only (a bf16 sign)
@example(nbytes=ROWS, data=None, u=1, v=-(2**63) + 1)
def test_swapping_two_distinct_words_changes_the_checksum(nbytes, data, u, v):
    words = nbytes // 8
    if data is None:  # what weighted sums miss: an even index distance (weights i), the same row + column (r + c)
        pairs = [(0, 2), (0, 2 * _ROW), (1, _ROW), (5, 2 * _ROW + 3)]
    else:
        i = data.draw(st.integers(0, words - 1), "i")
        j = data.draw(st.integers(0, words - 1).filter(lambda j: j != i), "j")
        pairs = [(i, j)]
    if u == v:
        v = wrap(u + 1)
    base = buffer(nbytes, seed=nbytes)
    for i, j in pairs:
        before = with_words(base, {i: u, j: v})
        after = with_words(base, {i: v, j: u})
        assert checksum(before) != checksum(after), (i, j, u, v)


@FAST
@given(nbytes=SIZES, data=st.data(), x=WORD)
@example(nbytes=ROWS, data=None, x=-(2**63))
def test_plus_x_in_one_word_and_minus_x_in_another_changes_the_checksum(nbytes, data, x):
    words = nbytes // 8
    if data is None:
        i, j = 0, 2
    else:
        i = data.draw(st.integers(0, words - 1), "i")
        j = data.draw(st.integers(0, words - 1).filter(lambda j: j != i), "j")
    x = x or 1
    base = buffer(nbytes, seed=nbytes + 1)
    w = base[: words * 8].view(torch.int64)
    changed = with_words(base, {i: wrap(int(w[i]) + x), j: wrap(int(w[j]) - x)})
    assert checksum(changed) != checksum(base), (i, j, x)


@FAST
@given(nbytes=SIZES, data=st.data())
def test_a_changed_or_swapped_tail_byte_changes_the_checksum(nbytes, data):
    tail = nbytes % 8
    base = buffer(nbytes, seed=nbytes + 2)
    at = nbytes - tail + data.draw(st.integers(0, tail - 1), "at")
    flipped = base.clone()
    flipped[at] ^= data.draw(st.integers(1, 255), "xor")
    assert checksum(flipped) != checksum(base)
    other = nbytes - tail + data.draw(st.integers(0, tail - 1).filter(lambda b: b != at - (nbytes - tail)), "other")
    if base[at] != base[other]:
        swapped = base.clone()
        swapped[at], swapped[other] = base[other], base[at]
        assert checksum(swapped) != checksum(base)
    assert checksum(base[:-1]) != checksum(base)  # a cut tail


def test_a_moved_block_a_zeroed_word_and_a_trailing_zero_change_the_checksum():
    base = buffer(LEVELS, seed=3)
    moved = base.clone()
    moved[8 * 1000 : 8 * 1064] = base[8 * 2000 : 8 * 2064]
    moved[8 * 2000 : 8 * 2064] = base[8 * 1000 : 8 * 1064]
    zeroed = base.clone()
    zeroed[8 * 77 : 8 * 78] = 0
    longer = torch.cat([base, torch.zeros(1, dtype=torch.uint8)])
    sums = {checksum(t) for t in (base, moved, zeroed, longer)}
    assert len(sums) == 4


def test_the_checksum_does_not_depend_on_thread_count_chunks_alignment_or_buffer(monkeypatch):
    nbytes = (9 << 20) + 8 * 3 + 5  # two levels, blocks and a remainder, a tail
    big = buffer(nbytes + 16, seed=4)
    view, unaligned = big[8 : 8 + nbytes], big[3 : 3 + nbytes]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = checksum(view), checksum(unaligned)
        torch.set_num_threads(2)
        two = checksum(view), checksum(unaligned)
    finally:
        torch.set_num_threads(threads)
    assert one == two
    assert checksum(view.clone()) == one[0] and checksum(unaligned.clone()) == one[1]
    shifted = torch.empty(nbytes + 8, dtype=torch.uint8)[1:]  # the same bytes at another (odd) address
    shifted[:nbytes].copy_(view)
    assert checksum(shifted[:nbytes]) == one[0]
    monkeypatch.setattr(schedule, "_BLOCK", 7)  # other blocks of the column pass, and a remainder
    monkeypatch.setattr(schedule, "_COPY_ROWS", 5)  # other chunks of an unaligned view's copy
    assert (checksum(view), checksum(unaligned)) == one


def test_the_checksum_is_enqueued_on_the_views_device():
    buf = buffer(ROWS, seed=5)
    got = checksum_tensor(buf)
    assert isinstance(got, torch.Tensor) and got.shape == () and got.dtype == torch.int64
    if torch.cuda.is_available():
        assert int(checksum_tensor(buf.cuda())) == int(got)
        assert int(checksum_tensor(buf.cuda()[1:])) == int(checksum_tensor(buf[1:]))


def test_random_buffers_match_the_reference():
    rnd = random.Random(6)
    for _ in range(20):
        data = rnd.randbytes(rnd.randrange(1, 4 * ROW_BYTES))
        assert checksum(torch.frombuffer(bytearray(data), dtype=torch.uint8)) == reference(data)


class Store:
    """The two control-channel calls join makes."""

    def __init__(self):
        self.kv = {}

    def add(self, key, n):
        self.kv[key] = self.kv.get(key, 0) + n
        return self.kv[key]

    def set(self, key, value):
        self.kv[key] = value


def test_a_peer_of_another_sync_protocol_is_refused_by_name_before_any_byte_moves():
    store = Store()
    join(store, "consumer0", None, {0: "rank0:abc"})
    published = json.loads(store.kv["join/consumer0"])["stamps"]["0"]
    assert published == wire_stamp("rank0:abc") and stamp_protocol(published) == PROTOCOL == 2
    trainer = Rank.__new__(Rank)
    trainer.name, trainer.stamps = "trainer0", {0: "rank0:abc"}
    assert trainer._mismatches({"stamps": {"consumer0": {"0": published}}}, [("consumer0", 0)]) == {}
    old = {"stamps": {"consumer0": {"0": "rank0:abc"}}}  # a consumer from before stamps carried a version
    refused = trainer._mismatches(old, [("consumer0", 0)])["consumer0"]
    assert isinstance(refused, LayoutMismatch)
    assert "consumer0 speaks sync protocol 1 and trainer0 protocol 2" in str(refused), refused
    # an older rank compares stamps as they are: this one differs from its own, and names its version there
    assert published != "rank0:abc" and "[sync protocol 2: " in published
