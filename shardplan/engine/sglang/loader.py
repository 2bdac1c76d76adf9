"""Inside a live SGLang engine: a weight loader that writes a shardplan buffer into this worker's params.

SGLang runs `--custom-weight-loader` functions in every TP worker as `update_weights_from_tensor(named_tensors,
load_format="shardplan.engine.sglang.loader.load")`, between `begin_weight_update()` (restores packed layouts) and
`end_weight_update()` (re-runs `process_weights_after_loading`, and `post_load_weights` since the loader was
bypassed). Each worker gets one tensor: the packed bytes of its own rank (`Replayer.pack` on the trainer), named
`shardplan:<plan file path>`. The plan is checked against the engine before a byte is written (engine, version,
layout, recording options): a mismatch raises, naming each difference, and nothing is applied.
"""

from __future__ import annotations

import functools
import os

import torch

from shardplan.engine.errors import EnginePlanMismatch
from shardplan.plan.file.engines import engine_name
from shardplan.plan.file.format import PlanFile
from shardplan.plan.file.store import installed_engine_version
from shardplan.record.sglang.options import SglangOptions
from shardplan.runtime.apply import Applier
from shardplan.runtime.pack import PackLayout

PREFIX = "shardplan:"
LOAD_FORMAT = "shardplan.engine.sglang.loader.load"


@functools.cache
def _plan(path: str) -> PlanFile:
    return PlanFile.read(path)


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


def load(model: torch.nn.Module, named_tensors) -> None:
    from sglang.srt.runtime_context import get_context, get_parallel

    parallel = get_parallel()
    world_rank = parallel.pp_rank * parallel.tp_size + parallel.tp_rank
    server_args = get_context().server_args
    cpu_engine = os.environ.get("SGLANG_USE_CPU_ENGINE", "") == "1"
    for name, buffer in named_tensors:
        if not name.startswith(PREFIX):
            raise EnginePlanMismatch(f"the shardplan loader takes tensors named '{PREFIX}<plan path>', got {name!r}")
        plan_file = _plan(name[len(PREFIX) :])
        problems = plan_problems(plan_file, server_args, [world_rank], cpu_engine)
        if problems:  # the trainer side checked first (client.check_engine): reaching here is a bug, stop loudly
            raise EnginePlanMismatch(f"{plan_file.path} does not match this SGLang engine: " + "; ".join(problems))
        plan = plan_file.rank(world_rank)
        params = dict(model.named_parameters())
        with torch.no_grad():
            Applier(plan, PackLayout.from_plans(plan), params).apply(buffer.to(params[plan.params[0].name].device))
