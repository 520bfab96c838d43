"""Copy whole KV blocks between the paged cache and a contiguous staging buffer.

The tiered KV pool and the layer-wise transfer use these: gather a request's blocks into one
contiguous buffer (to send or to store), scatter received blocks back into cache slots.
"""

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
)
from engine.kernels.kv_quant import is_quantized


def as_words(t: torch.Tensor) -> torch.Tensor:
    """A block tensor [..., N, block_size, Hkv, row] whose blocks are contiguous runs of bytes,
    as [..., N, words] of the widest integer that divides a block's bytes (a view, no copy).
    torch copies int8 rows of 66 bytes (an int8 cache, kv_quant.py) element by element, about 5x
    slower than 8-byte words; words copy every dtype at memory speed."""
    flat = t.flatten(-3)
    nbytes = flat.shape[-1] * t.element_size()
    word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8)
                if nbytes % w.itemsize == 0)  # fmt: skip
    return flat.view(torch.uint8).view(word)


def _word_views(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """as_words of a and of b, when both hold one dtype in blocks of contiguous bytes that the
    same word divides at their offsets; else None (the element-wise copy serves)."""
    if a.dtype != b.dtype or not (_blocks_contiguous(a) and _blocks_contiguous(b)):
        return None
    try:
        wa, wb = as_words(a), as_words(b)
    except RuntimeError:  # an offset or stride the word does not divide
        return None
    return (wa, wb) if wa.dtype == wb.dtype else None


def _blocks_contiguous(t: torch.Tensor) -> bool:
    """Whether each block of t ([..., N, block_size, Hkv, row]) is one run of memory (its last
    three dims contiguous), as as_words needs."""
    if t.dim() < 4:
        return False
    bs, heads, row = t.shape[-3:]
    return t.stride(-1) == 1 and t.stride(-2) == row and t.stride(-3) == heads * row


def kv_gather_ref(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """cache: [..., num_blocks, block_size, Hkv, D] (all layers [L, 2, ...] or one layer [2, ...]);
    block_ids: [N] int64; out: [..., N, block_size, Hkv, D] with the same leading dims."""
    lead = cache.dim() - 4
    words = _word_views(cache, out)
    if words is not None:
        words[1].copy_(words[0].index_select(lead, block_ids.long()))
        return out
    out.copy_(cache.index_select(lead, block_ids.long()))
    return out


def kv_scatter_ref(src: torch.Tensor, block_ids: torch.Tensor, cache: torch.Tensor) -> None:
    """Inverse of kv_gather: src [..., N, block_size, Hkv, D] into cache blocks block_ids."""
    lead = cache.dim() - 4
    words = _word_views(src, cache)
    if words is not None:
        words[1].index_copy_(lead, block_ids.long(), words[0])
        return
    cache.index_copy_(lead, block_ids.long(), src.to(cache.dtype))


@triton.jit
def _kv_copy_kernel(
    src_ptr,
    dst_ptr,
    ids_ptr,
    num_ids,
    stride_src_lead,
    stride_src_block,
    stride_dst_lead,
    stride_dst_block,
    BLOCK_ELEMS: tl.constexpr,  # block_size * Hkv * D, contiguous within a block
    TILE: tl.constexpr,
    GATHER: tl.constexpr,  # True: cache[ids] -> staging; False: staging -> cache[ids]
):
    # Grid (lead * N, cdiv(BLOCK_ELEMS, TILE)); programs of one lead index are adjacent, so the
    # staging side is walked in address order. All offsets in int64: a whole cache can pass 2^31.
    pid = tl.program_id(0).to(tl.int64)
    lead = pid // num_ids
    n = pid % num_ids
    block = tl.load(ids_ptr + n).to(tl.int64)
    if GATHER:
        src = src_ptr + lead * stride_src_lead + block * stride_src_block
        dst = dst_ptr + lead * stride_dst_lead + n * stride_dst_block
    else:
        src = src_ptr + lead * stride_src_lead + n * stride_src_block
        dst = dst_ptr + lead * stride_dst_lead + block * stride_dst_block
    i = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = i < BLOCK_ELEMS
    x = tl.load(src + i, mask=mask)
    tl.store(dst + i, x, mask=mask)


def _flat_lead(name: str, t: torch.Tensor) -> tuple[int, int]:
    """(count, stride) of t's leading dims (all but the last 4) seen as one dim; ValueError if they
    cannot be, or if a block (the last 3 dims) is not contiguous."""
    block_size, heads, head_dim = t.shape[-3:]
    if t.stride(-1) != 1 or t.stride(-2) != head_dim or t.stride(-3) != heads * head_dim:
        raise ValueError(
            f"{name} must be contiguous within a block (last 3 dims), got {t.stride()}"
        )
    dims = [(n, s) for n, s in zip(t.shape[:-4], t.stride()[:-4], strict=True) if n != 1]
    count = 1
    for n, _ in dims:
        count *= n
    for (_, outer), (n, inner) in zip(dims, dims[1:], strict=False):
        if outer != inner * n:
            raise ValueError(f"{name}'s leading dims must flatten to one stride, got {t.stride()}")
    return count, (dims[-1][1] if dims else 0)


def _copy(cache, block_ids, staging, gather: bool, staging_name: str) -> None:
    check_tensor("cache", cache, dtypes=KV_DTYPES)
    if cache.dim() < 4:
        raise ValueError(f"cache must have >= 4 dims, got shape {tuple(cache.shape)}")
    check_tensor("block_ids", block_ids, ndim=1, dtypes=INDEX_DTYPES, contiguous=True)
    lead_shape = tuple(cache.shape[:-4])
    want = (*lead_shape, block_ids.numel(), *cache.shape[-3:])
    # int8 rows (values and scale) are bytes to move: only into or out of int8 rows.
    dtypes = (torch.int8,) if is_quantized(cache.dtype) else FLOAT_DTYPES
    check_tensor(staging_name, staging, dtypes=dtypes, shape=want)
    check_devices(_kv_copy_kernel, cache=cache, block_ids=block_ids, **{staging_name: staging})
    lead, stride_cache_lead = _flat_lead("cache", cache)
    _, stride_staging_lead = _flat_lead(staging_name, staging)
    n = block_ids.numel()
    if n == 0 or lead == 0:
        return
    block_size, heads, head_dim = cache.shape[-3:]
    block_elems = block_size * heads * head_dim
    tile = min(triton.next_power_of_2(block_elems), 4096)
    grid = (lead * n, triton.cdiv(block_elems, tile))
    if gather:
        src, dst = cache, staging
        strides = (stride_cache_lead, cache.stride(-4), stride_staging_lead, staging.stride(-4))
    else:
        src, dst = staging, cache
        strides = (stride_staging_lead, staging.stride(-4), stride_cache_lead, cache.stride(-4))
    _kv_copy_kernel[grid](
        src,
        dst,
        block_ids,
        n,
        *strides,
        BLOCK_ELEMS=block_elems,
        TILE=tile,
        GATHER=gather,
        num_warps=8 if tile >= 2048 else 4,
    )


@on_tensor_device
def kv_gather_triton(
    cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Same contract as kv_gather_ref. Block ids are not range-checked (that would need a sync):
    ids outside [0, num_blocks) read out of bounds on the GPU."""
    if isinstance(out, torch.Tensor) and isinstance(cache, torch.Tensor):
        if out.dtype != cache.dtype and {out.dtype, cache.dtype} <= set(FLOAT_DTYPES):
            staged = torch.empty(out.shape, dtype=cache.dtype, device=out.device)
            _copy(cache, block_ids, staged, gather=True, staging_name="out")
            return out.copy_(staged)  # cast in torch (see kv_scatter_triton)
    _copy(cache, block_ids, out, gather=True, staging_name="out")
    return out


@on_tensor_device
def kv_scatter_triton(src: torch.Tensor, block_ids: torch.Tensor, cache: torch.Tensor) -> None:
    """Same contract as kv_scatter_ref. With duplicate ids one source wins, unspecified which."""
    if isinstance(src, torch.Tensor) and isinstance(cache, torch.Tensor):
        if src.dtype != cache.dtype and {src.dtype, cache.dtype} <= set(FLOAT_DTYPES):
            # Cast in torch (round to nearest even, as the reference): the interpreter's in-kernel
            # fp32 -> bf16 cast truncates, so an in-kernel cast would differ between CPU and GPU.
            src = src.to(cache.dtype)
    _copy(cache, block_ids, src, gather=False, staging_name="src")
