"""Plan files: msgpack, canonical, validated once on load. The byte layout is specified in docs/plan-format.md.

    offset  size  field
    0       8     magic b"SHRDPLAN"
    8       4     format version, uint32 little-endian
    12      8     header length H, uint64 little-endian
    20      H     header: msgpack map (see HEADER_FIELDS)
    20+H    8     body length B, uint64 little-endian
    28+H    B     body: msgpack array (see _encode_body)
    28+H+B        end of file: nothing may follow

Nothing in a plan is executable: op names are checked against `ir.ALLOWED_OPS`, and there is no pickle anywhere.
"""
from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np

from shardplan import __version__
from shardplan.plan import ir
from shardplan.plan.compile import Group, PlanBody, SourceTable, instantiate
from shardplan.plan.template import flatten_write, pure_view_form, unflatten_write
from shardplan.errors import ShardplanError
from shardplan.plan.layout import Layout

MAGIC = b"SHRDPLAN"
FORMAT_VERSION = 1
HEADER_FIELDS = ("format_version", "shardplan_version", "vllm_version", "model", "architecture", "config_sha256",
                 "layout", "dtype", "ranks", "body_nbytes", "body_sha256")


class PlanFileError(ShardplanError):
    """Base of every plan-file error; the message names the file and says how to re-record."""


class PlanTruncated(PlanFileError):
    pass


class PlanChecksumError(PlanFileError):
    pass


class PlanFormatVersionError(PlanFileError):
    pass


class PlanCorrupt(PlanFileError):
    pass


class PlanOpNotAllowed(PlanFileError):
    pass


class PlanBoundsError(PlanFileError):
    pass


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
    body_nbytes: int
    body_sha256: str

    def to_dict(self) -> dict:
        return {"format_version": self.format_version, "shardplan_version": self.shardplan_version,
                "vllm_version": self.vllm_version, "model": self.model, "architecture": self.architecture,
                "config_sha256": self.config_sha256, "layout": self.layout.to_dict(), "dtype": self.dtype,
                "ranks": list(self.ranks), "body_nbytes": self.body_nbytes, "body_sha256": self.body_sha256}


# ---- body encoding ---------------------------------------------------------------------------------------
def _encode_body(body: PlanBody) -> list:
    param_index = {name: i for i, name in enumerate(body.params)}
    groups = sorted(body.groups, key=lambda g: (repr(g.skeleton), repr(g.index)))
    return [
        [[text, list(shape), dtype, index] for text, shape, dtype, index in body.sources.templates],
        [[m.name, list(m.shape), m.dtype] for m in body.params.values()],
        [[r, [param_index[n] for n in body.rank_params[r]]] for r in sorted(body.rank_params)],
        [[g.skeleton, list(g.coeffs.shape), g.coeffs.reshape(-1).tolist(), g.index, g.num_vars] for g in groups],
        [[r, [list(flatten_write(w)[:2]) for w in body.ordered[r]]] for r in sorted(body.ordered)],
        [[r, [[f.source, f.op, f.reason, f.loader] for f in body.fallbacks[r]]] for r in sorted(body.fallbacks)],
        # not-needed names are derived on load (sources - read - fallbacks): storing them would dwarf the plan
        [],
    ]


def _decode_body(raw, path: str) -> PlanBody:
    try:
        sources_raw, params_raw, rank_params_raw, groups_raw, ordered_raw, fallbacks_raw, _ = raw
        sources = SourceTable([(t, tuple(s), d, i) for t, s, d, i in sources_raw])
        params = {n: ir.TensorMeta(n, tuple(s), d) for n, s, d in params_raw}
        param_names = list(params)
        rank_params = {int(r): tuple(param_names[i] for i in idx) for r, idx in rank_params_raw}
        groups = []
        for skeleton, shape, flat, index, num_vars in groups_raw:
            coeffs = np.asarray(flat, dtype=np.int64).reshape(tuple(shape))
            groups.append(Group(skeleton, coeffs, index, int(num_vars)))
        ordered = {int(r): [unflatten_write(skel, holes) for skel, holes in ws] for r, ws in ordered_raw}
        fallbacks = {int(r): [ir.Fallback(*f) for f in fs] for r, fs in fallbacks_raw}
    except (ValueError, TypeError, IndexError, KeyError, AttributeError) as e:
        raise PlanCorrupt(f"{path}: the plan body does not have the documented structure ({type(e).__name__}: {e}). "
                          f"Re-record it with `shardplan record`.") from None
    return PlanBody(ranks=tuple(sorted(rank_params)), sources=sources, params=params, rank_params=rank_params,
                    groups=groups, ordered=ordered, fallbacks=fallbacks, not_needed={})


