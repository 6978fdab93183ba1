"""The router (`jaxserve router`, and the front of --data-parallel-backend processes)
forwards /v1/responses, /v1/embeddings and /v1/models/{id}, and sends what names a
stored response (GET /v1/responses/{id}, previous_response_id) to the backend that
created it. Over real HTTP on 127.0.0.1, to scripted fake backends
(tests/support/router_harness.py), each of which holds only its own responses."""
from __future__ import annotations

import json

import httpx
import pytest
from starlette.responses import Response

from jaxserve.router.pins import ResponsePins
from jaxserve.router.policies import routing_key
from jaxserve.router.proxy import BACKEND_HEADER
from router_harness import fakes, router  # noqa: F401 - fixtures


def _create(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/responses", json={"model": "m", "input": "hi", **body},
                      timeout=30)


def _stream(url: str, **body) -> tuple[str, list[dict]]:
    """-> the stream's raw text and its events' data."""
    with httpx.stream("POST", f"{url}/v1/responses", timeout=30,
                      json={"model": "m", "input": "hi", "stream": True, **body}) as r:
        assert r.status_code == 200
        text = r.read().decode()
    return text, [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: ")]


def test_new_routes_are_forwarded(fakes, router):
    backends = fakes(2)
    rt = router([srv.url for _, srv in backends])
    r = httpx.post(f"{rt.url}/v1/embeddings", json={"model": "m", "input": ["a", "b"]},
                   timeout=30)
    assert r.status_code == 200 and r.json()["backend"] in ("b0", "b1")
    r = httpx.get(f"{rt.url}/v1/models/org/m", timeout=30)
    assert r.status_code == 200 and r.json()["id"] == "org/m"
    r = _create(rt.url)
    assert r.status_code == 200 and r.json()["id"].startswith("resp_")


def test_stored_responses_are_found_on_their_backend(fakes, router):
    backends = fakes(2)
    rt = router([srv.url for _, srv in backends])      # round robin: creators alternate
    made = [_create(rt.url) for _ in range(4)]
    made.append(httpx.Response(200, json={"id": _stream(rt.url)[1][0]["response"]["id"]},
                               headers={BACKEND_HEADER: "?"}))
    creators = {r.json()["id"]: r.headers[BACKEND_HEADER] for r in made[:4]}
    assert set(creators.values()) == {"0", "1"}
    for r in made:
        rid = r.json()["id"]
        got = httpx.get(f"{rt.url}/v1/responses/{rid}", timeout=30)
        assert got.status_code == 200 and got.json()["id"] == rid, got.text
        if rid in creators:
            assert got.headers[BACKEND_HEADER] == creators[rid]
        follow = _create(rt.url, previous_response_id=rid)
        assert follow.status_code == 200, follow.text
        streamed = _stream(rt.url, previous_response_id=rid)[1]
        assert streamed[-1]["type"] == "response.completed"
    # an id the router never saw is routed as any request: the backend's 404
    assert httpx.get(f"{rt.url}/v1/responses/resp_x", timeout=30).status_code == 404


def test_a_responses_stream_ends_as_it_does_and_a_cut_one_with_an_error_event(fakes,
                                                                               router):
    backends = fakes(1)
    rt = router([backends[0][1].url])
    text, events = _stream(rt.url)
    assert [e["type"] for e in events][-1] == "response.completed"
    assert "[DONE]" not in text and '"error"' not in text      # nothing added
    backends[0][0].mode = "drop_after"
    text, events = _stream(rt.url)
    assert "[DONE]" not in text
    assert events[-1]["type"] == "error" and events[-1]["code"] == "backend_failed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_pins_are_bounded_and_read_the_created_id():
    pins = ResponsePins(capacity=2)
    for i in range(3):
        pins.remember(Response(json.dumps({"id": f"r{i}"}),
                               headers={BACKEND_HEADER: str(i)}))
    assert [pins.backend_of(f"r{i}") for i in range(3)] == [None, 1, 2]
    pins.backend_of("r1")                   # used: r2 is now the oldest
    pins.remember(Response(json.dumps({"id": "r3"}), headers={BACKEND_HEADER: "0"}))
    assert pins.backend_of("r2") is None and pins.backend_of("r1") == 1
    pins.remember(Response(json.dumps({"error": {}}), status_code=404,
                           headers={BACKEND_HEADER: "0"}))
    assert pins.backend_of(["not", "an", "id"]) is None


@pytest.mark.parametrize("a, b", [
    ({"input": "the same start"}, {"input": "another start"}),
    ({"input": [{"role": "user", "content": "x"}]},
     {"input": [{"role": "user", "content": [{"type": "input_text", "text": "y"}]}]}),
    ({"input": "x", "instructions": "be brief"}, {"input": "x"}),
])
def test_routing_key_reads_responses_and_embedding_inputs(a, b):
    assert routing_key(a) and routing_key(a) != routing_key(b)
    assert routing_key(a) == routing_key(dict(a))
