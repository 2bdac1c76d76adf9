"""Errors of the live-engine integration, importable on both sides (no vLLM here).

Worker-side errors cross vLLM's collective_rpc as text; `raise_named` on the trainer side turns the text back into
the named class so callers can `except EnginePlanMismatch` whether the check ran in this process or in a worker.
"""

from __future__ import annotations

import re

from shardplan.errors import ShardplanError


class EngineError(ShardplanError):
    """Base of the live-engine integration's errors."""


class EnginePlanMismatch(EngineError):
    """The plan does not describe the live engine (other model config, layout, dtype, vLLM version or params); the
    message names the field, both values and how to get a matching plan."""


class EplbRebalanceInFlight(EngineError):
    """An asynchronous EPLB rebalance may be in flight and cannot be drained: writing now could be undone by it."""


class EplbPlacementChanged(EngineError):
    """The engine's placement changed while an update was being applied: its slots may hold the wrong experts."""


class EplbPlacementUnavailable(EngineError):
    """The engine runs EPLB but its placement cannot be read (no EPLB state on its MoE layers)."""


class EngineUnsupported(EngineError):
    """The engine or model uses something the backend cannot update correctly (named in the message)."""


class EngineNotInitialized(EngineError):
    """A weight update was asked of a backend whose init_weight_transfer_engine has not run (or failed)."""


class SyncIncomplete(EngineError):
    """A sync did not complete on every engine. `report` (an EngineSyncReport) says which engines hold which state;
    engines that did not complete stay paused, with weight version "<v>:incomplete", until a later sync completes or
    the caller resumes them knowingly (EngineSync.resume(force=True))."""

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report

    def __reduce__(self):
        return (SyncIncomplete, (str(self), self.report))


class EngineControlUnreachable(EngineError):
    """A worker could not reach the sync's control channel within the init's timeout_s (a wrong control_host or
    control_port, or the driver is gone); the engine keeps the sync it had."""


class EngineCallFailed(EngineError):
    """An engine call (RPC or HTTP route) failed for a reason that is not one of the named errors above."""


class EngineUpdateFailed(EngineError):
    """A worker's update did not complete, as its state says (its sync failed: a dead or slow peer, a checksum
    mismatch, an apply or processing error), for a reason that is not one of the named errors above."""


_NAMED = {
    cls.__name__: cls
    for cls in (
        EnginePlanMismatch,
        EplbRebalanceInFlight,
        EplbPlacementChanged,
        EplbPlacementUnavailable,
        EngineUnsupported,
        EngineNotInitialized,
        EngineControlUnreachable,
    )
}


def raise_named(error: BaseException, what: str, unnamed: type[EngineError] | None = None) -> None:
    """Re-raise an engine call's failure as the named error it carries (collective_rpc and HTTP flatten worker
    exceptions into text), else as `unnamed` with the text (a failure read from worker states) or EngineCallFailed;
    always names the call."""
    text = str(error)
    match = re.search(r"\b(" + "|".join(_NAMED) + r")\b:?\s*(.*)", text, re.S)
    if match:
        raise _NAMED[match.group(1)](f"{what}: {match.group(2).strip()[:2000]}") from error
    if unnamed is not None:
        raise unnamed(f"{what}: {text[:2000]}") from error
    raise EngineCallFailed(f"{what} failed: {type(error).__name__}: {text[:2000]}") from error
