"""Plan files: canonical writer, one named error per cause, plan lookup by fingerprint, trainer imports no vLLM."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest
from blocked_imports import run_without_vllm
from planfile_helpers import encode_plans, raw_parts, reseal, seal

from shardplan.plan import ir
from shardplan.plan.compile.compiler import compile_plans
from shardplan.plan.file import format as planfile
from shardplan.plan.file.format import (
    PlanBoundsError,
    PlanChecksumError,
    PlanCorrupt,
    PlanFile,
    PlanFormatVersionError,
    PlanOpNotAllowed,
    PlanTruncated,
    decode,
    encode,
)
from shardplan.plan.layout import Layout

SOURCES = [
    ir.TensorMeta("model.layers.0.w.weight", (8, 4), "bfloat16"),
    ir.TensorMeta("model.layers.1.w.weight", (8, 4), "bfloat16"),
    ir.TensorMeta("model.embed.weight", (16, 4), "bfloat16"),
]
PARAMS = (
    ir.TensorMeta("model.layers.0.w.weight", (4, 4), "bfloat16"),
    ir.TensorMeta("model.layers.1.w.weight", (4, 4), "bfloat16"),
)


def _plan(rank: int, writes=None) -> ir.RankPlan:
    if writes is None:
        writes = tuple(
            ir.Write(
                f"model.layers.{i}.w.weight",
                ir.full_region((4, 4)),
                ir.View(ir.Source(f"model.layers.{i}.w.weight"), ir.Region(16 * rank, (4, 4), (4, 1))),
            )
            for i in (1, 0)
        )
    return ir.RankPlan(rank, PARAMS, tuple(writes))


def _encode(plans, sources=SOURCES) -> bytes:
    return encode_plans(plans, sources)


def _good() -> bytes:
    return _encode([_plan(0), _plan(1)])


def test_roundtrip_and_instantiation():
    header, body = decode(_good())
    assert header.layout == Layout(tp=2) and header.ranks == (0, 1) and header.dtype == "bfloat16"
    plan = PlanFile(header, body).rank(1)
    assert {w.src.region.offset for w in plan.writes} == {16}
    assert set(plan.writes) == set(_plan(1).writes)


def test_writer_is_canonical_whatever_the_recording_order():
    a = _encode([_plan(0), _plan(1)])
    rev = [ir.RankPlan(p.rank, p.params[::-1], p.writes[::-1]) for p in (_plan(1), _plan(0))]
    b = _encode(rev, SOURCES[::-1])
    assert a == b


def test_truncated_file():
    data = _good()
    for cut in (5, 30, len(data) - 1):
        with pytest.raises(PlanTruncated, match="truncated"):
            decode(data[:cut], "x.plan")


def test_bad_checksum():
    data = bytearray(_good())
    data[-40] ^= 0xFF
    with pytest.raises(PlanChecksumError, match="x.plan"):
        decode(bytes(data), "x.plan")


def test_unknown_format_version():
    data = bytearray(_good())
    data[8:12] = struct.pack("<I", 99)
    with pytest.raises(PlanFormatVersionError, match="version 99"):
        decode(bytes(data), "x.plan")


def test_bad_magic_and_trailing_bytes_and_corrupt_header():
    with pytest.raises(PlanCorrupt, match="magic"):
        decode(b"NOTAPLAN" + _good()[8:], "x.plan")
    with pytest.raises(planfile.PlanOversize, match="1 unexpected bytes"):
        decode(_good() + b"\0", "x.plan")
    data = _good()
    (header_len,) = struct.unpack_from("<Q", data, 12)
    broken = data[:28] + b"\xc1" * header_len + data[28 + header_len :]  # 0xc1 is never valid msgpack
    with pytest.raises(PlanChecksumError):  # the header is sealed too
        decode(broken, "x.plan")
    with pytest.raises(PlanCorrupt, match="header is not valid msgpack"):
        decode(reseal(broken), "x.plan")


def _rewrite_body(data: bytes, mutate) -> bytes:
    """Re-seal a body after mutating it, with a valid checksum: what a hostile or buggy writer could produce."""
    header, raw = raw_parts(data)
    mutate(raw)
    return seal(header, raw)


def test_op_outside_allowlist_is_refused():
    call = ir.Call(
        "Tensor.reshape",
        (ir.Arg(0), 16),
        (),
        (ir.View(ir.Source("model.layers.0.w.weight"), ir.Region(0, (4, 4), (4, 1))),),
    )
    w = ir.Write("model.layers.0.w.weight", ir.Region(0, (16,), (1,)), ir.View(call, ir.full_region((16,))))
    data = _encode([_plan(0, [w])])
    assert decode(data)  # allowlisted: fine

    def evil(raw):
        text = repr(raw)
        assert "Tensor.reshape" in text

        def walk(node):
            if isinstance(node, list):
                for i, x in enumerate(node):
                    if x == "Tensor.reshape":
                        node[i] = "os.system"
                    walk(x)

        walk(raw)

    with pytest.raises(PlanOpNotAllowed, match="os.system"):
        decode(_rewrite_body(data, evil), "x.plan")


def _exp_plan_file() -> bytes:
    """A plan whose write is the Mamba family's `-torch.exp(A_log.float())`."""
    whole = ir.View(ir.Source("model.layers.0.w.weight"), ir.Region(0, (4, 4), (4, 1)))
    as_float = ir.View(ir.Call("Tensor.float", (ir.Arg(0),), (), (whole,)), ir.full_region((4, 4)))
    exp = ir.View(ir.Call("torch.exp", (ir.Arg(0),), (), (as_float,)), ir.full_region((4, 4)))
    neg = ir.View(ir.Call("Tensor.neg", (ir.Arg(0),), (), (exp,)), ir.full_region((4, 4)))
    return _encode([_plan(0, [ir.Write("model.layers.0.w.weight", ir.full_region((4, 4)), neg)])])


