"""Shared pieces of the stress suite (scripts/stress.py): the server under test, a case's
result, and the probes every case uses (health, KV pool, RSS, metrics, SSE checks).

Every probe talks to 127.0.0.1 only. A case returns a CaseResult; it fails when any of
its checks fails (`failures` says which), never by raising.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


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
    """Resident set size of a process, MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
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
    reading plus leaked_blocks (blocks still held) and settle_s."""
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
