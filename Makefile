# minipaged: every target sets itself up on a fresh machine with nothing but Python.
#   make demo      the main job on the embedded tiny model
#   make test      unit + property tests, every lesson notebook, the docs build
#   make docs      serve the docs site at http://127.0.0.1:8000
#   make gpu-test  the `gpu`-marked tests, on a GPU machine, with its own torch

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# -qq: the local package mirrors make pip warn about every index it skips.
PIP    := $(PY) -m pip install -qq --disable-pip-version-check

.PHONY: install demo test pytest docs docs-build gpu-test clean

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: a bare `torch` requirement would pull the multi-GB CUDA build.
	$(PIP) -c constraints-cpu.txt torch
	$(PIP) -c constraints-cpu.txt -e ".[dev,docs,server]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/minipaged demo

test: pytest docs-build

pytest: $(STAMP)
	$(PY) -m pytest -q tests --doctest-modules minipaged/memory --nbmake lessons --nbmake-timeout=120

docs-build: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

# On the GPU machine: use the torch that is installed there, as it is.
gpu-test:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) site .pytest_cache .hypothesis *.egg-info
