"""Building hostile plan files in tests: split a plan into its raw (msgpack-decoded) header and body, mutate them,
and seal them again with a valid checksum, as a buggy or hostile writer could."""

from __future__ import annotations

import hashlib
import struct

import msgpack

from shardplan.plan.file import format as planfile


def raw_parts(data: bytes) -> tuple[dict, list]:
    """(header map, body array) of a well-formed plan, as mutable lists and dicts."""
    header_len, body_len = struct.unpack_from("<QQ", data, 12)
    header = msgpack.unpackb(data[28 : 28 + header_len], raw=False)
    body = msgpack.unpackb(data[28 + header_len : 28 + header_len + body_len], raw=False)
    return header, body


def seal(
    header,
    body,
    *,
    header_bytes: bytes | None = None,
    body_bytes: bytes | None = None,
    version: int = planfile.FORMAT_VERSION,
) -> bytes:
    """A plan file around these parts, with correct lengths and checksum."""
    hb = msgpack.packb(header, use_bin_type=True) if header_bytes is None else header_bytes
    bb = msgpack.packb(body, use_bin_type=True) if body_bytes is None else body_bytes
    sealed = planfile.MAGIC + struct.pack("<IQQ", version, len(hb), len(bb)) + hb + bb
    return sealed + hashlib.sha256(sealed).digest()


def reseal(data: bytes) -> bytes:
    """The same bytes with the checksum recomputed (lengths untouched)."""
    return data[:-32] + hashlib.sha256(data[:-32]).digest()


# ---- a small plan that uses every part of the format ---------------------------------------------------------
def rich_plans():
    """Two ranks of TP2 with: pure-view templates over layers, a Call write (reshape), a constant fill, overlapping
    writes (kept in `ordered`) and a fallback: every section of the body is non-empty."""
    from shardplan.plan import ir

    sources = [ir.TensorMeta(f"model.layers.{i}.w.weight", (8, 4), "bfloat16") for i in range(3)]
    sources += [
        ir.TensorMeta("model.embed.weight", (16, 4), "bfloat16"),
        ir.TensorMeta("model.norm.weight", (4,), "float32"),
        ir.TensorMeta("model.scale", (1,), "float32"),
    ]
    params = tuple(ir.TensorMeta(f"model.layers.{i}.w.weight", (4, 4), "bfloat16") for i in range(3)) + (
        ir.TensorMeta("model.embed.weight", (8, 4), "bfloat16"),
        ir.TensorMeta("model.norm.weight", (4,), "float32"),
    )
    plans = []
    for rank in range(2):
        writes = [
            ir.Write(
                f"model.layers.{i}.w.weight",
                ir.full_region((4, 4)),
                ir.View(ir.Source(f"model.layers.{i}.w.weight"), ir.Region(16 * rank, (4, 4), (4, 1))),
            )
            for i in range(3)
        ]
        call = ir.Call(
            "Tensor.reshape",
            (ir.Arg(0), 32),
            (),
            (ir.View(ir.Source("model.embed.weight"), ir.Region(32 * rank, (8, 4), (4, 1))),),
        )
        writes.append(ir.Write("model.embed.weight", ir.Region(0, (32,), (1,)), ir.View(call, ir.full_region((32,)))))
        # overlapping writes into the norm: last write wins, so they keep their order
        writes.append(
            ir.Write(
                "model.norm.weight", ir.full_region((4,)), ir.View(ir.Source("model.norm.weight"), ir.full_region((4,)))
            )
        )
        writes.append(
            ir.Write(
                "model.norm.weight",
                ir.Region(rank, (1,), (1,)),
                ir.View(ir.Full(1.5, (1,), "float32"), ir.full_region((1,))),
            )
        )
        fallbacks = (ir.Fallback("model.scale", "Tensor.item", "reads values", "vllm.x.loader"),)
        plans.append(ir.RankPlan(rank, params, tuple(writes), fallbacks))
    return plans, sources


def rich_bytes() -> bytes:
    plans, sources = rich_plans()
    return encode_plans(plans, sources)


def encode_plans(
    plans, sources, *, tp: int = 2, model: str = "test/model", architecture: str = "TestForCausalLM"
) -> bytes:
    """A plan file of these rank plans (compiled), under a test header: TP `tp`, bfloat16, vLLM 0.32.0."""
    from shardplan.plan.compile.compiler import compile_plans
    from shardplan.plan.layout import Layout

    return planfile.encode(
        compile_plans(plans, sources),
        model=model,
        architecture=architecture,
        config_sha256="0" * 64,
        layout=Layout(tp=tp),
        dtype="bfloat16",
        vllm_version="0.32.0",
    )
