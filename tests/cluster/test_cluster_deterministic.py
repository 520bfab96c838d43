"""Deterministic by default, across placement: requests sent all at once to a real 1 prefill + 1
decode cluster (its workers on one thread each) equal the colocated engine's solo runs of the
same requests (on all of torch's threads), bit for bit: token ids, each token's logprob and its
top logprobs; greedy and seeded, n = 2, a prompt past a 256-token attention chunk. The KV that
the prefill worker computed in one batch, shipped layer by layer and decoded in another batch
gives the bits that one request alone computes; with an int8 KV cache too (its rows and scales
cross as the cache's bytes)."""

from __future__ import annotations

import asyncio

import pytest
from cluster_checks import collect

from engine import LLM
from engine.cluster.launcher import Cluster
from engine.cluster.router.router import RouterConfig
from engine.kernels import native
from engine.sampling_params import SamplingParams

KV_GB = 0.25
ROUTER = RouterConfig(rejection="none")
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    " ".join(f"word{i}" for i in range(150)),  # ~450 tokens: two attention chunks
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
]


def params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.0, logprobs=2, max_tokens=10, ignore_eos=True)
    return SamplingParams(
        temperature=0.9, top_p=0.95, seed=7 + i, n=2 if i == 2 else 1, logprobs=2, max_tokens=10
    )


def signature(out):
    return [
        (c.token_ids, [(lp.token_id, lp.logprob, sorted(lp.top.items())) for lp in c.logprobs])
        for c in out.outputs
    ]


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler: the torch layers serve")
@pytest.mark.parametrize("kv", ["auto", "int8"])  # --kv-cache-dtype: int8 rows cross as bytes
def test_concurrent_cluster_requests_equal_colocated_solo_runs(kv):
    with LLM(device="cpu", kv_cache_memory_gb=KV_GB, kv_cache_dtype=kv) as llm:
        if not llm.engine.model.deterministic:
            pytest.skip("the C layers do not apply on this CPU (no vector row dots)")
        ids = [llm.engine.tokenizer.encode(p) for p in PROMPTS]
        assert len(ids[3]) > 256
        solo = [signature(llm.generate([p], params(i))[0]) for i, p in enumerate(ids)]
        together = [signature(o) for o in llm.generate(ids, [params(i) for i in range(len(ids))])]
    assert together == solo  # colocated under load
    args = ["--kv-cache-memory-gb", str(KV_GB), "--kv-cache-dtype", kv]
    with Cluster(1, 1, worker_args=args, router_config=ROUTER) as c:

        async def main():
            return await asyncio.gather(
                *(collect(c.router, p, params(i)) for i, p in enumerate(ids))
            )

        outs = asyncio.run(main())
    for i, ((out, _), want) in enumerate(zip(outs, solo, strict=True)):
        assert signature(out) == want, f"prompt {i}"
