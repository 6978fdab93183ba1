"""The control channel between rank 0 and the other ranks of a multi-host engine.

    rank 0 (Leader)  --TCP, one connection per rank-->  rank i (Follower)
        frames:  [u32 big-endian length][msgpack (kind, payload)]  (never pickle)
        start:   "challenge" (0 -> i, nonce)  "hello" (i -> 0, rank, nonce, HMAC)
                 "welcome" (0 -> i, HMAC) or "refused" (0 -> i, reason)
        then:    "step" (0 -> i, encoded SchedulerOutput)   "stop" (0 -> i, clean shutdown)
                 "hb" (both ways, every timeout/4 s)

Start-up is a mutual HMAC-SHA256 challenge-response over a secret every rank shares
(core/multihost/engine.py derives it; docs/parallel.md): a process that cannot prove it
knows the secret is refused before anything is sent to it, and so is a rank out of
1..N-1 or one already connected. A follower checks rank 0's answer too, so it never
runs steps from an impostor. Each connection is checked on its own thread with a short
time limit, so a stray connection (a port scan, a health check that connects and
closes, garbage) is logged and dropped without delaying or crashing rank 0.

Every rank watches its peers: a closed connection (the peer process died: the OS closes
its sockets) or no frame for `timeout` seconds (hung or partitioned) is fatal. Fatal
means `on_fatal(message)`, by default: log the message and exit the process at once —
the main thread may be blocked inside a cross-host collective that will never finish,
so there is nothing to unwind; a clear error beats a hang.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable

import msgpack

log = logging.getLogger("jaxserve")

EXIT_PEER_LOST = 75
FRAME_HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30
HANDSHAKE_MAX_FRAME = 4096     # an unauthenticated peer cannot make rank 0 buffer more
HANDSHAKE_TIMEOUT = 10.0
NONCE_BYTES = 32


class PeerLost(RuntimeError):
    """Another rank died, hung or closed the connection unexpectedly."""


def die(message: str) -> None:
    """Default fatal handler: report and exit without waiting on stuck device work."""
    log.critical(message)
    print(f"jaxserve: fatal: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)


class _Conn:
    """One framed, heartbeated connection; reads on its own thread."""

    def __init__(self, sock: socket.socket, peer: str, timeout: float,
                 on_message: Callable[[str, Any], None], on_lost: Callable[[str], None]) -> None:
        self.sock = sock
        self.peer = peer
        self.timeout = timeout
        self.on_message = on_message
        self.on_lost = on_lost
        self.closing = False
        self._send_lock = threading.Lock()
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"control-read-{peer}")
        self._beater = threading.Thread(target=self._beat_loop, daemon=True,
                                        name=f"control-hb-{peer}")

    def start(self) -> None:
        self._reader.start()
        self._beater.start()

    def send(self, kind: str, payload: Any = None) -> None:
        try:
            with self._send_lock:
                send_frame(self.sock, kind, payload)
        except OSError as e:
            if not self.closing:
                self.on_lost(f"{self.peer}: connection lost while sending ({e})")
            raise PeerLost(self.peer) from e

    def recv_frame(self) -> tuple[str, Any]:
        return recv_frame(self.sock, MAX_FRAME)

    def _read_loop(self) -> None:
        while True:
            try:
                kind, payload = self.recv_frame()
            except socket.timeout:
                if not self.closing:
                    self.on_lost(f"{self.peer}: no heartbeat for {self.timeout:.0f} s "
                                 f"(hung, overloaded or unreachable)")
                return
            except (OSError, ConnectionError, ValueError) as e:
                if not self.closing:
                    self.on_lost(f"{self.peer}: connection closed ({e or 'EOF'}); "
                                 f"the process probably died")
                return
            if kind != "hb":
                self.on_message(kind, payload)

    def _beat_loop(self) -> None:
        while not self.closing:
            time.sleep(self.timeout / 4)
            try:
                self.send("hb")
            except PeerLost:
                return

    def close(self) -> None:
        self.closing = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def send_frame(sock: socket.socket, kind: str, payload: Any = None) -> None:
    body = msgpack.packb((kind, payload), use_bin_type=True)
    sock.sendall(FRAME_HEADER.pack(len(body)) + body)


def recv_frame(sock: socket.socket, limit: int) -> tuple[str, Any]:
    (n,) = FRAME_HEADER.unpack(_recv_exact(sock, FRAME_HEADER.size))
    if n > limit:
        raise ConnectionError(f"frame of {n} bytes (limit {limit})")
    msg = msgpack.unpackb(_recv_exact(sock, n), raw=False)
    if not (isinstance(msg, (list, tuple)) and len(msg) == 2 and isinstance(msg[0], str)):
        raise ValueError("not a (kind, payload) frame")
    return msg[0], msg[1]


class HandshakeError(PeerLost):
    """A control connection was refused at start-up (the message says why)."""


def handshake_mac(secret: bytes, role: bytes, first: bytes, second: bytes, rank: int) -> bytes:
    """Proof of the secret bound to both nonces, the direction and the rank (so a reply
    cannot be replayed, reflected, or moved to another rank)."""
    msg = b"|".join((b"jaxserve-control-v1", role, first, second, str(rank).encode()))
    return hmac.new(secret, msg, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("EOF")
        buf += chunk
    return bytes(buf)


class Leader:
    """Rank 0: admits one authenticated connection per other rank, then broadcasts."""

    def __init__(self, num_hosts: int, bind: tuple[str, int], *, secret: bytes,
                 timeout: float, connect_timeout: float = 300.0,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT,
                 on_fatal: Callable[[str], None] = die) -> None:
        if not secret:
            raise ValueError("the control channel needs a non-empty secret")
        self.on_fatal = on_fatal
        self.num_hosts = num_hosts
        self.conns: dict[int, _Conn] = {}
        self.refused: list[str] = []            # why connections were dropped (logs, tests)
        self._secret = secret
        self._timeout = timeout
        self._handshake_timeout = handshake_timeout
        self._lock = threading.Lock()           # conns / refused, shared with handshakes
        srv = socket.create_server(bind, reuse_port=False)
        try:
            self._accept_all(srv, bind, connect_timeout)
        finally:
            srv.close()
        for c in self.conns.values():
            c.start()
        log.info("multi-host: control channel up with ranks %s", sorted(self.conns))

    def _accept_all(self, srv: socket.socket, bind: tuple[str, int],
                    connect_timeout: float) -> None:
        deadline = time.monotonic() + connect_timeout
        while True:
            with self._lock:
                if len(self.conns) == self.num_hosts - 1:
                    return
                missing = sorted(set(range(1, self.num_hosts)) - set(self.conns))
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerLost(f"rank(s) {missing} did not connect to the control channel "
                               f"on {bind[0]}:{bind[1]} within {connect_timeout:.0f} s"
                               + (f" (refused: {'; '.join(self.refused)})"
                                  if self.refused else ""))
            srv.settimeout(min(0.2, left))
            try:
                sock, addr = srv.accept()
            except socket.timeout:
                continue
            # Each newcomer is checked on its own thread: a silent one cannot hold up
            # the real ranks, and whatever it does ends in a log line, never a crash.
            threading.Thread(target=self._admit, args=(sock, f"{addr[0]}:{addr[1]}"),
                             daemon=True, name="control-handshake").start()

    def _admit(self, sock: socket.socket, peer: str) -> None:
        try:
            sock.settimeout(self._handshake_timeout)
            rank = self._handshake(sock)
        except HandshakeError as e:
            self._refuse(sock, peer, str(e), tell=True)
        except Exception as e:      # noqa: BLE001 - a stray or broken peer: drop it
            self._refuse(sock, peer, f"bad handshake ({type(e).__name__}: {e or 'EOF'})",
                         tell=False)
        else:
            log.info("multi-host: rank %d connected from %s", rank, peer)

    def _handshake(self, sock: socket.socket) -> int:
        nonce = os.urandom(NONCE_BYTES)
        send_frame(sock, "challenge", nonce)
        kind, body = recv_frame(sock, HANDSHAKE_MAX_FRAME)
        if kind != "hello" or not isinstance(body, dict):
            raise HandshakeError(f"expected hello, got {kind!r}")
        rank, theirs, mac = body.get("rank"), body.get("nonce"), body.get("mac")
        if not (type(rank) is int and isinstance(theirs, bytes) and len(theirs) == NONCE_BYTES
                and isinstance(mac, bytes)):
            raise HandshakeError("malformed hello")
        # The proof first: who does not know the secret learns nothing about the ranks.
        if not hmac.compare_digest(mac, handshake_mac(self._secret, b"rank", nonce, theirs, rank)):
            raise HandshakeError("authentication failed (not the same multi-host secret)")
        with self._lock:
            if not 1 <= rank < self.num_hosts:
                raise HandshakeError(f"rank {rank} is out of range 1..{self.num_hosts - 1}")
            if rank in self.conns:
                raise HandshakeError(f"rank {rank} is already connected")
            send_frame(sock, "welcome", handshake_mac(self._secret, b"leader", theirs, nonce, rank))
            self.conns[rank] = _Conn(sock, f"rank {rank}", self._timeout, self._unexpected,
                                     self._lost)
        return rank

    def _refuse(self, sock: socket.socket, peer: str, reason: str, *, tell: bool) -> None:
        log.warning("multi-host: refused a control connection from %s: %s", peer, reason)
        with self._lock:
            self.refused.append(f"{peer}: {reason}")
        if tell:            # a reason, never data: a misconfigured rank learns what is wrong
            try:
                send_frame(sock, "refused", reason)
            except OSError:
                pass
        sock.close()

    def broadcast(self, kind: str, payload: Any = None) -> None:
        for c in self.conns.values():
            c.send(kind, payload)

    def stop(self) -> None:
        """Tell every rank to stop, then close (their EOFs are expected from here on)."""
        for c in self.conns.values():
            c.closing = True
        for c in self.conns.values():
            try:
                c.send("stop")
            except PeerLost:
                pass
            c.close()

    def _lost(self, message: str) -> None:
        self.on_fatal(f"multi-host: lost {message}; stopping the service")

    def _unexpected(self, kind: str, payload: Any) -> None:
        log.warning("multi-host: unexpected %r from a follower", kind)


class Follower:
    """Rank i > 0: connects to rank 0, proves the secret, receives its messages in order."""

    def __init__(self, rank: int, address: tuple[str, int], *, secret: bytes,
                 timeout: float, connect_timeout: float = 300.0,
                 on_fatal: Callable[[str], None] = die) -> None:
        self.on_fatal = on_fatal
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        sock = _connect(address, connect_timeout)
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            _prove(sock, rank, secret, address)
        except BaseException:
            sock.close()
            raise
        self.conn = _Conn(sock, "rank 0", timeout, self._on_message, self._lost)
        self.conn.start()

    def recv(self) -> tuple[str, Any]:
        return self.inbox.get()

    def close(self) -> None:
        self.conn.close()

    def _on_message(self, kind: str, payload: Any) -> None:
        if kind == "stop":
            self.conn.closing = True
        self.inbox.put((kind, payload))

    def _lost(self, message: str) -> None:
        self.on_fatal(f"multi-host: lost {message}; stopping this rank")


def _connect(address: tuple[str, int], connect_timeout: float) -> socket.socket:
    deadline = time.monotonic() + connect_timeout
    while True:
        try:
            return socket.create_connection(address, timeout=5.0)
        except OSError as e:
            if time.monotonic() > deadline:
                raise PeerLost(f"could not reach rank 0's control channel at "
                               f"{address[0]}:{address[1]} within {connect_timeout:.0f} s "
                               f"({e})") from None
            time.sleep(0.2)


def _prove(sock: socket.socket, rank: int, secret: bytes, address: tuple[str, int]) -> None:
    """The follower's half of the handshake; HandshakeError if rank 0 refuses or fails
    to prove it knows the secret."""
    where = f"{address[0]}:{address[1]}"
    try:
        kind, nonce = recv_frame(sock, HANDSHAKE_MAX_FRAME)
    except (OSError, ConnectionError, ValueError) as e:
        raise HandshakeError(f"no challenge from rank 0's control channel at {where} "
                             f"({e or 'EOF'})") from None
    if kind != "challenge" or not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise HandshakeError(f"{where} is not a jaxserve control channel")
    mine = os.urandom(NONCE_BYTES)
    send_frame(sock, "hello", {"rank": rank, "nonce": mine,
                                "mac": handshake_mac(secret, b"rank", nonce, mine, rank)})
    try:
        kind, body = recv_frame(sock, HANDSHAKE_MAX_FRAME)
    except (OSError, ConnectionError, ValueError) as e:
        raise HandshakeError(f"rank 0 closed the control connection during the handshake "
                             f"({e or 'EOF'})") from None
    if kind == "refused":
        raise HandshakeError(f"rank 0 refused rank {rank}: {body}")
    if kind != "welcome" or not isinstance(body, bytes) or not hmac.compare_digest(
            body, handshake_mac(secret, b"leader", mine, nonce, rank)):
        raise HandshakeError(f"{where} failed to prove it knows the multi-host secret")
