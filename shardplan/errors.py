"""User-facing errors. Each message says what went wrong, where (model, file, tensor, rank), and what to do.

The base class, and the errors of replaying a plan: both the reference interpreter (plan/interp.py) and the runtime
(runtime/) raise them, so they live below both."""


class ShardplanError(Exception):
    """Base class for user-facing errors: message says what, where, and what to do."""


class ReplayError(ShardplanError):
    """Base class for errors raised while replaying or packing a plan."""


class DisallowedOpError(ReplayError):
    """A plan names an op outside `ir.ALLOWED_OPS` (plans name ops, never carry code)."""


class PlanError(ReplayError):
    """The plan itself is inconsistent (unknown source, out-of-bounds region, unbroadcastable write)."""


class MissingTensorError(ReplayError):
    """A tensor the plan reads (trainer side) or writes (consumer side) was not given."""
