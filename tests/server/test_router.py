"""`jaxserve router` over real HTTP on 127.0.0.1.

Two kinds of backends:
* scripted fake servers (a raw ASGI app in a uvicorn thread) for the failure modes that
  a real server cannot be made to show on cue: dropping the connection before the first
  event or after two events, answering 503, reporting a given load on /metrics;
* real tiny-model `jaxserve serve` subprocesses (tests/support/server_harness.py), for greedy
  parity through the router and for 64 concurrent streams with one backend killed.
"""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest


from jaxserve.router.backends import parse_load  # noqa: E402
from router_harness import metric, wait  # noqa: E402
from router_harness import fakes, router  # noqa: E402,F401 - fixtures


def _complete(url: str, prompt: str = "hi", **kw: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": prompt, **kw},
                      timeout=30)


def _stream(url: str, prompt: str = "hi") -> tuple[int, list[str]]:
    """-> status, the data lines of the stream (without 'data: ')."""
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                      json={"model": "m", "prompt": prompt, "stream": True}) as r:
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        return r.status_code, lines


# ---- policies -------------------------------------------------------------------------

def test_round_robin_spreads_evenly(fakes, router):
    backends = fakes(3)
    r = router([s.url for _, s in backends], policy="round_robin")
    for _ in range(9):
        assert _complete(r.url).status_code == 200
    assert [len(f.requests) for f, _ in backends] == [3, 3, 3]
    assert metric(r.url, "jaxserve_router:backend_requests_total",
                   backend=backends[0][1].url) == 3


def test_prefix_policy_keeps_a_prefix_on_one_backend(fakes, router):
    backends = fakes(3)
    r = router([s.url for _, s in backends], policy="prefix", prefix_chars=64)
    shared = "system prompt: " + "w7 " * 30
    homes = {_complete(r.url, shared + f"question {i}").headers["x-jaxserve-backend"]
             for i in range(12)}
    assert len(homes) == 1                      # one backend saw every one of them
    home = int(homes.pop())
    assert len(backends[home][0].requests) == 12
    # different leading text spreads over the backends
    spread = {_complete(r.url, f"user {i}: " + "w1 " * 30).headers["x-jaxserve-backend"]
              for i in range(24)}
    assert len(spread) == 3
    # chat: the messages lead the key the same way
    chat = {httpx.post(f"{r.url}/v1/chat/completions", timeout=30, json={
        "model": "m", "messages": [{"role": "system", "content": shared},
                                   {"role": "user", "content": f"q{i}"}]}
    ).headers["x-jaxserve-backend"] for i in range(6)}
    assert len(chat) == 1
    # its backend down: the prefix moves (to one other backend), and comes back after
    backends[home][0].health = 503
    wait(lambda: not r.app.pool.backends[home].healthy, 10, "not marked down")
    moved = {_complete(r.url, shared + f"again {i}").headers["x-jaxserve-backend"]
             for i in range(4)}
    assert len(moved) == 1 and moved != {str(home)}
    backends[home][0].health = 200
    wait(lambda: r.app.pool.backends[home].healthy, 10, "not marked up")
    assert _complete(r.url, shared + "back").headers["x-jaxserve-backend"] == str(home)


def test_least_load_follows_reported_load(fakes, router):
    (a, sa), (b, sb) = fakes(2)
    a.metrics = 'vllm:num_requests_running{model_name="m",engine="0"} 3.0\n' \
                'vllm:num_requests_waiting{model_name="m",engine="0"} 40.0\n'
    b.metrics = "jaxserve:num_requests_running{model_name=\"m\"} 1.0\n"
    r = router([sa.url, sb.url], policy="least_load")
    wait(lambda: r.app.pool.backends[0].reported == 43.0, 10, "load not polled")
    for _ in range(6):
        assert _complete(r.url).status_code == 200
    assert (len(a.requests), len(b.requests)) == (0, 6)
    a.metrics, b.metrics = "", "jaxserve:num_requests_waiting{model_name=\"m\"} 9.0\n"
    wait(lambda: r.app.pool.backends[1].reported == 9.0, 10, "load not polled")
    for _ in range(4):
        _complete(r.url)
    assert (len(a.requests), len(b.requests)) == (4, 6)
    assert metric(r.url, "jaxserve_router:backend_reported_load", backend=sb.url) == 9.0


