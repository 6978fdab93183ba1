"""Shared pieces of the stress suite (jaxserve/tools/stress.py): the server under test, a case's
result, the probes every case uses (health, KV pool, RSS, metrics, SSE checks), the
watch kept on a server while it is attacked (a victim stream, /health probes, RSS) and
the server subprocesses the suite starts.

Every probe talks to 127.0.0.1 only. A case returns a CaseResult; it fails when any of
its checks fails (`failures` says which), never by raising.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
MAX_STALL_S = 2.0             # longest gap a victim stream may see during an attack
PROBE_EVERY_S, PROBE_TIMEOUT_S = 0.25, 1.0


@dataclass(slots=True)
class Target:
    """A running server: its URL, API key (None: none set), process id (RSS is read from
    /proc/PID/status) and the model facts the cases need (read from /v1/models)."""
    url: str
    pid: int
    api_key: str | None = None
    model: str = ""
    vocab_size: int = 0
    max_model_len: int = 0
    max_num_seqs: int = 64
    max_waiting_requests: int = 1024
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    chat_text: str = "Write one sentence about the sea."

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def discover(self) -> "Target":
        """Fill model, vocab_size, max_model_len from /v1/models."""
        info = httpx.get(f"{self.url}/v1/models", headers=self.headers(), timeout=30).json()
        m = info["data"][0]
        self.model, self.vocab_size, self.max_model_len = \
            m["id"], m["vocab_size"], m["max_model_len"]
        return self


@dataclass(slots=True)
class CaseResult:
    """One named case. figures: the numbers reported (the table reads sent, completed,
    aborted, failed, status_5xx, leaked_blocks, rss_start_mib, rss_end_mib when present)."""
    name: str
    figures: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def check(self, cond: bool, what: str) -> bool:
        if not cond:
            self.failures.append(what)
        return cond

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "seconds": round(self.seconds, 2),
                "figures": self.figures, "failures": self.failures}


# ---- probes ----------------------------------------------------------------------------
def rss_mib(pid: int) -> float:
    """Resident set size of a process, MiB (Linux /proc); 0 once it has exited."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def health(t: Target, timeout: float = 10.0) -> int:
    try:
        return httpx.get(f"{t.url}/health", timeout=timeout).status_code
    except httpx.HTTPError:
        return 0


def wait_health(t: Target, want: int = 200, within: float = 15.0) -> tuple[int, float]:
    """Poll /health until it answers `want` (or `within` s pass): (last status, seconds)."""
    t0 = time.monotonic()
    while True:
        code = health(t, timeout=5)
        if code == want or time.monotonic() - t0 > within:
            return code, time.monotonic() - t0
        time.sleep(0.05)


def kv(t: Target) -> dict[str, Any]:
    return httpx.get(f"{t.url}/admin/kv", headers=t.headers(), timeout=30).json()


def settle(t: Target, within: float = 30.0) -> dict[str, Any]:
    """Poll /admin/kv until nothing runs or waits and every block is free; the last
    reading plus leaked_blocks (blocks still held) and settle_s. A Watch's victim stream
    on this server is paused meanwhile (its own blocks are not a leak)."""
    watch = WATCHING.get(t.url)
    with watch.paused() if watch is not None else contextlib.nullcontext():
        return _settle(t, within)


def _settle(t: Target, within: float) -> dict[str, Any]:
    t0 = time.monotonic()
    while True:
        k = kv(t)
        idle = k["num_running"] == 0 and k["num_waiting"] == 0 and \
            k["num_free_blocks"] == k["num_blocks"]
        if idle or time.monotonic() - t0 > within:
            return {**k, "leaked_blocks": k["num_blocks"] - k["num_free_blocks"],
                    "settle_s": round(time.monotonic() - t0, 2)}
        time.sleep(0.1)


