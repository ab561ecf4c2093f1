# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv as needed.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Pinned: the CPU build of this version is what the project's machines carry locally; an open
# range would fetch a multi-GB CUDA build. On a GPU machine install the CUDA build you need.
TORCH_VERSION ?= 2.13.0

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,torch,report]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) bench/handoff.py

clean:
	rm -rf $(VENV) .timeslice test-artifacts
