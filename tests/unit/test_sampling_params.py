"""SamplingParams validation: bad values raise SamplingParamsError naming the field."""
from __future__ import annotations

import math

import pytest

from jaxserve.sampling.params import SamplingParams, SamplingParamsError

BAD = [
    ("n", dict(n=0)), ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=math.inf)), ("temperature", dict(temperature=math.nan)),
    ("top_p", dict(top_p=0.0)), ("top_p", dict(top_p=1.01)), ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=2.5)), ("min_p", dict(min_p=1.5)),
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("frequency_penalty", dict(frequency_penalty=-3)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("logit_bias", dict(logit_bias={1: 101})), ("logit_bias", dict(logit_bias={-1: 1})),
    ("logit_bias", dict(logit_bias={"x": 1})), ("logit_bias", dict(logit_bias={i: 1 for i in range(65)})),
    ("max_tokens", dict(max_tokens=0)), ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=5, max_tokens=4)), ("logprobs", dict(logprobs=-1)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)), ("stop", dict(stop=["ok", ""])),
    ("stop", dict(stop="")), ("seed", dict(seed=1.5)), ("stop_token_ids", dict(stop_token_ids=[-3])),
]


@pytest.mark.parametrize("param,kwargs", BAD, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD)])
def test_bad_values_name_the_parameter(param, kwargs):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)
    assert isinstance(e.value, ValueError)


def test_engine_limits_and_vocab():
    p = SamplingParams(n=20, logprobs=25, prompt_logprobs=3, logit_bias={"9": 1},
                       stop_token_ids=[7])
    assert p.logit_bias == {9: 1.0}                    # JSON keys become token ids
    for param, kwargs in [("n", {}), ("logprobs", dict(max_n=32)),
                          ("logit_bias", dict(max_n=32, max_logprobs=30, vocab_size=8)),
                          ("stop_token_ids", dict(max_n=32, max_logprobs=30, vocab_size=7))]:
        with pytest.raises(SamplingParamsError) as e:
            p.validate(**kwargs)
        assert e.value.param == param
    p.validate(max_n=32, max_logprobs=30, vocab_size=10)


def test_good_values_pass():
    SamplingParams(temperature=0, top_k=0, top_p=1, min_p=1, presence_penalty=-2,
                   repetition_penalty=0.5, logit_bias={0: -100, 9: 100}, seed=-5,
                   max_tokens=None, min_tokens=100, logprobs=0, stop="x").validate()
