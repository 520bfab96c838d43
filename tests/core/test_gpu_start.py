"""What an engine on CUDA does at start-up and in its step timer, checked on the CPU: the kernel
warm-up on the engine's shapes, then the decode graphs unless ``enforce_eager``; the step timer
synchronising the device where it splits a step, on CUDA only."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny_models import tiny_model

import engine.core.cuda_graphs as cuda_graphs
import engine.core.llm_engine as llm_engine
import engine.core.sample_step as sample_step
import engine.kernels.variants as kernel_variants
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.engine_setup import kernel_shape, prepare_gpu
from engine.core.llm_engine import LLMEngine
from engine.core.model_runner import ModelRunner
from engine.core.step_clock import step_clock
from engine.kernels.variants import ModelShape
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(
        EngineConfig(
            model=str(tiny_model("llama")),
            dtype="float32",
            device="cpu",
            max_model_len=256,
            cache=CacheConfig(num_blocks=32, block_size=16),
            scheduler=SchedulerConfig(max_num_seqs=8),
        )
    )


def test_step_clock_synchronizes_on_cuda_only(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: seen.append(device))
    step_clock(torch.device("cpu"))
    assert seen == []
    step_clock(torch.device("cuda", 1))
    assert seen == [torch.device("cuda", 1)]


def test_the_step_splits_on_the_device_clock(engine, monkeypatch):
    clocks = []
    for module in (llm_engine, sample_step):  # before the forward, and after it
        monkeypatch.setattr(module, "step_clock", lambda d: clocks.append(d) or 0.0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("synchronize on CPU"))
    engine.add_request("Hello there", SamplingParams(max_tokens=3, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    # before the forward and after it, on the engine's device, every step
    assert clocks == [engine.device] * (2 * steps)


def test_cuda_start_warms_up_then_captures(engine, monkeypatch):
    warmed, captured = [], []
    monkeypatch.setattr(kernel_variants, "warm_up", lambda *a: warmed.append(a) or (20, 0.0))
    monkeypatch.setattr(cuda_graphs, "CudaGraphBackend", lambda device: ("backend", device))
    monkeypatch.setattr(ModelRunner, "enable_graphs", lambda self, *a: captured.append(a))
    prepare_gpu(engine.parts)
    cfg = engine.model_config
    shape = ModelShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers)
    assert warmed == [(shape, 16, torch.float32, engine.device, torch.float32)]  # its KV dtype
    assert captured == [(8, 256, ("backend", engine.device))]

    warmed.clear(), captured.clear()
    prepare_gpu(replace(engine.parts, config=replace(engine.config, enforce_eager=True)))
    assert len(warmed) == 1 and captured == []  # warm-up still, no graphs


def test_cuda_start_with_the_torch_references_neither_compiles_nor_captures(engine, monkeypatch):
    """ENGINE_KERNELS=torch on a GPU (the parity check of profiling/gpu_e2e.py): the references
    read sequence lengths on the host, which a CUDA graph capture refuses (seen on an H200)."""
    warmed, captured = [], []
    monkeypatch.setattr(kernel_variants, "warm_up", lambda *a: warmed.append(a) or (20, 0.0))
    monkeypatch.setattr(ModelRunner, "enable_graphs", lambda self, *a: captured.append(a))
    monkeypatch.setenv("ENGINE_KERNELS", "torch")
    prepare_gpu(engine.parts)
    assert warmed == [] and captured == []


def test_kernel_shape(engine):
    cfg = engine.model_config  # hidden 64, 4 heads of 16, 2 KV heads, intermediate 128
    assert kernel_shape(cfg, int8=False) == ModelShape(4, 2, 16, 2, False, ())
    assert kernel_shape(cfg, int8=True).int8_projections == (
        (128, 64),  # fused qkv
        (64, 64),  # o
        (256, 64),  # fused gate_up
        (64, 128),  # down
        (cfg.vocab_size, 64),  # LM head
    )
