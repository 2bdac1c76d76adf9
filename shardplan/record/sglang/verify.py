"""`shardplan verify --engine sglang`: replay == SGLang's real `load_weights`, bit for bit, on random tensors.

As record/verify.py for vLLM: the rank's model is built twice on the CPU by SGLang, every floating-point parameter and
buffer NaN-poisoned; SGLang's `load_weights` (which ends with `post_load_weights`) runs on one, the plan through the
reference interpreter on the other, followed by SGLang's own `post_load_weights` (what `end_weight_update` runs after
a refit that bypassed the loader), and fallback tensors through the real loader. Compared: every parameter, buffer and
tensor attribute of every module (DeepSeek's derived MLA `w_kc` / `w_vc` are plain attributes), bitwise.
"""

from __future__ import annotations

from typing import Mapping

import torch

from shardplan.plan import interp, ir
from shardplan.record.sglang.build import SglangBuilder, post_load_deferred
from shardplan.record.verify import RankVerdict, add_created_params, bits, note_undefined


def module_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, buffers and plain tensor attributes of every module, by dotted name."""
    out: dict[str, torch.Tensor] = {}
    for mname, module in model.named_modules():
        prefix = f"{mname}." if mname else ""
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers"):
                for n, t in value.items():
                    if isinstance(t, torch.Tensor):
                        out[prefix + n] = t
            elif isinstance(value, torch.Tensor):
                out[prefix + key] = value
    return out


def _poison_all(model: torch.nn.Module) -> None:
    """NaN into every floating-point tensor a load could write: parameters, persistent buffers and tensor attributes
    (derived weights). Non-persistent buffers (RoPE caches) are computed at build and never loaded: left alone."""
    with torch.no_grad():
        for mname, module in model.named_modules():
            skip = getattr(module, "_non_persistent_buffers_set", set())
            for key, t in (
                list(module._parameters.items())
                + [(k, b) for k, b in module._buffers.items() if k not in skip]
                + [(k, v) for k, v in vars(module).items() if isinstance(v, torch.Tensor)]
            ):
                if t is not None and t.is_floating_point() and t.device.type != "meta" and t.numel():
                    t.fill_(float("nan"))


def verify_rank(
    builder: SglangBuilder, rank: int, plan: ir.RankPlan, checkpoint: Mapping[str, torch.Tensor]
) -> RankVerdict:
    real = loaded_by_sglang(builder, rank, checkpoint)
    return verify_models(real, replayed_by_plan(builder, rank, plan, checkpoint, real), rank)


def loaded_by_sglang(builder: SglangBuilder, rank: int, checkpoint: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """The rank's model built by SGLang on the CPU, poisoned, loaded by SGLang's own `load_weights`."""
    real = builder.build(rank, "cpu")
    _poison_all(real)
    # copies: some SGLang loaders change the given tensor in place (Gemma's `loaded_weight += 1.0` for its norms),
    # which a checkpoint read from disk tolerates and the shared random checkpoint here would not
    with torch.no_grad(), builder.as_rank(rank):
        real.load_weights((n, t.clone()) for n, t in checkpoint.items())
    return real


def replayed_by_plan(
    builder: SglangBuilder,
    rank: int,
    plan: ir.RankPlan,
    checkpoint: Mapping[str, torch.Tensor],
    real: torch.nn.Module | None = None,
) -> torch.nn.Module:
    """The rank's model built by SGLang, poisoned, filled by the plan (reference interpreter), fallbacks through the
    real loader, then what SGLang derives after its loader's writes: `post_load_weights` as `end_weight_update` runs
    it; or, for a loader that derives inline and then deletes the source params (MiniCPM3: w_kc / w_vc from
    kv_b_proj, then `del kv_b_proj`; params of the build that `real`, SGLang's own load, no longer has), its own
    `load_weights` on no tensors, whose loop writes nothing and whose tail derives from the replayed bytes."""
    replayed = builder.build(rank, "cpu")
    _poison_all(replayed)
    add_created_params(replayed, plan)
    params = dict(replayed.named_parameters())
    params.update(dict(replayed.named_buffers()))
    interp.apply_reference(plan, checkpoint, params)
    with torch.no_grad(), builder.as_rank(rank):
        if plan.fallbacks:
            with post_load_deferred(replayed):
                replayed.load_weights([(f.source, checkpoint[f.source].clone()) for f in plan.fallbacks])
        if hasattr(replayed, "post_load_weights"):
            replayed.post_load_weights()
        elif real is not None and {n for n, _ in replayed.named_parameters()} - {n for n, _ in real.named_parameters()}:
            replayed.load_weights(iter(()))  # SGLang's load deleted params of the build: it derived from them
    return replayed


def verify_models(real: torch.nn.Module, replayed: torch.nn.Module, rank: int) -> RankVerdict:
    verdict = RankVerdict(rank)
    compare(module_tensors(real), module_tensors(replayed), verdict)
    params = dict(real.named_parameters())
    for name in verdict.unwritten:  # elements no checkpoint tensor writes (buffers and attributes: SGLang's to make)
        if name in params:
            note_undefined(verdict, name, params[name])
    return verdict


def compare(real: dict[str, torch.Tensor], replayed: dict[str, torch.Tensor], verdict: RankVerdict) -> None:
    for name, t in real.items():
        if not t.is_floating_point() or t.device.type == "meta":
            continue
        verdict.num_params += 1
        other = replayed.get(name)
        if other is None or other.shape != t.shape or other.dtype != t.dtype or not torch.equal(bits(t), bits(other)):
            verdict.mismatched.append(name)
        elif torch.isnan(t).any():
            verdict.unwritten.append(name)
