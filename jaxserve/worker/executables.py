"""Step programs kept on disk as exported modules, so a second start neither traces nor
lowers them.

JAX's persistent compilation cache (compile_cache.py) saves XLA's compile, but a start
still traces and lowers every program to look it up (seconds for a bucket of a large
model). This store keeps each program's lowered module, serialized by jax.export (a
flatbuffer holding StableHLO bytecode, no pickle): a second start reads it, wraps it in
a jitted call of the module (no tracing of jaxserve's code) and compiles that, which
XLA's persistent cache answers from disk. The runner's compile counter does not move
for a program found here.

    <jaxserve cache>/executables/<fingerprint>/<program>-<signature>.jexp

A module takes and returns flat lists of arrays; the structures of the program's
arguments and results are jaxserve's pytrees. The argument structure is the caller's;
the result structure is written beside the module as JSON (worker/tree_codec.py), and
the donated arguments as leaf positions.

The fingerprint covers what a program's code closes over: the model config and every
runner setting (the caller's `context`), jaxserve's own source files, jax and jaxlib
versions, the platform and devices, XLA_FLAGS / LIBTPU_INIT_ARGS / JAXSERVE_* variables;
the signature, the arguments' tree, shapes, dtypes and shardings. A different build,
config or device gets other files, never a wrong program.

Trust: reading an entry parses a flatbuffer and MLIR bytecode, and runs nothing. The
files are still the user's own: written into the user's cache directory (mode 0700,
files 0600) and read back only from there; a file not owned by the current user, or
group/world writable, or in such a directory, is ignored, as is one whose checksum,
header or versions do not match (a truncated or corrupt file is removed and exported
again). On unless JAXSERVE_EXECUTABLE_CACHE=0, for single-process runs whose programs
are not sharded (a sharding plan's programs are compiled at every start); a program
that cannot be exported (host callbacks, a custom call jax.export does not know) is
compiled as before and not stored.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Hashable, Sequence

import jax

from jaxserve.paths import cache_root
from jaxserve.worker import tree_codec

log = logging.getLogger("jaxserve")
ENV = "JAXSERVE_EXECUTABLE_CACHE"
KEEP = 6            # fingerprint directories kept (the most recently used); older go
MAGIC = b"jaxserve-exported 1\n"
_SOURCE_DIRS = ("jaxserve", "kernels_pallas", "kernels_cpu")
# packages no program is traced from (editing them keeps the stored programs)
_UNTRACED = ("tools", "bench", "server", "router", "frontend")
_source_hash: str | None = None


def enabled() -> bool:
    """The store is on unless JAXSERVE_EXECUTABLE_CACHE is 0/false/off, for a
    single-process run where jax.export can serialize (its flatbuffers package)."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    if jax.process_count() != 1:
        return False
    try:
        import flatbuffers  # noqa: F401 - jax.export's serialization needs it
    except ImportError:
        log.info("stored step programs off: the package 'flatbuffers' is not installed")
        return False
    return True


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
        return self.dir / f"{name}-{hashlib.sha256(sig.encode()).hexdigest()[:24]}.jexp"

    def load(self, name: str, sig: str) -> Exported | None:
        """The module stored for (name, sig), or None (missing, foreign, corrupt)."""
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
            entry = Exported(jax.export.deserialize(bytearray(payload)),
                             tree_codec.decode(header["out_tree"]), tuple(header["donate"]))
        except Exception as e:  # noqa: BLE001 - any bad entry is exported again
            log.warning("executable cache: %s unusable (%s: %s); compiling it again",
                        path.name, type(e).__name__, e)
            path.unlink(missing_ok=True)
            return None
        self.loaded += 1
        return entry

    def save(self, name: str, sig: str, entry: Exported) -> None:
        """Write one module (atomically; one whose result structure the codec does not
        write is just not stored)."""
        if not self.usable:
            return
        try:
            payload = bytes(entry.module.serialize())
            header = json.dumps({"signature": sig, "fingerprint": self.fingerprint,
                                 "sha256": hashlib.sha256(payload).hexdigest(),
                                 "out_tree": tree_codec.encode(entry.out_tree),
                                 "donate": list(entry.donate)}).encode()
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + header + b"\n" + payload)
            os.replace(tmp, self._path(name, sig))
            self.saved += 1
        except Exception as e:  # noqa: BLE001 - storing is an optimisation only
            log.info("executable cache: %s not stored (%s: %s)", name, type(e).__name__, e)


