"""The engine-loop watchdog and SIGTERM with a wedged engine thread.

The engine thread is wedged inside add_request (not inside a step): /health and
engine_healthy must see it once its loop has not turned for --step-timeout s, admin
routes that need the engine must answer 503 instead of hanging, and SIGTERM must end
the process with a non-zero status after ending open streams with an error event and
[DONE]. A second SIGTERM ends a drain at once.

SIGTERM to a `jaxserve serve` process with a wedged engine thread is checked by
tests/tools/test_stress_short.py::test_engine_wedged_short (the stress tool's case on the
same wedge: /health engine_stalled, the open stream's shutting_down error and [DONE], the
wedging request's 503, a non-zero exit within the drain and its slack).
"""
from __future__ import annotations

import signal
import threading
import time

import httpx

from server_harness import (MODEL_NAME, ServerThread, spawn, start_stream, tiny_args,
                            tiny_parts)

WEDGE = 42                      # a prompt that starts with this token id wedges the engine
STEP_TIMEOUT = 2.0
LONG = {"model": MODEL_NAME, "prompt": "w7 w8", "max_tokens": 120, "temperature": 0,
        "ignore_eos": True, "stream": True}
WEDGING = {"model": MODEL_NAME, "prompt": f"w{WEDGE} w5", "max_tokens": 2}
HEALTHY = 'engine_healthy{model_name="tiny"} 1.0'
UNHEALTHY = 'engine_healthy{model_name="tiny"} 0.0'


def _start_stream(url: str, body: dict = LONG) -> tuple[threading.Thread, dict]:
    return start_stream(url, body)


def _post_in_thread(url: str, body: dict, out: dict) -> threading.Thread:
    def post() -> None:
        try:
            out["response"] = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        except httpx.HTTPError as e:
            out["error"] = e
    t = threading.Thread(target=post, daemon=True)
    t.start()
    return t


def _wait_stalled(url: str, since: float, limit: float) -> httpx.Response:
    """Poll /health until 503; fail if that takes longer than `limit` s after `since`."""
    while True:
        h = httpx.get(f"{url}/health", timeout=5)
        if h.status_code == 503:
            return h
        assert time.monotonic() - since < limit, "/health still 200 with a wedged engine"
        time.sleep(0.05)


def test_wedged_add_request_fails_health_metrics_and_admin_in_bounded_time():
    from jaxserve.server.launch import build_engine
    cfg, weights, tok = tiny_parts()
    args = tiny_args(step_timeout=STEP_TIMEOUT)
    engine = build_engine(args, cfg, weights, tok, warmup=False)
    entered, release = threading.Event(), threading.Event()
    add = engine.core.add_request

    def wedged(request):                # a Python computation on the engine thread
        if request.prompt_token_ids[:1] == [WEDGE]:
            entered.set()
            end, x = time.monotonic() + 60, 0
            while not release.is_set() and time.monotonic() < end:
                x = (x * 31 + 7) % 1000003
        add(request)
    engine.core.add_request = wedged
    srv = ServerThread(engine, tok, args)
    try:
        # Idle for longer than the step timeout: waiting for work is not a stall.
        time.sleep(STEP_TIMEOUT + 1.0)
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
        assert HEALTHY in httpx.get(f"{srv.url}/metrics", timeout=5).text

        out: dict = {}
        req = _post_in_thread(srv.url, WEDGING, out)
        assert entered.wait(30)
        wedged_at = time.monotonic()
        # Queued behind the wedge: answered when the loop is seen stalled, not never.
        kv = httpx.get(f"{srv.url}/admin/kv", timeout=30)
        assert kv.status_code == 503, kv.text
        assert time.monotonic() - wedged_at < STEP_TIMEOUT + 2.0
        assert kv.json()["error"]["code"] == "engine_stalled"

        h = _wait_stalled(srv.url, wedged_at, STEP_TIMEOUT + 1.0)
        err = h.json()["error"]
        assert err["code"] == "engine_stalled" and "not turned" in err["message"], err
        assert "add_request" in err["message"], err
        assert UNHEALTHY in httpx.get(f"{srv.url}/metrics", timeout=5).text
        t0 = time.monotonic()
        kv = httpx.get(f"{srv.url}/admin/kv", timeout=30)
        assert kv.status_code == 503 and time.monotonic() - t0 < 1.0

        release.set()                   # the engine recovers and serves the request
        req.join(60)
        assert out["response"].status_code == 200, out
        deadline = time.monotonic() + 30
        while httpx.get(f"{srv.url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "/health did not recover"
            time.sleep(0.1)
        assert httpx.get(f"{srv.url}/admin/kv", timeout=10).status_code == 200
    finally:
        release.set()
        srv.stop()


def _kill(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def test_second_sigterm_ends_the_drain_at_once():
    proc, url = spawn({"shutdown_timeout": 60, "step_delay": 0.05})
    try:
        t, got = _start_stream(url)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None          # draining: the stream may still finish
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        assert code != 0 and time.monotonic() - t0 < 5.0, code
        t.join(10)
        assert "[DONE]" not in got["events"]     # cut off, not finished
    finally:
        _kill(proc)
