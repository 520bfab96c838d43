"""The real-cluster trace benchmark's workload (engine/bench/trace.py): trace blocks become
token blocks so that shared hash ids are shared token prefixes (and so shared KV blocks), lengths
scale and cap as stated, a run's salt gives it prefixes no other run has, and sampling keeps
whole conversations."""

from __future__ import annotations

from engine.bench.trace import (
    TRACE_BLOCK,
    Result,
    real_scale_conversations,
    sample_conversations,
    scale_trace,
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
