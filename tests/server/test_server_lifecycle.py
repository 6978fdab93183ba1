"""Server lifecycle: the engine dying under open requests, and SIGTERM shutdown."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from server_harness import MODEL_NAME, ServerThread, spawn, tiny_args, tiny_parts


def test_engine_death_fails_open_requests_and_health():
    from jaxserve.server.launch import build_engine
    cfg, weights, tok = tiny_parts()
    args = tiny_args()
    engine = build_engine(args, cfg, weights, tok, warmup=False)
    entered, release = threading.Event(), threading.Event()

    def broken_step():                   # no compile needed: the step never runs
        entered.set()
        release.wait(20)
        raise RuntimeError("injected device failure")
    engine.core.step = broken_step
    srv = ServerThread(engine, tok, args)
    try:
        body = {"model": MODEL_NAME, "prompt": "w5 w6", "max_tokens": 4}
        results: dict[str, httpx.Response | str] = {}

        def plain():
            results["plain"] = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)

        def streamed():
            with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=30,
                              json={**body, "stream": True}) as r:
                results["stream_status"] = str(r.status_code)
                results["stream"] = "".join(r.iter_text())
        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        assert entered.wait(20)
        time.sleep(0.3)                  # both requests are queued in the engine
        assert httpx.get(f"{srv.url}/health").status_code == 200
        release.set()
        for t in threads:
            t.join(30)
        plain_r = results["plain"]
        assert plain_r.status_code == 503
        assert plain_r.json()["error"]["code"] == "engine_dead"
        assert "injected device failure" in plain_r.json()["error"]["message"]
        # The stream may have had its headers refused (503) or failed in-band.
        if results["stream_status"] == "200":
            events = [ln[6:] for ln in results["stream"].splitlines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == "engine_dead"
        else:
            assert results["stream_status"] == "503"
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        later = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=10)
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_dead"
        assert "engine_healthy{model_name=\"tiny\"} 0.0" in httpx.get(f"{srv.url}/metrics").text
    finally:
        release.set()
        srv.stop()


def test_sigterm_finishes_in_flight_and_exits_zero():
    proc, url = spawn({"shutdown_timeout": 60})
    try:
        body = {"model": MODEL_NAME, "prompt": "w7 w8", "max_tokens": 40, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        got: dict = {}

        def stream():
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        got.setdefault("first", time.monotonic())
                        ev = json.loads(line[6:])
                        if ev.get("usage"):
                            got["usage"] = ev["usage"]
                    elif line == "data: [DONE]":
                        got["done"] = True
        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 120
        while "first" not in got and time.monotonic() < deadline and t.is_alive():
            time.sleep(0.05)
        assert "first" in got, "no first token"
        proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert got.get("done") and got["usage"]["completion_tokens"] == 40
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.TransportError):       # no longer accepting
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
