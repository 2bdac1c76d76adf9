"""User-facing errors. Each message says what went wrong, where (model, file, tensor, rank), and what to do.

The base class, and the errors of replaying a plan: both the reference interpreter (plan/interp.py) and the runtime
(runtime/) raise them, so they live below both."""


class ShardplanError(Exception):
    """Base class for user-facing errors: message says what, where, and what to do."""


def exception_text(exc: BaseException, limit: int = 300) -> str:
    """One line that says what `exc` is, for a message that quotes a foreign exception: `Type: first line`, or
    `Type (no message)`. Never raises, whatever the exception holds (an empty message, non-str args, a __str__
    that itself fails)."""
    name = type(exc).__name__
    try:
        text = str(exc)
    except Exception:  # a broken __str__: its args are still data
        try:
            text = repr(exc.args)
        except Exception:
            text = ""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "") if isinstance(text, str) else ""
    if len(line) > limit:
        line = line[: limit - 3] + "..."
    return f"{name}: {line}" if line else f"{name} (no message)"


class ReplayError(ShardplanError):
    """Base class for errors raised while replaying or packing a plan."""


class DisallowedOpError(ReplayError):
    """A plan names an op outside `ir.ALLOWED_OPS` (plans name ops, never carry code)."""


class PlanError(ReplayError):
    """The plan itself is inconsistent (unknown source, out-of-bounds region, unbroadcastable write)."""


class ForeignWriteError(DisallowedOpError):
    """A plan would write into a tensor it did not make (an in-place op on a trainer tensor or a view of one, an
    `out=` argument): replay never modifies the trainer's tensors (`ir.foreign_write`)."""


class PlanTooLarge(PlanError):
    """A computed write would make a tensor larger than its plan declares room for (plan/interp.py:
    check_write_sizes)."""


class MissingTensorError(ReplayError):
    """A tensor the plan reads (trainer side) or writes (consumer side) was not given."""