# ---- write ------------------------------------------------------------------------------------------------
def encode(body: PlanBody, *, model: str, architecture: str, config_sha256: str, layout: Layout, dtype: str,
           vllm_version: str) -> bytes:
    body_bytes = msgpack.packb(_encode_body(body), use_bin_type=True)
    header = PlanHeader(FORMAT_VERSION, __version__, vllm_version, model, architecture, config_sha256, layout, dtype,
                        tuple(body.ranks), len(body_bytes), hashlib.sha256(body_bytes).hexdigest())
    header_bytes = msgpack.packb(header.to_dict(), use_bin_type=True)
    return b"".join([MAGIC, struct.pack("<I", FORMAT_VERSION), struct.pack("<Q", len(header_bytes)), header_bytes,
                     struct.pack("<Q", len(body_bytes)), body_bytes])


def write_plan(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # a reader never sees a half-written plan


# ---- read -------------------------------------------------------------------------------------------------
def _advice(path) -> str:
    return f"Re-record it: `shardplan record ...` (the command is in docs/plans.md), or delete {path}."


def read_header(data: bytes, path: str) -> tuple[PlanHeader, int]:
    if len(data) < 20:
        raise PlanTruncated(f"{path}: truncated plan file ({len(data)} bytes, shorter than the 20-byte preamble). "
                            + _advice(path))
    if data[:8] != MAGIC:
        raise PlanCorrupt(f"{path}: not a shardplan plan file (magic {data[:8]!r}, expected {MAGIC!r}). "
                          + _advice(path))
    (version,) = struct.unpack_from("<I", data, 8)
    if version != FORMAT_VERSION:
        raise PlanFormatVersionError(f"{path}: plan format version {version}; this shardplan {__version__} reads "
                                     f"version {FORMAT_VERSION}. " + _advice(path))
    (header_len,) = struct.unpack_from("<Q", data, 12)
    if 20 + header_len + 8 > len(data):
        raise PlanTruncated(f"{path}: truncated plan file: header says {header_len} bytes, file has "
                            f"{len(data) - 20} after the preamble. " + _advice(path))
    try:
        raw = msgpack.unpackb(data[20:20 + header_len], raw=False, strict_map_key=True)
        header = PlanHeader(**{k: raw[k] for k in HEADER_FIELDS if k != "layout"},
                            layout=Layout.from_dict(raw["layout"]))
        header = PlanHeader(**{**header.__dict__, "ranks": tuple(header.ranks)})
    except Exception as e:
        raise PlanCorrupt(f"{path}: the plan header is not a valid msgpack map with fields {HEADER_FIELDS} "
                          f"({type(e).__name__}: {e}). " + _advice(path)) from None
    if header.format_version != version:
        raise PlanCorrupt(f"{path}: header format_version {header.format_version} disagrees with the preamble's "
                          f"{version}. " + _advice(path))
    return header, 20 + header_len


def decode(data: bytes, path: str = "<bytes>") -> tuple[PlanHeader, PlanBody]:
    header, pos = read_header(data, path)
    (body_len,) = struct.unpack_from("<Q", data, pos)
    pos += 8
    if pos + body_len > len(data):
        raise PlanTruncated(f"{path}: truncated plan file: body should be {body_len} bytes, only "
                            f"{len(data) - pos} present. " + _advice(path))
    if pos + body_len != len(data):
        raise PlanCorrupt(f"{path}: {len(data) - pos - body_len} unexpected bytes after the body. " + _advice(path))
    body_bytes = data[pos:pos + body_len]
    if body_len != header.body_nbytes or hashlib.sha256(body_bytes).hexdigest() != header.body_sha256:
        raise PlanChecksumError(f"{path}: body checksum mismatch (sha256 in the header does not match the body): "
                                f"the file is corrupt. " + _advice(path))
    try:
        raw = msgpack.unpackb(body_bytes, raw=False, use_list=False, strict_map_key=True)
    except Exception as e:
        raise PlanCorrupt(f"{path}: the plan body is not valid msgpack ({e}). " + _advice(path)) from None
    body = _decode_body(raw, path)
    _check_ops(body, path)
    if tuple(body.ranks) != tuple(header.ranks):
        raise PlanCorrupt(f"{path}: header covers ranks {list(header.ranks)} but the body holds "
                          f"{list(body.ranks)}. " + _advice(path))
    return header, body


def skeleton_ops(node, out: set[str]) -> None:
    if isinstance(node, tuple):
        if len(node) >= 6 and node[0] == "C" and isinstance(node[1], str):
            out.add(node[1])
        for child in node:
            skeleton_ops(child, out)


def _check_ops(body: PlanBody, path: str) -> None:
    ops: set[str] = set()
    for g in body.groups:
        skeleton_ops(g.skeleton, ops)
    for writes in body.ordered.values():
        for w in writes:
            ops.update(ir.literal_ops(w.src.leaf))
    bad = sorted(ops - ir.ALLOWED_OPS)
    if bad:
        raise PlanOpNotAllowed(f"{path}: the plan names ops outside shardplan's allowlist: {bad}. A plan can only "
                               f"name allowlisted ops; this one is corrupt or hostile. " + _advice(path))


def check_bounds(plan: ir.RankPlan, sources, path: str, only_generic: bool = False) -> None:
    """Every destination box inside its parameter and every source view inside its checkpoint tensor."""
    params = {p.name: p for p in plan.params}
    for w in plan.writes:
        if only_generic and ir.is_pure_view(w):
            continue  # already checked, vectorised, per template
        param = params.get(w.param)
        if param is None:
            raise PlanBoundsError(f"{path}: rank {plan.rank} writes to {w.param}, which the plan does not declare. "
                                  + _advice(path))
        _inside(w.dst, param, f"destination {w.param}", plan.rank, path)
        _check_view_bounds(w.src, sources, plan.rank, path)


def _check_view_bounds(view: ir.View, sources, rank, path) -> None:
    leaf = view.leaf
    if isinstance(leaf, ir.Source):
        meta = _lookup(sources, leaf.name)
        if meta is None:
            raise PlanBoundsError(f"{path}: rank {rank} reads {leaf.name}, which is not a checkpoint tensor of this "
                                  f"plan. " + _advice(path))
        _inside(view.region, meta, f"source {leaf.name}", rank, path)
    elif isinstance(leaf, ir.Call):
        for v in leaf.inputs:
            _check_view_bounds(v, sources, rank, path)
    elif isinstance(leaf, ir.Update):
        _check_view_bounds(leaf.value, sources, rank, path)


def _inside(region: ir.Region, meta: ir.TensorMeta, what: str, rank: int, path: str) -> None:
    lo, hi = region.extent()
    if lo < 0 or hi > meta.numel or len(region.sizes) != len(region.strides):
        raise PlanBoundsError(f"{path}: rank {rank}: box {region} lies outside {what} of shape {list(meta.shape)} "
                              f"({meta.numel} elements). " + _advice(path))


class PlanFile:
    """A decoded plan file: header + templated body; `rank(r)` instantiates and bounds-checks one rank (cached)."""

    def __init__(self, header: PlanHeader, body: PlanBody, path: str = "<bytes>"):
        self.header, self.body, self.path = header, body, path
        self._cache: dict[int, ir.RankPlan] = {}

    @classmethod
    def read(cls, path: str | os.PathLike) -> "PlanFile":
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise PlanFileError(f"cannot read plan file {path}: {e.strerror}") from None
        header, body = decode(data, str(path))
        return cls(header, body, str(path))

    @property
    def sources(self) -> dict[str, ir.TensorMeta]:
        return self.body.sources

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.body.ranks

    def rank(self, rank: int) -> ir.RankPlan:
        """The rank's writes, bounds-checked (vectorised per template). `not_needed` is left empty here: ask
        `not_needed(rank)`, which materialises every checkpoint name."""
        if rank not in self._cache:
            if rank not in self.body.rank_params:
                raise PlanFileError(f"{self.path}: no plan for rank {rank}; this file covers ranks "
                                    f"{list(self.body.ranks)} of layout {self.header.layout.tag()}.")
            checked: list[bool] = []

            def check(group, holes):
                checked.append(_check_group_bounds(group, holes, self.body, rank, self.path))
            plan = instantiate(self.body, rank, check)
            # writes of non-view templates and ordered writes were not covered by the vectorised check
            if not all(checked) or plan.writes and self.body.ordered.get(rank):
                check_bounds(plan, self.body.sources, self.path, only_generic=all(checked))
            self._cache[rank] = plan
        return self._cache[rank]

    def not_needed(self, rank: int) -> tuple[str, ...]:
        plan = self.rank(rank)
        read = plan.sources_read()
        fallback_names = {f.source for f in plan.fallbacks}
        return tuple(n for n in self.body.sources if n not in read and n not in fallback_names)


def _check_group_bounds(group, holes, body: PlanBody, rank: int, path: str) -> bool:
    """Vectorised bounds check of a pure-view template's writes; False when the template is not a pure view."""

    layout = pure_view_form(group.skeleton)
    if layout is None:
        return False
    if len(holes) == 0:
        return True
    ptext, kp, nd, stext, ks, ns = layout

    def check(first: int, ndim: int, name_cols: slice, text: str, table, what: str):
        names_ix, inverse = np.unique(holes[:, name_cols], axis=0, return_inverse=True)
        numels = []
        by_text = getattr(table, "_by_text", {}).get(text, ())
        for row in names_ix.tolist():
            name = text.format(*row)
            if len(by_text) == 1:  # one shape for every tensor of this template: no per-name lookup needed
                shape, dtype, _ = by_text[0]
                meta = ir.TensorMeta(name, shape, dtype)
            else:
                meta = table.get(name) if isinstance(table, dict) else _lookup(table, name)
            if meta is None:
                raise PlanBoundsError(f"{path}: rank {rank}: {what} {name} is not declared in the plan. "
                                      + _advice(path))
            numels.append(meta.numel)
        numel = np.asarray(numels, dtype=np.int64)[inverse.reshape(-1)]
        offset = holes[:, first]
        sizes = holes[:, first + 1:first + 1 + ndim]
        strides = holes[:, first + 1 + ndim:first + 1 + 2 * ndim]
        span = (sizes - 1) * strides
        lo = offset + np.where(span < 0, span, 0).sum(axis=1)
        hi = offset + np.where(span > 0, span, 0).sum(axis=1) + 1
        empty = (sizes == 0).any(axis=1)
        bad = ~empty & ((lo < 0) | (hi > numel))
        if bad.any():
            i = int(np.nonzero(bad)[0][0])
            name = text.format(*holes[i, name_cols].tolist())
            raise PlanBoundsError(f"{path}: rank {rank}: box (offset {int(offset[i])}, sizes "
                                  f"{sizes[i].tolist()}, strides {strides[i].tolist()}) lies outside {what} {name} "
                                  f"({int(numel[i])} elements). " + _advice(path))
    check(kp, nd, slice(0, kp), ptext, body.params, "destination")
    first_src = kp + 1 + 2 * nd
    check(first_src + ks, ns, slice(first_src, first_src + ks), stext, body.sources, "source")
    return True


def _lookup(table, name):
    try:
        return table[name]
    except KeyError:
        return None
