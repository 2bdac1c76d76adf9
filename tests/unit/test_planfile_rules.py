"""One test per rule of docs/plan-format.md ("Validation", "Limits"): a plan that breaks exactly that rule, sealed with
a valid checksum (as a buggy or hostile writer would), is refused with the named error, naming the file and field."""

from __future__ import annotations

import copy
import os
import struct
import time
from pathlib import Path

import pytest
from planfile_helpers import encode_plans, raw_parts, reseal, rich_bytes, seal

from shardplan.plan.file import checks as plancheck
from shardplan.plan.file import format as planfile
from shardplan.plan.file.format import (
    PlanBoundsError,
    PlanChecksumError,
    PlanCorrupt,
    PlanFieldError,
    PlanFile,
    PlanFileError,
    PlanFormatVersionError,
    PlanLimitError,
    PlanNotCanonical,
    PlanOpNotAllowed,
    PlanOversize,
    PlanTruncated,
    PlanUnreadable,
    decode,
)

HOLE = "\x00#"
GOOD = rich_bytes()
LAYER = 1  # body.groups[1]: the pure-view template over layers (holes: dst name, offset, 2 sizes, 2 strides,
CALL = 0  # src name, offset, 2 sizes, 2 strides); body.groups[0]: the reshape Call template
DEEP = 900


def _set(path):
    """path = (part, index..., new value)"""
    *path, value = path

    def mutate(h, b):
        node = {"h": h, "b": b}[path[0]]
        for k in path[1:-1]:
            node = node[k]
        node[path[-1]] = value

    return mutate


def _coef(group: int, hole: int, value: int, column: int = 0):
    def mutate(h, b):
        b[3][group][2][hole * 3 + column] = value

    return mutate


def _nest(depth: int):
    leaf = ["S", "model.norm.weight"]
    for _ in range(depth):
        leaf = [
            "U",
            leaf,
            ["r", [HOLE], [HOLE], [HOLE]],
            ["v", ["S", "model.norm.weight"], ["r", [HOLE], [HOLE], [HOLE]]],
        ]
    return leaf


def _deep_write(h, b):
    b[4][0][1][0][0][3][1] = _nest(DEEP)


def _swap_groups(h, b):
    b[3].reverse()


def _huge_index(h, b):
    """A ~100-byte change claiming 10^12 writes: refused by counting the trie, never by expanding it."""
    b[3][LAYER][3] = [[0, 2, 1, [[0, 10**6, 1, None]]]]
    b[3][LAYER][3][0][3][0][1] = 10**12


def _capacity(h, b):
    """Declared counts that agree with the index, but more writes than the rank's params have elements."""
    b[3][LAYER][3] = [[0, 2, 1, [[0, 200, 1, None]]]]
    b[3][LAYER][2][0 * 3 + 2] = 0  # dst name no longer follows the layer
    h["num_writes"] = [200 + 3, 200 + 3]


