"""Where a constrained request's answer starts after its reasoning (the host path's
bookkeeping and the device path's restart replay share these helpers), and the shape
check of StructuredOutputsParams.reasoning_end."""
from __future__ import annotations

import pytest

from jaxserve.sampling.params import MAX_REASONING_END, SamplingParamsError
from jaxserve.sampling.params import StructuredOutputsParams as SO
from jaxserve.structured.reasoning_end import ReasoningWatch, answer_start, end_of


def test_answer_starts_after_the_first_end_sequence():
    assert answer_start([5, 6, 7], ()) == 0                  # no reasoning: at once
    assert answer_start([5, 6, 7], (9,)) is None             # still reasoning
    assert answer_start([5, 9, 7, 9], (9,)) == 2             # the first one counts
    assert answer_start([8, 8, 9, 8, 9], (8, 9)) == 3        # overlapping starts
    assert answer_start([8, 9], (8, 9)) == 2
    assert end_of(None) == () and end_of(SO(regex="a")) == ()
    assert end_of(SO(regex="a", reasoning_end=[8, 9])) == (8, 9)


def test_watch_follows_kept_tokens_and_preemption():
    w = ReasoningWatch.of(SO(regex="a", reasoning_end=[8, 9]))
    out: list[int] = []
    for t in [8, 8, 9]:
        assert w.reasoning
        out.append(t)
        w.observe(out)
    assert not w.reasoning and w.answer_from == 3
    assert w.kept(5) == 2                    # two answer tokens kept
    assert w.kept(3) == 0 and not w.reasoning
    assert w.kept(2) == 0 and w.reasoning    # the end was cut off: reasoning again
    assert ReasoningWatch.of(SO(regex="a")).kept(4) == 4


@pytest.mark.parametrize("bad", [[], [-1], ["1"], [1.5], list(range(MAX_REASONING_END + 1)),
                                 5])
def test_reasoning_end_shape_is_checked(bad):
    with pytest.raises(SamplingParamsError, match="reasoning_end"):
        SO(regex="a", reasoning_end=bad)
