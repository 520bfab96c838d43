"""Decode steps of a few sequences through the C decoder layer (kernels/native/decode_layer.c).

A batch-1 decode step of the default model is ~30 layers x two dozen small torch ops; on the CPU
their per-call overhead cost more than reading the weights did. ``NativeDecoder`` describes each
layer to the C code once (weight pointers, shapes, cache views) and then runs a decode-only step
of up to ``MAX_ROWS`` sequences as one C call per layer. The torch layers stay the reference and
serve everything else (prefill chunks, mixed steps, larger batches, compiled layers, machines
without a C compiler or without the row dots' vector paths for float weights). float32, bf16 and
fp16 models are served as they are (weights, activations and KV cache in the model's dtype),
int8 weights with activations and scales in the model's dtype, float32 included, and 16-bit
weights under float32 activations (EngineConfig.weight_dtype; widened exactly in registers).
The C structs' ctypes mirrors (Layer, Proj, Step) live in engine/kernels/native/structs.py,
where the library's loader checks them against C.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from engine.kernels.gemm import pack_panels
from engine.kernels.native import KV_DTYPE_CODES
from engine.kernels.native.structs import Layer, Proj, Step
from engine.layers.attention_metadata import AttentionMetadata

# Up to here the C layers beat the torch layers (their oneDNN GEMMs) at every row count measured:
# 16 x 512 int8 53.7 against 59.2 ms, bf16 45.8 against 46.4 (12 x 512: 38.0 / 47.2, 35.2 /
# 39.5). gemv.h takes up to 64 rows, in groups of 8 that share each weight row.
MAX_ROWS = 16
W_I8 = 3  # gemv.h's weight code for int8
W_Q8 = 4  # gemm_q8.h's for W8A8 panels

_ERRORS = {
    -1: "shapes beyond the C layer's limits",
    -2: "out of memory",
    -3: "a position, slot or block table outside the cache or rotary tables",
}


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def panels_of(lin) -> torch.Tensor | None:
    """The Linear's float weight packed for the fixed-order GEMM (kernels/gemm.py), packed once
    and kept while the weight is the same tensor; None for int8 and W8A8 weights."""
    w = lin.weight
    if lin.qweight is not None or w is None:
        return None
    key = (w.data_ptr(), w.dtype, tuple(w.shape), w._version)
    if getattr(lin, "panels_key", None) != key:
        lin.panels, lin.panels_key = pack_panels(w.detach()), key
    return lin.panels


def _proj(lin, dtype: torch.dtype, codes: dict[torch.dtype, int]) -> Proj | None:
    """The C description of a Linear, or None where its weights are in a form the C layer does
    not read (a float weight in another dtype than the model's, unless 16-bit under float32)."""
    bias = lin.bias
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
        return None
    if lin.q8 is not None:  # W8A8 panels (kernels/gemm_q8.py), any row count
        return Proj(W_Q8, None, None, _ptr(bias), lin.q8.data_ptr(), lin.out_features,
                    lin.in_features)  # fmt: skip
    if lin.qweight is not None:
        qw, scales = lin.qweight, lin.scales
        if not (qw.is_contiguous() and scales.dtype == dtype and scales.is_contiguous()):
            return None
        return Proj(W_I8, qw.data_ptr(), scales.data_ptr(), _ptr(bias), None, *qw.shape)
    w = lin.weight
    # the model's dtype, or 16-bit weights against float32 activations (store_weights_)
    if w is None or w.dtype not in codes or not w.is_contiguous():
        return None
    if w.dtype != dtype and dtype != torch.float32:
        return None  # 16-bit weights take float32 activations
    # the fixed-order GEMM's panels (gemm.h); they widen 16-bit weights exactly, so float32 rows
    # against bf16 weights are never rounded (the AVX512-BF16 row dots would round them)
    return Proj(codes[w.dtype], w.data_ptr(), None, _ptr(bias), panels_of(lin).data_ptr(), *w.shape)


class NativeDecoder:
    """The C decoder layers of one LlamaForCausalLM, bound to its weights and KV cache views as
    they are now: rebuild it when either changes (the model does, see LlamaForCausalLM)."""

    def __init__(self, model, lib: ctypes.CDLL, codes: dict[torch.dtype, int]) -> None:
        self.lib = lib
        cfg, dtype = model.cfg, model.dtype
        self.layers: list[Layer] = []
        for layer in model.layers:
            attn = layer.attn
            lins = (layer.qkv_proj, layer.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            projs = [_proj(lin, dtype, codes) for lin in lins]
            if any(p is None for p in projs) or attn.k_cache is None:
                raise ValueError("layer weights or KV cache in a form the C layer does not take")
            kc, vc = attn.k_cache, attn.v_cache
            self.layers.append(
                Layer(
                    codes[dtype],
                    cfg.hidden_size,
                    cfg.num_heads,
                    cfg.num_kv_heads,
                    cfg.head_dim,
                    cfg.intermediate_size,
                    int(cfg.qk_norm),
                    kc.shape[1],
                    KV_DTYPE_CODES[kc.dtype],
                    cfg.rms_norm_eps,
                    attn.scale,
                    layer.input_layernorm.weight.data_ptr(),
                    layer.post_attention_layernorm.weight.data_ptr(),
                    layer.q_norm.weight.data_ptr() if cfg.qk_norm else None,
                    layer.k_norm.weight.data_ptr() if cfg.qk_norm else None,
                    *projs,
                    kc.data_ptr(),
                    vc.data_ptr(),
                    kc.shape[0],
                    *kc.stride()[:3],
                    *vc.stride()[:3],
                )
            )
        self.cos, self.sin = model.rotary.cos, model.rotary.sin_signed
        self.code = codes[dtype]
        self.layer_ids = model.layer_range  # global layer numbers (a pipeline stage's own)

    def run(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        layer_hook: Callable[[int], None] | None,
    ) -> torch.Tensor:
        """hidden [T, H] (contiguous, updated in place) through every layer of any step: decode
        rows and prefill chunks alike, each row attending over its own causal length (the
        tokens of its sequence up to and including it); ``layer_hook(i)`` after layer i, as in
        the torch forward."""
        tables, lens, row_tables = step_rows(meta, hidden.shape[0])
        positions = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        step = Step(
            hidden.shape[0],
            torch.get_num_threads(),
            positions.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            _ptr(row_tables),
            tables.shape[0],
            tables.shape[1],
            tables.stride(0),
            self.cos.data_ptr(),
            self.sin.data_ptr(),
            self.cos.shape[0],
        )
        fn, out = self.lib.engine_decode_layer, hidden.data_ptr()
        for i, layer in zip(self.layer_ids, self.layers, strict=True):
            rc = fn(ctypes.byref(layer), ctypes.byref(step), out)
            if rc:
                raise ValueError(f"decode layer {i} (C kernel): {_ERRORS.get(rc, rc)}")
            if layer_hook is not None:
                layer_hook(i)
        return hidden

    def norm(self, hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The final RMSNorm of hidden [T, H], row by row in C (the same order for every row)."""
        out = torch.empty_like(hidden)
        rc = self.lib.engine_rms_norm(
            self.code,
            hidden.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            hidden.shape[0],
            hidden.shape[1],
            eps,
            torch.get_num_threads(),
        )
        if rc:
            raise ValueError(f"final norm (C kernel): {_ERRORS.get(rc, rc)}")
        return out


def step_rows(
    meta: AttentionMetadata, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Every row's attention inputs for the C layer: (block tables [S, width] int32, each row's
    causal length [rows] int32, each row's table row [rows] int32 or None where row i has table
    row i). Decode rows come first with their sequences' tables; a prefill chunk's rows share
    their sequence's table, row j of a chunk of q tokens over a sequence of L seeing L - q + 1 + j
    tokens."""
    nd = meta.num_decode_tokens
    if not meta.has_prefill:
        tables = meta.decode_block_tables
        if tables.dtype != torch.int32 or tables.stride(1) != 1:
            tables = tables.to(torch.int32).contiguous()
        return tables, meta.decode_seq_lens.to(torch.int32).contiguous(), None
    cu = meta.prefill_cu_seqlens_q.to(torch.int64)
    q_lens = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(q_lens.shape[0]), q_lens)
    offset = torch.arange(rows - nd) - cu[seq]
    p_lens = meta.prefill_seq_lens.to(torch.int64)[seq] - q_lens[seq] + 1 + offset
    p_tables = meta.prefill_block_tables.to(torch.int32)
    if not nd:
        return p_tables.contiguous(), p_lens.to(torch.int32), seq.to(torch.int32)
    d_tables = meta.decode_block_tables.to(torch.int32)
    width = max(d_tables.shape[1], p_tables.shape[1])
    tables = torch.zeros(nd + p_tables.shape[0], width, dtype=torch.int32)
    tables[:nd, : d_tables.shape[1]] = d_tables
    tables[nd:, : p_tables.shape[1]] = p_tables
    lens = torch.cat([meta.decode_seq_lens.to(torch.int64), p_lens]).to(torch.int32)
    row_tables = torch.cat([torch.arange(nd), seq + nd]).to(torch.int32)
    return tables, lens, row_tables
