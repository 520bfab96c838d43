"""The weight cache (engine/model/weight_cache.py, engine/model/builder.py): written on the first
load, mapped on the next without dequantizing, bit-identical to an uncached load, and rebuilt
(never an error) when the file is damaged or foreign. Each test has its own cache directory."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from tiny_models import tiny_gguf

import engine.model.gguf_loader as gguf_loader
from engine.config import CacheConfig, EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.model import weight_cache
from engine.model.builder import build_model

CPU = torch.device("cpu")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "weights"
    monkeypatch.setenv("ENGINE_WEIGHT_CACHE_DIR", str(directory))
    monkeypatch.delenv("ENGINE_WEIGHT_CACHE", raising=False)
    return directory


@pytest.fixture
def reads(monkeypatch):
    """How many GGUF tensors were read (dequantized) since the test began."""
    count = {"n": 0}
    original = gguf_loader._read_tensor

    def counting(tensor, heads):
        count["n"] += 1
        return original(tensor, heads)

    monkeypatch.setattr(gguf_loader, "_read_tensor", counting)
    return count


@pytest.fixture(scope="module")
def model_file():
    return str(tiny_gguf("llama", QType.Q8_0))


def weights(built) -> dict[str, torch.Tensor]:
    return built.model.runtime_weights()


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_once_then_mapped_without_dequantizing(cache_dir, reads, model_file, dtype):
    first = build_model(model_file, dtype, CPU)
    assert not first.cache_hit and first.cache_file and os.path.isfile(first.cache_file)
    assert os.path.dirname(first.cache_file) == str(cache_dir)
    assert reads["n"] > 0
    reads["n"] = 0
    second = build_model(model_file, dtype, CPU)
    assert second.cache_hit and second.cache_file == first.cache_file
    assert reads["n"] == 0  # nothing dequantized
    uncached = build_model(model_file, dtype, CPU, use_cache=False)
    assert uncached.cache_file is None
    assert_identical(weights(second), weights(uncached))


def test_tied_lm_head_follows_the_mapped_embedding(cache_dir):
    path = str(tiny_gguf("llama_tied", QType.Q8_0))
    build_model(path, torch.float32, CPU)
    built = build_model(path, torch.float32, CPU)
    assert built.cache_hit and built.config.tie_word_embeddings
    assert "lm_head" not in built.model.runtime_weights()  # stored once
    assert built.model.lm_head is built.model.embed_tokens
    uncached = build_model(path, torch.float32, CPU, use_cache=False)
    hidden = torch.randn(3, built.config.hidden_size)
    assert torch.equal(built.model.compute_logits(hidden), uncached.model.compute_logits(hidden))


def test_dtypes_have_their_own_files(cache_dir, model_file):
    a = build_model(model_file, torch.float32, CPU)
    b = build_model(model_file, torch.bfloat16, CPU)
    assert a.cache_file != b.cache_file
    assert sorted(os.listdir(cache_dir)) == sorted(
        os.path.basename(f) for f in (a.cache_file, b.cache_file)
    )


def test_logits_bit_identical_to_uncached(cache_dir, model_file):
    config = EngineConfig(
        model=model_file, dtype="float32", device="cpu", cache=CacheConfig(num_blocks=64)
    )
    LLMEngine(config)  # writes the cache
    cached = LLMEngine(config)
    uncached = LLMEngine(config.with_overrides(weight_cache=False))
    assert cached.weight_cache_hit and not uncached.weight_cache_hit
    ids = [1, 5, 9, 14, 3, 7, 2, 8]
    assert torch.equal(cached.prompt_logits(ids), uncached.prompt_logits(ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mapped_tensors_are_aligned(cache_dir, model_file, dtype):
    """Every mapped tensor starts on a 64-byte boundary, as torch's own allocations do: the
    float32 GEMMs gave other sums for weights 8 bytes off one (what safetensors' writer leaves),
    and engines that mapped the cache computed other logprobs than engines that did not."""
    build_model(model_file, dtype, CPU)
    built = build_model(model_file, dtype, CPU)
    assert built.cache_hit
    assert {
        n: t.data_ptr() % weight_cache.ALIGN for n, t in weights(built).items()
    } == dict.fromkeys(weights(built), 0)


def test_odd_sizes_padded_and_old_files_copied_aligned(tmp_path):
    tensors = {
        "a": torch.arange(7, dtype=torch.bfloat16),  # 14 bytes: a padding tensor follows
        "b": torch.randn(3, 5),
        "c": torch.randn(0, 4),
        "d": torch.arange(3, dtype=torch.int8),
    }
    path = str(tmp_path / "w.st")
    assert weight_cache.save(path, "k", tensors)
    loaded = weight_cache.load(path, "k", tensors)
    assert_identical(loaded, tensors)
    assert all(t.data_ptr() % weight_cache.ALIGN == 0 for t in loaded.values() if t.numel())
    # A file in safetensors' own layout (version 1's): misaligned tensors come back as copies.
    from safetensors.torch import save_file

    checksum = weight_cache._checksum(tensors)
    save_file(
        tensors, path, metadata={"format": "engine-weights", "key": "k", "checksum": checksum}
    )
    loaded = weight_cache.load(path, "k", tensors)
    assert_identical(loaded, tensors)
    assert all(t.data_ptr() % weight_cache.ALIGN == 0 for t in loaded.values() if t.numel())


def _damage_middle(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\xff" * 64)


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)


def _garbage(path: str) -> None:
    with open(path, "wb") as f:
        f.write(b"not a safetensors file at all")


@pytest.mark.parametrize("damage", [_damage_middle, _truncate, _garbage])
def test_damaged_cache_is_rebuilt_with_a_warning(cache_dir, reads, model_file, caplog, damage):
    good = build_model(model_file, torch.float32, CPU)
    damage(good.cache_file)
    reads["n"] = 0
    with caplog.at_level(logging.WARNING, logger="engine.model.weight_cache"):
        again = build_model(model_file, torch.float32, CPU)
    assert not again.cache_hit and reads["n"] > 0
    assert any("rebuilding" in r.message for r in caplog.records), caplog.text
    assert_identical(weights(again), weights(good))
    reads["n"] = 0
    third = build_model(model_file, torch.float32, CPU)  # the rebuilt file is good
    assert third.cache_hit and reads["n"] == 0


def test_foreign_file_under_the_name_is_rebuilt(cache_dir, model_file, caplog):
    """Another dtype's file (valid, but a different key) copied over this one's name."""
    f32 = build_model(model_file, torch.float32, CPU)
    bf16 = build_model(model_file, torch.bfloat16, CPU)
    os.replace(bf16.cache_file, f32.cache_file)
    with caplog.at_level(logging.WARNING, logger="engine.model.weight_cache"):
        again = build_model(model_file, torch.float32, CPU)
    assert not again.cache_hit
    assert "another model file" in caplog.text
    assert_identical(weights(again), weights(f32))


def test_a_changed_model_file_gets_a_new_key(cache_dir, tmp_path, model_file):
    copy = tmp_path / "model.gguf"
    copy.write_bytes(open(model_file, "rb").read())
    first = build_model(str(copy), torch.float32, CPU)
    os.utime(copy, ns=(0, 0))  # same bytes, another mtime: cannot be trusted to be the same
    second = build_model(str(copy), torch.float32, CPU)
    assert not second.cache_hit and second.cache_file != first.cache_file
    assert not os.path.exists(first.cache_file)  # the stale version was pruned


def test_turned_off_by_env_or_flag(cache_dir, reads, model_file, monkeypatch):
    build_model(model_file, torch.float32, CPU, use_cache=False)
    assert not cache_dir.exists()
    monkeypatch.setenv("ENGINE_WEIGHT_CACHE", "0")
    built = build_model(model_file, torch.float32, CPU)
    assert built.cache_file is None and not cache_dir.exists()


def test_unwritable_directory_only_warns(tmp_path, monkeypatch, model_file, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ENGINE_WEIGHT_CACHE_DIR", str(blocker / "weights"))
    with caplog.at_level(logging.WARNING, logger="engine.model.weight_cache"):
        built = build_model(model_file, torch.float32, CPU)
    assert built.cache_file is None and not built.cache_hit
    assert "could not write the weight cache" in caplog.text
    uncached = build_model(model_file, torch.float32, CPU, use_cache=False)
    assert_identical(weights(built), weights(uncached))
