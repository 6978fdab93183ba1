"""SamplingParams.output_kind (vLLM's RequestOutputKind): CUMULATIVE, DELTA, FINAL_ONLY.

The truth for every kind is the offline LLM's result for the same request (LLM.generate,
which returns final outputs): DELTA outputs concatenated, the one FINAL_ONLY output and
the last CUMULATIVE one must all equal it, with n=2 seeded samples, logprobs and a stop
string. A consumer that stops reading holds O(T) per request in every mode: what its
mailbox retains grows linearly with the tokens generated, not quadratically.
"""
from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import replace
from typing import Any

import pytest

from server_harness import tiny_args, tiny_parts

import jaxserve
from jaxserve.request import RequestOutput
from jaxserve.sampling.params import RequestOutputKind, SamplingParams, SamplingParamsError

KINDS = list(RequestOutputKind)
PROMPT = [5, 9, 17, 33, 40]


@pytest.fixture(scope="module")
def parts():
    return tiny_parts()


@pytest.fixture(scope="module")
def llm(parts):
    from jaxserve.frontend.llm import LLM
    cfg, weights, tok = parts
    a = tiny_args()
    return LLM.from_weights(cfg, weights, tok, max_num_batched_tokens=a.max_num_batched_tokens,
                            max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len,
                            block_size=a.block_size, token_buckets=a.token_buckets,
                            num_kv_blocks=a.num_kv_blocks)


