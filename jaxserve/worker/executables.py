"""Compiled step programs kept on disk, so a second start loads them instead of compiling.

JAX's persistent compilation cache (compile_cache.py) saves XLA's compile, but a start
still traces and lowers every program to look it up (seconds for a bucket of a large
model). This store keeps the compiled executables themselves
(jax.experimental.serialize_executable): a program found here is neither traced nor
lowered nor compiled, and the runner's compile counter does not move.

    <jaxserve cache>/executables/<fingerprint>/<program>-<signature>.jexe

The fingerprint covers what a program's code closes over: the model config and every
runner setting (the caller's `context`), jaxserve's own source files, jax and jaxlib
versions, the platform and devices, XLA_FLAGS / LIBTPU_INIT_ARGS / JAXSERVE_* variables;
the signature, the arguments' tree, shapes, dtypes and shardings. A different build,
config or device gets other files, never a wrong program.

Trust: serialize_executable stores with pickle, and unpickling runs code. The files are
written by this process into the user's own cache directory (mode 0700, files 0600) and
read back only from there: a file not owned by the current user, or group/world
writable, or in such a directory, is ignored, as is one whose checksum, header or
versions do not match (a truncated or corrupt file is removed and compiled again). Never
copy these files between hosts or users, or point JAXSERVE_CACHE at a shared directory;
multi-process runs do not use the store. Because it unpickles, the store is off unless
JAXSERVE_EXECUTABLE_CACHE=1 turns it on (a single-user host whose cache directory no one
else can write).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import stat
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Hashable

import jax

from jaxserve.paths import cache_root

log = logging.getLogger("jaxserve")
ENV = "JAXSERVE_EXECUTABLE_CACHE"
KEEP = 6            # fingerprint directories kept (the most recently used); older go
MAGIC = b"jaxserve-executable 1\n"
_SOURCE_DIRS = ("jaxserve", "kernels_pallas", "kernels_cpu")
# packages no program is traced from (editing them keeps the stored programs)
_UNTRACED = ("tools", "bench", "server", "router", "frontend")
_source_hash: str | None = None
# An executable XLA's persistent cache hands back cannot be stored: re-serialized, it lost
# its kernels on XLA:CPU ("Function ... not found" when run). So compiles for the store
# carry this (default-valued) option, which gives them keys of their own in XLA's cache,
# and are not written there (its minimum compile time is raised while they run): they
# are always fresh compiles. One that still came from XLA's cache is not stored.
STORE_COMPILE_OPTIONS = {"xla_embed_ir_in_executable": False,
                         "xla_hlo_graph_addresses": False}
_MIN_TIME = "jax_persistent_cache_min_compile_time_secs"
_seen = threading.local()
_listening = False
_listen_lock = threading.Lock()
_fresh_count = 0
_saved_min_time: float = 0.0


def _on_event(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _seen.hit = True


def _fresh_compile(fn: Any, args: tuple, static: dict) -> tuple[Any, bool]:
    """(compiled, whether it was compiled here rather than read from XLA's cache)."""
    global _listening
    with _listen_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            _listening = True
    global _fresh_count, _saved_min_time
    with _listen_lock:
        if _fresh_count == 0:
            _saved_min_time = getattr(jax.config, _MIN_TIME)
            jax.config.update(_MIN_TIME, 1e12)
        _fresh_count += 1
    try:
        _seen.hit = False
        compiled = fn.lower(*args, **static).compile(compiler_options=STORE_COMPILE_OPTIONS)
        return compiled, not _seen.hit
    finally:
        with _listen_lock:
            _fresh_count -= 1
            if _fresh_count == 0:
                jax.config.update(_MIN_TIME, _saved_min_time)


def enabled() -> bool:
    """The store is on only when JAXSERVE_EXECUTABLE_CACHE is 1/true/on (it unpickles:
    see the module docstring), and only for a single-process run."""
    if os.environ.get(ENV, "0").strip().lower() not in ("1", "true", "on", "yes"):
        return False
    return jax.process_count() == 1


def source_hash() -> str:
    """sha256 over jaxserve's Python sources (and the kernel packages beside it), but
    for the packages no program is traced from."""
    global _source_hash
    if _source_hash is None:
        root = Path(__file__).resolve().parents[2]
        h = hashlib.sha256()
        for d in _SOURCE_DIRS:
            for p in sorted((root / d).rglob("*.py")) if (root / d).is_dir() else []:
                rel = p.relative_to(root)
                if d == "jaxserve" and len(rel.parts) > 2 and rel.parts[1] in _UNTRACED:
                    continue
                h.update(str(rel).encode() + b"\0" + p.read_bytes() + b"\0")
        _source_hash = h.hexdigest()
    return _source_hash


def environment() -> dict[str, Any]:
    """What outside the runner's settings decides a compiled program."""
    import jaxlib
    devs = jax.devices()
    env = {k: v for k, v in sorted(os.environ.items())
           if (k.startswith("JAXSERVE_") and k not in ("JAXSERVE_CACHE", ENV))
           or k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")}
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "python": sys.version.split()[0], "platform": devs[0].platform,
            "device_kind": devs[0].device_kind, "num_devices": len(devs),
            "x64": bool(jax.config.jax_enable_x64),
            "matmul_precision": str(jax.config.jax_default_matmul_precision),
            "source": source_hash(), "env": env}


def signature(args: tuple, static: dict) -> str:
    """The arguments' tree and each leaf's shape, dtype, weak type and sharding."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    parts = [str(tree), repr(sorted(static.items()))]
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        committed = getattr(x, "committed", None)
        parts.append(f"{getattr(x, 'shape', ())}|{getattr(x, 'dtype', type(x).__name__)}|"
                     f"{getattr(x, 'weak_type', False)}|{sharding}|{committed}")
    return "\n".join(parts)


def _private(path: Path) -> bool:
    """Owned by this user and writable by no one else."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


class ExecutableStore:
    """One runner's directory of serialized executables (see the module docstring)."""

    def __init__(self, context: dict[str, Any], root: str | Path | None = None) -> None:
        self.meta = {"context": context, **environment()}
        # object reprs without their addresses (they differ from run to run)
        text = re.sub(r" at 0x[0-9a-fA-F]+", "", json.dumps(self.meta, sort_keys=True,
                                                          default=str))
        self.fingerprint = hashlib.sha256(text.encode()).hexdigest()[:20]
        base = cache_root(root) / "executables"
        self.dir = base / self.fingerprint
        self.loaded = self.saved = 0
        self.usable = True
        try:
            for d in (base, self.dir):
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not (_private(base) and _private(self.dir)):
                log.warning("executable cache %s is not private to this user: not used",
                            self.dir)
                self.usable = False
            (self.dir / "meta.json").write_text(json.dumps(self.meta, indent=1, default=str))
            self._prune(base)
        except OSError as e:
            log.warning("executable cache %s unusable (%s): compiling", self.dir, e)
            self.usable = False

    def _prune(self, base: Path) -> None:
        """Remove all but the KEEP most recently used fingerprint directories (other
        builds, configs or devices; meta.json is rewritten at every start)."""
        import shutil
        dirs = [d for d in base.iterdir() if d.is_dir() and (d / "meta.json").is_file()]
        dirs.sort(key=lambda d: (d / "meta.json").stat().st_mtime, reverse=True)
        for old in dirs[KEEP:]:
            if old != self.dir:
                shutil.rmtree(old, ignore_errors=True)

    def _path(self, name: str, sig: str) -> Path:
        return self.dir / f"{name}-{hashlib.sha256(sig.encode()).hexdigest()[:24]}.jexe"

    def load(self, name: str, sig: str) -> Any:
        """The Compiled stored for (name, sig), or None (missing, foreign, corrupt)."""
        path = self._path(name, sig)
        if not self.usable or not path.is_file():
            return None
        try:
            if not _private(path):
                log.warning("%s is not private to this user: ignored", path)
                return None
            data = path.read_bytes()
            if not data.startswith(MAGIC):
                raise ValueError("no header")
            head, _, payload = data[len(MAGIC):].partition(b"\n")
            header = json.loads(head)
            if header.get("sha256") != hashlib.sha256(payload).hexdigest():
                raise ValueError("checksum mismatch")
            if header.get("signature") != sig or header.get("fingerprint") != self.fingerprint:
                raise ValueError("written for other inputs")
            from jax.experimental import serialize_executable as se
            blob, in_tree, out_tree = pickle.loads(payload)
            compiled = se.deserialize_and_load(blob, in_tree, out_tree)
        except Exception as e:  # noqa: BLE001 - any bad entry is compiled again
            log.warning("executable cache: %s unusable (%s: %s); compiling it again",
                        path.name, type(e).__name__, e)
            path.unlink(missing_ok=True)
            return None
        self.loaded += 1
        return compiled

    def save(self, name: str, sig: str, compiled: Any) -> None:
        """Write one executable (atomically; a program that cannot be serialized, e.g.
        one with host callbacks, is just not stored)."""
        if not self.usable:
            return
        try:
            from jax.experimental import serialize_executable as se
            payload = pickle.dumps(se.serialize(compiled), protocol=pickle.HIGHEST_PROTOCOL)
            header = json.dumps({"signature": sig, "fingerprint": self.fingerprint,
                                 "sha256": hashlib.sha256(payload).hexdigest()}).encode()
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + header + b"\n" + payload)
            os.replace(tmp, self._path(name, sig))
            self.saved += 1
        except Exception as e:  # noqa: BLE001 - storing is an optimisation only
            log.info("executable cache: %s not stored (%s: %s)", name, type(e).__name__, e)


