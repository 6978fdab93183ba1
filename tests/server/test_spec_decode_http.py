"""The per-request speculation switch over HTTP: `"speculative": false` in a completions
or chat body turns speculative decoding off for that request (same greedy text, the
spec_decode counters on /metrics do not move); a non-boolean is a 400 naming it."""
from __future__ import annotations

import re

import httpx
import pytest

from server_harness import MODEL_NAME, ServerThread, tiny_args, tiny_parts

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
        "prompt_lookup_min": 1}
PROMPT = "w5 w6 w7 w8 w5 w6 w7 w8 w5 w6 w7 w8 w5 w6"     # copy-heavy: n-gram matches
BASE = dict(model=MODEL_NAME, temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def server():
    from jaxserve.server.launch import build_engine
    cfg, weights, tok = tiny_parts()
    args = tiny_args(speculative_config=SPEC)
    engine = build_engine(args, cfg, weights, tok, warmup=True)
    srv = ServerThread(engine, tok, args)
    yield srv
    srv.stop()


def _drafts(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    m = re.search(r"^jaxserve:spec_decode_num_drafts_total\{[^}]*\} (\S+)$", text, re.M)
    assert m, "spec_decode_num_drafts not on /metrics"
    return float(m.group(1))


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_speculative_false_same_text_and_no_drafts(server, route):
    if route == "chat":
        path, body = "/v1/chat/completions", {**BASE, "messages": [
            {"role": "user", "content": PROMPT}]}

        def text(r):
            return r.json()["choices"][0]["message"]["content"]
    else:
        path, body = "/v1/completions", {**BASE, "prompt": PROMPT}

        def text(r):
            return r.json()["choices"][0]["text"]
    d0 = _drafts(server)
    on = _post(server, path, body)
    d1 = _drafts(server)
    assert on.status_code == 200, on.text
    assert d1 > d0, "the default request did not speculate: the test would prove nothing"
    off = _post(server, path, {**body, "speculative": False})
    assert off.status_code == 200, off.text
    assert _drafts(server) == d1
    assert text(off) == text(on) and len(text(on).split()) == 16
    explicit = _post(server, path, {**body, "speculative": True})
    assert text(explicit) == text(on) and _drafts(server) > d1


@pytest.mark.parametrize("bad", ["no", "false", 0, 1, [], {}])
@pytest.mark.parametrize("path,extra", [("/v1/completions", {"prompt": "w5 w6"}),
                                        ("/v1/chat/completions",
                                         {"messages": [{"role": "user", "content": "w5"}]})])
def test_speculative_must_be_a_boolean(server, path, extra, bad):
    r = _post(server, path, {**BASE, **extra, "speculative": bad})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "speculative" and "speculative" in err["message"]
