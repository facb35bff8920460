# make test: every check CI runs (ruff, mypy, pytest). make demo: the main job.
# Both create .venv and install what they need on first use, the system packages
# included (scripts/system-packages: apt-get when root, else one line saying what
# to install).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-test
# Debian keeps haproxy and ip in the sbin folders, which a non-login PATH may lack.
SBIN ?= /usr/local/sbin:/usr/sbin:/sbin
export PATH := $(PATH)$(if $(SBIN),:$(SBIN))
# install (the default), check (never install) or dry-run
SYSTEM_PACKAGES ?= install
SYSTEM_TEST := haproxy postgresql nftables iproute2 chromium
SYSTEM_DEMO := postgresql

.PHONY: test lint typecheck pytest soak bench bench-celery demo docs clean system-test system-demo

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $@

system-test:
	@scripts/system-packages $(if $(filter install,$(SYSTEM_PACKAGES)),,--$(SYSTEM_PACKAGES)) $(SYSTEM_TEST)

system-demo:
	@scripts/system-packages $(if $(filter install,$(SYSTEM_PACKAGES)),,--$(SYSTEM_PACKAGES)) $(SYSTEM_DEMO)

test: system-test lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: system-test $(STAMP)
	$(BIN)/pytest

soak: system-test $(STAMP)
	$(BIN)/pytest -m soak
	$(BIN)/python scripts/mutate.py --all --jobs 2 --report mutation-report.md
	$(BIN)/python scripts/mutate.py --bugs --report bug-budgets.md

demo: system-demo $(STAMP)
	$(BIN)/python examples/demo.py

docs: $(STAMP)
	$(BIN)/sphinx-build -q -W -b html docs/api docs/api/_build/html

bench: $(STAMP)
	$(BIN)/python benchmarks/codec.py
	$(BIN)/python benchmarks/core.py
	$(BIN)/python benchmarks/execserver.py
	$(BIN)/python benchmarks/client.py
	$(BIN)/python benchmarks/handover.py

# Against Celery on Redis: installs its extra and Debian's redis-server first.
# BENCH_ARGS=--quick for small sizes and one round.
bench-celery: $(STAMP)
	@scripts/system-packages $(if $(filter install,$(SYSTEM_PACKAGES)),,--$(SYSTEM_PACKAGES)) redis
	$(BIN)/pip install -q -e '.[bench-celery]'
	$(BIN)/python benchmarks/vs_celery.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
