"""Test-only start-up hook for the processes of a live SGLang CPU engine (PYTHONPATH=tests/sglang/cpu_ops):
* torchvision: shardplan's import-only stand-in (shardplan/record/cpushim: PyPI's CUDA build cannot import beside
  CPU torch, and SGLang's config package imports torchvision.transforms);
* SGLang 0.5.23's CPU engine at tp_size > 1 builds a PyNccl communicator for every group (use_pynccl defaults on),
  which raises on a CPU: groups are made with use_pynccl=False (gloo does the collectives);
* SGLang's platform fact `has_amx` (its `intel_amx` attention backend falls back to torch_native without it) is
  answered True: this box has AMX tiles but no CPU sgl-kernel, and the shim in sgl_kernel/ supplies that backend's
  two attention kernels. Read only there (and by GPT-OSS's defaults); the layers' own AMX paths ask sgl-kernel for
  `convert_weight_packed`, which the shim leaves out, so they stay off."""

import importlib.abc
import importlib.util
import os
import sys

try:
    from shardplan.record import cpushim

    cpushim.activate()
except ImportError:
    pass


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` once, right after the module `target` is first executed."""

    def __init__(self, target, then):
        self.target, self.then = target, then

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def patched_exec(module):
            exec_module(module)
            self.then(module)

        spec.loader.exec_module = patched_exec
        return spec


def _no_pynccl(module):
    make = module.init_model_parallel_group

    def init_model_parallel_group(*args, **kwargs):
        kwargs["use_pynccl"] = False
        return make(*args, **kwargs)

    module.init_model_parallel_group = init_model_parallel_group


def _amx_attention(module):
    module.override_platform(has_amx=True).install()


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    sys.meta_path.insert(0, _AfterImport("sglang.srt.distributed.parallel_state", _no_pynccl))
    sys.meta_path.insert(0, _AfterImport("sglang.srt.runtime_context", _amx_attention))