def test_a_connection_closed_while_set_up_is_a_connect_error(monkeypatch):
    """anyio can raise AttributeError when the backend closes a connection while it is
    set up (seen when a backend is killed under load); the router's transport turns it
    into httpx.ConnectError, which the proxy retries elsewhere instead of answering 500."""
    from jaxserve.router.backends import transport

    async def vanished(self, request):
        raise AttributeError("'NoneType' object has no attribute 'getpeername'")
    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", vanished)

    async def go():
        async with httpx.AsyncClient(transport=transport(httpx, httpx.Limits())) as c:
            with pytest.raises(httpx.ConnectError, match="closed while it was set up"):
                await c.get("http://127.0.0.1:9/health")
    asyncio.run(go())


def test_parse_load_reads_both_metric_names():
    text = ('# HELP vllm:num_requests_running x\n'
            'vllm:num_requests_running{model_name="m",engine="0"} 2.0\n'
            'vllm:num_requests_running{model_name="m",engine="1"} 3.0\n'
            'jaxserve:num_requests_waiting{model_name="m"} 4.0\n'
            'jaxserve:num_requests_waiting_time 100.0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n')
    assert parse_load(text) == 9.0


# ---- failures -------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_failure_before_first_token_is_retried_elsewhere(fakes, router, stream):
    (a, sa), (b, sb) = fakes(2)
    a.mode = "drop_before"
    r = router([sa.url, sb.url], policy="round_robin", poll_interval=30)
    for _ in range(4):
        if stream:
            status, lines = _stream(r.url)
            assert status == 200 and lines[-1] == "[DONE]"
            assert [json.loads(x)["backend"] for x in lines[:-1]] == ["b1"] * 3
        else:
            resp = _complete(r.url)
            assert resp.status_code == 200 and resp.json() == {"backend": "b1"}
            assert resp.headers["x-jaxserve-backend"] == "1"
    # the drop marked `a` down: it saw the first request only (health checks are slow here)
    assert len(a.requests) == 1 and len(b.requests) == 4
    assert not r.app.pool.backends[0].healthy
    assert metric(r.url, "jaxserve_router:backend_retries_total", backend=sb.url) == 1
    assert metric(r.url, "jaxserve_router:backend_failures_total", backend=sa.url,
                   kind="disconnect") == 1


def test_error_event_before_first_token_is_retried(fakes, router):
    (a, sa), (b, sb) = fakes(2)
    a.mode = "error_first"
    r = router([sa.url, sb.url], policy="round_robin")
    status, lines = _stream(r.url)
    assert status == 200 and lines[-1] == "[DONE]"
    assert [json.loads(x)["backend"] for x in lines[:-1]] == ["b1"] * 3
    b.mode = "error_first"                      # nobody can: a 502 naming the reason
    resp = httpx.post(f"{r.url}/v1/completions", timeout=30,
                      json={"prompt": "x", "stream": True})
    assert resp.status_code == 502
    assert "shutting down" in resp.json()["error"]["message"]


def test_failure_after_tokens_ends_the_stream_with_an_error_event(fakes, router):
    ((a, sa),) = fakes(1)
    a.mode = "drop_after"
    r = router([sa.url])
    status, lines = _stream(r.url)
    assert status == 200
    # two whole events relayed, the half event dropped, then the error and [DONE]
    assert [json.loads(x)["choices"][0]["text"] for x in lines[:2]] == ["t0", "t1"]
    err = json.loads(lines[2])["error"]
    assert err["code"] == "backend_failed" and "after the stream started" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    assert lines[3:] == ["[DONE]"]
    assert len(a.requests) == 1                 # not re-run: the client had tokens
    assert metric(r.url, "jaxserve_router:requests_failed_total", reason="stream_cut") == 1


