"""Incremental stop-string checks on a request's output text (host side).

Called after each detokenization step with the whole output text so far and how many
characters the step appended. A stop string may span token boundaries, so matches are
looked for in the last (num_new + longest stop - 1) characters. The request stops at the
stop string that completes first (earliest end; on a tie, the longest); the text is cut
before it, or after it with include_stop_str_in_output.

Streaming: while no stop string has matched, a tail of the text that is a prefix of a
stop string might turn out to be one, so it is held back; `stream_end` says how much
text is safe to send. With include_stop_str_in_output nothing needs holding back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(slots=True, frozen=True)
class StopCheck:
    stop: str | None   # the stop string that matched, or None
    text_end: int      # the output text is text[:text_end] (len(text) when no match)
    stream_end: int    # text[:stream_end] may be streamed now (== text_end on a match)


def check_stop_strings(text: str, num_new_chars: int, stops: Sequence[str],
                       include_stop_str_in_output: bool = False) -> StopCheck:
    """Look for stop strings ending within the last num_new_chars characters of text."""
    if not stops:
        return StopCheck(None, len(text), len(text))
    longest = max(len(s) for s in stops)
    start = max(0, len(text) - num_new_chars - longest + 1)
    best: tuple[int, int, str] | None = None          # (end, -len, stop)
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
            best = (i + len(s), -len(s), s)
    if best is not None:
        end, neg_len, s = best
        cut = end if include_stop_str_in_output else end + neg_len
        return StopCheck(s, cut, cut)
    if include_stop_str_in_output:
        return StopCheck(None, len(text), len(text))
    return StopCheck(None, len(text), len(text) - _partial_stop_len(text, stops))


def _partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string.

    Such a suffix starts with the stop string's first character, so only those positions
    of the tail are tried (str.find jumps between them in C), longest first, and the
    first match wins. The old loop tried every length (one endswith each: quadratic
    characters per token); typical text has few candidate positions. The worst case
    (a tail full of the first character) is bounded by --max-stop-string-chars."""
    best = 0
    for s in stops:
        m = min(len(s) - 1, len(text))     # longest possible partial match
        if m <= best:
            continue
        tail = text[len(text) - m:]
        first, last = s[0], tail[-1]
        # Starting at i gives a match of length m - i; only i < m - best beats best.
        i = tail.find(first, 0, m - best)
        while i >= 0:
            if s[m - i - 1] == last and s.startswith(tail[i:]):
                best = m - i
                break
            i = tail.find(first, i + 1, m - best)
    return best