def _exp_node(raw) -> list:
    found = []

    def walk(node):
        if isinstance(node, list):
            if node[:2] == ["C", "torch.exp"]:
                found.append(node)
            for x in node:
                walk(x)

    walk(raw)
    assert len(found) == 1
    return found[0]


def test_exp_roundtrips():
    data = _exp_plan_file()
    header, body = decode(data)
    (w,) = PlanFile(header, body).rank(0).writes
    assert "torch.exp" in ir.literal_ops(w.src.leaf) and ir.leaf_str(w.src.leaf, {}).startswith("Tensor.neg(torch.exp(")


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda c: c[2].append(["a", 0]), "args"),  # exp(x, x)
        (lambda c: c[2].__setitem__(0, ["f", 2.0]), "args"),  # exp(2.0): not the input
        (lambda c: c[3].append(["out", ["a", 0]]), "kwargs"),  # exp(x, out=x): would write a trainer tensor
        (lambda c: c.__setitem__(5, 0), "out"),  # exp(x)[0]
        (lambda c: c[4].append(c[4][0]), "one input"),  # a second input
    ],
)
def test_exp_with_other_arguments_is_refused(mutate, words):
    data = _rewrite_body(_exp_plan_file(), lambda raw: mutate(_exp_node(raw)))
    with pytest.raises(planfile.PlanFieldError, match=r"torch\.exp takes exactly one tensor") as info:
        decode(data, "x.plan")
    assert "x.plan" in str(info.value) and words in str(info.value)


def test_box_outside_source_bounds():
    w = ir.Write(
        "model.layers.0.w.weight",
        ir.full_region((4, 4)),
        ir.View(ir.Source("model.layers.0.w.weight"), ir.Region(24, (4, 4), (4, 1))),
    )  # rows 6..9 of 8
    header, body = decode(_encode([_plan(0, [w])]))
    with pytest.raises(PlanBoundsError, match="source model.layers.0.w.weight"):
        PlanFile(header, body, "x.plan").rank(0)


def test_box_outside_destination_bounds():
    w = ir.Write(
        "model.layers.0.w.weight",
        ir.Region(4, (4, 4), (4, 1)),
        ir.View(ir.Source("model.layers.0.w.weight"), ir.Region(0, (4, 4), (4, 1))),
    )
    header, body = decode(_encode([_plan(0, [w])]))
    with pytest.raises(PlanBoundsError, match="destination model.layers.0.w.weight"):
        PlanFile(header, body, "x.plan").rank(0)


