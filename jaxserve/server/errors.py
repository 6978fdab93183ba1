"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with a status.

Everything a client can get wrong is a 400 (FastAPI's 422 included); an unknown model
is 404, a body too slow 408, a body too large 413, a missing/bad key 401; a request
that failed alone on the engine (the engine carries on) 422 `request_failed`; a dead,
stalled, stopping or full engine 503 (full: with Retry-After); a bug 500.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# frontend/errors.py, not async_engine: importing this module must not import jax (the
# router uses it and runs no engine).
from jaxserve.frontend.errors import (EngineDeadError, EngineOverloadedError,
                                      EngineStalledError, EngineStoppedError,
                                      RequestFailedError)
from jaxserve.sampling.params import SamplingParamsError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 422: "request_failed", 500: "internal_error",
          503: "service_unavailable"}

RETRY_AFTER_S = 1       # admission control: when a client should try again


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_response(status: int, message: str, **kw: Any) -> JSONResponse:
    return APIError(status, message, **kw).response()


def from_exception(e: BaseException) -> APIError:
    """Map an exception raised while serving a request to its APIError."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, SamplingParamsError):
        return APIError(400, e.message if e.code else str(e), param=e.param, code=e.code)
    if isinstance(e, EngineStoppedError):
        return APIError(503, str(e), code="shutting_down")
    if isinstance(e, EngineStalledError):      # may recover: not reported as dead
        return APIError(503, str(e), code="engine_stalled")
    if isinstance(e, EngineDeadError):
        return APIError(503, f"engine failure: {e}", code="engine_dead")
    if isinstance(e, EngineOverloadedError):
        return APIError(503, str(e), code="overloaded",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, RequestFailedError):
        return APIError(422, str(e), code="request_failed")
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return APIError(500, f"internal error: {type(e).__name__}: {e}")


def _param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    # Union members show up as extra loc parts (e.g. "str", "list[int]"); keep the field.
    return parts[0] if parts else None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = tuple(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('msg', '')}")
        where = ".".join(str(p) for p in loc if p != "body") or "body"
        return error_response(400, f"{where}: {first.get('msg', 'invalid value')}",
                              param=_param(loc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        error = getattr(e, "error", None)      # json_body.BodyError: the body's own error
        if isinstance(error, APIError):
            return error.response()
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        return from_exception(e).response()
