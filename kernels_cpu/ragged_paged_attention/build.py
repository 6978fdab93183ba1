"""Compile kernel.cc (with the small-M matmul, ../small_matmul/matmul.cc, and the decoder
stack, ../decode_stack/stack.cc: one library, one build, one warning) on first use into
the jaxserve cache and register their XLA FFI targets for the CPU platform.

    load() -> target name     (raises KernelUnavailable with the reason; cached)
    available() -> bool       (load(), or log once why not: the caller uses the jnp reference)

Why a first-use build and not a build step at `pip install` time: the kernel must be
compiled against the XLA FFI headers of the jaxlib this process actually imports
(`jax.ffi.include_dir()`), and users swap jaxlib after installing jaxserve (`jax[cuda]`,
`jax[tpu]`, a newer pin). An extension built at install time would carry the headers of
whatever jaxlib was present then; this build always matches, and costs ~15 s once.

Built for this CPU's x86-64 level: on an AVX-512 (x86-64-v4) or AVX2+FMA (x86-64-v3)
CPU the sources are compiled once for that level (-march=x86-64-v4 / -v3), which is the
code the portable build's target_clones would pick there; the level is in the compiler
command and so in the cache key, so a cache in a shared home directory or a container
image moved to another host builds a library per level. Why not always the portable
build (baseline plus per-ISA target_clones of the hot loops, as before): compiling every
hot loop three times made the build the largest part of a cold `jaxserve serve` start
(77 s vs 19.5 s, loaded 2-core machine). Other CPUs and architectures, or
JAXSERVE_PORTABLE_KERNELS=1, get the portable build. The two sources compile side by
side, one compiler process each, then link.

Cache: <cache>/kernels/ragged_paged_attention-<hash>.so, the hash covering the source,
jaxlib's version, the full compiler command (flags incl. the -march level, include dir),
the compiler's identity (resolved path and `--version`: an upgraded compiler rebuilds)
and the machine architecture. Written to a temporary file and
renamed, under a lock file beside it: processes that start together on a fresh cache
build it once (one compiles, the others wait and load it).
Process-wide float state is left alone (no -ffast-math: see `compile_command`).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import jax
import jaxlib

from kernels_cpu.cache import cache_root

log = logging.getLogger("jaxserve")

TARGET = "jaxserve_ragged_paged_attention_f32"
SYMBOL = "JaxserveRaggedPagedAttentionF32"
# the same, writing the step's new k/v into the (aliased) caches first
WRITE_TARGET = "jaxserve_ragged_paged_attention_write_f32"
WRITE_SYMBOL = "JaxserveRaggedPagedAttentionWriteF32"
# the int8 / fp8 KV cache (values + per-slot scales), registered with the same library
QUANT_TARGET = "jaxserve_ragged_paged_attention_quant"
QUANT_SYMBOL = "JaxserveRaggedPagedAttentionQuant"
SOURCE = Path(__file__).with_name("kernel.cc")
# y = x @ w for decode-sized x (a few rows): jaxserve/model/cpu/matmul.py
MATMUL_TARGET = "jaxserve_small_matmul_f32"
MATMUL_SYMBOL = "JaxserveSmallMatmulF32"
# y_i = x @ w_i for a few weights sharing x (q, k, v; gate, up) in one call
MATMUL_MANY_TARGET = "jaxserve_small_matmul_many_f32"
MATMUL_MANY_SYMBOL = "JaxserveSmallMatmulManyF32"
MATMUL_PACK_TARGET = "jaxserve_small_matmul_pack_f32"
MATMUL_PACK_SYMBOL = "JaxserveSmallMatmulPackF32"
MATMUL_SOURCE = Path(__file__).parent.parent / "small_matmul" / "matmul.cc"
# a whole decoder stack in one call (small CPU decode buckets): jaxserve/model/cpu/stack.py
STACK_TARGET = "jaxserve_decode_stack_f32"
STACK_SYMBOL = "JaxserveDecodeStackF32"
STACK_SOURCE = Path(__file__).parent.parent / "decode_stack" / "stack.cc"
# a greedy row's token from a float16 copy of the head and a bound: jaxserve/model/cpu/greedy_head.py
GREEDY_HEAD_TARGET = "jaxserve_greedy_head_f32"
GREEDY_HEAD_SYMBOL = "JaxserveGreedyHeadF32"
GREEDY_HEAD_SOURCE = Path(__file__).parent.parent / "greedy_head" / "head.cc"
# y_i = x @ w_i on quantized packed panels (int8, GGUF blocks): small_matmul/quant.py
QUANT_MATMUL_TARGET = "jaxserve_quant_matmul_many"
QUANT_MATMUL_SYMBOL = "JaxserveQuantMatmulMany"
QUANT_MATMUL_SOURCE = Path(__file__).parent.parent / "small_matmul" / "quant.cc"
# every FFI target this library registers (what an exported step program may call)
FFI_TARGETS = (TARGET, WRITE_TARGET, QUANT_TARGET, MATMUL_TARGET, MATMUL_MANY_TARGET,
               MATMUL_PACK_TARGET, STACK_TARGET, GREEDY_HEAD_TARGET, QUANT_MATMUL_TARGET)
SOURCES = (SOURCE, MATMUL_SOURCE, STACK_SOURCE, GREEDY_HEAD_SOURCE, QUANT_MATMUL_SOURCE)
# what the sources share (in the cache key with them)
HEADERS = (Path(__file__).parent.parent / "cpu_kernels.h", Path(__file__).parent.parent / "vec16.h")
FALLBACK = ("for the CPU kernels (attention ~10x faster, small-row matmuls); using the jnp "
            "reference attention and XLA's dot")
_lock = threading.Lock()
_loaded: str | None = None
_failure: KernelUnavailable | None = None
_warned: set[str] = set()


class KernelUnavailable(RuntimeError):
    """No C++ compiler, or the kernel did not build: use the jnp reference instead."""


def find_compiler() -> list[str]:
    """$CXX (may carry a launcher, e.g. "ccache g++"), else g++ / c++ / clang++ on PATH."""
    env = os.environ.get("CXX", "").strip()
    if env:
        parts = shlex.split(env)
        if shutil.which(parts[0]) is None:
            raise KernelUnavailable(f"CXX={env!r} is not an executable C++ compiler: fix CXX "
                                    f"or unset it to use g++/clang++ from PATH, {FALLBACK}")
        return parts
    for name in ("g++", "c++", "clang++"):
        if shutil.which(name):
            return [name]
    raise KernelUnavailable("no C++ compiler (g++/clang++) found: install one, e.g. "
                            f"`apt install g++`, {FALLBACK}")


def compiler_identity(cxx: list[str]) -> str:
    """Resolved path and `--version` output: part of the cache key."""
    path = os.path.realpath(shutil.which(cxx[0]) or cxx[0])
    try:
        res = subprocess.run(cxx + ["--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"`{shlex.join(cxx)} --version` failed ({e}), {FALLBACK}") \
            from e
    if res.returncode != 0:
        raise KernelUnavailable(f"`{shlex.join(cxx)} --version` failed: "
                                f"{res.stderr.strip()[-500:]}; {FALLBACK}")
    return f"{path}\n{res.stdout}"


# x86-64 micro-architecture levels as /proc/cpuinfo names their features (the levels of
# the portable build's target_clones: v4 = AVX-512, v3 = AVX2 + FMA).
_X86_V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave", "abm"}
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


def cpu_level() -> str | None:
    """The x86-64 level this CPU runs (x86-64-v4 / -v3) from /proc/cpuinfo's flags, or
    None: another architecture, an older CPU, no /proc/cpuinfo, or the portable build
    asked for (JAXSERVE_PORTABLE_KERNELS=1)."""
    if os.environ.get("JAXSERVE_PORTABLE_KERNELS", "") not in ("", "0"):
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((set(line.partition(":")[2].split()) for line in text.splitlines()
                  if line.startswith("flags")), set())
    if _X86_V4 <= flags:
        return "x86-64-v4"
    if _X86_V3 <= flags:
        return "x86-64-v3"
    return None


def _arch_flags(level: str | None) -> list[str]:
    if level is not None:   # one version of each hot loop: the clone this CPU would run
        return [f"-march={level}", "-mtune=generic", "-DJAXSERVE_NO_TARGET_CLONES"]
    # portable x86-64: the original baseline (SSE2), pinned because some distributions'
    # compilers default higher; target_clones add the AVX2+FMA and AVX-512 versions.
    # Elsewhere (aarch64: NEON is baseline) the compiler's default target is portable.
    if platform.machine().lower() in ("x86_64", "amd64"):
        return ["-march=x86-64", "-mtune=generic"]
    return []


def compile_command(cxx: list[str]) -> list[str]:
    """The whole build as one command (the cache key; `_build` runs it per source). The
    -march level is in it, so a cache shared by CPUs of different levels keeps one
    library per level."""
    # Not -ffast-math: linking a shared object with it pulls in crtfastmath, which sets
    # flush-to-zero for the whole process when the library loads. Only the flags the
    # vectorized reductions need:
    return [*cxx, "-O3", *_arch_flags(cpu_level()), "-fno-math-errno", "-fno-trapping-math",
            "-fassociative-math", "-fno-signed-zeros", "-std=c++17", "-shared", "-fPIC",
            "-pthread", f"-I{jax.ffi.include_dir()}", *map(str, SOURCES)]


def library_path(cache_dir: Path) -> tuple[Path, list[str]]:
    cxx = find_compiler()
    cmd = compile_command(cxx)
    h = hashlib.sha256()
    for part in (*(src.read_bytes() for src in (*SOURCES, *HEADERS)), jaxlib.__version__,
                 shlex.join(cmd),
                 compiler_identity(cxx), platform.machine()):
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return cache_dir / "kernels" / f"ragged_paged_attention-{h.hexdigest()[:16]}.so", cmd


def _run_all(cmds: list[list[str]]) -> None:
    """Runs the commands side by side; KernelUnavailable naming the first failure."""
    procs = []
    try:
        for c in cmds:
            procs.append(subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        for c, p in zip(cmds, procs):
            _, err = p.communicate(timeout=600)
            if p.returncode != 0:
                raise KernelUnavailable(f"the CPU kernels did not compile ({c[0]}: "
                                        f"{err.strip()[-2000:]}), {FALLBACK}")
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"running {cmds[0][0]} failed ({e}), {FALLBACK}") from e
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _build(path: Path, cmd: list[str]) -> None:
    """cmd (compile_command's): each source compiled to an object file in its own compiler
    process, side by side, then linked into `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sources = [a for a in cmd if a in {str(s) for s in SOURCES}]
    flags = [a for a in cmd if a not in sources and a != "-shared"]
    log.info("compiling the CPU kernels (once, ~15-40 s) -> %s", path)
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        objs = [str(Path(work) / f"{i}.o") for i in range(len(sources))]
        _run_all([[*flags, "-c", src, "-o", obj] for src, obj in zip(sources, objs)])
        tmp = str(Path(work) / "lib.so")
        _run_all([[*flags, "-shared", *objs, "-o", tmp]])
        os.replace(tmp, path)


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Held while one process builds `path`: processes that start together on a fresh
    cache (data-parallel replicas, a server beside a test run) wait for that build and
    load its library instead of each running the compiler for the same file. The lock
    is the OS's (flock), so a builder that dies releases it; where there is no flock,
    each process builds, as the atomic rename already allows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:         # not POSIX
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_built(path: Path, cmd: list[str]) -> None:
    """`path` built by `cmd` (library_path's pair) unless it exists, by one process at a
    time: a process that waited for another's build finds the file and builds nothing."""
    if not path.exists():
        with _build_lock(path):
            if not path.exists():
                _build(path, cmd)


def _load(cache_dir: Path | None) -> str:
    if cache_dir is None:
        cache_dir = cache_root()
    path, cmd = library_path(Path(cache_dir))
    ensure_built(path, cmd)
    lib = ctypes.cdll.LoadLibrary(str(path))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(lib, SYMBOL)),
                                platform="cpu")
    jax.ffi.register_ffi_target(QUANT_TARGET, jax.ffi.pycapsule(getattr(lib, QUANT_SYMBOL)),
                                platform="cpu")
    jax.ffi.register_ffi_target(WRITE_TARGET, jax.ffi.pycapsule(getattr(lib, WRITE_SYMBOL)),
                                platform="cpu")
    jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(getattr(lib, MATMUL_SYMBOL)),
                                platform="cpu")
    jax.ffi.register_ffi_target(MATMUL_MANY_TARGET,
                                jax.ffi.pycapsule(getattr(lib, MATMUL_MANY_SYMBOL)),
                                platform="cpu")
    jax.ffi.register_ffi_target(MATMUL_PACK_TARGET,
                                jax.ffi.pycapsule(getattr(lib, MATMUL_PACK_SYMBOL)),
                                platform="cpu")
    jax.ffi.register_ffi_target(STACK_TARGET, jax.ffi.pycapsule(getattr(lib, STACK_SYMBOL)),
                                platform="cpu")
    jax.ffi.register_ffi_target(QUANT_MATMUL_TARGET,
                                jax.ffi.pycapsule(getattr(lib, QUANT_MATMUL_SYMBOL)),
                                platform="cpu")
    jax.ffi.register_ffi_target(GREEDY_HEAD_TARGET,
                                jax.ffi.pycapsule(getattr(lib, GREEDY_HEAD_SYMBOL)),
                                platform="cpu")
    return TARGET


def load(cache_dir: Path | None = None) -> str:
    """Build if needed, load, register; idempotent. Returns the FFI target name.
    A failure is remembered too: later calls raise it again without retrying the build."""
    global _loaded, _failure
    with _lock:
        if _loaded is not None:
            return _loaded
        if _failure is not None:
            raise _failure
        try:
            _loaded = _load(cache_dir)
        except KernelUnavailable as e:
            _failure = e
            raise
        return _loaded


def load_in_background() -> threading.Thread:
    """available() on a thread of its own, started now. The compiler runs in processes
    of its own, so a first start's build proceeds while the caller goes on (loading the
    model, say); the engine's own load() or available() then waits for it (one lock)
    and finds the library loaded, or the remembered failure."""
    t = threading.Thread(target=available, name="cpu-kernels-build", daemon=True)
    t.start()
    return t


def available() -> bool:
    """True when the kernel loads; otherwise logs the reason (once per process and reason,
    however many engines or backend look-ups ask) and returns False."""
    try:
        load()
    except KernelUnavailable as e:
        with _lock:
            if str(e) not in _warned:
                _warned.add(str(e))
                log.warning("%s", e)
        return False
    return True
