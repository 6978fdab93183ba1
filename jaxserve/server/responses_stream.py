"""The Responses API's server-sent events, written from the pieces of a chat stream.

Clients (the openai SDK's `responses.stream`) rebuild the response from the events and
check that every item's added / done events and the final response agree, so each item
keeps one id from its output_item.added to response.completed, items are opened and
closed in order (one open at a time), and sequence_number counts every event from 0.
"""
from __future__ import annotations

import itertools
import json
from typing import Any, Callable


class EventWriter:
    """One streamed response: each method returns the SSE text of its events."""

    def __init__(self, head: dict[str, Any], new_id: Callable[[str], str]) -> None:
        self.head, self.new_id = head, new_id
        self.seq = itertools.count()
        self.items: list[dict[str, Any]] = []       # output items, in output order
        self.open: dict[str, Any] | None = None     # the item being written
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
        self.index: dict[str, int] = {}             # item id -> output_index
        self._pending = ""                          # close()'s events, for completed()

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": next(self.seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self) -> str:
        return (self._event("response.created", response=self.head)
                + self._event("response.in_progress", response=self.head))

    def text(self, delta: str) -> str:
        return self._part_delta("message", delta)

    def reasoning(self, delta: str) -> str:
        return self._part_delta("reasoning", delta)

    def _part_delta(self, kind: str, delta: str) -> str:
        """Text for the open item of `kind` (a message's output_text, a reasoning
        item's reasoning_text); another kind open is closed and a new item opened."""
        out = ""
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            new: dict[str, Any] = (
                {"type": "message", "id": self.new_id("msg"), "status": "in_progress",
                 "role": "assistant", "content": []} if kind == "message" else
                {"type": "reasoning", "id": self.new_id("rs"), "status": "in_progress",
                 "summary": [], "content": []})
            out += self._open(new)
            part = _empty_part(kind)
            out += self._event("response.content_part.added", **self._where(new),
                               content_index=0, part=dict(part))
            new["content"].append(part)
        item = self.open
        assert item is not None
        item["content"][0]["text"] += delta
        return out + self._event(_TEXT_EVENT[kind] + ".delta", **self._where(item),
                                 content_index=0, delta=delta, **_LOGPROBS[kind])

    def call(self, tc: dict[str, Any]) -> str:
        """One chat tool-call delta: a new index opens a function_call item."""
        out = ""
        fn = tc.get("function") or {}
        item = self.calls.get(tc.get("index", 0))
        if item is None:
            out += self._close()
            item = {"type": "function_call", "id": self.new_id("fc"),
                    "call_id": tc.get("id") or self.new_id("call"),
                    "name": fn.get("name") or "", "arguments": "", "status": "in_progress"}
            self.calls[tc.get("index", 0)] = item
            out += self._open(item)
        args = fn.get("arguments") or ""
        if args:
            item["arguments"] += args
            out += self._event("response.function_call_arguments.delta", **self._where(item),
                               delta=args)
        return out

    def close(self) -> list[dict[str, Any]]:
        """Close the open item (its events are sent by completed()); -> the output."""
        self._pending = self._close()
        return self.items

    def completed(self, response: dict[str, Any]) -> str:
        return self._pending + self._event("response.completed", response=response)

    def error(self, err: dict[str, Any]) -> str:
        """A failure after the stream began: OpenAI's in-stream error event."""
        return self._event("error", code=err.get("code"), message=err.get("message"),
                           param=err.get("param"))

    # ---- items ------------------------------------------------------------------------
    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.index[item["id"]]}

    def _open(self, item: dict[str, Any]) -> str:
        self.index[item["id"]] = len(self.items)
        self.items.append(item)
        self.open = item
        return self._event("response.output_item.added",
                           output_index=len(self.items) - 1, item=_copy(item))

    def _close(self) -> str:
        item, self.open = self.open, None
        if item is None:
            return ""
        item["status"] = "completed"
        where = self._where(item)
        if item["type"] in _TEXT_EVENT:
            part, kind = item["content"][0], item["type"]
            out = (self._event(_TEXT_EVENT[kind] + ".done", **where, content_index=0,
                               text=part["text"], **_LOGPROBS[kind])
                   + self._event("response.content_part.done", **where, content_index=0,
                                 part=dict(part)))
        else:
            out = self._event("response.function_call_arguments.done", **where,
                              name=item["name"], arguments=item["arguments"])
        return out + self._event("response.output_item.done",
                                 output_index=where["output_index"], item=_copy(item))


# the text events of each item kind with text content; output_text carries logprobs
_TEXT_EVENT = {"message": "response.output_text", "reasoning": "response.reasoning_text"}
_LOGPROBS: dict[str, dict[str, Any]] = {"message": {"logprobs": []}, "reasoning": {}}


def _empty_part(kind: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": ""}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))
