"""Plan files: msgpack, canonical, sealed by one checksum, validated once on load (docs/plan-format.md).

    offset   size  field
    0        8     magic b"SHRDPLAN"
    8        4     format version, uint32 little-endian
    12       8     header length H, uint64 little-endian
    20       8     body length B, uint64 little-endian
    28       H     header: msgpack map (see plancheck.HEADER_FIELDS)
    28+H     B     body: msgpack array (see _encode_body)
    28+H+B   32    sha256 of every byte before it: the whole file, preamble and header included
    60+H+B         end of file: nothing may follow

The reader opens only regular files, reads exactly the declared bytes (never more: a FIFO or /dev/zero is refused
before a byte is read, a file larger than declared is refused before its body is read), checks the seal, then every
field (file/checks.py), and accepts only the canonical encoding of what it decoded: what is loaded is exactly what the
bytes say. Nothing in a plan is executable: op names are checked against `ir.ALLOWED_OPS`; there is no pickle.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np

from shardplan import __version__
from shardplan.plan import ir
from shardplan.plan.body import Group, PlanBody, SourceTable, split_metas
from shardplan.plan.columns import LazyWrites
from shardplan.plan.file.checks import (  # noqa: F401
    HEADER_FIELDS,
    MAX_BODY_BYTES,
    MAX_HEADER_BYTES,
    Checker,
    check_body,
    check_header,
)
from shardplan.plan.file.engines import EngineInfo
from shardplan.plan.file.errors import (  # noqa: F401
    PlanBoundsError,
    PlanChecksumError,
    PlanCorrupt,
    PlanFieldError,
    PlanFileError,
    PlanFormatVersionError,
    PlanLimitError,
    PlanNotCanonical,
    PlanOpNotAllowed,
    PlanOversize,
    PlanRankNotCovered,
    PlanTruncated,
    PlanUnreadable,
    PlanWriteError,
    advice,
)
from shardplan.plan.file.rank import rank_columns
from shardplan.plan.layout import Layout
from shardplan.plan.placement import EplbSlots
from shardplan.plan.template import flatten_write, unflatten_write

MAGIC = b"SHRDPLAN"
FORMAT_VERSION = 2
PREAMBLE_BYTES = 28
CHECKSUM_BYTES = 32


@dataclass(frozen=True)
class PlanHeader:
    format_version: int
    shardplan_version: str
    vllm_version: str
    model: str
    architecture: str
    config_sha256: str
    layout: Layout
    dtype: str
    ranks: tuple[int, ...]
    num_writes: tuple[int, ...]  # per rank, aligned with `ranks`
    num_sources: int
    # what the consumer's bytes are made with when the trainer transforms its tensors: "" (copied as recorded), or a
    # quantizer id such as "fp8-e4m3-block-amax448-v1/128x128" (runtime/quantize.py); written only when not empty
    quantizer: str = ""
    # the EPLB expert slots the plan was recorded with (plan/placement.py); written only for EPLB plans
    eplb: EplbSlots | None = None
    # the recording ran code from the model's own directory (record --trust-remote-code); written only when true
    trust_remote_code: bool = False
    # the engine whose loaders were recorded, when not vLLM (plan/file/engines.py); written only then
    engine: EngineInfo | None = None

    def to_dict(self) -> dict:
        extra = {"quantizer": self.quantizer} if self.quantizer else {}
        if self.eplb is not None:
            extra["eplb"] = self.eplb.to_dict()
        if self.trust_remote_code:
            extra["trust_remote_code"] = True
        if self.engine is not None:
            extra["engine"] = self.engine.to_dict()
        return {
            "format_version": self.format_version,
            "shardplan_version": self.shardplan_version,
            "vllm_version": self.vllm_version,
            "model": self.model,
            "architecture": self.architecture,
            "config_sha256": self.config_sha256,
            "layout": self.layout.to_dict(),
            "dtype": self.dtype,
            "ranks": list(self.ranks),
            "num_writes": list(self.num_writes),
            "num_sources": self.num_sources,
            **extra,
        }


def _checker(path: str) -> Checker:
    return Checker(path, PlanFieldError, PlanLimitError, PlanOpNotAllowed)


# ---- body encoding ---------------------------------------------------------------------------------------
def _encode_body(body: PlanBody) -> list:
    # one entry per distinct (name, shape, dtype): a name has two only where ranks declare it differently
    entries = sorted(
        {(m.name, m.shape, m.dtype) for m in body.params.values()}
        | {(m.name, m.shape, m.dtype) for o in body.rank_metas.values() for m in o.values()}
    )
    entry_index = {e: i for i, e in enumerate(entries)}
    param_index = {m.name: entry_index[(m.name, m.shape, m.dtype)] for m in body.params.values()}

    def indices(rank: int) -> list[int]:
        names = body.rank_params[rank]
        out = list(map(param_index.__getitem__, names))  # C-level: a DP256 layout lists ~220k params
        override = body.rank_metas.get(rank)
        if override:  # the names this rank declares differently (few: found by a C-level search each)
            at = dict(zip(names, range(len(names)))) if len(override) > 8 else None
            for n, m in override.items():
                j = at.get(n) if at is not None else names.index(n) if n in names else None
                if j is not None:
                    out[j] = entry_index[(m.name, m.shape, m.dtype)]
        return out

    groups = sorted(body.groups, key=lambda g: (repr(g.skeleton), repr(g.index)))
    return [
        [[text, list(shape), dtype, index] for text, shape, dtype, index in body.sources.templates],
        [[name, list(shape), dtype] for name, shape, dtype in entries],
        [[r, indices(r)] for r in sorted(body.rank_params)],
        [[g.skeleton, list(g.coeffs.shape), g.coeffs.reshape(-1).tolist(), g.index, g.num_vars] for g in groups],
        [[r, [list(flatten_write(w)[:2]) for w in body.ordered[r]]] for r in sorted(body.ordered)],
        [[r, [[f.source, f.op, f.reason, f.loader] for f in body.fallbacks[r]]] for r in sorted(body.fallbacks)],
        # not-needed names are derived on load (sources - read - fallbacks): storing them would dwarf the plan
        [],
    ]


def _decode_body(raw, path: str) -> PlanBody:
    """Builds the body from raw values plancheck.check_body accepted (so nothing here can fail on types)."""
    sources_raw, params_raw, rank_params_raw, groups_raw, ordered_raw, fallbacks_raw, _ = raw
    sources = SourceTable([(t, tuple(s), d, i) for t, s, d, i in sources_raw])
    entries = [ir.TensorMeta(n, tuple(s), d) for n, s, d in params_raw]
    entry_names = [m.name for m in entries]
    rank_params = {r: tuple(map(entry_names.__getitem__, idx)) for r, idx in rank_params_raw}  # C-level maps
    if len(set(entry_names)) == len(entries):
        params, rank_metas = {m.name: m for m in entries}, {}
    else:  # a name declared differently by some ranks (plan-format.md): the one most ranks declare is the default
        shared: dict[tuple, list] = {}  # ranks with equal lists share one (split_metas counts it once)
        for _, idx in rank_params_raw:
            if idx not in shared:
                shared[idx] = list(map(entries.__getitem__, idx))
        params, rank_metas = split_metas({r: shared[idx] for r, idx in rank_params_raw})
        params = dict(sorted(params.items()))
    groups = [
        Group(skeleton, np.asarray(flat, dtype=np.int64).reshape(tuple(shape)), index, num_vars)
        for skeleton, shape, flat, index, num_vars in groups_raw
    ]
    ordered = {r: [unflatten_write(skel, holes) for skel, holes in ws] for r, ws in ordered_raw}
    fallbacks = {r: [ir.Fallback(*f) for f in fs] for r, fs in fallbacks_raw}
    for r, writes in ordered.items():
        for w in writes:
            if w.param not in rank_params[r] or w.dst.numel <= 0:
                raise PlanBoundsError(
                    f"{path}: rank {r} has an ordered write to {w.param} {w.dst}, which is not one "
                    f"of its params or is empty. " + advice(path)
                )
    for r, fs in fallbacks.items():
        for f in fs:
            if f.source not in sources:
                raise PlanBoundsError(
                    f"{path}: rank {r} has a fallback for {f.source}, which is not a checkpoint "
                    f"tensor of this plan. " + advice(path)
                )
    return PlanBody(
        ranks=tuple(rank_params),
        sources=sources,
        params=params,
        rank_params=rank_params,
        groups=groups,
        ordered=ordered,
        fallbacks=fallbacks,
        not_needed={},
        rank_metas=rank_metas,
    )


# ---- write ------------------------------------------------------------------------------------------------
def encode(
    body: PlanBody,
    *,
    model: str,
    architecture: str,
    config_sha256: str,
    layout: Layout,
    dtype: str,
    vllm_version: str,
    quantizer: str = "",
    eplb: EplbSlots | None = None,
    trust_remote_code: bool = False,
    engine: EngineInfo | None = None,
) -> bytes:
    """The canonical bytes of a plan. The result is decoded once before it is returned: the writer never produces a
    file its reader refuses."""
    body_bytes = msgpack.packb(_encode_body(body), use_bin_type=True)
    ranks = tuple(sorted(body.rank_params))
    header = PlanHeader(
        FORMAT_VERSION,
        __version__,
        vllm_version,
        model,
        architecture,
        config_sha256,
        layout,
        dtype,
        ranks,
        tuple(body.num_writes(r) for r in ranks),
        len(body.sources),
        quantizer,
        eplb,
        trust_remote_code,
        engine,
    )
    header_bytes = msgpack.packb(header.to_dict(), use_bin_type=True)
    sealed = b"".join(
        [MAGIC, struct.pack("<IQQ", FORMAT_VERSION, len(header_bytes), len(body_bytes)), header_bytes, body_bytes]
    )
    data = sealed + hashlib.sha256(sealed).digest()
    decode(data, "<plan being written>")
    return data


def write_plan(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, path)  # a reader never sees a half-written plan
    except OSError as e:
        raise PlanWriteError(
            f"cannot write the plan to {path}: {e.strerror or e}. Choose another --out directory (docs/recording.md)."
        ) from None


# ---- read -------------------------------------------------------------------------------------------------
def _declared_size(head: bytes, path: str, actual: int) -> tuple[int, int]:
    """From the preamble: (header length, body length), after checking magic, version, limits and the file size."""
    if len(head) >= 8 and head[:8] != MAGIC:
        raise PlanCorrupt(
            f"{path}: not a shardplan plan file (magic {head[:8]!r}, expected {MAGIC!r}). " + advice(path)
        )
    if len(head) < PREAMBLE_BYTES:
        raise PlanTruncated(
            f"{path}: truncated plan file ({actual} bytes, shorter than the {PREAMBLE_BYTES}-byte "
            f"preamble). " + advice(path)
        )
    version, header_len, body_len = struct.unpack_from("<IQQ", head, 8)
    if version != FORMAT_VERSION:
        raise PlanFormatVersionError(
            f"{path}: plan format version {version}; this shardplan {__version__} reads "
            f"version {FORMAT_VERSION}. " + advice(path)
        )
    if not 0 < header_len <= MAX_HEADER_BYTES or not 0 < body_len <= MAX_BODY_BYTES:
        raise PlanLimitError(
            f"{path}: the preamble declares a {header_len}-byte header and a {body_len}-byte body; "
            f"the limits are 1..{MAX_HEADER_BYTES} and 1..{MAX_BODY_BYTES}. " + advice(path)
        )
    total = PREAMBLE_BYTES + header_len + body_len + CHECKSUM_BYTES
    if actual < total:
        raise PlanTruncated(
            f"{path}: truncated plan file: {actual} bytes, the preamble declares {total} "
            f"({header_len}-byte header, {body_len}-byte body, checksum). " + advice(path)
        )
    if actual > total:
        raise PlanOversize(
            f"{path}: {actual - total} unexpected bytes after the {total} the preamble declares. " + advice(path)
        )
    return header_len, body_len


def _open_problem(path: str, e: OSError) -> str:
    if e.errno == errno.ENOENT and os.path.islink(path):
        return f"it is a dangling symlink (to {os.readlink(path)})"
    if e.errno == errno.ELOOP:
        return "it is a symlink loop"
    return e.strerror or str(e)


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def read_plan_bytes(path: str | os.PathLike) -> bytes:
    """Exactly the bytes of a plan file, read with a cap: the preamble first, then only what it declares."""
    path = os.fspath(path)
    try:  # O_NONBLOCK: opening a FIFO must not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise PlanUnreadable(f"cannot read plan file {path}: {_open_problem(path, e)}. " + advice(path)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
            raise PlanUnreadable(
                f"cannot read plan file {path}: it is {kind}; a plan is a regular file. " + advice(path)
            )
        head = _read_upto(fd, PREAMBLE_BYTES, path)
        header_len, body_len = _declared_size(head, path, st.st_size)
        data = head + _read_upto(fd, header_len + body_len + CHECKSUM_BYTES, path)
        if len(data) != st.st_size or _read_upto(fd, 1, path):
            raise PlanTruncated(f"{path}: the file changed size while it was read. " + advice(path))
        return data
    finally:
        os.close(fd)


def _read_upto(fd: int, n: int, path: str) -> bytes:
    chunks, left = [], n
    try:
        while left:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise PlanUnreadable(f"cannot read plan file {path}: {e.strerror or e}. " + advice(path)) from None
    return b"".join(chunks)


def _unpack(data: bytes, what: str, path: str):
    try:
        return msgpack.unpackb(data, raw=False, use_list=False, strict_map_key=True)
    except Exception as e:  # msgpack raises ValueError subclasses, UnicodeDecodeError, TypeError on bad keys
        raise PlanCorrupt(
            f"{path}: the plan {what} is not valid msgpack ({type(e).__name__}: {e}). " + advice(path)
        ) from None


def _sealed_header(data: bytes, path: str) -> tuple[PlanHeader, dict, int, int]:
    header_len, body_len = _declared_size(data[:PREAMBLE_BYTES], path, len(data))
    if hashlib.sha256(memoryview(data)[:-CHECKSUM_BYTES]).digest() != data[-CHECKSUM_BYTES:]:
        raise PlanChecksumError(
            f"{path}: checksum mismatch (the sha256 at the end of the file does not match the "
            f"bytes before it): the file is corrupt. " + advice(path)
        )
    raw = check_header(
        _unpack(data[PREAMBLE_BYTES : PREAMBLE_BYTES + header_len], "header", path),
        path,
        FORMAT_VERSION,
        _checker(path),
    )
    header = PlanHeader(
        **{
            **raw,
            "layout": Layout.from_dict(raw["layout"]),
            "ranks": tuple(raw["ranks"]),
            "num_writes": tuple(raw["num_writes"]),
            **({"eplb": EplbSlots.from_dict(raw["eplb"])} if "eplb" in raw else {}),
            **({"engine": EngineInfo.from_dict(raw["engine"])} if "engine" in raw else {}),
        }
    )
    return header, raw, header_len, body_len


def read_header(data: bytes, path: str = "<bytes>") -> PlanHeader:
    """The header of a whole plan file's bytes, after checking its size, seal and every header field."""
    return _sealed_header(data, path)[0]