CASES = {
    # header: exact keys and types, no coercion
    "header.missing_key": (lambda h, b: h.pop("model"), PlanFieldError, "header keys"),
    "header.extra_key": (lambda h, b: h.update(evil=1), PlanFieldError, "header keys"),
    "header.format_version": (lambda h, b: h.update(format_version=1), PlanFieldError, "format_version"),
    "header.shardplan_version": (
        lambda h, b: h.update(shardplan_version="0.1 \x1b[2J"),
        PlanFieldError,
        "shardplan_version",
    ),
    "header.vllm_version": (lambda h, b: h.update(vllm_version=32), PlanFieldError, "vllm_version"),
    "header.model": (lambda h, b: h.update(model=""), PlanFieldError, "header.model"),
    "header.architecture": (lambda h, b: h.update(architecture="os.system"), PlanFieldError, "architecture"),
    "header.config_sha256": (lambda h, b: h.update(config_sha256="ABC"), PlanFieldError, "config_sha256"),
    "header.layout.ep_string": (lambda h, b: h["layout"].update(ep="false"), PlanFieldError, "layout.ep"),
    "header.layout.ep_int": (lambda h, b: h["layout"].update(ep=0), PlanFieldError, "layout.ep"),
    "header.layout.tp_float": (lambda h, b: h["layout"].update(tp=2.0), PlanFieldError, "layout.tp"),
    "header.layout.tp_bool": (lambda h, b: h["layout"].update(tp=True), PlanFieldError, "layout.tp"),
    "header.layout.tp_zero": (lambda h, b: h["layout"].update(tp=0), PlanFieldError, "layout.tp"),
    "header.layout.extra": (lambda h, b: h["layout"].update(cp=1), PlanFieldError, "header.layout"),
    "header.layout.world": (lambda h, b: h["layout"].update(tp=1 << 16, pp=2), PlanLimitError, "world size"),
    "header.dtype": (lambda h, b: h.update(dtype="float16 "), PlanFieldError, "header.dtype"),
    "header.ranks.negative": (lambda h, b: h.update(ranks=[-1, 0]), PlanFieldError, r"header.ranks\[0\]"),
    "header.ranks.outside": (lambda h, b: h.update(ranks=[0, 2]), PlanFieldError, r"header.ranks\[1\]"),
    "header.ranks.unsorted": (lambda h, b: h.update(ranks=[1, 0]), PlanFieldError, "strictly increasing"),
    "header.ranks.empty": (lambda h, b: h.update(ranks=[]), PlanFieldError, "header.ranks"),
    "header.ranks.tp2_for_tp1": (lambda h, b: h["layout"].update(tp=1), PlanFieldError, "header.ranks"),
    "header.num_writes.length": (lambda h, b: h.update(num_writes=[6]), PlanFieldError, "num_writes"),
    "header.num_writes.limit": (lambda h, b: h.update(num_writes=[6, 1 << 30]), PlanFieldError, "num_writes"),
    "header.num_writes.mismatch": (lambda h, b: h.update(num_writes=[6, 5]), PlanLimitError, "declares 5 writes"),
    "header.num_sources": (lambda h, b: h.update(num_sources=5), PlanLimitError, "the header declares"),
    # body structure
    "body.length": (lambda h, b: b.append([]), PlanFieldError, "body"),
    "body.reserved": (lambda h, b: b[6].append(1), PlanFieldError, "body.reserved"),
    "body.sources.brace": (_set(("b", 0, 0, 0, "model.{embed}.weight")), PlanFieldError, "name_template"),
    "body.sources.dtype": (_set(("b", 0, 0, 2, "float128")), PlanFieldError, "dtype"),
    "body.sources.negative_dim": (_set(("b", 0, 0, 1, [-16, 4])), PlanFieldError, r"shape\[0\]"),
    "body.sources.shape_limit": (_set(("b", 0, 0, 1, [1 << 30, 1 << 30])), PlanLimitError, "elements"),
    "body.sources.index_for_no_holes": (_set(("b", 0, 0, 3, [[0, 1, 1, None]])), PlanFieldError, "must be nil"),
    "body.sources.step0": (_set(("b", 0, 1, 3, [[0, 3, 0, None]])), PlanFieldError, "step"),
    "body.sources.reversed_run": (_set(("b", 0, 1, 3, [[3, 0, 1, None]])), PlanFieldError, "start < stop"),
    "body.sources.overlapping_runs": (
        _set(("b", 0, 1, 3, [[0, 2, 1, None], [1, 3, 1, None]])),
        PlanFieldError,
        "sorted and disjoint",
    ),
    "body.sources.negative_index": (_set(("b", 0, 1, 3, [[-1, 3, 1, None]])), PlanFieldError, "start"),
    "body.sources.deep_index": (_set(("b", 0, 1, 3, [[0, 3, 1, [[0, 1, 1, None]]]])), PlanFieldError, "nil"),
    "body.sources.unsorted": (lambda h, b: b[0].reverse(), PlanFieldError, "strictly increasing"),
    "body.params.dtype": (_set(("b", 1, 0, 2, "torch.bfloat16")), PlanFieldError, "dtype"),
    "body.params.name": (_set(("b", 1, 0, 0, "")), PlanFieldError, "name"),
    "body.params.unsorted": (lambda h, b: b[1].reverse(), PlanFieldError, "strictly increasing"),
    # param entries are checked by passes over all of them; a broken rule is then named entry by entry
    "body.params.control": (_set(("b", 1, 1, 0, "a.\x1b[2J")), PlanFieldError, r"params\[1\].name.*control"),
    "body.params.brace": (_set(("b", 1, 1, 0, "a.{}")), PlanFieldError, r"params\[1\].name.*braces"),
    "body.params.bool_dim": (_set(("b", 1, 1, 1, [True, 4])), PlanFieldError, r"params\[1\].shape\[0\]"),
    "body.params.negative_dim": (_set(("b", 1, 1, 1, [4, -1])), PlanFieldError, r"params\[1\].shape\[1\]"),
    "body.params.huge_shape": (_set(("b", 1, 1, 1, [1 << 30, 1 << 30])), PlanLimitError, r"params\[1\].shape"),
    "body.params.row": (_set(("b", 1, 1, ["a", [4]])), PlanFieldError, r"params\[1\].*exactly 3"),
    "body.rank_params.negative_index": (
        _set(("b", 2, 0, 1, [-1, 1, 2, 3, 4])),
        PlanFieldError,
        r"rank_params\[0\].params\[0\]",
    ),
    "body.rank_params.index_outside": (_set(("b", 2, 0, 1, [0, 1, 2, 3, 5])), PlanFieldError, "params"),
    "body.rank_params.rank": (_set(("b", 2, 1, 0, 2)), PlanFieldError, "rank"),
    # the indices of all ranks are checked with numpy at once; a broken rule is then named index by index
    "body.rank_params.bool_index": (
        _set(("b", 2, 1, 1, [0, True, 2, 3, 4])),
        PlanFieldError,
        r"rank_params\[1\].params\[1\].*integer",
    ),
    "body.rank_params.huge_index": (
        _set(("b", 2, 1, 1, [0, 1, 2, 3, (1 << 64) - 1])),
        PlanFieldError,
        r"rank_params\[1\].params\[4\]",
    ),
    "body.rank_params.unsorted": (
        _set(("b", 2, 1, 1, [0, 1, 3, 2, 4])),
        PlanFieldError,
        r"rank_params\[1\].params\[3\].*strictly increasing",
    ),
    "body.rank_params.repeated": (_set(("b", 2, 0, 1, [0, 1, 1, 3, 4])), PlanFieldError, "strictly increasing"),
    "body.groups.tag": (_set(("b", 3, LAYER, 0, 0, "X")), PlanFieldError, "tag"),
    "body.groups.op": (_set(("b", 3, CALL, 0, 3, 1, 1, "os.system")), PlanOpNotAllowed, "os.system"),
    "body.groups.arg_index": (_set(("b", 3, CALL, 0, 3, 1, 2, 0, ["a", 5])), PlanFieldError, "index"),
    "body.groups.coeff_shape": (_set(("b", 3, LAYER, 1, [11, 3])), PlanFieldError, "coeff_shape"),
    "body.groups.coeff_int64": (_coef(LAYER, 1, (1 << 64) - 1), PlanFieldError, "coeff_values"),
    "body.groups.coeff_float": (_coef(LAYER, 1, 0.5), PlanFieldError, "coeff_values"),
    "body.groups.hole_range": (_coef(LAYER, 1, 1 << 60, column=2), PlanLimitError, "hole 1"),
    "body.groups.num_vars": (_set(("b", 3, LAYER, 4, 1)), PlanFieldError, "num_vars"),
    "body.groups.rank_outside": (_set(("b", 3, LAYER, 3, 0, 1, 3)), PlanFieldError, "ranks must be among"),
    "body.groups.huge_index": (_huge_index, PlanLimitError, "writes"),
    "body.groups.capacity": (_capacity, PlanLimitError, "can hold"),
    "body.groups.nesting": (
        lambda h, b: b[3][LAYER].__setitem__(
            0, ["W", ["n", "x"], ["r", [HOLE], [], []], ["v", _nest(DEEP), ["r", [HOLE], [], []]]]
        ),
        PlanLimitError,
        "nested deeper",
    ),
    "body.ordered.nesting": (_deep_write, PlanLimitError, "nested deeper"),
    "body.ordered.holes": (lambda h, b: b[4][0][1][0][1].pop(), PlanFieldError, "holes"),
    "body.ordered.rank": (_set(("b", 4, 0, 0, 7)), PlanFieldError, "header's ranks"),
    "body.ordered.param": (
        lambda h, b: b[4][0][1][0][0][1].__setitem__(1, "model.other.weight"),
        PlanBoundsError,
        "not one of its params",
    ),
    "body.fallbacks.source": (_set(("b", 5, 0, 1, 0, 0, "model.nothing")), PlanBoundsError, "model.nothing"),
    "body.fallbacks.control": (_set(("b", 5, 0, 1, 0, 2, "\x1b]0;owned\x07")), PlanFieldError, "control"),
    "body.canonical": (_swap_groups, PlanNotCanonical, "canonical"),
}


