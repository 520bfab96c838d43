"""The real-cluster trace benchmark's workload (engine/bench/trace.py): trace blocks become
token blocks so that shared hash ids are shared token prefixes (and so shared KV blocks), lengths
scale and cap as stated, a run's salt gives it prefixes no other run has, and sampling keeps
whole conversations. The trace sent at its arrivals (bench_peer.py's trace-arrivals, the cluster
replay): at the compressed timestamps, overlapping requests in flight together, a conversation's
turns in order."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from engine.bench.trace import (
    TRACE_BLOCK,
    Result,
    ScaledRequest,
    Turn,
    earlier_turns,
    real_scale_conversations,
    real_scale_turns,
    replay,
    sample_conversations,
    scale_trace,
    send_turns,
    start_at,
    summarize,
)
from engine.kvcache.prefix_hash import hash_blocks
from engine.sim.trace import TraceRequest


def req(i, t, n_in, n_out, ids):
    return TraceRequest(i, t, n_in, n_out, tuple(ids))


TRACE = [
    req(0, 10.0, 1024, 64, [0, 1]),
    req(1, 12.0, 1300, 320, [0, 1, 2]),  # the next turn: blocks 0 and 1 again
    req(2, 13.5, 600, 10_000, [0, 3]),
]


def test_shared_hash_ids_are_shared_token_prefixes_and_block_hashes():
    a, b, c = scale_trace(TRACE, block_tokens=16, max_prompt=1024, out_scale=1 / 32, max_out=16,
                          salt=1)  # fmt: skip
    assert [len(r.ids) for r in (a, b, c)] == [32, 41, 19]  # 1300 * 16 / 512 = 40.6 -> 41
    assert b.ids[:32] == a.ids and c.ids[:16] == a.ids[:16] and c.ids[16:19] != a.ids[16:19]
    ha, hb, hc = (hash_blocks(r.ids, 16) for r in (a, b, c))
    assert hb[:2] == ha and hc[0] == ha[0] and hc[1:] != ha[1:]
    assert [r.max_tokens for r in (a, b, c)] == [2, 10, 16]  # scaled, at least 1, capped
    assert [r.arrival_s for r in (a, b, c)] == [0.0, 2.0, 3.5]  # from the first arrival


def test_a_runs_salt_gives_prefixes_no_other_run_has():
    one = scale_trace(TRACE, 16, 1024, 1 / 32, 16, salt=1)
    two = scale_trace(TRACE, 16, 1024, 1 / 32, 16, salt=2)
    assert one == scale_trace(TRACE, 16, 1024, 1 / 32, 16, salt=1)  # deterministic
    assert not set(hash_blocks(one[1].ids, 16)) & set(hash_blocks(two[1].ids, 16))


def test_prompt_cap_and_sampling_by_conversation():
    capped = scale_trace(TRACE, 16, 20, 1 / 32, 16, salt=0)
    assert [len(r.ids) for r in capped] == [20, 20, 19]
    assert sample_conversations(TRACE, 1) == TRACE
    assert sample_conversations(TRACE, 3) == [TRACE[2]]  # second hash id 3
    assert [r.index for r in sample_conversations(TRACE, 2)] == []
    assert [r.index for r in sample_conversations(TRACE[:2], 1)] == [0, 1]


def test_goodput_counts_requests_meeting_both_slos():
    results = [
        Result("ok", 100, 50, 1.0, [0.1, 0.2]),
        Result("ok", 100, 0, 5.0, [0.1]),  # TTFT over the SLO
        Result("ok", 100, 0, 1.0, [0.9, 0.9]),  # TBT over the SLO
        Result("rejected", 100, 0, float("nan"), []),
    ]
    s = summarize(results, span_s=2.0, ttft_slo=2.0, tbt_slo=0.5)
    assert (s.completed, s.rejected, s.failed) == (3, 1, 0)
    assert s.goodput_rps == 0.5 and s.goodput_share == 0.25
    assert s.hit_rate == 50 / 300


def test_real_scale_conversations_keep_lengths_and_turns_share_their_prefixes():
    """The shipped trace at its real scale (trace_chaos.py, bench_peer.py's trace): whole
    conversations within the cap, the trace's input lengths, a later turn starting with its
    conversation's earlier blocks."""
    from engine.sim.trace import DEFAULT_TRACE, load_trace

    prompts = real_scale_conversations(10, 0, 32000)
    assert len(prompts) == 18 and max(map(len, prompts)) == 28641
    lengths = {r.input_len for r in load_trace(DEFAULT_TRACE)}
    assert all(len(p) in lengths for p in prompts)
    two = 2 * TRACE_BLOCK  # the system prompt's block and the conversation's first
    shared = [(a, b) for i, a in enumerate(prompts) for b in prompts[i + 1 :] if a[:two] == b[:two]]
    assert shared  # turns of one conversation share its first blocks
    assert real_scale_conversations(10, 1, 32000)[0][:64] != prompts[0][:64]  # the salt
    assert max(map(len, real_scale_conversations(6, 0, 8000))) <= 8000


def test_real_scale_turns_carry_the_traces_arrivals_and_conversations():
    """bench_peer.py's 6 conversations: their 10 turns at the trace's timestamps (6 at its start),
    in its order, the prompts of real_scale_conversations; a later turn follows its own
    conversation's earlier turn and starts with that turn's whole blocks."""
    turns = real_scale_turns(6, 0, 8000)
    assert [t.ids for t in turns] == real_scale_conversations(6, 0, 8000)
    assert [round(t.arrival_s) for t in turns] == [0, 0, 0, 0, 0, 0, 48, 546, 642, 732]
    assert [t.conversation for t in turns] == [0, 1, 2, 3, 4, 5, 1, 3, 3, 3]
    after = earlier_turns(turns)
    assert after == [None] * 6 + [1, 3, 7, 8]
    for i, j in enumerate(after):
        if j is not None:
            whole = len(turns[j].ids) // TRACE_BLOCK * TRACE_BLOCK
            assert turns[i].ids[:whole] == turns[j].ids[:whole]


def test_send_turns_keeps_overlapping_turns_in_flight_together_and_a_conversation_in_order():
    """Turns 0-2 (three conversations) arrive within 0.05 s of each other: each stays in flight
    until all three are, so a sender that runs one at a time (or any fewer than 3) fails here.
    Turn 3, conversation 0's next, arrives (1.0 s of trace / 10 = 0.1 s) while turn 0 is still in
    flight (until 0.25 s): it is sent only when turn 0 has ended, not at its arrival."""
    turns = [Turn(0.0, 0, [10]), Turn(0.0, 1, [11]), Turn(0.5, 2, [12]), Turn(1.0, 0, [13])]
    log: list[tuple[str, int, float]] = []
    all_in = asyncio.Event()
    flying = {"now": 0, "most": 0}

    async def main():
        t0 = time.monotonic()

        async def send(t: Turn):
            i = t.ids[0] - 10
            log.append(("start", i, time.monotonic() - t0))
            flying["now"] += 1
            flying["most"] = max(flying["most"], flying["now"])
            if flying["now"] == 3:
                all_in.set()
            if i < 3:
                await asyncio.wait_for(all_in.wait(), 10)  # concurrency lost: TimeoutError
            if i == 0:
                await asyncio.sleep(max(0.0, t0 + 0.25 - time.monotonic()))
            flying["now"] -= 1
            log.append(("end", i, time.monotonic() - t0))
            return f"answer {i}"

        return await send_turns(turns, 10.0, send)

    sent = asyncio.run(main())
    assert [r for _, r in sent] == ["answer 0", "answer 1", "answer 2", "answer 3"]
    assert flying["most"] == 3
    offsets = [s for s, _ in sent]
    assert offsets == sorted(offsets)
    assert all(s >= t.arrival_s / 10 - 0.002 for s, t in zip(offsets, turns))  # never early
    events = [(what, i) for what, i, _ in log]
    assert events.index(("start", 3)) > events.index(("end", 0))
    assert offsets[3] >= 0.25 - 0.002  # at turn 0's end, not at its own arrival (0.1 s)


def test_start_at_lets_a_request_follow_only_an_earlier_one():
    async def main(after):
        async def send(i):
            return i

        return await asyncio.gather(*start_at([0.0, 0.0], send, after))

    assert [r for _, r in asyncio.run(main([None, 0]))] == [0, 1]
    with pytest.raises(ValueError):
        asyncio.run(main([1, None]))
    with pytest.raises(ValueError):
        asyncio.run(send_turns([Turn(0.0, 0, [1])], 0.0, None))


class FakeRouter:
    """router.generate as the cluster replay uses it: one output of 2 new tokens, then a finished
    one; request ``slow`` never answers (the drain aborts it), ``full`` is refused."""

    def __init__(self):
        self.sent: dict[str, float] = {}
        self.t0 = time.monotonic()

    async def generate(self, ids, params, request_id):
        from engine.core.scheduler import QueueFullError

        self.sent[request_id] = time.monotonic() - self.t0
        if request_id.endswith("-2"):
            await asyncio.sleep(3600)
        if request_id.endswith("-1"):
            raise QueueFullError("full")
        yield SimpleNamespace(outputs=[SimpleNamespace(new_token_ids=[1, 2])], finished=False,
                              metrics=None)  # fmt: skip
        yield SimpleNamespace(outputs=[SimpleNamespace(new_token_ids=[3])], finished=True,
                              metrics=SimpleNamespace(num_cached_tokens=len(ids) // 2))  # fmt: skip


def test_replay_sends_at_arrivals_and_aborts_what_the_drain_leaves():
    reqs = [ScaledRequest(0.0, [1] * 8, 3), ScaledRequest(0.05, [2] * 8, 3),
            ScaledRequest(0.1, [3] * 8, 3)]  # fmt: skip
    router = FakeRouter()
    results = asyncio.run(replay(router, reqs, "t", drain_s=0.2))
    assert [r.status for r in results] == ["ok", "rejected", "timeout"]
    assert results[0].cached_tokens == 4 and len(results[0].gaps) == 1  # the 3rd token
    assert all(router.sent[f"t-{i}"] >= r.arrival_s - 0.002 for i, r in enumerate(reqs))