def decode(data: bytes, path: str = "<bytes>") -> tuple[PlanHeader, PlanBody]:
    header, raw_header, header_len, body_len = _sealed_header(data, path)
    start = PREAMBLE_BYTES + header_len
    body_bytes = data[start : start + body_len]
    raw = _unpack(body_bytes, "body", path)
    check_body(raw, raw_header, _checker(path))
    try:
        body = _decode_body(raw, path)
        canonical = msgpack.packb(_encode_body(body), use_bin_type=True) == body_bytes
        canonical &= msgpack.packb(header.to_dict(), use_bin_type=True) == data[PREAMBLE_BYTES:start]
    except (ValueError, TypeError, IndexError, KeyError, AttributeError, OverflowError, RecursionError) as e:
        # checks.py should make this unreachable: the fuzz tests assert that it is
        raise PlanCorrupt(
            f"{path}: the plan body does not have the documented structure ({type(e).__name__}: {e}). " + advice(path)
        ) from None
    if not canonical:
        raise PlanNotCanonical(
            f"{path}: the header and body are valid but not in canonical form (docs/plan-format.md, "
            f"Canonical writing): it was not written by shardplan. " + advice(path)
        )
    return header, body


def skeleton_ops(node, out: set[str]) -> None:
    """Op names in a (validated, so shallow) skeleton: inspect's histogram."""
    if isinstance(node, tuple):
        if len(node) >= 6 and node[0] == "C" and isinstance(node[1], str):
            out.add(node[1])
        for child in node:
            skeleton_ops(child, out)


