"""Trainer layouts as boxes (shardplan.runtime.shards.TrainerShard) for the simulator: Megatron-style
PP x TP x EP (x DP) and FSDP. A real trainer describes its own boxes; these builders cover the common layouts by
checkpoint-name rules."""

from __future__ import annotations

from typing import Mapping

from shardplan.plan import ir
from shardplan.plan.names import expert_of
from shardplan.runtime.shards import TrainerShard, full_box, layer_stage, replicate, split_range
from shardplan.simulate.fleet import FleetError

# Megatron's column-parallel (output dim split) and row-parallel (input dim split) linears, by checkpoint name
_COLUMN = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
_ROW = ("o_proj", "down_proj")


def megatron_split_dim(name: str, meta: ir.TensorMeta) -> int | None:
    """The dim Megatron's tensor parallelism splits: 0 for column-parallel linears and embeddings, 1 for row-parallel
    linears; None (replicated) for norms, routers, biases and the MLA down-projections."""
    if len(meta.shape) < 2:
        return None
    leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if any(leaf.endswith(k) for k in _ROW):
        return 1
    if any(leaf.endswith(k) for k in _COLUMN):
        return 0
    return None


def megatron(
    sources: Mapping[str, ir.TensorMeta],
    *,
    num_layers: int,
    pp: int = 1,
    tp: int = 1,
    ep: int = 1,
    stage_size: int | None = None,
    dp: int = 1,
) -> list[TrainerShard]:
    """PP stages of `stage_size` GPUs (default max(tp, ep)) each; within a stage, dense tensors split `tp` ways
    (megatron_split_dim) and replicated stage_size / tp times, expert tensors whole on expert e's EP rank
    (e * ep // num_experts), replicated stage_size / ep times; the whole layout replicated `dp` times.
    Rank = replica * (pp * stage_size) + stage * stage_size + index in the stage (dense: copy * tp + tp rank;
    experts: copy * ep + EP rank)."""
    stage_size = stage_size or max(tp, ep)
    for what, n in (("pp", pp), ("tp", tp), ("ep", ep), ("dp", dp), ("stage_size", stage_size)):
        if n < 1:
            raise FleetError(f"trainer layout: {what} must be >= 1, got {n}")
    if stage_size % tp or stage_size % ep:
        raise FleetError(f"trainer layout: stage_size {stage_size} must be a multiple of tp={tp} and ep={ep}")
    experts = [e for e in (expert_of(n) for n in sources) if e is not None]
    num_experts = max(experts) + 1 if experts else 0
    stage_of = layer_stage(num_layers, pp)
    shards: list[TrainerShard] = []
    for name, meta in sources.items():
        first = stage_of(name) * stage_size
        expert = expert_of(name)
        if expert is not None:
            holder = expert * ep // num_experts
            shards += [
                TrainerShard(name, first + copy * ep + holder, full_box(meta.shape)) for copy in range(stage_size // ep)
            ]
            continue
        dim = megatron_split_dim(name, meta)
        for copy in range(stage_size // tp):
            for r in range(tp):
                box = list(full_box(meta.shape))
                if dim is not None:
                    box[dim] = split_range(meta.shape[dim], tp, r)
                shards.append(TrainerShard(name, first + copy * tp + r, tuple(box)))
    return replicate(shards, dp, pp * stage_size) if dp > 1 else shards


def fsdp(sources: Mapping[str, ir.TensorMeta], world: int) -> list[TrainerShard]:
    """FSDP2's default: every tensor split along dim 0 over all `world` ranks (uneven splits as torch.chunk-like
    tensor_split bounds; a rank whose share is empty holds nothing of that tensor)."""
    if world < 1:
        raise FleetError(f"trainer layout: fsdp world must be >= 1, got {world}")
    shards = []
    for name, meta in sources.items():
        for r in range(world):
            box = list(full_box(meta.shape))
            if meta.shape:
                box[0] = split_range(meta.shape[0], world, r)
            shards.append(TrainerShard(name, r, tuple(box)))
    return shards
