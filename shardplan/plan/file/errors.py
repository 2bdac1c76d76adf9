"""The plan-file errors: one class per cause (docs/plan-format.md, "Validation"). Each message names the file (and
the field), says what is wrong, and points at the docs to re-record."""

from __future__ import annotations

from shardplan.errors import PlanError, ShardplanError


def advice(path) -> str:
    return (
        f"Re-record it with `shardplan record` (docs/recording.md; the format is docs/plan-format.md), "
        f"or delete {path}."
    )


class PlanFileError(ShardplanError):
    """Base of every plan-file error; the message names the file and says how to re-record."""


class PlanTruncated(PlanFileError):
    """The file is shorter than its preamble declares."""


class PlanOversize(PlanFileError):
    """The file is longer than its preamble declares (trailing bytes)."""


class PlanChecksumError(PlanFileError):
    """The sha256 at the end of the file does not match the bytes before it."""


class PlanFormatVersionError(PlanFileError):
    pass


class PlanCorrupt(PlanFileError):
    """The bytes are sealed but do not have the documented structure."""


class PlanFieldError(PlanCorrupt):
    """A header or body field has the wrong type or lies outside its documented range."""


class PlanNotCanonical(PlanCorrupt):
    """Valid fields, but not the bytes the canonical writer produces for them."""


class PlanLimitError(PlanFileError):
    """A declared size, count or nesting beyond the reader's limits, or an index expanding beyond what is declared."""


class PlanOpNotAllowed(PlanFileError):
    pass


class PlanBoundsError(PlanFileError, PlanError):
    """A box outside its tensor, empty, negative or self-overlapping: raised at load (plan/file/rank.py, bounds.py) and
    at replay (runtime/replay.py, runtime/apply.py: a plan built in memory), so it is a PlanError too."""


class PlanUnreadable(PlanFileError):
    """The path is not a readable regular file (missing, dangling symlink, symlink loop, directory, FIFO, device)."""


class PlanRankNotCovered(PlanFileError):
    pass


class PlanWriteError(PlanFileError):
    pass
