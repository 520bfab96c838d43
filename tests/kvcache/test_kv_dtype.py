"""The KV cache's dtype (engine/kvcache/kv_dtype.py, EngineConfig.kv_cache_dtype): the
attention's error bounds per cache dtype against a float32 cache, the bytes a token costs, the
flag's choices, and the namespace that keeps dtypes apart in the pool."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, ModelConfig, check_kv_cache_dtype
from engine.core.device_resolution import resolved_kv_dtype
from engine.kernels import native
from engine.kernels.decode_attention import decode_attention_ref
from engine.kernels.kv_quant import row_elems, to_cache
from engine.kvcache.paged_cache import PagedKVCache, bytes_per_block
from engine.kvstore.namespace import KVNamespace

# SmolLM2-135M's attention: 3 KV heads of 64
SMOL = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
)  # fmt: skip


def random_batch(seq_lens, heads, kv_heads, head_dim, block_size, seed):
    """q [B, heads, D] and a float32 paged cache, each sequence's blocks its own."""
    g = torch.Generator().manual_seed(seed)
    per = [-(-n // block_size) for n in seq_lens]
    tables = torch.zeros(len(seq_lens), max(per), dtype=torch.int32)
    start = 0
    for b, n in enumerate(per):
        tables[b, :n] = torch.arange(start, start + n)
        start += n
    shape = (start, block_size, kv_heads, head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=g)
    return q, k, v, tables, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize(
    "kv_dtype, bound",
    # relative (Frobenius) error of the attention output against a float32 cache, on unit-normal
    # q, K and V over contexts of 1 to 4,000 tokens; measured 0.18% (bf16), 0.02% (fp16), 0.6%
    # (int8): docs/kernels.md states these bounds
    [(torch.bfloat16, 0.004), (torch.float16, 0.0005), (torch.int8, 0.01)],
)
def test_attention_over_a_cache_of_each_dtype_stays_within_its_bound(kv_dtype, bound):
    q, k, v, bt, lens = random_batch([1, 17, 300, 1100, 4000], 9, 3, 64, 16, seed=2)
    exact = decode_attention_ref(q, k, v, bt, lens, 0.125)
    kq, vq = to_cache(k, kv_dtype), to_cache(v, kv_dtype)
    attend = decode_attention_ref
    if native.compiler() is not None:
        from engine.kernels.decode_attention import decode_attention_native as attend
    got = attend(q, kq, vq, bt, lens, 0.125)
    assert float((got - exact).norm() / exact.norm()) < bound


def test_int8_holds_at_least_1_9x_the_tokens_of_bf16_per_byte():
    bf16 = bytes_per_block(SMOL, 16, torch.bfloat16)
    int8 = bytes_per_block(SMOL, 16, torch.int8)
    assert int8 == 30 * 2 * 16 * 3 * 66
    assert bf16 / int8 >= 1.9
    cache = PagedKVCache(SMOL, 4, 16, torch.int8, torch.device("cpu"))
    assert cache.kv.shape == (30, 2, 4, 16, 3, 66)
    assert cache.kv[:, :, 0].numel() == int8


def test_the_flag_takes_vllms_names_and_names_itself_when_wrong():
    assert check_kv_cache_dtype("fp8") == "int8"
    assert check_kv_cache_dtype("bf16") == "bfloat16"
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*got 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    cpu = EngineConfig(device="cpu", dtype="float32")
    assert resolved_kv_dtype(cpu) == torch.float32  # asked for float32: all of it
    assert resolved_kv_dtype(EngineConfig(device="cpu", kv_cache_dtype="int8")) == torch.int8
    # CUDA's Triton kernels read every KV dtype (tests/kernels/test_triton_kv_dtypes.py)
    assert resolved_kv_dtype(EngineConfig(device="cuda", kv_cache_dtype="int8")) == torch.int8
    cuda_fp16_kv = EngineConfig(device="cuda", dtype="bfloat16", kv_cache_dtype="float16")
    assert resolved_kv_dtype(cuda_fp16_kv) == torch.float16


@pytest.mark.parametrize("isa", ["avx2", "avx512", "avx512bf16"])
def test_auto_is_bf16_under_float32_activations_where_attention_widens_it(monkeypatch, isa):
    # dtype=auto: float32 activations with bf16 weights on AVX2 and AVX-512 without BF16, whose
    # C attention widens bf16 KV in registers: a bf16 cache (half the bytes at long contexts);
    # with native bf16 the activations are bf16 and so is the cache
    from engine import cpu_isa

    monkeypatch.setenv("ENGINE_CPU_ISA", isa)
    cpu_isa.this_cpu.cache_clear()
    try:
        here = cpu_isa.this_cpu()
        if here.level != isa:
            pytest.skip(f"this CPU is {here.level}: it cannot be capped to {isa}")
        auto = EngineConfig(device="cpu")
        assert resolved_kv_dtype(auto) == torch.bfloat16
        assert resolved_kv_dtype(EngineConfig(device="cpu", kv_cache_dtype="float32")) == (
            torch.float32
        )
    finally:
        cpu_isa.this_cpu.cache_clear()


def test_each_kv_dtype_is_a_namespace_of_its_own():
    spaces = {
        d: KVNamespace("m" * 64, d, 16, 30, 3, 64)
        for d in ("float32", "bfloat16", "float16", "int8")
    }
    assert len({ns.id for ns in spaces.values()}) == 4
    assert spaces["int8"].block_bytes == bytes_per_block(SMOL, 16, torch.int8)
    assert spaces["bfloat16"].block_bytes == bytes_per_block(SMOL, 16, torch.bfloat16)
    assert row_elems(torch.int8, 64) == 66 and row_elems(torch.bfloat16, 64) == 64
