"""The router's ASGI app and its uvicorn loop.

    app = build_app(RouterConfig(backends=[url1, url2], policy="prefix"))
    app = build_app(RouterConfig(backends=[], policy="pd", prefill=[p], decode=[d]))
    run_router(RouterConfig(...)) -> exit code      # `jaxserve router`

Routes: POST /v1/completions, /v1/chat/completions, /v1/responses and /v1/embeddings
(forwarded; streams relayed event by event), GET /v1/responses/{id} and a
POST /v1/responses with previous_response_id (to the backend that created that
response: pins.py), GET /v1/models and /v1/models/{id} (from a healthy backend),
GET /health (200 while at least one backend is healthy, else a 503 error object),
GET /metrics (the router's own, metrics.py). With --policy pd only completions and
chat completions are split into prefill and decode; the other routes go to a decode
server whole. The same gate as `jaxserve serve` sits in front (middleware.py): API key
compared in constant time (/health open), bounded body size and body time. A body the
router cannot route is a 400 OpenAI error object, never forwarded and never a 500:
one the server's decoder refuses (server/json_body.py: malformed, not UTF-8, nested too
deeply, a lone surrogate), not an object, or a field the router reads of the wrong type
(policies.check_fields).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Coroutine

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jaxserve.router.backends import BackendPool, Timeouts
from jaxserve.router.metrics import RouterMetrics
from jaxserve.router.pd import PDForwarder, RoleOrder, check_roles
from jaxserve.router.pins import ResponsePins
from jaxserve.router.policies import (DEFAULT_PREFIX_CHARS, UnroutableError, check_fields,
                                      make_policy, routing_key)
from jaxserve.router.proxy import Proxy
from jaxserve.server.errors import APIError
from jaxserve.server.json_body import decode
from jaxserve.server.listen import bind
from jaxserve.server.middleware import Gate

log = logging.getLogger("jaxserve.router")

SPLIT_PATHS = ("/v1/completions", "/v1/chat/completions")    # what --policy pd splits


@dataclass(slots=True)
class RouterConfig:
    backends: list[str]
    policy: str = "round_robin"
    host: str = "127.0.0.1"
    port: int = 8100
    api_key: str | None = None
    backend_api_key: str | None = None
    prefix_chars: int = DEFAULT_PREFIX_CHARS
    poll_interval: float = 1.0          # seconds between health (and load) checks
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_request_body_bytes: int = 4 * 1024 * 1024
    request_body_timeout: float = 30.0
    public_metrics: bool = False
    limit_concurrency: int = 1000
    prefill: list[str] = field(default_factory=list)     # --policy pd (router/pd.py)
    decode: list[str] = field(default_factory=list)
    # Coroutines run beside the router while it serves, each given the backend pool
    # (router/dp_supervisor.py: restart dead data-parallel replicas); cancelled at shutdown.
    watchers: list[Callable[[BackendPool], Coroutine[Any, Any, None]]] = field(
        default_factory=list)


def build_app(cfg: RouterConfig) -> Any:
    """-> the ASGI app (Starlette behind the gate); `.pool` and `.metrics` for tests."""
    pd = cfg.policy == "pd"
    urls = check_roles(cfg.prefill, cfg.decode) if pd else cfg.backends
    policy = RoleOrder(cfg.decode) if pd else make_policy(cfg.policy,
                                                          prefix_chars=cfg.prefix_chars)
    pool = BackendPool(urls, api_key=cfg.backend_api_key,
                       poll_load=cfg.policy == "least_load", interval=cfg.poll_interval,
                       timeouts=cfg.timeouts)
    metrics = RouterMetrics(pool)
    proxy = Proxy(pool, policy, metrics)
    split = PDForwarder(pool, metrics, cfg.prefill, proxy) if pd else None
    pins = ResponsePins()

    async def generate(request: Request) -> Response:
        raw = await request.body()
        try:
            body = await decode(raw)
            if not isinstance(body, dict):
                raise APIError(400, "the body must be a JSON object")
            check_fields(body)
        except APIError as e:
            return e.response()
        except UnroutableError as e:
            return APIError(400, str(e), param=e.param).response()
        stream, path = body.get("stream") is True, request.url.path
        if path == "/v1/responses":
            response = await _until_disconnect(request, proxy.forward(
                "POST", path, raw, routing_key(body), stream=stream,
                pin=pins.backend_of(body.get("previous_response_id"))))
            pins.remember(response)
            return response
        if split is not None and path in SPLIT_PATHS:
            work = split.forward(path, body, routing_key(body), stream=stream)
        else:
            work = proxy.forward("POST", path, raw, routing_key(body), stream=stream)
        return await _until_disconnect(request, work)

    async def stored(request: Request) -> Response:
        pin = pins.backend_of(request.path_params["response_id"])
        return await _until_disconnect(request, proxy.forward(
            "GET", request.url.path, None, "", pin=pin))

    async def models(request: Request) -> Response:
        return await _until_disconnect(request, proxy.forward("GET", request.url.path,
                                                              None, ""))

    async def health(_: Request) -> Response:
        if pool.healthy():
            return Response(status_code=200)
        return APIError(503, "no healthy backend", code="no_healthy_backend").response()

    async def prometheus(_: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> Any:
        await pool.start()
        log.info("router: policy %s, backends up: %d of %d", policy.name,
                 len(pool.healthy()), len(pool.backends))
        watching: list[asyncio.Task[None]] = [asyncio.create_task(w(pool))
                                              for w in cfg.watchers]
        yield
        for task in watching:
            task.cancel()
        await asyncio.gather(*watching, return_exceptions=True)
        await pool.stop()

    app = Starlette(routes=[
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/v1/responses", generate, methods=["POST"]),
        Route("/v1/embeddings", generate, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ], lifespan=lifespan, exception_handlers={HTTPException: _http_error,
                                              Exception: _internal_error})
    gate = Gate(app, api_key=cfg.api_key, max_body_bytes=cfg.max_request_body_bytes,
                public_metrics=cfg.public_metrics, body_timeout=cfg.request_body_timeout)
    gate.pool, gate.metrics = pool, metrics          # type: ignore[attr-defined]
    return gate


async def _http_error(_: Request, e: Exception) -> Response:
    """Unknown route (404) or method (405): an OpenAI error object, like the server's."""
    assert isinstance(e, HTTPException)
    return APIError(e.status_code, str(e.detail)).response()


async def _internal_error(_: Request, e: Exception) -> Response:
    log.error("router bug", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}").response()


async def _until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run the forward; cancel it (closing the backend call, so the backend aborts the
    request) if the client goes away before the answer starts."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(BaseException):
            await task
        return Response(status_code=499)        # nobody is listening
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def run_router(cfg: RouterConfig) -> int:
    """Serve until SIGTERM / Ctrl-C (-> 0)."""
    import uvicorn

    from jaxserve.server.uvicorn_server import header_deadline_protocol
    app = build_app(cfg)
    sock = bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    urls = [*cfg.prefill, *cfg.decode] if cfg.policy == "pd" else cfg.backends
    print(f"jaxserve router: routing ({cfg.policy}) on {url} to {len(urls)} "
          f"backend(s): {', '.join(urls)}", flush=True)
    server = uvicorn.Server(uvicorn.Config(
        app, lifespan="on", http=header_deadline_protocol(10.0),
        limit_concurrency=cfg.limit_concurrency, timeout_graceful_shutdown=5,
        timeout_keep_alive=5, log_level="info", access_log=False))
    previous = signal.signal(signal.SIGTERM, lambda *_: None)   # uvicorn re-raises it
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
