"""A child process that turns user constraints into device automaton tables, killable.

    worker = CompileWorker(vocab, limits)
    regex = worker.regex("json", schema_text, deadline_s=20)   # NotOnDevice if not regular
    tables = worker.tables(regex, deadline_s=20)               # NotOnDevice if too big

Why a process: outlines-core builds the whole DFA of a regex before anyone can look at
its size, and a short regex can have an exponential one ((a|b)*a(a|b){30}); a schema's
regex can be exponential in its $ref chains. Neither can be interrupted inside a thread.
Here the work runs in a child under an address-space cap; past the deadline the parent
kills it (the next call starts a fresh one), so a constraint costs at most a deadline
and a bounded amount of memory, and never holds the engine thread or the event loop.

Wire format (both directions, no pickle): a frame is a 4-byte big-endian length and a
JSON header; the header's "arrays" list [name, dtype, shape] for each raw array that
follows as an 8-byte length and its bytes. The child receives the vocabulary once, then
answers one request at a time.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import fields
from typing import Any, BinaryIO

import numpy as np

from jaxserve.structured.device_automaton import (AutomatonLimits, AutomatonTables,
                                                  NotOnDevice, compile_tables, regex_of)
from jaxserve.structured.device_vocab import TokenVocabulary

WORKER_MEMORY_BYTES = 2 << 30      # the child's address-space cap
MAX_FRAME_BYTES = 1 << 30
_TABLE_ARRAYS = ("masks", "byte_next", "exc_start", "exc_len", "exc_tokens", "exc_next",
                 "final")


# ---- framing ---------------------------------------------------------------------------
def encode(header: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> bytes:
    arrays = arrays or {}
    head = dict(header, arrays=[[k, a.dtype.str, list(a.shape)] for k, a in arrays.items()])
    raw = json.dumps(head).encode()
    parts = [len(raw).to_bytes(4, "big"), raw]
    for a in arrays.values():
        data = np.ascontiguousarray(a).tobytes()
        parts += [len(data).to_bytes(8, "big"), data]
    return b"".join(parts)


class _Reader:
    """Exact reads from a pipe, each by a deadline (None: block)."""

    def __init__(self, f: BinaryIO, deadline: float | None) -> None:
        self.fd = f.fileno()
        self.deadline = deadline

    def exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            if self.deadline is not None:
                left = self.deadline - time.monotonic()
                if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                    raise TimeoutError
            chunk = os.read(self.fd, min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)


def decode(f: BinaryIO, deadline: float | None = None
           ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    r = _Reader(f, deadline)
    n = int.from_bytes(r.exactly(4), "big")
    if n > MAX_FRAME_BYTES:
        raise EOFError
    header = json.loads(r.exactly(n))
    arrays = {}
    for name, dtype, shape in header.pop("arrays"):
        size = int.from_bytes(r.exactly(8), "big")
        if size > MAX_FRAME_BYTES:
            raise EOFError
        arrays[name] = np.frombuffer(r.exactly(size), np.dtype(dtype)).reshape(shape)
    return header, arrays


# ---- the parent's side -----------------------------------------------------------------
class CompileWorker:
    """One child process, started on first use, restarted after a kill or a crash.
    Calls are serialized (a lock): the caller is the compiler's own pool thread."""

    def __init__(self, vocab: TokenVocabulary, limits: AutomatonLimits = AutomatonLimits(),
                 memory_bytes: int = WORKER_MEMORY_BYTES) -> None:
        self.vocab = vocab
        self.limits = limits
        self.memory_bytes = memory_bytes
        self.restarts = 0                   # children killed or lost (observability, tests)
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def regex(self, kind: str, text: str, deadline_s: float) -> str:
        header, _ = self._call({"op": "regex", "kind": kind, "text": text}, deadline_s)
        return str(header["regex"])

    def tables(self, regex: str, deadline_s: float) -> AutomatonTables:
        header, arrays = self._call({"op": "tables", "regex": regex}, deadline_s)
        tb, tl = self.vocab.byte_arrays()
        return AutomatonTables(*(np.array(arrays[k]) for k in _TABLE_ARRAYS), tb, tl,
                               int(header["max_token_len"]))

    def _call(self, request: dict[str, Any], deadline_s: float
              ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        with self._lock:
            proc = self._ensure()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(encode(request))
                proc.stdin.flush()
                header, arrays = decode(proc.stdout, time.monotonic() + deadline_s)
            except TimeoutError:
                self._kill()
                raise NotOnDevice(f"compiling took longer than {deadline_s:g} s") from None
            except (EOFError, OSError, ValueError):
                self._kill()
                raise NotOnDevice("the compile ran out of memory or crashed") from None
        if "error" in header:
            raise NotOnDevice(str(header["error"]))
        return header, arrays

    def _ensure(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._proc is not None:
            self._kill()
        code = "from jaxserve.structured.compile_worker import main; main()"
        proc = subprocess.Popen([sys.executable, "-c", code, str(self.memory_bytes)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdin is not None
        tb, tl = self.vocab.byte_arrays()
        limits = {f.name: getattr(self.limits, f.name) for f in fields(self.limits)}
        proc.stdin.write(encode({"eos": list(self.vocab.eos_token_ids),
                                 "vocab_size": self.vocab.vocab_size, "limits": limits},
                                {"token_bytes": tb, "token_len": tl}))
        proc.stdin.flush()
        self._proc = proc
        return proc

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self.restarts += 1
        proc.kill()
        proc.wait(timeout=10)
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()           # type: ignore[union-attr]
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._kill()
                self.restarts -= 1


# ---- the child's side ------------------------------------------------------------------
def _vocab_from(header: dict[str, Any], arrays: dict[str, np.ndarray]) -> TokenVocabulary:
    tb, tl = np.array(arrays["token_bytes"]), np.array(arrays["token_len"])
    token_bytes = {int(i): tb[i, :tl[i]].tobytes() for i in np.nonzero(tl)[0]}
    vocab = TokenVocabulary(token_bytes, tuple(header["eos"]), int(header["vocab_size"]))
    vocab._arrays = (tb, tl)
    return vocab


def _answer(request: dict[str, Any], vocab: TokenVocabulary, limits: AutomatonLimits
            ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    try:
        if request["op"] == "regex":
            return {"regex": regex_of(request["kind"], request["text"])}, {}
        t = compile_tables(request["regex"], vocab, limits)
        return ({"max_token_len": t.max_token_len},
                {k: getattr(t, k) for k in _TABLE_ARRAYS})
    except NotOnDevice as e:
        return {"error": str(e)}, {}
    except (MemoryError, RecursionError) as e:
        return {"error": f"the constraint is too large to compile ({type(e).__name__})"}, {}
    except Exception as e:   # noqa: BLE001 - the host path reports the user's real error
        return {"error": f"device compile failed: {type(e).__name__}: {e}"}, {}


def main() -> None:
    """The child: cap its memory, yield the CPU to serving (nice), read the vocabulary,
    then answer requests until EOF."""
    import resource
    cap = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    os.nice(10)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    header, arrays = decode(stdin)
    vocab = _vocab_from(header, arrays)
    limits = AutomatonLimits(**header["limits"])
    while True:
        try:
            request, _ = decode(stdin)
        except EOFError:
            return
        stdout.write(encode(*_answer(request, vocab, limits)))
        stdout.flush()
