"""The online-softmax step over one tile of paged KV, shared by the attention kernels.

Both chunked prefill and split-KV decode walk a sequence's cache through its block table one
tile of TILE_N positions at a time; only which (query, key) pairs are allowed differs, so the
caller passes that mask in.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_tile_step(
    q,  # [ROWS, HEAD_DIM_PAD] queries, already in the dot dtype
    allowed,  # [ROWS, TILE_N] bool: which scores count (causal, in-bounds)
    table,  # pointer to this sequence's block-table row
    k_base,
    v_base,
    pos,  # [TILE_N] absolute key positions
    pos_ok,  # [TILE_N] pos < end
    d,  # [HEAD_DIM_PAD] head-dim offsets
    d_ok,  # [HEAD_DIM_PAD] d < head_dim
    m_i,  # [ROWS] running max (base 2)
    l_i,  # [ROWS] running sum of exp2
    acc,  # [ROWS, HEAD_DIM_PAD] fp32 running output
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    scale_log2,
    BLOCK_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_INT8: tl.constexpr,  # int8 rows [HEAD_DIM values | fp16 scale] (kernels/kv_quant.py)
    HEAD_DIM: tl.constexpr,
):
    block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    slot_k = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks
    slot_v = block * stride_vb + (pos % BLOCK_SIZE) * stride_vs
    k = tl.load(
        k_base + slot_k[None, :] + d[:, None], mask=d_ok[:, None] & pos_ok[None, :], other=0.0
    )
    v = tl.load(
        v_base + slot_v[:, None] + d[None, :], mask=pos_ok[:, None] & d_ok[None, :], other=0.0
    )
    # Into the dot's dtype (q's): a no-op for a cache of q's dtype; int8 values are exact in
    # fp16 and bf16 (|q| <= 127), their scales applied to the scores and the probabilities.
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, k, input_precision=PRECISION) * scale_log2
    if KV_INT8:
        k_scale = tl.load(
            (k_base + slot_k + HEAD_DIM).to(tl.pointer_type(tl.float16), bitcast=True),
            mask=pos_ok,
            other=0.0,
        )
        s = s * k_scale.to(tl.float32)[None, :]
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row masked so far has m_new = -inf; use 0 so exp2(-inf - 0) = 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if KV_INT8:
        v_scale = tl.load(
            (v_base + slot_v + HEAD_DIM).to(tl.pointer_type(tl.float16), bitcast=True),
            mask=pos_ok,
            other=0.0,
        )
        p = p * v_scale.to(tl.float32)[None, :]  # sum_j p_j (v_j s_j) = sum_j (p_j s_j) v_j
    acc = tl.dot(p.to(q.dtype), v, acc, input_precision=PRECISION)
    return m_new, l_i, acc