@pytest.fixture(scope="module")
def engine(parts):
    from jaxserve.server.launch import build_engine
    cfg, weights, tok = parts
    eng = build_engine(tiny_args(), cfg, weights, tok, warmup=True)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def params(llm):
    """n=2 seeded samples with logprobs, stopped by a word sample 0 really generates."""
    base = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True,
                          logprobs=2)
    text = llm.generate({"prompt_token_ids": PROMPT}, base, use_tqdm=False)[0].outputs[0].text
    stop = text.split()[len(text.split()) // 2]
    return replace(base, stop=[stop])


def _final(c: Any) -> dict[str, Any]:
    return {"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
            "logprobs": list(c.logprobs or []), "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason, "cumulative_logprob": c.cumulative_logprob}


def _concat(outs: list[RequestOutput]) -> list[dict[str, Any]]:
    """DELTA outputs joined per sample; each finish reason must come exactly once."""
    by: dict[int, dict[str, Any]] = {}
    for o in outs:
        for c in o.outputs:
            d = by.setdefault(c.index, {"index": c.index, "text": "", "token_ids": [],
                                        "logprobs": [], "finish_reason": None,
                                        "stop_reason": None, "cumulative_logprob": None})
            assert d["finish_reason"] is None, "content after the finish reason"
            d["text"] += c.text
            d["token_ids"] += c.token_ids
            d["logprobs"] += c.logprobs or []
            d["finish_reason"], d["stop_reason"] = c.finish_reason, c.stop_reason
            d["cumulative_logprob"] = c.cumulative_logprob
    return [by[i] for i in sorted(by)]


def _generate(engine: Any, params: SamplingParams, rid: str) -> list[RequestOutput]:
    async def go() -> list[RequestOutput]:
        return [o async for o in engine.generate(PROMPT, params, rid)]
    return asyncio.run(go())


# ---- the enum ---------------------------------------------------------------------------
def test_enum_is_exported_and_checked():
    assert jaxserve.RequestOutputKind is RequestOutputKind
    assert "RequestOutputKind" in jaxserve.__all__
    assert [k.value for k in KINDS] == [0, 1, 2]       # vLLM's values
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(output_kind="delta")
    assert e.value.param == "output_kind"


# ---- what each kind yields ----------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_async_generate_by_kind_matches_llm(engine, llm, params, kind):
    truth = [_final(c) for c in llm.generate(
        {"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs]
    assert truth[0]["finish_reason"] == "stop" and truth[1]["token_ids"]
    outs = _generate(engine, replace(params, output_kind=kind), f"kind-{kind.name}")
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    if kind is RequestOutputKind.FINAL_ONLY:
        assert len(outs) == 1
    else:
        assert len(outs) > 3                       # it streamed
    if kind is RequestOutputKind.DELTA:
        got = _concat(outs)
        # Each delta is new content only: no output repeats the tokens of an earlier one.
        assert sum(len(c.token_ids) for o in outs for c in o.outputs) == \
            sum(len(t["token_ids"]) for t in truth)
    else:
        got = [_final(c) for c in outs[-1].outputs]
    assert got == truth
    if kind is RequestOutputKind.CUMULATIVE:      # each output extends the previous one
        for a, b in zip(outs, outs[1:]):
            for ca, cb in zip(a.outputs, b.outputs):
                assert cb.token_ids[:len(ca.token_ids)] == ca.token_ids
                assert cb.text.startswith(ca.text)


def test_llm_generate_returns_finals_whatever_the_kind(llm, params):
    """vLLM's LLM runs its requests FINAL_ONLY whatever output_kind says; so does ours,
    on a copy: the caller's params keep their kind."""
    delta = replace(params, output_kind=RequestOutputKind.DELTA)
    outs = {k: llm.generate({"prompt_token_ids": PROMPT}, replace(params, output_kind=k),
                            use_tqdm=False)[0] for k in KINDS}
    finals = {k: [_final(c) for c in o.outputs] for k, o in outs.items()}
    assert finals[RequestOutputKind.DELTA] == finals[RequestOutputKind.CUMULATIVE] == \
        finals[RequestOutputKind.FINAL_ONLY]
    assert all(o.finished for o in outs.values())
    llm.generate({"prompt_token_ids": PROMPT}, delta, use_tqdm=False)
    assert delta.output_kind is RequestOutputKind.DELTA


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_metrics_are_the_same_in_every_kind(engine, kind):
    """TTFT, ITLs, token count and finish reasons come from the engine's outputs, not
    from the RequestOutputs (DELTA and FINAL_ONLY ones do not carry the totals)."""
    seen: list[dict[str, Any]] = []

    class Sink:
        def observe_request(self, **kw: Any) -> None:
            seen.append(kw)
    old, engine.metrics = engine.metrics, Sink()
    try:
        p = SamplingParams(n=2, max_tokens=8, temperature=0, ignore_eos=True,
                           output_kind=kind)
        _generate(engine, p, f"metrics-{kind.name}")
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.metrics = old
    (m,) = seen
    assert m["generation_tokens"] == 16 and m["finish_reasons"] == ["length", "length"]
    assert m["ttft"] is not None and len(m["itls"]) == 7   # one token per step after it
    assert m["prompt_tokens"] == len(PROMPT)


def test_delta_abort_reports_abort_and_frees_kv(engine):
    seen: list[dict[str, Any]] = []

    class Sink:
        def observe_request(self, **kw: Any) -> None:
            seen.append(kw)
    old, engine.metrics = engine.metrics, Sink()
    p = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True,
                       output_kind=RequestOutputKind.DELTA)

    async def go() -> int:
        n = 0
        async for out in engine.generate(PROMPT, p, "abort-delta"):
            n += len(out.outputs[0].token_ids)
            if n >= 3:
                break           # closes the generator: the request is aborted
        return n
    try:
        got = asyncio.run(go())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            s = engine.snapshot()
            if seen and s["num_free_blocks"] == s["num_blocks"] and not s["num_running"]:
                break
            time.sleep(0.02)
    finally:
        engine.metrics = old
    assert 3 <= got < 60
    assert seen and seen[0]["finish_reasons"] == ["abort"]
    s = engine.snapshot()
    assert s["num_free_blocks"] == s["num_blocks"], s


# ---- a consumer that stops reading holds O(T) ------------------------------------------------
def _deep_size(obj: Any, seen: set[int]) -> int:
    """Bytes reachable from an output (lists, dicts, strings, slotted dataclasses)."""
    if id(obj) in seen or isinstance(obj, type):
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        kids: Any = [*obj.keys(), *obj.values()]
    elif isinstance(obj, (list, tuple)):
        kids = obj
    elif hasattr(type(obj), "__slots__"):
        kids = [getattr(obj, s) for s in type(obj).__slots__ if hasattr(obj, s)]
    else:
        kids = []
    return size + sum(_deep_size(k, seen) for k in kids)


def _stalled(engine: Any, params: SamplingParams, rid: str) -> tuple[int, RequestOutput]:
    """Submit, read nothing until the engine has finished the request, then measure what
    the mailbox holds and read it."""
    async def go() -> tuple[int, RequestOutput]:
        stream = engine.add_request(PROMPT, params, rid)
        box = stream.st.mailbox
        deadline = time.monotonic() + 60
        while True:
            item = getattr(box._item, "out", box._item)     # PendingDeltas -> its output
            if item is not None and item.finished:
                break
            assert time.monotonic() < deadline, "the request did not finish"
            await asyncio.sleep(0.01)
        size = _deep_size(box._item, {id(PROMPT), id(params)})
        out = await stream.next()
        assert stream.finished
        stream.close()
        return size, out
    return asyncio.run(go())


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_slow_consumer_holds_linear_memory(engine, llm, kind):
    sizes = {}
    for t in (24, 96):
        p = SamplingParams(n=2, max_tokens=t, temperature=0, ignore_eos=True, logprobs=2,
                           output_kind=kind)
        sizes[t], out = _stalled(engine, p, f"slow-{kind.name}-{t}")
        truth = llm.generate({"prompt_token_ids": PROMPT}, p, use_tqdm=False)[0]
        assert out.finished
        if kind is RequestOutputKind.DELTA:     # nothing read yet: one delta holds it all
            assert _concat([out]) == [_final(c) for c in truth.outputs]
        else:
            assert [_final(c) for c in out.outputs] == [_final(c) for c in truth.outputs]
    # 4x the tokens: ~4x the bytes when linear (a backlog of cumulative outputs: ~16x).
    assert sizes[96] < 5 * sizes[24], sizes


# ---- a failure after output: the output is read first, then the failure -------------------
@pytest.mark.parametrize("merge", [True, False], ids=["delta", "replace"])
def test_mailbox_delivers_pending_output_before_the_failure(merge):
    from jaxserve.frontend.request_stream import Mailbox
    from jaxserve.request import CompletionOutput

    def out(tok: int) -> RequestOutput:
        c = CompletionOutput(index=0, text=f"t{tok}", token_ids=[tok])
        return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], outputs=[c],
                             finished=False)

    async def go() -> tuple[Any, Any, Any]:
        box = Mailbox(merge=merge)
        assert box.put(out(1))
        box.put(out(2))
        box.put(ValueError("boom"))
        box.put(out(3))                      # after the failure: dropped
        box.wake()
        first = await box.get()
        return first, await box.get(), await box.get()
    first, err, again = asyncio.run(go())
    assert first.outputs[0].token_ids == ([1, 2] if merge else [2])
    assert isinstance(err, ValueError) and err is again        # sticky
