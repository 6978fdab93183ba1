"""Hardening at the process and engine level: SIGTERM mid-stream, engine death
(exit status, 503s), a killed engine thread, the step watchdog, control calls after
stop, and the one-slot output mailbox under a reader that does not read."""
from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import signal
import threading
import time

import httpx
import pytest

from server_harness import (MODEL_NAME, ServerThread, spawn, start_stream, tiny_args,
                            tiny_parts)

LONG = {"model": MODEL_NAME, "prompt": "w7 w8", "max_tokens": 120, "temperature": 0,
        "ignore_eos": True, "stream": True}


def _start_stream(url: str, body: dict = LONG) -> tuple[threading.Thread, dict]:
    return start_stream(url, body)


def _kill(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


# ---- 4. SIGTERM: streams open at the drain deadline end with an error event + [DONE] ----
def test_sigterm_mid_stream_error_event_then_done():
    proc, url = spawn({"shutdown_timeout": 0.5, "step_delay": 0.05})   # 120 tokens: ~6 s
    try:
        t, got = _start_stream(url)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        events = got["events"]
        assert events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])["error"]
        assert err["code"] == "shutting_down" and "drain" in err["message"]
        assert time.monotonic() - t0 < 10
        assert proc.wait(timeout=30) == 0
    finally:
        _kill(proc)


# ---- 2. engine-level failure: in-band error / 503, then exit status 1 ---------------------
def test_engine_failure_exits_nonzero():
    proc, url = spawn({"fail_after_steps": 6, "step_delay": 0.02})
    try:
        t, got = _start_stream(url)
        t.join(30)
        events = got["events"]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_dead"
        assert proc.wait(timeout=30) == 1       # a supervisor restarts it
    finally:
        _kill(proc)


# ---- 2./4. engine thread killed -> /health 503 within a second, requests 503 --------------
@pytest.fixture
def slow_server():
    from jaxserve.server.launch import build_engine
    cfg, weights, tok = tiny_parts()
    args = tiny_args(step_timeout=1.0)
    engine = build_engine(args, cfg, weights, tok, warmup=False)
    srv = ServerThread(engine, tok, args)
    yield srv
    srv.stop()


def _slow_steps(engine, delay: float) -> None:
    step = engine.core.step

    def slow():
        time.sleep(delay)
        return step()
    engine.core.step = slow


def test_killed_engine_thread_gives_503(slow_server):
    engine = slow_server.engine
    _slow_steps(engine, 0.03)
    t, got = _start_stream(slow_server.url)
    killed = time.monotonic()
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(engine._thread.ident),
                                                   ctypes.py_object(SystemExit))
    assert n == 1
    while httpx.get(f"{slow_server.url}/health", timeout=5).status_code != 503:
        assert time.monotonic() - killed < 1.0, "/health still 200 a second after the kill"
        time.sleep(0.02)
    t.join(30)
    assert got["events"][-1] == "[DONE]"
    assert json.loads(got["events"][-2])["error"]["code"] == "engine_dead"
    r = httpx.post(f"{slow_server.url}/v1/completions", timeout=10,
                   json={**LONG, "stream": False, "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    s = httpx.post(f"{slow_server.url}/v1/completions", timeout=10, json=LONG)
    assert s.status_code == 503


# ---- 2. step watchdog ---------------------------------------------------------------------
def test_step_watchdog_marks_unhealthy_then_recovers(slow_server):
    engine = slow_server.engine
    step, calls = engine.core.step, [0]

    def wedged():
        calls[0] += 1
        if calls[0] == 3:
            time.sleep(2.5)                # one step far over --step-timeout 1
        return step()
    engine.core.step = wedged
    t, got = _start_stream(slow_server.url, {**LONG, "max_tokens": 10})
    deadline = time.monotonic() + 10
    while True:
        h = httpx.get(f"{slow_server.url}/health", timeout=5)
        if h.status_code == 503:
            break
        assert time.monotonic() < deadline, "the wedged step never showed on /health"
        time.sleep(0.05)
    assert h.json()["error"]["code"] == "engine_stalled"
    assert "engine_healthy{model_name=\"tiny\"} 0.0" in \
        httpx.get(f"{slow_server.url}/metrics", timeout=5).text
    t.join(30)
    assert got["events"][-1] == "[DONE]" and '"error"' not in "".join(got["events"])
    assert httpx.get(f"{slow_server.url}/health", timeout=5).status_code == 200


# ---- 4. control calls after stop fail fast -----------------------------------------------
def test_calls_after_stop_fail_fast():
    from jaxserve.frontend.async_engine import EngineStoppedError
    from jaxserve.sampling.params import SamplingParams
    from jaxserve.server.launch import build_engine
    cfg, weights, tok = tiny_parts()
    engine = build_engine(tiny_args(), cfg, weights, tok, warmup=False)

    async def go():
        await engine.shutdown(timeout=1.0)
        t0 = time.monotonic()
        with pytest.raises(EngineStoppedError):
            await asyncio.wait_for(engine.call(lambda core: core.reset_prefix_cache()), 5)
        engine.abort("nobody")                         # a no-op, not a hang
        with pytest.raises(EngineStoppedError):
            engine.add_request([5, 6], SamplingParams(max_tokens=2), "late")
        return time.monotonic() - t0
    assert asyncio.run(go()) < 0.5


# ---- 3. a reader that does not read holds one output, not one per step -------------------
class _Finished:
    """A metrics sink that only notes that a request finished (engine thread)."""
    done = False

    def observe_request(self, **_: object) -> None:
        self.done = True


def test_unread_stream_holds_one_output():
    from jaxserve.request import RequestOutput
    from jaxserve.sampling.params import SamplingParams
    from jaxserve.server.launch import build_engine
    cfg, weights, tok = tiny_parts()
    engine = build_engine(tiny_args(), cfg, weights, tok, warmup=False)
    engine.metrics = _Finished()

    async def go():
        params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, n=2)
        stream = engine.add_request([5, 6, 7], params, "unread")
        deadline = time.monotonic() + 60
        while engine.metrics is None or not engine.metrics.done:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)          # 60 steps run; nobody reads
        gc.collect()
        held = [o for o in gc.get_objects()
                if type(o) is RequestOutput and o.request_id == "unread"]
        final = await stream.next()
        return len(held), final
    held, final = asyncio.run(go())
    assert final.finished and [len(c.token_ids) for c in final.outputs] == [60, 60]
    assert held == 1, f"{held} outputs retained for one unread request"
    asyncio.run(engine.shutdown(timeout=1.0))
