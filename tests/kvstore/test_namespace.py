from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import ModelConfig
from engine.kvcache.paged_cache import bytes_per_block
from engine.kvstore.namespace import KVNamespace, make_namespace

CFG = ModelConfig(
    architecture="llama",
    vocab_size=100,
    hidden_size=16,
    intermediate_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    max_position_embeddings=64,
    name="/some/host/path/model.gguf",
)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 100_000))


def test_same_model_same_id_whatever_its_path():
    a = make_namespace(CFG, _model(), torch.float32, 16)
    b = make_namespace(dataclasses.replace(CFG, name="elsewhere"), _model(), torch.float32, 16)
    assert a == b and a.id == b.id and len(a.id) == 16


def test_weights_shapes_and_layout_change_the_id():
    base = make_namespace(CFG, _model(), torch.float32, 16)
    changed = _model()
    with torch.no_grad():
        changed[1].weight.mul_(1.001)  # a fine-tune touches (nearly) every element
    ids = {
        base.id,
        make_namespace(CFG, changed, torch.float32, 16).id,
        make_namespace(CFG, _model(seed=1), torch.float32, 16).id,
        make_namespace(dataclasses.replace(CFG, rope_theta=5e5), _model(), torch.float32, 16).id,
        make_namespace(CFG, _model(), torch.bfloat16, 16).id,
        make_namespace(CFG, _model(), torch.float32, 32).id,
    }
    assert len(ids) == 6


def test_block_bytes_match_the_paged_cache_and_describe():
    ns = make_namespace(CFG, _model(), torch.bfloat16, 16)
    assert ns.block_bytes == bytes_per_block(CFG, 16, torch.bfloat16)
    d = ns.describe()
    assert d["id"] == ns.id.hex() and d["dtype"] == "bfloat16" and d["num_kv_heads"] == 2
    assert "path" not in str(d)


def test_bad_fields_are_named():
    with pytest.raises(ValueError, match="block_size"):
        KVNamespace("d", "float32", 0, 1, 1, 1)
    with pytest.raises(ValueError, match="dtype"):
        KVNamespace("d", "float33", 16, 1, 1, 1)


def test_quantized_weights_change_the_id():
    # int8 and W8A8 compute other KV from the same file: their blocks must never mix
    from engine.layers.linear import Linear

    def model(quantization: str | None) -> torch.nn.Module:
        torch.manual_seed(0)
        lin = Linear(64, 32, False, torch.float32, "cpu")
        torch.nn.init.normal_(lin.weight)
        if quantization == "int8":
            lin.quantize_int8_()
        elif quantization == "w8a8":
            lin.quantize_w8a8_()
        return lin

    ids = {make_namespace(CFG, model(q), torch.float32, 16).id for q in (None, "int8", "w8a8")}
    assert len(ids) == 3
    for q in ("int8", "w8a8"):  # and other weights under the same quantization, another id
        other = model(q)
        with torch.no_grad():
            for p in other.parameters():
                if p.dtype == torch.float32:
                    p.mul_(2.0)  # the scales (int8) or nothing (w8a8's bytes)
                else:
                    p.copy_(p.flip(-1))
        assert make_namespace(CFG, other, torch.float32, 16).id not in ids, q
