"""Paged decode attention: one query token per sequence, attending to its whole cached context."""

from __future__ import annotations

import torch


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
    longest one, mask the tail, one batched matmul pair.
    """
    if out is None:
        out = torch.empty_like(q)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    n = -(-max_seq_len // block_size)
    blocks = block_tables[:, :n].long().clamp(min=0)
    # [B, n*bs, Hkv, D] -> [B, Hkv, D, L] / [B, Hkv, L, D]
    k = k_cache[blocks].reshape(batch, n * block_size, num_kv_heads, head_dim)
    v = v_cache[blocks].reshape(batch, n * block_size, num_kv_heads, head_dim)
    qg = q.view(batch, num_kv_heads, group, head_dim)
    compute = torch.float32
    scores = torch.matmul(qg.to(compute), k.permute(0, 2, 3, 1).to(compute)) * scale
    pos = torch.arange(n * block_size, device=q.device)
    valid = pos[None, :] < seq_lens[:, None].to(pos.dtype)
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.matmul(probs, v.transpose(1, 2).to(compute))
    out.copy_(o.reshape(batch, num_heads, head_dim))
    return out
