"""A short version of every `make stress` case (jaxserve/tools/stress*.py), on the tiny model:
seconds each instead of minutes, same checks. The production server (make_server: header
deadline, drain) runs in a thread with an API key; every attack watches it with a victim
stream and /health probes; the router case puts a router (in a thread) in front of it;
the KV-transfer cases use a prefill and a decode server in threads
(tests/support/pd_harness.py); SIGTERM uses a subprocess server (tests/support/server_harness.py); engine_killed kills the
engine thread of an in-process server.
"""
from __future__ import annotations

import ctypes
import json
import os
import threading
import time
from typing import Any

import pytest

from server_harness import MODEL_NAME, ServerThread, spawn, tiny_args, tiny_parts

from jaxserve.tools.stress_attacks import ATTACKS, STALL_ALLOWANCE_S, run_attack
from jaxserve.tools.stress_cases import (engine_killed, engine_wedged,
                                         router_unroutable, schema_fuzz,
                                         sigterm_mid_load, streams_disconnects)
from jaxserve.tools.stress_kv import kv_forged_params, kv_idle_peers
from jaxserve.tools.stress_lib import Target, check_stream, read_http_response

KEY = "stress-key"
# 8 running + 64 waiting sequences: the 16 streams (n <= 3) fit; the flood (n=16) does not
LIMITS = dict(api_key=KEY, max_waiting_requests=64, request_header_timeout=1.0,
              request_body_timeout=1.0)


# Seconds each engine step of the servers built here sleeps while a case with a watch
# runs (test_attack_short, test_kv_transfer_short). The watch's victim streams without
# pause, so an engine stepping flat out would keep a core busy for the watch's whole
# length; paced, the victim still gets an event about every 0.05 s, far finer than the
# stall bars (2 s and more), and a stall (the event loop or the engine thread held up)
# shows as before: the pause can only lengthen a gap, by at most its own length.
PACE = {"s": 0.0}


def paced(engine: Any) -> None:
    step = engine.core.step

    def paced_step() -> Any:
        if PACE["s"]:
            time.sleep(PACE["s"])
        return step()
    engine.core.step = paced_step