class PlanFile:
    """A decoded plan file: header + templated body; `rank(r)` instantiates and bounds-checks one rank (cached)."""

    def __init__(self, header: PlanHeader, body: PlanBody, path: str = "<bytes>", digest: str = ""):
        self.header, self.body, self.path = header, body, path
        self.digest = digest  # sha256 (hex) of the file: one value that identifies every byte of the plan
        self._cache: dict[int, ir.RankPlan] = {}

    @classmethod
    def read(cls, path: str | os.PathLike) -> "PlanFile":
        return cls.from_bytes(read_plan_bytes(path), str(path))

    @classmethod
    def from_bytes(cls, data: bytes, path: str = "<bytes>") -> "PlanFile":
        """The plan in `data` (a whole plan file's bytes, e.g. the ones whose header the store already checked)."""
        header, body = decode(data, path)
        return cls(header, body, path, data[-CHECKSUM_BYTES:].hex())

    @property
    def sources(self) -> dict[str, ir.TensorMeta]:
        return self.body.sources

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.body.ranks

    def check_rank(self, rank) -> None:
        if type(rank) is not int or rank not in self.body.rank_params:
            raise PlanRankNotCovered(
                f"{self.path}: no plan for rank {rank!r}; this file covers ranks "
                f"{list(self.body.ranks)} of layout {self.header.layout.tag()}. Record the "
                f"missing ranks with `shardplan record --ranks` (docs/recording.md)."
            )

    def rank(self, rank: int) -> ir.RankPlan:
        """The rank's writes, bounds-checked (vectorised), as columns (plan/columns.py): `plan.writes` is a
        `LazyWrites` that builds `ir.Write` objects only when indexed. `not_needed` is left empty here: ask
        `not_needed(rank)`, which materialises every checkpoint name."""
        if rank not in self._cache:
            self.check_rank(rank)
            columns = rank_columns(self.body, rank, self.path)
            self._cache[rank] = ir.RankPlan(
                rank=rank,
                params=tuple(self.body.meta(rank, n) for n in self.body.rank_params[rank]),
                writes=LazyWrites(columns),
                fallbacks=tuple(self.body.fallbacks.get(rank, ())),
            )
        return self._cache[rank]

    def not_needed(self, rank: int) -> tuple[str, ...]:
        plan = self.rank(rank)
        read = plan.sources_read()
        fallback_names = {f.source for f in plan.fallbacks}
        return tuple(n for n in self.body.sources if n not in read and n not in fallback_names)
