"""The engine's GPU made current, its memory measured and the KV cache planned from it, with
``torch.cuda`` monkeypatched (no GPU here): what each CUDA call returns is set by the test."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core.cache_plan import activation_reserve, plan_cache
from engine.core.device_memory import MemoryBaseline, select_device
from engine.kvcache.kv_budget import GIB
from engine.kvcache.paged_cache import bytes_per_block

MODEL = ModelConfig(
    architecture="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=4096,
)  # fmt: skip


class FakeCuda:
    """torch.cuda's memory and device calls, answering from these fields."""

    def __init__(self, count=4, total=80 * GIB, free=80 * GIB, reserved=0, current=0):
        self.count, self.total, self.free, self.reserved = count, total, free, reserved
        self.current = current
        self.set_to: list[int] = []

    def install(self, monkeypatch) -> FakeCuda:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "set_device", self._set)
        monkeypatch.setattr(cuda, "mem_get_info", lambda device=None: (self.free, self.total))
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(cuda, "empty_cache", lambda: None)
        return self

    def _set(self, index: int) -> None:
        self.set_to.append(index)
        self.current = index


def test_cuda_n_becomes_the_current_device(monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    assert select_device(torch.device("cuda:2")) == torch.device("cuda:2")
    assert fake.set_to == [2]
    # cuda without an index: the current device, not changed
    assert select_device(torch.device("cuda")) == torch.device("cuda:2")
    assert fake.set_to == [2]
    assert select_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="cuda:4 does not exist: 4 GPU"):
        select_device(torch.device("cuda:4"))


def test_the_engine_sets_the_device_before_it_loads_the_model(monkeypatch):
    """LLMEngine calls select_device (and takes the baseline) before build_model touches CUDA."""
    from engine.core import engine_setup, llm_engine

    fake = FakeCuda().install(monkeypatch)
    order: list[str] = []

    def build_model(*a, **kw):
        order.append(f"build on current cuda:{fake.current}")
        raise RuntimeError("stop here")

    monkeypatch.setattr(engine_setup, "build_model", build_model)
    with pytest.raises(RuntimeError, match="stop here"):
        llm_engine.LLMEngine(EngineConfig(device="cuda:3"))
    assert fake.set_to == [3] and order == ["build on current cuda:3"]


def test_the_measure_counts_this_processes_memory_not_the_others(monkeypatch):
    fake = FakeCuda(free=50 * GIB).install(monkeypatch)  # another process holds 30 GiB
    base = MemoryBaseline.take(torch.device("cuda:0"))
    assert base == MemoryBaseline(free=50 * GIB, reserved=0)
    # the weights: 6 GiB through torch, 1 GiB outside it (cuBLAS, Triton modules)
    fake.reserved, fake.free = 6 * GIB, 43 * GIB
    mem = base.measure(torch.device("cuda:0"), reserve=2 * GIB)
    assert (mem.total, mem.free, mem.used, mem.reserve) == (80 * GIB, 43 * GIB, 7 * GIB, 2 * GIB)
    assert MemoryBaseline.take(torch.device("cpu")) is None


def engine_config(**cache) -> EngineConfig:
    return EngineConfig(
        device="cuda:0",
        cache=CacheConfig(**cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8),
    )


def test_plan_on_cuda_gives_the_kv_cache_the_share_minus_what_is_held(monkeypatch):
    fake = FakeCuda(free=80 * GIB).install(monkeypatch)
    device = torch.device("cuda:0")
    base = MemoryBaseline.take(device)
    fake.reserved, fake.free = 4 * GIB, 76 * GIB  # the weights loaded
    config = engine_config(gpu_memory_utilization=0.45)
    plan = plan_cache(config, MODEL, torch.bfloat16, device, base)
    per_block = bytes_per_block(MODEL, 16, torch.bfloat16)
    budget = int(0.45 * 80 * GIB) - 4 * GIB - activation_reserve(config, MODEL, torch.bfloat16)
    assert plan.num_blocks == budget // per_block
    assert plan.max_model_len == 4096
    # --kv-cache-memory-gb on CUDA: that size
    plan = plan_cache(engine_config(kv_cache_memory_gb=1.0), MODEL, torch.bfloat16, device, base)
    assert plan.num_blocks == GIB // per_block
    # The step budget unset: the activations reserved are those of CUDA's default budget (2048)
    unset = EngineConfig(device="cuda:0", cache=CacheConfig(gpu_memory_utilization=0.45))
    cuda2048 = dataclasses.replace(unset, scheduler=SchedulerConfig(max_num_batched_tokens=2048))
    reserve = activation_reserve(cuda2048, MODEL, torch.bfloat16)
    assert reserve > activation_reserve(config, MODEL, torch.bfloat16)  # more than 512's
    plan = plan_cache(unset, MODEL, torch.bfloat16, device, base)
    assert plan.num_blocks == (int(0.45 * 80 * GIB) - 4 * GIB - reserve) // per_block


def test_plan_refuses_a_cache_too_small_for_max_model_len(monkeypatch):
    fake = FakeCuda(free=80 * GIB).install(monkeypatch)
    device = torch.device("cuda:0")
    base = MemoryBaseline.take(device)
    fake.reserved, fake.free = 1 * GIB, 79 * GIB
    per_block = bytes_per_block(MODEL, 16, torch.bfloat16)
    gb = 10 * per_block / GIB  # 10 blocks: 160 tokens
    config = EngineConfig(device="cuda:0", max_model_len=1024,
                          cache=CacheConfig(kv_cache_memory_gb=gb))  # fmt: skip
    with pytest.raises(ValueError, match="max_model_len 1024"):
        plan_cache(config, MODEL, torch.bfloat16, device, base)
    # On the CPU too.
    cpu = EngineConfig(device="cpu", max_model_len=1024, cache=CacheConfig(kv_cache_memory_gb=gb))
    with pytest.raises(ValueError, match="max_model_len 1024"):
        plan_cache(cpu, MODEL, torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="num_blocks .* max_model_len"):
        plan_cache(EngineConfig(device="cpu", max_model_len=1024, cache=CacheConfig(num_blocks=10)),
                   MODEL, torch.bfloat16, torch.device("cpu"))  # fmt: skip