class Exported:
    """A program as jax.export left it: the module over flat leaves, the structure of
    its results, and the leaf positions it donates."""

    def __init__(self, module: Any, out_tree: Any, donate: tuple[int, ...]) -> None:
        self.module, self.out_tree, self.donate = module, out_tree, donate


def _custom_call_checks() -> list[Any]:
    """jax.export refuses custom calls it does not know to be stable; the CPU kernels'
    FFI targets are jaxserve's own, built from the same sources the fingerprint covers."""
    from kernels_cpu.ragged_paged_attention import build
    return [jax.export.DisabledSafetyCheck.custom_call(t) for t in build.FFI_TARGETS]


def export(fn: Any, args: tuple, static: dict, donate_argnums: Sequence[int]) -> Exported:
    """Trace and lower fn(*args, **static) through jax.export, over the flat leaves."""
    in_tree = jax.tree_util.tree_structure(args)
    box: dict[str, Any] = {}

    def flat(*leaves: Any) -> list[Any]:
        out = fn(*jax.tree_util.tree_unflatten(in_tree, leaves), **static)
        flat_out, box["out"] = jax.tree_util.tree_flatten(out)
        return flat_out
    donate, at = [], 0
    for i, a in enumerate(args):
        n = len(jax.tree_util.tree_leaves(a))
        if i in donate_argnums:
            donate.extend(range(at, at + n))
        at += n
    module = jax.export.export(jax.jit(flat), disabled_checks=_custom_call_checks())(
        *jax.tree_util.tree_leaves(args))
    return Exported(module, box["out"], tuple(donate))


class Loaded:
    """A stored module compiled for this process: called with the program's own
    arguments (pytrees), it returns the program's own results."""

    def __init__(self, entry: Exported, args: tuple) -> None:
        leaves, self.in_tree = jax.tree_util.tree_flatten(args)
        self.out_tree = entry.out_tree
        self.compiled = jax.jit(entry.module.call, donate_argnums=entry.donate).lower(
            *leaves).compile()

    @property
    def out_info(self) -> Any:
        return jax.tree_util.tree_unflatten(
            self.out_tree, jax.tree_util.tree_leaves(self.compiled.out_info))

    def __call__(self, *args: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != self.in_tree:
            raise TypeError(f"arguments of structure {tree}, compiled for {self.in_tree}")
        return jax.tree_util.tree_unflatten(self.out_tree, self.compiled(*leaves))


class Program:
    """A jitted function plus the executables compiled for it ahead of time, by dispatch
    key (a cheap hashable the caller derives from the arguments that vary: the packed
    inputs' layout, the plan...). Without a store it is the jitted function as before:
    compile() fills jit's own caches and calls go through it. donate: the positions of
    the arguments the jitted function donates (a stored module is jitted again, with
    these)."""

    def __init__(self, fn: Any, name: str, store: ExecutableStore | None = None,
                 donate: Sequence[int] = ()) -> None:
        self.fn, self.name, self.store, self.donate = fn, name, store, tuple(donate)
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
        entry = self.store.load(self.name, sig)
        if entry is None:
            try:
                entry = export(self.fn, args, static, self.donate)
            except Exception as e:  # noqa: BLE001 - not exportable: compiled as before
                log.info("executable %s not exported (%s: %s); compiled at every start",
                         self.name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                return self.fn.lower(*args, **static).compile()
            self.store.save(self.name, sig, entry)
        try:
            compiled = Loaded(entry, args)
        except Exception as e:  # noqa: BLE001 - e.g. a kernel this process did not register
            log.warning("executable %s: the stored module does not compile here (%s: %s); "
                        "compiling it from the source", self.name, type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "")
            return self.fn.lower(*args, **static).compile()
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

