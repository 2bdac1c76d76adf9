"""Prove a recording exact: replay == vLLM's real `load_weights`, bit for bit, on random tensors.

For each rank: build the model on CPU twice, poison every parameter with NaN, run the real loader on one and the
recorded plan (through the reference interpreter) on the other, compare bitwise. Fallback tensors go through the real
loader on the replay side too, as they would on a consumer. Any element the plan does not write stays NaN, so an
incomplete plan cannot pass.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from shardplan.plan import interp, ir
from shardplan.plan.layout import Layout
from shardplan.plan.unwritten import unwritten_runs
from shardplan.record.build import build_model, loading_context


@dataclass
class RankVerdict:
    rank: int
    num_params: int = 0
    mismatched: list[str] = field(default_factory=list)  # replay differs from the real loader
    unwritten: list[str] = field(default_factory=list)  # still NaN after the real loader (nothing loads them)
    # name -> (elements, of numel) no checkpoint tensor defines: vLLM's loader leaves them as allocated (padding such
    # as Kimi-Linear's expert intermediate at TP > 1 without EP), and the plan does not write them either
    undefined: dict[str, tuple[int, int]] = field(default_factory=dict)
    # name -> which elements those are: flat element ranges of the contiguous param, as plan.unwritten derives them
    undefined_ranges: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    # the unwritten ones that are buffers vLLM computes when it builds the model (attention _k_scale/_v_scale, rotary
    # tables): initialised at construction, which neither the loader nor a plan repeats
    constructed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatched


def random_checkpoint(tensors, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape, dtype in tensors:
        t = torch.randn(shape, generator=gen, dtype=torch.float32)
        out[name] = t.to(getattr(torch, dtype))
    return out


def poison(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_floating_point() and t.device.type != "meta":
                t.fill_(float("nan"))


def bits(t: torch.Tensor) -> torch.Tensor:
    """A view whose equality is bitwise (NaN == NaN with the same payload, -0.0 != 0.0)."""
    if t.is_floating_point():
        return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def compare_models(real: torch.nn.Module, replayed: torch.nn.Module, verdict: RankVerdict) -> None:
    replayed_tensors = dict(replayed.named_parameters())
    replayed_tensors.update(dict(replayed.named_buffers()))
    buffers = {name for name, _ in real.named_buffers()}
    for name, t in list(real.named_parameters()) + list(real.named_buffers()):
        if not t.is_floating_point() or t.device.type == "meta":
            continue  # meta: vLLM's cached rotary tables, shared with an earlier meta build; never loaded
        verdict.num_params += 1
        other = replayed_tensors[name]
        if not torch.equal(bits(t), bits(other)):
            verdict.mismatched.append(name)
        elif torch.isnan(t).any():
            verdict.unwritten.append(name)
            if name in buffers:
                verdict.constructed.append(name)
            else:
                note_undefined(verdict, name, t)


def note_undefined(verdict: RankVerdict, name: str, t: torch.Tensor) -> None:
    """Which elements of param `name` the real loader left NaN-poisoned (no checkpoint tensor wrote them)."""
    nan = torch.isnan(t).flatten()
    verdict.undefined[name] = (int(nan.sum()), t.numel())
    verdict.undefined_ranges[name] = unwritten_runs((~nan).numpy())


def undefined_reason(layouts: dict, engine: str) -> str:
    """A coverage row's FAIL reason for the params its layouts' "undefined" ({param: [elements, numel]}) name, each
    at the first layout that leaves it unwritten; "" where none."""
    undefined = {
        n: (tag, nan, numel)
        for tag, r in reversed(layouts.items())
        for n, (nan, numel) in r.get("undefined", {}).items()
    }
    if not undefined:
        return ""
    shown = [
        f"{n} ({'every element' if nan == numel else f'{nan} of {numel} elements'} at {tag})"
        for n, (tag, nan, numel) in sorted(undefined.items())[:4]
    ]
    return (
        f"no listed checkpoint tensor writes {'; '.join(shown)}"
        + (f" and {len(undefined) - 4} more params" if len(undefined) > 4 else "")
        + f" ({engine}'s loader leaves them as allocated too): the listing lacks tensors the model's checkpoint has, "
        f"{engine} sizes the param from a field the tiny config does not shrink as the checkpoint's class does, or "
        f"{engine}'s loader drops a tensor it is given"
    )


@dataclass(frozen=True)
class Padding:
    """Rows of a param that the engine allocates as padding, never loads (its own loader leaves them as allocated)
    and never reads into a result: the one kind of element no checkpoint tensor may leave unwritten in a passing
    coverage row (coverage.VLLM_PADDING, sglang.coverage.SGLANG_PADDING: each cited)."""

    params: str  # a regex the param's name fullmatches
    what: str  # the padding, for the row's detail
    rows: Callable[[torch.nn.Module, str], tuple[int, int]]  # (the engine's model, the param's name) -> rows [lo, hi)
    cite: str  # the engine source it rests on


def split_unwritten(entries, model: torch.nn.Module, verdict: RankVerdict) -> tuple[dict, dict]:
    """verdict.undefined split in two: {param: (elements, numel)} that no listed checkpoint tensor writes outside the
    padding `entries` name (the row's FAIL), and {param: (elements, numel, what)} inside exactly their rows."""
    tensors = dict(model.named_parameters())
    failing, padding = {}, {}
    for name, (nan, numel) in verdict.undefined.items():
        entry = next((e for e in entries if re.fullmatch(e.params, name)), None)
        if entry is not None:
            lo, hi = entry.rows(model, name)
            row = numel // tensors[name].shape[0]
            if all(lo * row <= a and b <= hi * row for a, b in verdict.undefined_ranges[name]):
                padding[name] = (nan, numel, entry.what)
                continue
        failing[name] = (nan, numel)
    return failing, padding


def note_unwritten(result: dict, entries, model: torch.nn.Module, verdict: RankVerdict) -> None:
    """Add a rank's unwritten elements to its layout's result (split_unwritten): outside the padding `entries` name
    under "undefined" (the first rank's counts), the padding under "padding" (what -> [params, elements, numel])."""
    failing, padding = split_unwritten(entries, model, verdict)
    for name, counts in failing.items():
        result["undefined"].setdefault(name, list(counts))
    for nan, numel, what in padding.values():
        total = result.setdefault("padding", {}).setdefault(what, [0, 0, 0])
        total[0], total[1], total[2] = total[0] + 1, total[1] + nan, total[2] + numel


def only_dropped(layouts: dict, endings: tuple[str, ...]) -> bool:
    """Whether the params a coverage row leaves unwritten (its layouts' "undefined") are all wholly unwritten and all
    end in one of `endings`: the params an engine's loader drops (coverage.VLLM_LOADER_DROPS, SGLANG_LOADER_DROPS)."""
    unwritten = [c for r in layouts.values() for n, c in r.get("undefined", {}).items() if n.endswith(endings)]
    total = sum(len(r.get("undefined", {})) for r in layouts.values())
    return bool(unwritten) and len(unwritten) == total and all(nan == numel for nan, numel in unwritten)


def padding_summary(layouts: dict) -> list[str]:
    """Per kind of exempted padding, the elements of it each layout's ranks left unwritten (the row's detail)."""
    kinds: dict[str, list[str]] = {}
    for tag, r in layouts.items():
        for what, (params, nan, numel) in r.get("padding", {}).items():
            of = f"{params} param{'s' * (params > 1)}"
            kinds.setdefault(what, []).append(f"{tag}: {nan} of the {numel} elements of {of} over its ranks")
    return [f"{what} ({', '.join(where)})" for what, where in kinds.items()]


def add_created_params(model: torch.nn.Module, plan: ir.RankPlan) -> None:
    """Register, NaN-filled, the destinations the plan declares that a freshly built `model` lacks: parameters vLLM's
    loader creates while loading (the Transformers backend's `lm_head.bias`). A consumer is a model vLLM has loaded,
    which has them; the plan must then write every element (NaN is what an unwritten one would show)."""
    have = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    for meta in plan.params:
        if meta.name not in have:
            owner, _, leaf = meta.name.rpartition(".")
            data = torch.full(meta.shape, float("nan"), dtype=interp.to_dtype(meta.dtype))
            model.get_submodule(owner).register_parameter(leaf, torch.nn.Parameter(data, requires_grad=False))


def verify_rank(
    vllm_config, layout: Layout, rank: int, plan: ir.RankPlan, checkpoint: Mapping[str, torch.Tensor]
) -> RankVerdict:
    verdict = RankVerdict(rank)
    real = build_model(vllm_config, layout, rank, "cpu")
    poison(real)
    # the real loader runs as on that rank (loaders ask for the TP/EP rank while loading), as recording does
    with torch.no_grad(), loading_context(vllm_config, layout, rank):
        real.load_weights(iter(list(checkpoint.items())))
    replayed = build_model(vllm_config, layout, rank, "cpu")
    poison(replayed)
    add_created_params(replayed, plan)
    params = dict(replayed.named_parameters())
    params.update(dict(replayed.named_buffers()))
    interp.apply_reference(plan, checkpoint, params)
    if plan.fallbacks:
        with torch.no_grad(), loading_context(vllm_config, layout, rank):
            replayed.load_weights([(f.source, checkpoint[f.source]) for f in plan.fallbacks])
    compare_models(real, replayed, verdict)
    return verdict
