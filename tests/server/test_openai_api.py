"""The official ``openai`` client against the running HTTP server: chat, completions, streams,
the parameters we claim, and errors in OpenAI's shape."""

from __future__ import annotations

import threading
import time

import openai
import pytest
from serverutil import MAX_MODEL_LEN, MODEL, http_server, wait_idle

from engine import cpu_isa

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "Paris" in choice.message.content


def test_completion_greedy_is_deterministic(client):
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert a.choices[0].text == b.choices[0].text and a.choices[0].text
    assert a.usage.completion_tokens == 6 and a.choices[0].finish_reason == "length"


def test_completion_stream_with_usage(client):
    stream = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    full = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0
    )
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


def test_chat_stream(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=6, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_n_seed_and_stop(client):
    kwargs = dict(model=MODEL, prompt="List some fruits:", max_tokens=8, temperature=1.0, n=3)
    a = client.completions.create(seed=7, **kwargs)
    b = client.completions.create(seed=7, **kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    stopped = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=["7"]
    )
    assert "7" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


def test_prompt_list_and_token_ids(client, http):
    ids = http.post("/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    r = client.completions.create(
        model=MODEL, prompt=["Hello there", "Hello there"], max_tokens=3, temperature=0
    )
    assert len(r.choices) == 2 and r.choices[0].text == r.choices[1].text
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text


def test_logprobs(client):
    r = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) >= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob


def test_models_health_tokenize(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert http.get("/health").status_code == 200
    tok = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    text = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.endswith("Hello world")
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > tok["count"]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_tokens=MAX_MODEL_LEN + 5), "max_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(logprobs=99), "logprobs"),
        (dict(prompt="word " * (MAX_MODEL_LEN + 10)), "prompt"),
        (dict(prompt=[]), "prompt"),
        (dict(prompt=[10**9]), "prompt"),
        (dict(extra_body={"max_tokens": "3"}), "max_tokens"),
        (dict(extra_body={"temperature": True}), "temperature"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_request_names_the_param(client, kwargs, param):
    body = dict(model=MODEL, prompt="Hi", max_tokens=2) | kwargs
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**body)
    err = info.value
    assert err.status_code == 400
    assert err.body["param"] == param, err.body
    assert err.body["type"] == "BadRequestError" and err.body["code"] == 400
    assert param in err.body["message"] or param == "prompt"


def test_bad_chat_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "wizard", "content": "x"}], max_tokens=2
        )
    assert info.value.body["param"] == "messages"
    long = [{"role": "user", "content": "word " * MAX_MODEL_LEN}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=long, max_tokens=2)
    assert info.value.body["param"] == "messages"
    assert str(MAX_MODEL_LEN) in info.value.body["message"]


def _broken_job(self, req):
    raise ValueError("temperature must be a bug")  # reads like bad input; it is a bug


def _broken_validate(ids, params):
    raise TypeError("unsupported operand type(s)")


@pytest.mark.parametrize("where", ["serving", "engine"])
def test_a_bug_is_a_500_and_the_server_keeps_serving(http, llm, monkeypatch, where):
    """A ValueError or TypeError that no input check raised is the server's fault: a 500 that
    names no field and repeats nothing of the exception, never a 400."""
    from engine.server.openai_serving import OpenAIServing

    if where == "serving":
        monkeypatch.setattr(OpenAIServing, "completion_job", _broken_job)
    else:
        monkeypatch.setattr(llm.engine, "validate", _broken_validate)
    body = {"prompt": "Hi", "max_tokens": 2}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "InternalServerError" and err["param"] is None and err["code"] == 500
    assert "temperature" not in err["message"] and "operand" not in err["message"]
    monkeypatch.undo()
    assert http.post("/v1/completions", json=body).status_code == 200


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    assert info.value.body["param"] == "model" and info.value.body["code"] == 404


