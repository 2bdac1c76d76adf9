"""Record what vLLM's real `load_weights` does to each checkpoint tensor, on a model built on the meta device.

Two tiers. The fast tier (`fast.FastRecorder`) feeds plain meta tensors and hooks only the sinks: most loaders only
take views and copy them into parameters, and a meta view's geometry is the whole record. It gives up at the first
thing it cannot vouch for, and the full tier (`full.Recorder` on `rectensor.RecTensor`s) records the rank from the
start. A tensor whose loader reads values or applies an op outside `ir.ALLOWED_OPS` becomes an `ir.Fallback` (the
consumer gets it whole and runs the real loader); `strict=True` raises `UnsupportedLoaderOp` instead.
"""

from __future__ import annotations

import gc
import re
import time
import traceback
from typing import Iterable, Iterator

import torch

from shardplan.errors import ShardplanError, exception_text
from shardplan.plan import ir
from shardplan.record.composed import composed_loaders_recorded
from shardplan.record.fast import FastRecorder
from shardplan.record.full import Recorder, recording
from shardplan.record.recording import (
    LoaderRejectsCheckpoint,
    RankRecording,
    RecordError,
    UnsupportedLoaderOp,
    ValueRead,
    dtype_name,
)
from shardplan.record.rectensor import RecTensor, storage_key


def _loader_frame(tb) -> str:
    """The innermost weight-loading function in a traceback: what to name in an error."""
    best = ""
    for frame in traceback.extract_tb(tb):
        if "shardplan" in frame.filename or "/torch/" in frame.filename:
            continue
        if "load" in frame.name:
            best = f"{frame.name} ({frame.filename.rsplit('site-packages/', 1)[-1]}:{frame.lineno})"
    return best


_GEOMETRY = re.compile(r"\.(shape|size\(|numel\(|ndim|dim\()")


def _geometry_assert(exc: BaseException) -> str | None:
    """The `assert ...` line that raised `exc` when it checks a tensor's geometry (shape, size, numel, ndim), else
    None (an assert on the parallel state, say, depends on where the loader runs, so it stays a fallback)."""
    if not isinstance(exc, AssertionError):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    line = (frames[-1].line or "").strip() if frames else ""
    return line if line.startswith("assert") and _GEOMETRY.search(line) else None


def record_loader(
    model: torch.nn.Module,
    tensors: Iterable[tuple[str, tuple[int, ...], str]],
    *,
    rank: int,
    strict: bool = False,
    tier: str = "auto",
) -> RankRecording:
    """Record every write `model.load_weights` makes into a parameter from each checkpoint tensor.

    tier "auto": first the fast tier (`FastRecorder`: plain meta tensors, only the sink hooked), which gives up at
    the first thing it cannot vouch for; then, if it gave up, the full tier on RecTensors (`Recorder`) from the start.
    tier "full": the full tier only. Both give the same recording wherever the fast tier completes (tested)."""
    param_of: dict[int, tuple[str, torch.Tensor]] = {}
    params: dict[str, ir.TensorMeta] = {}
    for pname, p in list(model.named_parameters()) + list(model.named_buffers()):
        param_of.setdefault(storage_key(p), (pname, p))
        params.setdefault(pname, ir.TensorMeta(pname, tuple(p.shape), dtype_name(p.dtype)))
    rec = RankRecording(rank=rank, params=params)
    aliases = {pname: p.data for key, (pname, p) in param_of.items()}
    remaining = list(tensors)
    t0 = time.perf_counter()
    # The recording allocates a few small objects per tensor (RecTensor, IR records) on top of the loader's own, and
    # every ~700 allocations CPython's cycle collector runs, its older generations walking the whole heap (the model
    # with its thousands of modules and params): a large share of a rank's recording time. Nothing recorded is cyclic
    # garbage worth collecting mid-load, so the collector is paused for the recording and resumed (not forced) after.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        if tier == "auto":
            fast = FastRecorder(param_of, rank, params)
            if fast.run(model, remaining):
                created = [n for n, _ in _created_params(model, param_of)]
                if not created:
                    fast.rec.seconds = time.perf_counter() - t0
                    return fast.rec
                fast.anomaly = f"the loader creates parameters while loading: {', '.join(created)}"
            rec.tier_note = fast.anomaly
            for key, (pname, p) in param_of.items():  # undo `param.data = loaded` before the full tier runs
                if p.untyped_storage()._cdata != key:
                    p.data = aliases[pname]
        elif tier != "full":
            raise ValueError(f"tier must be 'auto' or 'full', not {tier!r}")
        rec.tier = "full"
        _record_all(model, remaining, rec, param_of, aliases, strict)
    finally:
        if gc_was_enabled:
            gc.enable()
    rec.seconds = time.perf_counter() - t0
    return rec


