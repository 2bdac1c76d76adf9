"""Plan-file validation: every header and body field is type- and range-checked before anything is built from it.

The reader decodes msgpack into plain values, and this module checks them against the grammar of
docs/plan-format.md ("Validation"): exact types (a bool is not an int, a string is not a bool: nothing is coerced),
ranges (no negative index, no dtype outside a closed set), orderings the canonical writer guarantees, and limits that
keep loading linear in what the file declares: nesting depth, dims, variables, hole values, and the number of writes
and checkpoint names an index can expand to, counted from the tries without expanding them.

Every failure is a `PlanFieldError` (a type or range rule) or a `PlanLimitError` (a limit or a declared count) whose
message names the file, the field (e.g. `body.groups[3].index`), the value and the rule.
"""

from __future__ import annotations

import re
import reprlib
from bisect import bisect_left, bisect_right
from itertools import chain
from math import prod

import numpy as np

from shardplan.plan import ir
from shardplan.plan.file.engines import EngineInfo, EngineInfoError
from shardplan.plan.file.errors import advice
from shardplan.plan.file.skeletons import MAX_CONST_NUMEL, MAX_DEPTH, MAX_NDIM, SkeletonRules  # noqa: F401
from shardplan.plan.placement import EplbSlots, PlacementError
from shardplan.plan.template import trie_count

# ---- limits (docs/plan-format.md, "Limits") --------------------------------------------------------------
MAX_HEADER_BYTES = 1 << 16
MAX_BODY_BYTES = 1 << 26
MAX_VARS = 16  # variables of a group (legit plans: 2-3)
MAX_WORLD_SIZE = 1 << 16
MAX_WRITES_PER_RANK = 1 << 20  # Kimi-K2 TP32 (the largest shipped): 69,975
MAX_TOTAL_WRITES = 1 << 25
MAX_SOURCES = 1 << 22  # Kimi-K2: 66,963 checkpoint tensors
MAX_NUMEL = 1 << 48  # elements of one tensor; also bounds every integer a write holds
MAX_TEXT = 4096

MODEL_DTYPES = ("bfloat16", "float16", "float32")
TENSOR_DTYPES = frozenset(ir.ITEMSIZE)  # the one dtype table: plan/ir.py
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_TEXT_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # free text may hold tabs and newlines
_TEMPLATE = re.compile(r"(?:[^{}]|\{\})*")
_VERSION = re.compile(r"[0-9A-Za-z.+!_-]{1,64}")
_ARCH = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
LAYOUT_KEYS = ("tp", "pp", "dp", "ep")
HEADER_FIELDS = (
    "format_version",
    "shardplan_version",
    "vllm_version",
    "model",
    "architecture",
    "config_sha256",
    "layout",
    "dtype",
    "ranks",
    "num_writes",
    "num_sources",
)
OPTIONAL_HEADER_FIELDS = (
    "quantizer",  # only in plans whose trainer quantizes (runtime/quantize.py)
    "eplb",  # only in plans with EPLB redundant expert slots (plan/placement.py)
    "trust_remote_code",  # only true: recorded running the model directory's own code
    "engine",
)  # only in plans of another engine than vLLM (plan/file/engines.py)
_QUANTIZER = re.compile(r"[a-z0-9][a-z0-9.-]{0,63}/[1-9][0-9]{0,4}x[1-9][0-9]{0,4}")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 3, 60, 40, 60
_REPR.maxtuple = _REPR.maxlist = _REPR.maxdict = 6


def _show(value) -> str:
    """A short repr that is safe on hostile values (nesting is cut at 3 levels, long ints and strings shortened)."""
    text = _REPR.repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


