"""Parallel layout of the inference engine: which rank is which, without vLLM.

vLLM numbers ranks as world = dp x pp x tp with tp fastest (initialize_model_parallel); the expert-parallel group of a
pipeline stage is its dp x tp ranks. Plans are keyed by the global rank in that numbering.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardplan.errors import ShardplanError


class LayoutError(ShardplanError):
    pass


@dataclass(frozen=True, kw_only=True)
class Layout:
    tp: int = 1
    """tensor-parallel size"""
    pp: int = 1
    """pipeline-parallel size"""
    dp: int = 1
    """data-parallel size (matters for the expert-parallel group only)"""
    ep: bool = False
    """vLLM's enable_expert_parallel: experts are split over the dp x tp ranks of a stage instead of TP-sliced"""

    def __post_init__(self):
        for field_name in ("tp", "pp", "dp"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"--{field_name} must be a positive integer, got {value!r}")
        if not isinstance(self.ep, bool):
            raise LayoutError(f"ep (--ep) must be True or False, got {self.ep!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """global rank -> (dp_rank, pp_rank, tp_rank)"""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the layout {self} (world size {self.world_size})")
        dp_rank, rest = divmod(rank, self.pp * self.tp)
        pp_rank, tp_rank = divmod(rest, self.tp)
        return dp_rank, pp_rank, tp_rank

    def rank_of(self, *, dp_rank: int = 0, pp_rank: int = 0, tp_rank: int = 0) -> int:
        return dp_rank * self.pp * self.tp + pp_rank * self.tp + tp_rank

    def ep_ranks(self, rank: int) -> list[int]:
        _, pp_rank, _ = self.coords(rank)
        return [self.rank_of(dp_rank=d, pp_rank=pp_rank, tp_rank=t) for d in range(self.dp) for t in range(self.tp)]

    def tag(self) -> str:
        """Short, file-name-safe description: tp32-ep, tp8-pp2, ..."""
        parts = [f"tp{self.tp}"]
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        if self.dp > 1:
            parts.append(f"dp{self.dp}")
        if self.ep:
            parts.append("ep")
        return "-".join(parts)

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep}

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        """Exact types only: `"ep": "false"` or `"tp": 2.0` is refused, never coerced."""
        if (
            not isinstance(d, dict)
            or set(d) != {"tp", "pp", "dp", "ep"}
            or type(d["ep"]) is not bool
            or any(type(d[k]) is not int for k in ("tp", "pp", "dp"))
        ):
            raise LayoutError(f"a layout is {{tp: int, pp: int, dp: int, ep: bool}}, got {d!r}")
        return cls(tp=d["tp"], pp=d["pp"], dp=d["dp"], ep=d["ep"])

    def __str__(self) -> str:
        return self.tag()


def parse_ranks(text: str | None, world_size: int) -> list[int]:
    """'0,3-5' -> [0, 3, 4, 5]; None or 'all' -> all ranks. Empty items, reversed ranges and ranks outside the world
    are refused: a typo must not record an empty or partial plan."""
    if text is None or text.strip() == "all":
        return list(range(world_size))
    ranks: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise LayoutError(
                        f"--ranks {text!r}: {part!r} is a reversed range (it holds no rank); write {hi}-{lo}"
                    )
                ranks.update(range(lo, hi + 1))
            else:
                ranks.add(int(part))
        except ValueError:
            raise LayoutError(
                f"--ranks {text!r}: cannot parse {part!r}; use a list like 0,3-5 (ranks 0..{world_size - 1}, or 'all')"
            ) from None
    bad = sorted(r for r in ranks if not 0 <= r < world_size)
    if bad:
        raise LayoutError(f"--ranks: {bad} outside 0..{world_size - 1} for world size {world_size}")
    return sorted(ranks)
