"""An import-only stand-in for torchvision, for recording on a CPU machine only (docs/coverage.md, README set-up).

vLLM's CPU build lists torchvision, but PyPI serves only CUDA-linked torchvision wheels, which fail to import beside
torch's CPU build ("operator torchvision::nms does not exist"), and the CPU wheels live on download.pytorch.org.
Text decoders never run torchvision: vLLM's Qwen3.5 / Qwen4-Exp modules import it only through transformers' image
processors. `shardplan.record.cpushim.activate` puts this directory on the path when no real torchvision imports.
Every name of every `torchvision.*` module resolves to a placeholder; calling one (or anything but reading more
attributes) raises `TorchvisionShimCalled`, naming it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+shardplan.shim"
SHIM = True


class TorchvisionShimCalled(RuntimeError):
    """Code ran torchvision while shardplan's import-only stand-in was installed."""


class _Absent:
    """torchvision.<path>: attributes chain into more placeholders; any use raises TorchvisionShimCalled."""

    def __init__(self, path: str):
        self._path = path

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{self._path}.{name}")

    def __call__(self, *args, **kwargs):
        raise TorchvisionShimCalled(
            f"{self._path} was called, but torchvision here is shardplan's import-only stand-in "
            f"(shardplan/record/cpushim): no real torchvision imports beside this torch. Recording text decoders "
            f"never needs it; for anything else install the torchvision build matching your torch."
        )

    def __mro_entries__(self, bases):
        return (object,)  # a class deriving from a torchvision class still defines; its use of the base does not

    def __repr__(self) -> str:
        return f"<torchvision shim {self._path}>"


def _module_getattr(module_name: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{module_name}.{name}")

    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every torchvision.* submodule as a module of placeholders."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__getattr__ = _module_getattr(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


__getattr__ = _module_getattr("torchvision")
if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())
