"""router --policy pd against scripted backends (router/pd.py): what the prefill and the
decode server are sent, the fallbacks, and the answers when a role has no server left."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest


from jaxserve.router import RouterConfig, build_app  # noqa: E402
from jaxserve.router.pd import check_roles  # noqa: E402
from router_harness import Uvicorn, read_body  # noqa: E402

KV = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9,
      "transfer_id": "t1"}


class Scripted:
    """status: what a generation route answers; kv: the prefill response's params."""

    def __init__(self, status: int = 200, kv: dict | None = None) -> None:
        self.status, self.kv, self.bodies = status, kv, []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        body = await read_body(receive)
        if scope["path"] == "/health":
            out, status = b"", 200
        else:
            self.bodies.append(json.loads(body))
            status = self.status
            payload: dict[str, Any] = {"choices": [{"text": "x"}], "kv_transfer_params": self.kv}
            if status != 200:
                payload = {"error": {"message": "scripted", "type": "x", "param": None,
                                     "code": "scripted"}}
            out = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": out})


@pytest.fixture
def pd():
    made: list[Uvicorn] = []

    def make(pre: Scripted, dec: Scripted) -> str:
        ps, ds = Uvicorn(pre), Uvicorn(dec)
        r = Uvicorn(build_app(RouterConfig(backends=[], policy="pd", prefill=[ps.url],
                                           decode=[ds.url], poll_interval=0.1)),
                    lifespan="on")
        made.extend([ps, ds, r])
        return r.url
    yield make
    for s in made:
        s.stop()


def _post(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=30,
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                            **body})


def test_prefill_gets_one_token_and_decode_gets_the_params(pd):
    pre, dec = Scripted(kv=KV), Scripted()
    url = pd(pre, dec)
    assert _post(url, max_completion_tokens=50, min_tokens=5, stream_options={
        "include_usage": True}).status_code == 200
    (p,), (d,) = pre.bodies, dec.bodies
    assert p["max_tokens"] == 1 and p["max_completion_tokens"] == 1 and p["min_tokens"] == 0
    assert p["stream"] is False and "stream_options" not in p
    assert p["kv_transfer_params"] == {"do_remote_decode": True}
    assert d["kv_transfer_params"] == KV and d["max_completion_tokens"] == 50
    assert d["stream_options"] == {"include_usage": True}


def test_unsplittable_requests_go_to_decode_whole(pd):
    pre, dec = Scripted(kv=KV), Scripted()
    url = pd(pre, dec)
    assert _post(url, n=2).status_code == 200
    r = httpx.post(f"{url}/v1/completions", timeout=30,
                   json={"model": "m", "prompt": ["a", "b"], "max_tokens": 3})
    assert r.status_code == 200
    assert pre.bodies == [] and len(dec.bodies) == 2
    assert all("kv_transfer_params" not in b for b in dec.bodies)


def test_prefill_4xx_is_the_answer_and_5xx_falls_back(pd):
    pre, dec = Scripted(status=400), Scripted()
    url = pd(pre, dec)
    r = _post(url)
    assert r.status_code == 400 and r.json()["error"]["code"] == "scripted"
    assert dec.bodies == []
    pre.status = 500
    assert _post(url).status_code == 200            # decode computes the prompt itself
    assert "kv_transfer_params" not in dec.bodies[-1]


def test_decode_failing_is_a_clean_5xx(pd):
    pre, dec = Scripted(kv=KV), Scripted(status=503)
    url = pd(pre, dec)
    r = _post(url)
    assert r.status_code == 503 and "error" in r.json()


def test_roles_are_checked():
    with pytest.raises(ValueError, match="at least one --prefill"):
        check_roles([], ["http://a:1"])
    with pytest.raises(ValueError, match="both --prefill and --decode"):
        check_roles(["http://a:1"], ["http://a:1/v1"])


def test_client_kv_transfer_params_are_dropped(pd):
    pre, dec = Scripted(kv=KV), Scripted()
    url = pd(pre, dec)
    mine = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 4444,
            "transfer_id": "client's"}
    assert _post(url, kv_transfer_params=mine).status_code == 200
    assert _post(url, n=2, kv_transfer_params=mine).status_code == 200
    (p,) = pre.bodies                               # the split request was split anyway
    assert p["kv_transfer_params"] == {"do_remote_decode": True}
    assert dec.bodies[0]["kv_transfer_params"] == KV
    assert "kv_transfer_params" not in dec.bodies[1]
