"""A real cluster (router in this process, one prefill and one decode worker process, shared
memory transfer, chunked prefill of 64 tokens) against the colocated engine on the default
model: greedy output identical for single, batched, streamed and chunk-prefilled requests, and a
seeded n=2 request with logprobs; the same through the HTTP server; an abort frees KV blocks and
staging on both workers."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from cluster_checks import collect, wait_idle
from engines import make_engine, run_all
from server.serverutil import http_server

from engine.cluster.launcher import Cluster
from engine.cluster.router.router import RouterConfig
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, logprobs=3, max_tokens=8)
WORKER_ARGS = ["--kv-cache-memory-gb", "0.25", "--max-num-batched-tokens", "64",
               "--kv-staging-mb", "128", "--dtype", "float32"]  # fmt: skip


def prompts():
    return [
        list(range(1000, 1000 + 150)),  # chunk-prefilled: 64 + 64 + 22
        list(range(2000, 2000 + 40)),
        list(range(3000, 3000 + 17)),
    ]


@pytest.fixture(scope="module")
def cluster():
    with Cluster(1, 1, worker_args=WORKER_ARGS, router_config=RouterConfig()) as c:
        yield c


@pytest.fixture(scope="module")
def reference():
    engine = make_engine(max_tokens=64)
    greedy = [o.outputs[0].token_ids for o in run_all(engine, prompts(), GREEDY)]
    seeded = run_all(engine, prompts()[:1], SEEDED)[0]
    return greedy, seeded


def test_single_batched_streamed_chunked_equal_colocated(cluster, reference):
    greedy, _ = reference

    async def main():
        single, deltas = await collect(cluster.router, prompts()[0], GREEDY)
        batched = await asyncio.gather(*(collect(cluster.router, p, GREEDY) for p in prompts()))
        return single, deltas, batched

    single, deltas, batched = asyncio.run(main())
    assert single.outputs[0].token_ids == greedy[0]
    assert single.outputs[0].finish_reason == "length"
    # Streamed: the first delta is the prefill worker's first token alone; deltas add up.
    assert deltas[0] == [greedy[0][:1]]
    assert [t for d in deltas for t in d[0]] == greedy[0]
    assert [b[0].outputs[0].token_ids for b in batched] == greedy
    assert single.metrics.first_token_time is not None
    # One host: the prefill worker proved it reads the decode worker's arena, so every transfer
    # went through shared memory (shm_pairs.py), none over TCP.
    status = cluster.router.workers_status()["prefill-0"]
    assert status["shm_peers"] == ["decode-0"]
    assert set(status["kv_transports"]) == {"shm"}, status


def test_seeded_n2_logprobs_equal_colocated(cluster, reference):
    _, seeded = reference
    out, _ = asyncio.run(collect(cluster.router, prompts()[0], SEEDED))
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in seeded.outputs]
    assert [c.text for c in out.outputs] == [c.text for c in seeded.outputs]
    for a, b in zip(out.outputs, seeded.outputs):
        assert [lp.token_id for lp in a.logprobs] == [lp.token_id for lp in b.logprobs]
        assert [sorted(lp.top) for lp in a.logprobs] == [sorted(lp.top) for lp in b.logprobs]
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)


def test_http_equal_colocated(cluster, reference):
    greedy, _ = reference
    body = {"model": "default", "prompt": prompts()[0], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    with http_server(cluster.router) as srv, httpx.Client(base_url=srv.url, timeout=120) as h:
        r = h.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        pieces = []
        with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    pieces += [c["text"] for c in json.loads(line[6:])["choices"]]
        assert h.get("/health").status_code == 200
        assert "engine:generation_tokens_total" in h.get("/metrics").text
    engine = make_engine()
    assert text == engine.tokenizer.decode(greedy[0])
    assert "".join(pieces) == text


def test_http_echo_logprobs_refused_by_name_echo_alone_served(cluster):
    """The workers do not send prompt logprobs back yet: echo with logprobs is a 400 naming
    echo (what the client sent); echo without them, max_tokens 0 included, is served."""
    body = {"model": "default", "prompt": "The capital of France is", "echo": True}
    with http_server(cluster.router) as srv, httpx.Client(base_url=srv.url, timeout=120) as h:
        r = h.post("/v1/completions", json=body | {"max_tokens": 1, "logprobs": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
        assert "cluster router" in r.json()["error"]["message"]
        r = h.post("/v1/completions", json=body | {"max_tokens": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == body["prompt"]
        assert r.json()["usage"]["completion_tokens"] == 0


def test_abort_frees_kv_on_both_sides(cluster):
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main():
        gen = cluster.router.generate(prompts()[0], long, request_id="to-abort")
        n = 0
        async for out in gen:
            n += len(out.outputs[0].new_token_ids)
            if n >= 3:
                break  # the decode worker is running it now
        await gen.aclose()  # closing the stream aborts the request
        return n

    assert asyncio.run(main()) >= 3
    wait_idle(cluster)
    st = cluster.router.workers_status()
    assert all(v["state"] == "up" for v in st.values())


def test_block_events_reach_router(cluster):
    from engine.kvcache.prefix_hash import hash_blocks

    asyncio.run(collect(cluster.router, prompts()[1], GREEDY))
    chain = hash_blocks(prompts()[1], 16)  # 40 tokens: 2 full blocks
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        held = {w: cluster.router.prefix_blocks(w, chain) for w in ("prefill-0", "decode-0")}
        if held == {"prefill-0": 2, "decode-0": 2}:
            break
        time.sleep(0.1)
    # The prefill worker computed the blocks; the decode worker loaded them into its cache.
    assert held == {"prefill-0": 2, "decode-0": 2}
