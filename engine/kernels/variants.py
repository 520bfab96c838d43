"""Every Triton kernel variant an engine's shapes need, as launcher calls on small inputs.

Triton compiles one variant per set of constexprs (tile sizes the launchers pick, DIRECT, the
merge's SPLITS_PAD) and per class of each int argument (1, a multiple of 16, other) and of each
pointer's alignment. The engine's start-up on CUDA runs these calls once (``warm_up``), so no
compile (1-3 s each) lands in a request; ``profiling/kernels.py --aot`` compiles the same calls
for a GPU target without one. The inputs are built as the model builds them (q and k slices of
one fused tensor, per-layer views of one KV tensor) so strides and alignment fall in the same
classes.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.kernels._launch import capability, dot_dtype, pad_dim
from engine.kernels.decode_attention import MAX_SPLITS
from engine.kernels.kv_quant import row_elems
from engine.kernels.prefill_attention import prefill_config

# Decode split counts covering every (SPLITS_PAD, multiple of 16 or not) pair the split
# heuristic can produce (1 to MAX_SPLITS); 1 is the direct, one-kernel variant.
DECODE_SPLITS = tuple(s for s in (1, 2, 3, 5, 9, 16, 17, 32, 33, 64) if s <= MAX_SPLITS)
COUNT_CLASSES = (1, 2, 16)  # an int argument equal to 1, a multiple of 16, neither
# Rows of the int8 GEMM: each tile configuration (int8_matmul_config: up to 16, 32, 64, more
# rows) times each class of the row count.
INT8_ROWS = (1, 2, 16, 17, 32, 33, 64, 65, 128)


def _size_class(n: int) -> int:
    """A small int that Triton specialises like ``n`` (1, a multiple of 16, neither)."""
    return 1 if n == 1 else 16 if n % 16 == 0 else 17


@dataclass(frozen=True)
class ModelShape:
    """What the kernels see of a model: heads, KV heads, head dim, layers, whether q and k come
    out of per-head norms (contiguous) or of the fused QKV projection (strided views), and the
    (out, in) sizes of its int8 projections (none unless its weights are int8)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int = 2
    qk_norm: bool = False
    int8_projections: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Variant:
    """One launcher call. The launcher is looked up in its module when run (tests replace it)."""

    module: str  # engine.kernels.<module>
    launcher: str
    label: str  # what makes it a variant of its own
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def run(self) -> Any:
        fn = getattr(importlib.import_module(f"engine.kernels.{self.module}"), self.launcher)
        return fn(*self.args, **self.kwargs)


def _qkv(shape: ModelShape, tokens: int, dtype, device):
    """q [T, Hq, D], k and v [T, Hkv, D] laid out as the decoder layer hands them over."""
    hq, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    fused = torch.zeros(tokens, (hq + 2 * hkv) * d, dtype=dtype, device=device)
    v = fused[:, (hq + hkv) * d :].view(tokens, hkv, d)
    if shape.qk_norm:
        q = torch.zeros(tokens, hq, d, dtype=dtype, device=device)
        k = torch.zeros(tokens, hkv, d, dtype=dtype, device=device)
        return q, k, v
    qk = torch.zeros(tokens, hq + hkv, d, dtype=dtype, device=device)  # the rotary's output
    return qk[:, :hq], qk[:, hq:], v