class Checker(SkeletonRules):
    """Checks raw decoded msgpack values; `fail` and `limit` raise file/errors.py's named errors (passed in, so that the
    error classes live with the format) with the field path and the rule."""

    def __init__(self, path: str, field_error, limit_error, op_error):
        self.path, self.field_error, self.limit_error, self.op_error = path, field_error, limit_error, op_error

    def fail(self, where: str, value, rule: str):
        raise self.field_error(f"{self.path}: {where} = {_show(value)}: {rule}. " + advice(self.path))

    def limit(self, where: str, what: str):
        raise self.limit_error(f"{self.path}: {where}: {what}. " + advice(self.path))

    # -- scalars
    def int_(self, v, where: str, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
        if type(v) is not int:
            self.fail(where, v, f"must be an integer, not {type(v).__name__}")
        if not lo <= v <= hi:
            self.fail(where, v, f"must lie in [{lo}, {hi}]")
        return v

    def bool_(self, v, where: str) -> bool:
        if type(v) is not bool:
            self.fail(where, v, f"must be a boolean (true/false), not {type(v).__name__}")
        return v

    def str_(self, v, where: str, *, pattern: re.Pattern | None = None, rule: str = "", free_text=False) -> str:
        if type(v) is not str:
            self.fail(where, v, f"must be a string, not {type(v).__name__}")
        if len(v) > MAX_TEXT:
            self.fail(where, v, f"must be at most {MAX_TEXT} characters")
        if (_TEXT_CONTROL if free_text else _CONTROL).search(v):
            self.fail(where, v, "must not contain control characters")
        if pattern is not None and not pattern.fullmatch(v):
            self.fail(where, v, rule)
        return v

    def name(self, v, where: str) -> str:
        self.str_(v, where)
        if not v or "{" in v or "}" in v:
            self.fail(where, v, "must be a non-empty tensor name without braces")
        return v

    def template(self, v, where: str) -> int:
        """A name template: `{}` holes only (no literal braces); returns the number of holes."""
        self.str_(v, where)
        if not v or not _TEMPLATE.fullmatch(v):
            self.fail(where, v, "must be a non-empty name template whose only braces are `{}` holes")
        return v.count("{}")

    def dtype(self, v, where: str) -> str:
        if type(v) is not str or v not in TENSOR_DTYPES:
            self.fail(where, v, f"must be one of {sorted(TENSOR_DTYPES)}")
        return v

    def array(self, v, where: str, length: int | None = None, *, min_len: int = 0, max_len: int | None = None) -> tuple:
        if type(v) is not tuple:
            self.fail(where, v, f"must be an array, not {type(v).__name__}")
        if length is not None and len(v) != length:
            self.fail(where, v, f"must have exactly {length} elements, not {len(v)}")
        if len(v) < min_len:
            self.fail(where, v, f"must have at least {min_len} elements")
        if max_len is not None and len(v) > max_len:
            self.fail(where, v, f"must have at most {max_len} elements")
        return v

    def shape(self, v, where: str) -> int:
        """A tensor shape; returns its number of elements."""
        self.array(v, where, max_len=MAX_NDIM)
        numel = 1
        for i, d in enumerate(v):
            numel *= self.int_(d, f"{where}[{i}]", 0, MAX_NUMEL)
        if numel > MAX_NUMEL:
            self.limit(where, f"shape {list(v)} holds {numel} elements, more than the {MAX_NUMEL} a plan allows")
        return numel

    def increasing(self, keys: list, where: str, what: str) -> None:
        for i in range(1, len(keys)):
            if not keys[i - 1] < keys[i]:
                self.fail(
                    f"{where}[{i}]",
                    keys[i],
                    f"{what} must be strictly increasing (canonical order): it follows {_show(keys[i - 1])}",
                )

    # -- index tries
    def trie(self, node, where: str, depth: int, lows: tuple, stats: list) -> int:
        """A trie of `len(stats)` variables, variable d's values >= lows[d]; returns how many tuples it holds, without
        expanding it. stats[d] collects [min, max] of variable d."""
        num_vars = len(stats)
        if depth == num_vars:
            if node is not None:
                self.fail(where, node, f"must be nil: the index has only {num_vars} variables")
            return 1
        self.array(node, where, min_len=1)
        total, last_value = 0, None
        for i, run in enumerate(node):
            at = f"{where}[{i}]"
            self.array(run, at, 4)
            start = self.int_(run[0], f"{at}.start", lows[depth], MAX_NUMEL)
            stop = self.int_(run[1], f"{at}.stop", lows[depth], MAX_NUMEL + 1)
            step = self.int_(run[2], f"{at}.step", 1, MAX_NUMEL)
            if stop <= start or (stop - start) % step:
                self.fail(at, run[:3], "a run must have start < stop and stop = start + k * step (k >= 1)")
            if stop - start == step and step != 1:
                self.fail(at, run[:3], "a single-value run must have step 1 (canonical form)")
            if last_value is not None and start <= last_value:
                self.fail(
                    at,
                    run[:3],
                    f"runs must be sorted and disjoint: starts at or before {last_value}, "
                    f"the last value of the previous run",
                )
            last_value = stop - step
            s = stats[depth]
            s[0] = start if s[0] is None else min(s[0], start)
            s[1] = last_value if s[1] is None else max(s[1], last_value)
            total += (stop - start) // step * self.trie(run[3], f"{at}.child", depth + 1, lows, stats)
        return total


def check_header(raw, path: str, version: int, c: Checker) -> dict:
    """The header map: exactly HEADER_FIELDS, each of its documented type and range. Returns it unchanged."""
    if type(raw) is not dict:
        c.fail("header", raw, "must be a msgpack map")
    optional = tuple(raw)[len(HEADER_FIELDS) :]
    if tuple(raw)[: len(HEADER_FIELDS)] != HEADER_FIELDS or optional != tuple(
        f for f in OPTIONAL_HEADER_FIELDS if f in optional
    ):
        c.fail(
            "header keys",
            list(raw),
            f"must be exactly {list(HEADER_FIELDS)}, in that order (then optionally {list(OPTIONAL_HEADER_FIELDS)})",
        )
    if "quantizer" in raw:
        c.str_(
            raw["quantizer"],
            "header.quantizer",
            pattern=_QUANTIZER,
            rule="must be a quantizer id such as 'fp8-e4m3-block-amax448-v1/128x128'",
        )
    if "trust_remote_code" in raw and raw["trust_remote_code"] is not True:
        c.fail(
            "header.trust_remote_code",
            raw["trust_remote_code"],
            "must be the msgpack bool true (the key is absent when the recording ran no remote code)",
        )
    if "eplb" in raw:
        try:
            EplbSlots.from_dict(raw["eplb"])
        except PlacementError as e:
            c.fail("header.eplb", raw["eplb"], str(e))
    if "engine" in raw:
        try:
            EngineInfo.from_dict(raw["engine"])
        except EngineInfoError as e:
            c.fail("header.engine", raw["engine"], str(e))
    c.int_(raw["format_version"], "header.format_version", version, version)
    c.str_(raw["shardplan_version"], "header.shardplan_version", pattern=_VERSION, rule="must be a version string")
    c.str_(raw["vllm_version"], "header.vllm_version", pattern=_VERSION, rule="must be a version string")
    model = c.str_(raw["model"], "header.model")
    if not model:
        c.fail("header.model", model, "must not be empty")
    c.str_(raw["architecture"], "header.architecture", pattern=_ARCH, rule="must be a class name")
    c.str_(raw["config_sha256"], "header.config_sha256", pattern=_SHA256, rule="must be 64 lowercase hex digits")
    layout = raw["layout"]
    if type(layout) is not dict or tuple(layout) != LAYOUT_KEYS:
        c.fail("header.layout", layout, f"must be a map with exactly the keys {list(LAYOUT_KEYS)}, in that order")
    world = 1
    for key in ("tp", "pp", "dp"):
        world *= c.int_(layout[key], f"header.layout.{key}", 1, MAX_WORLD_SIZE)
    c.bool_(layout["ep"], "header.layout.ep")
    if "eplb" in raw and (
        layout["ep"] is not True or EplbSlots.from_dict(raw["eplb"]).num_ep_ranks != layout["tp"] * layout["dp"]
    ):
        c.fail("header.eplb", raw["eplb"], "num_ep_ranks must be the layout's EP group (tp x dp, with ep true)")
    if world > MAX_WORLD_SIZE:
        c.limit("header.layout", f"world size {world} exceeds {MAX_WORLD_SIZE}")
    if type(raw["dtype"]) is not str or raw["dtype"] not in MODEL_DTYPES:
        c.fail("header.dtype", raw["dtype"], f"must be one of {list(MODEL_DTYPES)}")
    ranks = c.array(raw["ranks"], "header.ranks", min_len=1, max_len=world)
    for i, r in enumerate(ranks):
        c.int_(r, f"header.ranks[{i}]", 0, world - 1)
    c.increasing(list(ranks), "header.ranks", "ranks")
    counts = c.array(raw["num_writes"], "header.num_writes", len(ranks))
    for i, n in enumerate(counts):
        c.int_(n, f"header.num_writes[{i}]", 0, MAX_WRITES_PER_RANK)
    if sum(counts) > MAX_TOTAL_WRITES:
        c.limit("header.num_writes", f"{sum(counts)} writes in all, more than {MAX_TOTAL_WRITES}")
    c.int_(raw["num_sources"], "header.num_sources", 0, MAX_SOURCES)
    return raw


def check_body(raw, header: dict, c: Checker) -> None:
    """The body array, against the (already checked) header. Nothing is expanded: counts come from the tries."""
    body = c.array(raw, "body", 7)
    sources, params, rank_params, groups, ordered, fallbacks, reserved = body
    if reserved != ():
        c.fail("body.reserved", reserved, "must be an empty array")
    ranks = list(header["ranks"])

    # sources
    num_sources, keys = 0, []
    for i, row in enumerate(c.array(sources, "body.sources", max_len=MAX_SOURCES)):
        at = f"body.sources[{i}]"
        c.array(row, at, 4)
        num_holes = c.template(row[0], f"{at}.name_template")
        c.shape(row[1], f"{at}.shape")
        c.dtype(row[2], f"{at}.dtype")
        if num_holes == 0:
            if row[3] is not None:
                c.fail(f"{at}.index", row[3], "must be nil: the template has no holes")
            num_sources += 1
        else:
            if num_holes > MAX_VARS:
                c.limit(f"{at}.name_template", f"more than {MAX_VARS} holes")
            num_sources += c.trie(row[3], f"{at}.index", 0, (0,) * num_holes, [[None, None] for _ in range(num_holes)])
        if num_sources > header["num_sources"]:
            c.limit(
                f"{at}.index",
                f"the source table expands to more than the {header['num_sources']} checkpoint "
                f"tensors the header declares",
            )
        keys.append((row[0], row[1], row[2]))
    c.increasing(keys, "body.sources", "source templates")
    if num_sources != header["num_sources"]:
        c.fail("header.num_sources", header["num_sources"], f"the source table holds {num_sources} names")

    # params
    numels = _param_numels(c.array(params, "body.params"))
    if numels is None:  # a rule is broken: the per-entry checks name it
        numels = []
        for i, row in enumerate(params):
            at = f"body.params[{i}]"
            c.array(row, at, 3)
            c.name(row[0], f"{at}.name")
            numels.append(c.shape(row[1], f"{at}.shape"))
            c.dtype(row[2], f"{at}.dtype")
    # a name appears once per distinct (shape, dtype) some rank declares it with: entries sorted by all three
    c.increasing(
        [(row[0], tuple(row[1]), row[2]) for row in params], "body.params", "param entries (name, shape, dtype)"
    )

    repeated_names = len({row[0] for row in params}) != len(params)
    # rank_params: exactly the header's ranks, each with sorted indices into params
    c.array(rank_params, "body.rank_params", len(ranks))
    for i, row in enumerate(rank_params):
        at = f"body.rank_params[{i}]"
        c.array(row, at, 2)
        c.int_(row[0], f"{at}.rank", ranks[i], ranks[i])
        c.array(row[1], f"{at}.params")
    capacity = _rank_capacities(rank_params, params, numels, repeated_names)
    if capacity is None:  # a rule is broken: the per-index checks below name it
        capacity = {}
        for i, (rank, idx) in enumerate(rank_params):
            at = f"body.rank_params[{i}]"
            for j, k in enumerate(idx):
                c.int_(k, f"{at}.params[{j}]", 0, len(params) - 1)
            c.increasing(list(idx), f"{at}.params", "param indices")
            if repeated_names:
                c.increasing([params[k][0] for k in idx], f"{at}.params", "param names (one entry per name and rank)")
            capacity[rank] = sum(numels[k] for k in idx)

    # groups: count writes per rank from the index tries
    per_rank = dict.fromkeys(ranks, 0)
    for i, row in enumerate(c.array(groups, "body.groups")):
        at = f"body.groups[{i}]"
        c.array(row, at, 5)
        num_holes, ops = c.skeleton(row[0], f"{at}.skeleton")
        _check_ops(ops, f"{at}.skeleton", c)
        num_vars = c.int_(row[4], f"{at}.num_vars", 2, MAX_VARS)
        cshape = c.array(row[1], f"{at}.coeff_shape", 2)
        if cshape != (num_holes, 1 + num_vars):
            c.fail(
                f"{at}.coeff_shape",
                cshape,
                f"must be [{num_holes}, {1 + num_vars}] (holes of the skeleton, 1 + num_vars)",
            )
        coeffs = c.array(row[2], f"{at}.coeff_values", num_holes * (1 + num_vars))
        if set(map(type, coeffs)) - {int} or (coeffs and not INT64_MIN <= min(coeffs) <= max(coeffs) <= INT64_MAX):
            for j, v in enumerate(coeffs):  # one is not an int64: name it
                c.int_(v, f"{at}.coeff_values[{j}]")
        stats = [[None, None] for _ in range(num_vars)]
        c.trie(row[3], f"{at}.index", 0, (0,) + (-1,) * (num_vars - 1), stats)
        _check_hole_range(coeffs, num_holes, num_vars, stats, at, c)
        _count_by_rank(row[3], ranks, per_rank, at, c)

    # ordered: explicit writes, in rank order; their params and counts are checked here, boxes on instantiation
    seen = []
    for i, row in enumerate(c.array(ordered, "body.ordered")):
        at = f"body.ordered[{i}]"
        c.array(row, at, 2)
        rank = _rank_of(row[0], ranks, f"{at}.rank", c)
        seen.append(rank)
        writes = c.array(row[1], f"{at}.writes", min_len=1, max_len=MAX_WRITES_PER_RANK)
        for j, w in enumerate(writes):
            c.array(w, f"{at}.writes[{j}]", 2)
            num_holes, ops = c.skeleton(w[0], f"{at}.writes[{j}].skeleton")
            _check_ops(ops, f"{at}.writes[{j}].skeleton", c)
            holes = c.array(w[1], f"{at}.writes[{j}].holes", num_holes)
            for k, h in enumerate(holes):
                c.int_(h, f"{at}.writes[{j}].holes[{k}]", -MAX_NUMEL, MAX_NUMEL)
        per_rank[rank] += len(writes)
    c.increasing(seen, "body.ordered", "ranks")

    seen = []
    for i, row in enumerate(c.array(fallbacks, "body.fallbacks")):
        at = f"body.fallbacks[{i}]"
        c.array(row, at, 2)
        seen.append(_rank_of(row[0], ranks, f"{at}.rank", c))
        for j, f in enumerate(c.array(row[1], f"{at}.fallbacks", min_len=1)):
            c.array(f, f"{at}.fallbacks[{j}]", 4)
            c.name(f[0], f"{at}.fallbacks[{j}].source")
            for k, what in ((1, "op"), (2, "reason"), (3, "loader")):
                c.str_(f[k], f"{at}.fallbacks[{j}].{what}", free_text=True)
    c.increasing(seen, "body.fallbacks", "ranks")

    for i, (rank, declared) in enumerate(zip(ranks, header["num_writes"])):
        if per_rank[rank] != declared:
            c.limit(
                f"header.num_writes[{i}]",
                f"rank {rank} declares {declared} writes but its templates and "
                f"ordered writes expand to {per_rank[rank]}",
            )
        if per_rank[rank] > capacity[rank]:
            c.limit(
                f"body.groups (rank {rank})",
                f"{per_rank[rank]} writes, more than the {capacity[rank]} elements of the rank's params can hold",
            )


def _param_numels(params: tuple) -> list[int] | None:
    """The elements of each param entry's shape when every entry is [name, shape, dtype] by the rules of
    `Checker.name`, `Checker.shape` and `Checker.dtype`; None when one is not. C-level passes over all entries (a
    plan declares ~700-1300), not a check call per value."""
    if set(map(type, params)) - {tuple} or set(map(len, params)) - {3}:
        return None
    names, shapes, dtypes = zip(*params) if params else ((), (), ())
    if set(map(type, names)) - {str} or set(map(type, shapes)) - {tuple} or set(map(type, dtypes)) - {str}:
        return None
    text = "".join(names)  # a control character or a brace in the concatenation is one in a name
    if names and (
        min(map(len, names)) == 0
        or max(map(len, names)) > MAX_TEXT
        or _CONTROL.search(text)
        or "{" in text
        or "}" in text
    ):
        return None
    if not set(dtypes) <= TENSOR_DTYPES or (shapes and max(map(len, shapes)) > MAX_NDIM):
        return None
    dims = list(chain.from_iterable(shapes))
    if set(map(type, dims)) - {int} or (dims and (min(dims) < 0 or max(dims) > MAX_NUMEL)):
        return None
    numels = list(map(prod, shapes))
    return None if numels and max(numels) > MAX_NUMEL else numels


def _rank_capacities(rank_params, params, numels: list[int], repeated_names: bool) -> dict[int, int] | None:
    """{rank: elements its params hold} when every rank's param indices are integers into `params`, strictly
    increasing, of strictly increasing names where names repeat; None when one is not (the caller then checks index
    by index, for the error). With numpy over all ranks at once: a DP256 layout lists ~220k indices."""
    lists = [idx for _, idx in rank_params]
    total = sum(map(len, lists))
    if not set(map(type, chain.from_iterable(lists))) <= {int}:  # exactly int: a bool is not an index
        return None
    try:
        flat = np.fromiter(chain.from_iterable(lists), dtype=np.int64, count=total)
    except OverflowError:
        return None
    if total and (int(flat.min()) < 0 or int(flat.max()) >= len(params)):
        return None
    ends = np.cumsum([len(idx) for idx in lists], dtype=np.int64)
    starts = ends - np.asarray([len(idx) for idx in lists], dtype=np.int64)
    step = np.diff(flat)
    inner = np.ones(len(step), dtype=bool)  # steps inside one rank's list (not across two ranks' lists)
    inner[(ends[:-1] - 1)[(ends[:-1] > 0) & (ends[:-1] < total)]] = False
    if (inner & (step <= 0)).any():
        return None
    if repeated_names:  # entries are sorted by name (checked above): distinct names <-> a name ordinal that steps
        names = [row[0] for row in params]
        ordinal = np.cumsum([0] + [a != b for a, b in zip(names[1:], names[:-1])], dtype=np.int64)
        if (inner & (np.diff(ordinal[flat]) <= 0)).any():
            return None
    if total and max(numels) * total >= 1 << 62:  # int64 sums could wrap: Python ints
        return {rank: sum(numels[k] for k in idx) for rank, idx in rank_params}
    sums = np.concatenate([[0], np.cumsum(np.asarray(numels, dtype=np.int64)[flat])])
    return {rank: int(sums[e] - sums[s]) for (rank, _), s, e in zip(rank_params, starts.tolist(), ends.tolist())}


def _rank_of(v, ranks: list[int], where: str, c: Checker) -> int:
    c.int_(v, where)
    if v not in ranks:
        c.fail(where, v, f"must be one of the header's ranks {ranks}")
    return v


def _check_ops(ops: set[str], where: str, c: Checker) -> None:
    bad = sorted(ops - ir.ALLOWED_OPS)
    if bad:
        raise c.op_error(
            f"{c.path}: {where} names ops outside shardplan's allowlist: {bad}. A plan can only "
            f"name allowlisted ops; this one is corrupt or hostile. " + advice(c.path)
        )


def _check_hole_range(coeffs, num_holes: int, num_vars: int, stats: list, where: str, c: Checker) -> None:
    """Every hole = c0 + sum c_j x_j over the index's variable ranges stays within +-MAX_NUMEL: int64 arithmetic
    on holes can then never overflow."""
    width = 1 + num_vars
    for h in range(num_holes):
        row = coeffs[h * width : (h + 1) * width]
        lo = hi = row[0]
        for coef, (vmin, vmax) in zip(row[1:], stats):
            a, b = coef * vmin, coef * vmax
            lo, hi = lo + min(a, b), hi + max(a, b)
        if lo < -MAX_NUMEL or hi > MAX_NUMEL:
            c.limit(
                f"{where}.coeff_values (hole {h})", f"takes values in [{lo}, {hi}] over the index, beyond +-{MAX_NUMEL}"
            )


def _count_by_rank(index, ranks: list[int], per_rank: dict, where: str, c: Checker) -> None:
    """Adds each rank's number of writes; every rank in the index must be one of the header's."""
    for i, (start, stop, step, child) in enumerate(index):
        count = trie_count(child)
        num_values = (stop - start) // step
        window = ranks[bisect_left(ranks, start) : bisect_right(ranks, stop - step)]  # runs are disjoint: linear
        hits = [r for r in window if (r - start) % step == 0]
        if len(hits) != num_values:
            c.fail(f"{where}.index[{i}]", (start, stop, step), f"ranks must be among the header's ranks {ranks}")
        for r in hits:
            per_rank[r] += count
            if per_rank[r] > MAX_WRITES_PER_RANK:
                c.limit(f"{where}.index", f"rank {r} expands to more than {MAX_WRITES_PER_RANK} writes")