@pytest.mark.parametrize("rule", sorted(CASES))
def test_field_rule(rule):
    mutate, error, match = CASES[rule]
    h, b = raw_parts(GOOD)
    mutate(h, b)
    data = seal(h, b)
    start = time.perf_counter()
    with pytest.raises(error, match=match) as info:
        decode(data, "x.plan")
    assert time.perf_counter() - start < 5, "refusal must not expand anything"
    assert "x.plan" in str(info.value) and "docs/plan-format.md" in str(info.value)


# rules checked when a rank is instantiated (vectorised over the template's writes)
RANK_CASES = {
    "dst.stride0": (_coef(LAYER, 4, 0), "self-overlapping"),
    "dst.negative_offset": (_coef(LAYER, 1, -1), "negative"),
    "dst.outside": (_coef(LAYER, 1, 4), "outside destination"),
    "dst.empty": (_coef(LAYER, 2, 0), "empty"),
    "dst.overlapping": (_coef(LAYER, 5, 2), "self-overlapping"),
    "src.outside": (_coef(LAYER, 7, 17), "outside source"),
    "src.negative_stride": (_coef(LAYER, 11, -1), "negative"),
    "dst.other_param": (_coef(LAYER, 0, 5), "not declared for this rank"),
    "src.undeclared_name": (_coef(LAYER, 6, 5, column=2), "not declared"),
    "call.src_outside": (_coef(CALL, 4, 40), "outside source"),
    "call.dst_stride0": (_coef(CALL, 2, 0), "self-overlapping"),
    "ordered.view_outside": (lambda h, b: b[4][0][1][0][1].__setitem__(3, 1), "outside source"),
    "ordered.fill_too_big": (lambda h, b: b[4][0][1][1][1].__setitem__(3, 10**9), "constant fill"),
}


