"""Paged decode attention: one query token per sequence, attending to its whole cached context."""

from __future__ import annotations

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
    num_sms,
    on_tensor_device,
    pad_dim,
)
from engine.kernels.kv_quant import is_quantized
from engine.kernels.paged_gather import gather_blocks_float
from engine.kernels.paged_tile import paged_tile_step
from engine.kernels.split_merge import decode_merge_kernel

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost (Q load, partial write, merge) dominates
MAX_SPLITS = 64  # chosen by the heuristic
MAX_FORCED_SPLITS = 128  # num_splits argument clamped to this
SPLIT_TOKENS_MULTIPLE = 64  # split_tokens: a multiple of every BLOCK_N the launcher picks


_GATHER_CHUNK_BYTES = 2 << 20
# A lone sequence up to this many tokens takes _decode_one_sequence (measured faster up to here;
# beyond, its whole-context float32 copy leaves the cache and the chunked path wins).
_ONE_SEQUENCE_MAX_TOKENS = 1024


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """q: [B, Hq, D]; k_cache/v_cache: [num_blocks, block_size, Hkv, D];
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 (context length incl. the new token,
    whose K/V is already in the cache). Returns out [B, Hq, D]. num_splits is a kernel hint.

    Vectorised over the batch (the CPU engine runs this): gather every sequence's blocks up to the
    longest one, mask the tail, one batched matmul pair. Decode attention is memory-bound, so
    with few KV heads the matmuls run against all KV heads at once on the gathered blocks as they
    lie ([L * Hkv, D], no permuted copy) and keep the matching head's diagonal: Hkv times the
    (cheap) FLOPs for half the memory traffic.
    """
    if out is None:
        out = torch.empty_like(q)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    n = -(-max_seq_len // block_size)
    length = n * block_size
    if batch == 1 and length <= _ONE_SEQUENCE_MAX_TOKENS and (only := int(seq_lens[0])) > 0:
        return _decode_one_sequence(q, k_cache, v_cache, block_tables[0, :n], only, scale, out)
    blocks = block_tables[:, :n].long().clamp(min=0)
    compute = torch.float32
    pos = torch.arange(length, device=q.device)
    invalid = pos[None, :] >= seq_lens[:, None].to(pos.dtype)  # [B, L]
    if num_kv_heads <= 4:
        # Gather a few block columns at a time, small enough to stay in cache while the matmul
        # reads them: the KV is read from memory about once instead of three times. Rows are
        # sorted longest first, so each block column is gathered only for the sequences that
        # reach it (no work on padding).
        order = torch.argsort(seq_lens, descending=True)
        sorted_lens = seq_lens[order].tolist()
        blocks, invalid = blocks[order], invalid[order]
        width = block_size * num_kv_heads * head_dim
        step = max(1, _GATHER_CHUNK_BYTES // (batch * width * 4))
        qf = q[order].to(compute) * scale  # [B, Hq, D]
        rows_per_block = block_size * num_kv_heads
        chunks = []  # (first block, blocks, sequences that reach it)
        for c in range(0, n, step):
            live = sum(1 for x in sorted_lens if x > c * block_size)
            chunks.append((c, min(step, n - c), live))
        s_all = torch.empty(batch, num_heads, n * rows_per_block, dtype=compute, device=q.device)
        for c, m, live in chunks:
            # [live, m, bs, Hkv, D]
            kc = gather_blocks_float(k_cache, blocks[:live, c : c + m])
            # q @ K^T, not K @ q^T: with the few query heads as M and the long key axis as N
            # the GEMM runs ~4x faster here than the other way round (profiling/bench_step.py).
            s_all[:live, :, c * rows_per_block : (c + m) * rows_per_block] = torch.bmm(
                qf[:live], kc.view(live, m * rows_per_block, head_dim).transpose(1, 2)
            )
        s_all = s_all.view(batch, num_kv_heads, group, length, num_kv_heads)
        # diagonal over (query's kv head, key head) -> [B, G, L, Hkv] -> [B, Hkv, G, L]
        scores = s_all.diagonal(dim1=1, dim2=4).permute(0, 3, 1, 2)
        # Also overwrites the never-computed (uninitialised) entries past each sequence's end.
        scores = scores.masked_fill(invalid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).reshape(batch, num_heads, length)
        o_all = torch.zeros(
            batch, num_heads, num_kv_heads * head_dim, dtype=compute, device=q.device
        )
        for c, m, live in chunks:
            vc = gather_blocks_float(v_cache, blocks[:live, c : c + m])
            cols = probs[:live, :, c * block_size : (c + m) * block_size]
            o_all[:live].baddbmm_(cols, vc.view(live, m * block_size, num_kv_heads * head_dim))
        o_all = o_all.view(batch, num_kv_heads, group, num_kv_heads, head_dim)
        o = o_all.diagonal(dim1=1, dim2=3)  # [B, G, D, Hkv]
        o = o.permute(0, 3, 1, 2).reshape(batch, num_heads, head_dim)
        out.index_copy_(0, order, o.to(out.dtype))
        return out
    k = gather_blocks_float(k_cache, blocks)  # [B, n, bs, Hkv, D], contiguous
    v = gather_blocks_float(v_cache, blocks)
    k = k.view(batch, length, num_kv_heads, head_dim)
    v = v.view(batch, length, num_kv_heads, head_dim)
    qg = q.view(batch, num_kv_heads, group, head_dim).to(compute)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)) * scale
    scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.matmul(probs, v.transpose(1, 2))
    out.copy_(o.reshape(batch, num_heads, head_dim))
    return out


