"""kv_transfer_params on the OpenAI routes (vLLM's field): the disaggregated
prefill/decode hand-off between a prefill server and a decode server.

    to a prefill server:  {"do_remote_decode": true}      (non-streamed, n = 1, one prompt)
       its response adds: {"do_remote_prefill": true, "remote_host", "remote_port",
                           "remote_engine_id", "transfer_id", "prompt_digest",
                           "expires", "signature"}   (null: nothing was saved)
    to a decode server:   those params, as they came back

The engine sees them as SamplingParams.extra_args["kv_transfer_params"]
(kv_transfer/connector.py). A server without --kv-transfer-config, or in the other
role, ignores them and computes the prompt itself (same output, no transfer); so does a
decode server given params that a prefill server holding its transfer secret did not
sign for this very prompt: the endpoint a client names is never connected to.
"""
from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from jaxserve.frontend.async_engine import AsyncEngine
from jaxserve.sampling.params import SamplingParams
from jaxserve.server.errors import APIError

PARAM = "kv_transfer_params"


def attach(p: dict[str, Any] | None, params: SamplingParams, *, stream: bool,
           num_prompts: int) -> tuple[SamplingParams, str | None]:
    """-> (params carrying the hand-off, the transfer id a prefill response advertises)."""
    if not p:
        return params, None
    if params.n != 1 or num_prompts != 1:
        raise APIError(400, "kv_transfer_params needs one prompt and n = 1", param=PARAM)
    if p.get("do_remote_decode"):
        if stream:
            raise APIError(400, "kv_transfer_params.do_remote_decode needs stream=false "
                                "(the response carries the transfer's parameters)",
                           param=PARAM)
        tid = uuid.uuid4().hex
        return _with(params, {"do_remote_decode": True, "transfer_id": tid}), tid
    if p.get("do_remote_prefill"):
        return _with(params, _checked_remote(p)), None
    return params, None


def _checked_remote(p: dict[str, Any]) -> dict[str, Any]:
    host, port, tid = p.get("remote_host"), p.get("remote_port"), p.get("transfer_id")
    if not (isinstance(host, str) and 0 < len(host) <= 255):
        raise APIError(400, "kv_transfer_params.remote_host must be a host name",
                       param=PARAM)
    if not (type(port) is int and 0 < port < 65536):
        raise APIError(400, "kv_transfer_params.remote_port must be a TCP port",
                       param=PARAM)
    if not (isinstance(tid, str) and 0 < len(tid) <= 128):
        raise APIError(400, "kv_transfer_params.transfer_id must be a string",
                       param=PARAM)
    out = {"do_remote_prefill": True, "remote_host": host, "remote_port": port,
           "transfer_id": tid}
    for key in ("remote_engine_id", "prompt_digest", "signature"):   # checked by the engine
        if isinstance(p.get(key), str) and len(p[key]) <= 128:
            out[key] = p[key]
    if type(p.get("expires")) is int:
        out["expires"] = p["expires"]
    return out


def _with(params: SamplingParams, kv: dict[str, Any]) -> SamplingParams:
    return replace(params, extra_args={**(params.extra_args or {}), PARAM: kv})


async def advertise(engine: AsyncEngine, transfer_id: str) -> dict[str, Any] | None:
    """The prefill response's kv_transfer_params: where to pull what was saved (asked
    on the engine thread, like every engine call)."""
    return await engine.call(lambda core: core.kv_transfer_params(transfer_id))
