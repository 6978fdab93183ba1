"""The context-length error in OpenAI's words: clients (litellm, LangChain) recognise it
by its phrase and its code, and turn it into their own "context window exceeded"."""
from __future__ import annotations

import pytest

from jaxserve.frontend.input_processor import InputLimits, InputProcessor
from jaxserve.sampling.params import SamplingParams, SamplingParamsError

# the substring litellm's exception mapping looks for (it is not installed here)
LITELLM_PHRASE = "This model's maximum context length is"


def _refusal(num_ids: int, max_tokens: int | None, what: str) -> SamplingParamsError:
    proc = InputProcessor(InputLimits(), vocab_size=128, max_model_len=100)
    with pytest.raises(SamplingParamsError) as e:
        proc.process([5] * num_ids, SamplingParams(max_tokens=max_tokens), what)
    return e.value


def test_phrase_is_openais_and_what_litellm_matches():
    e = _refusal(60, 50, "messages")
    assert e.message == ("This model's maximum context length is 100 tokens. However, you "
                      "requested 110 tokens (60 in the messages, 50 in the completion). "
                      "Please reduce the length of the messages or completion.")
    assert LITELLM_PHRASE in e.message
    assert e.code == "context_length_exceeded" and e.param == "max_tokens"


def test_a_prompt_too_long_alone_names_the_prompt():
    e = _refusal(100, None, "prompt")
    assert e.message.startswith(LITELLM_PHRASE) and "(100 in the prompt, 1 in the completion)" \
        in e.message
    assert e.param == "prompt" and e.code == "context_length_exceeded"
