"""The float-weight matmul for a few rows (the LM head of a decode step): the C kernel against
float64 math and torch's GEMM, its row invariance, where it stops, and that the float32 model's
logits take it."""

from __future__ import annotations

import importlib

import pytest
import torch

import engine.kernels as kernels
from engine import cpu_isa
from engine.kernels import native
from engine.kernels.float_matmul import (
    NATIVE_FLOAT_MAX_ROWS,
    float_matmul_blocked,
    float_matmul_native,
    float_matmul_ref,
    native_max_rows,
    rounds_rows,
)

# the module (engine.kernels.float_matmul, the name, is the dispatching function)
fm = importlib.import_module("engine.kernels.float_matmul")
needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")
WEIGHTS = [torch.float32, torch.bfloat16, torch.float16]


def inputs(out_features, in_features, x_dtype, w_dtype, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_features, in_features, generator=g) * 0.05).to(w_dtype)
    x = torch.randn(rows, in_features, generator=g).to(x_dtype)
    return x, w


@needs_cc
@pytest.mark.parametrize("w_dtype", WEIGHTS)
@pytest.mark.parametrize("in_features", [576, 100, 1536])  # 100: tails after 96 and 8 columns
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 13, NATIVE_FLOAT_MAX_ROWS])  # row dots and tiles
def test_matches_float_math(rows, in_features, w_dtype):
    # 77 output rows: partial blocks of 18 and a partial tile of 3
    x, w = inputs(77, in_features, torch.float32, w_dtype, rows)
    exact = x.double() @ w.double().T
    got = float_matmul_native(x, w)
    assert got.dtype == torch.float32 and got.shape == (rows, 77)
    # float32 sums of in_features products: a few ulps of the sum of magnitudes
    bound = (x.double().abs() @ w.double().abs().T) * in_features * 2.0**-24 + 1e-30
    assert ((got.double() - exact).abs() <= bound).all()
    torch.testing.assert_close(got, float_matmul_ref(x, w), rtol=1e-5, atol=1e-5)


@needs_cc
@pytest.mark.parametrize(
    "w_dtype, x_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),  # weight_dtype bf16 under float32 activations
        (torch.float16, torch.float32),
    ],
    ids=["float32", "bf16", "bf16-weights-float32", "fp16-weights-float32"],
)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(w_dtype, x_dtype):
    # What keeps n > 1 and batched decode equal to batch 1, bit for bit: each row's sums are
    # formed in the same order alone, in row-dot groups and in tiles of any shape.
    if rounds_rows(w_dtype, x_dtype):
        pytest.skip("AVX512-BF16 row dots: bf16 weights against float32 rows go to torch's GEMM")
    x, w = inputs(61, 576, x_dtype, w_dtype, NATIVE_FLOAT_MAX_ROWS, seed=1)
    rows = min(NATIVE_FLOAT_MAX_ROWS, max(1, native_max_rows()))
    together = float_matmul_native(x[:rows], w)
    for n in range(1, rows + 1):
        part = float_matmul_native(x[:n], w)
        for b in range(n):
            assert torch.equal(part[b], together[b]), (n, b)


@needs_cc
def test_16bit_activations_are_read_as_their_values():
    x, w = inputs(40, 576, torch.bfloat16, torch.float32, 5, seed=2)
    torch.testing.assert_close(
        float_matmul_native(x, w), float_matmul_ref(x, w), rtol=1e-5, atol=1e-5
    )


