"""GGUF reading: the metadata parser, dequantization, q/k un-permutation, config and rope."""

from __future__ import annotations

import dataclasses
import math

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from safetensors.numpy import load_file
from tiny_models import (
    _llama3_rope_factors,
    llama_cpp_permute,
    tiny_gguf,
    tiny_model,
    write_gguf,
)

from engine.config import RopeScaling
from engine.model.gguf_loader import (
    _read_tensor,
    hf_name,
    llama3_scaling_from_factors,
    read_gguf,
    unpermute_rope_rows,
)
from engine.model.loader import load_model, resolve_model_path

# --- independent dequantization references, written from ggml-quants.c ------------------------


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def ref_q8_0(block: np.ndarray) -> np.ndarray:
    return _f16(block[:2]) * block[2:].view(np.int8).astype(np.float32)


def ref_q4_0(block: np.ndarray) -> np.ndarray:
    d, qs = _f16(block[:2]), block[2:].astype(np.int32)
    return np.concatenate([(qs & 0xF) - 8, (qs >> 4) - 8]) * d


def ref_q4_1(block: np.ndarray) -> np.ndarray:
    d, m, qs = _f16(block[:2]), _f16(block[2:4]), block[4:].astype(np.int32)
    return np.concatenate([qs & 0xF, qs >> 4]) * d + m


def ref_q4_k(block: np.ndarray) -> np.ndarray:
    d, dmin = _f16(block[:2])[0], _f16(block[2:4])[0]
    scales, qs = block[4:16].astype(np.int32), block[16:].astype(np.int32)

    def scale_min(j: int) -> tuple[int, int]:
        if j < 4:
            return scales[j] & 63, scales[j + 4] & 63
        sc = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4)
        return sc, (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)

    out = []
    for chunk in range(4):  # 64 values per chunk: low nibbles, then high nibbles
        q = qs[32 * chunk : 32 * chunk + 32]
        sc, m = scale_min(2 * chunk)
        out.append(d * sc * (q & 0xF) - dmin * m)
        sc, m = scale_min(2 * chunk + 1)
        out.append(d * sc * (q >> 4) - dmin * m)
    return np.concatenate(out).astype(np.float32)


def ref_q6_k(block: np.ndarray) -> np.ndarray:
    ql, qh = block[:128].astype(np.int32), block[128:192].astype(np.int32)
    scales, d = block[192:208].view(np.int8).astype(np.float32), _f16(block[208:210])[0]
    out = np.zeros(256, np.float32)
    for half in range(2):
        lo, hi, sc, y = ql[64 * half :], qh[32 * half :], scales[8 * half :], 128 * half
        for i in range(32):
            s = i // 16
            q1 = ((lo[i] & 0xF) | ((hi[i] & 3) << 4)) - 32
            q2 = ((lo[i + 32] & 0xF) | (((hi[i] >> 2) & 3) << 4)) - 32
            q3 = ((lo[i] >> 4) | (((hi[i] >> 4) & 3) << 4)) - 32
            q4 = ((lo[i + 32] >> 4) | (((hi[i] >> 6) & 3) << 4)) - 32
            out[y + i] = d * sc[s] * q1
            out[y + i + 32] = d * sc[s + 2] * q2
            out[y + i + 64] = d * sc[s + 4] * q3
            out[y + i + 96] = d * sc[s + 6] * q4
    return out


REFERENCES = {
    QType.Q8_0: ref_q8_0,
    QType.Q4_0: ref_q4_0,
    QType.Q4_1: ref_q4_1,
    QType.Q4_K: ref_q4_k,
    QType.Q6_K: ref_q6_k,
}
# Where each block keeps its float16 scales (byte offsets), so random blocks stay finite.
F16_FIELDS = {QType.Q8_0: [0], QType.Q4_0: [0], QType.Q4_1: [0, 2], QType.Q4_K: [0, 2]}
F16_FIELDS[QType.Q6_K] = [208]


