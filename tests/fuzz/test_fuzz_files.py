"""Files from disk under damage: GGUF and safetensors checkpoints (truncated, bytes flipped,
length fields set to huge values) and SSD tier records (truncated, flipped, replaced, foreign).
Loading a damaged model either succeeds (the damage hit weight values, which carry no checksum)
or raises a clear error (ValueError or OSError, naming the file); never a crash, a hang or an
unbounded allocation. A damaged SSD record is a miss and is removed; it never yields wrong bytes.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import struct
import time
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import tiny_gguf, tiny_model

from engine.kvstore.ssd_tier import SsdTier

START = 0.0  # when the module started (tests/fuzz/conftest.py sets it)

HANG_S = 120  # a load that takes this long is a hang: the process dumps its stacks and exits
RSS_GROWTH = 2 << 30
COUNTS: dict[str, dict[str, int]] = {}
FAST = settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
FAST_SSD = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
LONG = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))


@st.composite
def damage(draw, size: int, hot: int) -> list[tuple[str, int, int]]:
    """1..3 damages to a file of ``size`` bytes; most in its first ``hot`` bytes (headers)."""
    out = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["truncate", "flip", "huge", "zero"]))
        where = draw(st.integers(0, min(size, hot) - 1) | st.integers(0, size - 1))
        out.append((kind, where, draw(st.integers(1, 255))))
    return out


def _apply(path: Path, damages) -> None:
    data = bytearray(path.read_bytes())
    for kind, where, x in damages:
        where = min(where, max(0, len(data) - 1))
        if kind == "truncate":
            del data[where:]
        elif kind == "flip" and data:
            data[where] ^= x
        elif kind == "huge":  # a length or count field read as 2**64 - 1 (or nearly)
            data[where : where + 8] = struct.pack("<Q", 2**64 - x)
        elif kind == "zero":
            data[where : where + x] = bytes(min(x, len(data) - where))
    path.write_bytes(bytes(data))


def _load(path: Path, fmt: str) -> str:
    """Load the damaged model; the outcome's name (a clear error or a load)."""
    from engine.model.loader import load_model

    rss0 = psutil.Process().memory_info().rss
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    try:
        load_model(str(path), show_progress=False)
        outcome = "loaded"
    except (ValueError, OSError) as exc:
        assert str(path) in str(exc), f"the error must name the file: {exc!r}"
        outcome = type(exc).__name__
    finally:
        faulthandler.cancel_dump_traceback_later()
    grew = psutil.Process().memory_info().rss - rss0
    assert grew < RSS_GROWTH, f"loading a damaged {fmt} file took {grew >> 20} MiB"
    c = COUNTS.setdefault(fmt, {})
    c[outcome] = c.get(outcome, 0) + 1
    return outcome


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return tiny_gguf("llama")


@pytest.fixture(scope="module")
def hf_dir() -> Path:
    return tiny_model("llama")


def _gguf(gguf_file, tmp_path_factory, damages) -> None:
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    shutil.copy(gguf_file, path)
    _apply(path, damages)
    _load(path, "gguf")


def _hf(hf_dir, tmp_path_factory, target, damages) -> None:
    d = tmp_path_factory.mktemp("hf") / "m"
    shutil.copytree(hf_dir, d)
    _apply(d / target, damages)
    _load(d, "safetensors" if target.endswith(".safetensors") else target)


GGUF_SIZE = 4 << 20  # damage offsets are clipped to the file's size


@FAST
@given(damages=damage(GGUF_SIZE, 1 << 16))
def test_damaged_gguf(gguf_file, tmp_path_factory, damages):
    _gguf(gguf_file, tmp_path_factory, damages)


@pytest.mark.slow
@LONG
@given(damages=damage(GGUF_SIZE, 2 << 20))
def test_damaged_gguf_long(gguf_file, tmp_path_factory, damages):
    _gguf(gguf_file, tmp_path_factory, damages)


TARGETS = ["model.safetensors", "config.json", "tokenizer.json"]


@FAST
@given(target=st.sampled_from(TARGETS), damages=damage(1 << 20, 4096))
def test_damaged_hf_checkpoint(hf_dir, tmp_path_factory, target, damages):
    _hf(hf_dir, tmp_path_factory, target, damages)