def test_native_stops_where_it_stops_paying(monkeypatch):
    # Beyond native_max_rows() rows the reference serves (torch's GEMM), so results there are
    # torch's own; on a CPU without the vector row dots the C kernel never serves.
    limit = native_max_rows()
    isa = cpu_isa.this_cpu()
    if not isa.c_float_row_dots or native.library() is None:
        assert limit == 0
    else:
        tiles = native.row_dot_paths()["float"] == "avx2"
        assert limit == (NATIVE_FLOAT_MAX_ROWS if tiles else 8)
    x, w = inputs(30, 64, torch.float32, torch.float32, limit + 1, seed=3)
    assert torch.equal(float_matmul_native(x, w), float_matmul_ref(x, w))


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16])
def test_blocked_widens_a_tile_at_a_time_to_the_references_products(monkeypatch, w_dtype):
    # 16-bit weights against float32 rows beyond the C kernel's rows (prefill, large batches):
    # a tile of weight rows widened at a time, never the whole weight (an LM head), each output
    # the reference's dot of exact widened weights.
    monkeypatch.setattr(fm, "FLOAT_TILE_BYTES", 32 * 100 * 4)  # tiles of 32 of 77 rows
    x, w = inputs(77, 100, torch.float32, w_dtype, 40, seed=4)
    widened = []
    real = torch.Tensor.float

    def spy(t):
        widened.append(t.shape[0])
        return real(t)

    monkeypatch.setattr(torch.Tensor, "float", spy)
    got = float_matmul_blocked(x, w)
    monkeypatch.setattr(torch.Tensor, "float", real)
    assert widened[1:] == [32, 32, 13]  # x itself first
    exact = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * 100 * 2.0**-24 + 1e-30
    assert ((got.double() - exact).abs() <= bound).all()
    torch.testing.assert_close(got, float_matmul_ref(x, w), rtol=1e-5, atol=1e-5)


@needs_cc
def test_bf16_weights_keep_float32_rows_exact_on_every_row_dot_path():
    # The AVX512-BF16 row dots take bf16 rows; float32 rows against bf16 weights must not be
    # rounded to them (weight_dtype bf16 under float32), so there torch's tiles serve.
    x, w = inputs(50, 576, torch.float32, torch.bfloat16, 4, seed=5)
    x = x + 1e-3  # most values now need more than bf16's 8 bits
    assert rounds_rows(torch.bfloat16, torch.float32) == (
        native.row_dot_paths()["bf16"] == "avx512bf16"
    )
    assert not rounds_rows(torch.bfloat16, torch.bfloat16)
    assert not rounds_rows(torch.float16, torch.float32)
    exact = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * 576 * 2.0**-24 + 1e-30
    assert ((float_matmul_native(x, w).double() - exact).abs() <= bound).all()


def test_bad_shapes_name_the_tensor():
    x, w = inputs(30, 64, torch.float32, torch.float32, 2)
    with pytest.raises(ValueError, match="w"):
        float_matmul_native(x, w[:, :32].contiguous())
    with pytest.raises(ValueError, match="x"):
        float_matmul_native(x.to(torch.int32), w)


@needs_cc
def test_dispatch_and_the_float32_lm_head_take_the_c_kernel(monkeypatch):
    if native_max_rows() == 0:
        pytest.skip("no vector row dots for float weights on this CPU")
    calls = []
    real = kernels.float_matmul_native

    def spy(x, w):
        calls.append(x.shape[0])
        return real(x, w)

    monkeypatch.setattr(kernels, "float_matmul_native", spy)
    x, w = inputs(30, 64, torch.float32, torch.float32, 4)
    torch.testing.assert_close(kernels.float_matmul(x, w), float_matmul_ref(x, w))
    assert calls == [4]
    monkeypatch.setenv("ENGINE_KERNELS", "torch")
    assert torch.equal(kernels.float_matmul(x, w), float_matmul_ref(x, w))
    assert calls == [4]


def test_a_float32_models_logits_take_it(monkeypatch):
    from engine.config import ModelConfig
    from engine.model.llama import LlamaForCausalLM

    cfg = ModelConfig(
        architecture="llama",
        vocab_size=50,
        hidden_size=64,
        intermediate_size=96,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        max_position_embeddings=64,
    )
    calls = []
    real = kernels.float_matmul

    def spy(x, w):
        calls.append((x.shape[0], w.dtype))
        return real(x, w)

    monkeypatch.setattr(kernels, "float_matmul", spy)
    hidden = torch.randn(3, 64)
    model = LlamaForCausalLM(cfg, torch.float32, torch.device("cpu"))
    torch.nn.init.normal_(model.lm_head, std=0.05)
    logits = model.compute_logits(hidden)
    assert calls == [(3, torch.float32)]
    torch.testing.assert_close(logits, hidden @ model.lm_head.T, rtol=1e-5, atol=1e-5)
    bf16 = LlamaForCausalLM(cfg, torch.bfloat16, torch.device("cpu"))
    bf16.compute_logits(hidden.bfloat16())
    assert len(calls) == 1  # 16-bit heads keep their GEMM and the float32 refinement
