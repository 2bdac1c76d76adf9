"""Sharded trainers in a live-engine sync: which box of each checkpoint tensor every trainer rank holds.

A trainer whose tensors are sharded (FSDP2 / torch DTensor, Megatron-style dim splits, or any boxes) sends its LOCAL
shards: shardplan.runtime.shards.plan_shards re-plans every engine rank's writes against the boxes the trainer ranks
hold, and each trainer rank packs the pieces it was given (sync.ShardedPacker). The engine workers compute the same
sharded plan from the same boxes (they travel in the init info as JSON) and apply every trainer's part of each group
(engine.reload.ReloadUnpacker); the join stamps prove both sides computed the same layout before any byte moves.

Boxes of DTensors come from torch's own local-shape/offset rule for every coordinate of the mesh, so a driver (or
an engine) can know every rank's box without holding the DTensors: `placement_shards`. Shard(d) and Replicate are
supported; Partial (unreduced) and strided shards (_StridedShard: not one box per rank) are refused by name.
"""

from __future__ import annotations

import itertools
from typing import Callable, Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

# torch's own rule for a shard's local shape and global offset, for any mesh coordinate (plain data in, no mesh needed)
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset,
    compute_local_shape_and_global_offset,
)

from shardplan.engine.errors import EnginePlanMismatch, EngineUnsupported
from shardplan.plan import ir
from shardplan.plan.names import expert_of, layer_of, slot_name, with_expert
from shardplan.runtime.shards import Box, ShardedPlan, ShardError, ShardLayoutError, TrainerShard, full_box, plan_shards


def placement_boxes(shape: Sequence[int], mesh: Sequence, placements: Sequence, name: str = "tensor") -> dict[int, Box]:
    """Global rank -> the box of a tensor of `shape` that rank holds, for a DTensor on `mesh` (nested lists of global
    ranks, e.g. DeviceMesh.mesh.tolist()) with `placements` (one per mesh dim)."""
    mesh_t = torch.as_tensor(mesh)
    if len(placements) != mesh_t.dim():
        raise ShardLayoutError(f"{name}: {len(placements)} placements for a {mesh_t.dim()}-D mesh")
    for p in placements:
        if type(p) is not Shard and not isinstance(p, Replicate):  # _StridedShard subclasses Shard
            raise ShardLayoutError(
                f"{name}: placement {p!r} is not supported for a sync (only Shard(dim) and "
                f"Replicate hold one box per rank): redistribute it first (e.g. "
                f"tensor.redistribute(placements=[Shard(0)]) or full_tensor())"
            )
    boxes = {}
    for coord in itertools.product(*(range(n) for n in mesh_t.shape)):
        local, offset = _compute_local_shape_and_global_offset(
            tuple(shape), tuple(mesh_t.shape), list(coord), list(placements)
        )
        boxes[int(mesh_t[coord])] = tuple((int(o), int(o) + int(n)) for o, n in zip(offset, local))
    return boxes


def placement_shards(
    metas: Mapping[str, ir.TensorMeta | Sequence[int]], mesh: Sequence, placements: Callable[[str], Sequence]
) -> list[TrainerShard]:
    """Every rank's boxes of the named tensors for DTensor placements `placements(name)` on `mesh`, without the
    DTensors (e.g. in a driver process): FSDP2 is `lambda name: [Shard(0)]` on a 1-D mesh of the trainer ranks."""
    shards = []
    for name, meta in metas.items():
        shape = meta.shape if isinstance(meta, ir.TensorMeta) else tuple(meta)
        shards += [
            TrainerShard(name, r, box)
            for r, box in sorted(placement_boxes(shape, mesh, placements(name), name).items())
        ]
    return shards


def dtensor_shards(tensors: Mapping[str, torch.Tensor]) -> list[TrainerShard]:
    """Every rank's boxes of `tensors` (a state dict of DTensors, e.g. an FSDP2 model's), from each DTensor's mesh and
    placements. Plain tensors among them are taken as replicated on every rank of the meshes."""
    meshes = {n: t.device_mesh.mesh.tolist() for n, t in tensors.items() if isinstance(t, DTensor)}
    if not meshes:
        raise ShardLayoutError("none of the trainer's tensors is a DTensor: pass the boxes (shards=) or whole tensors")
    ranks = sorted({int(r) for m in meshes.values() for r in torch.as_tensor(m).flatten().tolist()})
    shards = []
    for name, t in tensors.items():
        if isinstance(t, DTensor):
            boxes = placement_boxes(tuple(t.shape), meshes[name], t.placements, name)
            shards += [TrainerShard(name, r, box) for r, box in sorted(boxes.items())]
        else:
            shards += [TrainerShard(name, r, full_box(t.shape)) for r in ranks]
    return shards


def local_box(tensor: torch.Tensor) -> tuple[torch.Tensor, Box | None]:
    """The local tensor and the box it is of the global one (None for a plain tensor: the caller's box applies)."""
    if not isinstance(tensor, DTensor):
        return tensor, None
    local = tensor.to_local()
    shape, offset = compute_local_shape_and_global_offset(tuple(tensor.shape), tensor.device_mesh, tensor.placements)
    return local, tuple((int(o), int(o) + int(n)) for o, n in zip(offset, shape))


