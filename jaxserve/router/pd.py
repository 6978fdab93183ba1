"""--policy pd: disaggregated prefill and decode (vLLM's disaggregated-serving proxy flow).

    client --> router --1--> prefill server: the request with max_tokens=1, stream=false,
                             kv_transfer_params {do_remote_decode: true}
                      <----- its response's kv_transfer_params (where its KV waits)
                      --2--> decode server: the client's request + those params; it pulls
                             the prompt's KV, computes the last prompt token and generates
                      <----- relayed to the client as it comes (streaming included)

Each step picks among its role's healthy backends round-robin, and moves to the next one
on a failure before anything reached the client (proxy.py's retry rule). Requests that
cannot be split (n > 1, several prompts) go to a decode server whole, and so does a
request whose prefill failed on every prefill server (a decode server computes the
prompt itself; the client sees only the latency). A prefill server's 4xx (the client's
mistake) is passed on as is. No decode server left: the decode step's clean 502/503.

A client's own kv_transfer_params are dropped: the hand-off is the router's to arrange,
and the only params a decode server is sent are the ones the prefill server returned
(signed by it with the transfer secret, which the router does not need).
"""
from __future__ import annotations

import json
import logging
from typing import Any, Sequence

from starlette.responses import Response

from jaxserve.router.backends import Backend, BackendPool, check_url
from jaxserve.router.metrics import RouterMetrics
from jaxserve.router.policies import RoundRobin
from jaxserve.router.proxy import Proxy

log = logging.getLogger("jaxserve.router")


class RoleOrder(RoundRobin):
    """Round-robin over the healthy backends of one role (prefill or decode)."""
    name = "pd"

    def __init__(self, urls: Sequence[str]) -> None:
        super().__init__()
        self.urls = {check_url(u) for u in urls}

    def order(self, backends: Sequence[Backend], key: str) -> list[Backend]:
        return super().order([b for b in backends if b.url in self.urls], key)


def check_roles(prefill: list[str], decode: list[str]) -> list[str]:
    """-> every backend URL, prefill first; ValueError for a bad split."""
    if not prefill or not decode:
        raise ValueError("--policy pd needs at least one --prefill URL and one --decode URL")
    both = {check_url(u) for u in prefill} & {check_url(u) for u in decode}
    if both:
        raise ValueError(f"a server is both --prefill and --decode: {sorted(both)}; give "
                         f"each server one role")
    return [*prefill, *decode]


class PDForwarder:
    def __init__(self, pool: BackendPool, metrics: RouterMetrics, prefill: list[str],
                 decode: Proxy) -> None:
        self.prefill = Proxy(pool, RoleOrder(prefill), metrics)
        self.decode = decode

    async def forward(self, path: str, body: dict[str, Any], key: str, *,
                      stream: bool) -> Response:
        body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if _splittable(body):
            r = await self.prefill.forward("POST", path, _encode(_prefill_body(body)), key)
            if 400 <= r.status_code < 500:
                return r                    # the request is at fault: same answer anywhere
            kv = _transfer_params(r)
            if kv is not None:
                body = {**body, "kv_transfer_params": kv}
            elif r.status_code != 200:
                log.warning("pd: prefill failed (%d); the decode server computes the "
                            "prompt", r.status_code)
        return await self.decode.forward("POST", path, _encode(body), key, stream=stream)


def _splittable(body: dict[str, Any]) -> bool:
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    return body.get("n") in (None, 1) and not several


def _prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    pre = {k: v for k, v in body.items() if k not in ("stream_options", "prompt_logprobs")}
    pre.update(max_tokens=1, stream=False, min_tokens=0,
               kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    return pre


def _transfer_params(r: Response) -> dict[str, Any] | None:
    if r.status_code != 200:
        return None
    try:
        kv = json.loads(bytes(r.body)).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return kv if isinstance(kv, dict) else None


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()
