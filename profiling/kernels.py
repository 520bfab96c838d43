"""Profile the Triton kernels of engine/kernels against ceilings measured in the same run.

    python profiling/kernels.py [--quick] [--json PATH] [--md PATH]

On CUDA, for each kernel over a table of sizes: FLOPs and the fewest bytes the operation must move,
median time from triton.testing.do_bench, achieved TFLOP/s and GB/s and their fractions of two
ceilings measured first (a large device-to-device copy for GB/s, a large bf16 matmul for TFLOP/s),
GPU name, memory and clocks from NVML. Every timed case is also checked against the torch
reference (on a slice of it where the reference would be slow), after a correctness sweep over
odd shapes (group 3, head_dim 80/96, block sizes 8-128, fp32/fp16/bf16; the int8 GEMM at 1-130
rows, widths not a multiple of its tile, odd output counts) that also proves each kernel variant
compiles. The int8 GEMM's timed cases are Llama-3-8B's projections from 1 row (decode: weight
bytes, % BW) to 8,192 (prefill: % of the bf16 matmul ceiling). Without a GPU only a small sweep
runs, through the Triton interpreter.
``--aot [SM ...]`` instead compiles every kernel variant the launchers pick for CUDA targets
(default sm_90; no GPU needed) and prints shared memory, registers and spills from ptxas: what
the interpreter cannot tell. CI runs ``--aot 90 80`` (make test).
Exit status 1 if any check fails (with ``--aot``: a variant that does not compile or spills).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

AOT = (
    "--aot" in sys.argv
)  # compile for a GPU target without one: the kernels must not be interpreted
ON_GPU = torch.cuda.is_available() and not AOT
if AOT:
    os.environ.pop("TRITON_INTERPRET", None)
elif not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported, below

import triton  # noqa: E402

from engine.kernels._launch import num_sms  # noqa: E402
from engine.kernels.decode_attention import (  # noqa: E402
    choose_num_splits,
    decode_attention_ref,
    decode_attention_triton,
)
from engine.kernels.int8_matmul import int8_matmul_triton  # noqa: E402
from engine.kernels.kv_copy import (  # noqa: E402
    kv_gather_ref,
    kv_gather_triton,
    kv_scatter_triton,
)
from engine.kernels.kv_quant import quantize_int8  # noqa: E402
from engine.kernels.kv_store import kv_store_triton  # noqa: E402
from engine.kernels.prefill_attention import (  # noqa: E402
    prefill_attention_ref,
    prefill_attention_triton,
)
from engine.kernels.variants import ModelShape, variants  # noqa: E402


@dataclass(frozen=True)
class Model:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    layers: int


LLAMA = Model("d128", 32, 8, 128, 32)  # Llama-3-8B attention shape
SMOL = Model("smollm2", 9, 3, 64, 30)  # SmolLM2-135M, the default model
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}  # rtol = atol


@dataclass
class Case:
    kernel: str
    name: str
    flops: float
    bytes: float
    run: Callable[[], object] | None  # timed; None: correctness only
    check: Callable[[], tuple[float, bool, str]]  # -> (max abs error, ok, what was compared)


@dataclass
class Result:
    kernel: str
    case: str
    flops: float
    bytes: float
    ms: float | None
    tflops: float | None
    gbps: float | None
    frac_peak_flops: float | None
    frac_peak_bw: float | None
    max_err: float
    ok: bool
    checked: str


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def _kv_label(dtype: torch.dtype, kv_dtype: torch.dtype | None) -> str:
    """' kv i8' (or another dtype) where the KV cache's dtype is not the activations'."""
    if kv_dtype is None or kv_dtype == dtype:
        return ""
    return " kv " + ("i8" if kv_dtype == torch.int8 else _short(kv_dtype))


def _tol_dtype(dtype: torch.dtype, kv_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype whose tolerance a result meets: q is converted to a float cache's dtype
    (engine/kernels/_launch.py dot_dtype), and the output is q's: the looser of the two."""
    if kv_dtype is None or kv_dtype == torch.int8:
        return dtype
    return max((dtype, kv_dtype), key=lambda d: TOL[d])


def _compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> tuple[float, bool]:
    if out.isnan().any():
        return float("nan"), False
    diff = (out.float() - ref.float()).abs()
    tol = TOL[dtype]
    return float(diff.max()) if diff.numel() else 0.0, bool(
        (diff <= tol + tol * ref.float().abs()).all()
    )


