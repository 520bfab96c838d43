"""The output builder both the engine and the cluster router hand their callers' outputs from:
everything so far, plus exactly what is new since the last output."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.output_builder import build_output, take_completion
from engine.outputs import RequestMetrics, TokenLogprob


@dataclass
class _Choice:
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text_len: int = 0


def test_each_output_reports_what_is_new_once_and_moves_the_cursors():
    c = _Choice([5, 6], logprobs=[TokenLogprob(5, -0.1), TokenLogprob(6, -0.2)])
    first = take_completion(0, c, "ab")
    assert (first.text, first.new_text, first.new_token_ids) == ("ab", "ab", [5, 6])
    assert [lp.token_id for lp in first.new_logprobs] == [5, 6]
    assert (c.sent_tokens, c.sent_text_len) == (2, 2)
    c.output_token_ids.append(7)
    c.logprobs.append(TokenLogprob(7, -0.3))
    second = take_completion(0, c, "abc")
    assert (second.new_text, second.new_token_ids) == ("c", [7])
    assert [lp.token_id for lp in second.new_logprobs] == [7]
    assert second.token_ids == [5, 6, 7] and second.token_ids is not c.output_token_ids
    nothing = take_completion(0, c, "abc")
    assert (nothing.new_text, nothing.new_token_ids, nothing.new_logprobs) == ("", [], [])


def test_a_held_back_tail_is_shown_later_and_what_was_shown_is_never_taken_back():
    c = _Choice([1, 2])
    held = take_completion(0, c, "hello ST", visible=6)  # "ST" may begin a stop string
    assert (held.text, held.new_text, c.sent_text_len) == ("hello ", "hello ", 6)
    later = take_completion(0, c, "hello STOP", visible=3)  # less than shown: keeps what was
    assert (later.text, later.new_text) == ("hello ", "")
    c.finish_reason = "stop"
    done = take_completion(0, c, "hello STOP")
    assert (done.text, done.new_text, done.finish_reason) == ("hello STOP", "STOP", "stop")


def test_build_output_numbers_the_choices_and_carries_the_request():
    a, b = _Choice([1]), _Choice([2, 3], finish_reason="length")
    metrics = RequestMetrics(arrival_time=1.0)
    out = build_output("r", "p", [9, 9], [(a, "x", None), (b, "yz", 1)], False, metrics)
    assert (out.request_id, out.prompt, out.prompt_token_ids, out.finished) == (
        "r",
        "p",
        [9, 9],
        False,
    )
    assert [(o.index, o.text, o.finish_reason) for o in out.outputs] == [
        (0, "x", None),
        (1, "y", "length"),
    ]
    assert out.metrics is metrics and out.prompt_logprobs is None
