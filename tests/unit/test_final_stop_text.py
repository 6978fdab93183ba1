"""The EOS or stop token that ends a sequence adds no text to the output (its id stays in
token_ids), as in vLLM, even with skip_special_tokens off (a reasoning parser's setting,
so that <think> tags stay in the text), where its text (`<|im_end|>`) would otherwise
end, say, JSON content; include_stop_str_in_output keeps it. On the embedded SmolLM2
tokenizer, whose EOS is the special token <|im_end|>."""
from __future__ import annotations

import functools

import pytest

from jaxserve.core.engine_core import EngineCoreOutput
from jaxserve.core.sched.token_stops import ends_on_stop_token
from jaxserve.frontend.detokenizer import IncrementalDetokenizer
from jaxserve.frontend.output_processor import OutputProcessor
from jaxserve.request import FinishReason, Request
from jaxserve.sampling.params import RequestOutputKind, SamplingParams

ANSWER = '{"color": "red", "ok": true}'


@functools.cache
def _tok():
    from jaxserve.model.loader.default_model import default_gguf_path
    from jaxserve.model.tokenizer.gguf import load_gguf_tokenizer
    return load_gguf_tokenizer(default_gguf_path())


def _ids() -> tuple[list[int], list[int], int]:
    """(prompt ids, the answer's ids, the EOS id)."""
    tok = _tok()
    return tok.encode("<|im_start|>assistant\n"), tok.encode(ANSWER), tok.eos_token_id


@pytest.mark.parametrize("use_stream", [True, False])
def test_detokenizer_leaves_out_the_final_stop_token(use_stream):
    prompt, answer, eos = _ids()
    kept = IncrementalDetokenizer(_tok(), prompt, skip_special_tokens=False,
                                  use_stream=use_stream)
    left = IncrementalDetokenizer(_tok(), prompt, skip_special_tokens=False,
                                  use_stream=use_stream)
    for t in answer:
        kept.add([t])
        left.add([t])
    assert kept.add([eos]) == "<|im_end|>"          # the token's text, when decoded
    assert left.add([eos], final_stop=True) == "" and left.text == ANSWER
    both = IncrementalDetokenizer(_tok(), prompt, skip_special_tokens=False,
                                  use_stream=use_stream)
    assert both.add(answer + [eos], final_stop=True) == ANSWER   # several in one step


def _run(kind: RequestOutputKind, steps: list[list[int]], stop_token: bool = True,
         **params) -> tuple[str, list[int]]:
    """The output processor over these engine steps (the last ends the request on its
    last token): (text, token ids) as its outputs give them."""
    prompt, _, _ = _ids()
    proc = OutputProcessor(_tok())
    p = SamplingParams(max_tokens=64, skip_special_tokens=False, output_kind=kind, **params)
    proc.add_request("r", None, prompt, {"r": p})
    text, ids = "", []
    for i, new in enumerate(steps):
        last = i == len(steps) - 1
        outs, _ = proc.process([EngineCoreOutput(
            "r", new, FinishReason.STOP if last else None, stop_token=stop_token and last)])
        for o in outs:
            c = o.outputs[0]
            text, ids = (text + c.text, ids + c.token_ids) if kind is RequestOutputKind.DELTA \
                else (c.text, c.token_ids)
    return text, ids


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_text_has_no_final_stop_token_text_streamed_or_not(kind):
    _, answer, eos = _ids()
    steps = [[t] for t in answer] + [[eos]]
    assert _run(kind, steps) == (ANSWER, answer + [eos])
    # speculative steps (several tokens each) with stop strings: checked one by one
    text, ids = _run(kind, [answer[:3], answer[3:] + [eos]], stop=["never"])
    assert (text, ids) == (ANSWER, answer + [eos])
    # include_stop_str_in_output keeps it; a request that did not end on it keeps it
    assert _run(kind, steps, include_stop_str_in_output=True)[0] == ANSWER + "<|im_end|>"
    assert _run(kind, steps, stop_token=False)[0] == ANSWER + "<|im_end|>"


def test_which_finishes_end_on_a_stop_token():
    def ended(new, reason=FinishReason.STOP, stop_reason=None, **sp):
        r = Request("r", [1], SamplingParams(max_tokens=8, **sp), eos_token_ids=(2,))
        r.finish_reason, r.stop_reason = reason, stop_reason
        return ends_on_stop_token(r, new)
    assert ended([5, 2])                                    # EOS
    assert ended([7], stop_reason=7, stop_token_ids=[7])    # a stop token
    assert not ended([5, 9])                # a grammar complete on an ordinary token
    assert not ended([5, 2], FinishReason.LENGTH)           # cut at max_tokens
    assert not ended([])
