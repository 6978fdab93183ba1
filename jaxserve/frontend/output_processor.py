"""OutputProcessor: engine deltas -> text, stop strings, logprobs and RequestOutputs.

One `_Seq` per engine request; a user request with n > 1 is a parent with n child
sequences ("{id}-{i}") that share the prompt (and so its prefix-cached KV blocks).
Texts are cumulative; while a sequence runs, any tail that could be the start of a
stop string is held back so streamed text never has to be retracted. The EOS or stop
token that ends a sequence adds no text (unless include_stop_str_in_output), as in
vLLM: its id stays in token_ids.

What a RequestOutput carries follows the request's output_kind: CUMULATIVE copies the
whole state (O(T) per step), DELTA only what is new since the last output (each
sequence remembers how far it was reported), FINAL_ONLY builds nothing until the
request has finished.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from jaxserve.core.engine_core import EngineCoreOutput
from jaxserve.frontend.detokenizer import IncrementalDetokenizer
from jaxserve.request import CompletionOutput, FinishReason, Logprob, RequestMetrics, RequestOutput
from jaxserve.sampling.params import RequestOutputKind, SamplingParams
from jaxserve.frontend.stop_strings import check_stop_strings


@dataclass(slots=True)
class _Seq:
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    visible: int = 0                       # chars of text that may be shown now
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # DELTA: how much was reported already (tokens, logprob entries, visible chars).
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_text: int = 0
    finish_sent: bool = False


@dataclass(slots=True)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: dict[str, _Seq]
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # [None, entries for positions 1..] from the first sequence that brings them (the
    # n sequences share the prompt); DELTA outputs carry them once
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    pooled: Any = None                     # a pooling request's vector (EngineCoreOutput)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    child_params: dict[str, SamplingParams],
                    metrics: RequestMetrics | None = None) -> None:
        seqs = {}
        for i, (cid, p) in enumerate(child_params.items()):
            seqs[cid] = _Seq(i, p, IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                                          p.skip_special_tokens),
                             logprobs=[] if p.logprobs is not None else None,
                             cumulative_logprob=0.0 if p.logprobs is not None else None)
            self.child_to_parent[cid] = request_id
        kind = next(iter(child_params.values())).output_kind
        self.parents[request_id] = _Parent(request_id, prompt, prompt_token_ids, seqs, kind,
                                           metrics)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.parents

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated parents' outputs (per their output_kind: none for an
        unfinished FINAL_ONLY request) and child ids stopped by a stop string (the caller
        finishes those in the engine)."""
        touched: dict[str, _Parent] = {}
        stopped: list[str] = []
        for o in outputs:
            pid = self.child_to_parent.get(o.req_id)
            if pid is None:
                continue
            parent = self.parents[pid]
            parent.num_cached_tokens = max(parent.num_cached_tokens, o.num_cached_tokens)
            if o.prompt_logprobs is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = [None, *o.prompt_logprobs]
            if o.pooled is not None:
                parent.pooled = o.pooled
            seq = parent.seqs[o.req_id]
            if seq.finish_reason is not None:
                continue
            if o.error:
                parent.error = o.error
            if self._advance(seq, o):
                stopped.append(o.req_id)
            touched[pid] = parent
        results = []
        for p in touched.values():
            out = self._output(p)
            if out is not None:
                results.append(out)
            if self._finished(p):
                self._drop(p.request_id)
        return results, stopped

    def abort(self, request_id: str) -> RequestOutput | None:
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for seq in parent.seqs.values():
            if seq.finish_reason is None:
                seq.finish_reason = FinishReason.ABORT.value
        out = self._output(parent)
        self._drop(request_id)
        return out

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.seqs) if parent else []

    def is_running(self, child_id: str) -> bool:
        """The sequence exists and has not finished (its next tokens will be taken)."""
        parent = self.parents.get(self.child_to_parent.get(child_id, ""))
        return parent is not None and parent.seqs[child_id].finish_reason is None

    # ---- internals ----------------------------------------------------------------------
    def _advance(self, seq: _Seq, o: EngineCoreOutput) -> bool:
        if len(o.new_token_ids) > 1 and seq.params.stop:
            return self._advance_each(seq, o)
        seq.token_ids.extend(o.new_token_ids)
        if seq.logprobs is not None and o.logprobs is not None:
            for entry in o.logprobs:
                seq.logprobs.append(entry)
                first = next(iter(entry.values()))
                seq.cumulative_logprob += first.logprob
        p = seq.params
        delta = seq.detok.add(o.new_token_ids,
                              final_stop=o.stop_token and not p.include_stop_str_in_output)
        seq.text += delta
        if p.stop:
            check = check_stop_strings(seq.text, len(delta), p.stop, p.include_stop_str_in_output)
            if check.stop is not None:
                seq.text = seq.text[:check.text_end]
                seq.finish_reason = FinishReason.STOP.value
                seq.stop_reason = check.stop
                seq.visible = len(seq.text)
                return True
            seq.visible = check.stream_end
        else:
            seq.visible = len(seq.text)
        if o.finish_reason is not None:
            seq.finish_reason = o.finish_reason.value
            seq.stop_reason = o.stop_reason
            seq.visible = len(seq.text)
        return False

    def _advance_each(self, seq: _Seq, o: EngineCoreOutput) -> bool:
        """Several tokens in one step (speculative decoding): stop strings are checked
        after each, as if they came one per step; tokens after a stop are dropped."""
        last = len(o.new_token_ids) - 1
        for i, token in enumerate(o.new_token_ids):
            one = dataclasses.replace(
                o, new_token_ids=[token],
                logprobs=None if o.logprobs is None else o.logprobs[i:i + 1],
                finish_reason=o.finish_reason if i == last else None,
                stop_reason=o.stop_reason if i == last else None,
                stop_token=o.stop_token and i == last)
            if self._advance(seq, one):
                return True
        return False

    @staticmethod
    def _finished(parent: _Parent) -> bool:
        return all(s.finish_reason is not None for s in parent.seqs.values())

    def _output(self, parent: _Parent) -> RequestOutput | None:
        finished = self._finished(parent)
        kind = parent.kind
        if kind is RequestOutputKind.DELTA:
            outs = [c for c in map(_delta, parent.seqs.values()) if c is not None]
            if not (outs or finished or parent.error):
                return None
        elif kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        else:
            outs = [_cumulative(seq) for seq in parent.seqs.values()]
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outs,
                             finished, parent.metrics, num_cached_tokens=parent.num_cached_tokens,
                             error=parent.error, prompt_logprobs=_prompt_logprobs(parent),
                             pooled=parent.pooled)

    def _drop(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        if parent:
            for cid in parent.seqs:
                self.child_to_parent.pop(cid, None)



def _prompt_logprobs(parent: _Parent) -> list | None:
    """The parent's prompt logprobs for this output (DELTA: only the first time)."""
    if parent.kind is RequestOutputKind.DELTA:
        if parent.prompt_logprobs_sent:
            return None
        parent.prompt_logprobs_sent = parent.prompt_logprobs is not None
    return parent.prompt_logprobs


def _cumulative(seq: _Seq) -> CompletionOutput:
    """Everything so far (copies: the caller may keep it while the sequence grows)."""
    return CompletionOutput(
        index=seq.index, text=seq.text[:seq.visible], token_ids=list(seq.token_ids),
        cumulative_logprob=seq.cumulative_logprob,
        logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
        finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)


def _delta(seq: _Seq) -> CompletionOutput | None:
    """What is new since the last report (None: nothing), and mark it reported."""
    n0, t0 = seq.sent_tokens, seq.sent_text
    finish = seq.finish_reason is not None and not seq.finish_sent
    if len(seq.token_ids) == n0 and seq.visible <= t0 and not finish:
        return None
    logprobs = None
    if seq.logprobs is not None:
        logprobs = seq.logprobs[seq.sent_logprobs:]
        seq.sent_logprobs = len(seq.logprobs)
    text = seq.text[t0:seq.visible]
    seq.sent_tokens, seq.sent_text = len(seq.token_ids), max(t0, seq.visible)
    seq.finish_sent = seq.finish_reason is not None
    return CompletionOutput(
        index=seq.index, text=text, token_ids=seq.token_ids[n0:],
        cumulative_logprob=seq.cumulative_logprob, logprobs=logprobs,
        finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