def test_no_backend_left_is_a_clean_openai_error(fakes, router):
    closed = []
    for _ in range(2):                  # ports nobody listens on
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        closed.append(f"http://127.0.0.1:{s.getsockname()[1]}")
        s.close()
    r = router(closed)
    h = httpx.get(f"{r.url}/health", timeout=10)
    assert h.status_code == 503 and h.json()["error"]["code"] == "no_healthy_backend"
    for resp in (_complete(r.url), httpx.get(f"{r.url}/v1/models", timeout=10)):
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "no_healthy_backend"
        assert "ConnectError" in resp.json()["error"]["message"]
    status, _ = _stream(r.url)
    assert status == 503


def test_every_backend_failing_is_502_or_their_503(fakes, router):
    (a, sa), (b, sb) = fakes(2)
    a.mode = b.mode = "drop_before"
    r = router([sa.url, sb.url], poll_interval=30)
    resp = _complete(r.url)
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "backend_failed"
    assert len(a.requests) == len(b.requests) == 1
    assert not any(b.healthy for b in r.app.pool.backends)
    # healthy but overloaded everywhere: the last backend's own 503 passes through
    a.mode = b.mode = "status503"
    r2 = router([sa.url, sb.url], poll_interval=30)
    resp = _complete(r2.url)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "overloaded"
    assert len(a.requests) == len(b.requests) == 2
    assert all(b.healthy for b in r2.app.pool.backends)     # overloaded is not down


def test_health_checks_mark_down_and_up(fakes, router):
    ((a, sa),) = fakes(1)
    r = router([sa.url])
    assert httpx.get(f"{r.url}/health", timeout=10).status_code == 200
    a.health = 503                      # e.g. the server drains at shutdown
    wait(lambda: httpx.get(f"{r.url}/health", timeout=10).status_code == 503, 10,
          "router still healthy")
    assert metric(r.url, "jaxserve_router:backend_healthy", backend=sa.url) == 0
    assert _complete(r.url).status_code == 503 and not a.requests
    a.health = 200
    wait(lambda: httpx.get(f"{r.url}/health", timeout=10).status_code == 200, 10,
          "router not healthy again")
    assert _complete(r.url).json() == {"backend": "b0"}


# ---- gate -----------------------------------------------------------------------------

def test_keys_body_limits_and_bad_json(fakes, router):
    ((a, sa),) = fakes(1)
    r = router([sa.url], api_key="client-key", backend_api_key="backend-key",
               max_request_body_bytes=2048)
    assert _complete(r.url).status_code == 401
    auth = {"Authorization": "Bearer client-key"}
    assert httpx.get(f"{r.url}/metrics", timeout=10).status_code == 401
    assert httpx.get(f"{r.url}/health", timeout=10).status_code == 200     # open
    ok = httpx.post(f"{r.url}/v1/completions", json={"prompt": "x"}, headers=auth, timeout=10)
    assert ok.status_code == 200
    assert a.auth == ["Bearer backend-key"]      # the router's key, not the client's
    big = httpx.post(f"{r.url}/v1/completions", headers=auth, timeout=10,
                     json={"prompt": "x" * 4096})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    bad = httpx.post(f"{r.url}/v1/completions", headers=auth, timeout=10, content=b"{nope")
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
    assert len(a.requests) == 1
    lost = httpx.get(f"{r.url}/v1/nothing", headers=auth, timeout=10)
    assert lost.status_code == 404 and lost.json()["error"]["type"] == "not_found_error"


UNROUTABLE = [     # raw body -> the error's param (None: the body as a whole)
    (b"[" * 100_000, None),
    (b'{"prompt": ' + b"[" * 100_000, None),
    (b'{"prompt": "x", "x": ' + b"[" * 500 + b"]" * 500 + b"}", None),
    (b'{"prompt": "\\ud800"}', "prompt"),
    (b'{"messages": [{"role": "user", "content": "a\\udfff"}]}', "messages"),
    (b'{"messages": 5}', "messages"),
    (b'{"messages": [5]}', "messages"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "messages"),
    (b'{"messages": [{"role": 5, "content": "x"}]}', "messages"),
    (b'{"prompt": {}}', "prompt"),
    (b'{"prompt": 5}', "prompt"),
    (b'{"prompt": [1.0]}', "prompt"),
    (b'{"prompt": [true]}', "prompt"),
    (b'{"prompt": [[5, "x"]]}', "prompt"),
    (b'{"prompt": "x", "stream": "yes"}', "stream"),
    (b'{"prompt": "x", "n": true}', "n"),
    (b'{"prompt": "x", "n": "2"}', "n"),
    (b"[1, 2]", None),
    (b"\xff\xfe\xff", None),
]