class Production:
    """make_server(build_app(...)) on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self) -> None:
        from jaxserve.server.api import build_app
        from jaxserve.server.launch import bind, build_engine
        from jaxserve.server.uvicorn_server import make_server
        cfg, weights, tok = tiny_parts()
        args = tiny_args(**LIMITS)
        self.engine = build_engine(args, cfg, weights, tok, warmup=True)
        paced(self.engine)
        app = build_app(self.engine, tok, model_name=MODEL_NAME, args=args)
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = make_server(app, self.engine, args, log_level="warning")
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "no server"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def target():
    srv = Production()
    t = Target(url=srv.url, pid=os.getpid(), api_key=KEY, max_num_seqs=8,
               max_waiting_requests=64, header_timeout=1.0, body_timeout=1.0,
               chat_text="w5 w6 w7").discover()
    yield t
    srv.stop()


def _passed(res: Any) -> None:
    assert res.ok, (res.failures, json.dumps(res.figures)[:2000])


# ---- the SSE checker the cases rely on (hand-built streams) -------------------------------
def _chunk(index: int, finish: str | None) -> str:
    return json.dumps({"choices": [{"index": index, "text": "x", "finish_reason": finish}]})


def test_check_stream_flags_lost_and_duplicated_completions():
    good = [_chunk(0, None), _chunk(1, None), _chunk(0, "length"), _chunk(1, "stop"), "[DONE]"]
    assert check_stream(good, 2) == ("completed", "")
    assert check_stream(good[:-1], 2)[0] == "broken"                  # no [DONE]
    assert check_stream(good + ["[DONE]"], 2)[0] == "broken"          # two
    assert check_stream([_chunk(0, "length"), _chunk(0, "stop"), "[DONE]"], 1)[0] == "broken"
    assert check_stream([_chunk(0, "length"), "[DONE]"], 2)[0] == "broken"   # choice 1 lost
    err = json.dumps({"error": {"code": "shutting_down", "message": "m"}})
    assert check_stream([_chunk(0, None), err, "[DONE]"], 1) == ("failed", "shutting_down")
    assert check_stream([err, _chunk(0, "stop"), "[DONE]"], 1)[0] == "broken"


# ---- the cases ---------------------------------------------------------------------------
def test_schema_fuzz_short(target):
    pytest.importorskip("schemathesis")
    res = schema_fuzz(target, max_examples=5, seconds=15, call_timeout=10)
    _passed(res)
    assert res.figures["sent"] > 20 and "POST /v1/completions" in res.figures["operations"]


def test_streams_disconnects_short(target):
    # two seconds send about a hundred streams: completions and each kind of abort
    # (before the headers, at them, after chunks) come tens of times each
    res = streams_disconnects(target, duration=2, concurrency=16, seed=1)
    _passed(res)
    f = res.figures
    assert f["completed"] > 0 and f["aborted"] > 0 and f["lost_or_duplicated"] == 0
    assert f["sent"] == f["completed"] + f["aborted"] + sum(f["failed"].values())


@pytest.fixture(scope="module")
def smol():
    """SmolLM2-135M-Instruct (the default model) in a thread: the tiny model's word-level
    tokenizer has no byte decoder, so constraints cannot compile against it. Steps of at
    most 32 tokens (chunked prefill): the victim's gap is then one small step even on a
    slow, shared CPU, and a gap over the bar means the attack held the engine up."""
    from jaxserve.config import EngineArgs
    from jaxserve.model.loader.load import load_model
    from jaxserve.server.launch import build_engine
    m = load_model(None, progress=False)
    args = EngineArgs(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
                      token_buckets=[8, 32], block_size=16, num_kv_blocks=128,
                      served_model_name="smol", port=0)
    engine = build_engine(args, m.config, m.weights, m.tokenizer, warmup=True)
    paced(engine)
    # A hostile constraint's device compile goes on in its child process until the
    # compiler's deadline (20 s a phase by default), long after its request was answered
    # on the host path: a core busy through the attacks that follow. Each attack waits
    # for its answer at most the admission wait (5 s), so a 3 s deadline ends every such
    # compile, with the child's kill and restart, inside the attack that started it.
    compiler = engine.core.device_structured.compiler
    compiler.deadline_s = 3.0
    srv = ServerThread(engine, m.tokenizer, args)
    yield Target(url=srv.url, pid=os.getpid()).discover()
    srv.stop()
    compiler.shutdown()             # the engine leaves its compile child running


def _on(request: Any, name: str) -> Target:
    return request.getfixturevalue("smol" if name.startswith("structured_") else "target")


@pytest.mark.stall
@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_short(request, name):
    target = _on(request, name)
    PACE["s"] = 0.05
    try:
        res = run_attack(name, ATTACKS[name], target, storm=60)
    finally:
        PACE["s"] = 0.0
    _passed(res)
    f = res.figures
    assert f["health_after"] == 200
    assert f["health_probes"] > 0 and f["health_probes_failed"] == 0
    limit = STALL_ALLOWANCE_S.get(name, 2.0)        # each allowance says why it exists
    assert f["victim_max_stall_s"] is not None and f["victim_max_stall_s"] <= limit


def test_read_http_response_reads_the_whole_body():
    """Headers and body in separate writes (a 408 may arrive so): the body is read to
    its Content-Length; without one, to the connection's close; never past the deadline."""
    import socket
    for head, parts, want in (
            (b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 12\r\n\r\n",
             [b"request_", b"timeout"], b"request_time"),
            (b"HTTP/1.1 400 Bad\r\nconnection: close\r\n\r\n", [b"abc", b"def"], b"abcdef")):
        a, b = socket.socketpair()

        def write(a: socket.socket = a, head: bytes = head, parts: list = parts) -> None:
            a.sendall(head)
            for part in parts:
                time.sleep(0.1)
                a.sendall(part)
            time.sleep(0.1)
            a.close()
        th = threading.Thread(target=write)
        th.start()
        status, _, body = read_http_response(b, time.monotonic() + 5)
        th.join()
        b.close()
        assert (status, body) == (int(head.split()[1]), want)
    a, b = socket.socketpair()                           # silent peer: the deadline ends it
    t0 = time.monotonic()
    assert read_http_response(b, t0 + 0.3) == (0, b"", b"")
    assert time.monotonic() - t0 < 1.0
    a.close()
    b.close()


