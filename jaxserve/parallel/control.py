"""The control channel between rank 0 and the other ranks of a multi-host engine.

    rank 0 (Leader)  --TCP, one connection per rank-->  rank i (Follower)
        frames:  [u32 big-endian length][msgpack (kind, payload)]
        kinds:   "hello" (i -> 0, rank id)   "step" (0 -> i, encoded SchedulerOutput)
                 "hb" (both ways, every timeout/4 s)   "stop" (0 -> i, clean shutdown)

Every rank watches its peers: a closed connection (the peer process died: the OS closes
its sockets) or no frame for `timeout` seconds (hung or partitioned) is fatal. Fatal
means `on_fatal(message)`, by default: log the message and exit the process at once —
the main thread may be blocked inside a cross-host collective that will never finish,
so there is nothing to unwind; a clear error beats a hang.
"""
from __future__ import annotations

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
_HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30


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
        body = msgpack.packb((kind, payload), use_bin_type=True)
        try:
            with self._send_lock:
                self.sock.sendall(_HEADER.pack(len(body)) + body)
        except OSError as e:
            if not self.closing:
                self.on_lost(f"{self.peer}: connection lost while sending ({e})")
            raise PeerLost(self.peer) from e

    def recv_frame(self) -> tuple[str, Any]:
        (n,) = _HEADER.unpack(_recv_exact(self.sock, _HEADER.size))
        if n > MAX_FRAME:
            raise ConnectionError(f"frame of {n} bytes")
        kind, payload = msgpack.unpackb(_recv_exact(self.sock, n), raw=False)
        return kind, payload

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


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("EOF")
        buf += chunk
    return bytes(buf)


class Leader:
    """Rank 0: accepts one connection per other rank, then broadcasts to all of them."""

    def __init__(self, num_hosts: int, bind: tuple[str, int], *, timeout: float,
                 connect_timeout: float = 300.0,
                 on_fatal: Callable[[str], None] = die) -> None:
        self.on_fatal = on_fatal
        self.conns: dict[int, _Conn] = {}
        srv = socket.create_server(bind, reuse_port=False)
        srv.settimeout(connect_timeout)
        deadline = time.monotonic() + connect_timeout
        try:
            while len(self.conns) < num_hosts - 1:
                srv.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    sock, addr = srv.accept()
                except socket.timeout:
                    missing = sorted(set(range(1, num_hosts)) - set(self.conns))
                    raise PeerLost(f"rank(s) {missing} did not connect to the control channel "
                                   f"on {bind[0]}:{bind[1]} within {connect_timeout:.0f} s") from None
                sock.settimeout(connect_timeout)
                kind, rank = _Conn(sock, "?", timeout, _ignore, _ignore).recv_frame()
                if kind != "hello" or not isinstance(rank, int) or rank in self.conns:
                    sock.close()
                    continue
                self.conns[rank] = _Conn(sock, f"rank {rank}", timeout, self._unexpected,
                                         self._lost)
        finally:
            srv.close()
        for c in self.conns.values():
            c.start()
        log.info("multi-host: control channel up with ranks %s", sorted(self.conns))

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
    """Rank i > 0: connects to rank 0 and receives its messages in order."""

    def __init__(self, rank: int, address: tuple[str, int], *, timeout: float,
                 connect_timeout: float = 300.0,
                 on_fatal: Callable[[str], None] = die) -> None:
        self.on_fatal = on_fatal
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                sock = socket.create_connection(address, timeout=5.0)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise PeerLost(f"could not reach rank 0's control channel at "
                                   f"{address[0]}:{address[1]} within {connect_timeout:.0f} s "
                                   f"({e})") from None
                time.sleep(0.2)
        self.conn = _Conn(sock, "rank 0", timeout, self._on_message, self._lost)
        self.conn.send("hello", rank)
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


def _ignore(*_: Any) -> None:
    return None