def test_unknown_rank_names_the_covered_ranks():
    header, body = decode(_good())
    with pytest.raises(planfile.PlanFileError, match=r"covers ranks \[0, 1\]"):
        PlanFile(header, body, "x.plan").rank(5)


def test_never_pickles(tmp_path):
    path = tmp_path / "a.plan"
    planfile.write_plan(path, _good())
    assert b"pickle" not in path.read_bytes() and b"\x80\x04" not in path.read_bytes()[:2]


@pytest.fixture
def isolated_store(tmp_path, monkeypatch):
    """Only tmp_path is searched: neither the shipped plans/ nor the user's cache."""
    from shardplan.plan.file import store

    monkeypatch.setattr(store, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("SHARDPLAN_PLAN_PATH", str(tmp_path))
    return tmp_path


def test_load_plan_by_fingerprint(isolated_store, monkeypatch):
    from shardplan.plan.file import store

    tmp_path = isolated_store
    from shardplan.models import resolve_model

    spec = resolve_model("llama-3.1-8b")
    data = encode(
        compile_plans([_plan(0), _plan(1)], SOURCES),
        model=spec.hf_id,
        architecture=spec.architecture,
        config_sha256=spec.config_sha256,
        layout=Layout(tp=2),
        dtype="bfloat16",
        vllm_version=store.installed_vllm_version() or "0.32.0",
    )
    planfile.write_plan(tmp_path / store.plan_filename("llama-3.1-8b", Layout(tp=2), "bfloat16"), data)
    plan = store.load_plan("Llama-3.1-8B", tp=2, rank=1)
    assert isinstance(plan, ir.RankPlan) and plan.rank == 1
    # another layout: refused with the list of existing plans and the command that records the missing one
    with pytest.raises(store.PlanNotFound) as err:
        store.load_plan("llama-3.1-8b", tp=4)
    assert "tp2" in str(err.value) and "shardplan record --model llama-3.1-8b --tp 4" in str(err.value)
    # another config (overridden) does not match the fingerprint
    with pytest.raises(store.PlanNotFound):
        store.load_plan("llama-3.1-8b", tp=2, overrides=["num_hidden_layers=2"])


def test_load_plan_searches_shipped_then_cache_then_named_dirs(tmp_path, monkeypatch):
    """The order users are told (store.py, README): the package's shipped plans, the per-user cache, then
    $SHARDPLAN_PLAN_PATH; the first usable match wins, and a directory without one is passed over."""
    from shardplan.models import resolve_model
    from shardplan.plan.file import store

    spec = resolve_model("llama-3.1-8b")
    dirs = {"shipped": tmp_path / "shipped", "cache": tmp_path / "cache" / "shardplan" / "plans"}
    dirs |= {"named": tmp_path / "named", "named2": tmp_path / "named2"}
    monkeypatch.setattr(store, "SHIPPED_DIR", dirs["shipped"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("SHARDPLAN_PLAN_PATH", os.pathsep.join([str(dirs["named"]), str(dirs["named2"])]))
    assert store.search_dirs() == [dirs["shipped"], dirs["cache"], dirs["named"], dirs["named2"]]

    def put(where: str) -> None:
        data = encode(
            compile_plans([_plan(0), _plan(1)], SOURCES),
            model=where,  # not part of the fingerprint: tells the copies apart
            architecture=spec.architecture,
            config_sha256=spec.config_sha256,
            layout=Layout(tp=2),
            dtype="bfloat16",
            vllm_version=store.installed_vllm_version() or "0.32.0",
        )
        dirs[where].mkdir(parents=True, exist_ok=True)
        planfile.write_plan(dirs[where] / store.plan_filename("llama-3.1-8b", Layout(tp=2), "bfloat16"), data)

    put("named2")
    assert store.load_plan("llama-3.1-8b", tp=2).header.model == "named2"
    put("named")
    assert store.load_plan("llama-3.1-8b", tp=2).header.model == "named"
    put("cache")
    assert store.load_plan("llama-3.1-8b", tp=2).header.model == "cache"
    put("shipped")
    assert store.load_plan("llama-3.1-8b", tp=2).header.model == "shipped"


def test_load_plan_returns_the_bytes_whose_fingerprint_it_checked(isolated_store, monkeypatch):
    """A plan file replaced between the scan (header matched) and the read used to come back unchecked: load_plan
    now decodes the very bytes whose header matched."""
    from shardplan.models import resolve_model
    from shardplan.plan.file import store

    def plan_bytes(spec):
        return encode(
            compile_plans([_plan(0), _plan(1)], SOURCES),
            model=spec.hf_id or spec.name,
            architecture=spec.architecture,
            config_sha256=spec.config_sha256,
            layout=Layout(tp=2),
            dtype="bfloat16",
            vllm_version=store.installed_vllm_version() or "0.32.0",
        )

    spec, other = resolve_model("llama-3.1-8b"), resolve_model("llama-3.1-8b", ["num_hidden_layers=2"])
    path = isolated_store / store.plan_filename("llama-3.1-8b", Layout(tp=2), "bfloat16")
    planfile.write_plan(path, plan_bytes(spec))
    real = store.read_plan_bytes

    def read_then_swap(p):
        data = real(p)
        planfile.write_plan(path, plan_bytes(other))  # replaced right after its header was read
        return data

    monkeypatch.setattr(store, "read_plan_bytes", read_then_swap)
    plan = store.load_plan("llama-3.1-8b", tp=2)
    assert plan.header.config_sha256 == spec.config_sha256 != other.config_sha256


def test_inspect_refuses_a_negative_max_lines(capsys):
    from shardplan import cli
    from shardplan.plan.inspect import InspectArgumentError, inspect_plan

    assert cli.main(["inspect", "plans/kimi-k2--tp32-ep--bfloat16.plan", "--rank", "3", "--max-lines", "-5"]) == 2
    assert "--max-lines must be a non-negative integer (0 prints every line), got -5" in capsys.readouterr().err
    for bad in (-1, 2.5, True):
        with pytest.raises(InspectArgumentError):
            inspect_plan("plans/kimi-k2--tp32-ep--bfloat16.plan", max_lines=bad)


def test_stale_vllm_is_refused(isolated_store, monkeypatch):
    from shardplan.plan.file import store

    tmp_path = isolated_store
    from shardplan.models import resolve_model

    spec = resolve_model("llama-3.1-8b")
    data = encode(
        compile_plans([_plan(0), _plan(1)], SOURCES),
        model=spec.hf_id,
        architecture=spec.architecture,
        config_sha256=spec.config_sha256,
        layout=Layout(tp=2),
        dtype="bfloat16",
        vllm_version="0.1.0",
    )
    planfile.write_plan(tmp_path / "x.plan", data)
    monkeypatch.setattr(store, "installed_vllm_version", lambda: "0.32.0")
    with pytest.raises(store.StalePlan, match="vLLM 0.1.0"):
        store.load_plan("llama-3.1-8b", tp=2)
    assert store.load_plan("llama-3.1-8b", tp=2, check_vllm=False).header.vllm_version == "0.1.0"


def test_corrupt_file_in_store_gives_named_error(tmp_path):
    path = tmp_path / "bad.plan"
    path.write_bytes(_good()[:40])
    with pytest.raises(PlanTruncated, match=str(path)):
        PlanFile.read(path)


@pytest.mark.slow  # subprocesses / whole shipped plans: `make test`, not `make test-fast`
def test_trainer_side_imports_without_vllm_transformers_safetensors(tmp_path):
    """Plan loading, instantiation, replay and apply with vLLM, transformers and safetensors made unimportable."""
    path = tmp_path / "a.plan"
    planfile.write_plan(path, _good())
    out = run_without_vllm(f"""
        import pkgutil, importlib, shardplan
        # every module of the trainer-side packages: plan files, runtime, sync engine, transports
        for pkg in ("shardplan.plan", "shardplan.runtime", "shardplan.sync", "shardplan.transport"):
            for info in pkgutil.iter_modules(importlib.import_module(pkg).__path__, pkg + "."):
                importlib.import_module(info.name)
        from shardplan.plan.file.format import PlanFile
        plan = PlanFile.read({str(path)!r}).rank(1)
        print('ok', len(plan.writes))
    """)
    assert out.strip() == "ok 2"


def _cli(*args, timeout=600):  # generous: a loaded 2-core box imports torch + transformers slowly
    return subprocess.run(
        [sys.executable, "-m", "shardplan.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow  # subprocesses / whole shipped plans: `make test`, not `make test-fast`
def test_inspect_shipped_kimi_plan():
    """The full-size Kimi-K2 TP32+EP plan: 32 ranks, ~31x less than a full broadcast, no fallbacks; fast."""
    out = _cli("inspect", "plans/kimi-k2--tp32-ep--bfloat16.plan", "--rank", "3", "--max-lines", "5", timeout=60)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "layout tp32-ep, ranks 32" in text and "fallbacks: 0" in text
    assert "31.0x" in text  # 1912 GiB checkpoint / 61.7 GiB per rank
    assert "IR of rank 3 (3015 writes, 66960 checkpoint tensors not needed)" in text
    assert (
        "model.layers.1.mlp.experts"
        in _cli(
            "inspect", "plans/kimi-k2--tp32-ep--bfloat16.plan", "--rank", "3", "--max-lines", "0", timeout=60
        ).stdout
    )


@pytest.mark.parametrize(
    "fp8,bf16", [("kimi-k2-fp8--tp16-ep", "kimi-k2--tp16-ep"), ("qwen3-30b-a3b-fp8--tp4", "qwen3-30b-a3b--tp4")]
)
@pytest.mark.slow  # subprocesses / whole shipped plans: `make test`, not `make test-fast`
def test_inspect_fp8_plan_next_to_bf16(fp8, bf16):
    """An FP8 plan's inspect shows fp8 + scale bytes per rank and what the same layout moves in BF16, computed from
    the FP8 plan alone: that BF16 figure is exactly the shipped BF16 plan's bytes per rank; the IR still prints."""
    from shardplan.plan.inspect import group_bytes, human_bytes, inspect_plan, kind_bytes

    fp8_file = PlanFile.read(f"plans/{fp8}--bfloat16.plan")
    bf16_file = PlanFile.read(f"plans/{bf16}--bfloat16.plan")
    assert fp8_file.header.quantizer == "fp8-e4m3-block-amax448-v1/128x128" and not bf16_file.header.quantizer
    text = inspect_plan(f"plans/{fp8}--bfloat16.plan", rank=1, max_lines=3)
    assert "FP8 plan (quantizer fp8-e4m3-block-amax448-v1/128x128)" in text and "IR of rank 1" in text
    for r in (0, 1, fp8_file.body.ranks[-1]):
        kinds = kind_bytes(fp8_file.body, r)
        assert sum(kinds.values()) == sum(group_bytes(fp8_file.body, r).values())
        assert kinds["scale"] > 0 and kinds["fp8"] > 20 * kinds["other"]
        in_bf16 = 2 * kinds["fp8"] + kinds["other"]
        assert in_bf16 == sum(group_bytes(bf16_file.body, r).values())
        row = [line for line in text.splitlines() if line.split()[:1] == [str(r)] and "x" not in line][0]
        assert human_bytes(sum(kinds.values())) in row and human_bytes(in_bf16) in row, row
    assert "BF16" not in inspect_plan(f"plans/{bf16}--bfloat16.plan")


@pytest.mark.slow  # subprocesses / whole shipped plans: `make test`, not `make test-fast`
def test_cli_errors_are_clean():
    out = _cli("record", "--model", "no-such-model", "--tp", "2")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "Unknown model 'no-such-model'" in out.stderr and "kimi-k2" in out.stderr
    out = _cli("inspect", "README.md")
    assert out.returncode == 2 and "not a shardplan plan file" in out.stderr and "Traceback" not in out.stderr
    out = _cli("record", "--model", "llama-3.1-8b", "--tp", "3", "--override", "num_hidden_layers=2")
    assert out.returncode == 2 and "Traceback" not in out.stderr and "tp3" in out.stderr, out.stderr
    out = _cli("record", "--model", "llama-3.1-8b", "--tp", "2", "--ep", "--override", "num_hidden_layers=2")
    assert out.returncode == 2 and "expert" in out.stderr.lower(), out.stderr
