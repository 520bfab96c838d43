"""Stop conditions: EOS, stop ids, max_tokens, stop strings across tokens, streaming holdback."""

from __future__ import annotations

from engine.core.stop_conditions import StopResult, check_stop, find_stop_string, safe_text_len
from engine.sampling_params import SamplingParams

EOS = (2,)


def feed(params, pieces, token_ids=None):
    """Feed text pieces one token at a time; return (token count, result) at the first stop."""
    text = ""
    token_ids = token_ids or [100 + i for i in range(len(pieces))]
    for n, (piece, tok) in enumerate(zip(pieces, token_ids, strict=True), start=1):
        text += piece
        result = check_stop(params, tok, n, EOS, text, len(piece))
        if result.finished:
            return n, result, text
    return len(pieces), result, text


def test_eos_stops_unless_ignored():
    assert check_stop(SamplingParams(), 2, 1, EOS, "a", 0) == StopResult(True, "stop", None, None)
    ignored = check_stop(SamplingParams(ignore_eos=True), 2, 1, EOS, "a", 0)
    assert not ignored.finished


def test_stop_token_ids_report_the_id():
    p = SamplingParams(stop_token_ids=(7, 9), ignore_eos=True)
    assert check_stop(p, 9, 3, EOS, "abc", 1) == StopResult(True, "stop", 9, None)
    assert not check_stop(p, 8, 3, EOS, "abc", 1).finished


def test_max_tokens_is_length_but_stop_wins_on_the_same_token():
    p = SamplingParams(max_tokens=3, stop=("xy",))
    assert check_stop(p, 5, 2, EOS, "ab", 1) == StopResult(False, None, None, None)
    assert check_stop(p, 5, 3, EOS, "abc", 1) == StopResult(True, "length", None, None)
    assert check_stop(p, 2, 3, EOS, "abc", 1).finish_reason == "stop"
    assert check_stop(p, 5, 3, EOS, "abxy", 2) == StopResult(True, "stop", "xy", 2)


def test_stop_string_spanning_tokens_is_trimmed():
    p = SamplingParams(stop=("</end>",))
    n, result, text = feed(p, ["Hello", " wor", "ld<", "/e", "nd>", " more"])
    assert n == 5
    assert result == StopResult(True, "stop", "</end>", len("Hello world"))
    assert text[: result.truncate_to] == "Hello world"


def test_include_stop_str_in_output_keeps_it_and_cuts_after():
    p = SamplingParams(stop=("STOP",), include_stop_str_in_output=True)
    n, result, text = feed(p, ["a S", "TOPtail"])
    assert n == 2 and result.stop_reason == "STOP"
    assert text[: result.truncate_to] == "a STOP"


def test_earliest_stop_string_wins_and_old_text_is_not_searched():
    p = SamplingParams(stop=("bc", "a"))
    assert find_stop_string("xxabc", 3, p.stop) == (2, "a")
    assert find_stop_string("xxabc", 2, p.stop) == (3, "bc")
    assert find_stop_string("abcxx", 1, p.stop) is None  # matches ended before the new char
    assert find_stop_string("abc", 0, p.stop) is None
    assert find_stop_string("xab", 1, ("ab", "b")) == (1, "ab")  # same start: the longer one


def test_min_tokens_suppresses_every_stop_but_length():
    p = SamplingParams(min_tokens=2, max_tokens=5, stop=("z",), stop_token_ids=(9,))
    assert not check_stop(p, 2, 1, EOS, "z", 1).finished
    assert not check_stop(p, 9, 2, EOS, "zz", 1).finished
    assert check_stop(p, 2, 3, EOS, "zz", 0).finished
    # An occurrence completed while min_tokens held is not picked up later.
    assert not check_stop(p, 5, 3, EOS, "zzq", 1).finished
    assert check_stop(p, 5, 3, EOS, "zzz", 1) == StopResult(True, "stop", "z", 2)
    q = SamplingParams(min_tokens=2, max_tokens=2)
    assert check_stop(q, 2, 2, EOS, "ab", 1).finish_reason == "length"


def test_safe_text_len_holds_back_a_possible_stop_prefix():
    stop = ("</end>", "###")
    assert safe_text_len("Hello", stop) == 5
    assert safe_text_len("Hello </e", stop) == len("Hello ")
    assert safe_text_len("Hello <", stop) == len("Hello ")
    assert safe_text_len("x ##", stop) == len("x ")
    assert safe_text_len("x #a", stop) == 4
    assert safe_text_len("", stop) == 0
    assert safe_text_len("</en", ()) == 4
    assert safe_text_len("ab#", ("#x", "b#y")) == 1  # the longest holdback of any stop string
