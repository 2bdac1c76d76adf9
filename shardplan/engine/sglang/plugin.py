"""SGLang general plugin (entry point group `sglang.srt.plugins` in pyproject.toml): SGLang calls `register` in every
process it starts (engine/server, schedulers, detokenizer) before serving. Opt-in: it registers the loader only where
the server's environment says SHARDPLAN_SGLANG=1 (SGLang loads every installed plugin; its plugins take no server
flag), so that an SGLang server in an environment where shardplan happens to be installed takes no shardplan update.

It adds the shardplan loader (`shardplan.engine.sglang.loader.load`) to every TP worker's custom weight loaders,
as `--custom-weight-loader shardplan.engine.sglang.loader.load` would (that flag keeps working, e.g. where plugins
are restricted by SGLANG_PLUGINS; it is then not added twice). Through SGLang's own hook registry: an AFTER hook on
`ModelRunner.init_weight_updater`, where SGLang copies the server args' list into the worker's WeightUpdater.
"""

from __future__ import annotations

import logging
import os

from shardplan.engine.sglang.commands import LOAD_FORMAT

TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.init_weight_updater"


def _add_loader(result, runner, *args, **kwargs):
    updater = runner.weight_updater
    loaders = updater.custom_weight_loaders
    if loaders is None:  # a frozen dataclass: SGLang reads this attribute at every update
        object.__setattr__(updater, "custom_weight_loaders", [LOAD_FORMAT])
    elif LOAD_FORMAT not in loaders:
        loaders.append(LOAD_FORMAT)  # the list SGLang itself consults (load_format in custom_weight_loaders)
    return result


def register() -> None:
    if os.environ.get("SHARDPLAN_SGLANG") != "1":
        why = "set SHARDPLAN_SGLANG=1 in the server's environment to opt in, or pass --custom-weight-loader"
        logging.getLogger("shardplan.engine.sglang").info("shardplan: SGLang loader not registered (%s)", why)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not any(hook is _add_loader for _, hook, _ in HookRegistry._hooks.get(TARGET, ())):
        HookRegistry.register(TARGET, _add_loader, HookType.AFTER)
