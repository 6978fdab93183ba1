"""Session set-up shared by every tier of the suite (layout: README, "Tests").

* tests/support (the harness modules) and the tier folders are importable by plain name,
  so a test imports `engine_utils` or another tier's helpers from anywhere, and so do
  the subprocesses that run those modules as scripts.
* tests/multidevice needs 8 simulated CPU devices, which XLA fixes when its CPU client
  starts: a run of that folder alone sets the flag here, before any test imports jax;
  a run that mixes it with other folders leaves it out (the other tiers run on one
  device) and says so at the end. `make test` runs it as its own pytest process.
* tests/tools/test_typecheck.py (mypy, twice over the whole package) belongs to
  `make lint`: it runs only when named.
* One persistent XLA compilation cache for the session and its subprocesses: the same
  directory the engine uses (<jaxserve cache>/xla), with no size or time threshold, so
  every program compiled once (engine buckets, kernels, model tests) loads thereafter.
* XLA's CPU backend compiles without its expensive LLVM passes in the suite and its
  subprocesses (TEST_XLA_FLAGS): the suite compiles thousands of small programs and runs
  each a few times, so compile time dominates. This changes how fast the generated code
  runs, not what it computes (no fast-math: XLA keeps IEEE semantics at every level, and
  the matmuls and the C++ kernels are library calls either way). Set
  JAXSERVE_TEST_XLA_DEFAULTS=1 to test with XLA's default optimisation instead. On
  jaxlib 0.10 the same flags select XLA:CPU's older loop emitters over its MLIR fusion
  emitters (--xla_cpu_use_fusion_emitters=false), which compile a tiny engine's programs
  in about 0.4 of the time (docs/benchmarks.md, "Test suite"). Each program's machine
  code is generated as one LLVM module, not split into parts for parallel code
  generation: `make test` keeps both cores busy with its test processes, and the split
  only adds each part's set-up (the same section). And a collective over simulated CPU
  devices waits up to 10 minutes for its last participant, not XLA's 40 s: `make test`
  runs the 8-device tier beside the other tiers' two workers, and 8 device threads
  sharing what is left of 2 cores can take longer than 40 s to meet (XLA then aborts
  the process). That tier also gets an XLA:CPU intra-op pool of 16 threads
  (PJRT_NPROC), not one per core: the devices' collectives block pool threads while
  they wait, and with 2 threads a TP=8 step under load deadlocked.
* Engines built through `LLM(...)`, `LLM.from_weights(...)` or `EngineCore(...)` (and so
  `make_engine(...)`) in a test compile each step shape when a step first needs it, not
  all buckets at start-up: most tests run a few shapes of the engine's buckets, and
  compiling every one of them was about half the engine tier's time. A test (or module)
  marked `warmup` gets the engine's own default (every bucket compiled at start-up), and
  a test that says `warmup=` gets what it says: those that count compiles after warm-up
  are marked (the 8-device tier's too). The server's engines (server.launch.build_engine)
  and every `jaxserve` process keep the default.
* Engines built in a test process without a KV size get a 128 MiB pool, not the CPU
  default of 1 GiB (TEST_CPU_KV_BYTES): the tiny model's would otherwise be 262,144
  blocks, every one of them allocated, written and copied where a program copies the pool.
* OpenMP runs one thread per test process (OMP_NUM_THREADS=1): torch's references and
  numpy's BLAS would otherwise spin for cores the other worker holds.
* After each module, unreachable objects are collected and the C heap's free pages are
  handed back to the OS (malloc_trim): modules build and drop engines, references and
  servers, and the allocator would otherwise keep the peak of every module resident,
  which matters when `make test` runs two pytest processes side by side.
"""
from __future__ import annotations

import ctypes
import gc
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

TESTS = Path(__file__).resolve().parent
TIERS = ("support", "unit", "engine", "kernels", "model", "server", "tools", "multidevice")
MULTIDEVICE = TESTS / "multidevice"
LINT_ONLY = TESTS / "tools" / "test_typecheck.py"
EIGHT_DEVICES = "--xla_force_host_platform_device_count=8"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

for _tier in reversed(TIERS):
    if str(TESTS / _tier) not in sys.path:
        sys.path.insert(0, str(TESTS / _tier))
