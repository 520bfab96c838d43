"""The chaos oracle (oracle.py) on the answers the issue's failing runs served: an empty text
where the clean run answered, and prompt 0 answered with prompt 6's clean answer. Both are wrong
answers by a wide logit gap, not float32 near-ties; a served text equal to the reference up to
a point and then another token is judged at that token."""

from __future__ import annotations

import pytest
from chaos_harness import PREFIX, QUESTIONS
from oracle import NEAR_TIE, classify

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("default", dtype="float32", max_model_len=1024, kv_cache_memory_gb=0.2)


def _reference(llm, i: int) -> str:
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    return llm.generate([PREFIX + QUESTIONS[i]], sp)[0].outputs[0].text


def test_the_issues_mismatches_are_wrong_answers(llm):
    ref0, ref6 = _reference(llm, 0), _reference(llm, 6)
    assert ref0 != ref6
    for served in ("", ref6):  # an empty answer; another prompt's answer
        kind, why = classify(llm, PREFIX + QUESTIONS[0], ref0, served)
        assert kind == "wrong", why
        gap = float(why.rsplit("logit gap ", 1)[1])
        assert abs(gap) > 100 * NEAR_TIE


def test_a_token_changed_part_way_is_judged_where_the_texts_part(llm):
    ref = _reference(llm, 6)
    kind, why = classify(llm, PREFIX + QUESTIONS[6], ref, ref[:-1] + "x")
    assert kind == "wrong" and why.startswith("token "), why
    assert int(why.split()[1].rstrip(":")) >= 1  # not at the first token: where they part


def test_a_deterministic_cluster_has_no_near_ties(llm):
    # exact: the same served text is wrong whatever its gap, and the reason says why
    ref = _reference(llm, 6)
    kind, why = classify(llm, PREFIX + QUESTIONS[6], ref, ref[:-1] + "x", exact=True)
    assert kind == "wrong" and why.endswith("(deterministic: any difference is wrong)"), why
