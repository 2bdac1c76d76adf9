"""The one parser of checkpoint and parameter names: decoder layer, weight group, expert index, EPLB slot, FP8 scale.

Every stage keys on these (compile fits layer holes, the pack layout groups by layer, the sync pipelines groups,
trainer shards place experts and PP stages), so they are defined once, here.
"""

from __future__ import annotations

import re

# `model.layers.7.x`, `layers.7.x`, `language_model.model.layers.7.x`: a "layers" component followed by an index
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# the same inside a name template whose integers became holes (`model.layers.{}.mlp.experts.{}.w1`)
_LAYER_TEMPLATE = re.compile(r"(?:^|\.)layers\.\{\}\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
# `model.layers.3.mlp.experts.slot.17.gate_proj.weight`: physical slot 17 of layer 3's routed experts (placement.py)
_SLOT = re.compile(r"\.experts\.slot\.(\d+)\.")
# the float32 block scale stored beside a block-FP8 weight: `<weight>_scale_inv` (record/fp8.py, runtime/quantize.py)
SCALE_SUFFIX = "_scale_inv"


def layer_of(name: str) -> int:
    """Decoder layer index in a dotted name (`model.layers.7.x` -> 7), -1 when the name is not in a layer."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else -1


def layer_hole(template: str) -> int | None:
    """Index, among a name template's holes, of its layer index (`layers.{}.`), None when it has none."""
    m = _LAYER_TEMPLATE.search(template)
    return template[: m.start()].count("{}") if m else None


def without_layer(name: str, layer: int) -> str:
    """The name with its layer index replaced by `*` (`model.layers.7.x` -> `model.layers.*.x`): equal for the
    same tensor of every layer."""
    return name.replace(f"layers.{layer}.", "layers.*.", 1)


def with_layer(name: str, old: int, new: int) -> str:
    """The name with its layer index `old` replaced by `new` (`model.layers.7.x` -> `model.layers.9.x`)."""
    return name.replace(f"layers.{old}.", f"layers.{new}.", 1)


def expert_of(name: str) -> int | None:
    """`...mlp.experts.17.gate_proj.weight` -> 17; None for non-expert tensors."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


def with_expert(name: str, expert: int | str) -> str:
    """The name with its expert index replaced (`...experts.3.w` -> `...experts.<expert>.w`; `"{}"` makes a
    template); names that hold no expert index are returned unchanged."""
    return _EXPERT.sub(f".experts.{expert}.", name, count=1)


def slot_name(name: str, slot: int) -> str:
    """`...experts.<e>.w` -> `...experts.slot.<slot>.w` (the plan-side name of a physical slot's tensor)."""
    return _EXPERT.sub(f".experts.slot.{slot}.", name, count=1)


def slot_of(name: str) -> int | None:
    """`...experts.slot.17.w` -> 17; None for names that are not a physical slot's."""
    m = _SLOT.search(name)
    return int(m.group(1)) if m else None


def slot_to_expert(name: str, expert: int) -> str:
    """`...experts.slot.<p>.w` -> `...experts.<expert>.w`."""
    m = _SLOT.search(name)
    return f"{name[: m.start()]}.experts.{expert}.{name[m.end() :]}"


def scale_name(weight: str) -> str:
    """The block scale's name of a block-FP8 weight (`x.weight` -> `x.weight_scale_inv`)."""
    return weight + SCALE_SUFFIX


def is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def weight_of_scale(name: str) -> str:
    """The weight a block scale belongs to; other names unchanged."""
    return name.removesuffix(SCALE_SUFFIX)


def group_of(name: str) -> str:
    """Weight group of a checkpoint or parameter name: one decoder layer per group, so a sync can pipeline groups.
    `model.layers.7.x` / `layers.7.x` -> "layers.7"; embeddings -> "embed"; everything else (final norm, lm_head)
    -> "head"."""
    layer = layer_of(name + ".")
    if layer >= 0:
        return f"layers.{layer}"
    return "embed" if "embed" in name else "head"


def group_layer(group: str) -> int:
    """The decoder layer of a weight group (or of a part of one: "layers.3/1" -> 3), -1 for embed/head/others."""
    base = base_group(group)
    return int(base[7:]) if base.startswith("layers.") and base[7:].isdigit() else -1


def base_group(group: str) -> str:
    """The weight group a part of a split group belongs to ("layers.3/1" -> "layers.3")."""
    return group.partition("/")[0]


def group_order(group: str) -> tuple:
    """Sync order: embeddings, then decoder layers by number, then the head (and any other group by name); the parts
    of a split group ("layers.3/0", "layers.3/1": PackLayout's max_group_bytes) in part order, where the group would
    be."""
    base, _, part = group.partition("/")
    part_index = int(part) if part.isdigit() else -1
    if base == "embed":
        return (0, 0, "", part_index)
    layer = group_layer(base)
    if layer >= 0:
        return (1, layer, "", part_index)
    return (2 if base == "head" else 3, 0, base, part_index)
