"""Reading a GGUF file (llama.cpp's format): config from the metadata, tokenizer from the
``tokenizer.*`` keys, and tensors renamed to Hugging Face names and dequantized on demand.

Two things differ from a Hugging Face checkpoint besides names:
- GGUF lists a tensor's dimensions fastest first; the HF shape is that list reversed.
- llama.cpp's converter permutes the rows of Llama's q and k projections (its rope rotates
  adjacent pairs; HF's ``rotate_half`` rotates the two halves of each head). We undo it, so the
  runtime uses the HF convention for every model. Qwen2/Qwen3 files are not permuted.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from engine.config import ModelConfig, RopeScaling
from engine.model.checkpoint import Checkpoint, TensorSource
from engine.model.tokenizer import tokenizer_from_gguf

_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors that are not weights: rope_freqs holds Llama 3 rope factors (read into the config),
# attn_rot_embd is an unused leftover of old conversions.
_NOT_WEIGHTS = re.compile(r"rope_freqs\.weight|blk\.\d+\.attn_rot_embd(\.weight)?")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # HF order: slowest dimension first
    qtype: QType
    data: np.ndarray  # the raw bytes, uint8, shaped (*rows, bytes per row), memory-mapped


# GGUF value types: 8 is a string, 9 an array; the rest are little-endian scalars.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS.update({11: "<q", 12: "<d"})


def read_gguf(path: str) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """Metadata (key -> Python value) and tensors of a GGUF file, the tensors memory-mapped.

    gguf.GGUFReader parses the same, but slowly: several seconds for a 50k-token vocabulary,
    because every string becomes numpy views. Reading with struct takes a few milliseconds.
    """
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # outlives the file object
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path}: not a GGUF v2/v3 file (magic {magic!r}, version {version})")
    pos = 24

    def scalar(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return value

    def value(vtype: int) -> Any:
        nonlocal pos
        if vtype == 8:
            size = scalar("<Q")
            pos += size
            return buf[pos - size : pos].decode("utf-8", errors="replace")
        if vtype == 9:
            etype, count = scalar("<I"), scalar("<Q")
            if etype in _SCALARS:
                array = np.frombuffer(buf, np.dtype(_SCALARS[etype]), count, pos)
                pos += array.nbytes
                return array.tolist()
            return [value(etype) for _ in range(count)]
        return scalar(_SCALARS[vtype])

    meta = {}
    for _ in range(n_kv):
        key = value(8)
        meta[key] = value(scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = value(8)
        dims = [scalar("<Q") for _ in range(scalar("<I"))]
        infos.append((name, dims, scalar("<I"), scalar("<Q")))
    align = int(meta.get("general.alignment", 32))
    start = (pos + align - 1) // align * align
    tensors = {}
    for name, dims, kind, offset in infos:
        try:
            qtype = QType(kind)
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name} has unknown type {kind}") from None
        rows = tuple(reversed(dims[1:]))
        row_bytes = dims[0] // block * block_bytes
        nbytes = math.prod(rows) * row_bytes
        if start + offset + nbytes > len(buf):
            raise ValueError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        data = np.frombuffer(buf, np.uint8, nbytes, start + offset).reshape(*rows, row_bytes)
        tensors[name] = GGUFTensor(name, (*rows, dims[0]), qtype, data)
    return meta, tensors


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, or None when the name is unknown."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix == "weight":
        return f"{_GLOBAL_NAMES[base]}.weight"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"
    return None


def load_gguf_checkpoint(path: str) -> Checkpoint:
    try:
        meta, tensors = read_gguf(path)
    except (struct.error, UnicodeDecodeError, KeyError) as exc:
        raise ValueError(f"{path}: not a readable GGUF file ({exc!r})") from exc
    try:
        tokenizer = tokenizer_from_gguf(meta)
    except KeyError as exc:
        raise ValueError(f"{path}: tokenizer metadata {exc} is missing") from exc
    config = config_from_gguf(meta, tensors, path)
    config = replace(
        config, bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids
    )
    file = os.path.basename(path)
    sources = {}
    for name, tensor in tensors.items():
        if _NOT_WEIGHTS.fullmatch(name):
            continue
        target = hf_name(name)
        if target is None:
            raise ValueError(f"{path}: unknown tensor {name} (architecture {config.architecture})")
        if not _can_dequantize(tensor.qtype):
            raise ValueError(
                f"{path}: tensor {name} has quantization {tensor.qtype.name}, which "
                "cannot be dequantized"
            )
        heads = None
        if meta["general.architecture"] == "llama" and name.endswith(".weight"):
            if ".attn_q." in name:
                heads = config.num_heads
            elif ".attn_k." in name:
                heads = config.num_kv_heads
        sources[target] = TensorSource(
            file, name, tensor.shape, lambda t=tensor, h=heads: _read_tensor(t, h)
        )
    return Checkpoint(config, tokenizer, sources, path)


def config_from_gguf(meta: Mapping[str, Any], tensors: Mapping[str, Any], path: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}"
        )

    def key(name: str, default: Any = KeyError) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is KeyError:
            raise ValueError(f"{path}: metadata key {arch}.{name} is missing")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts; we need them all equal
        if len(set(kv_heads)) != 1:
            raise ValueError(f"{path}: per-layer {arch}.attention.head_count_kv is not supported")
        kv_heads = kv_heads[0]
    head_dim = int(key("attention.key_length", hidden // heads))
    rope_dim = key("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial rotary ({rope_dim} of {head_dim} dims) not supported")
    embed = tensors.get("token_embd.weight")
    vocab = key("vocab_size", None) or (embed.shape[0] if embed is not None else 0)
    name = meta.get("general.name") or os.path.splitext(os.path.basename(path))[0]
    return ModelConfig(
        # llama.cpp converts Mistral models to the llama architecture.
        architecture="mistral" if arch == "llama" and "mistral" in name.lower() else arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch, tensors, head_dim, path),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        sliding_window=key("attention.sliding_window", None),
        name=name,
    )


def _rope_scaling(
    meta: Mapping[str, Any], arch: str, tensors: Mapping[str, Any], head_dim: int, path: str
) -> RopeScaling:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
    if "rope_freqs.weight" in tensors:
        freqs = tensors["rope_freqs.weight"].data.view("<f4").reshape(-1)
        theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
        return llama3_scaling_from_factors(np.asarray(freqs, np.float64), theta, head_dim, path)
    if kind == "linear" or (kind == "none" and factor not in (None, 1.0)):
        return RopeScaling(kind="linear", factor=float(factor))
    if kind == "yarn":
        context = meta.get(f"{arch}.context_length", 8192)
        original = meta.get(f"{arch}.rope.scaling.original_context_length", context)
        return RopeScaling(
            kind="yarn",
            factor=float(factor),
            original_max_position_embeddings=int(original),
            beta_fast=float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
        )
    if kind != "none":
        raise ValueError(f"{path}: rope scaling {kind!r} is not supported (linear, yarn, llama3)")
    return RopeScaling()


def llama3_scaling_from_factors(
    factors: np.ndarray, theta: float, head_dim: int, path: str = "<gguf>"
) -> RopeScaling:
    """Recover Llama 3 rope scaling from the per-frequency factors llama.cpp stores instead.

    A factor r is 1 above the high cut-off, ``factor`` below the low one, and in between obeys
    1/r = (1 - s)/factor + s with s = (orig/wavelen - low)/(high - low): s is a line in
    1/wavelen. We find that line (fitted through the in-between points, or, with fewer than two,
    the least steep one that keeps every point on its side of the cut-offs), then low and high
    for a fixed orig: scaling orig, low and high together changes no factor.
    """
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return RopeScaling()
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    for original in (8192, 4096, 2048, 1024, 16384, 32768):  # Llama 3.x: 8192, low 1, high 4
        scaling = RopeScaling(
            kind="llama3", factor=factor, original_max_position_embeddings=original
        )
        if np.allclose(llama3_factors(scaling, inv_freq), factors, rtol=1e-5):
            return scaling
    x = inv_freq / (2 * math.pi)  # 1 / wavelen
    smooth = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
    eps = 1e-4
    between = (smooth > eps) & (smooth < 1 - eps)
    unscaled, scaled = x[smooth >= 1 - eps], x[smooth <= eps]
    if between.sum() >= 2:
        slope, intercept = np.polyfit(x[between], smooth[between], 1)
    elif between.sum() == 1 and (unscaled.size or scaled.size):
        x0, s0 = x[between][0], smooth[between][0]
        slope = max(
            (1 - s0) / (unscaled.min() - x0) if unscaled.size else 0.0,
            s0 / (x0 - scaled.max()) if scaled.size else 0.0,
        )
        intercept = s0 - slope * x0
    elif between.sum() == 0 and unscaled.size and scaled.size:
        slope = 1.0 / (unscaled.min() - scaled.max())
        intercept = -slope * scaled.max()
    else:
        slope = intercept = 0.0
    original = 8192
    if slope > 0 and intercept < 0:
        span = original / slope  # high - low
        scaling = RopeScaling(
            kind="llama3",
            factor=factor,
            low_freq_factor=float(-intercept * span),
            high_freq_factor=float((1 - intercept) * span),
            original_max_position_embeddings=original,
        )
        if np.allclose(llama3_factors(scaling, inv_freq), factors, rtol=1e-3):
            return scaling
    raise ValueError(f"{path}: rope_freqs.weight does not follow Llama 3 rope scaling")


def llama3_factors(scaling: RopeScaling, inv_freq: np.ndarray) -> np.ndarray:
    """The factor each frequency is divided by, as Llama 3 (and llama.cpp's rope_freqs) define."""
    orig = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    mid = 1.0 / ((1 - smooth) / scaling.factor + smooth)
    out = np.where(wavelen < orig / scaling.high_freq_factor, 1.0, mid)
    return np.where(wavelen > orig / scaling.low_freq_factor, scaling.factor, out)


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: per head, rows were reordered from (2, dim/2) to
    (dim/2, 2), interleaving the two rotary halves."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _read_tensor(tensor: GGUFTensor, heads: int | None) -> torch.Tensor:
    if tensor.qtype == QType.F32:
        array = tensor.data.view("<f4")
    elif tensor.qtype == QType.F16:
        array = tensor.data.view("<f2")  # stays half precision; the caller casts
    else:
        array = gguf.quants.dequantize(tensor.data, tensor.qtype)
    array = array.reshape(tensor.shape)
    if heads is not None:
        array = unpermute_rope_rows(array, heads)
    # np.array copies out of the read-only memory map.
    return torch.from_numpy(np.array(array, order="C"))


def _can_dequantize(qtype: QType) -> bool:
    # Tested: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; gguf.quants has the other ggml types.
    # gguf.quants registers a dequantizer per type; the registry has no public accessor.
    return qtype in (QType.F32, QType.F16) or qtype in getattr(gguf.quants, "_type_traits", {})