def shards_to_json(shards: Sequence[TrainerShard]) -> dict[str, list]:
    """{name: [[rank, [start, stop, start, stop, ...]], ...]}: what EngineInitInfo.trainer_shards carries."""
    out: dict[str, list] = {}
    for s in shards:
        out.setdefault(s.name, []).append([s.rank, [x for ab in s.box for x in ab]])
    return out


def shards_from_json(obj: Mapping[str, list]) -> list[TrainerShard]:
    try:
        return [
            TrainerShard(str(name), int(rank), tuple((int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)))
            for name, entries in obj.items()
            for rank, flat in entries
        ]
    except (TypeError, ValueError, IndexError) as e:
        raise ShardLayoutError(f"trainer_shards is not {{name: [[rank, [start, stop, ...]], ...]}}: {e}") from None


def sharded_plan(plan_file, shards: Sequence[TrainerShard]) -> ShardedPlan:
    """Every engine rank's writes re-planned against the trainer ranks' boxes (the same on both sides of a sync); a
    block-FP8 plan's trainers quantize their own boxes (holders of a block cut between them exchange its amax)."""
    plans = [plan_file.rank(r) for r in plan_file.ranks]
    if plan_file.header.eplb is not None:
        if plan_file.header.quantizer:
            raise EngineUnsupported(
                f"{plan_file.path} is a block-FP8 plan with EPLB slots: sharded trainers quantizing their own "
                f"boxes are not built with EPLB; gather the experts (whole tensors)"
            )
        shards = [*shards, *eplb_slot_shards(shards, plan_file)]
    with_fallbacks = [p for p in plans if p.fallbacks]
    if with_fallbacks:
        raise EngineUnsupported(
            f"{plan_file.path}: ranks {[p.rank for p in with_fallbacks][:8]} have fallback "
            f"tensors ({with_fallbacks[0].fallbacks[0].source}, ...), which sharded trainers "
            f"cannot send yet; send whole tensors"
        )
    return plan_shards(plans, plan_file.sources, shards, quantizer=plan_file.header.quantizer)


def whole_expert_holders(plan_file, shards: Sequence[TrainerShard] | None) -> bool:
    """Whether `shards` are an EPLB plan's trainers that each hold some tensors whole (expert parallel: each rank its
    experts, as Megatron's expert parallelism holds them; the rest whole on any ranks). They are served as whole-tensor
    trainers holding subsets (sync.ReplayPacker): each version's schedule gives every slot's bytes to a holder of the
    expert the consumer's published placement puts there (sync.placement.SlotSpans), so no sharded plan is made.
    Block-FP8 EPLB plans are not (sharded_plan refuses them by name)."""
    if shards is None or plan_file.header.eplb is None or plan_file.header.quantizer:
        return False
    return all(s.box == full_box(plan_file.sources[s.name].shape) for s in shards if s.name in plan_file.sources)


def eplb_slot_shards(shards: Sequence[TrainerShard], plan_file) -> list[TrainerShard]:
    """Every trainer rank's box of each EPLB slot tensor (`experts.slot.<p>`) the plan reads. Any expert may fill any
    slot, so a rank must hold the same box of every expert of a MoE tensor (each expert whole, or each split alike as
    FSDP's Shard(0) splits it): that box is its box of every slot, and the sub-plans do not depend on the placement
    (the packer aliases each slot to the local shard of the expert the consumer's placement puts there). Trainers
    holding different experts (EP-sharded, as Megatron's expert parallelism holds them) are served only where every
    box is whole (whole_expert_holders); here, with other tensors cut into boxes, they are refused by name."""
    slots = plan_file.header.eplb
    held: dict[tuple[str, int], dict[int, Box]] = {}  # (expert-name template, trainer rank) -> expert -> box
    for s in shards:
        expert = expert_of(s.name)
        if expert is not None and layer_of(s.name) in slots.moe_layers:
            held.setdefault((with_expert(s.name, "{}"), s.rank), {})[expert] = s.box
    out = []
    for (template, rank), boxes in sorted(held.items()):
        if len(boxes) != slots.num_logical_experts or len(set(boxes.values())) != 1:
            lacking = [e for e in range(slots.num_logical_experts) if e not in boxes]
            what = f"lacks experts {lacking[:8]}" if lacking else f"holds them in {len(set(boxes.values()))} boxes"
            raise EngineUnsupported(
                f"{plan_file.path} has EPLB slots, and trainer rank {rank} {what} of {template.format('<e>')}: with "
                f"EPLB any expert may move to any slot, so every trainer rank must hold the same box of every "
                f"expert (whole, or split alike as FSDP's Shard(0)), or every box must be whole (expert "
                f"parallel: each rank holds its experts whole and the other tensors whole, e.g. gathered)"
            )
        box = next(iter(boxes.values()))
        out += [TrainerShard(slot_name(template.format(0), p), rank, box) for p in range(slots.num_physical_experts)]
    return out


def worker_sharded_plan(plan_file, trainer_shards: Mapping[str, list] | None) -> ShardedPlan | None:
    """In an engine worker: the sharded plan of the trainers' boxes that the init info carries (None: whole tensors).
    The driver planned the same boxes first, so a refusal here is a disagreement: EnginePlanMismatch."""
    if not trainer_shards:
        return None
    try:
        return sharded_plan(plan_file, shards_from_json(trainer_shards))
    except ShardError as e:
        raise EnginePlanMismatch(
            f"the trainers' shards cannot serve {plan_file.path}: {type(e).__name__}: {e}"
        ) from None
