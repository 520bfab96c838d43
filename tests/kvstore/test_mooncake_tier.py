"""The Mooncake Store backend against a real `mooncake_master` (with its HTTP metadata server) and
a real long-lived process lending it memory (`engine pool serve --mooncake ...&segment=SIZE`):
put/get parity through MooncakeTier and through a BlockStore built from a kv_pool string, blocks
outliving the client that wrote them, and corrupt, truncated or foreign objects read as misses
and removed. Skipped, saying why, only where the package or libibverbs is missing."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pool_service_helpers import block, free_port, key, small_namespace, start_service, stop

from engine.kvstore import block_record
from engine.kvstore.mooncake_tier import MooncakeUnavailable, load_store_class

NS = small_namespace("mooncake-test")
BB = NS.block_bytes


def _mooncake_or_skip():
    try:
        store_class = load_store_class()
    except MooncakeUnavailable as exc:
        pytest.skip(str(exc))
    master = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    if not os.access(master, os.X_OK):
        pytest.skip("mooncake_master is not installed (pip install 'engine[mooncake]')")
    return store_class, master


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "mooncake_master exited"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port} after {timeout}s")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """mooncake_master + `engine pool serve --mooncake` lending 64 MiB; yields the client URL."""
    store_class, master_bin = _mooncake_or_skip()
    rpc, http, metrics = free_port(), free_port(), free_port()
    log = open(tmp_path_factory.mktemp("mooncake") / "master.log", "wb")
    master = subprocess.Popen(
        [
            master_bin,
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_port={http}",
            "-http_metadata_server_host=127.0.0.1",
            f"-rpc_port={rpc}",
            f"-metrics_port={metrics}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    lender = None
    try:
        _wait_port(rpc, master)
        _wait_port(http, master)
        url = f"mooncake://127.0.0.1:{rpc}?metadata=http://127.0.0.1:{http}/metadata"
        # Only lending (no --dram/--ssd): `engine pool serve --mooncake URL&segment=SIZE`.
        lender = start_service("--mooncake", url + "&segment=64MiB", ready=b"mooncake lender")
        yield {"url": url, "store_class": store_class, "lender": lender}
    finally:
        stop(lender)
        master.kill()
        master.wait(timeout=10)
        log.close()


@pytest.fixture
def tier(cluster):
    from engine.kvstore.mooncake_tier import MooncakeTier
    from engine.pool_spec import parse_pool_spec

    t = MooncakeTier(parse_pool_spec(cluster["url"]).remote, NS)
    try:
        yield t
    finally:
        t.clear()
        t.close()


def test_put_get_parity(tier):
    keys = [key(i) for i in range(12)]
    for i, k in enumerate(keys):
        assert tier.put(k, memoryview(block(i, BB)), position=i).stored
    assert tier.put(keys[0], memoryview(block(0, BB))).stored  # present: still stored
    assert tier.match_prefix(keys) == 12
    assert tier.match_prefix([keys[0], key(99), keys[2]]) == 1
    out = bytearray(BB)
    for i, k in enumerate(keys):
        assert tier.get_into(k, memoryview(out))
        assert out == block(i, BB)
    assert not tier.get_into(key(99), memoryview(out))
    assert tier.remove(keys[5]) and not tier.contains(keys[5])
    assert tier.match_prefix(keys) == 5
    stats = tier.stats()
    assert stats["hits"] == 12 and stats["misses"] == 1 and stats["failed_reads"] == 0
    assert tier.clear() == 11 and tier.match_prefix(keys) == 0


def test_blocks_outlive_the_client_that_wrote_them(cluster, tier):
    from engine.kvstore.block_store import build_block_store
    from engine.pool_spec import parse_pool_spec

    spec = parse_pool_spec(f"dram=64KiB,{cluster['url']}")
    writer = build_block_store(spec, NS)
    try:
        for i in range(4):
            assert writer.put(key(i, salt=1), memoryview(block(i, BB)))
    finally:
        writer.close()  # the objects live in the lender's segment, not the writer's
    reader = build_block_store(spec, NS)
    try:
        assert reader.locate([key(i, salt=1) for i in range(5)]) == ["remote"] * 4
        out = bytearray(BB)
        assert reader.get_into(key(2, salt=1), memoryview(out)) == "remote"
        assert out == block(2, BB)
        assert reader.get_into(key(2, salt=1), memoryview(out)) == "dram"  # promoted
    finally:
        reader.close()


def test_bad_objects_are_misses_and_removed(cluster, tier):
    raw = cluster["store_class"]()
    spec = tier.spec
    assert raw.setup("127.0.0.1", spec.metadata, 0, 16 << 20, "tcp", "", spec.master) == 0
    try:
        payload = block(1, BB)
        good = block_record.encode_header(NS.id, key(1), payload) + payload
        flipped = bytearray(good)
        flipped[-10] ^= 0x01
        foreign_ns = small_namespace("another-model").id
        cases = {
            "flipped byte": bytes(flipped),
            "truncated": good[:-100],
            "too long": good + b"x" * 64,
            "foreign namespace": block_record.encode_header(foreign_ns, key(1), payload) + payload,
            "other key": block_record.encode_header(NS.id, key(2), payload) + payload,
            "garbage": b"\x00" * len(good),
        }
        out = bytearray(BB)
        for name, value in cases.items():
            okey = tier.object_key(key(1))
            assert raw.put(okey, value) == 0, name
            assert tier.contains(key(1)), name
            assert not tier.get_into(key(1), memoryview(out)), name
            assert raw.is_exist(okey) == 0, f"{name}: the bad object was not removed"
        assert tier.stats()["failed_reads"] == len(cases)
        assert raw.put(tier.object_key(key(1)), good) == 0  # and a good one reads back
        assert tier.get_into(key(1), memoryview(out)) and out == payload
    finally:
        raw.close()


def test_missing_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import raises ImportError
    with pytest.raises(MooncakeUnavailable, match=r"pip install 'engine\[mooncake\]'"):
        load_store_class()


def test_lending_needs_a_segment():
    from engine.kvstore.mooncake_tier import MemoryLender
    from engine.pool_spec import parse_pool_spec

    spec = parse_pool_spec("mooncake://127.0.0.1:1?metadata=http://127.0.0.1:2/metadata").remote
    with pytest.raises(ValueError, match="segment=SIZE"):
        MemoryLender(spec)


def test_batches_stop_at_the_first_miss(tier):
    keys = [key(i, salt=4) for i in range(6)]
    datas = [block(i, BB) for i in range(6)]
    assert tier.put_many(keys[:3] + keys[4:], datas[:3] + datas[4:]) == [True] * 5
    outs = [bytearray(BB) for _ in keys]
    assert tier.get_many_into(keys, outs) == 3
    assert outs[:3] == datas[:3] and outs[3] == bytearray(BB)


def test_unreachable_master_is_a_clear_error():
    _mooncake_or_skip()
    from engine.kvstore.mooncake_tier import MooncakeTier
    from engine.pool_spec import parse_pool_spec

    port = free_port()  # nothing listens there
    url = f"mooncake://127.0.0.1:{port}?metadata=http://127.0.0.1:{port}/metadata"
    with pytest.raises(ConnectionError, match="not reachable"):
        MooncakeTier(parse_pool_spec(url).remote, NS)


@pytest.mark.slow
def test_dead_master_reads_miss_with_one_warning(tmp_path, caplog):
    """The master is killed under a client: reads miss, writes fail, one warning; never a hang
    or an exception. (Closing a client whose master is gone takes Mooncake ~12 s: slow.)"""
    import logging

    from engine.kvstore.mooncake_tier import MooncakeTier
    from engine.pool_spec import parse_pool_spec

    _, master_bin = _mooncake_or_skip()
    rpc, http, metrics = free_port(), free_port(), free_port()
    master = subprocess.Popen(
        [
            master_bin,
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_port={http}",
            f"-rpc_port={rpc}",
            f"-metrics_port={metrics}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tier = None
    try:
        _wait_port(rpc, master)
        _wait_port(http, master)
        url = f"mooncake://127.0.0.1:{rpc}?metadata=http://127.0.0.1:{http}/metadata"
        tier = MooncakeTier(parse_pool_spec(url + "&segment=16MiB").remote, NS)
        assert tier.put(key(1), memoryview(block(1, BB))).stored
        master.kill()
        master.wait(timeout=10)
        out = bytearray(BB)
        with caplog.at_level(logging.WARNING, logger="engine.kvstore.mooncake_tier"):
            results = [tier.get_into(key(1), memoryview(out)) for _ in range(5)]
            results.append(tier.put(key(2), memoryview(block(2, BB))).stored)
            results.append(tier.contains(key(1)))
        assert not any(results)
        assert len([r for r in caplog.records if "does not answer" in r.getMessage()]) == 1
    finally:
        if tier is not None:
            tier.close()
        if master.poll() is None:
            master.kill()
            master.wait(timeout=10)


def test_engine_prefix_through_mooncake_matches_recompute(cluster):
    """Greedy tokens of SmolLM2 with the prefix loaded from the Mooncake Store by a second engine
    equal the full recompute; only the tail runs."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    prompt = list(range(4000, 4150))  # 9 full blocks of 16, then 6 tokens
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    args = dict(dtype="float32", device="cpu", num_blocks=128)
    with LLM(**args, kv_pool=cluster["url"]) as writer:
        first = writer.generate(prompt, greedy)[0]
        assert writer.engine.connector.flush()
    with LLM(**args, kv_pool=cluster["url"]) as reader:
        second = reader.generate(prompt, greedy)[0]
        reader.engine.check_integrity()
    assert first.metrics.num_computed_prompt_tokens == 150
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.metrics.kv_sources == {"remote": 144}
    assert second.metrics.num_computed_prompt_tokens == 6
