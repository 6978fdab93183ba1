"""Incremental stop-string checks: spans across tokens, include/exclude, streaming hold-back."""
from __future__ import annotations

from jaxserve.frontend.stop_strings import StopCheck, check_stop_strings


def feed(pieces: list[str], stops: list[str], include: bool = False):
    """Feed detokenized pieces one at a time like the engine; return the final check,
    the text and what was streamed."""
    text, streamed = "", ""
    for piece in pieces:
        text += piece
        chk = check_stop_strings(text, len(piece), stops, include)
        streamed += text[len(streamed):chk.stream_end]
        if chk.stop is not None:
            return chk, text[:chk.text_end], streamed
    return chk, text, streamed


def test_stop_string_spanning_tokens_is_cut():
    chk, text, streamed = feed(["Hello", " wor", "ld", "!", " more"], ["world!"])
    assert chk.stop == "world!"
    assert text == streamed == "Hello "


def test_include_stop_str_in_output():
    chk, text, streamed = feed(["Hello", " wor", "ld!", " more"], ["world!"], include=True)
    assert text == streamed == "Hello world!"


def test_hold_back_only_a_possible_stop_prefix():
    assert check_stop_strings("abc wo", 3, ["world"]) == StopCheck(None, 6, 4)
    assert check_stop_strings("abc wx", 3, ["world"]) == StopCheck(None, 6, 6)
    assert check_stop_strings("abc wo", 3, ["world"], True) == StopCheck(None, 6, 6)
    chk, text, streamed = feed(["x", "w", "o", "r", "x", "y"], ["world"])
    assert chk.stop is None and streamed == text == "xworxy"


def test_earliest_completed_stop_wins():
    assert check_stop_strings("say abcd", 8, ["bcd", "ab"]).stop == "ab"
    chk = check_stop_strings("say abcd", 8, ["abcd", "bc"])
    assert (chk.stop, chk.text_end) == ("bc", 5)
    chk = check_stop_strings("xxab", 2, ["ab", "xab"], True)
    assert (chk.stop, chk.text_end) == ("xab", 4)     # same end: the longer one


def test_match_only_in_old_text_is_not_found_again():
    # "stop" ended before the new characters and their look-back window.
    assert check_stop_strings("stop and go", 3, ["stop"]).stop is None
    assert check_stop_strings("abc", 1, []) == StopCheck(None, 3, 3)
