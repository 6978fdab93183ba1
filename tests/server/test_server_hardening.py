"""Server-side hardening: one request cannot take the server down, memory and
time are bounded, nothing is lost or stuck, access is gated. Real HTTP on 127.0.0.1
against the tiny model. Process-level cases (SIGTERM, engine death -> exit status,
engine-level API) are in test_server_hardening_process.py."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from server_harness import MODEL_NAME, tiny_args, tiny_parts

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"model": MODEL_NAME, "prompt": "w5 w6", "max_tokens": 120, "temperature": 0,
        "ignore_eos": True}


class Served:
    """An app on 127.0.0.1:<free port> in a daemon thread (server: a uvicorn.Server)."""

    def __init__(self, app: Any, server_factory: Any) -> None:
        from jaxserve.server.launch import bind
        self.app, self.sock = app, bind("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = server_factory(app)
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "no server"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


@pytest.fixture(scope="module")
def hard():
    """The production server (make_server: header deadline, concurrency limit, drain)
    with an API key and no waiting room beyond max_num_seqs=8."""
    from jaxserve.server.api import build_app
    from jaxserve.server.launch import build_engine
    from jaxserve.server.uvicorn_server import make_server
    cfg, weights, tok = tiny_parts()
    args = tiny_args(api_key=KEY, max_waiting_requests=0, limit_concurrency=8,
                     request_header_timeout=1.0, request_body_timeout=1.0)
    engine = build_engine(args, cfg, weights, tok, warmup=True)
    app = build_app(engine, tok, model_name=MODEL_NAME, args=args)
    srv = Served(app, lambda a: make_server(a, engine, args, log_level="warning"))
    srv.engine, srv.tok = engine, tok
    yield srv
    srv.stop()


def side_app(hard: Served, **kw: Any) -> Served:
    """Another app on the same engine (other flags); lifespan off so that stopping it
    leaves the engine running; the engine's metrics sink stays the main app's."""
    import uvicorn

    from jaxserve.server.api import build_app
    sink = hard.engine.metrics
    app = build_app(hard.engine, hard.tok, model_name=MODEL_NAME, args=tiny_args(**kw))
    hard.engine.metrics = sink
    return Served(app, lambda a: uvicorn.Server(uvicorn.Config(a, lifespan="off",
                                                               log_level="warning")))


def get(srv: Served, path: str, **kw: Any) -> httpx.Response:
    return httpx.get(f"{srv.url}{path}", headers=AUTH, timeout=30, **kw)


def post(srv: Served, path: str, body: dict, **kw: Any) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, headers=kw.pop("headers", AUTH),
                      timeout=60, **kw)


def counter(srv: Served, reason: str) -> float:
    for line in get(srv, "/metrics").text.splitlines():
        if line.startswith("jaxserve:request_success_total") and f'"{reason}"' in line:
            return float(line.split()[-1])
    return 0.0


def wait_idle(srv: Served, timeout: float = 15.0) -> dict:
    """Poll /admin/kv until nothing runs or waits and every block is free."""
    deadline = time.monotonic() + timeout
    while True:
        kv = get(srv, "/admin/kv").json()
        idle = kv["num_running"] == 0 and kv["num_waiting"] == 0 and \
            kv["num_free_blocks"] == kv["num_blocks"]
        if idle or time.monotonic() > deadline:
            return kv
        time.sleep(0.05)


def raw_request(srv: Served, body: dict, path: str = "/v1/completions") -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
              .encode() + data)
    return s


def sse_events(text: str) -> list[str]:
    return [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]


# ---- 4. disconnects at any moment abort the request -----------------------------------
def _assert_aborted_not_finished(hard: Served, abort0: float, length0: float) -> None:
    deadline = time.monotonic() + 15
    while counter(hard, "abort") < abort0 + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    kv = wait_idle(hard)
    assert kv["num_running"] == 0 and kv["num_free_blocks"] == kv["num_blocks"], kv
    assert counter(hard, "abort") == abort0 + 1
    assert counter(hard, "length") == length0      # it did not run to max_tokens


def test_disconnect_before_stream_body_starts(hard, monkeypatch):
    """The client leaves once the StreamingResponse is being sent but before its body
    generator ran once (the window is widened by a sleep in stream_response)."""
    from starlette.responses import StreamingResponse
    entered = threading.Event()
    orig = StreamingResponse.stream_response

    async def late_start(self, send):
        entered.set()
        await asyncio.sleep(1.0)
        await orig(self, send)
    monkeypatch.setattr(StreamingResponse, "stream_response", late_start)
    abort0, length0 = counter(hard, "abort"), counter(hard, "length")
    s = raw_request(hard, {**LONG, "stream": True})
    assert entered.wait(20)
    s.close()
    _assert_aborted_not_finished(hard, abort0, length0)


def test_disconnect_after_response_built_before_sent(hard, monkeypatch):
    """The client leaves after the handler built the streamed response (requests
    submitted) but before it was returned: the response is dropped unsent."""
    import gc

    from jaxserve.server.serving import OpenAIServing
    built = threading.Event()
    orig = OpenAIServing.completions

    async def slow_return(self, req):
        resp = await orig(self, req)
        built.set()
        await asyncio.sleep(2.0)               # cancelled here by the disconnect
        return resp
    monkeypatch.setattr(OpenAIServing, "completions", slow_return)
    abort0, length0 = counter(hard, "abort"), counter(hard, "length")
    s = raw_request(hard, {**LONG, "stream": True})
    assert built.wait(20)
    s.close()
    time.sleep(0.3)
    gc.collect()                              # frames kept alive by a traceback cycle
    _assert_aborted_not_finished(hard, abort0, length0)


# ---- 2. one request's failure fails that request only ----------------------------------
def test_request_failure_is_isolated(hard, monkeypatch):
    from jaxserve.frontend.output_processor import OutputProcessor
    orig = OutputProcessor.process
    poison = [97, 98, 99]

    def process(self, outputs):
        for o in outputs:
            parent = self.parents.get(self.child_to_parent.get(o.req_id, ""))
            if parent and parent.prompt_token_ids == poison and \
                    len(parent.seqs[o.req_id].token_ids) >= 2:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return orig(self, outputs)
    monkeypatch.setattr(OutputProcessor, "process", process)
    good = {**LONG, "max_tokens": 30}
    with httpx.Client(timeout=60, headers=AUTH) as c:
        with c.stream("POST", f"{hard.url}/v1/completions",
                      json={**good, "prompt": poison, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events(r.read().decode())
        plain = c.post(f"{hard.url}/v1/completions", json={**good, "prompt": poison})
        ok = c.post(f"{hard.url}/v1/completions", json=good)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "request_failed" and "injected" in err["message"]
    assert json.loads(events[0])["choices"][0]["text"]   # it failed mid-stream
    assert plain.status_code == 422 and plain.json()["error"]["code"] == "request_failed"
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 30
    assert get(hard, "/health").status_code == 200
    kv = wait_idle(hard)
    assert kv["num_free_blocks"] == kv["num_blocks"]
    assert counter(hard, "error") >= 2


# ---- 3. admission control, timeouts, connection limit, tokenization off the loop -------
@pytest.fixture
def slow_steps(hard, monkeypatch):
    """Each engine step takes >= 30 ms, so a long request stays open for seconds."""
    core = hard.engine.core
    step = core.step

    def slow():
        time.sleep(0.03)
        return step()
    monkeypatch.setattr(core, "step", slow)


def test_admission_503_with_retry_after(hard, slow_steps):
    with httpx.Client(timeout=60, headers=AUTH) as c:
        with c.stream("POST", f"{hard.url}/v1/completions",
                      json={**LONG, "n": 8, "max_tokens": 60, "stream": True}) as first:
            lines = first.iter_lines()      # (a dropped iterator closes the connection)
            assert next(lines).startswith("data: {")    # 8 sequences = max_num_seqs open
            late = c.post(f"{hard.url}/v1/completions", json={**LONG, "max_tokens": 2})
        assert late.status_code == 503, late.text
        assert late.headers["retry-after"] == "1"
        assert late.json()["error"]["code"] == "overloaded"
        wait_idle(hard)
        assert c.post(f"{hard.url}/v1/completions",
                      json={**LONG, "max_tokens": 2}).status_code == 200


def test_header_timeout_closes_slow_connection(hard):
    s = socket.create_connection(("127.0.0.1", hard.port), timeout=5)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n")     # headers never end
    t0 = time.monotonic()
    assert s.recv(100) == b""                 # closed by the server (not a timeout)
    assert 0.8 < time.monotonic() - t0 < 4
    s.close()


def test_body_timeout_408(hard):
    s = socket.create_connection(("127.0.0.1", hard.port), timeout=5)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " +
              KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    t0 = time.monotonic()
    reply = s.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 408"), reply
    assert "request_timeout" in reply and time.monotonic() - t0 < 4
    s.close()


def test_limit_concurrency(hard):
    idle = [socket.create_connection(("127.0.0.1", hard.port)) for _ in range(8)]
    try:
        r = httpx.get(f"{hard.url}/health", timeout=5)
        assert r.status_code == 503
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 5
    while httpx.get(f"{hard.url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("what", ["prompt", "chat"])
def test_tokenization_off_the_event_loop(hard, monkeypatch, what):
    tok = hard.tok
    name = "encode" if what == "prompt" else "apply_chat_template"
    orig = getattr(tok, name)
    slow = threading.Event()

    def blocking(*a, **kw):
        slow.set()
        time.sleep(1.5)                       # a huge input, tokenized synchronously
        return orig(*a, **kw)
    monkeypatch.setattr(tok, name, blocking)
    body = {**LONG, "max_tokens": 2} if what == "prompt" else \
        {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "w5"}]}
    path = "/v1/completions" if what == "prompt" else "/v1/chat/completions"
    t = threading.Thread(target=post, args=(hard, path, body))
    t.start()
    assert slow.wait(10)
    t0 = time.monotonic()
    assert httpx.get(f"{hard.url}/health", timeout=10).status_code == 200
    took = time.monotonic() - t0
    t.join(30)
    assert took < 0.7, f"/health took {took:.2f} s while a prompt was tokenized"


# ---- 5. access -----------------------------------------------------------------------
PROTECTED = [("GET", "/metrics"), ("POST", "/tokenize"), ("POST", "/detokenize"),
             ("GET", "/admin/kv"), ("POST", "/reset_prefix_cache"), ("GET", "/v1/models"),
             ("GET", "/openapi.json"), ("POST", "/v1/completions")]


@pytest.mark.parametrize("method,path", PROTECTED)
def test_api_key_on_every_route_but_health(hard, method, path):
    body = {"tokens": [5]} if path == "/detokenize" else {"prompt": "w5", "max_tokens": 1}
    kw = {"json": body} if method == "POST" else {}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, f"{hard.url}{path}", headers=headers, timeout=30, **kw)
        assert r.status_code == 401, (path, headers, r.status_code)
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.request(method, f"{hard.url}{path}", headers=AUTH, timeout=30, **kw)
    assert r.status_code == 200, (path, r.text)
    assert httpx.get(f"{hard.url}/health", timeout=10).status_code == 200


def test_public_metrics_and_admin_routes_need_flags(hard):
    default = side_app(hard, api_key=KEY, enable_admin_routes=False)
    public = side_app(hard, api_key=KEY, public_metrics=True, enable_admin_routes=False)
    try:
        for path, method in (("/admin/kv", "GET"), ("/reset_prefix_cache", "POST")):
            r = httpx.request(method, f"{default.url}{path}", headers=AUTH, timeout=10)
            assert r.status_code == 404, (path, r.status_code)
        assert "/admin/kv" not in get(default, "/openapi.json").text
        assert httpx.get(f"{default.url}/metrics", timeout=10).status_code == 401
        r = httpx.get(f"{public.url}/metrics", timeout=10)
        assert r.status_code == 200 and "jaxserve:engine_healthy" in r.text
        assert httpx.post(f"{public.url}/tokenize", json={"prompt": "w5"},
                          timeout=10).status_code == 401
    finally:
        default.stop()
        public.stop()


def test_cached_tokens_only_with_flag(hard):
    detailed = side_app(hard, enable_prompt_tokens_details=True)
    try:
        prefix = " ".join(f"w{10 + i}" for i in range(32))
        body = {"model": MODEL_NAME, "max_tokens": 1, "temperature": 0}
        assert post(hard, "/v1/completions", {**body, "prompt": prefix + " w60"}
                    ).status_code == 200
        r = post(hard, "/v1/completions", {**body, "prompt": prefix + " w61 w62 w63"})
        assert r.status_code == 200 and "prompt_tokens_details" not in r.json()["usage"]
        client = openai.OpenAI(base_url=f"{hard.url}/v1", api_key=KEY, max_retries=0)
        chunks = list(client.completions.create(
            model=MODEL_NAME, prompt=prefix + " w64", max_tokens=1, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details is None
        r = post(detailed, "/v1/completions", {**body, "prompt": prefix + " w65 w66 w67"})
        assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    finally:
        detailed.stop()