def finished_counts(t: Target) -> dict[str, float]:
    """jaxserve:request_success_total by finished_reason (stop, length, abort, error)."""
    text = httpx.get(f"{t.url}/metrics", headers=t.headers(), timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("jaxserve:request_success_total{"):
            reason = line.split('finished_reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.split()[-1])
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(v - before.get(k, 0.0)) for k, v in sorted(after.items())
            if v - before.get(k, 0.0)}


# ---- server-sent events ----------------------------------------------------------------
def sse_data(lines: list[str]) -> list[str]:
    return [ln[6:] for ln in lines if ln.startswith("data: ")]


def check_stream(events: list[str], n: int) -> tuple[str, str]:
    """Classify a stream read to its end: ("completed", ""), ("failed", error code) for an
    in-band error event, or ("broken", why) when [DONE] is missing or repeated, or a
    choice has no or more than one finish_reason (a lost or duplicated completion)."""
    if not events or events[-1] != "[DONE]":
        return "broken", "no [DONE] at the end"
    if events.count("[DONE]") != 1:
        return "broken", f"{events.count('[DONE]')} [DONE] events"
    finishes: dict[int, int] = {}
    for e in events[:-1]:
        obj = json.loads(e)
        if "error" in obj:
            if e is not events[-2]:
                return "broken", "events after an error event"
            return "failed", str(obj["error"].get("code") or obj["error"].get("type"))
        for ch in obj.get("choices") or []:
            if ch.get("finish_reason"):
                finishes[ch["index"]] = finishes.get(ch["index"], 0) + 1
    if sorted(finishes) != list(range(n)) or any(v != 1 for v in finishes.values()):
        return "broken", f"finish_reason counts {finishes} for n={n}"
    return "completed", ""


def error_code(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"].get("code") or r.json()["error"].get("type"))
    except (ValueError, KeyError, TypeError):
        return r.text[:40]


# ---- the watch kept during an attack ------------------------------------------------------
WATCHING: dict[str, "Watch"] = {}        # url -> the Watch on that server now


class Watch:
    """While a case attacks a server: a victim stream and /health probes, from threads.

        with Watch(target) as w:
            ...attack...
        w.report(res)      # figures; fails res on a stall > 2 s or a failed probe

    The victim streams a greedy completion as long as the context allows and starts a
    new one whenever one ends; its stall is the longest gap between streamed events,
    the time from sending a request to its first event included. A probe is a GET
    /health on a fresh connection every 0.25 s with a 1 s timeout; it fails on a
    timeout, a refused connection or a status other than 200. RSS is read before and
    after. The watch goes on `after` s past the attack (2 probes at least). settle()
    pauses the victim (paused(): its stream closed, no gap counted, probes go on). Every
    loop ends at exit or after `limit` s, whichever comes first.
    """

    def __init__(self, t: Target, *, expect_healthy: bool = True, limit: float = 900.0,
                 after: float = 0.5, max_tokens: int | None = None,
                 max_stall_s: float = MAX_STALL_S) -> None:
        self.t, self.expect_healthy, self.limit, self.after = t, expect_healthy, limit, after
        self.max_stall_s = max_stall_s
        self.max_tokens = max_tokens or max(8, min(480, t.max_model_len - 16))
        self.gaps: list[float] = []
        self.events = self.streams = self.probes = 0
        self.probe_failures: dict[str, int] = {}
        self.errors: list[str] = []
        self.rss_start = self.rss_end = 0.0
        self._stop = threading.Event()
        self._pause = threading.Event()
        self._out = threading.Event()          # the victim is out of its stream (paused)
        self._end = self._start = 0.0
        self.max_stall_at = 0.0
        self._threads = [threading.Thread(target=self._victim, daemon=True),
                         threading.Thread(target=self._probe, daemon=True)]

    def __enter__(self) -> "Watch":
        self.rss_start = rss_mib(self.t.pid)
        self._end = time.monotonic() + self.limit
        WATCHING[self.t.url] = self
        for th in self._threads:
            th.start()
        deadline = time.monotonic() + 60
        while self.events < 2 and time.monotonic() < deadline and not self.errors:
            time.sleep(0.02)
        self.gaps.clear()              # start-up (compile, queue) is not the attack's
        self._start, self.max_stall_at = time.monotonic(), 0.0
        self.probes, self.probe_failures = 0, {}
        return self

    def __exit__(self, *exc: Any) -> None:
        # go on a little after the attack (its aftermath counts) and for 2 probes at least
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3 and (time.monotonic() - t0 < self.after or
                                             self.probes < 2):
            time.sleep(0.05)
        self._stop.set()
        for th in self._threads:
            th.join(timeout=35)
        WATCHING.pop(self.t.url, None)
        self.rss_end = rss_mib(self.t.pid)

    @contextlib.contextmanager
    def paused(self, within: float = 10.0) -> Any:
        """Close the victim's stream (within `within` s) and start it again after."""
        self._out.clear()
        self._pause.set()
        try:
            if self._threads[0].is_alive():
                self._out.wait(within)
            yield
        finally:
            self._pause.clear()

    def _victim(self) -> None:
        body = {"model": self.t.model, "prompt": "Once upon a time", "stream": True,
                "max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True}
        with httpx.Client(timeout=httpx.Timeout(30, connect=5)) as c:
            while not self._stop.is_set() and time.monotonic() < self._end:
                if self._pause.is_set():
                    self._out.set()
                    time.sleep(0.02)
                    continue
                last = time.monotonic()
                self.streams += 1
                try:
                    with c.stream("POST", f"{self.t.url}/v1/completions", json=body,
                                  headers=self.t.headers()) as r:
                        if r.status_code != 200:
                            r.read()
                            self.errors.append(f"HTTP {r.status_code} {r.text[:80]}")
                            return
                        for line in r.iter_lines():
                            if not line.startswith("data: "):
                                continue
                            now = time.monotonic()
                            self._gap(now - last, now)
                            last = now
                            if line.startswith('data: {"error"'):
                                self.errors.append(f"error event {line[6:120]}")
                                return
                            self.events += 1
                            if self._stop.is_set() or now > self._end:
                                return
                            if self._pause.is_set():
                                break
                except httpx.HTTPError as e:
                    if not self._stop.is_set():
                        self._gap(time.monotonic() - last, time.monotonic())
                        self.errors.append(f"{type(e).__name__}: {e}"[:160])
                    return

    def _gap(self, gap: float, now: float) -> None:
        if gap > max(self.gaps, default=0.0):
            self.max_stall_at = now - self._start      # when it ended, from the start
        self.gaps.append(gap)

    def _probe(self) -> None:
        limits = httpx.Limits(max_keepalive_connections=0)      # a fresh connection each
        with httpx.Client(timeout=PROBE_TIMEOUT_S, limits=limits) as c:
            while not self._stop.wait(PROBE_EVERY_S) and time.monotonic() < self._end:
                self.probes += 1
                try:
                    code = c.get(f"{self.t.url}/health").status_code
                    why = "" if code == 200 else f"HTTP {code}"
                except httpx.HTTPError as e:
                    why = type(e).__name__
                if why:
                    self.probe_failures[why] = self.probe_failures.get(why, 0) + 1

    @property
    def max_stall(self) -> float:
        return max(self.gaps, default=float("inf"))

    def report(self, res: CaseResult) -> None:
        failed = sum(self.probe_failures.values())
        res.figures.update({
            "victim_max_stall_s": round(self.max_stall, 3) if self.gaps else None,
            "victim_max_stall_ended_at_s": round(self.max_stall_at, 2),
            "victim_events": self.events, "victim_streams": self.streams,
            "victim_errors": self.errors[:5], "health_probes": self.probes,
            "health_probes_failed": failed, "health_probe_failures": self.probe_failures,
            "rss_start_mib": self.rss_start, "rss_end_mib": self.rss_end})
        if not self.expect_healthy:
            return
        res.check(bool(self.gaps) and not self.errors,
                  f"victim stream: {self.events} events, errors {self.errors[:3]}")
        res.check(self.max_stall <= self.max_stall_s,
                  f"victim stalled {self.max_stall:.2f} s (limit {self.max_stall_s} s)")
        res.check(self.probes > 0 and failed == 0,
                  f"{failed}/{self.probes} /health probes failed: {self.probe_failures}")


# ---- raw HTTP --------------------------------------------------------------------------
def read_http_response(s: socket.socket, deadline: float) -> tuple[int, bytes, bytes]:
    """Read one HTTP/1.1 response from a raw socket: (status, headers, body). The body
    is read to its Content-Length, or to the connection's close when there is none;
    everything by `deadline` (time.monotonic()), after which what arrived is returned."""
    buf = b""
    while b"\r\n\r\n" not in buf and time.monotonic() < deadline:
        chunk = _recv(s, deadline)
        if not chunk:
            break
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split()
    status = int(parts[1]) if len(parts) > 1 and parts[0].startswith("HTTP/") and \
        parts[1].isdigit() else 0
    length = next((int(ln.split(":", 1)[1]) for ln in lines[1:]
                   if ln.lower().startswith("content-length:")), None)
    while (length is None or len(body) < length) and time.monotonic() < deadline:
        chunk = _recv(s, deadline)
        if not chunk:
            break
        body += chunk
    return status, head, body if length is None else body[:length]


def _recv(s: socket.socket, deadline: float) -> bytes:
    s.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        return s.recv(65536)
    except socket.timeout:
        return b""
    except OSError:
        return b""


# ---- server processes --------------------------------------------------------------------
class Server:
    """A server subprocess (`jaxserve serve`, `jaxserve router`, ...); its output goes to
    a log file (read by a thread, so the pipe never fills); url from its first line that
    holds `marker` and " on http://"."""

    def __init__(self, cmd: list[str], log_path: Path, start_timeout: float = 900,
                 env: dict[str, str] | None = None, marker: str = "serving") -> None:
        self.cmd, self.log_path, self.marker = cmd, log_path, marker
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.url: str | None = None
        ready = threading.Event()
        threading.Thread(target=self._pump, args=(ready,), daemon=True).start()
        t0 = time.monotonic()
        if not ready.wait(start_timeout) or self.url is None:
            self.stop()
            raise RuntimeError(f"server did not start; log: {log_path}")
        self.start_s = time.monotonic() - t0

    def _pump(self, ready: threading.Event) -> None:
        assert self.proc.stdout is not None
        with self.log_path.open("w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                if self.url is None and self.marker in line and " on http://" in line:
                    self.url = line.split(" on ")[1].split()[0]
                    ready.set()
        ready.set()                                      # exited before serving

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
