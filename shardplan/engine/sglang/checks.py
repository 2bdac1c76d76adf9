"""Whether a plan fits a live SGLang engine, from its server args: both sides run it (the trainer side on the engine's
`get_server_info`, each worker on its own server args). No SGLang import."""

from __future__ import annotations

from types import SimpleNamespace

from shardplan.engine.errors import EnginePlanMismatch
from shardplan.plan.file.engines import engine_name
from shardplan.plan.file.format import PlanFile
from shardplan.plan.file.store import installed_engine_version
from shardplan.record.sglang.options import SglangOptions


def plan_problems(plan_file: PlanFile, server_args, world_ranks, cpu_engine: bool) -> list[str]:
    """Every difference between the plan and an engine with these server args (empty: it matches)."""
    h = plan_file.header
    if engine_name(h) != "sglang":
        return [f"it records {engine_name(h)}'s loaders, not SGLang's (record it with `--engine sglang`)"]
    problems = []
    here = installed_engine_version("sglang")
    if here and h.engine.version.split("+")[0] != here:
        problems.append(f"SGLang version: plan {h.engine.version}, engine {here}")
    if (h.layout.tp, h.layout.pp) != (int(server_args.tp_size), int(server_args.pp_size)):
        problems.append(f"layout: plan {h.layout.tag()}, engine tp{server_args.tp_size} pp{server_args.pp_size}")
    problems += SglangOptions.from_engine_info(h.engine).differences(
        SglangOptions.from_server_args(server_args, cpu_engine)
    )
    missing = sorted(set(world_ranks) - set(h.ranks))
    if missing:
        problems.append(f"ranks {missing} are not covered (plan ranks {list(h.ranks)})")
    return problems


def check_server_info(info: dict, plan_file: PlanFile) -> None:
    """EnginePlanMismatch naming every difference between the plan and an engine's resolved server args."""
    server_args = SimpleNamespace(**{k: info.get(k) for k in SglangOptions.layout_server_args()})
    world = range(int(server_args.tp_size) * int(server_args.pp_size))
    problems = plan_problems(plan_file, server_args, world, info.get("device") == "cpu")
    if problems:
        raise EnginePlanMismatch(
            f"{plan_file.path} does not match this SGLang engine: "
            + "; ".join(problems)
            + ". Record the plan with the engine's server args (docs/sglang.md); nothing was sent."
        )