@pytest.mark.parametrize("policy", ["prefix", "round_robin"])
def test_unroutable_bodies_are_400_never_500(fakes, router, policy):
    ((a, sa),) = fakes(1)
    r = router([sa.url], policy=policy)
    for raw, param in UNROUTABLE:
        resp = httpx.post(f"{r.url}/v1/chat/completions", content=raw, timeout=10,
                          headers={"content-type": "application/json"})
        assert resp.status_code == 400, (raw[:60], resp.status_code, resp.text[:300])
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert a.requests == []                 # none of them reached a backend
    ok = [{"prompt": "x", "stream": None, "n": None}, {"prompt": [[1, 2], [3]], "n": 1},
          {"prompt": ["a", "b"]}, {"messages": [{"role": "user", "content": None}]},
          {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
          {"prompt": "x"}]
    for body in ok:
        resp = httpx.post(f"{r.url}/v1/completions", json=body, timeout=10)
        assert resp.status_code == 200
    pair = httpx.post(f"{r.url}/v1/completions", content=b'{"prompt": "\\ud83d\\ude00"}',
                      timeout=10, headers={"content-type": "application/json"})
    assert pair.status_code == 200                   # a surrogate pair is one character
    assert a.requests[-1] == {"prompt": "\U0001F600"}
    assert len(a.requests) == len(ok) + 1


def test_check_fields_then_routing_key_never_raise_anything_else():
    from hypothesis import given, settings, strategies as st

    from jaxserve.router.policies import UnroutableError, check_fields, routing_key
    leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                     st.text(max_size=4))
    value = st.recursive(leaf, lambda kids: st.one_of(
        st.lists(kids, max_size=3), st.dictionaries(st.sampled_from(
            ["role", "content", "text", "type", "x"]), kids, max_size=3)), max_leaves=12)
    body = st.dictionaries(st.sampled_from(["prompt", "messages", "stream", "n", "model"]),
                           value, max_size=4)

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(body)
    def check(b: dict) -> None:
        try:
            check_fields(b)
        except UnroutableError as e:
            assert e.param in ("prompt", "messages", "stream", "n")
        assert isinstance(routing_key(b), str)      # total, checked or not
    check()


def test_pd_policy_flags_are_checked_plainly(capsys):
    # --policy pd itself is tested in tests/server/test_pd_serve.py
    from jaxserve.cli import main
    assert main(["router", "--policy", "pd", "--prefill", "http://127.0.0.1:1"]) == 2
    assert "--decode" in capsys.readouterr().err
    assert main(["router", "--policy", "pd", "--backend", "http://127.0.0.1:1"]) == 2
    assert "--policy pd needs them" in capsys.readouterr().err
    assert main(["router", "--policy", "pd", "--prefill", "http://127.0.0.1:1", "--decode",
                 "http://127.0.0.1:2", "--backend", "http://127.0.0.1:3"]) == 2
    assert "not --backend" in capsys.readouterr().err
    assert main(["router", "--prefill", "http://127.0.0.1:1"]) == 2
    assert "--policy pd" in capsys.readouterr().err
    assert main(["router", "--policy", "prefix"]) == 2
    assert "--backend" in capsys.readouterr().err


