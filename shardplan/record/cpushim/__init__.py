"""Import-only stand-ins for what vLLM's CPU build lists but a CPU machine cannot import from PyPI (record side only).

`activate()` appends this directory to `sys.path` and to `PYTHONPATH` (vLLM inspects model classes in a subprocess)
when no torchvision is installed, so `import torchvision` finds the stand-in in ./torchvision; a real torchvision,
when installed, comes first on the path and wins. Only the recorder activates it (`record.configs`, the first
record module that imports vLLM or transformers); the trainer side never imports this package.
"""

from __future__ import annotations

import importlib.util
import os
import sys

__all__ = ["SHIM_DIR", "activate", "active"]

SHIM_DIR = os.path.dirname(os.path.abspath(__file__))


def activate() -> bool:
    """Put the stand-ins on the path where the real packages are missing; True when the torchvision stand-in is used."""
    if SHIM_DIR in sys.path:
        return True
    if importlib.util.find_spec("torchvision") is not None:
        return False
    sys.path.append(SHIM_DIR)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if SHIM_DIR not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, SHIM_DIR])
    return True


def active() -> bool:
    """Whether `torchvision` resolves to the stand-in in this process."""
    spec = importlib.util.find_spec("torchvision")
    return spec is not None and spec.origin is not None and spec.origin.startswith(SHIM_DIR)