@pytest.mark.parametrize("rule", sorted(RANK_CASES))
def test_instantiation_rule(rule):
    mutate, match = RANK_CASES[rule]
    h, b = raw_parts(GOOD)
    mutate(h, b)
    plan = PlanFile(*decode(seal(h, b), "x.plan"), "x.plan")
    with pytest.raises(PlanBoundsError, match=match):
        plan.rank(0)


def test_the_header_is_sealed():
    """Every byte counts: a flip in the preamble, header, body or checksum is refused (format 1 sealed the body only,
    so a header edit could hand out a TP2 plan for tp=1)."""
    h, _ = raw_parts(GOOD)
    header_len = struct.unpack_from("<Q", GOOD, 12)[0]
    at = GOOD.index(b"bfloat16", 28)
    edited = GOOD[:at] + b"float32\0"[:8] + GOOD[at + 8 :]
    assert at < 28 + header_len
    with pytest.raises(PlanChecksumError):
        decode(edited, "x.plan")
    for i in range(len(GOOD)):
        data = bytearray(GOOD)
        data[i] ^= 0x01
        with pytest.raises(PlanFileError):
            decode(bytes(data), "x.plan")


def test_preamble_limits_and_sizes():
    with pytest.raises(PlanTruncated, match="28-byte preamble"):
        decode(GOOD[:20], "x.plan")
    with pytest.raises(PlanTruncated, match="declares"):
        decode(GOOD[:-1], "x.plan")
    with pytest.raises(PlanOversize, match="1 unexpected bytes"):
        decode(GOOD + b"\0", "x.plan")
    huge = GOOD[:12] + struct.pack("<QQ", 1 << 40, 10) + GOOD[28:]
    with pytest.raises(PlanLimitError, match="limits"):
        decode(huge, "x.plan")
    with pytest.raises(PlanFormatVersionError, match="version 1"):
        decode(GOOD[:8] + struct.pack("<I", 1) + GOOD[12:], "x.plan")
    with pytest.raises(PlanCorrupt, match="not valid msgpack"):
        h, b = raw_parts(GOOD)
        decode(seal(h, b, body_bytes=b"\x97" + b"\xc1" * 6), "x.plan")