def _decode_one_sequence(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    seq_len: int,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Batch 1 (a lone decode): its blocks gathered whole, then per KV head one small GEMM for
    the scores and one for the output, without the batched path's sorting, chunking and
    diagonal. At 512 tokens of the default model's shape: ~145 us against ~310 us."""
    _, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    rows = blocks.numel() * block_size
    blocks = blocks.long().clamp(min=0)
    k = gather_blocks_float(k_cache, blocks).view(rows, num_kv_heads, head_dim)[:seq_len]
    v = gather_blocks_float(v_cache, blocks).view(rows, num_kv_heads, head_dim)[:seq_len]
    qg = q[0].view(num_kv_heads, group, head_dim).float() * scale
    probs = torch.softmax(torch.bmm(qg, k.permute(1, 2, 0)), dim=-1)  # [Hkv, G, L]
    o = torch.bmm(probs, v.transpose(0, 1))  # [Hkv, G, D]
    out[0].copy_(o.reshape(num_heads, head_dim))
    return out


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,  # [B, Hq, num_splits, HEAD_DIM] fp32, normalised within the split
    part_lse_ptr,  # [B, Hq, num_splits] fp32, base-2 log-sum-exp of the split's scores
    block_tables_ptr,
    seq_lens_ptr,
    scale_log2,
    num_heads,
    num_splits,  # runtime, not constexpr: a new split count must not trigger a recompile
    split_tokens,  # > 0: every split that many tokens at absolute positions (a multiple of BLOCK_N)
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= 16 rows: GROUP query heads, the rest masked
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,  # num_splits == 1: write the normalised output, no merge kernel
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_INT8: tl.constexpr,
    Q_AS_KV: tl.constexpr,
):
    # Grid (batch, kv heads, num_splits). Each sequence's context is cut into num_splits
    # BLOCK_N-aligned pieces of its own length (or, with split_tokens, pieces of that many tokens
    # at absolute positions, whatever the batch), so short sequences leave trailing splits
    # empty; an empty split writes lse = -inf and weighs nothing in the merge.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if split_tokens > 0:
        split_len = split_tokens
    else:
        split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, BLOCK_H)
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < HEAD_DIM
    io_mask = row_ok[:, None] & d_ok[None, :]
    q_off = seq * stride_qb + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)
    if Q_AS_KV:  # a float32 q over a 16-bit cache: dots in the cache's dtype (dot_dtype)
        q = q.to(k_cache_ptr.dtype.element_ty)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        m_i, l_i, acc = paged_tile_step(
            q, pos_ok[None, :], table, k_base, v_base, pos, pos_ok, d, d_ok, m_i, l_i, acc,
            stride_kb, stride_ks, stride_vb, stride_vs, scale_log2,
            BLOCK_SIZE, DOT_F32, PRECISION, KV_INT8, HEAD_DIM,
        )  # fmt: skip

    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if DIRECT:
        o_off = seq * stride_ob + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        row = (seq * num_heads + head) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=io_mask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=row_ok)


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, sms: int) -> int:
    """Split the context only while batch x kv heads leaves SMs idle: aim at ~2 programs per SM,
    at least MIN_SPLIT_TOKENS per split, at most MAX_SPLITS."""
    programs = batch * num_kv_heads
    if programs >= sms:
        return 1
    want = triton.cdiv(2 * sms, programs)
    return max(1, min(want, triton.cdiv(max_seq_len, MIN_SPLIT_TOKENS), MAX_SPLITS))


