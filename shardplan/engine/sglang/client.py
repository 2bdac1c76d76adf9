"""Trainer side of a shardplan update of an in-process SGLang `sgl.Engine` (no SGLang import: the engine is given).

The plan is checked against the engine's own resolved server args (`get_server_info()`) before a byte is packed: an
exception inside SGLang's worker-side loader would kill the engine's scheduler, so a mismatch must be refused here,
naming each difference (EnginePlanMismatch), with nothing sent. Then each rank's bytes are packed from HF-named
tensors (`Replayer.pack`) and pushed between begin/end_weight_update to `shardplan.engine.sglang.loader.load`.
Colocated only (CPU shared memory / CUDA IPC through `update_weights_from_tensor`); `EngineSync` and the sync
engine's transports do not drive SGLang engines yet (docs/sglang.md).
"""

from __future__ import annotations

from types import SimpleNamespace

from shardplan.engine.errors import EnginePlanMismatch
from shardplan.engine.sglang.loader import LOAD_FORMAT, PREFIX, plan_problems
from shardplan.plan.file.format import PlanFile
from shardplan.runtime.replay import Replayer


def check_engine(llm, plan_file: PlanFile) -> None:
    info = llm.get_server_info()
    server_args = SimpleNamespace(
        **{
            k: info.get(k)
            for k in (
                "tp_size",
                "pp_size",
                "ep_size",
                "dp_size",
                "enable_dp_attention",
                "enable_dp_lm_head",
                "moe_dense_tp_size",
                "moe_runner_backend",
                "moe_a2a_backend",
                "ep_num_redundant_experts",
            )
        }
    )
    world = range(int(server_args.tp_size) * int(server_args.pp_size))
    problems = plan_problems(plan_file, server_args, world, info.get("device") == "cpu")
    if problems:
        raise EnginePlanMismatch(
            f"{plan_file.path} does not match this SGLang engine: "
            + "; ".join(problems)
            + ". Record the plan with the engine's server args (docs/sglang.md); nothing was "
            "sent."
        )


def push(llm, plan_path: str, tensors) -> tuple:
    """One version: check, pack every rank's bytes, update the engine inside begin/end_weight_update."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
    from sglang.srt.utils import MultiprocessingSerializer

    plan_file = PlanFile.read(plan_path)
    check_engine(llm, plan_file)
    buffers = [Replayer(plan_file.rank(r), plan_file.sources).pack(tensors) for r in plan_file.header.ranks]
    payload = LocalSerializedTensor(values=[MultiprocessingSerializer.serialize(b) for b in buffers])
    llm.begin_weight_update()
    try:
        return llm.update_weights_from_tensor([(PREFIX + str(plan_path), payload)], load_format=LOAD_FORMAT)
    finally:
        llm.end_weight_update()