# spawned harness scripts and `python -c` children find the same modules
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(TESTS / "support")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                if p])


def _jaxserve_cache() -> Path:
    # the engine's own rule (jaxserve.model.loader.default_model.cache_root), without
    # importing jax before the device flags below are settled
    return Path(os.environ.get("JAXSERVE_CACHE") or Path.home() / ".cache" / "jaxserve")


def _jaxlib_version() -> tuple[int, ...]:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return tuple(int(p) for p in version("jaxlib").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return (0,)


TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                  "--xla_cpu_parallel_codegen_split_count=1 "
                  "--xla_cpu_collective_call_terminate_timeout_seconds=600")
# jaxlib 0.11's XLA has no loop emitters left to choose (an unknown flag aborts at start)
if _jaxlib_version() < (0, 11):
    TEST_XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"
if os.environ.get("JAXSERVE_TEST_XLA_DEFAULTS") != "1" and \
        "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

# One thread for OpenMP (torch's intra-op pool, OpenBLAS under numpy) in the suite and
# its subprocesses: `make test` already runs a process per core, and an OpenMP team
# whose threads wait for a core held by another process spins at every barrier: the
# transformers references of the model tier ran several times slower with two threads
# than with one beside a busy second process (docs/benchmarks.md, "Test suite").
os.environ.setdefault("OMP_NUM_THREADS", "1")

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_jaxserve_cache() / "xla"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# the engines tests build count their compiles at warm-up, and stored programs are keyed
# by settings and sources, not by a test's monkeypatches of module internals: no
# programs kept across them (tests/engine/test_executable_cache.py turns the store on)
os.environ.setdefault("JAXSERVE_EXECUTABLE_CACHE", "0")


_MULTIDEVICE_KEY = pytest.StashKey[bool]()