def test_router_unroutable_short(target):
    from jaxserve.router import RouterConfig, build_app
    from router_harness import Uvicorn
    router = Uvicorn(build_app(RouterConfig(backends=[target.url], api_key=KEY,
                                            backend_api_key=KEY, poll_interval=0.2)),
                     lifespan="on")
    try:
        rt = Target(url=router.url, pid=os.getpid(), api_key=KEY, model=target.model,
                    vocab_size=target.vocab_size, max_model_len=target.max_model_len)
        res = router_unroutable(rt, target)
        _passed(res)
        assert res.figures["backend_finished_during"] >= 1         # only the plain one(s)
    finally:
        router.stop()


def test_kv_transfer_short():
    import pd_harness  # noqa: F401  (sets the transfer secret for both servers)
    from server_harness import ServerThread as ST
    from jaxserve.server.launch import build_engine
    cfg, weights, tok = tiny_parts()
    made = []
    try:
        for kv in ('{"kv_role": "kv_producer", "chunk_blocks": 2, "handshake_timeout": 1}',
                   '{"kv_role": "kv_consumer", "chunk_blocks": 2, "timeout": 10}'):
            args = tiny_args(kv_transfer_config=kv)
            engine = build_engine(args, cfg, weights, tok, warmup=True)
            paced(engine)
            made.append(ST(engine, tok, args))
        pre, dec = made
        PACE["s"] = 0.05
        tp = Target(url=pre.url, pid=os.getpid()).discover()
        td = Target(url=dec.url, pid=os.getpid()).discover()
        stats = dec.engine.core.kv_connector.stats
        res = kv_forged_params(td, prompt="w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17")
        _passed(res)
        assert res.figures["impostor_connections"] == 0 and stats.loads == 0
        res = kv_idle_peers(tp, td, pull_failures=lambda: stats.load_failures,
                            prompt=" ".join(f"w{3 + 7 * i % 120}" for i in range(40)))
        _passed(res)
        assert stats.loads >= 1 and stats.blocks_loaded > 0 and stats.load_failures == 0
    finally:
        PACE["s"] = 0.0
        for s in made:
            s.stop()
            conn = getattr(s.engine.core, "kv_connector", None)
            if conn is not None:
                conn.close()


def test_sigterm_mid_load_short():
    proc, url = spawn({"shutdown_timeout": 0.5, "step_delay": 0.05})
    try:
        t = Target(url=url, pid=proc.pid).discover()
        res = sigterm_mid_load(t, proc, streams=4, shutdown_timeout=0.5)
        _passed(res)
        assert res.figures["failed"]["shutting_down"] >= 1      # the long ones were cut
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_engine_killed_short():
    from jaxserve.server.launch import build_engine
    cfg, weights, tok = tiny_parts()
    args = tiny_args()
    engine = build_engine(args, cfg, weights, tok, warmup=False)
    step = engine.core.step

    def slow() -> Any:                   # streams stay open while the kill lands
        time.sleep(0.03)
        return step()
    engine.core.step = slow
    srv = ServerThread(engine, tok, args)
    try:
        def kill() -> None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(engine._thread.ident),
                                                       ctypes.py_object(SystemExit))
        res = engine_killed(Target(url=srv.url, pid=os.getpid()).discover(), kill, streams=2)
        _passed(res)
        assert res.figures["health_status"] == 503 and res.figures["request_status"] == 503
    finally:
        srv.stop()


def test_engine_wedged_short():
    """The harness's wedge (tests/support/server_harness.py --wedge_token) in a serve
    subprocess; SIGTERM with the engine thread wedged (the suite's one check of that case;
    tests/server/test_engine_watchdog.py checks the watchdog's other cases)."""
    proc, url = spawn({"shutdown_timeout": 1.0, "step_timeout": 1.0, "step_delay": 0.05,
                       "wedge_token": 42})
    try:
        t = Target(url=url, pid=proc.pid).discover()
        res = engine_wedged(t, proc, wedge_token=42, step_timeout=1.0, shutdown_timeout=1.0)
        _passed(res)
        f = res.figures
        assert f["health_code"] == "engine_stalled" and f["exit_code"] not in (None, 0)
        assert f["stream_outcome"] == "failed:shutting_down"
        # the request wedged in admission is answered (503), not left hanging
        assert f["wedging_request"]["status"] == 503, f["wedging_request"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