def random_blocks(qtype: QType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scale = rng.uniform(-0.05, 0.05, (rows, cols // block)).astype(np.float16)
        data[..., offset : offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, cols // block * size)


@pytest.mark.parametrize("qtype", list(REFERENCES), ids=lambda q: q.name)
def test_dequantize_matches_reference(tmp_path, qtype):
    rows, cols = 3, 512
    raw = random_blocks(qtype, rows, cols)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    expected = np.stack(
        [np.concatenate([REFERENCES[qtype](b) for b in row.reshape(-1, size)]) for row in raw]
    ).astype(np.float32)
    np.testing.assert_allclose(gguf.quants.dequantize(raw, qtype), expected, rtol=1e-6, atol=1e-7)
    # and through our reader, from a file
    writer = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _, tensors = read_gguf(str(tmp_path / "q.gguf"))
    tensor = tensors["blk.0.ffn_up.weight"]
    assert tensor.shape == (rows, cols) and tensor.qtype == qtype
    torch.testing.assert_close(_read_tensor(tensor, None), torch.from_numpy(expected))


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q4_1], ids=lambda q: q.name)
def test_quantize_round_trip(qtype):
    rng = np.random.default_rng(1)
    weight = rng.normal(0, 0.05, (4, 256)).astype(np.float32)
    back = gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype)
    # error bounded by half a quantization step of each block (8-bit: range/255, 4-bit: /15)
    levels = 255 if qtype == QType.Q8_0 else 15
    blocks = weight.reshape(-1, 32)
    step = (blocks.max(1) - blocks.min(1)) / levels
    assert np.all(np.abs(back.reshape(-1, 32) - blocks) <= step[:, None] * 1.01 + 1e-6)


def test_reader_matches_gguf_reader():
    path = resolve_model_path("default")
    meta, tensors = read_gguf(path)
    reader = gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert meta == expected
    assert list(tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors[:12]:
        ours = tensors[t.name]
        assert ours.qtype == t.tensor_type
        assert ours.shape == tuple(reversed(t.shape.tolist()))
        assert np.array_equal(ours.data.reshape(-1), t.data.view(np.uint8).reshape(-1))


def test_unpermute_inverts_llama_cpp_permute():
    weight = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    for heads in (1, 2, 6):
        permuted = llama_cpp_permute(weight, heads)
        assert not np.array_equal(permuted, weight)
        np.testing.assert_array_equal(unpermute_rope_rows(permuted, heads), weight)


def test_hf_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("blk.3.ffn_gate_exps.weight") is None


@pytest.mark.parametrize(
    "rope",
    [
        dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, orig=8192, head_dim=128),
        dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, orig=8192, head_dim=64),
        dict(factor=16.0, low_freq_factor=2.0, high_freq_factor=8.0, orig=3000, head_dim=128),
        dict(factor=8.0, low_freq_factor=1.5, high_freq_factor=4.0, orig=1000, head_dim=16),
    ],
)
def test_llama3_scaling_recovered_from_rope_freqs(rope):
    head_dim, theta = rope.pop("head_dim"), 500000.0
    rope["original_max_position_embeddings"] = rope.pop("orig")
    factors = _llama3_rope_factors(rope, head_dim, theta).astype(np.float64)
    scaling = llama3_scaling_from_factors(factors, theta, head_dim)
    assert scaling.kind == "llama3" and scaling.factor == rope["factor"]
    # Equivalent parameters: the same factor for every frequency the model has.
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    from engine.model.gguf_loader import llama3_factors

    np.testing.assert_allclose(llama3_factors(scaling, inv_freq), factors, rtol=1e-5)
    if rope["original_max_position_embeddings"] == 8192:
        assert scaling == RopeScaling("llama3", rope["factor"], 1.0, 4.0, 8192)


@pytest.mark.parametrize("kind", ["llama", "llama_mqa", "llama3_rope", "qwen2", "qwen3"])
def test_tiny_gguf_loads_hf_weights_exactly(kind):
    directory, path = tiny_model(kind), tiny_gguf(kind)
    loaded = load_model(str(path), show_progress=False)
    reference = load_model(str(directory), show_progress=False)
    # GGUF stores eps as float32, and the vocabulary's end tokens (<|endoftext|> too).
    assert math.isclose(loaded.config.rms_norm_eps, reference.config.rms_norm_eps, rel_tol=1e-6)
    assert loaded.config.eos_token_ids == (2, 0)
    same = dict(
        name=loaded.config.name, rms_norm_eps=loaded.config.rms_norm_eps, eos_token_ids=(2, 0)
    )
    assert loaded.config == dataclasses.replace(reference.config, **same)
    assert loaded.weights.keys() == reference.weights.keys()
    for name, weight in reference.weights.items():
        assert torch.equal(loaded.weights[name], weight), name


@pytest.mark.parametrize("qtype", [QType.F16, QType.BF16, QType.Q4_1], ids=lambda q: q.name)
def test_tiny_gguf_quantized(qtype):
    directory, path = tiny_model("qwen3"), tiny_gguf("qwen3", qtype)
    loaded = load_model(str(path), dtype=torch.float32, show_progress=False)
    state = load_file(directory / "model.safetensors")
    for name, weight in state.items():
        if weight.ndim == 2:
            expected = gguf.quants.dequantize(gguf.quants.quantize(weight, qtype), qtype)
        else:
            expected = weight  # norms and biases stay float32
        np.testing.assert_array_equal(loaded.weights[name].numpy(), expected, err_msg=name)
    half = load_model(str(path), dtype=torch.bfloat16, show_progress=False)
    assert all(w.dtype == torch.bfloat16 for w in half.weights.values())


def test_smollm2_config_and_tokens():
    loaded = load_model("default", show_progress=False)
    config = loaded.config
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert config.rope_theta == 100000.0 and config.max_position_embeddings == 8192
    assert math.isclose(config.rms_norm_eps, 1e-5, rel_tol=1e-6)
    assert config.bos_token_id == 1 and config.eos_token_ids == (2, 0)
    assert "lm_head.weight" not in loaded.weights
    assert loaded.weights["model.embed_tokens.weight"].shape == (49152, 576)


def test_errors_name_file_and_tensor(tmp_path):
    good = tiny_gguf("llama")
    data = good.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.gguf: tensor .* runs past the end"):
        load_model(str(tmp_path / "cut.gguf"), show_progress=False)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ValueError, match=r"junk\.gguf: not a GGUF"):
        load_model(str(tmp_path / "junk.gguf"), show_progress=False)

    meta, _ = read_gguf(str(good))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        from engine.model.gguf_loader import config_from_gguf

        config_from_gguf({**meta, "general.architecture": "gpt2"}, {}, "x.gguf")
    missing_key = {k: v for k, v in meta.items() if k != "llama.block_count"}
    with pytest.raises(ValueError, match=r"x\.gguf: metadata key llama\.block_count is missing"):
        config_from_gguf(missing_key, {}, "x.gguf")

    extra = {"blk.0.ffn_gate_exps.weight": np.zeros((2, 4), np.float32)}
    path = write_gguf(tiny_model("llama"), tmp_path / "moe.gguf", extra_tensors=extra)
    with pytest.raises(
        ValueError, match=r"moe\.gguf: unknown tensor blk\.0\.ffn_gate_exps\.weight"
    ):
        load_model(str(path), show_progress=False)

    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"bare\.gguf: tokenizer metadata .* is missing"):
        load_model(str(tmp_path / "bare.gguf"), show_progress=False)