def _under(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _requested(config: pytest.Config) -> list[Path]:
    paths = [Path(str(a).split("::")[0]).resolve() for a in config.args]
    return paths or [TESTS]


def _backend_started() -> bool:
    from jax._src import xla_bridge
    return bool(xla_bridge._backends)


def pytest_configure(config: pytest.Config) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    only_multidevice = all(_under(p, MULTIDEVICE) for p in _requested(config))
    config.stash[_MULTIDEVICE_KEY] = only_multidevice or EIGHT_DEVICES in flags
    if only_multidevice and EIGHT_DEVICES not in flags:
        assert "jax" not in sys.modules or not _backend_started(), \
            "jax started before the 8-device flag could be set"
        os.environ["XLA_FLAGS"] = f"{flags} {EIGHT_DEVICES}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if config.stash[_MULTIDEVICE_KEY]:
        # as for the engine's own CPU replicas: an intra-op pool the 8 devices'
        # collectives cannot exhaust (on 2 cores, 2 threads deadlocked a TP=8 step)
        from jaxserve.router.dp_processes import cpu_collective_threads
        os.environ.setdefault("PJRT_NPROC", str(cpu_collective_threads(8)))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if _under(collection_path, MULTIDEVICE) and not config.stash[_MULTIDEVICE_KEY]:
        return True
    if collection_path == LINT_ONLY and LINT_ONLY not in _requested(config):
        return True
    return None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    if not config.stash[_MULTIDEVICE_KEY] and any(
            _under(MULTIDEVICE, p) for p in _requested(config)):
        terminalreporter.write_line(
            "tests/multidevice was not run here (it needs its own process with 8 CPU "
            "devices): pytest tests/multidevice, or make test")


def _engine_warmup_default(on: bool) -> None:
    try:
        from jaxserve.core.engine_core import EngineCore
        from jaxserve.frontend.llm import LLM
    except ImportError:   # a kernels-only install (make test-jax-next): no engine to set up
        return
    EngineCore.__init__.__kwdefaults__["warmup"] = on
    LLM.__init__.__kwdefaults__["warmup"] = on
    LLM.from_weights.__func__.__kwdefaults__["warmup"] = on  # type: ignore[attr-defined]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # before the item's fixtures are set up, so module and session fixtures built for it
    # take its setting too
    _engine_warmup_default(item.get_closest_marker("warmup") is not None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A stall-marked test must sit in a file whose text says `mark.stall`: `make test`
    runs the stall tests from the files that do (the Makefile's STALL_FILES), and its
    other run deselects them, so one marked another way would run nowhere."""
    seen: dict[Path, bool] = {}
    for item in items:
        if item.get_closest_marker("stall") is None:
            continue
        path = Path(str(item.path))
        if path not in seen:
            seen[path] = "mark.stall" in path.read_text(encoding="utf-8")
        if not seen[path]:
            raise pytest.UsageError(f"{item.nodeid} is marked stall, but its file never "
                                    "writes `mark.stall`, which `make test` looks for")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Python's cyclic collector, tuned for a test process (JAXSERVE_TEST_GC=default
    leaves it alone). Every test module is imported by now, and with them jax, torch,
    transformers and jaxserve, whose objects live until the process ends: they leave
    the collector's view (gc.freeze). Tracing and compiling create objects by the
    million, and a full collection scans all of them (about a second on 2 cores): with
    the default thresholds one module ran about 27 of them, a sixth of its time. The
    thresholds below run one about every 14 million net allocations instead, and each
    module still ends with one (_trim_heap), as does any test after which the process
    holds RSS_SLACK more than after the last one (_bounded_garbage): cyclic garbage
    (engines and their device buffers, servers) lives at most until then."""
    _one_torch_thread()
    _small_cpu_kv_default()
    if os.environ.get("JAXSERVE_TEST_GC") != "default":
        gc.collect()
        gc.freeze()
        gc.set_threshold(10_000, 20, 1_000)


# The KV budget of an engine built in this process with neither num_kv_blocks nor
# kv_cache_memory (the engine's CPU default is 1 GiB): the default model still gets 182
# blocks (2,912 tokens), the tiny test model 32,768 instead of 262,144. A step writes
# into the whole pool, and the interpreted Pallas kernel copies it every call.
TEST_CPU_KV_BYTES = 128 << 20


def _small_cpu_kv_default() -> None:
    try:
        from jaxserve.worker import kv_device
    except ImportError:     # a kernels-only install (make test-jax-next)
        return
    kv_device.CPU_DEFAULT_KV_BYTES = TEST_CPU_KV_BYTES


def _one_torch_thread() -> None:
    """torch imported before this file set OMP_NUM_THREADS keeps its own thread count."""
    torch = sys.modules.get("torch")
    if torch is not None and os.environ.get("OMP_NUM_THREADS") == "1":
        torch.set_num_threads(1)


RSS_SLACK = 2 << 30
_rss_after_trim = [0]


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):   # not Linux: never triggers a collection
        return 0


def _trim_heap() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):       # not glibc: nothing to hand back this way
        pass
    _rss_after_trim[0] = _rss()


def _bounded_garbage() -> None:
    """A module whose tests each build engines would otherwise keep every one of them
    (a cycle holds each) until the module ends: with two workers side by side that ran
    a 24 GB machine out of memory."""
    if _rss() > _rss_after_trim[0] + RSS_SLACK:
        _trim_heap()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test of a module, once its module fixtures are torn down; after
    any test that left the process RSS_SLACK bigger."""
    result = yield
    if nextitem is None or nextitem.path != item.path:
        _trim_heap()
    else:
        _bounded_garbage()
    return result


@pytest.fixture
def tiny_llm_factory() -> Iterator[Callable[..., Any]]:
    """engine_pool.tiny_llm for this test; every engine it handed out is released (and
    checked clean) when the test ends."""
    import engine_pool
    used: list[Any] = []

    def get(*args: Any, **kwargs: Any) -> Any:
        llm = engine_pool.tiny_llm(*args, **kwargs)
        used.append(llm)
        return llm
    yield get
    for llm in used:
        engine_pool.release(llm)


@pytest.fixture(scope="session")
def default_model() -> Any:
    """The embedded default model (SmolLM2-135M-Instruct) dequantized to float32 (the
    reference transformers also computes), loaded once per session: the model tier's
    tests that only read it share one copy instead of converting and loading it per
    module. The default itself serves the file's quantized blocks
    (tests/model/test_default_blocks.py, tests/kernels/test_cpu_quant_matmul.py)."""
    from jaxserve.model.loader.load import load_model
    return load_model(None, quantization="none")
