# objfs development and demo entry points. `make demo` and `make test` set up everything on a
# fresh Debian 12 machine (apt packages, .venv with objfs in editable mode, test servers).
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.objfs-installed
APT_PACKAGES := fuse3 libfuse3-dev pkg-config gcc python3-dev python3-venv util-linux
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=

# Azurite, the Azure Storage emulator the Azure tests run against, installed with npm into a
# git-ignored folder. 3.35.0 is the last release whose package declares support for Node 18
# (Debian 12's nodejs); checked to start and serve under Node 18.20.
AZURITE_VERSION := 3.35.0
NPM_TOOLS := .npm-tools
AZURITE_STAMP := $(NPM_TOOLS)/.azurite-$(AZURITE_VERSION)

.PHONY: help setup sysdeps nodejs azurite lint format test demo clean

help:
	@echo "make demo   - local S3 server + small model + objfs mount + transformers load"
	@echo "make test   - lint, then the whole test suite (real FUSE mounts, real S3 server)"
	@echo "make lint   - ruff and mypy (strict on objfs/)"
	@echo "make format - ruff format and import sorting"

# Installs only what is missing, so a re-run costs a few dpkg queries.
sysdeps:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "apt-get install:$$missing"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
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

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup
	$(PY) -m objfs.demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info $(NPM_TOOLS)
