"""The KV transfer stream over TCP: a prefill server serves its saved prefills, a decode
server pulls them. Frames are the multi-host control channel's ([u32 length][msgpack
(kind, payload)], parallel/control.py; never pickle), and so is the HMAC-SHA256 proof.

    decode (client)                               prefill (TransferServer)
      connect                     <----  "kv-challenge" {v, nonce_s}
      "kv-fetch" {v, nonce_c, mac_c, transfer_id, first_block, num_blocks,
                  digest, geometry, wire}  ---->   (mac_c checked when a secret is set;
                                                    the saved prefill is TAKEN: released
                                                    whatever happens next)
                                  <----  "kv-data" {v, mac_s, shape, dtype, wire, nbytes,
                                                    crc32}
                                  <----  nbytes of block data [L, 2, K, n, S, H], raw or
                                         int8 with scales (wire.py)
                                   or    "kv-refused" {v, reason}

num_blocks = 0 only releases the saved prefill ("kv-released"). Sizes are bounded: a
frame is at most 4 KiB, and the client takes exactly the bytes its own cache geometry
says n blocks hold, checks the CRC-32, and refuses anything else. The secret proves who
is talking (both ways, bound to both nonces); the block bytes themselves are neither
encrypted nor MACed: run transfers on a private network.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from jaxserve.kv_transfer import wire as wire_codec
from jaxserve.parallel.control import (HANDSHAKE_MAX_FRAME, NONCE_BYTES, _mac, _recv_exact,
                                       _recv_frame, _send_frame)

log = logging.getLogger("jaxserve")

VERSION = 1
MAX_HANDLERS = 16           # connections served at once; more are closed at once


class TransferError(RuntimeError):
    """A transfer failed (refused, broken, timed out, corrupt); the message says why."""


@dataclass(slots=True)
class Saved:
    """A finished prefill's KV, read out of the pool (the blocks themselves are free)."""
    chunks: list[Any]               # device arrays [L, 2, K, C, S, H] (gathers in flight)
    num_blocks: int
    digest: bytes                   # of the token ids the blocks hold
    nbytes: int
    expires: float                  # monotonic


class SavedStore:
    """transfer_id -> Saved, bounded in bytes; entries leave when taken or expired."""

    def __init__(self, max_bytes: int, ttl: float) -> None:
        self.max_bytes, self.ttl = max_bytes, ttl
        self._items: dict[str, Saved] = {}
        self._lock = threading.Lock()
        self.nbytes = 0
        self.expired = 0

    def put(self, tid: str, chunks: list[Any], num_blocks: int, digest: bytes,
            nbytes: int) -> bool:
        """False (nothing kept) when it would exceed the byte bound."""
        self.sweep()
        with self._lock:
            if tid in self._items or self.nbytes + nbytes > self.max_bytes:
                return False
            self._items[tid] = Saved(chunks, num_blocks, digest, nbytes,
                                     time.monotonic() + self.ttl)
            self.nbytes += nbytes
            return True

    def take(self, tid: str) -> Saved | None:
        with self._lock:
            item = self._items.pop(tid, None)
            if item is not None:
                self.nbytes -= item.nbytes
            return item

    def has(self, tid: str) -> bool:
        with self._lock:
            return tid in self._items

    def sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [t for t, s in self._items.items() if s.expires <= now]
            for t in old:
                self.nbytes -= self._items.pop(t).nbytes
            self.expired += len(old)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class TransferServer:
    """Serves saved prefills on (host, port) from a thread; one thread per connection."""

    def __init__(self, store: SavedStore, to_host: Callable[[Saved], np.ndarray],
                 geometry: list[Any], *, host: str, port: int, secret: bytes,
                 timeout: float) -> None:
        self.store, self.to_host, self.geometry = store, to_host, geometry
        self.secret, self.timeout = secret, timeout
        self.sock = socket.create_server((host, port))
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self.served = 0
        self.refused: list[str] = []
        self._handlers = threading.BoundedSemaphore(MAX_HANDLERS)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._accept_loop, daemon=True,
                                       name="kv-transfer-server")
        self.thread.start()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        self.sock.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            self.store.sweep()          # expired prefills go even when nobody connects
            try:
                conn, addr = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            if not self._handlers.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._handle, args=(conn, f"{addr[0]}:{addr[1]}"),
                             daemon=True, name="kv-transfer-conn").start()

    def _handle(self, conn: socket.socket, peer: str) -> None:
        try:
            conn.settimeout(self.timeout)
            self._serve(conn)
        except Exception as e:          # noqa: BLE001 - a broken peer: log, drop
            self.refused = [*self.refused[-15:], f"{peer}: {type(e).__name__}: {e}"]
            log.warning("kv transfer: connection from %s failed: %s", peer, e)
        finally:
            conn.close()
            self._handlers.release()

    def _serve(self, conn: socket.socket) -> None:
        nonce = os.urandom(NONCE_BYTES)
        _send_frame(conn, "kv-challenge", {"v": VERSION, "nonce": nonce})
        kind, req = _recv_frame(conn, HANDSHAKE_MAX_FRAME)
        if kind != "kv-fetch" or not isinstance(req, dict) or req.get("v") != VERSION:
            raise TransferError(f"expected kv-fetch v{VERSION}, got {kind!r}")
        theirs = req.get("nonce")
        if not isinstance(theirs, bytes) or len(theirs) != NONCE_BYTES:
            raise TransferError("malformed kv-fetch")
        mac = req.get("mac")
        if self.secret and not (isinstance(mac, bytes) and hmac.compare_digest(
                mac, _mac(self.secret, b"kv-client", nonce, theirs, 0))):
            return _refuse(conn, "authentication failed (not the same secret)")
        saved = self.store.take(str(req.get("transfer_id")))
        if saved is None:
            return _refuse(conn, "unknown or expired transfer id")
        first, num = req.get("first_block"), req.get("num_blocks")
        if num == 0:
            return _send_frame(conn, "kv-released", {"v": VERSION})
        why = self._check(req, saved, first, num)
        if why:
            return _refuse(conn, why)
        data = self.to_host(saved)[:, :, :, first:first + num]
        used, payload = wire_codec.encode(data, str(req.get("wire", "native")))
        _send_frame(conn, "kv-data", {
            "v": VERSION, "mac": _mac(self.secret, b"kv-server", theirs, nonce, 0)
            if self.secret else b"", "shape": list(data.shape), "dtype": data.dtype.str,
            "wire": used, "nbytes": payload.nbytes, "crc32": zlib.crc32(payload)})
        conn.sendall(payload)
        self.served += 1

    def _check(self, req: dict, saved: Saved, first: Any, num: Any) -> str:
        if req.get("geometry") != self.geometry:
            return f"KV geometry differs: {req.get('geometry')} here {self.geometry}"
        if req.get("digest") != saved.digest:
            return "the prompt differs from the one prefilled"
        if not (type(first) is int and type(num) is int and 0 <= first
                and 0 < num and first + num <= saved.num_blocks):
            return f"blocks [{first}, +{num}) outside the {saved.num_blocks} saved"
        return ""


