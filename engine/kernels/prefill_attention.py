"""Chunked-prefill attention over a paged KV cache.

A flat batch of query chunks (``cu_seqlens_q``); chunk b holds the last ``q_len_b`` tokens of a
sequence whose total length so far is ``seq_lens[b]`` (cached prefix + this chunk). The chunk's own
K/V must already be written to the cache (``kv_store``) before the call. Query i of chunk b sits at
absolute position ``seq_lens[b] - q_len_b + i`` and attends causally to positions <= its own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels._launch import (
    INDEX_DTYPES,
    KV_DTYPES,
    attention_strides,
    capability,
    check_devices,
    check_dot_shape,
    check_paged_attention,
    check_tensor,
    dot_dtype,
    dot_in_f32,
    dot_precision,
    on_tensor_device,
    pad_dim,
)
from engine.kernels.kv_quant import dequantize_int8, is_quantized
from engine.kernels.paged_gather import gather_blocks
from engine.kernels.paged_tile import paged_tile_step

LOG2E = 1.4426950408889634


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_row: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence, [length, Hkv, D], read through its block-table row."""
    block_size = k_cache.shape[1]
    n = -(-length // block_size)
    blocks = block_row[:n].long()
    k = gather_blocks(k_cache, blocks).reshape(n * block_size, *k_cache.shape[2:])[:length]
    v = gather_blocks(v_cache, blocks).reshape(n * block_size, *v_cache.shape[2:])[:length]
    if is_quantized(k_cache.dtype):  # int8 rows with their scales: as float32 values
        return dequantize_int8(k), dequantize_int8(v)
    return k, v


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D]; k_cache/v_cache: [num_blocks, block_size, Hkv, D];
    block_tables: [B, max_blocks] int32; cu_seqlens_q: [B + 1] int32; seq_lens: [B] int32.
    Returns out [T, Hq, D] in q's dtype. max_seqlen_q/max_seq_len are launch hints (unused here)."""
    if out is None:
        out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        start, end, kv_len = cu[b], cu[b + 1], lens[b]
        if end == start:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], kv_len)
        _attend_chunk(q[start:end], k, v, scale, out[start:end])
    return out


# Query rows per GEMM pass: small enough that a pass skips most keys past its last row (causal),
# large enough for the GEMMs to run at speed. Measured on the default model's heads: 2-4x faster
# than the CPU's scaled_dot_product_attention (float32, with a mask), 400 x 400 to 2,048 x 2,048.
_PREFILL_ROWS = 64
_PREFILL_SCORE_BYTES = 8 << 20


