"""``priority`` on the embedded API (``LLM.generate(..., priority=[...])``, as vLLM's, and
``AsyncLLM.generate(..., priority=)``) on a tiny model: the order requests are served in under
``scheduling_policy="priority"``, and bad values refused naming the field under either policy."""

from __future__ import annotations

import asyncio

import pytest
from tiny_models import tiny_model

from engine import LLM, SamplingParams
from engine.async_llm import AsyncLLM
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.errors import RequestError

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
PROMPTS = ["one two", "three four", "five six", "seven eight"]


def tiny_llm(policy: str) -> LLM:
    return LLM(
        str(tiny_model("llama")),
        dtype="float32",
        device="cpu",
        num_blocks=64,
        max_num_seqs=1,  # one at a time: the order served is the queue's
        scheduling_policy=policy,
    )


@pytest.fixture(scope="module")
def by_priority():
    with tiny_llm("priority") as llm:
        yield llm


@pytest.fixture(scope="module")
def fcfs():
    with tiny_llm("fcfs") as llm:
        yield llm


def served_order(outs) -> list[int]:
    return sorted(range(len(outs)), key=lambda i: outs[i].metrics.first_scheduled_time)


def test_generate_serves_lower_priority_values_first(by_priority):
    outs = by_priority.generate(PROMPTS, PARAMS, priority=[5, -1, 5, 0])
    assert [o.prompt for o in outs] == PROMPTS  # outputs stay in input order
    assert served_order(outs) == [1, 3, 0, 2]  # (priority, arrival)
    same = by_priority.generate(PROMPTS, PARAMS)  # no priority: all 0, arrival order
    assert served_order(same) == [0, 1, 2, 3]
    assert [o.outputs[0].token_ids for o in same] == [o.outputs[0].token_ids for o in outs]


def test_fcfs_takes_all_zeros_and_refuses_anything_else_naming_the_field(fcfs):
    outs = fcfs.generate(PROMPTS, PARAMS, priority=[0, 0, 0, 0])
    assert served_order(outs) == [0, 1, 2, 3]
    with pytest.raises(RequestError, match="priority scheduling is not enabled") as e:
        fcfs.generate(PROMPTS, PARAMS, priority=[0, 1, 0, 0])
    assert e.value.param == "priority"
    assert not fcfs.engine.has_unfinished_requests()  # nothing was queued


@pytest.mark.parametrize(
    "priority, message",
    [
        ([0, "1", 0, 0], "priority must be an integer, got str '1'"),
        ([0, True, 0, 0], "priority must be an integer, got bool True"),
        ([0, 1.5, 0, 0], "priority must be an integer, got float 1.5"),
        ([0, 2**63, 0, 0], r"priority must be in \[-2\*\*63, 2\*\*63 - 1\]"),
        ([0, 1], "priority has 2 entries for 4 prompts"),
        (3, "priority must be a list with one int per prompt, got int"),
    ],
)
def test_bad_priorities_are_refused_naming_the_field(by_priority, priority, message):
    with pytest.raises(RequestError, match=message) as e:
        by_priority.generate(PROMPTS, PARAMS, priority=priority)
    assert e.value.param == "priority"
    assert not by_priority.engine.has_unfinished_requests()
    # ...and the engine keeps serving.
    assert by_priority.generate(PROMPTS[0], PARAMS, priority=[-7])[0].finished


def test_async_llm_takes_priority_beside_the_params():
    config = EngineConfig(
        model=str(tiny_model("llama")),
        dtype="float32",
        device="cpu",
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=1, policy="priority"),
    )
    llm = AsyncLLM(config=config)

    async def last(prompt, priority):
        return [out async for out in llm.generate(prompt, PARAMS, priority=priority)][-1]

    async def main():
        # The first holds the only sequence slot (it has produced a token) while the others
        # queue up behind it.
        hold = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
        first = llm.generate(PROMPTS[0], hold, priority=0)
        await anext(first)
        rest = asyncio.gather(*(last(p, q) for p, q in zip(PROMPTS[1:], [9, 1, -4])))
        while len(llm.engine.scheduler.waiting) < 3:
            await asyncio.sleep(0.01)
        await first.aclose()  # aborted: its slot frees
        outs = await rest
        with pytest.raises(RequestError) as e:
            await last(PROMPTS[0], "high")
        return outs, e.value

    try:
        outs, err = asyncio.run(main())
    finally:
        llm.close()
    assert err.param == "priority"
    assert served_order(outs) == [2, 1, 0]  # -4, 1, 9