class Program:
    """A jitted function plus the executables compiled for it ahead of time, by dispatch
    key (a cheap hashable the caller derives from the arguments that vary: the packed
    inputs' layout, the plan...). Without a store it is the jitted function as before:
    compile() fills jit's own caches and calls go through it."""

    def __init__(self, fn: Any, name: str, store: ExecutableStore | None = None) -> None:
        self.fn, self.name, self.store = fn, name, store
        self._table: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def compile(self, key: Hashable, *args: Any, **static: Any) -> Any:
        """The executable for these arguments: from the table, the store, or compiled
        (and stored). Returns it (its out_info gives the output shapes)."""
        if self.store is None:
            return self.fn.lower(*args, **static).compile()
        with self._lock:
            if key in self._table:
                return self._table[key]
        sig = signature(args, static)
        compiled = self.store.load(self.name, sig)
        if compiled is None:
            compiled, fresh = _fresh_compile(self.fn, args, static)
            if fresh:
                self.store.save(self.name, sig, compiled)
            else:
                log.info("executable %s came from XLA's cache: not stored", self.name)
        with self._lock:
            self._table[key] = compiled
        return compiled

    def __call__(self, key: Hashable, *args: Any, **static: Any) -> Any:
        compiled = self._table.get(key)
        if compiled is not None:
            try:
                return compiled(*args)
            except TypeError as e:      # other argument types: checked before running
                log.warning("executable %s %s does not take these arguments (%s); using "
                            "jit", self.name, key, str(e).splitlines()[0])
                with self._lock:
                    self._table.pop(key, None)
        return self.fn(*args, **static)


def store_for(context: dict[str, Any]) -> ExecutableStore | None:
    """The store for a runner with these settings, or None where it is off."""
    return ExecutableStore(context) if enabled() else None

