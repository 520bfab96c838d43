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


@pytest.fixture(scope="module")
def tiny_llm():
    from tiny_models import tiny_model

    config = EngineConfig(
        model=str(tiny_model("llama")), dtype="float32", device="cpu",
        cache=CacheConfig(num_blocks=64),
    )  # fmt: skip
    llm = AsyncLLM(config=config)
    yield llm
    llm.close()


def test_a_request_aborted_twice_still_ends_on_its_final_abort_output(tiny_llm):
    """The second abort finds the request ended, its final output pending: the caller gets that
    output (finish_reason "abort"), not a stream that stops without a final output (before the
    fix the second abort closed the stream and the pending final output was dropped)."""
    from engine.async_llm import AbortRequest

    llm = tiny_llm

    async def main():
        params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
        gen = llm.generate([5, 6, 7, 8], params, request_id="twice")
        outs = [await anext(gen)]
        with llm._cv:  # both before the loop applies either: the second meets a pending output
            llm._commands += [AbortRequest("twice"), AbortRequest("twice")]
            llm._cv.notify()
        outs += [out async for out in gen]
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert llm.num_in_flight == 0


def test_a_stream_the_engine_lost_raises_instead_of_ending_quietly(tiny_llm):
    """A request the engine has no trace of (nothing pending for it either) ends its caller's
    stream with IncompleteRequestError, a 503 for the servers, not an ending without a final
    output that reads as a whole answer."""
    from engine.async_llm import IncompleteRequestError

    llm = tiny_llm

    async def main():
        params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
        gen = llm.generate([5, 6, 7, 8], params, request_id="lost")
        await anext(gen)
        real = llm.engine.abort_request
        llm.engine.abort_request = lambda rid: False  # as if the engine had forgotten it
        try:
            await llm.abort("lost")
            with pytest.raises(IncompleteRequestError, match="without its final output"):
                async for _ in gen:
                    pass
        finally:
            llm.engine.abort_request = real
            real("lost")

    asyncio.run(main())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failed_step_fails_every_caller_with_engine_dead():
    """The engine loop's step raises: the caller streaming gets EngineDeadError naming it
    (a 503 for the servers), not an end that passes for an answer, and so does every later
    request, at once."""
    from tiny_models import tiny_model

    from engine.async_llm import EngineDeadError

    config = EngineConfig(
        model=str(tiny_model("llama")), dtype="float32", device="cpu",
        cache=CacheConfig(num_blocks=64),
    )  # fmt: skip
    llm = AsyncLLM(config=config)
    try:

        async def main():
            params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
            gen = llm.generate([5, 6, 7, 8], params)
            await anext(gen)
            llm.engine.forward.run = _raise  # the next step's forward fails
            with pytest.raises(EngineDeadError, match="boom in the forward"):
                async for _ in gen:
                    pass
            with pytest.raises(EngineDeadError, match="boom in the forward"):
                await anext(llm.generate([5, 6], params))

        asyncio.run(main())
        assert not llm.is_healthy()
    finally:
        llm.close()


def _raise(*args, **kwargs):
    raise RuntimeError("boom in the forward")
