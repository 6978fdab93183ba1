"""A victim stream and a health prober that run while a test attacks a live server.

    with Victim(url, model) as v:
        ...attack...
    v.check()        # no gap over 2 s between streamed events, /health always within 1 s

The victim restarts its stream whenever one ends, so it covers the whole attack; the
time from sending a request to its first event counts as a gap too.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx

MAX_GAP_S = 2.0
HEALTH_TIMEOUT_S = 1.0


class Victim:
    def __init__(self, url: str, model: str, max_tokens: int = 64) -> None:
        self.url = url
        self.model = model
        self.max_tokens = max_tokens
        self.gaps: list[float] = []
        self.events = 0
        self.health_failures: list[str] = []
        self.health_probes = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._stream, daemon=True),
                         threading.Thread(target=self._probe, daemon=True)]

    def __enter__(self) -> "Victim":
        for t in self._threads:
            t.start()
        deadline = time.monotonic() + 60
        while self.events < 3 and time.monotonic() < deadline and not self.errors:
            time.sleep(0.05)
        assert self.events >= 3, f"the victim stream did not start: {self.errors}"
        self.gaps.clear()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def _stream(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time", "stream": True,
                "max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True}
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                last = time.monotonic()
                try:
                    with c.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            self.errors.append(f"victim got HTTP {r.status_code}")
                            return
                        for line in r.iter_lines():
                            if not line.startswith("data: "):
                                continue
                            now = time.monotonic()
                            self.gaps.append(now - last)
                            last = now
                            if line != "data: [DONE]":
                                json.loads(line[6:])
                                self.events += 1
                except httpx.HTTPError as e:
                    self.errors.append(f"victim: {type(e).__name__}: {e}")
                    return

    def _probe(self) -> None:
        with httpx.Client(timeout=HEALTH_TIMEOUT_S) as c:
            while not self._stop.wait(0.25):
                self.health_probes += 1
                try:
                    r = c.get(f"{self.url}/health")
                    if r.status_code != 200:
                        self.health_failures.append(f"HTTP {r.status_code}")
                except httpx.HTTPError as e:
                    self.health_failures.append(type(e).__name__)

    def check(self) -> None:
        assert not self.errors, self.errors
        assert self.gaps, "the victim received nothing during the attack"
        assert max(self.gaps) < MAX_GAP_S, f"the victim stalled {max(self.gaps):.2f} s"
        assert self.health_probes and not self.health_failures, self.health_failures
