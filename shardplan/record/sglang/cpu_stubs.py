"""Import-time stand-ins that let SGLang import on a CPU-only machine (the .venv-sglang of scripts/setup-sglang.sh).

SGLang's config package imports `torchvision.transforms` (multimodal preprocessing) at module import, and PyPI's
torchvision wheels are CUDA builds that fail to import beside torch's CPU build ("operator torchvision::nms does not
exist"). Text models never call it, so a module that raises on use is enough. Installed only when the real
torchvision cannot be imported; never on a machine that has a working one.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

_SUBMODULES = (
    "transforms",
    "transforms.functional",
    "transforms.v2",
    "transforms.v2.functional",
    "io",
    "ops",
    "transforms.InterpolationMode",
)


class _Missing(types.ModuleType):
    """A module whose every attribute is a submodule-like stand-in that raises when called."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _Missing(f"{self.__name__}.{name}")
        sub.__spec__ = importlib.machinery.ModuleSpec(sub.__name__, None)
        setattr(self, name, sub)
        return sub

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self.__name__}: torchvision is stubbed in this CPU environment "
            f"(shardplan/record/sglang/cpu_stubs.py); text models do not use it"
        )


def _torchvision_works() -> bool:
    if "torchvision" in sys.modules:
        return not isinstance(sys.modules["torchvision"], _Missing)
    try:
        import torchvision  # noqa: F401

        return True
    except Exception:  # ImportError, or RuntimeError from a CUDA build's ops registration
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        return False


def install() -> None:
    """Make `import torchvision` work for SGLang's imports when the real one cannot be imported here."""
    if _torchvision_works():
        return
    root = _Missing("torchvision")
    root.__version__ = "0.0.0+shardplan-stub"
    root.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)
    root.__path__ = []
    sys.modules["torchvision"] = root
    for name in _SUBMODULES:
        parent = root
        for part in name.split("."):
            parent = getattr(parent, part)
            sys.modules[parent.__name__] = parent
