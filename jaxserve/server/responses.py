"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API on the chat path.

A request is rendered into a chat request (server/responses_protocol.py) and served by
OpenAIServing.chat, so prompts, sampling, structured outputs, tool calling, admission
and aborts behave exactly as on /v1/chat/completions. What comes back is rewritten:

    plain     the chat completion -> a response object whose `output` holds a
              `reasoning` item (reasoning_text: the chat reasoning_content, with
              --reasoning-parser), a `message` item (output_text) and one
              `function_call` item per tool call
    stream    the chat chunks -> Responses events, each with its sequence_number:
              response.created, response.in_progress, then per item
              output_item.added, (content_part.added, reasoning_text.delta...,
              reasoning_text.done, content_part.done | content_part.added,
              output_text.delta..., output_text.done, content_part.done |
              function_call_arguments.delta..., function_call_arguments.done),
              output_item.done; last response.completed (its response says
              "incomplete" when max_output_tokens cut it)

With `store` (the default) the response and its whole conversation are kept in the
ResponseStore, scoped by the caller's credentials, for GET and previous_response_id.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from jaxserve.sampling.params import SamplingParamsError
from jaxserve.server.errors import APIError, from_exception
from jaxserve.server.protocol import ChatCompletionRequest, StreamOptions
from jaxserve.server.response_store import ResponseStore, StoredResponse
from jaxserve.server.responses_protocol import (CHAT_TO_RESPONSES_PARAM, FunctionToolChoice,
                                                ResponsesRequest)
from jaxserve.server.responses_stream import EventWriter
from jaxserve.server.serving import JobStream, OpenAIServing


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str,
              status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def responses_usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens") or 0},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning or 0},
            "total_tokens": chat_usage["total_tokens"]}


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the assistant chat turn they were (for the next
    request's conversation)."""
    text = "".join(p["text"] for i in output if i["type"] == "message" for p in i["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {
        "name": i["name"], "arguments": i["arguments"]}}
        for i in output if i["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return msg


class OpenAIResponses:
    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving, self.store = serving, store

    async def create(self, req: ResponsesRequest, scope: str) -> Any:
        self.serving.check_model(req.model)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self.store.get(scope, req.previous_response_id)
            if prev is None:
                raise _not_found(req.previous_response_id, "previous_response_id")
            history = prev.messages
        try:
            chat = req.chat_request(history)
        except ValidationError as e:        # e.g. tool_choice "required" with no tools
            first = e.errors()[0]
            field = str(first["loc"][0]) if first["loc"] else "input"
            param = CHAT_TO_RESPONSES_PARAM.get(field, field)
            raise APIError(400, f"{param}: {first['msg']}", param=param) from None
        conversation = history + req.input_messages()
        head = self._head(req, new_id("resp"), int(time.time()))
        if req.stream:
            chat = chat.model_copy(update={"stream": True,
                                           "stream_options": StreamOptions(include_usage=True)})
            inner = await self._chat(chat)
            writer = EventWriter(head, new_id)
            # the generator holds `inner`: dropped, it would close the job (JobStream)
            return JobStream(inner.job, self._events(inner, writer, scope, conversation))
        body = json.loads((await self._chat(chat)).body)
        choice = body["choices"][0]
        msg = choice["message"]
        output = [reasoning_item(new_id("rs"), msg["reasoning_content"])
                  ] if msg.get("reasoning_content") else []
        output += [message_item(new_id("msg"), msg["content"])] if msg.get("content") else []
        output += [call_item(new_id("fc"), c["id"], c["function"]["name"],
                             c["function"]["arguments"]) for c in msg.get("tool_calls") or ()]
        resp = finish(head, output, choice["finish_reason"], responses_usage(body["usage"]))
        self._keep(scope, resp, conversation)
        return JSONResponse(resp)

    def get(self, response_id: str, scope: str) -> dict[str, Any]:
        entry = self.store.get(scope, response_id)
        if entry is None:
            raise _not_found(response_id, "response_id")
        return entry.response

    async def _chat(self, chat: ChatCompletionRequest) -> Any:
        """The chat path's answer; its errors name the Responses fields."""
        try:
            return await self.serving.chat(chat)
        except (APIError, SamplingParamsError) as e:
            err = from_exception(e)
            err.param = CHAT_TO_RESPONSES_PARAM.get(err.param or "", err.param)
            raise err from None

    async def _events(self, inner: JobStream, writer: EventWriter, scope: str,
                      conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
        """The chat SSE stream -> Responses events; the finished response is stored."""
        yield writer.start()
        reason, usage = None, None
        async for piece in inner.body_iterator:
            chunk = piece if isinstance(piece, str) else bytes(piece).decode()
            data = chunk[len("data: "):].strip() if chunk.startswith("data: ") else ""
            if not data or data == "[DONE]":
                continue
            obj = json.loads(data)
            if "error" in obj:          # the chat stream reports failures in-band
                yield writer.error(obj["error"])
                return
            usage = obj.get("usage") or usage
            for c in obj.get("choices") or ():
                delta = c.get("delta") or {}
                if delta.get("reasoning_content"):
                    yield writer.reasoning(delta["reasoning_content"])
                if delta.get("content"):
                    yield writer.text(delta["content"])
                for tc in delta.get("tool_calls") or ():
                    yield writer.call(tc)
                reason = c.get("finish_reason") or reason
        resp = finish(writer.head, writer.close(), reason, responses_usage(usage))
        yield writer.completed(resp)
        self._keep(scope, resp, conversation)

    def _keep(self, scope: str, resp: dict[str, Any], conversation: list[dict[str, Any]]
              ) -> None:
        if resp["store"]:
            self.store.put(scope, StoredResponse(resp, conversation + [
                assistant_message(resp["output"])]))

    def _head(self, req: ResponsesRequest, rid: str, created: int) -> dict[str, Any]:
        """The response object's request-side fields (status, output and usage come
        later)."""
        fmt = req.text.format if req.text is not None else None
        choice = req.tool_choice
        return {
            "id": rid, "object": "response", "created_at": created, "status": "in_progress",
            "model": self.serving.model_name, "output": [], "usage": None, "error": None,
            "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "previous_response_id": req.previous_response_id,
            "store": req.store, "reasoning": req.reasoning.model_dump()
            if req.reasoning is not None else None, "metadata": req.metadata or {}, "user": req.user,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionToolChoice)
            else choice or ("auto" if req.tools else "none"),
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                     if fmt is not None else {"type": "text"}},
            "truncation": "disabled"}


def finish(head: dict[str, Any], output: list[dict[str, Any]], reason: str | None,
           usage: dict[str, Any] | None) -> dict[str, Any]:
    """The finished response object: cut by max_output_tokens it is "incomplete"."""
    cut = reason == "length"
    return {**head, "status": "incomplete" if cut else "completed", "output": output,
            "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None}


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"no stored response with id {response_id!r} (responses are kept "
                         f"a limited time, for the API key that created them)",
                    param=param, code="response_not_found")
