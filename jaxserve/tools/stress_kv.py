"""The stress suite's KV-transfer cases: a client's forged kv_transfer_params must not make
a decode server connect anywhere, and idle or half-open peers must not pin a producer's
handshake slots. Each case takes Targets (stress_lib.py) and returns a CaseResult."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Callable

import httpx

from .stress_lib import CaseResult, Target, Watch


class Impostor:
    """A listener on 127.0.0.1 that a forged kv_transfer_params names: it counts the
    connections it gets and hands each to `serve` (here: nothing; a subclass may answer
    like a prefill server), then closes it. Bounded: it stops after `limit` s."""

    def __init__(self, limit: float = 300.0) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._end = time.monotonic() + limit
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._end:
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.connections += 1
            with conn:
                try:
                    self.serve(conn)
                except (OSError, ValueError, ConnectionError):
                    pass

    def serve(self, conn: socket.socket) -> None:
        """What a connection gets before it is closed."""

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close()


def _greedy(t: Target, prompt: str, max_tokens: int, **extra: Any) -> tuple[int, str, dict]:
    r = httpx.post(f"{t.url}/v1/completions", headers=t.headers(), timeout=120,
                   json={"model": t.model, "prompt": prompt, "max_tokens": max_tokens,
                         "temperature": 0, "ignore_eos": True, **extra})
    if r.status_code != 200:
        return r.status_code, r.text[:200], {}
    body = r.json()
    return 200, body["choices"][0]["text"], body.get("kv_transfer_params") or {}


def kv_forged_params(consumer: Target, *, max_tokens: int = 8,
                     prompt: str = "The capital of France is a city where") -> CaseResult:
    """A client's kv_transfer_params naming an impostor listener, sent to a decode
    (kv_consumer) server: the listener sees no connection, the request is answered as if
    the params were absent, and a plain request with the same prompt afterwards gets the
    same greedy answer as before the attempt."""
    res = CaseResult("kv_transfer:forged_params")
    impostor = Impostor()
    try:
        with Watch(consumer) as w:
            marks = [time.monotonic()]
            s0, before, _ = _greedy(consumer, prompt, max_tokens)
            marks.append(time.monotonic())
            forged = {"do_remote_prefill": True, "remote_host": "127.0.0.1",
                      "remote_port": impostor.port, "remote_engine_id": "x",
                      "transfer_id": "forged-1", "prompt_digest": "0" * 64,
                      "expires": int(time.time()) + 600,
                      "signature": "0" * 64}
            s1, during, _ = _greedy(consumer, prompt, max_tokens, kv_transfer_params=forged)
            marks.append(time.monotonic())
            time.sleep(0.5)                  # a pull, if one started, would connect by now
            s2, after, _ = _greedy(consumer, prompt, max_tokens)
            marks.append(time.monotonic())
        w.report(res)
    finally:
        impostor.close()
    res.figures.update({"sent": 3, "completed": (s0, s1, s2).count(200),
                        "status_5xx": sum(s >= 500 for s in (s0, s1, s2)),
                        "impostor_connections": impostor.connections,
                        "seen": {"before": s0, "forged": s1, "after": s2},
                        "same_answer": before == during == after, "answer": before,
                        "request_s": [round(b - a, 2) for a, b in zip(marks, marks[1:])]})
    res.check((s0, s1, s2) == (200, 200, 200), f"statuses {(s0, s1, s2)}: {during[:120]}")
    res.check(impostor.connections == 0,
              f"the impostor got {impostor.connections} connection(s)")
    res.check(before == during == after,
              f"greedy answers differ: {before!r} / {during!r} / {after!r}")
    return res


def kv_idle_peers(producer: Target, consumer: Target, *, idle: int = 100,
                  idle_source: str = "127.0.0.2", max_tokens: int = 8,
                  pull_failures: Callable[[], int] | None = None,
                  prompt: str = "A long list of the rivers of Europe begins with") -> CaseResult:
    """`idle` connections to a prefill (kv_producer) server's transfer port that never
    authenticate, then a legitimate transfer: the prefill's kv_transfer_params, handed
    to the decode server, give a 200 with no failed pull (pull_failures(): the decode
    server's count so far), and the idle peers are closed (at accept, over the per-peer
    cap, or at the handshake deadline). The idle peers connect from `idle_source` (a
    loopback address other than the decode server's, which the per-peer cap would
    otherwise also count)."""
    res = CaseResult("kv_transfer:idle_peers")
    conns: list[socket.socket] = []
    with Watch(producer) as w:
        s_pre, _, params = _greedy(producer, prompt, 1,
                                   kv_transfer_params={"do_remote_decode": True})
        port = params.get("remote_port")
        res.check(s_pre == 200 and bool(port), f"prefill: {s_pre}, params {params}")
        if not port:
            w.report(res)
            return res
        t0 = time.monotonic()
        for _ in range(idle):
            with contextlib.suppress(OSError):
                conns.append(socket.create_connection(
                    ("127.0.0.1", port), timeout=5, source_address=(idle_source, 0)))
        time.sleep(0.3)                     # accepted or turned away by now
        fails0 = pull_failures() if pull_failures else 0
        s_pre2, _, params2 = _greedy(producer, prompt + " the", 1,
                                     kv_transfer_params={"do_remote_decode": True})
        t1 = time.monotonic()
        s_dec, text, _ = _greedy(consumer, prompt + " the", max_tokens,
                                 kv_transfer_params=params2)
        transfer_s = time.monotonic() - t1
        fails = (pull_failures() - fails0) if pull_failures else 0
        closed = 0
        for s in conns:                     # which idle ones the server closed by now
            s.setblocking(False)
            try:
                closed += s.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        held_s = time.monotonic() - t0
        for s in conns:
            s.close()
    w.report(res)
    res.figures.update({"sent": 3, "completed": (s_pre, s_pre2, s_dec).count(200),
                        "status_5xx": sum(s >= 500 for s in (s_pre, s_pre2, s_dec)),
                        "idle_connections": len(conns), "idle_closed_by_server": closed,
                        "idle_held_s": round(held_s, 2), "transfer_s": round(transfer_s, 2),
                        "pull_failures": fails, "advertised": bool(params2.get("signature")),
                        "seen": {"prefill": s_pre2, "decode": s_dec}})
    res.check(len(conns) == idle, f"{len(conns)} of {idle} idle connections opened")
    res.check(s_pre2 == 200 and bool(params2.get("do_remote_prefill")),
              f"second prefill: {s_pre2}, params {params2}")
    res.check(s_dec == 200, f"decode with the prefill's params: {s_dec} {text[:120]}")
    res.check(fails == 0, f"{fails} pull(s) failed with {idle} idle peers on the port")
    res.check(transfer_s < 10, f"the transfer took {transfer_s:.1f} s")
    return res
