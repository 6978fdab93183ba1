"""/v1/completions and /v1/chat/completions: prompts -> engine -> JSON or SSE.

Both endpoints share one flow: tokenize and check every prompt (in a worker thread: a
big input must not stall the event loop), admit (503 + Retry-After when full), submit
all of them, wait for each one's first output (so a request the engine refuses is
still a plain 400, not a broken stream), then either collect to the end or stream
deltas. A streamed response owns its requests (JobStream): they are aborted when it
ends, however it ends, even if its body was never started.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
import weakref
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi.responses import JSONResponse, StreamingResponse

from jaxserve.frontend.async_engine import AsyncEngine, RequestFailedError
from jaxserve.lora import AdapterError, LoRARegistry
from jaxserve.request import RequestOutput
from jaxserve.sampling.params import RequestOutputKind, SamplingParams, SamplingParamsError
from jaxserve.server import kv_params
from jaxserve.server.errors import APIError, from_exception
from jaxserve.server.chat_outputs import ChatOutputs
from jaxserve.server.chat_template import ChatRenderer, template_options
from jaxserve.server.formatting import (ChoiceTracker, Delta, TokenTexts, chat_logprobs,
                                        completion_logprobs, echo_logprobs, join_logprobs,
                                        prompt_logprobs_json, token_id_text, usage)
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest
from jaxserve.server.reasoning import (REASONING_PARSERS, constrain_after_reasoning, end_ids,
                                       keep_tags)
from jaxserve.server.tool_calling import (ToolCallOutputs, call_style, plan_tools,
                                          schema_error)
from jaxserve.server.tool_parsers import ToolParser


@dataclass(slots=True)
class _Prompt:
    text: str | None
    ids: list[int]


class _Job:
    """One HTTP request: its prompts' engine streams and the first output of each."""

    def __init__(self, streams: list[Any], prompts: list[_Prompt], n: int) -> None:
        self.streams, self.prompts, self.n = streams, prompts, n
        self.latest: list[RequestOutput | None] = [None] * len(streams)

    async def start(self) -> list[RequestOutput]:
        return list(await asyncio.gather(*(s.next() for s in self.streams)))

    async def merged(self, firsts: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
        for i, out in enumerate(firsts):
            yield i, out
        if len(self.streams) == 1:
            s = self.streams[0]
            while not s.finished:
                yield 0, await s.next()
            return
        q: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, s: Any) -> None:
            try:
                while not s.finished:
                    q.put_nowait((i, await s.next()))
                q.put_nowait((i, done))
            except BaseException as e:      # noqa: BLE001 - re-raised by the consumer
                q.put_nowait((i, e))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await q.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def close(self) -> None:
        for s in self.streams:
            s.close()


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer: Any, model_name: str, *,
                 prompt_tokens_details: bool = False, tool_parser: str | None = None,
                 reasoning_parser: str | None = None,
                 trust_request_chat_template: bool = False,
                 aliases: Sequence[str] = (), loras: LoRARegistry | None = None) -> None:
        """tool_parser: the parser tool_choice "auto" uses; None: auto is refused.
        reasoning_parser: splits <think> reasoning from the answer (server/reasoning.py).
        trust_request_chat_template: a request may bring its own template (code).
        aliases: other names requests may give for the model (responses say model_name).
        loras: the LoRA adapters served by name (model: <adapter name>), or None."""
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.loras = loras
        self.names = {model_name, *aliases}
        self.prompt_tokens_details = prompt_tokens_details
        self.tool_parser = tool_parser
        self.reasoning = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
        self.trust_request_chat_template = trust_request_chat_template
        self.renderer = ChatRenderer(tokenizer)
        self.max_model_len = engine.max_model_len
        self.texts = TokenTexts(tokenizer)

    # ---- prompts ------------------------------------------------------------------------
    def check_model(self, model: str | None, adapters: bool = True) -> None:
        """404 for a name this server does not serve; adapters=False: a route that runs
        the base model only (400 for an adapter's name)."""
        if model is None or model in self.names:
            return
        if self.loras is not None and self.loras.lookup(model) is not None:
            if adapters:
                return
            raise APIError(400, f"{model!r} is a LoRA adapter; this route serves the base "
                                f"model {self.model_name!r} only", param="model")
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                            f"{self.model_name!r}", param="model", code="model_not_found")

    async def adapter(self, model: str | None) -> tuple[Any, str | None]:
        """(loaded adapter, its name) of a checked model name; (None, None): the base.
        A load from disk (the host cache dropped it) runs on a worker thread."""
        req = self.loras.lookup(model) if self.loras is not None and model else None
        if req is None or self.loras is None:
            return None, None
        try:
            return await asyncio.to_thread(self.loras.get, req), req.lora_name
        except AdapterError as e:
            raise APIError(400, f"LoRA adapter {model!r}: {e}", param="model") from None

    def answer_model(self, model: str | None) -> str:
        """The model a response names: the adapter's name, else the base model's."""
        if model is not None and self.loras is not None and self.loras.lookup(model):
            return model
        return self.model_name

    def completion_prompts(self, prompt: Any, n: int = 1, what: str = "prompt"
                           ) -> list[_Prompt]:
        """Size-checked (prompts x n, characters) before anything is tokenized; `what`
        names the request field (prompt, or input for embeddings)."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, f"the {what} is empty", param=what)
        inputs = self.engine.inputs
        inputs.check_request(len(prompt), n, (p for p in prompt if isinstance(p, str)), what)
        out = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise APIError(400, f"the {what} is empty", param=what)
                out.append(_Prompt(p, self.tokenizer.encode(p, add_special_tokens=True)))
            else:
                out.append(_Prompt(None, inputs.check_prompt_ids(p, what)))
            if not out[-1].ids:
                raise APIError(400, f"the {what} is empty", param=what)
        return out

    def chat_prompt(self, req: ChatCompletionRequest, n: int = 1,
                    tools: list[dict[str, Any]] | None = None,
                    style: type[ToolParser] | None = None) -> _Prompt:
        """tools: OpenAI tool objects to render; style: the call format the fallback
        writes (default: the --tool-call-parser's)."""
        texts = [m.text() for m in req.messages] + [
            c.function.arguments for m in req.messages for c in m.tool_calls or ()] + (
            [json.dumps(tools)] if tools else []) + (
            [req.chat_template] if req.chat_template else [])
        self.engine.inputs.check_request(1, n, texts, "messages")
        opts = template_options(req, self.trust_request_chat_template)
        try:
            ids = self.renderer.render(req.template_messages(), tools,
                                       style or call_style(self.tool_parser), opts)
        except Exception as e:  # noqa: BLE001 - jinja raises what the template raises
            param = "chat_template" if opts.template else "messages"
            raise APIError(400, f"{param}: cannot apply the chat template: {e}",
                           param=param) from None
        return _Prompt(None, ids)

    async def submit(self, prompts: list[_Prompt], params: SamplingParams, rid: str,
                     cache_salt: str | None, what: str, stream: bool,
                     model: str | None = None) -> tuple[_Job, list[RequestOutput]]:
        """model: the request's model name (a LoRA adapter's selects it)."""
        lora, lora_name = await self.adapter(model)
        # A stream sends deltas, so it asks for DELTA outputs (no cumulative copy per
        # step); a plain response needs only the end (FINAL_ONLY: nothing per step).
        params = replace(params, output_kind=RequestOutputKind.DELTA if stream
                         else RequestOutputKind.FINAL_ONLY)
        # Every prompt checked (defaults filled) before any is submitted; add_request
        # checks again, so nothing reaches the engine unchecked.
        finals = [self.engine.inputs.process(p.ids, params, what)[1] for p in prompts]
        self.engine.admit(len(prompts) * params.n)
        job = _Job([], prompts, params.n)
        try:
            for i, (p, fp) in enumerate(zip(prompts, finals)):
                job.streams.append(self.engine.add_request(p.ids, fp, f"{rid}-p{i}",
                                                           p.text, cache_salt, lora,
                                                           lora_name))
            return job, await job.start()
        except BaseException:
            job.close()
            raise

    # ---- /v1/completions ----------------------------------------------------------------
    async def completions(self, req: CompletionRequest) -> Any:
        self.check_model(req.model)
        params = req.sampling_params()
        self.engine.inputs.check_params(params)
        await self.engine.inputs.acheck_structured(params)
        _no_streamed_prompt_logprobs(req)
        prompts = await asyncio.to_thread(self.completion_prompts, req.prompt, params.n)
        params, kv_tid = kv_params.attach(req.kv_transfer_params, params, stream=req.stream,
                                          num_prompts=len(prompts))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        job, firsts = await self.submit(prompts, params, rid, req.cache_salt, "prompt",
                                        req.stream, req.model)
        head = {"id": rid, "object": "text_completion", "created": created,
                "model": self.answer_model(req.model)}
        k = req.logprobs

        def choice(d: Delta, p: _Prompt, first: bool) -> dict[str, Any]:
            return self._completion_choice(req, params, d, p, first)

        if req.stream:
            return _sse(job, self._stream(job, firsts, head, choice, req.include_usage,
                                          k is not None, req.continuous_usage))
        return await self._collect(job, firsts, head, choice, kv_tid=kv_tid)

    def _completion_choice(self, req: CompletionRequest, params: SamplingParams, d: Delta,
                           p: _Prompt, first: bool) -> dict[str, Any]:
        """One choice (or stream chunk). With echo, the first one starts with the prompt
        (its text; with logprobs, its tokens and their logprobs, the first null), as
        lm-evaluation-harness's loglikelihood requests read it; echo with max_tokens 0
        returns only the prompt."""
        echo, k = req.echo and first, req.logprobs
        texts = token_id_text if req.return_tokens_as_token_ids else self.texts
        end = 0 if req.echo_only else d.end
        text = "" if req.echo_only else d.text
        if echo:
            text = (p.text if p.text is not None else self.tokenizer.decode(
                p.ids, skip_special_tokens=req.skip_special_tokens)) + text
        lp = None
        if k is not None:
            lp = completion_logprobs(texts, d.output, d.start, end, k, d.text_offset)
            if echo:
                lp = join_logprobs(echo_logprobs(texts, p.ids, d.prompt_logprobs, k), lp)
        c = {"index": d.index, "text": text, "logprobs": lp,
             "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
        if params.prompt_logprobs is not None and first:
            c["prompt_logprobs"] = prompt_logprobs_json(self.texts, d.prompt_logprobs)
        return c

    # ---- /v1/chat/completions -----------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest) -> Any:
        self.check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        params = req.sampling_params()
        plan = plan_tools(req, self.tool_parser)
        if plan is not None:
            params = plan.adjust(params, self.tokenizer)
        if self.reasoning is not None:
            params = constrain_after_reasoning(self.reasoning, keep_tags(params, self.tokenizer),
                                               self.tokenizer, req.chat_template_kwargs)
        try:
            self.engine.inputs.check_params(params)
            await self.engine.inputs.acheck_structured(params)
        except SamplingParamsError as e:
            raise schema_error(e) if plan is not None else e
        _no_streamed_prompt_logprobs(req)
        prompts = [await asyncio.to_thread(
            self.chat_prompt, req, params.n, plan.tools if plan is not None else None,
            plan.style if plan is not None else None)]
        params, kv_tid = kv_params.attach(req.kv_transfer_params, params, stream=req.stream,
                                          num_prompts=1)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        job, firsts = await self.submit(prompts, params, rid, req.cache_salt, "messages",
                                        req.stream, req.model)
        obj = "chat.completion.chunk" if req.stream else "chat.completion"
        head = {"id": rid, "object": obj, "created": created,
                "model": self.answer_model(req.model)}
        k = req.top_logprobs or 0
        texts = token_id_text if req.return_tokens_as_token_ids else self.texts
        last = req.messages[-1]
        # a constrained output's grammar starts after the reasoning: the split applies
        outputs = ChatOutputs(
            ToolCallOutputs(plan) if plan is not None else None, self.reasoning,
            last.text() if req.echo and last.role == "assistant" else "",
            end_ids(self.tokenizer) if self.reasoning is not None else ())
        # usage's completion_tokens_details.reasoning_tokens (with a reasoning parser)
        counted = outputs.reasoning_tokens if self.reasoning is not None else None

        def choice(d: Delta, p: _Prompt, first: bool) -> dict[str, Any] | None:
            lp = chat_logprobs(texts, d.output, d.start, d.end, k) if req.logprobs else None
            if not req.stream:
                msg, reason = outputs.message(d)
                return {"index": d.index, "message": msg, "logprobs": lp,
                        "finish_reason": reason, "stop_reason": d.stop_reason}
            delta, reason = outputs.delta(d, first)
            if not delta and reason is None and lp is None:
                return None         # nothing to say yet (a tag or a call being read)
            return {"index": d.index, "delta": delta, "logprobs": lp,
                    "finish_reason": reason, "stop_reason": d.stop_reason}

        if req.stream:
            return _sse(job, self._stream(job, firsts, head, choice, req.include_usage,
                                          req.logprobs, req.continuous_usage, counted))
        return await self._collect(job, firsts, head, choice,
                                   top_prompt_logprobs=params.prompt_logprobs is not None,
                                   kv_tid=kv_tid, reasoning=counted)

    # ---- shared -------------------------------------------------------------------------
    async def _collect(self, job: _Job, firsts: list[RequestOutput], head: dict,
                       choice: Any, top_prompt_logprobs: bool = False,
                       kv_tid: str | None = None, reasoning: _Counter | None = None
                       ) -> JSONResponse:
        """top_prompt_logprobs: the (one) prompt's logprobs at the top level (chat, as
        vLLM does; completions put them in each choice). reasoning: counts a choice's
        reasoning tokens (after its choice() read the text) for the usage."""
        try:
            finals = list(firsts)
            async for i, out in job.merged([]):
                finals[i] = out
        finally:
            job.close()
        choices, completion_tokens, cached, thought = [], 0, 0, 0
        for i, out in enumerate(finals):
            _raise_if_error(out)
            cached += out.num_cached_tokens
            for d in ChoiceTracker(i, job.n).deltas(out):
                choices.append(choice(d, job.prompts[i], True))
                completion_tokens += d.num_tokens
                if reasoning is not None:   # a final-only output: all of its tokens
                    thought += reasoning(d.index, d.output.token_ids)
        choices.sort(key=lambda c: c["index"])
        prompt_tokens = sum(len(p.ids) for p in job.prompts)
        body = {**head, "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens, self._cached(cached),
                               thought if reasoning is not None else None)}
        if top_prompt_logprobs:
            body["prompt_logprobs"] = prompt_logprobs_json(self.texts, finals[0].prompt_logprobs)
        if kv_tid is not None:      # a prefill for a decode server (server/kv_params.py)
            body[kv_params.PARAM] = await kv_params.advertise(self.engine, kv_tid)
        return JSONResponse(body)

    async def _stream(self, job: _Job, firsts: list[RequestOutput], head: dict, choice: Any,
                      include_usage: bool, every_token: bool, continuous: bool = False,
                      reasoning: _Counter | None = None) -> AsyncIterator[str]:
        """continuous: every chunk carries the usage so far (vLLM's
        continuous_usage_stats); include_usage: a last chunk with the total (and, with
        `reasoning`, the reasoning tokens of the finished choices)."""
        trackers = [ChoiceTracker(i, job.n) for i in range(len(job.prompts))]
        started: set[int] = set()
        extra: dict[str, Any] = {"usage": None} if include_usage else {}
        counts: dict[int, int] = {}
        outputs: dict[int, list[int]] = {}     # each choice's tokens, to count reasoning
        cached = 0
        pt = sum(len(p.ids) for p in job.prompts)
        try:
            async for i, out in job.merged(firsts):
                _raise_if_error(out)
                cached = max(cached, out.num_cached_tokens)
                for d in trackers[i].deltas(out):
                    counts[d.index] = d.num_tokens
                    if reasoning is not None and include_usage:
                        outputs.setdefault(d.index, []).extend(d.output.token_ids)
                    if not (d.text or d.finish_reason or every_token or d.index not in started):
                        continue
                    c = choice(d, job.prompts[i], d.index not in started)
                    if c is None:       # nothing to say yet (a tool call being read)
                        continue
                    started.add(d.index)
                    if continuous:
                        extra = {"usage": usage(pt, sum(counts.values()),
                                                self._cached(cached))}
                    yield _data({**head, "choices": [c], **extra})
            if include_usage:
                thought = None if reasoning is None else sum(
                    reasoning(i, ids) for i, ids in outputs.items())
                yield _data({**head, "choices": [], "usage": usage(
                    pt, sum(counts.values()), self._cached(cached), thought)})
        except Exception as e:  # noqa: BLE001 - the status line is gone: report in-band
            yield _data(from_exception(e).body())
        finally:
            job.close()
        yield "data: [DONE]\n\n"

    def _cached(self, cached: int) -> int | None:
        return cached if self.prompt_tokens_details else None


# a choice's index and all its output token ids -> how many of them are reasoning
_Counter = Callable[[int, Sequence[int]], int]


def _no_streamed_prompt_logprobs(req: Any) -> None:
    """vLLM's rule: the prompt_logprobs field is not streamed (echo's logprobs are)."""
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs is not available with stream=true",
                       param="prompt_logprobs")


def _raise_if_error(out: RequestOutput) -> None:
    if out.error:
        raise RequestFailedError(f"request failed: {out.error}")


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


class JobStream(StreamingResponse):
    """An SSE response that owns its job. A client that disconnects after the handler
    returned but before the body iterator's first step would otherwise leave the
    requests running: a never-started async generator's `finally` never runs. So the
    job is closed when the response finishes in any way, and, should the response be
    dropped without ever being sent, when it is garbage-collected."""

    def __init__(self, job: _Job, gen: AsyncIterator[str]) -> None:
        super().__init__(gen, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job
        weakref.finalize(self, job.close)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close()


def _sse(job: _Job, gen: AsyncIterator[str]) -> StreamingResponse:
    return JobStream(job, gen)
