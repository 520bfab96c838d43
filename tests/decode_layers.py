"""Small random Llama-family models and decode-step metadata for tests of the C decoder layers
(tests/layers/test_native_decode.py, tests/kernels/test_native_steal.py)."""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig
from engine.layers.attention_metadata import AttentionMetadata
from engine.model.llama import LlamaForCausalLM

BLOCK = 16


def random_model(dtype, *, qk_norm=False, bias=False, heads=4, kv_heads=2, head_dim=32, seed=0):
    # hidden 96 and intermediate 160: the row dots' 64- and 16-wide tails are exercised.
    cfg = ModelConfig(
        architecture="qwen3" if qk_norm else ("qwen2" if bias else "llama"),
        vocab_size=64,
        hidden_size=96,
        intermediate_size=160,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=640,
        attention_bias=bias,
        qk_norm=qk_norm,
    )
    g = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg, dtype, torch.device("cpu"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return model


def decode_step(seq_lens, num_blocks, g):
    """AttentionMetadata of one decode step: sequence b has seq_lens[b] tokens (this one
    last), its blocks a random draw from the pool."""
    widths = [math.ceil(n / BLOCK) for n in seq_lens]
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(seq_lens), max(widths) + 1), -1, dtype=torch.int32)
    used = 0
    for b, w in enumerate(widths):
        tables[b, :w] = perm[used : used + w]
        used += w
    positions = torch.tensor([n - 1 for n in seq_lens], dtype=torch.int64)
    blocks = tables[torch.arange(len(seq_lens)), positions // BLOCK].long()
    slots = blocks * BLOCK + positions % BLOCK
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=len(seq_lens),
        decode_block_tables=tables,
        decode_seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        decode_max_seq_len=max(seq_lens),
    )
    return positions, meta