def _refuse(conn: socket.socket, reason: str) -> None:
    _send_frame(conn, "kv-refused", {"v": VERSION, "reason": reason})


def fetch(host: str, port: int, *, transfer_id: str, first_block: int, num_blocks: int,
          digest: bytes, geometry: list[Any], shape: tuple[int, ...], dtype: np.dtype,
          secret: bytes, timeout: float, wire: str = "native") -> np.ndarray | None:
    """Pull blocks [first, first + num) of a saved prefill -> host array `shape`, or
    release it (num_blocks 0 -> None). wire: the encoding asked for (wire.py; the
    server may answer natively). Raises TransferError."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.settimeout(timeout)
            return _fetch(conn, transfer_id, first_block, num_blocks, digest, geometry,
                          shape, np.dtype(dtype), secret, wire)
    except (OSError, ValueError, ConnectionError) as e:
        raise TransferError(f"{host}:{port}: {type(e).__name__}: {e or 'EOF'}") from None


def _fetch(conn: socket.socket, tid: str, first: int, num: int, digest: bytes,
           geometry: list[Any], shape: tuple[int, ...], dtype: np.dtype,
           secret: bytes, wire: str = "native") -> np.ndarray | None:
    kind, hello = _recv_frame(conn, HANDSHAKE_MAX_FRAME)
    if kind != "kv-challenge" or not isinstance(hello, dict) or hello.get("v") != VERSION:
        raise TransferError(f"not a jaxserve KV transfer endpoint (got {kind!r})")
    theirs, mine = hello.get("nonce"), os.urandom(NONCE_BYTES)
    if not isinstance(theirs, bytes) or len(theirs) != NONCE_BYTES:
        raise TransferError("malformed challenge")
    _send_frame(conn, "kv-fetch", {
        "v": VERSION, "nonce": mine, "mac": _mac(secret, b"kv-client", theirs, mine, 0)
        if secret else b"", "transfer_id": tid, "first_block": first, "num_blocks": num,
        "digest": digest, "geometry": geometry, "wire": wire})
    kind, head = _recv_frame(conn, HANDSHAKE_MAX_FRAME)
    if not isinstance(head, dict):
        raise TransferError(f"malformed {kind!r} frame")
    if kind == "kv-refused":
        raise TransferError(f"refused: {head.get('reason')}")
    if kind == "kv-released" and num == 0:
        return None
    if kind != "kv-data":
        raise TransferError(f"unexpected {kind!r} frame")
    if secret and not (isinstance(head.get("mac"), bytes) and hmac.compare_digest(
            head["mac"], _mac(secret, b"kv-server", mine, theirs, 0))):
        raise TransferError("the prefill server failed authentication")
    used = head.get("wire", "native")
    if used not in ("native", wire_codec.choose(wire, dtype)):
        raise TransferError(f"block data encoded as {used!r}; asked for {wire!r}")
    want = wire_codec.nbytes(shape, dtype, used)
    if head.get("nbytes") != want or head.get("shape") != list(shape) \
            or head.get("dtype") != dtype.str:
        raise TransferError(f"unexpected block data {head.get('shape')} {head.get('dtype')} "
                            f"({head.get('nbytes')} bytes; want {list(shape)} {dtype.str})")
    payload = _recv_exact(conn, want)
    if zlib.crc32(payload) != head.get("crc32"):
        raise TransferError("checksum mismatch: the block data arrived corrupted")
    return wire_codec.decode(payload, shape, dtype, used)


def token_digest(token_ids: list[int]) -> bytes:
    """Names the tokens whose KV a transfer holds (both sides compute it)."""
    return hashlib.sha256(np.asarray(token_ids, np.int64).tobytes()).digest()
