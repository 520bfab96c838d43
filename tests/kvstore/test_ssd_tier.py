from __future__ import annotations

import errno
import os

import pytest
from kv_store_helpers import block, key, small_namespace

from engine.kvstore import block_record
from engine.kvstore.ssd_tier import SsdTier

NS = small_namespace()
BB = NS.block_bytes
REC = block_record.HEADER_SIZE + BB


def _get(t, i) -> bytes | None:
    out = bytearray(BB)
    return bytes(out) if t.get_into(key(i), memoryview(out)) else None


def _fill(path, n, cap_blocks=10):
    t = SsdTier(path, cap_blocks * REC, NS)
    for i in range(n):
        assert t.put(key(i), block(i), position=i).stored
    return t


def test_round_trip_and_record_format(tmp_path):
    t = _fill(tmp_path, 2)
    assert _get(t, 1) == block(1) and _get(t, 5) is None
    files = sorted(p.name for p in t.dir.iterdir())
    assert files == sorted([".lock", key(0).hex() + ".kvb", key(1).hex() + ".kvb"])
    raw = (t.dir / f"{key(1).hex()}.kvb").read_bytes()
    assert bytes(block_record.decode_and_verify(NS.id, key(1), raw)) == block(1)
    s = t.stats()
    assert (s["blocks"], s["hits"], s["misses"], s["bytes_written"]) == (2, 1, 1, 2 * REC)
    t.close()


def test_restart_rebuilds_the_index(tmp_path):
    _fill(tmp_path, 3).close()
    t = SsdTier(tmp_path, 10 * REC, NS)
    assert t.stats()["blocks"] == 3
    assert [_get(t, i) for i in range(3)] == [block(i) for i in range(3)]
    t.close()


def test_a_second_owner_of_the_directory_is_refused(tmp_path):
    t = _fill(tmp_path, 1)
    with pytest.raises(RuntimeError, match="in use"):
        SsdTier(tmp_path, 10 * REC, NS)
    t.close()


def test_other_namespace_never_sees_the_records(tmp_path):
    _fill(tmp_path, 2).close()
    other = SsdTier(tmp_path, 10 * REC, small_namespace("another-model"))
    assert other.stats()["blocks"] == 0 and _get(other, 0) is None
    other.close()
    t = SsdTier(tmp_path, 10 * REC, NS)  # and its directory was left alone
    assert t.stats()["blocks"] == 2
    t.close()


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "extend"])
def test_damaged_record_found_on_read_is_a_miss_and_removed(tmp_path, damage):
    t = _fill(tmp_path, 2)
    path = t.dir / f"{key(0).hex()}.kvb"
    raw = bytearray(path.read_bytes())
    if damage == "flip_payload":
        raw[-5] ^= 0xFF
    elif damage == "flip_header":
        raw[40] ^= 0x01  # inside the key field
    elif damage == "truncate":
        raw = raw[: REC - 100]
    else:
        raw += b"junk"
    path.write_bytes(raw)
    assert _get(t, 0) is None
    assert not path.exists() and not t.contains(key(0))
    assert t.stats()["failed_reads"] == 1
    assert _get(t, 1) == block(1)
    t.close()


def test_bad_records_temporaries_and_foreign_records_are_removed_at_start(tmp_path):
    t = _fill(tmp_path, 4)
    d = t.dir
    t.close()
    (d / f"{key(0).hex()}.kvb").write_bytes(b"EKVB")  # truncated inside the header
    raw = bytearray((d / f"{key(1).hex()}.kvb").read_bytes())
    raw[0] = ord("X")  # bad magic
    (d / f"{key(1).hex()}.kvb").write_bytes(raw)
    # A valid record of another namespace, copied into ours.
    foreign = small_namespace("foreign")
    rec = block_record.encode_header(foreign.id, key(9), block(9)) + block(9)
    (d / f"{key(9).hex()}.kvb").write_bytes(rec)
    # A record renamed to another key's name.
    os.rename(d / f"{key(2).hex()}.kvb", d / f"{key(8).hex()}.kvb")
    (d / f".tmp-{key(5).hex()}-deadbeef").write_bytes(b"half a record")
    t = SsdTier(tmp_path, 10 * REC, NS)
    assert t.stats()["removed_at_start"] == 5
    assert t.keys() == [key(3)]
    assert sorted(p.name for p in d.iterdir()) == sorted([".lock", f"{key(3).hex()}.kvb"])
    t.close()


