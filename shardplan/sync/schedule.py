"""The static schedule: which trainer serves which bytes of which consumer, per group; a pure function of the
consumers' segments and what each live trainer holds. Also the checksum both sides compute per piece."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import partial
from typing import Mapping, Sequence

import torch

from shardplan.sync.stages import ScheduleError, Span, WeightSource
from shardplan.transport.base import consumer_name

# Schedules the coordinator keeps published and each rank keeps parsed: the last few (a version's is the newest; with
# EPLB a new one comes with each new set of placements, and a Kimi-K2 TP32 schedule is ~2 MiB of JSON).
KEPT_SCHEDULES = 4


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes [lo, hi) of a consumer's group buffer, packed and sent by one trainer (segments: layout indices).
    `direct`: (segment, lo, hi) of the segments the trainer sends from its own tensor (Span.direct) rather than from
    its staging buffer; each is a message of its own, and so is each run of bytes between them (`messages`)."""

    trainer: int
    lo: int
    hi: int
    segments: tuple[int, ...]
    direct: tuple[tuple[int, int, int], ...] = ()

    def messages(self) -> tuple[tuple[int, int, int], ...]:
        """(lo, hi, segment sent from the trainer's tensor, or -1: from its staging buffer) of each transfer, in
        order: what both sides post, so sends and receives match one to one."""
        out, at = [], self.lo
        for seg, lo, hi in self.direct:
            if lo > at:
                out.append((at, lo, -1))
            out.append((lo, hi, seg))
            at = hi
        if at < self.hi:
            out.append((at, self.hi, -1))
        return tuple(out)