def paged_inputs(seq_lens, model, block_size, dtype, device, spare_blocks=3, kv_dtype=None):
    """Random cache and a random permutation of its blocks as block tables, -1 past each end;
    ``kv_dtype``: the cache's (by default ``dtype``; int8 rows quantized from normal values)."""
    blocks = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks) + spare_blocks
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    table = torch.full((len(seq_lens), max(blocks) + 1), -1, dtype=torch.int32, device=device)
    if len(set(blocks)) == 1:
        table[:, : blocks[0]] = perm[: len(blocks) * blocks[0]].view(len(blocks), blocks[0])
    else:
        used = 0
        for b, n in enumerate(blocks):
            table[b, :n] = perm[used : used + n]
            used += n
    shape = (num_blocks, block_size, model.kv_heads, model.head_dim)
    kv_dtype = kv_dtype or dtype
    if kv_dtype == torch.int8:
        k_cache = quantize_int8(torch.randn(shape, device=device))
        v_cache = quantize_int8(torch.randn(shape, device=device))
    else:
        k_cache = torch.randn(shape, dtype=kv_dtype, device=device)
        v_cache = torch.randn(shape, dtype=kv_dtype, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return k_cache, v_cache, table, lens


def decode_case(
    model, seq_lens, dtype, device, block_size=16, num_splits=None, timed=True, kv_dtype=None
):
    k_cache, v_cache, table, lens = paged_inputs(
        seq_lens, model, block_size, dtype, device, kv_dtype=kv_dtype
    )
    batch, max_len = len(seq_lens), max(seq_lens)
    q = torch.randn(batch, model.heads, model.head_dim, dtype=dtype, device=device)
    out = torch.empty_like(q)
    scale = model.head_dim**-0.5

    def run():
        decode_attention_triton(
            q,
            k_cache,
            v_cache,
            table,
            lens,
            scale,
            out=out,
            max_seq_len=max_len,
            num_splits=num_splits,
        )

    def check():
        out.fill_(float("nan"))
        run()
        n = min(batch, 8)  # the reference materialises K/V in fp32: keep it to a few sequences
        ref = decode_attention_ref(q[:n], k_cache, v_cache, table[:n], lens[:n], scale)
        err, ok = _compare(out[:n], ref, _tol_dtype(dtype, kv_dtype))
        ok = ok and not bool(out.isnan().any())
        return err, ok, "all" if n == batch else f"first {n} of {batch} seqs"

    el = q.element_size()
    tokens = sum(seq_lens)
    flops = 4.0 * model.heads * model.head_dim * tokens
    row_bytes = k_cache.shape[-1] * k_cache.element_size()  # int8: the values and their scale
    nbytes = 2.0 * tokens * model.kv_heads * row_bytes + 2.0 * q.numel() * el
    splits = num_splits or choose_num_splits(batch, model.kv_heads, max_len, num_sms(device))
    lens_name = f"ctx {max_len}" if len(set(seq_lens)) == 1 else f"ctx {seq_lens}"
    kv = _kv_label(dtype, kv_dtype)
    name = (
        f"{model.name} {_short(dtype)}{kv} bs{block_size} batch {batch} {lens_name} splits {splits}"
    )
    return Case("decode", name, flops, nbytes, run if timed else None, check)


def prefill_case(model, chunks, prefixes, dtype, device, block_size=16, timed=True, kv_dtype=None):
    seq_lens = [c + p for c, p in zip(chunks, prefixes, strict=True)]
    k_cache, v_cache, table, lens = paged_inputs(
        seq_lens, model, block_size, dtype, device, kv_dtype=kv_dtype
    )
    tol = _tol_dtype(dtype, kv_dtype)
    total = sum(chunks)
    q = torch.randn(total, model.heads, model.head_dim, dtype=dtype, device=device)
    out = torch.empty_like(q)
    cu_list = [0]
    for c in chunks:
        cu_list.append(cu_list[-1] + c)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    scale = model.head_dim**-0.5

    def run():
        prefill_attention_triton(
            q,
            k_cache,
            v_cache,
            table,
            cu,
            lens,
            scale,
            out=out,
            max_seqlen_q=max(chunks),
            max_seq_len=max(seq_lens),
        )

    def check():
        out.fill_(float("nan"))
        run()
        if not timed:  # small: the whole batch
            ref = prefill_attention_ref(q, k_cache, v_cache, table, cu, lens, scale)
            err, ok = _compare(out, ref, tol)
            return err, ok, "all"
        # Query i's output depends only on its position, so the first and the last k queries of
        # the first chunk are checked as chunks of their own (the reference is a python loop).
        c, p, k = chunks[0], prefixes[0], min(chunks[0], 128)
        errs, oks = [], []
        for lo in (0, c - k):
            sub_cu = torch.tensor([0, k], dtype=torch.int32, device=device)
            sub_len = torch.tensor([p + lo + k], dtype=torch.int32, device=device)
            ref = prefill_attention_ref(
                q[lo : lo + k], k_cache, v_cache, table[:1], sub_cu, sub_len, scale
            )
            err, ok = _compare(out[lo : lo + k], ref, tol)
            errs.append(err)
            oks.append(ok)
        ok = all(oks) and not bool(out.isnan().any())
        return max(errs), ok, f"first+last {k} queries of chunk 0, no NaN anywhere"

    el = q.element_size()
    pairs = sum(c * p + c * (c + 1) / 2 for c, p in zip(chunks, prefixes, strict=True))
    flops = 4.0 * model.heads * model.head_dim * pairs
    row_bytes = k_cache.shape[-1] * k_cache.element_size()
    nbytes = el * 2.0 * q.numel() + 2.0 * sum(seq_lens) * model.kv_heads * row_bytes
    shape = (
        f"{len(chunks)}x chunk {chunks[0]} prefix {prefixes[0]}"
        if len(set(chunks)) == 1 and len(set(prefixes)) == 1
        else f"chunks {chunks} prefixes {prefixes}"
    )
    name = f"{model.name} {_short(dtype)}{_kv_label(dtype, kv_dtype)} bs{block_size} {shape}"
    return Case("prefill", name, flops, nbytes, run if timed else None, check)


def store_case(model, tokens, dtype, device, num_blocks, block_size=16, timed=True):
    shape = (num_blocks, block_size, model.kv_heads, model.head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    fused = torch.randn(tokens, model.heads + 2 * model.kv_heads, model.head_dim, device=device)
    fused = fused.to(dtype)
    key = fused[:, model.heads : model.heads + model.kv_heads]  # strided, as the runtime has it
    value = fused[:, model.heads + model.kv_heads :]
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    if tokens > 1:
        slots[-1] = -1  # padding: skipped

    def run():
        kv_store_triton(key, value, k_cache, v_cache, slots)

    def check():
        run()
        valid = slots >= 0
        got_k = k_cache.view(-1, model.kv_heads, model.head_dim)[slots[valid]]
        got_v = v_cache.view(-1, model.kv_heads, model.head_dim)[slots[valid]]
        ok = torch.equal(got_k, key[valid]) and torch.equal(got_v, value[valid])
        written = int(valid.sum()) * model.kv_heads * model.head_dim
        ok = ok and int((~k_cache.isnan()).sum()) == written  # nothing else touched
        err = float((got_k.float() - key[valid].float()).abs().max()) if written else 0.0
        return err, ok, "exact, written slots; rest untouched"

    el = key.element_size()
    nbytes = 4.0 * tokens * model.kv_heads * model.head_dim * el + 8.0 * tokens
    big = num_blocks * block_size * model.kv_heads * model.head_dim >= 2**31
    name = f"{model.name} {_short(dtype)} {tokens} tokens into {num_blocks} blocks" + (
        " (>2^31 elems)" if big else ""
    )
    return Case("kv_store", name, 0.0, nbytes, run if timed else None, check)


def store_int8_case(model, tokens, dtype, device, num_blocks, block_size=16):
    """The KV store into int8 rows: each written row equal to kv_quant.quantize_int8 of its
    input, bit for bit; every other row untouched."""
    shape = (num_blocks, block_size, model.kv_heads, model.head_dim + 2)
    k_cache = torch.full(shape, 7, dtype=torch.int8, device=device)
    v_cache = torch.full(shape, 7, dtype=torch.int8, device=device)
    fused = torch.randn(tokens, model.heads + 2 * model.kv_heads, model.head_dim, device=device)
    fused = fused.to(dtype)
    key = fused[:, model.heads : model.heads + model.kv_heads]
    value = fused[:, model.heads + model.kv_heads :]
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    if tokens > 1:
        slots[-1] = -1

    def run():
        kv_store_triton(key, value, k_cache, v_cache, slots)

    def check():
        run()
        valid = slots >= 0
        rows = (-1, model.kv_heads, model.head_dim + 2)
        got_k, got_v = k_cache.view(rows)[slots[valid]], v_cache.view(rows)[slots[valid]]
        want_k, want_v = quantize_int8(key[valid]), quantize_int8(value[valid])
        differ = int((got_k != want_k).sum() + (got_v != want_v).sum())
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
        untouched[slots[valid]] = False
        ok = differ == 0 and bool((k_cache.view(rows)[untouched] == 7).all())
        return (
            float(differ),
            ok,
            "bit for bit quantize_int8 (err = bytes that differ); rest untouched",
        )

    nbytes = 2.0 * tokens * model.kv_heads * (model.head_dim * key.element_size() + shape[-1])
    name = f"{model.name} {_short(dtype)} kv i8 {tokens} tokens into {num_blocks} blocks"
    return Case("kv_store", name, 0.0, nbytes, None, check)


def copy_case(model, n, dtype, device, layers, num_blocks, gather, block_size=16, timed=True):
    cache = torch.randn(
        layers,
        2,
        num_blocks,
        block_size,
        model.kv_heads,
        model.head_dim,
        dtype=dtype,
        device=device,
    )
    ids = torch.randperm(num_blocks, device=device)[:n]
    staging = torch.randn(cache[:, :, :n].shape, dtype=dtype, device=device)

    def run():
        if gather:
            kv_gather_triton(cache, ids, staging)
        else:
            kv_scatter_triton(staging, ids, cache)

    def check():
        if gather:
            staging.fill_(float("nan"))
            run()
            ok = torch.equal(staging, kv_gather_ref(cache, ids, torch.empty_like(staging)))
        else:
            cache[:, :, ids] = float("nan")
            run()
            ok = torch.equal(cache[:, :, ids], staging) and not bool(cache.isnan().any())
        return 0.0 if ok else float("nan"), ok, "exact"

    nbytes = 2.0 * staging.numel() * staging.element_size()
    big = cache.numel() >= 2**31
    name = f"{model.name} {_short(dtype)} {n} blocks x {layers} layers x K,V" + (
        " (>2^31 elems)" if big else ""
    )
    return Case(
        "kv_gather" if gather else "kv_scatter", name, 0.0, nbytes, run if timed else None, check
    )


def int8_case(rows, out_features, in_features, dtype, device, timed=True, name=""):
    """y = x @ (qweight * scales)^T against float32 math on the dequantized weight (the first
    rows of x where the reference would be slow)."""
    g = torch.Generator(device=device).manual_seed(rows)
    qweight = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8,
                            device=device, generator=g)  # fmt: skip
    scales = (torch.rand(out_features, device=device, generator=g) * 1e-3 + 1e-4).to(dtype)
    x = torch.randn(rows, in_features, device=device, generator=g).to(dtype)
    out = {}

    def run():
        out["y"] = int8_matmul_triton(x, qweight, scales)

    def check():
        run()
        n = min(rows, 64)
        w = qweight.float() * scales.float()[:, None]
        ref = (x[:n].double() @ w.double().T).to(dtype)
        err, ok = _compare(out["y"][:n], ref, dtype)
        return err, ok, "all rows" if n == rows else f"first {n} of {rows} rows"

    el = x.element_size()
    flops = 2.0 * rows * out_features * in_features
    nbytes = out_features * in_features + (rows * (in_features + out_features) + out_features) * el
    label = f"{name} " if name else ""
    case = f"{label}{_short(dtype)} {rows} x {in_features} -> {out_features}"
    return Case("int8_mm", case, flops, nbytes, run if timed else None, check)


def sweep_cases(device) -> Iterator[Callable[[], Case]]:
    """Small, odd shapes for correctness only: on CPU through the interpreter, on a GPU to prove
    that every kernel variant compiles (dot shapes, shared memory) and matches."""
    odd = [
        (SMOL, torch.float32, 16),
        (SMOL, torch.bfloat16, 32),
        (SMOL, torch.float16, 8),
        (Model("g4d80", 8, 2, 80, 2), torch.float32, 64),
        (Model("g1d96", 4, 4, 96, 2), torch.bfloat16, 128),
        (Model("d128", 8, 2, 128, 2), torch.float16, 16),
    ]
    for model, dtype, bs in odd:
        yield lambda m=model, d=dtype, b=bs: prefill_case(
            m, [1, 37, 20, 150], [45, 13, 0, 7], d, device, block_size=b, timed=False
        )
        yield lambda m=model, d=dtype, b=bs: prefill_case(
            m, [1, 1, 1], [5, 17, 64], d, device, block_size=b, timed=False
        )
        for splits in (1, 5):
            yield lambda m=model, d=dtype, b=bs, s=splits: decode_case(
                m, [1, 17, 100, 257], d, device, block_size=b, num_splits=s, timed=False
            )
        yield lambda m=model, d=dtype, b=bs: store_case(m, 37, d, device, 16, b, timed=False)
        for gather in (True, False):
            yield lambda m=model, d=dtype, b=bs, g=gather: copy_case(
                m, 5, d, device, 2, 12, g, block_size=b, timed=False
            )
    # Other KV cache dtypes (--kv-cache-dtype): int8 under each activation dtype, and a 16-bit
    # cache under float32 and bf16 activations.
    kv_pairs = [
        (SMOL, torch.float32, torch.int8, 16),
        (SMOL, torch.bfloat16, torch.int8, 16),
        (Model("d128", 8, 2, 128, 2), torch.float16, torch.int8, 32),
        (Model("g4d80", 8, 2, 80, 2), torch.bfloat16, torch.int8, 16),
        (SMOL, torch.float32, torch.bfloat16, 16),
        (SMOL, torch.bfloat16, torch.float16, 16),
    ]
    for model, dtype, kv, bs in kv_pairs:
        yield lambda m=model, d=dtype, k=kv, b=bs: prefill_case(
            m, [1, 37, 20, 150], [45, 13, 0, 7], d, device, block_size=b, timed=False, kv_dtype=k
        )
        for splits in (1, 5):
            yield lambda m=model, d=dtype, k=kv, b=bs, s=splits: decode_case(
                m, [1, 17, 100, 257], d, device, block_size=b, num_splits=s, timed=False,
                kv_dtype=k,
            )  # fmt: skip
        if kv == torch.int8:
            yield lambda m=model, d=dtype, b=bs: store_int8_case(m, 37, d, device, 16, b)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows in (1, 3, 17, 64, 130):
            for out_f, in_f in ((77, 100), (33, 200)):  # in not a multiple of BLOCK_K; out odd
                yield lambda r=rows, o=out_f, i=in_f, d=dtype: int8_case(
                    r, o, i, d, device, timed=False
                )


# Llama-3-8B's projections (out, in): fused qkv, o_proj, fused gate_up, down_proj.
INT8_SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
               ("down", 4096, 14336)]  # fmt: skip