def _check_inputs(
    q, k_cache, v_cache, block_tables, seq_lens, out, num_splits, kv_dtypes=None
) -> torch.Tensor:
    """The launchers' shared argument checks (the reference's contract). Returns out, allocated
    when None."""
    check_paged_attention(q, k_cache, v_cache, kv_dtypes)
    batch = q.shape[0]
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, shape=(batch,), contiguous=True)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, shape=(batch, None))
    check_tensor("block_tables", block_tables, last_contiguous=True)
    if out is None:
        out = torch.empty_like(q)
    check_tensor("out", out, dtypes=(q.dtype,), shape=tuple(q.shape), last_contiguous=True)
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    return out


_NATIVE_ERRORS = {
    -1: "more than 256 query heads, or a block size that does not divide 256",
    -2: "out of memory for the kernel's scratch",
    -3: "a sequence is longer than its block table row, or names a block outside the cache",
}


def decode_attention_native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    row_tables: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as decode_attention_ref, on CPU tensors, by the C kernel of
    native/decode_attention.c: each K and V row read once from its paged block, in 256-token
    chunks at absolute positions merged in order by the online softmax's rule. A row's result
    depends only on its own query, length and cache (not on the batch, the thread count or how
    the work was split). A row of length 0 gets zeros. max_seq_len and num_splits are accepted
    and not needed. ``row_tables`` [batch] int32: query row b reads block table row
    ``row_tables[b]`` (the rows of a prefill chunk, each with its own causal length, share their
    sequence's row); None: row b reads row b."""
    from engine.kernels import native

    kv_codes = tuple(native.KV_DTYPE_CODES)
    if row_tables is not None:
        check_tensor("row_tables", row_tables, ndim=1, dtypes=(torch.int32,),
                     shape=(q.shape[0],), contiguous=True)  # fmt: skip
        check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES)
        own = torch.zeros(q.shape[0], block_tables.shape[1], dtype=block_tables.dtype)
        _check_inputs(q, k_cache, v_cache, own, seq_lens, out, num_splits, kv_codes)
        out = torch.empty_like(q) if out is None else out
    else:
        out = _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, out, num_splits, kv_codes)
    lib = native.library_for(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                             seq_lens=seq_lens, out=out)  # fmt: skip
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if batch == 0:
        return out
    if block_tables.dtype != torch.int32:
        block_tables = block_tables.to(torch.int32)
    if seq_lens.dtype != torch.int32:
        seq_lens = seq_lens.to(torch.int32)
    rc = lib.engine_decode_attention(
        native.DTYPE_CODES[q.dtype],
        native.KV_DTYPE_CODES[k_cache.dtype],
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        None if row_tables is None else row_tables.data_ptr(),
        block_tables.shape[0],
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        block_tables.shape[1],
        *q.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *out.stride()[:2],
        block_tables.stride(0),
        float(scale),
        torch.get_num_threads(),
    )
    if rc:
        raise ValueError(f"decode attention (C kernel): {_NATIVE_ERRORS.get(rc, rc)}")
    return out