# ---- odd file kinds and sizes: refused before (or without) reading them -----------------------------------
def _odd_paths(tmp_path: Path) -> dict[str, Path]:
    paths = {}
    (tmp_path / "dir.plan").mkdir()
    paths["directory"] = tmp_path / "dir.plan"
    os.mkfifo(tmp_path / "fifo.plan")
    paths["FIFO"] = tmp_path / "fifo.plan"
    (tmp_path / "dangling.plan").symlink_to(tmp_path / "missing")
    paths["dangling symlink"] = tmp_path / "dangling.plan"
    (tmp_path / "loop.plan").symlink_to(tmp_path / "loop.plan")
    paths["symlink loop"] = tmp_path / "loop.plan"
    paths["character device"] = Path("/dev/zero")
    return paths


def test_odd_file_kinds_are_refused(tmp_path):
    expected = {
        "directory": "a directory",
        "FIFO": "a FIFO",
        "dangling symlink": "dangling symlink",
        "symlink loop": "symlink loop",
        "character device": "a character device",
    }
    for kind, path in _odd_paths(tmp_path).items():
        start = time.perf_counter()
        with pytest.raises(PlanUnreadable, match=expected[kind]) as info:
            PlanFile.read(path)
        assert time.perf_counter() - start < 5 and str(path) in str(info.value)


def test_junk_after_a_valid_plan_is_refused_without_reading_it(tmp_path, monkeypatch):
    path = tmp_path / "big.plan"
    path.write_bytes(GOOD)
    os.truncate(path, len(GOOD) + (1 << 30))  # + 1 GiB (sparse)
    read = []
    real_read = os.read
    monkeypatch.setattr(planfile.os, "read", lambda fd, n: read.append(n) or real_read(fd, n))
    with pytest.raises(PlanOversize, match=str(1 << 30)):
        PlanFile.read(path)
    assert sum(read) <= planfile.PREAMBLE_BYTES


def test_reads_are_capped_at_the_declared_size(tmp_path, monkeypatch):
    path = tmp_path / "a.plan"
    path.write_bytes(GOOD)
    read = []
    real_read = os.read
    monkeypatch.setattr(planfile.os, "read", lambda fd, n: read.append(n) or real_read(fd, n))
    assert PlanFile.read(path).digest == GOOD[-32:].hex()
    assert sum(read) == len(GOOD) + 1  # the declared bytes, then one byte to see the end of the file