def timed_cases(device, quick: bool) -> Iterator[Callable[[], Case]]:
    bf16 = torch.bfloat16
    for model in (LLAMA, SMOL):
        sizes = [(1, 512), (1, 4096), (1, 32768), (8, 4096), (32, 8192), (256, 4096)]
        if not quick:
            sizes += [(8, 32768), (64, 2048), (128, 8192), (256, 32768)]
        for batch, ctx in sizes:
            yield lambda m=model, b=batch, c=ctx: decode_case(m, [c] * b, bf16, device)
        for batch, ctx in ((1, 32768), (256, 4096)):  # int8 KV: about half the bytes read
            yield lambda m=model, b=batch, c=ctx: decode_case(
                m, [c] * b, bf16, device, kv_dtype=torch.int8
            )
        chunks = [(1, 512, 0), (1, 2048, 0), (1, 8192, 0), (1, 512, 8192), (1, 2048, 8192)]
        if not quick:
            chunks += [(1, 8192, 8192), (4, 2048, 2048), (1, 512, 32768)]
        for n, chunk, prefix in chunks:
            yield lambda m=model, n=n, c=chunk, p=prefix: prefill_case(
                m, [c] * n, [p] * n, bf16, device
            )
        yield lambda m=model: prefill_case(m, [2048], [8192], bf16, device, kv_dtype=torch.int8)
        # > 2^31 elements per layer's K: block and slot offsets must be computed in int64.
        big_blocks = 2**31 // (16 * model.kv_heads * model.head_dim) + 1024
        for tokens in (1, 256, 8192) if quick else (1, 16, 256, 2048, 8192, 32768):
            yield lambda m=model, t=tokens, nb=big_blocks: store_case(m, t, bf16, device, nb)
        for n in (1, 64, 1024) if quick else (1, 16, 64, 256, 1024):
            for gather in (True, False):
                yield lambda m=model, n=n, g=gather: copy_case(
                    m, n, bf16, device, m.layers, 2048, g
                )
    # The int8 GEMM: decode rows are weight-bound (read % BW), prefill rows FLOP-bound.
    for rows in (1, 16, 256, 2048) if quick else (1, 4, 16, 64, 256, 2048, 8192):
        for label, out_f, in_f in INT8_SHAPES:
            yield lambda r=rows, n=label, o=out_f, i=in_f: int8_case(
                r, o, i, bf16, device, name=f"llama8b {n}"
            )


