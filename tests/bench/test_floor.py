"""The prefill floor (engine/bench/floor.py): multiply-accumulates counted from the model's shapes
and the prefix cache's whole blocks, and the line bench_peer.py prints from them."""

from __future__ import annotations

import pytest

from engine.bench.floor import (
    cached_prefix,
    floor_line,
    prefill_macs,
    token_macs,
    workload_macs,
)
from engine.config import ModelConfig

CFG = ModelConfig(
    architecture="llama",
    vocab_size=100,
    hidden_size=12,
    intermediate_size=20,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=3,
    max_position_embeddings=64,
)


def counted(start: int, end: int) -> int:
    """The same total, one product at a time."""
    h, d, heads, kv = 12, 3, 4, 2
    total = 0
    for _layer in range(3):
        for t in range(start, end):
            total += h * heads * d + 2 * h * kv * d  # q, k, v
            total += heads * d * h  # o
            total += 3 * h * 20  # gate, up, down
            for _head in range(heads):
                total += (t + 1) * d  # scores over keys 0..t
                total += (t + 1) * d  # values
    return total + h * 100  # the first output token's LM head row


@pytest.mark.parametrize("start,end", [(0, 1), (0, 7), (5, 6), (16, 40)])
def test_prefill_macs_counts_every_product(start, end):
    assert prefill_macs(CFG, start, end) == counted(start, end)


def test_a_cached_prefix_costs_only_the_new_tokens_and_their_attention():
    whole = prefill_macs(CFG, 0, 40)
    rest = prefill_macs(CFG, 32, 40)
    assert rest < whole
    # the new tokens' projections are the same, their attention still spans the cached keys
    assert rest - CFG.hidden_size * CFG.vocab_size > 8 * 3 * token_macs(CFG)


def test_prefill_macs_refuses_an_empty_range():
    with pytest.raises(ValueError, match="start < end"):
        prefill_macs(CFG, 5, 5)


def test_cached_prefix_is_whole_blocks_of_the_longest_shared_prefix():
    p = list(range(50))
    assert cached_prefix(p, [], 16) == 0
    assert cached_prefix(p, [p[:20] + [999]], 16) == 16
    assert cached_prefix(p, [p[:20], p[:35] + [7]], 16) == 32  # the best earlier prompt
    assert cached_prefix(p, [list(range(1, 50))], 16) == 0  # shares nothing
    # the same prompt again: its last token is computed, so its last block is not reused
    assert cached_prefix(p[:48], [p], 16) == 32
    with pytest.raises(ValueError, match="block_size"):
        cached_prefix(p, [], 0)


def test_workload_macs_reuses_earlier_turns_in_order():
    first = list(range(40))
    second = first + list(range(100, 110))  # the next turn: the conversation so far, then more
    macs = workload_macs(CFG, [first, second], 16)
    assert macs == [prefill_macs(CFG, 0, 40), prefill_macs(CFG, 32, 50)]
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        workload_macs(CFG, [first, []], 16)


def test_floor_line_divides_by_the_rate_and_compares_with_the_peer():
    line = floor_line([2e9, 4e9], 1.0, "a test rate", 6.0)
    assert "mean TTFT >= 3.00 s" in line
    assert "0.50x llama-server's 6.00 s" in line
    assert "llama-server" not in floor_line([2e9], 1.0, "a test rate", None)
    with pytest.raises(ValueError, match="rate_gmac_s"):
        floor_line([1], 0.0, "a test rate", None)
