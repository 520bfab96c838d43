from __future__ import annotations

import pytest

from engine.pool_spec import (
    DramSpec,
    MooncakeSpec,
    PoolSpec,
    ServiceSpec,
    SsdSpec,
    parse_pool_spec,
    parse_size,
)

GiB = 1 << 30


@pytest.mark.parametrize(
    "text,expected",
    [
        ("4GiB", 4 * GiB),
        ("512 MiB", 512 << 20),
        ("100kib", 100 << 10),
        ("1.5GiB", 3 * GiB // 2),
        ("1048576", 1 << 20),
        ("2TiB", 2 << 40),
    ],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["4GB", "4 G", "", "-1GiB", "GiB", "1e9"])
def test_bad_sizes_say_what_is_allowed(text):
    with pytest.raises(ValueError, match="binary suffix"):
        parse_size(text)


def test_the_issue_examples():
    assert parse_pool_spec("dram=4GiB,ssd=/var/cache/kv:50GiB") == PoolSpec(
        dram=DramSpec(4 * GiB), ssd=SsdSpec("/var/cache/kv", 50 * GiB)
    )
    spec = parse_pool_spec("dram=1GiB,tcp://10.0.0.5:7600")
    assert spec.remote == ServiceSpec("10.0.0.5", 7600)
    assert spec.remote.address == "tcp://10.0.0.5:7600"


def test_ssd_size_is_after_the_last_colon():
    assert parse_pool_spec("ssd=/mnt/a:b/kv:2GiB").ssd == SsdSpec("/mnt/a:b/kv", 2 * GiB)


def test_mooncake_url():
    spec = parse_pool_spec(
        "dram=1GiB,mooncake://10.0.0.7:50051?metadata=http://10.0.0.7:8080/metadata"
        "&segment=512MiB&buffer=64MiB"
    )
    assert spec.remote == MooncakeSpec(
        "10.0.0.7", 50051, "http://10.0.0.7:8080/metadata", 512 << 20, 64 << 20
    )
    assert spec.remote.master == "10.0.0.7:50051"
    minimal = parse_pool_spec("mooncake://h:1?metadata=http://h:2/metadata").remote
    assert (minimal.segment, minimal.buffer) == (0, 0)


def test_round_trip_through_str(tmp_path):
    for text in [
        "dram=4GiB,ssd=/var/cache/kv:50GiB",
        "dram=1GiB,tcp://10.0.0.5:7600,policy=length",
        "tcp://[::1]:7600",
        "mooncake://h:1?metadata=http://h:2/metadata&segment=1GiB",
    ]:
        spec = parse_pool_spec(text)
        assert parse_pool_spec(str(spec)) == spec


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "empty part"),
        ("dram=1GiB,,ssd=/x:1GiB", "empty part"),
        ("dram=0", "dram size must be > 0"),
        ("dram=4GB", "'dram=4GB'.*binary suffix"),
        ("ssd=/x", "ssd=PATH:SIZE"),
        ("ssd=:1GiB", "path is empty"),
        ("dram=1GiB,dram=2GiB", "at most one dram"),
        ("tcp://a:1,tcp://b:2", "at most one remote"),
        ("tcp://a:1,mooncake://h:1?metadata=u", "at most one remote"),
        ("ssd=/x:1GiB,dram=1GiB", "lookup order"),
        ("tcp://a:1,dram=1GiB", "lookup order"),
        ("tcp://a", "port must be in 1..65535"),
        ("tcp://a:99999", "tcp://a:99999"),
        ("tcp://:7600", "host is empty"),
        ("tcp://a:1/path", "nothing after the port"),
        ("mooncake://h:1", "metadata=URL is required"),
        ("mooncake://h:1?metadata=u&segmnt=1GiB", "unknown parameter"),
        ("mooncake://h:1?metadata=u&segment=lots", "segment 'lots'"),
        ("redis://h:1", "none of dram=SIZE"),
        ("policy=fifo", "policy 'fifo' is unknown"),
        ("policy=lru", "names no tier"),
    ],
)
def test_errors_name_the_part_and_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        parse_pool_spec(text)
