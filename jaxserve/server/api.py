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
from fastapi.responses import PlainTextResponse, Response

from jaxserve.config import EngineArgs
from jaxserve.frontend.async_engine import (AsyncEngine, EngineDeadError, EngineStalledError,
                                            EngineStoppedError)
from jaxserve.core.client import EngineClient
from jaxserve.lora import LoRARegistry, parse_lora_modules
from jaxserve.server.errors import APIError, error_response, from_exception, \
    install_error_handlers
from jaxserve.server.json_body import StrictJSONRoute
from jaxserve.server.metrics import ServerMetrics, cache_info_labels
from jaxserve.server.middleware import Gate
from jaxserve.model.pooling import pooling_from_args
from jaxserve.server.embeddings import EmbeddingServing
from jaxserve.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                      DetokenizeRequest, EmbeddingRequest,
                                      LoadLoRAAdapterRequest, TokenizeRequest,
                                      UnloadLoRAAdapterRequest)
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
                            max_model_len=engine.max_model_len, cache_info=cache_info,
                            max_lora=args.max_loras if args.enable_lora else None)
    engine.metrics = metrics
    names = [model_name] + [n for n in args.served_model_name or () if n != model_name]
    loras = lora_registry(args, engine.core.model_cfg) if args.enable_lora else None
    serving = OpenAIServing(engine, tokenizer, model_name,
                            prompt_tokens_details=args.enable_prompt_tokens_details,
                            tool_parser=args.tool_call_parser
                            if args.enable_auto_tool_choice else None,
                            reasoning_parser=args.reasoning_parser,
                            trust_request_chat_template=args.trust_request_chat_template,
                            aliases=names[1:], loras=loras)
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

    def adapter_card(name: str) -> dict[str, Any]:
        # root: the adapter's name (its server-side path is not shown to clients)
        return {**model_card(name), "root": name, "parent": model_name}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        adapters = [adapter_card(r.lora_name) for r in loras.requests()] if loras else []
        return {"object": "list", "data": [model_card(n) for n in names] + adapters}

    @app.get("/v1/models/{model_id:path}")      # repo ids hold a "/"
    async def model(model_id: str) -> dict[str, Any]:
        serving.check_model(model_id)
        if model_id not in names:
            return adapter_card(model_id)
        return model_card(model_id)

    if loras is not None:
        lora_routes(app, loras, names, args.allow_runtime_lora_updating)

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


def lora_registry(args: EngineArgs, model_cfg: Any) -> LoRARegistry:
    """The adapters served by name, --lora-modules loaded and checked now (a bad one
    stops the start with its message)."""
    reg = LoRARegistry(model_cfg, max_rank=args.max_lora_rank,
                       max_cpu_loras=args.max_cpu_loras or args.max_loras)
    for name, path, base in parse_lora_modules(args.lora_modules):
        reg.register(name, path, base)
    return reg


def lora_routes(app: FastAPI, loras: LoRARegistry, names: list[str], allowed: bool) -> None:
    """vLLM's runtime adapter routes, behind --allow-runtime-lora-updating (and the API
    key, as every route). Loading reads files on a worker thread; unloading stops new
    requests from naming the adapter, while requests already admitted finish with it."""

    def check_allowed() -> None:
        if not allowed:
            raise APIError(404, "runtime LoRA updating is off (start the server with "
                                "--allow-runtime-lora-updating)", code="not_found")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        check_allowed()
        if body.lora_name in names or loras.lookup(body.lora_name) is not None:
            raise APIError(400, f"the name {body.lora_name!r} is taken", param="lora_name")
        try:
            await asyncio.to_thread(loras.register, body.lora_name, body.lora_path)
        except ValueError as e:          # AdapterError included: a bad adapter
            raise APIError(400, str(e), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 f"successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        check_allowed()
        try:
            loras.unregister(body.lora_name)
        except KeyError:
            raise APIError(404, f"the LoRA adapter {body.lora_name!r} is not loaded",
                           param="lora_name", code="not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 f"successfully.")


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

