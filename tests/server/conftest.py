"""Shared fixtures for the server tests: one real engine (the default SmolLM2-135M on CPU) for
the whole session, and an HTTP server in front of it on a free port of 127.0.0.1 per module.

The servers run in this process (uvicorn, and the RPC server's asyncio loop, each on its own
thread), so the model loads once. The SIGTERM tests start real ``engine serve`` processes.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from serverutil import MAX_MODEL_LEN, MODEL, HTTPServer, http_server


@pytest.fixture(scope="session")
def llm():
    from engine.async_llm import AsyncLLM
    from engine.config import CacheConfig, EngineConfig

    engine = AsyncLLM(
        config=EngineConfig(
            model=MODEL, max_model_len=MAX_MODEL_LEN, cache=CacheConfig(kv_cache_memory_gb=0.25)
        )
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(llm) -> Iterator[HTTPServer]:
    with http_server(llm) as s:
        yield s


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