def _attend_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor
) -> None:
    """q [q_len, Hq, D] are the last q_len of the kv_len positions of k/v [kv_len, Hkv, D]; writes
    causal attention into out [q_len, Hq, D]. Float32 GEMMs over the query rows of a KV head's
    group at once ([G * rows, D] @ [D, keys]), a pass of rows at a time: a pass reads only the
    keys its last row can see and masks only its own n x n corner."""
    q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    past = kv_len - q_len
    kf = k.permute(1, 0, 2).float()  # [Hkv, kv_len, D]
    vf = v.permute(1, 0, 2).float()
    rows = max(1, min(_PREFILL_ROWS, _PREFILL_SCORE_BYTES // (num_heads * kv_len * 4)))
    for i0 in range(0, q_len, rows):
        n = min(rows, q_len - i0)
        keys = past + i0 + n  # the last row of this pass sees keys [0, keys)
        qg = q[i0 : i0 + n].view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        qg = qg.reshape(num_kv_heads, group * n, head_dim).float() * scale
        s = torch.bmm(qg, kf[:, :keys].transpose(1, 2))  # [Hkv, G * n, keys]
        # Row r sits at position past + i0 + r: of the last n keys it sees the first r + 1.
        corner = s.view(num_kv_heads, group, n, keys)[..., keys - n :]
        ahead = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)
        corner.masked_fill_(ahead, float("-inf"))
        o = torch.bmm(torch.softmax(s, dim=-1), vf[:, :keys])  # [Hkv, G * n, D]
        out[i0 : i0 + n] = (
            o.view(num_kv_heads, group, n, head_dim)
            .permute(2, 0, 1, 3)
            .reshape(n, num_heads, head_dim)
        )


@triton.jit
def _find_seq_idx(cu_seqlens_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence of q-block ``q_block``. Sequence b owns the q-blocks from
    cu_seqlens[b] // BLOCK_Q + b on (at least one each, so the starts strictly increase); binary
    search for the last start <= q_block (vLLM ``find_seq_idx``)."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        start = tl.load(cu_seqlens_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    cu_seqlens_ptr,
    seq_lens_ptr,
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # tile rows = BLOCK_Q positions x GROUP heads (+ masked padding)
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,  # KV positions per iteration
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_INT8: tl.constexpr,
    Q_AS_KV: tl.constexpr,
):
    # Grid (q-blocks upper bound, kv heads). Row r of the tile is query position
    # q_block*BLOCK_Q + r // GROUP of the chunk and query head kv_head*GROUP + r % GROUP, so each
    # K/V tile is loaded once for the whole GQA group.
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq_idx(cu_seqlens_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return  # past the last q-block of the last sequence (the grid is an upper bound)
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = local * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    # Rows >= BLOCK_Q*GROUP would alias the next q-block's first position: keep them out.
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q_off = token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if Q_AS_KV:  # a float32 q over a 16-bit cache: dots in the cache's dtype (dot_dtype)
        q = q.to(k_cache_ptr.dtype.element_ty)
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = context + q_idx  # absolute position: attends to keys at positions <= q_pos

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # Causal bound: no row of this block sees past its last valid query position.
    kv_end = context + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    for start in range(0, kv_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_ok = pos < kv_end
        allowed = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        m_i, l_i, acc = paged_tile_step(
            q, allowed, table, k_base, v_base, pos, pos_ok, d, d_ok, m_i, l_i, acc,
            stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
            BLOCK_SIZE, DOT_F32, PRECISION, KV_INT8, HEAD_DIM,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(
        out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :]
    )


class PrefillConfig(NamedTuple):
    block_m: int
    block_q: int
    tile_n: int
    num_warps: int
    num_stages: int


def prefill_config(
    max_seqlen_q: int,
    group: int,
    head_dim_pad: int,
    dtype: torch.dtype,
    capability: tuple[int, int] = (9, 0),
    kv_converted: bool = False,
) -> PrefillConfig:
    """Tile sizes. Short queries (decode, small chunks) get the 16-row tile vLLM uses, so a q_len
    of 1 wastes little; long chunks get 64 or 128 rows for more reuse of each K/V tile. Head dims
    > 128 get smaller tiles to stay inside shared memory. fp32 runs IEEE fp32 dots on the CUDA
    cores, whose register use grows with the tile: the smallest tiles keep spills down (fp32 is
    for checking, not for speed).

    No variant may spill registers (``profiling/kernels.py --aot 90 80``, which CI runs, fails on
    a spill; Triton 3.9): on sm_90 the 16-row tiles are not software-pipelined (2 stages spilled
    4-8 bytes in five variants; their loops are short anyway); on sm_80 (mma.sync keeps the
    accumulators in registers) the 64-row tiles of 128-wide heads take 32 keys at a time (head dim
    96 spilled 72 bytes at 64) and fp32 keeps 2 stages (1 spilled 16 bytes)."""
    hopper = capability >= (9, 0)
    if dtype == torch.float32:
        block_m, tile_n = 16, 16
    elif max_seqlen_q * group <= 32:
        block_m, tile_n = 16, 64 if head_dim_pad <= 128 else 32
    elif max_seqlen_q * group <= 128 or head_dim_pad > 128:
        wide = head_dim_pad > 128 or (head_dim_pad == 128 and not hopper)
        block_m, tile_n = 64, 32 if wide else 64
    else:
        block_m, tile_n = 128, 64
    if kv_converted:  # K and V (or q) converted in registers before the dots: fewer keys a tile
        tile_n = min(tile_n, 32 if head_dim_pad <= 128 and block_m > 16 else 16)
    block_m = max(block_m, triton.next_power_of_2(group))
    pipelined = block_m > 16 or (dtype == torch.float32 and not hopper)
    num_warps = 8 if block_m >= 128 else 4
    if kv_converted and not hopper:
        # mma.sync keeps the accumulators in registers beside the converted tiles: spread the
        # 64-row tiles over 8 warps and drop the pipeline's second stage (three int8 variants
        # still spill 4-16 bytes on sm_80: profiling/kernels.py KNOWN_SPILLS).
        num_warps = 8 if block_m >= 64 else 4
        pipelined = False
    return PrefillConfig(
        block_m=block_m,
        block_q=block_m // group,
        tile_n=tile_n,
        num_warps=num_warps,
        num_stages=2 if pipelined else 1,
    )


@on_tensor_device
def prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Same contract as prefill_attention_ref. No host sync: the grid is sized from q.shape[0]
    and max_seqlen_q (q.shape[0] when None) picks the tile; metadata values are trusted.
    max_seq_len is unused (accepted for the common signature)."""
    check_paged_attention(q, k_cache, v_cache, KV_DTYPES)
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, contiguous=True)
    num_seqs = seq_lens.shape[0]
    check_tensor(
        "cu_seqlens_q",
        cu_seqlens_q,
        ndim=1,
        dtypes=INDEX_DTYPES,
        shape=(num_seqs + 1,),
        contiguous=True,
    )
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, shape=(num_seqs, None))
    check_tensor("block_tables", block_tables, last_contiguous=True)
    if out is None:
        out = torch.empty_like(q)
    check_tensor("out", out, dtypes=(q.dtype,), shape=tuple(q.shape), last_contiguous=True)
    check_devices(
        _prefill_kernel,
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        out=out,
    )
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    head_dim_pad = pad_dim(head_dim)
    dots = dot_dtype(q.dtype, k_cache.dtype)
    cfg = prefill_config(
        max_seqlen_q or num_tokens,
        group,
        head_dim_pad,
        dots,
        capability(q.device),
        kv_converted=k_cache.dtype != q.dtype,
    )
    check_dot_shape(cfg.block_m, cfg.tile_n, head_dim_pad)
    check_dot_shape(cfg.block_m, head_dim_pad, cfg.tile_n)
    grid = (num_tokens // cfg.block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        float(scale) * LOG2E,
        num_seqs,
        *attention_strides(q, k_cache, v_cache, out, block_tables),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        GROUP=group,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=cfg.block_q,
        TILE_N=cfg.tile_n,
        DOT_F32=dot_in_f32(_prefill_kernel, dots),
        PRECISION=dot_precision(dots),
        KV_INT8=is_quantized(k_cache.dtype),
        Q_AS_KV=dots != q.dtype,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
