"""Per-step attention inputs, built by the model runner and passed down explicitly.

Token order in a step: all decode tokens first (one per sequence), then the prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each token (-1: padding)
    num_decode_tokens: int
    # Decodes: one query per sequence.
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks] int32
    decode_seq_lens: torch.Tensor | None = None  # [Bd] int32, incl. the new token
    decode_max_seq_len: int = 0
    # Prefill chunks (q_len >= 2): flat, cu_seqlens_q relative to the first prefill token.
    prefill_block_tables: torch.Tensor | None = None  # [Bp, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor | None = None  # [Bp + 1] int32
    prefill_seq_lens: torch.Tensor | None = None  # [Bp] int32, cached prefix + chunk
    prefill_max_seqlen_q: int = 0
    prefill_max_seq_len: int = 0

    @property
    def has_prefill(self) -> bool:
        return self.prefill_cu_seqlens_q is not None
