"""The import-only torchvision stand-in (shardplan/record/cpushim): with no torchvision installed, the recorder's
first vLLM/transformers import puts it on the path, so vLLM's Qwen3.5 modules import (transformers' image
processors import torchvision); calling anything in it raises a named error; a spawned process inherits it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None
    and "cpushim" not in (importlib.util.find_spec("torchvision").origin or ""),
    reason="a real torchvision is installed: the stand-in is never activated",
)

CODE = """
import importlib, os, subprocess, sys
import shardplan.record.configs   # activates the stand-in
from shardplan.record import cpushim
assert cpushim.active()
import vllm.model_executor.models.qwen3_5   # imports torchvision through transformers' qwen2_vl image processor
import torchvision.transforms.v2.functional as F
try:
    F.resize(None, [2, 2])
except Exception as e:
    assert type(e).__name__ == "TorchvisionShimCalled" and "transforms.v2.functional.resize" in str(e), e
else:
    raise AssertionError("calling the stand-in did not raise")
child = subprocess.run([sys.executable, "-c", "import torchvision; print(torchvision.SHIM)"], capture_output=True,
                       text=True, env=os.environ)
assert child.stdout.strip() == "True", child.stderr
print("ok")
"""


def test_qwen3_5_imports_and_the_shim_raises_by_name():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
