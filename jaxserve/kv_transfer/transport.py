"""The KV transfer stream over TCP: a prefill server serves its saved prefills, a decode
server pulls them. Frames are the multi-host control channel's ([u32 length][msgpack
(kind, payload)], core/multihost/control.py; never pickle), and so is the HMAC-SHA256 proof.

    decode (client)                               prefill (TransferServer)
      connect                     <----  "kv-challenge" {v, nonce_s}
      "kv-fetch" {v, nonce_c, mac_c, transfer_id, first_block, num_blocks,
                  digest, geometry, wire}  ---->   (within handshake_timeout; mac_c
                                                    checked; the saved prefill is TAKEN:
                                                    released whatever happens next)
                                  <----  "kv-data" {v, mac_s, digest, shape, dtype, wire,
                                                    nbytes, crc32}
                                  <----  nbytes of block data [L, 2, K, n, S, H], raw or
                                         int8 with scales (wire.py)
                                   or    "kv-refused" {v, reason}

num_blocks = 0 only releases the saved prefill ("kv-released"). mac_s binds both nonces,
the transfer id, the digest of the prompt tokens the saved blocks hold, and the data's
size and CRC-32: a decode server takes the data only from a server that knows the secret
and vouches for exactly its own prompt. Sizes are bounded: a frame is at most 4 KiB, and
the client takes exactly the bytes its own cache geometry says n blocks hold, within one
deadline for the whole transfer. The server gives a peer handshake_timeout to
authenticate, holds at most max_peer_connections per peer address and MAX_HANDLERS in
all, so idle or slow peers cannot keep decode servers out for long. The block bytes
themselves are neither encrypted nor MACed (CRC-32 is no defence against an on-path
attacker): run transfers on a private network.
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
import msgpack

from jaxserve.core.multihost.control import (FRAME_HEADER, HANDSHAKE_MAX_FRAME, NONCE_BYTES,
                                             handshake_mac, send_frame)

log = logging.getLogger("jaxserve")

VERSION = 2                 # 2: kv-data's MAC binds the prompt digest and the data
MAX_HANDLERS = 32           # connections served at once; more are closed at once


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

    def digest(self, tid: str) -> bytes | None:
        with self._lock:
            item = self._items.get(tid)
            return None if item is None else item.digest

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
                 timeout: float, handshake_timeout: float = 5.0,
                 max_peer_connections: int = 8) -> None:
        self.store, self.to_host, self.geometry = store, to_host, geometry
        self.secret, self.timeout = secret, timeout
        self.handshake_timeout = handshake_timeout
        self.max_peer_connections = max_peer_connections
        self.sock = socket.create_server((host, port))
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self.served = 0
        self.refused: list[str] = []
        self.turned_away = 0            # closed at accept: no slot, or its address is full
        self._handlers = threading.BoundedSemaphore(MAX_HANDLERS)
        self._peers: dict[str, int] = {}    # peer address -> connections being served
        self._peers_lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._accept_loop, daemon=True,
                                       name="kv-transfer-server")
        self.thread.start()

    @property
    def active(self) -> int:
        with self._peers_lock:
            return sum(self._peers.values())

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
            if not self._admit(addr[0]):
                self.turned_away += 1
                conn.close()
                continue
            threading.Thread(target=self._handle, args=(conn, addr[0], addr[1]),
                             daemon=True, name="kv-transfer-conn").start()

    def _admit(self, ip: str) -> bool:
        # one address cannot take every slot: other decode servers still get one
        with self._peers_lock:
            if self._peers.get(ip, 0) >= self.max_peer_connections:
                return False
            if not self._handlers.acquire(blocking=False):
                return False
            self._peers[ip] = self._peers.get(ip, 0) + 1
            return True

    def _handle(self, conn: socket.socket, ip: str, port: int) -> None:
        try:
            self._serve(conn)
        except Exception as e:          # noqa: BLE001 - a broken peer: log, drop
            self.refused = [*self.refused[-15:], f"{ip}:{port}: {type(e).__name__}: {e}"]
            log.warning("kv transfer: connection from %s:%d failed: %s", ip, port, e)
        finally:
            conn.close()
            with self._peers_lock:
                left = self._peers.pop(ip) - 1
                if left:
                    self._peers[ip] = left
                self._handlers.release()

    def _serve(self, conn: socket.socket) -> None:
        nonce = os.urandom(NONCE_BYTES)
        conn.settimeout(self.handshake_timeout)
        send_frame(conn, "kv-challenge", {"v": VERSION, "nonce": nonce})
        kind, req = recv_frame(conn, HANDSHAKE_MAX_FRAME,
                                time.monotonic() + self.handshake_timeout)
        if kind != "kv-fetch" or not isinstance(req, dict) or req.get("v") != VERSION:
            raise TransferError(f"expected kv-fetch v{VERSION}, got {kind!r}")
        theirs = req.get("nonce")
        if not isinstance(theirs, bytes) or len(theirs) != NONCE_BYTES:
            raise TransferError("malformed kv-fetch")
        conn.settimeout(self.timeout)
        mac = req.get("mac")
        if self.secret and not (isinstance(mac, bytes) and hmac.compare_digest(
                mac, handshake_mac(self.secret, b"kv-client", nonce, theirs, 0))):
            return _refuse(conn, "authentication failed (not the same secret)")
        tid = str(req.get("transfer_id"))
        saved = self.store.take(tid)
        if saved is None:
            return _refuse(conn, "unknown or expired transfer id")
        first, num = req.get("first_block"), req.get("num_blocks")
        if num == 0:
            return send_frame(conn, "kv-released", {"v": VERSION})
        why = self._check(req, saved, first, num)
        if why:
            return _refuse(conn, why)
        data = self.to_host(saved)[:, :, :, first:first + num]
        used, payload = wire_codec.encode(data, str(req.get("wire", "native")))
        crc = zlib.crc32(payload)
        send_frame(conn, "kv-data", {
            "v": VERSION, "mac": _data_mac(self.secret, theirs, nonce, tid, saved.digest,
                                           payload.nbytes, crc) if self.secret else b"",
            "digest": saved.digest, "shape": list(data.shape), "dtype": data.dtype.str,
            "wire": used, "nbytes": payload.nbytes, "crc32": crc})
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


def _data_mac(secret: bytes, client_nonce: bytes, server_nonce: bytes, tid: str,
              digest: bytes, nbytes: int, crc: int) -> bytes:
    """The server's proof: it knows the secret, and the data it is about to send is the
    KV of the prompt tokens `digest` names (saved under transfer id `tid`)."""
    msg = b"|".join((b"jaxserve-kv-data-v2", client_nonce, server_nonce, tid.encode(),
                     digest, str(nbytes).encode(), str(crc).encode()))
    return hmac.new(secret, msg, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytearray:
    """n bytes by `deadline` (monotonic), however slowly the peer trickles them."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:                      # each pass takes >= 1 byte or raises
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout(f"deadline passed with {got} of {n} bytes")
        sock.settimeout(left)
        k = sock.recv_into(view[got:], min(n - got, 1 << 22))
        if not k:
            raise ConnectionError("EOF")
        got += k
    return buf