def test_capacity_evicts_by_policy_and_unlinks(tmp_path):
    t = SsdTier(tmp_path, 3 * REC + 5, NS)
    for i in range(3):
        t.put(key(i), block(i))
    _get(t, 0)
    result = t.put(key(3), block(3))
    assert result.stored and result.evicted == [key(1)]
    assert not (t.dir / f"{key(1).hex()}.kvb").exists()
    assert t.stats()["evictions"] == 1 and t.stats()["blocks"] == 3
    t.close()


def test_smaller_capacity_at_restart_drops_the_oldest(tmp_path):
    t = _fill(tmp_path, 4)
    t.close()
    t = SsdTier(tmp_path, 2 * REC, NS)
    assert t.stats()["blocks"] == 2
    assert len(list(t.dir.glob("*.kvb"))) == 2
    t.close()


@pytest.mark.parametrize("fail_at", ["write", "replace"])
def test_full_disk_is_a_failed_write_not_an_exception(tmp_path, monkeypatch, fail_at):
    t = _fill(tmp_path, 1)

    def enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev" if fail_at == "write" else "replace", enospc)
    assert t.put(key(5), block(5)) == (False, [])
    monkeypatch.undo()
    assert t.stats()["failed_writes"] == 1 and not t.contains(key(5))
    assert [p.name for p in t.dir.iterdir() if p.name.startswith(".tmp")] == []
    assert t.put(key(5), block(5)).stored and _get(t, 5) == block(5)  # the disk has room again
    t.close()


def test_wrong_size_put_fails_and_fsync_mode_works(tmp_path):
    t = SsdTier(tmp_path, 4 * REC, NS, fsync=True)
    assert not t.put(key(0), b"x" * 3).stored
    assert t.put(key(1), block(1)).stored and _get(t, 1) == block(1)
    t.drop_page_cache(key(1))
    assert _get(t, 1) == block(1)
    t.close()


def test_remove_and_clear(tmp_path):
    t = _fill(tmp_path, 3)
    assert t.remove(key(0)) and not t.remove(key(0))
    assert t.clear() == 2
    assert list(t.dir.glob("*.kvb")) == []
    t.close()


def test_record_removed_under_a_reader_is_a_plain_miss(tmp_path):
    t = _fill(tmp_path, 1)
    os.unlink(t.dir / f"{key(0).hex()}.kvb")  # e.g. an operator cleaning the cache directory
    assert _get(t, 0) is None and t.stats()["failed_reads"] == 0
    assert not t.contains(key(0)) and t.stats()["blocks"] == 0
    t.close()


def test_evicted_files_are_recycled_and_never_exceed_the_capacity(tmp_path):
    t = SsdTier(tmp_path, 3 * REC, NS)
    for i in range(10):
        assert t.put(key(i), block(i)).stored
        files = [p for p in t.dir.iterdir() if p.name != ".lock"]
        assert len(files) <= 3
    assert [_get(t, i) for i in range(7, 10)] == [block(i) for i in range(7, 10)]
    assert t.clear() == 3 and t.stats()["spares"] == 3
    assert t.put(key(20), block(20)).stored and t.stats()["spares"] == 2
    assert _get(t, 20) == block(20)
    t.close()
    assert sorted(p.name for p in t.dir.iterdir()) == sorted([".lock", f"{key(20).hex()}.kvb"])
