#!/usr/bin/env bash
# Create .venv-light: torch 2.13.0 (CPU) and the [test] extra, nothing else: the trainer side and its unit tests
# (`make test-fast`) need no vLLM, SGLang, Ray or Mooncake, so this sets up in about a minute (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-light}
stamp="$VENV/.shardplan-light-setup-v1"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup-light.sh ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
$PIP install -q torch==2.13.0 -e '.[test]' 2>&1 | grep -v "is ignored: it is neither" || true
"$VENV/bin/python" - <<'PY'
import importlib.util, torch, msgpack, hypothesis
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert importlib.util.find_spec("vllm") is None, "the light venv must stay free of vLLM"
print(f"shardplan light setup: torch {torch.__version__}")
PY
touch "$stamp"
