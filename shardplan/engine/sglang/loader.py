"""Inside a live SGLang engine: the shardplan weight loader, run in every TP worker.

SGLang runs custom weight loaders (registered by the `sglang.srt.plugins` entry point, shardplan.engine.sglang.plugin,
or by hand with `--custom-weight-loader shardplan.engine.sglang.loader.load`) as `update_weights_from_tensor(
named_tensors, load_format="shardplan.engine.sglang.loader.load")`, between `begin_weight_update()` (restores packed
layouts) and `end_weight_update()` (re-runs `process_weights_after_loading`). It skips `post_load_weights` after a
tensor update, so the loader runs it itself after writing. Two kinds of entries (commands.py):

* `shardplan-sync:<command>`: the sync engine (shardplan.engine.sglang.worker: init / update as consumer<rank>);
* `shardplan:<plan file path>` with this rank's packed bytes (`Replayer.pack` on a colocated trainer, client.push):
  the plan is checked against the engine before a byte is written (engine, version, layout, recording options).
"""

from __future__ import annotations

import os

import torch

from shardplan.engine.errors import EnginePlanMismatch
from shardplan.engine.sglang import worker
from shardplan.engine.sglang.checks import plan_problems
from shardplan.engine.sglang.commands import COMMAND, LOAD_FORMAT, PREFIX  # noqa: F401 - LOAD_FORMAT: importers
from shardplan.runtime.apply import Applier
from shardplan.runtime.pack import PackLayout

MIXED = "a call that mixes shardplan-sync commands with weight bytes is refused (send each in a call of its own)"


def load(model: torch.nn.Module, named_tensors) -> None:
    """SGLang's custom loader; never raises (an exception here kills SGLang's scheduler): a command is answered in its
    control channel (worker.run), a failed push is logged by name and kept in the worker's state (worker.failed)."""
    try:
        named_tensors = list(named_tensors)
        commands = [name for name, _ in named_tensors if name.startswith(COMMAND)]
        mixed = bool(commands) and (len(commands) < len(named_tensors) or any(t.numel() for _, t in named_tensors))
        for name in commands:
            worker.run(model, name, MIXED if mixed else "")
        if not commands:
            push(model, named_tensors)
            worker._ERROR = ""
    except Exception as e:  # noqa: BLE001 - see the doc
        worker.failed(f"{type(e).__name__}: {e}")


def push(model: torch.nn.Module, named_tensors) -> None:
    from sglang.srt.model_loader.loader import post_load_weights
    from sglang.srt.runtime_context import get_context

    world_rank, server_args = worker.world_rank(), get_context().server_args
    cpu_engine = os.environ.get("SGLANG_USE_CPU_ENGINE", "") == "1"
    for name, buffer in named_tensors:
        if not name.startswith(PREFIX):
            raise EnginePlanMismatch(f"the shardplan loader takes '{PREFIX}<plan path>' entries, not {name[:200]!r}")
        plan_file = worker.read_plan(name[len(PREFIX) :])
        problems = plan_problems(plan_file, server_args, [world_rank], cpu_engine)
        if problems:  # the trainer side checked first (client.check_engine)
            raise EnginePlanMismatch(f"{plan_file.path} does not match this SGLang engine: " + "; ".join(problems))
        plan = plan_file.rank(world_rank)
        params = dict(model.named_parameters())
        with torch.no_grad():
            Applier(plan, PackLayout.from_plans(plan), params).apply(buffer.to(params[plan.params[0].name].device))
    with torch.no_grad():
        post_load_weights(model)  # SGLang skips it after update_weights_from_tensor; derived tensors follow params
