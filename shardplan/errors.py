"""User-facing errors. Each message says what went wrong, where (model, file, tensor, rank), and what to do."""


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
        line = line[:limit - 3] + "..."
    return f"{name}: {line}" if line else f"{name} (no message)"
