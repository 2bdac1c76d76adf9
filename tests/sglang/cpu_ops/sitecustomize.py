"""Test-only start-up hook for the processes of a live SGLang CPU engine (PYTHONPATH=tests/sglang/cpu_ops):
* torchvision: shardplan's import-only stand-in (shardplan/record/cpushim: PyPI's CUDA build cannot import beside
  CPU torch, and SGLang's config package imports torchvision.transforms);
* SGLang 0.5.23's CPU engine at tp_size > 1 builds a PyNccl communicator for every group (use_pynccl defaults on),
  which raises on a CPU: groups are made with use_pynccl=False (gloo does the collectives)."""

import importlib.abc
import importlib.util
import os
import sys

try:
    from shardplan.record import cpushim

    cpushim.activate()
except ImportError:
    pass

_TARGET = "sglang.srt.distributed.parallel_state"


class _NoPynccl(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def patched_exec(module):
            exec_module(module)
            make = module.init_model_parallel_group

            def init_model_parallel_group(*args, **kwargs):
                kwargs["use_pynccl"] = False
                return make(*args, **kwargs)

            module.init_model_parallel_group = init_model_parallel_group

        spec.loader.exec_module = patched_exec
        return spec


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    sys.meta_path.insert(0, _NoPynccl())
