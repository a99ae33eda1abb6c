# minipaged: every target sets itself up on a fresh machine with Python and a C++ compiler
# (make test also wants the CUDA toolkit's nvcc and headers; no GPU).
#   make demo      the main job on the embedded tiny model
#   make test      the CUDA kernels' compile check, unit + property tests, every lesson
#                  notebook, the docs build
#   make docs      serve the docs site at http://127.0.0.1:8000
#   make gpu-test  the `gpu`-marked tests, on a GPU machine, with its own torch

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# -qq: the local package mirrors make pip warn about every index it skips.
PIP    := $(PY) -m pip install -qq --disable-pip-version-check

.PHONY: install demo test kernels-check pytest docs docs-build gpu-test clean

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: a bare `torch` requirement would pull the multi-GB CUDA build.
	$(PIP) -c constraints-cpu.txt torch
	$(PIP) -c constraints-cpu.txt -e ".[dev,docs,server]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/minipaged demo

test: kernels-check pytest docs-build

# Every CUDA file in kernels/ must compile for A100 (sm_80) and H100 (sm_90), GPU or not.
NVCC       ?= nvcc
NVCC_FLAGS := -std=c++17 -t 2 -gencode arch=compute_80,code=sm_80 \
              -gencode arch=compute_90,code=sm_90
kernels-check:
	@command -v $(NVCC) >/dev/null || { echo "kernels-check needs nvcc (the CUDA toolkit)"; exit 1; }
	@mkdir -p .build/kernels
	@for f in kernels/*.cu; do \
		echo "nvcc sm_80 sm_90: $$f"; \
		$(NVCC) $(NVCC_FLAGS) -c $$f -o .build/kernels/$$(basename $$f .cu).o || exit 1; \
	done

pytest: $(STAMP)
	$(PY) -m pytest -q tests --doctest-modules minipaged/memory --nbmake lessons --nbmake-timeout=120

docs-build: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

.PHONY: lessons
lessons: $(STAMP)  # re-execute every lesson in place: the outputs the docs site shows
	$(PY) scripts/execute_lessons.py

# On the GPU machine: use the torch that is installed there, as it is.
gpu-test:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) site .build .pytest_cache .hypothesis *.egg-info
