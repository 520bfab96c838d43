"""Paged attention layer: writes this step's K/V into the cache, then attends via the kernels."""

from __future__ import annotations

import torch

from engine import kernels
from engine.layers.attention_metadata import AttentionMetadata


class PagedAttention(torch.nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        # Per-layer views of the engine's one KV tensor, bound by the runner after allocation.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        kernels.kv_store(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            kernels.decode_attention(
                q[:nd],
                self.k_cache,
                self.v_cache,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                self.scale,
                out=out[:nd],
                max_seq_len=meta.decode_max_seq_len,
            )
        if meta.has_prefill:
            kernels.prefill_attention(
                q[nd:],
                self.k_cache,
                self.v_cache,
                meta.prefill_block_tables,
                meta.prefill_cu_seqlens_q,
                meta.prefill_seq_lens,
                self.scale,
                out=out[nd:],
                max_seqlen_q=meta.prefill_max_seqlen_q,
                max_seq_len=meta.prefill_max_seq_len,
            )
        return out