def _record_all(model, remaining: list, rec: RankRecording, param_of: dict, aliases: dict, strict: bool) -> None:
    while remaining:
        mode = Recorder(param_of, rec)
        fed: list[str] = []

        def feed() -> Iterator[tuple[str, torch.Tensor]]:
            for name, shape, dtype in remaining:
                t = RecTensor.make(shape, getattr(torch, dtype))
                mode.add_source(name, t)
                fed.append(name)
                rec.fed.append(name)
                yield name, t

        try:
            with recording(mode), composed_loaders_recorded(mode):
                model.load_weights(feed())
                _check_param_storages(mode, aliases)
            remaining = []
            _record_created_params(mode, model)
        except ValueRead as e:
            culprits = e.sources or {fed[-1]} if fed else e.sources
            _fallback(rec, culprits, e.op, e.reason, _loader_frame(e.__traceback__), strict)
            remaining = _unfinished(rec, remaining, len(fed), culprits) + remaining[len(fed) :]
        except ShardplanError:
            raise
        except Exception as e:  # the loader itself failed on this tensor
            where = _loader_frame(e.__traceback__)
            if not fed:
                raise RecordError(
                    f"vLLM's load_weights failed before reading any tensor: {exception_text(e)}"
                    f"{f' in {where}' if where else ''}"
                ) from None
            check = _geometry_assert(e)
            if check is not None:
                # vLLM's loader asserts on the tensor's geometry, which a meta tensor has exactly: its real loader
                # fails the same way on this checkpoint, so a fallback would only move the failure to the consumer
                name, shape, dtype = next(t for t in remaining if t[0] == fed[-1])
                raise LoaderRejectsCheckpoint(
                    f"vLLM's loader rejects checkpoint tensor {name} {list(shape)} {dtype} on rank {rec.rank}: "
                    f"{exception_text(e)} at `{check}` in {where or 'the loader'}. vLLM cannot load this checkpoint "
                    f"either: make the tensor's shape fit the config (e.g. an lm_head or embedding padded beyond "
                    f"vocab_size: cut it to vocab_size rows, or set vocab_size to its row count)."
                ) from None
            line = exception_text(e)
            _fallback(rec, {fed[-1]}, type(e).__name__, line.partition(": ")[2] or "(no message)", where, strict)
            remaining = _unfinished(rec, remaining, len(fed), {fed[-1]}) + remaining[len(fed) :]


def _check_param_storages(mode: "Recorder", aliases: dict) -> None:
    """`param.data = loaded` (no torch function sees the setter): the parameter now *is* the loaded tensor, its
    storage and geometry, which a plan of copies cannot express. The consumer must run the real loader for it."""
    for key, (pname, p) in mode.param_of.items():
        new_key = p.untyped_storage()._cdata
        if new_key != key:
            p.data = aliases[pname]  # back to the parameter's own storage, for the loads still to come
            leaf = mode.leaf_of.get(new_key)
            if leaf is None:
                raise RecordError(
                    f"the loader replaced the storage of parameter {pname} with a tensor that is not "
                    f"a checkpoint tensor; shardplan cannot record that"
                )
            sources: set[str] = set()
            ir.sources(leaf, sources)
            raise ValueRead(
                sources, "Tensor.data.set", f"the loader replaces the storage of {pname} (`param.data = ...`)"
            )


def _created_params(model, param_of: dict) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers the model has now and had not when the recording started."""
    return [
        (n, p)
        for n, p in list(model.named_parameters()) + list(model.named_buffers())
        if storage_key(p) not in param_of
    ]


def _record_created_params(mode: "Recorder", model) -> None:
    """A parameter the loader creates while loading (vLLM's Transformers backend registers `lm_head.bias` when the
    checkpoint has one): the recorder saw its storage as a scratch tensor the loader filled, with that storage's
    value as its leaf. Record it as a destination: one write of the whole parameter from that leaf (elements the
    loader never wrote read NaN, so verify would expose them). The consumer is a model vLLM has loaded, which has it."""
    for pname, p in _created_params(model, mode.param_of):
        leaf = mode.leaf_of.get(storage_key(p))
        if leaf is None or pname in mode.rec.params:
            continue  # created but not loaded from the checkpoint (model-side init), or a name already recorded
        shape, strides = tuple(p.shape), tuple(p.stride())
        mode.rec.params[pname] = ir.TensorMeta(pname, shape, dtype_name(p.dtype))
        mode.rec.writes.append(
            ir.Write(pname, ir.Region(0, shape, strides), ir.View(leaf, ir.Region(p.storage_offset(), shape, strides)))
        )


def _unfinished(rec: RankRecording, remaining: list, num_fed: int, culprits: set[str]) -> list:
    """Tensors fed before the aborted load that wrote nothing yet, to feed again to the restarted load_weights: a
    loader may hold a tensor back (to fuse it with a later one) and the abort lost it. Re-feeding one that the loader
    skipped costs nothing; without this it would be wrongly reported as not needed."""
    read: set[str] = set()
    for w in rec.writes:
        ir.sources(w.src.leaf, read)
    return [t for t in remaining[:num_fed] if t[0] not in read and t[0] not in culprits and t[0] not in rec.fallbacks]


def _fallback(rec: RankRecording, culprits: set[str], op: str, reason: str, loader: str, strict: bool) -> None:
    if strict:
        raise UnsupportedLoaderOp(
            f"cannot record the loader for {', '.join(sorted(culprits))}: {op} ({reason}) in {loader or 'the loader'}."
            f" Drop --strict to record it as a fallback (the consumer then receives the whole tensor and runs the "
            f"real loader)."
        )
    for name in culprits:
        rec.fallbacks[name] = ir.Fallback(name, op, reason, loader)
    # a half-recorded tensor must not be replayed: drop whatever it already wrote
    rec.writes = [w for w in rec.writes if not (_sources(w) & culprits)]


def _sources(w: ir.Write) -> set[str]:
    out: set[str] = set()
    ir.sources(w.src.leaf, out)
    return out