def test_invalid_json_and_unknown_route(http):
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "x"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = http.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def test_queue_full_is_429_with_retry_after(client, llm, http):
    """With room for one request in flight, a second one is turned away with Retry-After."""
    saved = llm.max_pending
    llm.max_pending = 1
    try:
        stream = client.completions.create(
            model=MODEL,
            prompt="Count:",
            max_tokens=64,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = next(iter(stream))
        assert first.choices
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "RateLimitError"
        stream.close()
    finally:
        llm.max_pending = saved
    wait_idle(llm)
    metrics = http.get("/metrics").text
    assert 'engine:request_rejected_total{model_name="default",reason="queue_full"} 1.0' in metrics


def test_api_key(llm):
    with http_server(llm, api_key="s3cret") as s:
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices
        import httpx

        assert httpx.get(s.url + "/health").status_code == 200  # /health needs no key
        assert httpx.get(s.url + "/metrics").status_code == 401


def test_metrics_names(client, http):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    text = http.get("/metrics").text
    for name in (
        "engine:time_to_first_token_seconds_bucket",
        "engine:inter_token_latency_seconds_bucket",
        "engine:e2e_request_latency_seconds_count",
        "engine:num_requests_running",
        "engine:num_requests_waiting",
        "engine:kv_cache_usage_perc",
        "engine:prefix_cache_queries_total",
        "engine:prefix_cache_hits_total",
        "engine:num_preemptions_total",
        "engine:generation_tokens_total",
        "engine:request_success_total",
        "engine:request_rejected_total",
        "engine:cpu_isa_info",
    ):
        assert name in text, name
    assert 'model_name="default"' in text
    assert f'level="{cpu_isa.this_cpu().level}"' in text  # engine/cpu_isa.py, under its cap


def test_non_streaming_disconnect_aborts(server, llm):
    """A client that gives up on a non-streamed request frees its KV too."""
    import httpx

    def go() -> None:
        body = {"prompt": "Count:", "max_tokens": 400, "ignore_eos": True}
        try:
            httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
        except httpx.TimeoutException:
            pass

    t = threading.Thread(target=go)
    t.start()
    t.join()
    time.sleep(0.2)
    wait_idle(llm)
    assert llm.metrics().finished.get("abort", 0) >= 1


def test_more_prompts_than_ever_admitted_is_400(http, llm):
    """A request that could never be admitted is a 400 (not a 429 that clients retry forever)."""
    saved = llm.max_pending
    llm.max_pending = 4
    try:
        r = http.post(
            "/v1/completions", json={"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 2}
        )
    finally:
        llm.max_pending = saved
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "4" in r.json()["error"]["message"]


_USER = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    "path, extra, param",
    [
        ("chat", {"functions": [{"name": "f"}]}, "functions"),
        ("chat", {"function_call": "auto"}, "function_call"),
        ("chat", {"tool_choice": "auto"}, "tool_choice"),
        ("chat", {"grammar": "root ::= x"}, "grammar"),
        ("chat", {"json_schema": {}}, "json_schema"),
        ("chat", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("completions", {"prompt_logprobs": "1"}, "prompt_logprobs"),
        ("chat", {"echo": True}, "echo"),
        ("chat", {"chat_template": "{{ messages }}"}, "chat_template"),
        ("chat", {"continue_final_message": True}, "continue_final_message"),
        ("chat", {"response_format": {}}, "response_format"),
        ("chat", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
        ("completions", {"guided_regex": "a", "guided_json": {}}, "guided_json"),
        ("chat", {"logit_bias": {"1": 1.0}}, "logit_bias"),
        ("chat", {"best_of": 3}, "best_of"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        (
            "chat",
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
            "messages",
        ),
        ("completions", {"tools": [{"type": "function"}]}, "tools"),
        ("completions", {"suffix": "x"}, "suffix"),
        ("completions", {"max_tokens": 0}, "max_tokens"),
        ("completions", {"temperature": 1e39, "min_tokens": 2}, "temperature"),
        ("completions", {"repetition_penalty": 1e39}, "repetition_penalty"),
    ],
)
def test_unsupported_options_are_400_naming_them(http, path, extra, param):
    """Never a silent 200 that ignored what was asked; the error names the field."""
    if path == "chat":
        url, body = "/v1/chat/completions", {"messages": _USER, "max_tokens": 2}
    else:
        url, body = "/v1/completions", {"prompt": "Hi", "max_tokens": 2}
    r = http.post(url, json=body | extra)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "BadRequestError"


def test_no_op_values_of_unsupported_options_are_accepted(http):
    body = {"messages": _USER, "max_tokens": 2, "tools": [], "tool_choice": "none"}
    body |= {"response_format": {"type": "text"}, "parallel_tool_calls": None}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def _check_prompt_logprobs(plp, num_tokens: int, k: int) -> None:
    """vLLM's shape: None for the first prompt token, then {token id: {logprob, rank,
    decoded_token}} holding the prompt's token and the top k."""
    assert len(plp) == num_tokens and plp[0] is None
    for entry in plp[1:]:
        assert k <= len(entry) <= k + 1
        ranks = sorted(v["rank"] for v in entry.values())
        assert ranks[:k] == list(range(1, k + 1))
        for token_id, v in entry.items():
            assert token_id.isdigit() and v["logprob"] <= 0.0
            assert isinstance(v["decoded_token"], str)


def test_prompt_logprobs_completions_per_choice(http):
    body = {"prompt": ["The capital of France is", "One, two,"], "max_tokens": 2}
    r = http.post("/v1/completions", json=body | {"prompt_logprobs": 2, "n": 2, "seed": 1})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["choices"]) == 4
    lengths = [http.post("/tokenize", json={"prompt": p}).json()["count"] for p in body["prompt"]]
    for choice in out["choices"]:
        _check_prompt_logprobs(choice["prompt_logprobs"], lengths[choice["index"] // 2], 2)
    assert "prompt_logprobs" not in http.post("/v1/completions", json=body).json()["choices"][0]


def test_prompt_logprobs_chat_on_the_response(http):
    body = {"messages": _USER, "max_tokens": 2, "prompt_logprobs": 0}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    _check_prompt_logprobs(out["prompt_logprobs"], out["usage"]["prompt_tokens"], 0)
    assert "prompt_logprobs" not in out["choices"][0]


def test_logprob_bytes_rebuild_multibyte_text(llm):
    """Byte-level tokens of multi-byte characters: their ``bytes`` join to the text (not to
    U+FFFD), and completions' text_offset counts characters (two emoji: offsets in [0, 1])."""
    from engine.outputs import TokenLogprob
    from engine.sampling_params import SamplingParams
    from engine.server.completion_logprobs import TextCursor, generated_logprobs
    from engine.server.openai_serving import Job, OpenAIServing

    serving = OpenAIServing(llm, [MODEL])
    text = "😀😀 é"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in serving.text.str(t) for t in ids)  # the case that was lossy
    lps = [TokenLogprob(t, -0.5, {t: -0.5}) for t in ids]

    chat = Job(True, "id", MODEL, [[1]], SamplingParams(), False, top_logprobs=1)
    content = serving._chat_logprobs(chat, lps)["content"]
    assert b"".join(bytes(c["bytes"]) for c in content).decode() == text
    assert b"".join(bytes(c["top_logprobs"][0]["bytes"]) for c in content).decode() == text
    offsets = generated_logprobs(serving.text, lps, 1, TextCursor())["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(text)
    first_emoji = [o for t, o in zip(ids, offsets) if o == 0]
    assert 1 < len(first_emoji) < len(ids)  # the emoji's byte tokens all start at 0