@dataclass(frozen=True)
class Schedule:
    groups: tuple[str, ...]
    trainers: tuple[int, ...]
    consumers: tuple[int, ...]
    nbytes: Mapping[int, tuple[int, ...]]  # consumer -> end of its last segment, per group
    pieces: Mapping[tuple[int, int], tuple[Piece, ...]]  # (consumer, group index) -> pieces in byte order

    def of(self, consumer: int, group_index: int, trainer: int | None = None) -> tuple[Piece, ...]:
        pieces = self.pieces.get((consumer, group_index), ())
        return pieces if trainer is None else tuple(p for p in pieces if p.trainer == trainer)

    def bytes_by_trainer(self) -> dict[int, int]:
        out = {t: 0 for t in self.trainers}
        for pieces in self.pieces.values():
            for p in pieces:
                out[p.trainer] += p.hi - p.lo
        return out

    def to_json(self) -> str:
        return json.dumps(
            {
                "groups": list(self.groups),
                "trainers": list(self.trainers),
                "consumers": list(self.consumers),
                "nbytes": {str(c): list(n) for c, n in self.nbytes.items()},
                "pieces": [
                    [c, g, p.trainer, p.lo, p.hi, list(p.segments)]
                    + ([[list(d) for d in p.direct]] if p.direct else [])
                    for (c, g), ps in sorted(self.pieces.items())
                    for p in ps
                ],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        d = json.loads(text)
        pieces: dict[tuple[int, int], list[Piece]] = {}
        for c, g, t, lo, hi, segs, *direct in d["pieces"]:
            sent = tuple(tuple(x) for x in direct[0]) if direct else ()
            pieces.setdefault((c, g), []).append(Piece(t, lo, hi, tuple(segs), sent))
        return cls(
            tuple(d["groups"]),
            tuple(d["trainers"]),
            tuple(d["consumers"]),
            {int(c): tuple(n) for c, n in d["nbytes"].items()},
            {k: tuple(v) for k, v in pieces.items()},
        )


def build_schedule(
    spans: Mapping[int, Mapping[str, Sequence[Span]]],
    groups: Sequence[str],
    held: Mapping[int, frozenset[str] | None],
    trainers: Sequence[int],
    consumers: Sequence[int],
) -> Schedule:
    """Which trainer serves which bytes of which consumer, per group; computed once per membership.

    `held[t]`: the tensors trainer t holds whole (None: all of them). Per group: each consumer's segments are cut into
    runs with the same set of eligible trainers, each run into ceil(#trainers / #consumers) chunks of about equal
    bytes (so more trainers than consumers still all work), and the chunks go largest-first to the eligible trainer
    with the least bytes in this group (then overall): balanced per pipeline step and contiguous per consumer.
    """
    if not trainers:
        raise ScheduleError("no live trainer rank: nothing can serve the sync")
    trainers, consumers = tuple(sorted(trainers)), tuple(sorted(consumers))
    chunks_per_run = max(1, math.ceil(len(trainers) / max(len(consumers), 1)))
    eligible_for = _eligibility(held, trainers)
    total = {t: 0 for t in trainers}
    nbytes: dict[int, list[int]] = {c: [] for c in consumers}
    pieces: dict[tuple[int, int], tuple[Piece, ...]] = {}
    for gi, group in enumerate(groups):
        chunks: list[tuple[int, list[int], int, tuple[int, ...]]] = []  # (consumer, segment indices, bytes, eligible)
        for c in consumers:
            segs = list(spans[c].get(group, ()))
            nbytes[c].append(max((s.offset + s.nbytes for s in segs), default=0))
            run: list[int] = []
            run_eligible: tuple[int, ...] = ()
            for i, seg in enumerate(segs):
                if seg.nbytes == 0:
                    continue
                if seg.only:
                    eligible = tuple(t for t in trainers if t in seg.only)
                else:
                    eligible = eligible_for(seg.sources)
                if not eligible:
                    if seg.only:
                        raise ScheduleError(
                            f"{consumer_name(c)}, group {group}: bytes at {seg.offset} come only from "
                            f"trainer {list(seg.only)}, which is not live; re-plan the shards "
                            f"(shardplan.runtime.shards.plan_shards) without it"
                        )
                    missing = sorted(
                        n for n in seg.sources if not any(held[t] is None or n in held[t] for t in trainers)
                    )
                    raise ScheduleError(
                        f"{consumer_name(c)}, group {group}: no live trainer holds {missing} whole "
                        f"(live trainers: {list(trainers)}); restore the trainer that holds them, or "
                        f"have the WeightSource gather them"
                    )
                if run and eligible != run_eligible:
                    chunks += _split_run(c, run, segs, run_eligible, chunks_per_run)
                    run = []
                run.append(i)
                run_eligible = eligible
            if run:
                chunks += _split_run(c, run, segs, run_eligible, chunks_per_run)
        load = {t: 0 for t in trainers}
        owner: dict[tuple[int, int], int] = {}  # (consumer, first segment of chunk) -> trainer
        for c, idx, size, eligible in sorted(chunks, key=lambda ch: (-ch[2], ch[0], ch[1][0])):
            t = min(eligible, key=lambda t: (load[t], total[t], t))
            load[t] += size
            total[t] += size
            owner[(c, idx[0])] = t
        for c in consumers:
            segs = list(spans[c].get(group, ()))
            mine = sorted((ch for ch in chunks if ch[0] == c), key=lambda ch: ch[1][0])
            merged: list[Piece] = []
            for _, idx, _, _ in mine:
                t = owner[(c, idx[0])]
                lo, hi = segs[idx[0]].offset, segs[idx[-1]].offset + segs[idx[-1]].nbytes
                direct = tuple((i, segs[i].offset, segs[i].offset + segs[i].nbytes) for i in idx if segs[i].direct)
                if (
                    merged
                    and merged[-1].trainer == t
                    and merged[-1].segments[-1] + 1 == idx[0]
                    and all(segs[j].nbytes == 0 for j in range(merged[-1].segments[-1] + 1, idx[0]))
                ):
                    prev = merged.pop()
                    merged.append(Piece(t, prev.lo, hi, prev.segments + tuple(idx), prev.direct + direct))
                else:
                    merged.append(Piece(t, lo, hi, tuple(idx), direct))
            if merged:
                pieces[(c, gi)] = tuple(merged)
    return Schedule(tuple(groups), trainers, consumers, {c: tuple(n) for c, n in nbytes.items()}, pieces)


def _split_run(c: int, run: list[int], segs: list[Span], eligible: tuple[int, ...], parts: int):
    parts = min(parts, len(eligible), len(run))
    size = sum(segs[i].nbytes for i in run)
    out, cur, acc, cut = [], [], 0, 1
    for i in run:
        cur.append(i)
        acc += segs[i].nbytes
        if cut < parts and acc >= size * cut / parts:
            out.append((c, cur, sum(segs[j].nbytes for j in cur), eligible))
            cur, cut = [], cut + 1
    if cur:
        out.append((c, cur, sum(segs[j].nbytes for j in cur), eligible))
    return out


def _eligibility(held: Mapping[int, frozenset[str] | None], trainers: tuple[int, ...]):
    """sources -> the trainers holding all of them whole. Each tensor's holders are a bit mask (trainer i: bit i), found
    once (checking every trainer's set per segment took most of a schedule of 100k segments whose trainers hold
    subsets)."""
    everyone = sum(1 << i for i, t in enumerate(trainers) if held[t] is None)
    holders: dict[str, int] = {}
    for i, t in enumerate(trainers):
        for n in held[t] or ():
            holders[n] = holders.get(n, 0) | 1 << i
    of_mask: dict[int, tuple[int, ...]] = {}

    def eligible_for(sources: tuple[str, ...]) -> tuple[int, ...]:
        mask = (1 << len(trainers)) - 1
        for n in sources:
            mask &= holders.get(n, 0)
        mask |= everyone
        out = of_mask.get(mask)
        if out is None:
            out = of_mask[mask] = tuple(t for i, t in enumerate(trainers) if mask >> i & 1)
        return out

    return eligible_for


def held_whole(source: WeightSource, needed: set[str]) -> frozenset[str] | None:
    """Names of needed tensors the source holds whole; None when it holds all of them (saves publishing the list)."""
    meta, boxes = source.metadata(), source.boxes()
    whole = {n for n, box in boxes.items() if n in meta and tuple(box) == tuple((0, s) for s in meta[n].shape)}
    return None if needed <= whole else frozenset(whole & needed)


CHECKSUM = "rowcol-fmix64"
"""Name of the checksum below, carried in every join stamp (control.PROTOCOL): peers that compute another one are
refused by name before any byte moves, rather than failing every piece as a checksum mismatch."""

_ROW = 256  # int64 words per row of the matrices the checksum reduces (2 KiB)
_LAST = 4096  # words (32 KiB) mixed one by one: a view this small is not reduced at all
_BLOCK = 256  # rows (512 KiB) the column pass reduces at a time, in cache: one op over all blocks (a 3-D view)
_COPY_ROWS = (64 << 20) // (8 * _ROW)  # a view not 8-byte aligned goes through aligned scratch this much at a time
_U64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """The int64 with the same 64 bits as x (mod 2**64)."""
    x &= _U64
    return x - (1 << 64) if x >> 63 else x


_KEY = _i64(0x9E3779B97F4A7C15)  # term i (from 0) is keyed by (i + 1) * _KEY before it is mixed
_M1, _M2 = _i64(0xFF51AFD7ED558CCD), _i64(0xC4CEB9FE1A85EC53)  # fmix64's
_CPU_KEYS = torch.arange(1, 2 * _LAST + 1, dtype=torch.int64) * _KEY  # more than 16 levels' columns + _LAST words


def _mix_(z: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 64-bit finalizer (fmix64, its shifts 32 rather than 33), in place on contiguous int64 words: a
    bijection of 64-bit words in which every input bit reaches every output bit. Products wrap; the logical shift by
    32 is each word's high half xored into its low half (an int32 view, little-endian), one op."""
    halves = z.view(torch.int32)
    low, high = halves[0::2], halves[1::2]
    low ^= high
    z *= _M1
    low ^= high
    z *= _M2
    low ^= high
    return z


def _mix_int(x: int) -> int:
    """_mix_ of one Python int, as a Python int in int64 range."""
    x &= _U64
    x ^= x >> 32
    x = x * (_M1 & _U64) & _U64
    x ^= x >> 32
    x = x * (_M2 & _U64) & _U64
    return _i64(x ^ x >> 32)


def _levels(n: int) -> tuple[list[tuple[int, int]], int]:
    """(full rows, words of the partial last row) of each level the checksum of n bytes reduces, and the number of
    words left after the last (at most _LAST)."""
    full, rest = divmod(n, 8 * _ROW)
    words, levels = -(-n // 8), []
    while words > _LAST:
        levels.append((full, -(-rest // 8)))
        words = full + (rest > 0)
        full, rest = divmod(words, _ROW)
        rest *= 8  # in bytes, as at the first level
    return levels, words


def _rows(words: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows [a, b) of flat int64 words, _ROW to a row."""
    return words[a * _ROW : b * _ROW].view(b - a, _ROW)


def _columns(rows: torch.Tensor) -> torch.Tensor:
    """Column sums of a (k, _ROW) int64 matrix: per block of _BLOCK rows, then of the blocks' sums. One op over all
    blocks, not a loop over cache-sized chunks: each op is a parallel region, and on a busy CPU every region waits
    for its slowest thread."""
    whole = rows.shape[0] // _BLOCK * _BLOCK
    if not whole:
        return rows.sum(0)
    out = rows[:whole].view(-1, _BLOCK, _ROW).sum(1).sum(0)
    return out + rows[whole:].sum(0) if whole < rows.shape[0] else out


def checksum(view: torch.Tensor) -> int:
    """The checksum of a 1-D uint8 view's bytes (checksum_tensor), as an int."""
    return int(checksum_tensor(view))


def checksum_tensor(view: torch.Tensor) -> torch.Tensor:
    """Checksum of a 1-D uint8 view's bytes, as a 0-d int64 tensor on its device: enqueued, not waited for (the
    two-sided pipeline reads it once the transfer it guards has finished). Both sides of the sync compute it on every
    piece (CHECKSUM names it).

    The bytes are read as little-endian int64 words (the last zero-padded). While there are more than _LAST words,
    they fill the rows of a matrix _ROW words wide (the last row zero-padded); its column sums (wrapping) are kept, and
    its row sums are the words of the next level (1/_ROW as many). Row and column sums change, exactly, for any change
    of one or two words: a changed word, two words swapped, +x in one word and -x in another change the sums of the
    rows or columns that hold them. The terms (each level's column sums, then the words left) are each keyed by their
    position, put through a 64-bit bijection (_mix_) and summed, with the mixed byte count: so a change the sums show
    is missed only if the mixed terms happen to cancel (about 2**-64). Views of at most _LAST words (32 KiB) are mixed
    word by word. An index-weighted sum, by contrast, misses two swapped words that differ in the top bit only (a bf16
    sign) at an even distance, and row + column weights miss any swap along an anti-diagonal. What reduction cannot
    see is a change that keeps every row and column sum: +x, -x, -x, +x at the corners of a rectangle of words.

    Integer sums wrap, so the result is a function of the bytes alone, whatever the summation order (CPU threads, GPU
    blocks) and the view's alignment (a view not 8-byte aligned is read through aligned scratch, in chunks). int64
    words because torch reduces them at memory speed (int32 words summed into int64 go through a casting reduction
    ~20x slower on CPU). Cost: two passes over the bytes, row sums and column sums (docs/transports.md gives the
    figures)."""
    n, device = view.numel(), view.device
    levels, left = _levels(n)
    cols = len(levels) * _ROW  # the terms: every level's column sums, then the words left
    terms = torch.zeros(cols + left, dtype=torch.int64, device=device)
    if not levels:
        terms.view(torch.uint8)[:n].copy_(view)
    else:
        full, rest = levels[0]
        cut = full * _ROW * 8
        last = torch.zeros(rest, dtype=torch.int64, device=device) if rest else terms[:0]  # the partial row, padded
        if rest:
            last.view(torch.uint8)[: n - cut].copy_(view[cut:])
        chunk = full
        if view.data_ptr() % 8 == 0 and view.storage_offset() % 8 == 0:
            rows_of = partial(_rows, view[:cut].view(torch.int64))
        else:
            chunk = min(chunk, _COPY_ROWS)
            scratch = torch.empty(min(chunk, full) * _ROW, dtype=torch.int64, device=device)

            def rows_of(a: int, b: int) -> torch.Tensor:
                scratch.view(torch.uint8)[: (b - a) * _ROW * 8].copy_(view[a * _ROW * 8 : b * _ROW * 8])
                return _rows(scratch, 0, b - a)

        for i, (full, rest) in enumerate(levels):
            final = i + 1 == len(levels)
            sums = terms[cols:] if final else torch.empty(full + (rest > 0), dtype=torch.int64, device=device)
            col = terms[i * _ROW : (i + 1) * _ROW]
            for a in range(0, full, chunk):
                part = rows_of(a, min(a + chunk, full))
                torch.sum(part, 1, out=sums[a : a + part.shape[0]])
                col += _columns(part)
            if rest:
                sums[full] = last.sum()
                col[:rest] += last
            if not final:
                full = levels[i + 1][0]
                rows_of, last, chunk = partial(_rows, sums), sums[full * _ROW :], max(full, 1)
    if device.type == "cpu":
        terms += _CPU_KEYS[: terms.numel()]
    else:  # made there: a copy from pageable host memory may wait for the work the stream holds
        terms += torch.arange(1, terms.numel() + 1, dtype=torch.int64, device=device) * _KEY
    return _mix_(terms).sum() + _mix_int(n)