def recv_frame(sock: socket.socket, limit: int, deadline: float) -> tuple[str, Any]:
    (n,) = FRAME_HEADER.unpack(_recv_exact(sock, FRAME_HEADER.size, deadline))
    if n > limit:
        raise ConnectionError(f"frame of {n} bytes (limit {limit})")
    msg = msgpack.unpackb(bytes(_recv_exact(sock, n, deadline)), raw=False)
    if not (isinstance(msg, (list, tuple)) and len(msg) == 2 and isinstance(msg[0], str)):
        raise ValueError("not a (kind, payload) frame")
    return msg[0], msg[1]


def _refuse(conn: socket.socket, reason: str) -> None:
    send_frame(conn, "kv-refused", {"v": VERSION, "reason": reason})


def fetch(host: str, port: int, *, transfer_id: str, first_block: int, num_blocks: int,
          digest: bytes, geometry: list[Any], shape: tuple[int, ...], dtype: np.dtype,
          secret: bytes, timeout: float, wire: str = "native") -> np.ndarray | None:
    """Pull blocks [first, first + num) of a saved prefill -> host array `shape`, or
    release it (num_blocks 0 -> None), all within `timeout` seconds. wire: the encoding
    asked for (wire.py; the server may answer natively). Raises TransferError."""
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            return _fetch(conn, transfer_id, first_block, num_blocks, digest, geometry,
                          shape, np.dtype(dtype), secret, wire, deadline)
    except (OSError, ValueError, ConnectionError) as e:
        raise TransferError(f"{host}:{port}: {type(e).__name__}: {e or 'EOF'}") from None


