"""The Triton kernel variants an engine's shapes need (engine/kernels/variants.py): the table the
engine's CUDA warm-up runs and ``profiling/kernels.py --aot`` compiles."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch

from engine.kernels.variants import DECODE_SPLITS, INT8_ROWS, ModelShape, variants, warm_up

CPU = torch.device("cpu")
LAUNCHERS = (
    ("kv_store", "kv_store_triton"),
    ("decode_attention", "decode_attention_triton"),
    ("prefill_attention", "prefill_attention_triton"),
    ("kv_copy", "kv_gather_triton"),
    ("kv_copy", "kv_scatter_triton"),
    ("int8_matmul", "int8_matmul_triton"),
)


@pytest.fixture
def calls(monkeypatch):
    """Every launcher replaced by a recorder of (launcher, args, kwargs)."""
    seen: list[tuple[str, tuple, dict]] = []
    for module, name in LAUNCHERS:
        record = lambda *a, _name=name, **k: seen.append((_name, a, k))
        monkeypatch.setattr(importlib.import_module(f"engine.kernels.{module}"), name, record)
    return seen


@pytest.mark.parametrize(
    "shape,block_size,dtype",
    [
        (ModelShape(9, 3, 64, 30), 16, torch.bfloat16),  # SmolLM2-135M
        (ModelShape(32, 8, 128, 32), 32, torch.float16),  # Llama-3-8B
        (ModelShape(16, 8, 128, 28, qk_norm=True), 64, torch.float32),  # Qwen3-style
    ],
)
def test_warm_up_calls_each_variant_once_with_the_engines_shapes(calls, shape, block_size, dtype):
    count, _ = warm_up(shape, block_size, dtype, torch.device("cpu"))
    table = variants(shape, block_size, dtype, "cpu")
    assert count == len(table) == len(calls)
    labels = [(v.launcher, v.label) for v in table]
    assert len(set(labels)) == len(labels)  # no variant twice
    assert [c[0] for c in calls] == [v.launcher for v in table]  # each run once, in order
    by = {}
    for name, args, kwargs in calls:
        by.setdefault(name, []).append((args, kwargs))
        caches = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 4]
        for c in caches:  # the paged cache: blocks of block_size x kv heads x head_dim
            assert tuple(c.shape[-3:]) == (block_size, shape.num_kv_heads, shape.head_dim)
            assert c.dtype == dtype
        if name == "kv_gather_triton" or name == "kv_scatter_triton":
            kv = args[0] if name == "kv_gather_triton" else args[2]
            assert kv.shape[:2] == (shape.num_layers, 2)  # the whole KV tensor, as connectors
        if name in ("decode_attention_triton", "prefill_attention_triton"):
            q = args[0]
            assert q.shape[1:] == (shape.num_heads, shape.head_dim) and q.dtype == dtype
            # q as the model hands it over: a view of the fused QKV rotary output, or contiguous
            # after per-head norms
            assert q.is_contiguous() == shape.qk_norm
    assert len(by["kv_store_triton"]) == 1
    assert [k["num_splits"] for _, k in by["decode_attention_triton"]] == list(DECODE_SPLITS)
    prefill = by["prefill_attention_triton"]
    seqs = [a[5].shape[0] for a, _ in prefill]
    assert len(prefill) % 3 == 0 and sorted(set(seqs)) == [1, 2, 16]
    assert len(by["kv_gather_triton"]) == len(by["kv_scatter_triton"]) == 3
    assert "int8_matmul_triton" not in by  # 16-bit or float32 weights: no int8 GEMM


def test_int8_weights_add_the_int8_gemm_per_size_class(calls):
    # SmolLM2's projections (qkv, o, gate_up, down, LM head): all multiples of 16 but the
    # vocabulary's 49152 too, so one size class; a 100-wide input is another.
    projections = ((960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576))
    shape = ModelShape(9, 3, 64, 30, int8_projections=projections)
    warm_up(shape, 16, torch.bfloat16, torch.device("cpu"))
    gemm = [(a[0].shape[0], tuple(a[1].shape)) for n, a, _ in calls if n == "int8_matmul_triton"]
    assert gemm == [(rows, (16, 16)) for rows in INT8_ROWS]
    calls.clear()
    warm_up(replace(shape, int8_projections=((77, 100), (64, 64))), 16, torch.float16, CPU)
    gemm = {tuple(a[1].shape) for n, a, _ in calls if n == "int8_matmul_triton"}
    assert gemm == {(17, 17), (16, 16)}


def test_the_tile_configurations_are_each_covered():
    # Group 8: max_seqlen_q 2 (16-row tiles), 5 (64), 17 (128): three configurations; fp32 has one.
    bf16 = variants(ModelShape(32, 4, 128), 16, torch.bfloat16, "cpu")
    fp32 = variants(ModelShape(32, 4, 128), 16, torch.float32, "cpu")
    tiles = lambda vs: {v.label.rsplit(" ", 1)[0] for v in vs if "prefill" in v.launcher}
    assert len(tiles(bf16)) == 3
    assert len(tiles(fp32)) == 1


def test_the_variants_run_in_the_interpreter():
    # The inputs are valid for each launcher (its checks pass, the kernels run) on a small shape;
    # the decode calls past 2 splits differ only in num_splits (and are slow to interpret).
    shape = ModelShape(4, 2, 16, qk_norm=True, int8_projections=((40, 16),))
    for v in variants(shape, 8, torch.float32, "cpu"):
        if v.kwargs.get("num_splits", 1) <= 2:
            v.run()


@pytest.mark.parametrize(
    "dtype,kv_dtype,row", [(torch.bfloat16, torch.int8, 66), (torch.float32, torch.bfloat16, 64)]
)
def test_warm_up_on_the_engines_kv_dtype(calls, dtype, kv_dtype, row):
    """--kv-cache-dtype: every cache the variants launch on is of the engine's KV dtype (int8
    rows hold their scale), so the warm-up compiles what the engine will run."""
    shape = ModelShape(9, 3, 64, 30)
    count, _ = warm_up(shape, 16, dtype, CPU, kv_dtype)
    assert count == len(calls) > 0
    caches = [
        a for _, args, _ in calls for a in args if isinstance(a, torch.Tensor) and a.dim() >= 4
    ]
    assert caches and all(c.dtype == kv_dtype and c.shape[-1] == row for c in caches)
    queries = [a[0] for n, a, _ in calls if n.endswith("attention_triton")]
    assert queries and all(q.dtype == dtype for q in queries)