def _copy_ceiling() -> float:
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB, far above the L2
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), return_mode="median")
    return 2 * x.numel() * x.element_size() / ms / 1e6  # GB/s, bytes read + written


def _matmul_ceiling(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = triton.testing.do_bench(lambda: a @ b, return_mode="median")
    return 2 * n**3 / ms / 1e9  # TFLOP/s


def ceilings() -> dict[str, float]:
    result = {"copy_GBps": _copy_ceiling(), "matmul_bf16_TFLOPs": _matmul_ceiling()}
    torch.cuda.empty_cache()
    return result


def gpu_info() -> dict[str, object]:
    info: dict[str, object] = {"torch": torch.__version__, "triton": triton.__version__}
    if not ON_GPU:
        return info
    props = torch.cuda.get_device_properties(0)
    info.update(
        name=props.name,
        sms=props.multi_processor_count,
        memory_GiB=round(props.total_memory / 2**30, 1),
        capability=f"{props.major}.{props.minor}",
    )
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        name = pynvml.nvmlDeviceGetName(h)
        info["nvml_name"] = name.decode() if isinstance(name, bytes) else name
        info["nvml_memory_GiB"] = round(pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30, 1)
        info["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
        for key, clock in (("sm", pynvml.NVML_CLOCK_SM), ("mem", pynvml.NVML_CLOCK_MEM)):
            info[f"clock_{key}_MHz"] = pynvml.nvmlDeviceGetClockInfo(h, clock)
            info[f"clock_{key}_max_MHz"] = pynvml.nvmlDeviceGetMaxClockInfo(h, clock)
    except Exception as exc:  # NVML is informative only
        info["nvml_error"] = repr(exc)
    return info


def run_case(make: Callable[[], Case], ceil: dict[str, float], quick: bool) -> Result:
    try:
        case = make()
        err, ok, what = case.check()
        ms = tflops = gbps = f_flops = f_bw = None
        if case.run is not None and ON_GPU:
            warmup, rep = (10, 40) if quick else (25, 100)
            ms = triton.testing.do_bench(case.run, warmup=warmup, rep=rep, return_mode="median")
            tflops = case.flops / ms / 1e9 if case.flops else None
            gbps = case.bytes / ms / 1e6
            f_bw = gbps / ceil["copy_GBps"]
            f_flops = tflops / ceil["matmul_bf16_TFLOPs"] if tflops else None
        result = Result(
            case.kernel,
            case.name,
            case.flops,
            case.bytes,
            ms,
            tflops,
            gbps,
            f_flops,
            f_bw,
            err,
            ok,
            what,
        )
    except Exception as exc:  # report and go on: one broken variant must not hide the others
        msg = f"raised {type(exc).__name__}: {exc}".replace("\n", " ")[:300]
        result = Result(
            "?",
            "(failed to build or run)",
            0,
            0,
            None,
            None,
            None,
            None,
            None,
            float("nan"),
            False,
            msg,
        )
    finally:
        if ON_GPU:
            torch.cuda.empty_cache()
    return result


# Spills accepted, each with its bound: (sm, kernel, constexprs it has, most bytes). sm_80 keeps
# mma.sync accumulators in registers beside int8 K and V widened in registers; these three
# int8-KV prefill variants (head dims 64 and 80, GQA groups 3 and 4) spill a few bytes whatever
# the tile and warp count tried (docs/kernels.md). sm_90 spills nowhere.
KNOWN_SPILLS = (
    (80, "_prefill_kernel", ("HEAD_DIM=64,", "GROUP=3,", "BLOCK_M=16,", "KV_INT8=True"), 8),
    (80, "_prefill_kernel", ("HEAD_DIM=64,", "GROUP=3,", "BLOCK_M=64,", "KV_INT8=True"), 16),
    (80, "_prefill_kernel", ("HEAD_DIM=80,", "GROUP=4,", "BLOCK_M=16,", "KV_INT8=True"), 4),
)


def _known_spill(arch: int, kernel: str, consts: str, spilled: int) -> bool:
    return any(
        arch == sm and kernel == name and all(p in consts for p in parts) and spilled <= most
        for sm, name, parts, most in KNOWN_SPILLS
    )


def aot_compile(arch: int) -> int:
    """Compile, without a GPU, each kernel variant the launchers choose over a set of shapes (the
    engine's warm-up table, engine/kernels/variants.py), for CUDA sm_<arch>, and report what
    ptxas says. The launchers run on small CPU tensors with ``kernel[grid](...)`` replaced by
    a compile of the same signature and constexprs."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    mods = [sys.modules[f"engine.kernels.{n}"] for n in ("prefill_attention", "decode_attention")]
    mods += [sys.modules[f"engine.kernels.{n}"] for n in ("kv_store", "kv_copy", "int8_matmul")]
    for mod in mods:
        mod.check_devices = lambda *a, **k: torch.device("cpu")
        mod.capability = lambda *a, **k: (arch // 10, arch % 10)  # configs chosen per target
    types = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    types |= {torch.int8: "i8", torch.int32: "i32", torch.int64: "i64"}
    ptxas = get_ptxas(arch).path
    rows, seen = [], set()

    def compile_launch(fn, args, kwargs):
        warps, stages = kwargs.pop("num_warps", 4), kwargs.pop("num_stages", 3)
        sig, attrs = {}, {}
        for i, (name, a) in enumerate(zip(fn.arg_names, args, strict=False)):
            if isinstance(a, torch.Tensor):
                sig[name] = "*" + types[a.dtype]
            elif isinstance(a, float):
                sig[name] = "fp32"
            else:
                sig[name] = "i64" if abs(a) >= 2**31 else "i32"
            if isinstance(a, int) and a % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]  # as the launch-time specialisation does
            elif isinstance(a, torch.Tensor) and a.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        sig |= {k: "constexpr" for k in kwargs}
        key = (fn.__name__, str(sorted(sig.items())), str(sorted(kwargs.items())), warps, stages)
        if key in seen:
            return
        seen.add(key)
        consts = ", ".join(f"{k}={v}" for k, v in kwargs.items() if k != "PRECISION")
        try:
            kernel = triton.compile(
                ASTSource(fn, sig, kwargs, attrs),
                target=GPUTarget("cuda", arch, 32),
                options={"num_warps": warps, "num_stages": stages},
            )
            ptx = kernel.asm["ptx"]
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                f.write(ptx)
                f.flush()
                suffix = "a" if arch >= 90 else ""  # sm_90a: wgmma; ptxas has no sm_80a
                cmd = [ptxas, f"-arch=sm_{arch}{suffix}", "-v", f.name, "-o", os.devnull]
                info = subprocess.run(cmd, capture_output=True, text=True).stderr
            regs = re.findall(r"Used (\d+) registers", info)
            if not regs:  # ptxas refused the PTX or the target: nothing was checked
                raise RuntimeError(f"ptxas -arch=sm_{arch}{suffix}: {info.strip()[:200]}")
            spills = re.findall(r"(\d+) bytes spill stores", info)
            mma = "wgmma" if "wgmma" in ptx else "mma" if "mma.sync" in ptx else "-"
            row = (fn.__name__, consts, warps, stages, kernel.metadata.shared, regs, spills, mma)
            rows.append(row)
            print(
                f"  ok     {fn.__name__} {consts} warps {warps}: shared {row[4]} B, "
                f"regs {regs}, spill stores {spills}, {mma}",
                flush=True,
            )
        except Exception as exc:
            rows.append((fn.__name__, consts, warps, stages, None, None, None, str(exc)[:200]))
            print(f"  FAILED {fn.__name__} {consts}: {exc}", flush=True)

    class Launch:
        def __init__(self, fn):
            self.fn = fn

        def __call__(self, *args, **kwargs):
            compile_launch(self.fn, args, kwargs)

    JITFunction.__getitem__ = lambda self, grid: Launch(self)
    # The engine's warm-up table (engine/kernels/variants.py) over these model shapes.
    int8_weights = ((4096, 4096),)
    shapes = [(9, 3, 64, False), (32, 8, 128, False), (8, 2, 80, False), (4, 4, 96, True)]
    shapes += [(8, 1, 256, False)]
    # Each activation dtype over a cache of its own dtype and an int8 one (--kv-cache-dtype),
    # and float pairs of each kind (a 16-bit cache under float32 activations or another 16-bit
    # dtype: q converted; a float32 cache under bf16: K and V converted).
    kv_dtypes = {
        torch.bfloat16: (None, torch.int8, torch.float16, torch.float32),
        torch.float16: (None, torch.int8),
        torch.float32: (None, torch.int8, torch.bfloat16),
    }
    for dtype, kvs in kv_dtypes.items():
        for heads, kv_heads, dim, qk_norm in shapes:
            # One int8 projection, 4096 x 4096: the int8 GEMM's tiles and row classes.
            shape = ModelShape(heads, kv_heads, dim, qk_norm=qk_norm, int8_projections=int8_weights)
            for kv_dtype in kvs:
                for call in variants(shape, 16, dtype, torch.device("cpu"), kv_dtype):
                    call.run()
    failed = sum(r[4] is None for r in rows)
    spilled = [r for r in rows if r[4] is not None and any(int(n) for n in r[6])]
    known = [r for r in spilled if _known_spill(arch, r[0], r[1], max(int(n) for n in r[6]))]
    for r in known:
        print(f"KNOWN  {r[0]} {r[1]} warps {r[2]}: spill stores {r[6]} bytes (KNOWN_SPILLS)")
    spilled = [r for r in spilled if r not in known]
    print(f"\n{len(rows) - failed}/{len(rows)} kernel variants compiled for sm_{arch}")
    for r in spilled:
        print(f"SPILL  {r[0]} {r[1]} warps {r[2]}: spill stores {r[6]} bytes")
    if spilled:
        print(f"{len(spilled)} variant(s) spill registers to local memory on sm_{arch}")
    return 1 if failed or spilled else 0


def _aot_captured(arch: int) -> tuple[int, str]:
    """aot_compile(arch) with what it prints returned (a worker process of --aot A B ...)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = aot_compile(arch)
    return rc, out.getvalue()


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}"


def table(results: list[Result]) -> str:
    head = "| kernel | case | time us | TFLOP/s | % peak | GB/s | % BW | max err | ok | checked |"
    lines = [head, "|" + " --- |" * 10]
    for r in results:
        lines.append(
            f"| {r.kernel} | {r.case} | {_fmt(r.ms and r.ms * 1e3, '.1f')} "
            f"| {_fmt(r.tflops, '.1f')} | {_pct(r.frac_peak_flops)} "
            f"| {_fmt(r.gbps, '.0f')} | {_pct(r.frac_peak_bw)} "
            f"| {r.max_err:.1e} | {'yes' if r.ok else 'NO'} | {r.checked} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, shorter timing")
    parser.add_argument("--json", type=Path, help="write results and GPU info as JSON")
    parser.add_argument("--md", type=Path, help="write the report as a markdown file")
    parser.add_argument(
        "--aot",
        type=int,
        nargs="*",
        metavar="SM",
        help="no GPU needed: compile every kernel variant for each sm_SM (default 90; e.g. "
        "--aot 90 80), report registers and spills; exit 1 on a compile error or a spill",
    )
    args = parser.parse_args(argv)
    if args.aot is not None:
        archs = args.aot or [90]
        if len(archs) == 1:
            return aot_compile(archs[0])
        # One process per target, at most one per core (CI's make test runs --aot 90 80): each
        # prints its table when done, so the tables do not interleave.
        import concurrent.futures
        import multiprocessing

        workers = min(len(archs), os.cpu_count() or 1)
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            done = list(pool.map(_aot_captured, archs))
        for _, text in done:
            print(text, end="", flush=True)
        return max(rc for rc, _ in done)
    start = time.time()
    info = gpu_info()
    header = [f"# Kernel profile ({time.strftime('%Y-%m-%d %H:%M:%S')})", ""]
    header.append("- " + ", ".join(f"{k} {v}" for k, v in info.items()))
    device = torch.device("cuda" if ON_GPU else "cpu")
    ceil: dict[str, float] = {}
    if ON_GPU:
        ceil = ceilings()
        header.append(
            f"- ceilings measured in this run: copy {ceil['copy_GBps']:.0f} GB/s (read+write), "
            f"bf16 matmul 8192^3 {ceil['matmul_bf16_TFLOPs']:.0f} TFLOP/s"
        )
    else:
        header.append("- no GPU: no timings were taken (correctness sweep through the interpreter)")
    print("\n".join(header), flush=True)

    torch.manual_seed(0)
    sections: list[tuple[str, list[Result]]] = []
    groups = [("correctness sweep (odd shapes)", sweep_cases(device))]
    if ON_GPU:
        groups.append(("timed cases (bf16, block size 16)", timed_cases(device, args.quick)))
    for title, makers in groups:
        results = []
        for make in makers:
            r = run_case(make, ceil, args.quick)
            results.append(r)
            status = "ok" if r.ok else "FAILED"
            timing = f" {r.ms * 1e3:.1f} us" if r.ms is not None else ""
            print(f"  {status:6} {r.kernel:10} {r.case}{timing} ({r.checked})", flush=True)
        sections.append((title, results))

    if ON_GPU:
        info_after = gpu_info()
        clocks = {k: v for k, v in info_after.items() if k.startswith("clock_")}
        if clocks:
            header.append(
                "- clocks after the timed cases: "
                + ", ".join(f"{k} {v}" for k, v in clocks.items())
            )
    failed = sum(not r.ok for _, rs in sections for r in rs)
    total = sum(len(rs) for _, rs in sections)
    body = header + [""]
    for title, results in sections:
        body += [f"## {title}", "", table(results), ""]
    body.append(f"{total - failed}/{total} checks passed in {time.time() - start:.0f} s.")
    if not ON_GPU:
        body.append("no GPU: no timings were taken")
    report = "\n".join(body)
    print("\n" + report)
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(report + "\n")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "info": info,
            "ceilings": ceil,
            "results": {t: [asdict(r) for r in rs] for t, rs in sections},
            "failed": failed,
        }
        args.json.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
