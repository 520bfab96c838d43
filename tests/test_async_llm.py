"""AsyncLLM builds and steps its engine on one thread, its loop thread: a second thread with an
OpenMP team of its own (the caller's, from loading the weights) made libgomp stop spinning
between parallel regions and cost every GEMV of a step about a quarter of its speed."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import SamplingParams
from engine.async_llm import AsyncLLM
from engine.config import CacheConfig, EngineConfig
from engine.core.llm_engine import LLMEngine


def test_engine_is_built_and_stepped_on_the_loop_thread(monkeypatch):
    seen: dict[str, set[str]] = {"init": set(), "step": set()}
    init, step = LLMEngine.__init__, LLMEngine.step

    def spy_init(self, *a, **k):
        seen["init"].add(threading.current_thread().name)
        init(self, *a, **k)

    def spy_step(self):
        seen["step"].add(threading.current_thread().name)
        return step(self)

    monkeypatch.setattr(LLMEngine, "__init__", spy_init)
    monkeypatch.setattr(LLMEngine, "step", spy_step)
    config = EngineConfig(max_model_len=64, cache=CacheConfig(kv_cache_memory_gb=0.05))
    llm = AsyncLLM(config=config)
    try:

        async def run() -> str:
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            text = ""
            async for out in llm.generate("The capital of France is", params):
                text = out.outputs[0].text
            return text

        assert asyncio.run(run())  # it serves
    finally:
        llm.close()
    assert seen == {"init": {"engine-loop"}, "step": {"engine-loop"}}


def test_a_failed_build_raises_on_the_callers_thread_and_leaves_no_thread():
    before = set(threading.enumerate())  # other tests' engines may have loop threads of their own
    with pytest.raises((FileNotFoundError, ValueError), match="no-such-model"):
        AsyncLLM(config=EngineConfig(model="/no/such/dir/no-such-model.gguf"))
    left = [t for t in threading.enumerate() if t not in before and t.name == "engine-loop"]
    assert not left