def _fetch(conn: socket.socket, tid: str, first: int, num: int, digest: bytes,
           geometry: list[Any], shape: tuple[int, ...], dtype: np.dtype,
           secret: bytes, wire: str, deadline: float) -> np.ndarray | None:
    kind, hello = recv_frame(conn, HANDSHAKE_MAX_FRAME, deadline)
    if kind != "kv-challenge" or not isinstance(hello, dict) or hello.get("v") != VERSION:
        raise TransferError(f"not a jaxserve KV transfer endpoint (got {kind!r})")
    theirs, mine = hello.get("nonce"), os.urandom(NONCE_BYTES)
    if not isinstance(theirs, bytes) or len(theirs) != NONCE_BYTES:
        raise TransferError("malformed challenge")
    send_frame(conn, "kv-fetch", {
        "v": VERSION, "nonce": mine, "mac": handshake_mac(secret, b"kv-client", theirs, mine, 0)
        if secret else b"", "transfer_id": tid, "first_block": first, "num_blocks": num,
        "digest": digest, "geometry": geometry, "wire": wire})
    kind, head = recv_frame(conn, HANDSHAKE_MAX_FRAME, deadline)
    if not isinstance(head, dict):
        raise TransferError(f"malformed {kind!r} frame")
    if kind == "kv-refused":
        raise TransferError(f"refused: {head.get('reason')}")
    if kind == "kv-released" and num == 0:
        return None
    if kind != "kv-data":
        raise TransferError(f"unexpected {kind!r} frame")
    if head.get("digest") != digest:
        raise TransferError("the prefill server holds the KV of another prompt")
    nbytes, crc = head.get("nbytes"), head.get("crc32")
    if secret and not (isinstance(head.get("mac"), bytes) and hmac.compare_digest(
            head["mac"], _data_mac(secret, mine, theirs, tid, digest, nbytes, crc))):
        raise TransferError("the prefill server failed authentication")
    used = head.get("wire", "native")
    if used not in ("native", wire_codec.choose(wire, dtype)):
        raise TransferError(f"block data encoded as {used!r}; asked for {wire!r}")
    want = wire_codec.nbytes(shape, dtype, used)
    if nbytes != want or head.get("shape") != list(shape) or head.get("dtype") != dtype.str:
        raise TransferError(f"unexpected block data {head.get('shape')} {head.get('dtype')} "
                            f"({nbytes} bytes; want {list(shape)} {dtype.str})")
    payload = _recv_exact(conn, want, deadline)
    if zlib.crc32(payload) != crc:
        raise TransferError("checksum mismatch: the block data arrived corrupted")
    return wire_codec.decode(payload, shape, dtype, used)


def token_digest(token_ids: list[int]) -> bytes:
    """Names the tokens whose KV a transfer holds (both sides compute it)."""
    return hashlib.sha256(np.asarray(token_ids, np.int64).tobytes()).digest()
