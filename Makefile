# Two entry points; both create .venv on first use (scripts/setup.sh).
PY := .venv/bin/python
# SGLang's loaders and tests live in their own venv (its torch pin cannot share vLLM's): scripts/setup-sglang.sh
SGL_PY := .venv-sglang/bin/python
# keep all test traffic on loopback (Ray, gloo, UCX/NIXL, Mooncake)
export GLOO_SOCKET_IFNAME := lo
export UCX_NET_DEVICES := lo
export RAY_ENABLE_UV_RUN_RUNTIME_ENV := 0

# the trainer side's own venv (torch + the [test] extra, no vLLM): scripts/setup-light.sh
LIGHT_PY := .venv-light/bin/python

.PHONY: setup setup-sglang setup-light demo test test-fast test-unit test-sglang test-gpu lint plans bench-record bench-compile

setup:
	@bash scripts/setup.sh

setup-sglang:
	@bash scripts/setup-sglang.sh

setup-light:
	@bash scripts/setup-light.sh

# The main job on a built-in default: record Kimi-K2 (real dims, meta device) for all 32 ranks of TP32+EP,
# then inspect the plan.
demo: setup
	$(PY) -m shardplan.cli record --model kimi-k2 --tp 32 --ep --out out/
	$(PY) -m shardplan.cli inspect out/kimi-k2--tp32-ep--bfloat16.plan --rank 0 --max-lines 20

# The whole suite (what CI runs after `make lint`): ~35 min on a 2-core box with the venvs built. Two pytest-xdist
# workers: most tests wait on engine processes rather than compute. tests/ and notebooks/ go a file at a time to a
# worker (--dist loadfile: a module's shared engine starts once); tests/sglang shares no engine between tests, so a
# test at a time (--dist load) and its live-engine cases, all in one file, run two at once. --durations: the slowest
# tests and the total; conftest.py fails the run when a test passes its time budget.
XDIST := -n 2 --dist loadfile
test: setup setup-sglang
	$(PY) -m pytest -q -p no:cacheprovider $(XDIST) --durations=30 --nbmake tests notebooks
	$(SGL_PY) -m pytest -q -p no:cacheprovider -n 2 --dist load --durations=10 tests/sglang

# The SGLang tests alone (tests/sglang, in .venv-sglang): recording SGLang's loaders, verify against them.
test-sglang: setup-sglang
	$(SGL_PY) -m pytest -q -p no:cacheprovider tests/sglang

# The development loop (< 3 min on a 2-core box), in the light venv (no vLLM): tests/unit without the `slow` cases
# (subprocesses, whole shipped plans), every hypothesis test at a small budget (tests/conftest.py's `fast` profile),
# the plan-reader fuzz at 200 cases per family.
test-fast: setup-light
	HYPOTHESIS_PROFILE=fast SHARDPLAN_FUZZ_CASES=200 $(LIGHT_PY) -m pytest -q -p no:cacheprovider -m "not slow" --durations=15 tests/unit

# The CPU unit tests alone, at their full budgets: tests/unit.
test-unit: setup
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 tests/unit

# Lint and format check (configuration: pyproject.toml's [tool.ruff]); `ruff format` and `ruff check --fix` fix.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

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