# ---- the store: a bad entry never breaks lookups of good plans -----------------------------------------------
@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    from shardplan.plan.file import store

    monkeypatch.setattr(store, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("SHARDPLAN_PLAN_PATH", str(tmp_path / "plans"))
    (tmp_path / "plans").mkdir()
    return tmp_path / "plans"


def _llama_plan() -> bytes:
    from planfile_helpers import rich_plans

    from shardplan.models import resolve_model
    from shardplan.plan.compile.compiler import compile_plans
    from shardplan.plan.layout import Layout

    spec = resolve_model("llama-3.1-8b")
    plans, sources = rich_plans()
    return planfile.encode(
        compile_plans(plans, sources),
        model=spec.hf_id,
        architecture=spec.architecture,
        config_sha256=spec.config_sha256,
        layout=Layout(tp=2),
        dtype="bfloat16",
        vllm_version="0.32.0",
    )


def test_bad_entries_in_a_search_dir_are_skipped(store_dir):
    from shardplan.plan.file import store

    _odd_paths(store_dir)
    good = _llama_plan()
    (store_dir / "a-truncated.plan").write_bytes(good[:100])
    (store_dir / "b-header-edited.plan").write_bytes(good.replace(b"bfloat16", b"float16\0", 1))
    (store_dir / "z-good.plan").write_bytes(good)
    plan = store.load_plan("llama-3.1-8b", tp=2, rank=1, check_vllm=False)
    assert plan.rank == 1
    with pytest.raises(store.PlanNotFound) as info:
        store.load_plan("llama-3.1-8b", tp=4, check_vllm=False)
    text = str(info.value)
    for name in ("a-truncated.plan", "b-header-edited.plan", "dir.plan", "fifo.plan", "dangling.plan", "loop.plan"):
        assert name in text, name


def test_load_plan_path_names_the_file_and_the_problem(store_dir):
    from shardplan.plan.file import store

    path = store_dir / "cut.plan"
    path.write_bytes(_llama_plan()[:100])
    with pytest.raises(PlanTruncated, match=f"{path}: truncated plan file"):
        store.load_plan("llama-3.1-8b", tp=2, path=path, check_vllm=False)
    path.write_bytes(_llama_plan())
    with pytest.raises(store.PlanNotFound, match="tp2 bfloat16, not llama-3.1-8b at tp4"):
        store.load_plan("llama-3.1-8b", tp=4, path=path, check_vllm=False)


def test_every_error_points_at_docs_that_exist():
    root = Path(__file__).resolve().parents[2]
    text = plancheck.advice("x.plan")
    for doc in ("docs/recording.md", "docs/plan-format.md"):
        assert doc in text and (root / doc).is_file()


def test_the_writer_refuses_what_the_reader_would():
    from planfile_helpers import rich_plans

    from shardplan.plan.compile.compiler import compile_plans
    from shardplan.plan.layout import Layout

    plans, sources = rich_plans()
    with pytest.raises(PlanFieldError, match="header.architecture"):
        planfile.encode(
            compile_plans(plans, sources),
            model="m",
            architecture="not a class",
            config_sha256="0" * 64,
            layout=Layout(tp=2),
            dtype="bfloat16",
            vllm_version="0.32.0",
        )


def test_reseal_helper_roundtrip():
    assert reseal(GOOD) == GOOD and copy.copy(GOOD) == GOOD


def _uneven_bytes() -> bytes:
    """rich_plans with rank 1's first layer param declared [2, 4] (rank 0's stays [4, 4]), as uneven EP does."""
    from planfile_helpers import rich_plans

    from shardplan.plan import ir

    plans, sources = rich_plans()
    small = ir.TensorMeta("model.layers.0.w.weight", (2, 4), "bfloat16")
    p1 = plans[1]
    writes = tuple(
        ir.Write(
            w.param, ir.Region(0, (2, 4), (4, 1)), ir.View(w.src.leaf, ir.Region(w.src.region.offset, (2, 4), (4, 1)))
        )
        if w.param == small.name
        else w
        for w in p1.writes
    )
    plans[1] = ir.RankPlan(1, tuple(small if m.name == small.name else m for m in p1.params), writes, p1.fallbacks)
    return encode_plans(plans, sources)


def test_a_param_declared_differently_by_two_ranks_keeps_both_shapes():
    data = _uneven_bytes()
    header, body = raw_parts(data)
    entries = [i for i, row in enumerate(body[1]) if row[0] == "model.layers.0.w.weight"]
    assert [body[1][i][1] for i in entries] == [[2, 4], [4, 4]]
    plan_file = PlanFile(*decode(data))
    shapes = [{p.name: p.shape for p in plan_file.rank(r).params}["model.layers.0.w.weight"] for r in (0, 1)]
    assert shapes == [(4, 4), (2, 4)]
    # a rank indexing both entries of one name: refused by name
    body[2][1][1] = sorted(set(body[2][1][1]) | set(entries))
    with pytest.raises(PlanFieldError, match=r"rank_params\[1\]\.params.*one entry per name"):
        decode(seal(header, body))
