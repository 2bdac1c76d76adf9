# Two entry points; both create .venv on first use (scripts/setup.sh).
PY := .venv/bin/python
# keep all test traffic on loopback (Ray, gloo, UCX/NIXL, Mooncake)
export GLOO_SOCKET_IFNAME := lo
export UCX_NET_DEVICES := lo
export RAY_ENABLE_UV_RUN_RUNTIME_ENV := 0

.PHONY: setup demo test test-unit test-gpu plans bench-record bench-compile

setup:
	@bash scripts/setup.sh

# The main job on a built-in default: record Kimi-K2 (real dims, meta device) for all 32 ranks of TP32+EP,
# then inspect the plan.
demo: setup
	$(PY) -m shardplan.cli record --model kimi-k2 --tp 32 --ep --out out/
	$(PY) -m shardplan.cli inspect out/kimi-k2--tp32-ep--bfloat16.plan --rank 0 --max-lines 20

test: setup
	$(PY) -m pytest -q -p no:cacheprovider --nbmake tests notebooks

# The CPU unit tests alone (no vLLM, no processes): tests/unit.
test-unit: setup
	$(PY) -m pytest -q -p no:cacheprovider tests/unit

# The GPU tier (tests/gpu: replay, apply, the fused FP8 kernel, devices, shipped plans on CUDA). Runs on a CUDA
# machine with the python that has torch there (no .venv, no vLLM: GPU_PY=python3 by default); CI has no GPU, so its
# log goes to bench/results/test-gpu-<commit>.log, to be committed (COMMIT= names the commit where git is absent).
GPU_PY ?= python3
COMMIT ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
test-gpu: SHELL := /bin/bash
test-gpu:
	set -o pipefail; $(GPU_PY) -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee bench/results/test-gpu-$(COMMIT).log

# Regenerate every plan shipped in plans/.
plans: setup
	$(PY) scripts/make_plans.py

bench-record: setup
	$(PY) bench/record_bench.py --model kimi-k2 --tp 32

bench-compile: setup
	$(PY) bench/compile_bench.py
