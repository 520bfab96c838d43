"""The two clients of the serving benchmark (engine/bench/serve.py), each sending one request
and timing its stream into a ``RequestResult``: ``OpenAIBackend`` streams /v1/completions over
HTTP (prompts sent as token ids, so input lengths are exact), ``EmbeddedBackend`` drives
``AsyncLLM.generate`` in this process. Both read the prefix cache's counters, so that a run can
report its hit rate."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from engine.bench.datasets import BenchRequest


@dataclass
class RequestResult:
    ok: bool = False
    input_len: int = 0
    output_len: int = 0
    start_s: float = 0.0  # since the benchmark began
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


class OpenAIBackend:
    name = "http"

    def __init__(self, base_url: str, model: str, ignore_eos: bool, temperature: float, n: int):
        limits = httpx.Limits(max_connections=max(n, 1), max_keepalive_connections=max(n, 1))
        self.client = httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits)
        self.model, self.ignore_eos, self.temperature = model, ignore_eos, temperature

    async def request(self, req: BenchRequest, res: RequestResult) -> None:
        body = {
            "model": self.model,
            "prompt": req.prompt,
            "max_tokens": req.output_len,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        last = t0
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return
                if chunk.get("usage"):
                    res.output_len = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2el = time.perf_counter() - t0
        res.ok = True

    async def prefix_counters(self) -> tuple[float, float]:
        text = (await self.client.get("/metrics")).text
        values = {}
        for line in text.splitlines():
            for key in ("engine:prefix_cache_queries_total", "engine:prefix_cache_hits_total"):
                if line.startswith(key + "{"):
                    values[key] = values.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return (
            values.get("engine:prefix_cache_queries_total", 0.0),
            values.get("engine:prefix_cache_hits_total", 0.0),
        )

    async def close(self) -> None:
        await self.client.aclose()


class EmbeddedBackend:
    name = "embedded"

    def __init__(self, llm, ignore_eos: bool, temperature: float):
        self.llm, self.ignore_eos, self.temperature = llm, ignore_eos, temperature

    async def request(self, req: BenchRequest, res: RequestResult) -> None:
        from engine.sampling_params import SamplingParams

        params = SamplingParams(
            max_tokens=req.output_len, temperature=self.temperature, ignore_eos=self.ignore_eos
        )
        t0 = time.perf_counter()
        last = t0
        out = None
        async for out in self.llm.generate(req.prompt, params):
            if out.outputs[0].new_token_ids:
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
        res.e2el = time.perf_counter() - t0
        res.output_len = len(out.outputs[0].token_ids) if out else 0
        res.ok = True

    async def prefix_counters(self) -> tuple[float, float]:
        m = self.llm.metrics()
        return float(m.prefix_queries), float(m.prefix_hits)

    async def close(self) -> None:
        pass