@on_tensor_device
def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    split_tokens: int | None = None,
) -> torch.Tensor:
    """Same contract as decode_attention_ref; split-KV (flash-decoding) in two kernels, or one
    when num_splits is 1. No host sync: without max_seq_len the split count is sized from the
    block table's width. A sequence of length 0 gets zeros (the reference gives NaN).

    ``split_tokens`` (a multiple of SPLIT_TOKENS_MULTIPLE): the batch-invariant mode, every
    split that many tokens at absolute positions of its sequence and merged in split order, so
    that a sequence's result depends only on its own length, not on the batch's longest
    sequence or size (which the split-count heuristic follows); num_splits is then ignored."""
    out = _check_inputs(q, k_cache, v_cache, block_tables, seq_lens, out, num_splits, KV_DTYPES)
    if split_tokens is not None and (
        not isinstance(split_tokens, int)
        or split_tokens < 1
        or split_tokens % SPLIT_TOKENS_MULTIPLE
    ):
        raise ValueError(
            f"split_tokens must be a positive multiple of {SPLIT_TOKENS_MULTIPLE}, "
            f"got {split_tokens!r}"
        )
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    device = check_devices(
        _decode_split_kernel,
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=seq_lens,
        out=out,
    )
    if batch == 0:
        return out

    group = num_heads // num_kv_heads
    head_dim_pad = pad_dim(head_dim)
    bound = max_seq_len if max_seq_len else block_tables.shape[1] * block_size
    if split_tokens is not None:
        num_splits = max(1, triton.cdiv(bound, split_tokens))
    else:
        if num_splits is None:
            num_splits = choose_num_splits(batch, num_kv_heads, bound, num_sms(device))
        # A hint: more than MAX_FORCED_SPLITS would only grow the merge kernel's register tile.
        num_splits = min(num_splits, MAX_FORCED_SPLITS)
    block_h = max(16, triton.next_power_of_2(group))
    # fp32 (IEEE dots on CUDA cores) and big heads: smaller tiles, fewer registers (see prefill).
    dots = dot_dtype(q.dtype, k_cache.dtype)
    kv_int8 = is_quantized(k_cache.dtype)
    # K and V (or q) converted in registers before the dots: half the keys a tile (no spills on
    # sm_90 and sm_80, profiling/kernels.py --aot).
    converted = k_cache.dtype != q.dtype
    if dots == torch.float32 or (converted and head_dim_pad > 128 and capability(device) < (9, 0)):
        block_n = 16
    else:
        block_n = 64 if head_dim_pad <= 128 and not converted else 32
    check_dot_shape(block_h, block_n, head_dim_pad)
    check_dot_shape(block_h, head_dim_pad, block_n)
    direct = num_splits == 1 and split_tokens is None  # else always merged: one path for all
    if not direct:
        part_out = torch.empty(
            batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=device
        )
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=device)
    else:
        part_out = part_lse = out  # unused: the split kernel writes out directly
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        block_tables,
        seq_lens,
        float(scale) * LOG2E,
        num_heads,
        num_splits,
        split_tokens or 0,
        *attention_strides(q, k_cache, v_cache, out, block_tables),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        GROUP=group,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        DIRECT=direct,
        DOT_F32=dot_in_f32(_decode_split_kernel, dots),
        PRECISION=dot_precision(dots),
        KV_INT8=kv_int8,
        Q_AS_KV=dots != q.dtype,
        num_warps=4,
        num_stages=2,
    )
    if not direct:
        decode_merge_kernel[(batch, num_heads)](
            out,
            part_out,
            part_lse,
            num_heads,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out
