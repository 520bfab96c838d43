"""The KV cache's size from measured memory (engine/kvcache/kv_budget.py): the arithmetic, and
the errors that name the field and the limit. Numbers in GiB, as a GPU reports them."""

from __future__ import annotations

import pytest

from engine.kvcache.kv_budget import (
    GIB,
    DeviceMemory,
    activation_reserve_bytes,
    kv_budget_bytes,
    num_blocks_for,
    sized_by,
)


def gpu(total: float, free: float, used: float, reserve: float = 0.0) -> DeviceMemory:
    return DeviceMemory(int(total * GIB), int(free * GIB), int(used * GIB), int(reserve * GIB))


def test_utilization_is_this_processes_share_of_the_total():
    # 80 GiB GPU, 0.45 of it: 36 GiB for this process, 10 already held, 2 kept for activations.
    assert kv_budget_bytes(gpu(80, 60, 10, 2), 0.45, None) == int(0.45 * 80 * GIB) - 12 * GIB
    # the free memory does not enter (as long as the budget fits in it)...
    assert kv_budget_bytes(gpu(80, 30, 10, 2), 0.45, None) == int(0.45 * 80 * GIB) - 12 * GIB


def test_two_workers_on_one_gpu_each_get_their_share():
    # The first worker took 0.45 of 80 GiB (36): the second still gets its 36 - weights.
    first = kv_budget_bytes(gpu(80, 80 - 1, 1, 1), 0.45, None)
    assert first == 34 * GIB
    second = kv_budget_bytes(gpu(80, 80 - 36 - 1, 1, 1), 0.45, None)
    assert second == first
    # The old rule (free - (1 - u) * total) gave the second worker a negative budget:
    assert (80 - 37) - (1 - 0.45) * 80 < 0


def test_a_share_the_other_processes_left_no_room_for_is_refused():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.9 .* only 20.00 GiB .* free"):
        kv_budget_bytes(gpu(80, 20, 1, 1), 0.9, None)


def test_a_share_the_weights_fill_is_refused():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.1 .* no room .* raise"):
        kv_budget_bytes(gpu(80, 70, 7, 1), 0.1, None)


def test_kv_cache_memory_gb_is_the_budget_on_every_device():
    assert kv_budget_bytes(None, 0.85, 1.5) == int(1.5 * GIB)
    assert kv_budget_bytes(gpu(80, 60, 10, 2), 0.1, 20) == 20 * GIB  # utilization unused
    with pytest.raises(ValueError, match=r"kv_cache_memory_gb \(59.00 GiB\) .* 58.00 GiB"):
        kv_budget_bytes(gpu(80, 60, 10, 2), 0.85, 59)
    with pytest.raises(ValueError, match="kv_cache_memory_gb must be set on a CPU"):
        kv_budget_bytes(None, 0.85, None)


def test_num_blocks_and_the_too_small_errors():
    assert num_blocks_for(10 * 1000 + 999, 1000, 16, 64, True) == 10
    # 10 blocks of 16 tokens hold 160 tokens: max_model_len 161 given does not fit.
    with pytest.raises(ValueError, match=r"holds 10 blocks; it needs at least 11 .* max_model_len"):
        num_blocks_for(10 * 1000, 1000, 16, 161, True)
    field = sized_by(DeviceMemory(1, 1, 0, 0), None)
    with pytest.raises(ValueError, match=r"raise --gpu-memory-utilization .* lower --max-model"):
        num_blocks_for(10 * 1000, 1000, 16, 161, True, field)
    assert sized_by(None, None) == sized_by(DeviceMemory(1, 1, 0, 0), 2.0)
    # defaulted from the model: lowered later (cache_plan), not refused...
    assert num_blocks_for(10 * 1000, 1000, 16, 8192, False) == 10
    # ...unless fewer than 2 blocks (or none)
    with pytest.raises(ValueError, match="holds 0 blocks; it needs at least 2"):
        num_blocks_for(999, 1000, 16, 8192, False)


def test_activation_reserve_grows_with_the_step():
    kw = dict(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
              vocab_size=49152, max_num_seqs=128, elem_size=2)  # fmt: skip
    small = activation_reserve_bytes(max_num_batched_tokens=256, **kw)
    big = activation_reserve_bytes(max_num_batched_tokens=2048, **kw)
    per_token = (3 * 576 + (18 + 6) * 64 + 3 * 1536) * 2
    assert big - small == 2 * (2048 - 256) * per_token
    # the logits of the sampling rows: at most one per token of the step
    assert small == 2 * 256 * per_token + 128 * 49152 * 20


def test_device_memory_rejects_negative_numbers():
    with pytest.raises(ValueError, match="DeviceMemory.used"):
        DeviceMemory(1, 1, -1, 0)
