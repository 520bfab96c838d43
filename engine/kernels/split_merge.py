"""The second kernel of split-KV (flash-decoding) decode attention: each split left its output
normalised within the split and the base-2 log-sum-exp of its scores; the merge weighs them in
split order (a fixed order, whatever the batch)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_merge_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    num_heads,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next power of 2 >= num_splits
):
    # Grid (batch, query heads): out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse).
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    row = (seq * num_heads + head) * num_splits + s
    lse = tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    o = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + d,
        res.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )
