"""FastAPI routes: OpenAI's /v1 API (completions, chat, responses, models), /health, /metrics, /tokenize, /detokenize, admin.

    app = build_app(engine, tokenizer, model_name="m", args=EngineArgs(...))

Completions run under `_until_disconnect`: if the client goes away before the
response starts, the handler is cancelled and its requests aborted (their KV blocks
freed). A streamed response owns its requests from then on (serving.py: JobStream
closes them whatever happens to the response, started or not). The admin routes
(/reset_prefix_cache, /admin/*) exist only with --enable-admin-routes.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Awaitable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from jaxserve.config import EngineArgs
from jaxserve.frontend.async_engine import (AsyncEngine, EngineDeadError, EngineStalledError,
                                            EngineStoppedError)
from jaxserve.core.client import EngineClient
from jaxserve.server.errors import APIError, error_response, from_exception, \
    install_error_handlers
from jaxserve.server.json_body import StrictJSONRoute
from jaxserve.server.metrics import ServerMetrics, cache_info_labels
from jaxserve.server.middleware import Gate
from jaxserve.model.pooling import pooling_from_args
from jaxserve.server.embeddings import EmbeddingServing
from jaxserve.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                      DetokenizeRequest, EmbeddingRequest, TokenizeRequest)
from jaxserve.server.response_store import ResponseStore, scope_of
from jaxserve.server.responses import OpenAIResponses
from jaxserve.server.responses_protocol import ResponsesRequest
from jaxserve.server.serving import OpenAIServing
from jaxserve.server.tool_calling import template_tools

log = logging.getLogger("jaxserve")


def build_app(engine: AsyncEngine, tokenizer: Any, *, model_name: str,
              args: EngineArgs) -> Any:
    """-> the ASGI app (FastAPI wrapped in the auth / body-size gate). `.fastapi` is the
    inner app (for its OpenAPI schema)."""
    cache_info = cache_info_labels(
        block_size=args.block_size, num_gpu_blocks=engine.snapshot()["num_blocks"],
        cache_dtype=args.kv_cache_dtype, enable_prefix_caching=args.enable_prefix_caching,
        gpu_memory_utilization=args.kv_cache_memory_fraction,
        num_gpu_blocks_override=args.num_kv_blocks)
    metrics = ServerMetrics(model_name, engine.snapshot, compat=args.metrics_compat,
                            max_model_len=engine.max_model_len, cache_info=cache_info)
    engine.metrics = metrics
    names = [model_name] + [n for n in args.served_model_name or () if n != model_name]
    serving = OpenAIServing(engine, tokenizer, model_name,
                            prompt_tokens_details=args.enable_prompt_tokens_details,
                            tool_parser=args.tool_call_parser
                            if args.enable_auto_tool_choice else None,
                            reasoning_parser=args.reasoning_parser,
                            trust_request_chat_template=args.trust_request_chat_template,
                            aliases=names[1:])
    pooling = pooling_from_args(args)     # None: a generation model
    embeddings = EmbeddingServing(serving, pooling, engine.core.model_cfg.hidden_size
                                  if pooling is not None else 0)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        # `serve` has drained already (server/uvicorn_server.py: DrainingServer); this stops the thread.
        await engine.shutdown(timeout=1.0)

    app = FastAPI(title="jaxserve", version="0.1.0", lifespan=lifespan)
    app.router.route_class = StrictJSONRoute      # bodies decoded by server/json_body.py
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        embeddings.refuse_generation()
        return await _until_disconnect(raw, serving.completions(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        embeddings.refuse_generation()
        return await _until_disconnect(raw, serving.chat(body))

    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, raw: Request) -> Any:
        return await _until_disconnect(raw, embeddings.embeddings(body))

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "jaxserve",
                "root": model_name, "max_model_len": engine.max_model_len,
                "vocab_size": engine.vocab_size}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in names]}

    @app.get("/v1/models/{model_id:path}")      # repo ids hold a "/"
    async def model(model_id: str) -> dict[str, Any]:
        serving.check_model(model_id)
        return model_card(model_id)

    add_responses_routes(app, serving, args, embeddings)

    @app.get("/health")
    async def health() -> Response:
        try:
            engine.check_health()
        except EngineDeadError as e:
            code = "engine_stalled" if isinstance(e, EngineStalledError) else "engine_dead"
            return error_response(503, str(e), code=code)
        if not engine.accepting:            # draining: route new work elsewhere
            return error_response(503, "the server is shutting down", code="shutting_down")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:      # rendered as chat renders it, tools included
            req = ChatCompletionRequest(
                messages=body.messages, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template=body.chat_template, chat_template_kwargs=body.chat_template_kwargs,
                tools=body.tools)
            ids = (await asyncio.to_thread(serving.chat_prompt, req, 1,
                                           template_tools(req))).ids
        else:           # off the event loop: a big input takes a while
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt,
                                          add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        if any(not 0 <= t < engine.vocab_size for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {engine.vocab_size})",
                           param="tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}

    if args.enable_admin_routes:
        _admin_routes(app, engine)
    gate = Gate(app, api_key=args.api_key, max_body_bytes=args.max_request_body_bytes,
                public_metrics=args.public_metrics, body_timeout=args.request_body_timeout)
    gate.fastapi = app      # type: ignore[attr-defined]
    return gate


def _admin_routes(app: FastAPI, engine: AsyncEngine) -> None:
    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        return {"success": bool(await _engine_call(engine, lambda c: c.reset_prefix_cache()))}

    @app.get("/admin/kv")
    async def admin_kv() -> dict[str, Any]:
        def read(core: EngineClient) -> dict[str, Any]:
            snap = core.snapshot()       # all replicas (data parallel) summed
            return {"num_free_blocks": snap.num_free_blocks, "num_blocks": snap.num_blocks,
                    "usage": snap.kv_usage, "num_running": snap.num_running,
                    "num_waiting": snap.num_waiting}
        return await _engine_call(engine, read)


def add_responses_routes(app: FastAPI, serving: OpenAIServing, args: EngineArgs,
                         embeddings: EmbeddingServing) -> None:
    """POST /v1/responses, GET /v1/responses/{id} (server/responses.py); an embedding
    server refuses the first as it refuses the other generation routes."""
    responses = OpenAIResponses(serving, ResponseStore(args.max_stored_responses,
                                                       args.stored_response_ttl))

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request) -> Any:
        embeddings.refuse_generation()
        scope = scope_of(raw.headers.get("authorization"))
        return await _until_disconnect(raw, responses.create(body, scope))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, raw: Request) -> dict[str, Any]:
        return responses.get(response_id, scope_of(raw.headers.get("authorization")))


async def _engine_call(engine: AsyncEngine, fn: Any) -> Any:
    try:
        return await engine.call(fn)
    except (EngineDeadError, EngineStoppedError) as e:
        raise from_exception(e) from None


async def _until_disconnect(raw: Request, work: Awaitable[Any]) -> Any:
    """Run the handler; cancel it if the client disconnects before it returns."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        listener.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(BaseException):
            await task
        return Response(status_code=499)    # nobody is listening
    e = task.exception()
    if e is not None:
        err = from_exception(e)
        if err.status == 503:        # overloaded / shutting down / engine dead: expected,
            log.info("request refused (503): %s", err.message)   # no traceback per request
        elif err.status >= 500:
            log.error("request failed: %s", err.message, exc_info=e)
        return err.response()
    return task.result()


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass

