"""Chunked-prefill attention over a paged KV cache.

A flat batch of query chunks (``cu_seqlens_q``); chunk b holds the last ``q_len_b`` tokens of a
sequence whose total length so far is ``seq_lens[b]`` (cached prefix + this chunk). The chunk's own
K/V must already be written to the cache (``kv_store``) before the call. Query i of chunk b sits at
absolute position ``seq_lens[b] - q_len_b + i`` and attends causally to positions <= its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_row: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence, [length, Hkv, D], read through its block-table row."""
    block_size = k_cache.shape[1]
    n = -(-length // block_size)
    blocks = block_row[:n].long()
    k = k_cache[blocks].reshape(n * block_size, *k_cache.shape[2:])[:length]
    v = v_cache[blocks].reshape(n * block_size, *v_cache.shape[2:])[:length]
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
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        start, end, kv_len = cu[b], cu[b + 1], lens[b]
        q_len = end - start
        if q_len == 0:
            continue
        k, v = gather_kv(k_cache, v_cache, block_tables[b], kv_len)
        # [H, q_len, D] x [H, kv_len, D]; GQA by repeating KV heads.
        qh = q[start:end].transpose(0, 1).float()
        kh = k.transpose(0, 1).float().repeat_interleave(group, dim=0)
        vh = v.transpose(0, 1).float().repeat_interleave(group, dim=0)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1).to(out.dtype)
    return out