def variants(
    shape: ModelShape,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_dtype: torch.dtype | None = None,
) -> list[Variant]:
    """The calls that compile every variant the engine can launch for ``shape``: the KV store,
    decode attention at each split class, prefill attention at each tile configuration and
    sequence-count class, the KV block gather and scatter at each block-count class, and the
    int8 GEMM at each row class for each class of projection size (the kernel compiles the same
    code for any two sizes of one class, so small weights stand in for the real ones).
    ``kv_dtype``: the KV cache's (by default the activations'; int8 rows hold their scale)."""
    hq, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    group = hq // hkv
    num_blocks = 4
    kv_dtype = kv_dtype or dtype
    row = row_elems(kv_dtype, d)
    kv = torch.zeros(
        shape.num_layers, 2, num_blocks, block_size, hkv, row, dtype=kv_dtype, device=device
    )
    k_cache, v_cache = kv[0, 0], kv[0, 1]
    scale = d**-0.5
    out: list[Variant] = []

    batch = 2
    q, k, v = _qkv(shape, batch, dtype, device)
    slots = torch.tensor([0, block_size + 1], dtype=torch.int64, device=device)
    out.append(Variant("kv_store", "kv_store_triton", "", (k, v, k_cache, v_cache, slots)))

    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([block_size + 3, 2], dtype=torch.int32, device=device)
    for splits in DECODE_SPLITS:
        o = torch.empty_like(q)
        out.append(
            Variant(
                "decode_attention",
                "decode_attention_triton",
                f"num_splits={splits}",
                (q, k_cache, v_cache, table, seq_lens, scale),
                {"out": o, "num_splits": splits},
            )
        )

    head_dim_pad = pad_dim(d)
    target = capability(torch.device(device))  # the tiles depend on the CUDA target
    configs: dict[Any, int] = {}  # tile configuration -> a max_seqlen_q that picks it
    for max_q in (2, 32 // group + 1, 128 // group + 1, 4096):
        dots = dot_dtype(dtype, kv_dtype)
        converted = kv_dtype != dtype
        cfg = prefill_config(max(max_q, 2), group, head_dim_pad, dots, target, converted)
        configs.setdefault(cfg, max_q)
    for cfg, max_q in configs.items():
        for seqs in COUNT_CLASSES:
            # Two query tokens per sequence: the tile is chosen from max_seqlen_q, not the data.
            tokens = 2 * seqs
            pq, _, _ = _qkv(shape, tokens, dtype, device)
            cu = torch.arange(0, tokens + 1, 2, dtype=torch.int32, device=device)
            lens = torch.full((seqs,), 2, dtype=torch.int32, device=device)
            tables = torch.zeros(seqs, 1, dtype=torch.int32, device=device)
            out.append(
                Variant(
                    "prefill_attention",
                    "prefill_attention_triton",
                    f"block_m={cfg.block_m} tile_n={cfg.tile_n} seqs={seqs}",
                    (pq, k_cache, v_cache, tables, cu, lens, scale),
                    {"out": torch.empty_like(pq), "max_seqlen_q": max(max_q, 2)},
                )
            )

    for n in COUNT_CLASSES:
        ids = torch.arange(n, dtype=torch.int64, device=device) % num_blocks
        staging = torch.zeros(
            shape.num_layers, 2, n, block_size, hkv, row, dtype=kv_dtype, device=device
        )
        out.append(Variant("kv_copy", "kv_gather_triton", f"blocks={n}", (kv, ids, staging)))
        out.append(Variant("kv_copy", "kv_scatter_triton", f"blocks={n}", (staging, ids, kv)))

    sizes = sorted({(_size_class(o), _size_class(i)) for o, i in shape.int8_projections})
    for out_features, in_features in sizes:
        qweight = torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
        scales = torch.ones(out_features, dtype=dtype, device=device)
        for rows in INT8_ROWS:
            x = torch.zeros(rows, in_features, dtype=dtype, device=device)
            label = f"{out_features}x{in_features} rows={rows}"
            out.append(Variant("int8_matmul", "int8_matmul_triton", label, (x, qweight, scales)))
    return out


def warm_up(
    shape: ModelShape,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_dtype: torch.dtype | None = None,
) -> tuple[int, float]:
    """Run every variant once (compiling it, or loading it from Triton's cache); returns how
    many and the seconds it took."""
    start = time.perf_counter()
    calls = variants(shape, block_size, dtype, device, kv_dtype)
    for call in calls:
        call.run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(calls), time.perf_counter() - start
