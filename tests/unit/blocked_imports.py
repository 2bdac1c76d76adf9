"""Run Python code in a fresh interpreter where vLLM, transformers and safetensors cannot be imported: what the
trainer side (plan files, runtime, sync, transports, the engine's trainer half, the simulator) must work with."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = ("vllm", "transformers", "safetensors")

_PRELUDE = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {BLOCKED!r}:
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
"""
_EPILOGUE = f"""
assert not any(m.split('.')[0] in {BLOCKED!r} for m in sys.modules)
"""


def run_without_vllm(body: str, timeout: float = 600) -> str:
    """Run `body` with the packages blocked (and check none got imported); its stdout. Fails the test on an error."""
    code = _PRELUDE + textwrap.dedent(body) + _EPILOGUE
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout
