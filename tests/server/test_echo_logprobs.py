"""Completions with ``echo`` and ``logprobs`` (what lm-eval's local-completions model sends): the
prompt's tokens and their logprobs first, in OpenAI's legacy shape, then the generated ones;
``max_tokens: 0`` with echo; streamed; prompts as text, token ids, or lists of either."""

from __future__ import annotations

import json

import openai
import pytest
from serverutil import MODEL

PROMPT = "The capital of France is"
GREEDY = {"model": MODEL, "temperature": 0, "ignore_eos": True}
KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def complete(http, **body) -> dict:
    r = http.post("/v1/completions", json=GREEDY | body)
    assert r.status_code == 200, r.text
    return r.json()


def tokenize(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def check_shape(choice: dict, k: int) -> None:
    """Four lists of one length; the first token's logprobs null; each top map holds the top k
    and the token itself; each token stands at its text_offset in the choice's text."""
    lp, text = choice["logprobs"], choice["text"]
    assert len({len(lp[key]) for key in KEYS}) == 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for token, value, top, offset in zip(*(lp[key] for key in KEYS)):
        if value is None:
            continue
        assert k <= len(top) <= k + 1 and top[token] == value <= 0.0
        assert text.startswith(token, offset)
    assert lp["text_offset"] == sorted(lp["text_offset"])


def test_echo_logprobs_are_the_prompt_then_the_generated_tokens(http):
    ids = tokenize(http, PROMPT)
    plain = complete(http, prompt=PROMPT, max_tokens=3, logprobs=2)["choices"][0]
    out = complete(http, prompt=PROMPT, max_tokens=3, logprobs=2, echo=True, prompt_logprobs=1)
    choice = out["choices"][0]
    assert choice["text"] == PROMPT + plain["text"]
    check_shape(choice, 2)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3 == out["usage"]["total_tokens"]
    # The generated part is what the same request without echo reports.
    assert {key: lp[key][len(ids) :] for key in KEYS} == {
        key: [o + len(PROMPT) for o in plain["logprobs"][key]]
        if key == "text_offset"
        else plain["logprobs"][key]
        for key in KEYS
    }
    # The prompt part is vLLM's prompt_logprobs of the same tokens (asked for with 1
    # alternative while echo asked for 2: each shape keeps its own count).
    vllm = choice["prompt_logprobs"]
    for i, token_id in enumerate(ids[1:], start=1):
        assert lp["token_logprobs"][i] == vllm[i][str(token_id)]["logprob"]
        assert 1 <= len(vllm[i]) <= 2


def test_echoed_logprobs_equal_those_of_the_same_tokens_generated(http):
    """Off by one, the echoed prompt would pair each token with its neighbour's logprob."""
    plain = complete(http, prompt=PROMPT, max_tokens=4, logprobs=0)["choices"][0]
    pieces = [tokenize(http, t) for t in plain["logprobs"]["tokens"]]  # each one token
    assert all(len(p) == 1 for p in pieces)
    generated = tokenize(http, PROMPT) + [p[0] for p in pieces]
    echoed = complete(http, prompt=generated, max_tokens=0, echo=True, logprobs=0)
    lp = echoed["choices"][0]["logprobs"]
    assert lp["tokens"][-4:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][-4:] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=0.1)


@pytest.mark.parametrize(
    "prompt",
    [PROMPT, [PROMPT, "One, two,"], "ids", "id lists"],
    ids=["text", "texts", "ids", "id-lists"],
)
def test_max_tokens_0_with_echo_is_the_prompt_alone(http, prompt):
    texts = [PROMPT, "One, two,"]
    if prompt == "ids":
        prompt, texts = tokenize(http, PROMPT), [PROMPT]
    elif prompt == "id lists":
        prompt = [tokenize(http, t) for t in texts]
    elif isinstance(prompt, str):
        texts = [prompt]
    out = complete(http, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert [c["text"] for c in out["choices"]] == texts
    for choice, text in zip(out["choices"], texts):
        assert choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == len(tokenize(http, text))
        check_shape(choice, 1)
    prompt_tokens = sum(len(tokenize(http, t)) for t in texts)
    assert out["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 0,
        "total_tokens": prompt_tokens,
        "prompt_tokens_details": out["usage"]["prompt_tokens_details"],
    }
    without_logprobs = complete(http, prompt=prompt, max_tokens=0, echo=True)
    assert [c["text"] for c in without_logprobs["choices"]] == texts


def test_max_tokens_0_without_echo_is_a_400_naming_it(http):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens" and "echo" in r.json()["error"]["message"]


def streamed(http, body: dict) -> tuple[dict[int, str], dict[int, dict], list]:
    texts: dict[int, str] = {}
    lps: dict[int, dict] = {}
    reasons = []
    with http.stream("POST", "/v1/completions", json=GREEDY | body | {"stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                into = lps.setdefault(c["index"], {key: [] for key in KEYS})
                for key in KEYS:
                    into[key] += c["logprobs"][key]
                reasons.append(c["finish_reason"])
    return texts, lps, reasons


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_streamed_echo_logprobs_add_up_to_the_whole_response(http, max_tokens):
    body = {"prompt": [PROMPT, "One, two,"], "max_tokens": max_tokens, "echo": True, "logprobs": 1}
    whole = complete(http, **body)["choices"]
    texts, lps, reasons = streamed(http, body)
    assert texts == {c["index"]: c["text"] for c in whole}
    assert lps == {c["index"]: c["logprobs"] for c in whole}
    assert [r for r in reasons if r] == ["length", "length"]


def test_openai_client_reads_echo_logprobs(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text == PROMPT and r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:]) and lp.text_offset[0] == 0


def test_tokenizer_info_spells_the_special_tokens(http):
    """vLLM's /tokenizer_info: lm-eval's remote tokenizer reads the EOS from it and encodes it
    through /tokenize, where it must be one token."""
    info = http.get("/tokenizer_info").json()
    assert info["model_max_length"] > 0 and info["chat_template"]
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert len(eos.json()["tokens"]) == 1
