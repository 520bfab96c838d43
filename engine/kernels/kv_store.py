"""Write new K/V rows into paged cache slots (slot -1 = padding, skipped)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._launch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    KV_DTYPES,
    check_devices,
    check_tensor,
    on_tensor_device,
    paged_cache_strides,
)
from engine.kernels.kv_quant import is_quantized, row_elems, to_cache


def kv_store_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value: [T, Hkv, D]; k_cache/v_cache: [num_blocks, block_size, Hkv, D] (any dtype;
    int8: rows [.., D + 2] with their scales, kvcache/kv_dtype.py);
    slot_mapping: [T] int64, slot = block * block_size + offset, -1 skipped."""
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat_k = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    flat_v = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    flat_k.index_copy_(0, slot_mapping, to_cache(key, k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, to_cache(value, v_cache.dtype))


@triton.jit
def _kv_store_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,  # Hkv * HEAD_DIM, need not be a power of 2 (SmolLM2: 192)
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,  # float caches: a tile of ROW; int8: >= HEAD_DIM, a power of 2
    INT8: tl.constexpr,  # int8 rows [HEAD_DIM values | fp16 scale] (kernels/kv_quant.py)
):
    # Grid (tokens, cdiv(ROW, TILE)): one program copies one tile of one token's K and V row;
    # int8: grid (tokens, KV heads), one program quantizes one head's row, as
    # kv_quant.quantize_int8 does, bit for bit.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    if INT8:
        head = tl.program_id(1)
        d = tl.arange(0, TILE)
        mask = d < HEAD_DIM
    else:
        i = tl.program_id(1) * TILE + tl.arange(0, TILE)
        mask = i < ROW
        head = i // HEAD_DIM
        d = i % HEAD_DIM
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=mask, other=0.0)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + head * stride_kch
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch
    if INT8:
        _store_int8_row(k.to(tl.float32), k_dst, d, mask, HEAD_DIM)
        _store_int8_row(v.to(tl.float32), v_dst, d, mask, HEAD_DIM)
    else:
        tl.store(k_dst + d, k, mask=mask)
        tl.store(v_dst + d, v, mask=mask)


@triton.jit
def _store_int8_row(x, dst, d, mask, HEAD_DIM: tl.constexpr):
    scale = tl.math.div_rn(tl.max(tl.abs(x), 0), 127.0).to(tl.float16)  # IEEE, as torch
    s = scale.to(tl.float32)
    q = tl.where(s > 0, tl.math.div_rn(x, tl.where(s > 0, s, 1.0)), 0.0)
    # Round half to even as torch.round does: adding and taking away 1.5 * 2^23 leaves the
    # nearest even integer in float32 arithmetic (|q| <= 127 here).
    q = (q + 12582912.0) - 12582912.0
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    tl.store(dst + d, q.to(tl.int8), mask=mask)
    tl.store((dst + HEAD_DIM).to(tl.pointer_type(tl.float16), bitcast=True), scale)


@on_tensor_device
def kv_store_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as kv_store_ref. key/value may be strided views (e.g. slices of a fused QKV
    output) as long as the last dim is contiguous; slot_mapping may be int32 or int64."""
    check_tensor("key", key, ndim=3, dtypes=FLOAT_DTYPES, last_contiguous=True)
    num_tokens, num_kv_heads, head_dim = key.shape
    check_tensor("value", value, dtypes=FLOAT_DTYPES, shape=tuple(key.shape), last_contiguous=True)
    check_tensor("k_cache", k_cache, ndim=4, dtypes=KV_DTYPES, last_contiguous=True)
    row = row_elems(k_cache.dtype, head_dim)
    check_tensor("k_cache", k_cache, shape=(None, None, num_kv_heads, row), last_contiguous=True)
    same = {"dtypes": (k_cache.dtype,), "shape": tuple(k_cache.shape)}
    check_tensor("v_cache", v_cache, **same, last_contiguous=True)
    check_tensor(
        "slot_mapping",
        slot_mapping,
        ndim=1,
        dtypes=INDEX_DTYPES,
        shape=(num_tokens,),
        contiguous=True,
    )
    check_devices(
        _kv_store_kernel,
        key=key,
        value=value,
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=slot_mapping,
    )
    if num_tokens == 0:
        return
    int8 = is_quantized(k_cache.dtype)
    if not int8:
        # Cast in torch, as the reference does: the interpreter's in-kernel fp32 -> bf16 cast
        # truncates.
        key = key if key.dtype == k_cache.dtype else key.to(k_cache.dtype)
        value = value if value.dtype == v_cache.dtype else value.to(v_cache.dtype)
    row = num_kv_heads * head_dim
    if int8:
        tile = triton.next_power_of_2(head_dim)
        grid, warps = (num_tokens, num_kv_heads), 1 if head_dim <= 128 else 2
    else:
        tile = min(triton.next_power_of_2(row), 2048)
        grid, warps = (num_tokens, triton.cdiv(row, tile)), 4 if tile <= 1024 else 8
    _kv_store_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *paged_cache_strides(k_cache, v_cache),
        HEAD_DIM=head_dim,
        ROW=row,
        BLOCK_SIZE=k_cache.shape[1],
        TILE=tile,
        INT8=int8,
        num_warps=warps,
    )
