"""Speculative decoding behind the servers: an engine with ``ngram`` drafts answers the OpenAI
client (plain, streamed, with logprobs) and the RPC client exactly as the session's engine
without drafts does, and /metrics reports its draft counters."""

from __future__ import annotations

import httpx
import openai
import pytest
from cluster_checks import key, samples
from serverutil import MAX_MODEL_LEN, MODEL, RPCThread, http_server, wait_idle

from engine.client import RPCClient
from engine.sampling_params import SamplingParams

COPY = [
    {
        "role": "user",
        "content": "Copy this text exactly: The Mooncake architecture separates prefill and "
        "decode clusters, and it keeps the KVCache in a distributed pool of DRAM and SSD.",
    }
]


@pytest.fixture(scope="module")
def spec_llm():
    from engine.async_llm import AsyncLLM
    from engine.config import CacheConfig, EngineConfig, SpeculativeConfig

    engine = AsyncLLM(
        config=EngineConfig(
            model=MODEL,
            max_model_len=MAX_MODEL_LEN,
            cache=CacheConfig(kv_cache_memory_gb=0.25),
            speculative=SpeculativeConfig(method="ngram"),
        )
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def servers(spec_llm, server):
    with http_server(spec_llm) as spec_server:
        yield spec_server, server


def chat(url: str, stream: bool = False):
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model=MODEL, messages=COPY, max_tokens=40, temperature=0, logprobs=True)
    if not stream:
        r = c.chat.completions.create(**kw, top_logprobs=2)
        ch = r.choices[0]
        return ch.message.content, ch.finish_reason, [t.logprob for t in ch.logprobs.content]
    parts = list(c.chat.completions.create(**kw, stream=True))
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    return text, [p.choices[0].finish_reason for p in parts if p.choices][-1]


def test_openai_answers_equal_those_without_drafts(servers, spec_llm):
    spec_server, plain_server = servers
    want = chat(plain_server.url)
    assert chat(spec_server.url) == want
    assert chat(spec_server.url, stream=True) == want[:2]
    assert spec_llm.metrics().spec["accepted"] > 0
    wait_idle(spec_llm)


def test_metrics_report_drafts(servers):
    spec_server, _ = servers
    chat(spec_server.url)
    s = samples(httpx.get(spec_server.url + "/metrics", timeout=30).text)
    proposed = s[key("engine:spec_decode_num_draft_tokens_total")]
    accepted = s[key("engine:spec_decode_num_accepted_tokens_total")]
    drafts = s[key("engine:spec_decode_num_drafts_total")]
    assert proposed >= accepted > 0 and drafts > 0
    assert s[key("engine:spec_decode_mean_accepted_length")] == pytest.approx(1 + accepted / drafts)
    assert s[key("engine:spec_decode_num_accepted_tokens_per_pos_total", position="0")] > 0


def test_rpc_answers_equal_those_without_drafts(spec_llm, llm):
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=11, logprobs=1)
    prompt = "Repeat after me: one two three four, one two three four, one two three four"
    with RPCThread(spec_llm) as spec_rpc, RPCThread(llm) as plain_rpc:
        with RPCClient(spec_rpc.address, timeout=120) as a, RPCClient(plain_rpc.address) as b:
            got, want = a.generate(prompt, params), b.generate(prompt, params)
            streamed = [t for d in a.stream(prompt, params) for t in d.outputs[0].token_ids]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids == streamed
    assert [lp.logprob for lp in got.outputs[0].logprobs] == [
        lp.logprob for lp in want.outputs[0].logprobs
    ]