@pytest.mark.slow
@LONG
@given(target=st.sampled_from(TARGETS), damages=damage(1 << 20, 1 << 16))
def test_damaged_hf_checkpoint_long(hf_dir, tmp_path_factory, target, damages):
    _hf(hf_dir, tmp_path_factory, target, damages)


def test_empty_and_missing_files(tmp_path, gguf_file):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert _load(empty, "gguf") in ("ValueError", "OSError")
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(100))
    assert _load(not_gguf, "gguf") == "ValueError"
    d = tmp_path / "hf"
    shutil.copytree(tiny_model("llama"), d)
    os.unlink(d / "model.safetensors")
    assert _load(d, "safetensors") in ("ValueError", "OSError")


# -- SSD records -----------------------------------------------------------------------------


def _ssd(tmp_path_factory, damages_per_key) -> None:
    from kvstore.service.pool_service_helpers import block, key, small_namespace

    ns = small_namespace()
    d = tmp_path_factory.mktemp("ssd")
    tier = SsdTier(d, 1 << 20, ns)
    keys = [key(i) for i in range(len(damages_per_key))]
    for i, k in enumerate(keys):
        assert tier.put(k, memoryview(block(i, ns.block_bytes))).stored
    files = {k: tier._path(k) for k in keys}
    damaged = set()
    for k, damages in zip(keys, damages_per_key):
        if damages:
            _apply(files[k], damages)
            damaged.add(k)
    (tier.dir / "junk.kvb").write_bytes(b"junk")
    (tier.dir / ("ab" * 32 + ".kvb")).write_bytes(os.urandom(100))

    def read_all(t: SsdTier) -> dict[bytes, bool]:
        got = {}
        for i, k in enumerate(keys):
            out = bytearray(ns.block_bytes)
            hit = t.get_into(k, memoryview(out))
            if hit:
                assert bytes(out) == block(i, ns.block_bytes), "a damaged record gave bytes"
            got[k] = hit
        return got

    first = read_all(tier)
    assert all(first[k] for k in keys if k not in damaged)
    tier.close()
    again = SsdTier(d, 1 << 20, ns)  # the index rebuilt from what is on disk
    second = read_all(again)
    assert all(second[k] for k in keys if k not in damaged)
    assert not any(second[k] for k in keys if not first[k])  # a miss stays a miss (removed)
    again.close()
    c = COUNTS.setdefault("ssd-record", {})
    c["records"] = c.get("records", 0) + len(keys)
    c["damaged"] = c.get("damaged", 0) + len(damaged)
    # A hit after "damage" means the damage changed nothing (zeros over zeros): the bytes were
    # compared with the original above.
    c["damage_was_a_no_op"] = c.get("damage_was_a_no_op", 0) + sum(first[k] for k in damaged)


RECORD = 72 + 4096


@FAST_SSD
@given(damages_per_key=st.lists(st.none() | damage(RECORD, 80), min_size=1, max_size=8))
def test_damaged_ssd_records(tmp_path_factory, damages_per_key):
    _ssd(tmp_path_factory, damages_per_key)


@pytest.mark.slow
@LONG
@given(damages_per_key=st.lists(st.none() | damage(RECORD, 80), min_size=1, max_size=16))
def test_damaged_ssd_records_long(tmp_path_factory, damages_per_key):
    _ssd(tmp_path_factory, damages_per_key)


def test_write_file_fuzz_record():
    from reliab_record import record_if_the_run_passes

    assert COUNTS, "the file fuzz tests ran nothing"
    record_if_the_run_passes(
        "fuzz",
        "files",
        "GGUF and safetensors/config/tokenizer files truncated, bytes flipped or zeroed, "
        "8-byte fields set to ~2**64; SSD records truncated/flipped/zeroed, junk files",
        COUNTS,
        "every damaged model loaded or raised ValueError/OSError naming the problem; no crash, "
        f"no hang (>{HANG_S} s), RSS growth < {RSS_GROWTH >> 30} GiB; damaged SSD records read "
        "as misses and never as wrong bytes",
        extra={"finished": time.time()},
        duration_s=time.monotonic() - START,
    )
