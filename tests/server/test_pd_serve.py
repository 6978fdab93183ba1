"""Disaggregated prefill/decode over real HTTP on 127.0.0.1.

A co-located tiny-model server is the reference; a producer (prefill) and a consumer
(decode) server, both with prefix caching, sit behind `jaxserve router --policy pd`.
Greedy outputs must be identical (completions and chat, streamed and not), the KV must
really have moved (the consumer's pull counters), and every KV block must be free on
both sides afterwards, with no saved prefill left on the producer. Failure cases: no
decode server -> a clean 5xx; a decode server killed before its first token -> retried
on another (same output); killed mid-stream -> an error event and [DONE]; neither leaks
a block on the surviving servers.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest


from pd_harness import PDCluster, pd_router, settled  # noqa: E402
from router_harness import metric, wait  # noqa: E402
from server_harness import tiny_args, tiny_parts  # noqa: E402

PRODUCER = json.dumps({"kv_role": "kv_producer", "chunk_blocks": 2, "ttl": 5})
CONSUMER = json.dumps({"kv_role": "kv_consumer", "chunk_blocks": 2, "timeout": 10})


def _words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


# Lengths around block boundaries (16), a shared 32-token prefix (local hits on the
# decode side), one prompt twice (the second time all but its last block is local), and
# prompts longer than the 64-token step budget (chunked prefill on both sides).
BASE = [(7 * i) % 120 + 3 for i in range(120)]
PROMPTS = [_words(BASE[:20]), _words(BASE[:33]), _words(BASE[:32] + BASE[40:60]),
           _words(BASE[5:22]), _words(BASE[:33]), _words(BASE[1:60]), _words(BASE[:100]),
           _words(BASE[7:117])]


@pytest.fixture(scope="module")
def cluster():
    c = PDCluster.start(tiny_parts(), tiny_args, PRODUCER, CONSUMER, warmup=False)
    yield c
    c.close()


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/{path}", json={"model": "tiny", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, path: str, body: dict) -> tuple[str, list[dict]]:
    events = []
    with httpx.stream("POST", f"{url}/v1/{path}", timeout=120,
                      json={"model": "tiny", "stream": True, **body}) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(x) for x in lines[:-1]]
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for e in events for c in e.get("choices", []))
    return text, events


def _text(resp: dict) -> str:
    c = resp["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


def test_completions_identical_to_colocated(cluster):
    colo, pre, dec, router = cluster
    stats = dec.engine.core.kv_connector.stats
    loads0 = stats.loads
    for prompt in PROMPTS:
        want = _text(_post(colo.url, "completions", {"prompt": prompt, **GREEDY}))
        assert _text(_post(router.url, "completions", {"prompt": prompt, **GREEDY})) == want
        got, _ = _stream(router.url, "completions", {"prompt": prompt, **GREEDY})
        assert got == want
    # 12 requests; the repeated 33-token prompt has all 32 transferable tokens local
    # the second and later times (a release, not a pull)
    assert stats.load_failures == 0, stats.failures
    assert stats.loads - loads0 >= 8 and stats.blocks_loaded > 0
    settled(pre, dec)


def test_chat_identical_to_colocated(cluster):
    colo, pre, dec, router = cluster
    for content in (_words(BASE[3:40]), _words(BASE[10:29])):
        body = {"messages": [{"role": "user", "content": content}], **GREEDY}
        want = _text(_post(colo.url, "chat/completions", body))
        assert _text(_post(router.url, "chat/completions", body)) == want
        got, events = _stream(router.url, "chat/completions", body)
        assert got == want and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert dec.engine.core.kv_connector.stats.load_failures == 0
    settled(pre, dec)


def test_prefill_response_advertises_the_transfer(cluster):
    _, pre, dec, _ = cluster
    r = _post(pre.url, "completions", {"prompt": PROMPTS[0], "max_tokens": 1,
                                       "kv_transfer_params": {"do_remote_decode": True}})
    kv = r["kv_transfer_params"]
    assert kv["do_remote_prefill"] and kv["remote_host"] == "127.0.0.1"
    assert kv["remote_port"] == pre.engine.core.kv_connector.server.port
    bad = httpx.post(f"{pre.url}/v1/completions", timeout=30, json={
        "model": "tiny", "prompt": PROMPTS[0], "stream": True,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params"
    # hand it to the decode server directly: it pulls (and the producer forgets it)
    out = _post(dec.url, "completions", {"prompt": PROMPTS[0], **GREEDY,
                                         "kv_transfer_params": kv})
    assert len(out["choices"][0]["text"].split()) == 8
    settled(pre, dec)


def test_router_without_decode_server_answers_clean_5xx(cluster):
    _, pre, dec, _ = cluster
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()                                        # nothing listens there
    r = pd_router([pre.url], [dead])
    try:
        for stream in (False, True):
            resp = httpx.post(f"{r.url}/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": PROMPTS[1], "max_tokens": 4, "stream": stream})
            assert resp.status_code in (502, 503), resp.text
            assert resp.json()["error"]["code"] in ("backend_failed", "no_healthy_backend")
    finally:
        r.stop()
    # the prefill's blocks were free at once; its two saved copies, which nobody will
    # pull, go when their ttl (5 s) runs out
    store = pre.engine.core.kv_connector.store
    assert len(store) == 2
    expired = store.expired
    settled(pre, dec, wait_s=15)
    assert store.expired - expired == 2


def test_decode_killed_before_first_token_is_retried(cluster):
    from pd_harness import spawn
    colo, pre, dec, _ = cluster
    proc, slow = spawn(CONSUMER, 3.0)          # each engine step takes 3 s
    r = pd_router([pre.url], [slow, dec.url])
    try:
        want = _text(_post(colo.url, "completions", {"prompt": PROMPTS[5], **GREEDY}))
        result: dict[str, Any] = {}

        def go() -> None:
            result["out"] = _stream(r.url, "completions", {"prompt": PROMPTS[5], **GREEDY})
        import threading
        t = threading.Thread(target=go, daemon=True)
        t.start()
        wait(lambda: metric(r.url, "jaxserve_router:backend_requests_total",
                            backend=slow) >= 1, 30, "the request never reached it")
        time.sleep(1.0)                        # it has pulled or is pulling the KV
        proc.kill()
        proc.wait(10)
        t.join(120)
        text, _ = result["out"]
        assert text == want                    # retried on the other decode server
        settled(pre, dec)
    finally:
        if proc.poll() is None:
            proc.kill()
        r.stop()


def test_decode_killed_mid_stream_ends_with_error_event(cluster):
    from pd_harness import spawn
    _, pre, dec, _ = cluster
    proc, slow = spawn(CONSUMER, 0.3)
    r = pd_router([pre.url], [slow])
    try:
        with httpx.stream("POST", f"{r.url}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": PROMPTS[2], "stream": True, "max_tokens": 40,
                "temperature": 0, "ignore_eos": True}) as resp:
            assert resp.status_code == 200
            lines = []
            for ln in resp.iter_lines():
                if ln.startswith("data: "):
                    lines.append(ln[6:])
                    if len(lines) == 2:
                        proc.kill()
        assert lines[-1] == "[DONE]"
        assert json.loads(lines[-2])["error"]["code"] == "backend_failed"
        settled(pre, dec)
    finally:
        if proc.poll() is None:
            proc.kill()
        r.stop()
