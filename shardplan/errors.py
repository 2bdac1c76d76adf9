"""User-facing errors. Each message says what went wrong, where (model, file, tensor, rank), and what to do."""


class ShardplanError(Exception):
    """Base class for user-facing errors: message says what, where, and what to do."""
