"""Write new K/V rows into paged cache slots (slot -1 = padding, skipped)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._launch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_devices,
    check_tensor,
    on_tensor_device,
    paged_cache_strides,
)
from engine.kernels.kv_quant import to_cache


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
    TILE: tl.constexpr,
):
    # Grid (tokens, cdiv(ROW, TILE)): one program copies one tile of one token's K and V row.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    i = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = i < ROW
    head = i // HEAD_DIM
    d = i % HEAD_DIM
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + head * stride_kch + d
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch + d
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


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
    check_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, last_contiguous=True)
    check_tensor(
        "k_cache", k_cache, shape=(None, None, num_kv_heads, head_dim), last_contiguous=True
    )
    check_tensor(
        "v_cache", v_cache, dtypes=FLOAT_DTYPES, shape=tuple(k_cache.shape), last_contiguous=True
    )
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
    # Cast in torch, as the reference does: the interpreter's in-kernel fp32 -> bf16 cast truncates.
    key = key if key.dtype == k_cache.dtype else key.to(k_cache.dtype)
    value = value if value.dtype == v_cache.dtype else value.to(v_cache.dtype)
    row = num_kv_heads * head_dim
    tile = min(triton.next_power_of_2(row), 2048)
    grid = (num_tokens, triton.cdiv(row, tile))
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
        num_warps=4 if tile <= 1024 else 8,
    )