def test_cli_serves_and_stops_on_sigterm(fakes):
    ((a, sa),) = fakes(1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "router", "--backend", sa.url, "--port", "0",
         "--policy", "prefix"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()           # "jaxserve router: routing ... on URL to"
        url = line.split(" on ")[1].split()[0]
        wait(lambda: _up(url), 30, "router did not answer")
        assert _complete(url).json() == {"backend": "b0"}
        proc.terminate()
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    # the router process never needs jax
    probe = "import sys, jaxserve.router, jaxserve.cli; print('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60).stdout.strip() == "False"


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# ---- real tiny-model servers ----------------------------------------------------------

@pytest.fixture(scope="module")
def real():
    """Two `jaxserve serve` subprocesses (tiny model; each engine step sleeps 20 ms so
    that 64 streams are still running when one server is killed)."""
    from server_harness import spawn
    out: list[Any] = [None, None]

    def start(i: int) -> None:
        out[i] = spawn({"step_delay": 0.02, "shutdown_timeout": 1})
    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    procs = [o[0] for o in out if o is not None]
    # keep reading their output: a full pipe would block a server's logging
    for p in procs:
        threading.Thread(target=lambda p=p: [None for _ in p.stdout], daemon=True).start()
    try:
        assert len(procs) == 2, "a backend server did not start"
        yield procs, [o[1] for o in out]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def _gen(url: str, route: str, prompt: str, stream: bool, max_tokens: int = 8) -> str:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": stream}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    if not stream:
        c = httpx.post(url + path, json=body, timeout=60).json()["choices"][0]
        return c["message"]["content"] if route == "chat" else c["text"]
    text = []
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        for ln in r.iter_lines():
            if ln.startswith("data: {"):
                c = json.loads(ln[6:])["choices"][0]
                text.append(c["delta"].get("content", "") if route == "chat" else c["text"])
    return "".join(text)


def test_greedy_output_through_the_router_matches_a_server(real, router):
    procs, urls = real
    r = router(urls, policy="least_load")
    for route in ("completions", "chat"):
        for stream in (False, True):
            prompt = "w5 w9 w11 w2"
            want = _gen(urls[0], route, prompt, False)
            assert want.strip()
            assert _gen(r.url, route, prompt, stream) == want
    models = httpx.get(f"{r.url}/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "tiny"


def test_64_streams_with_one_backend_killed(real, router):
    procs, urls = real
    r = router(urls, policy="least_load")
    prompts = [f"w{4 + i} w{20 + i} w7" for i in range(4)]
    want = {p: _gen(urls[1], "completions", p, False, 16) for p in prompts}
    results = asyncio.run(_storm(r.url, prompts, procs[0]))
    assert len(results) == 64
    done = failed = 0
    for prompt, backend, lines in results:
        assert lines[-1] == "[DONE]", (backend, lines[-3:])
        events = [json.loads(x) for x in lines[:-1]]
        errors = [e["error"] for e in events if "error" in e]
        if errors:                      # cut after its first tokens: on the killed one
            failed += 1
            assert backend == "0" and errors[0]["message"] and errors[0]["code"]
            assert len(errors) == 1 and "error" in events[-1]
        else:                           # finished, on either backend, with the greedy text
            done += 1
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            assert "".join(e["choices"][0]["text"] for e in events) == want[prompt]
    assert done + failed == 64
    # at most one running batch (max_num_seqs 8) had tokens when the server died
    assert 1 <= failed <= 8, failed
    # its waiting requests had none: they were retried on the other backend
    assert metric(r.url, "jaxserve_router:backend_retries_total", backend=urls[1]) >= 1
    assert not r.app.pool.backends[0].healthy
    assert httpx.get(f"{r.url}/health", timeout=10).status_code == 200
    assert _gen(r.url, "completions", prompts[0], True, 16) == want[prompts[0]]


async def _storm(url: str, prompts: list[str], victim: subprocess.Popen
                 ) -> list[tuple[str, str, list[str]]]:
    """64 concurrent streams; SIGKILL `victim` (backend 0) once a stream from it has a
    token. -> (prompt, backend index, data lines) per stream."""
    first_from_victim = asyncio.Event()

    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, str, list[str]]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0.0,
                "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            backend = resp.headers["x-jaxserve-backend"]
            lines = []
            async for ln in resp.aiter_lines():
                if ln.startswith("data: "):
                    lines.append(ln[6:])
                    if backend == "0":
                        first_from_victim.set()
            return prompt, backend, lines

    async def killer() -> None:
        await asyncio.wait_for(first_from_victim.wait(), 120)
        victim.kill()

    limits = httpx.Limits(max_connections=128)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        kill = asyncio.create_task(killer())
        results = await asyncio.gather(*(one(client, prompts[i % 4]) for i in range(64)))
        await kill
    return list(results)
