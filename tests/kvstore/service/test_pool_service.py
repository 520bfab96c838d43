"""`engine pool serve` as a real subprocess: blocks through the shared-memory path and the TCP
path, two client processes sharing blocks, a service killed with SIGKILL and restarted (the client
fails fast with one warning, then reconnects), frames over the limit, events on the PUB socket,
the `engine pool stats|clear` commands and a clean SIGTERM exit."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import msgpack
import pytest
import zmq
from pool_service_helpers import (
    REPO,
    block,
    free_port,
    key,
    small_namespace,
    start_service,
    stop,
)

from engine.kvstore.service_tier import PoolClientTier

NS = small_namespace()
BB = NS.block_bytes


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    port, events = free_port(), free_port()
    ssd = tmp_path_factory.mktemp("pool-ssd")
    proc = start_service(
        "--dram", "64KiB", "--ssd", f"{ssd}:1MiB", "--port", str(port), "--events-port", str(events)
    )
    try:
        yield {"proc": proc, "address": f"tcp://127.0.0.1:{port}", "events": events}
    finally:
        stop(proc)


@pytest.fixture(params=["shm", "tcp"])
def client(request, service):
    c = PoolClientTier(service["address"], NS, force_tcp=request.param == "tcp")
    try:
        yield c
    finally:
        c.clear()
        c.close()


def test_put_get_exists_remove_clear_stats(client):
    keys = [key(i) for i in range(10)]
    for i, k in enumerate(keys):
        assert client.put(k, memoryview(block(i, BB)), position=i).stored
    assert client.same_host == (not client.force_tcp)
    assert client.match_prefix(keys) == 10
    assert client.match_prefix([keys[0], key(99), keys[2]]) == 1
    out = bytearray(BB)
    for i, k in enumerate(keys):
        assert client.get_into(k, memoryview(out))
        assert out == block(i, BB)
    assert not client.get_into(key(99), memoryview(out))
    assert client.put(keys[0], memoryview(block(0, BB))).stored  # present: a refresh
    assert client.remove(keys[3]) and not client.remove(keys[3])
    assert client.match_prefix(keys) == 3
    stats = client.stats()
    assert stats["connected"] and stats["blocks"] == 9 and stats["hits"] == 10
    assert stats["same_host"] == (not client.force_tcp)
    assert client.clear() == 9
    assert client.match_prefix(keys) == 0


def test_blocks_demoted_to_ssd_still_read(client):
    # 64 KiB of DRAM holds 16 blocks: the first ones move to the SSD tier and are still found.
    keys = [key(i, salt=1) for i in range(40)]
    for i, k in enumerate(keys):
        assert client.put(k, memoryview(block(i, BB))).stored
    assert client.match_prefix(keys) == 40
    out = bytearray(BB)
    for i in (0, 1, 39):
        assert client.get_into(keys[i], memoryview(out)) and out == block(i, BB)


def _run_client(address: str, code: str) -> str:
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(REPO / "tests" / "kvstore" / "service")!r})
        from pool_service_helpers import block, key, small_namespace
        from engine.kvstore.service_tier import PoolClientTier
        ns = small_namespace()
        c = PoolClientTier({address!r}, ns)
        """
    ) + textwrap.dedent(code)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_two_client_processes_share_blocks(service):
    writer = """
        for i in range(8):
            assert c.put(key(i, salt=2), memoryview(block(i, ns.block_bytes))).stored
        print(c.same_host)
        c.close()
    """
    assert _run_client(service["address"], writer).strip() == "True"
    out = bytearray(BB)
    for force_tcp in (False, True):  # this process reads them, through the arena and over TCP
        c = PoolClientTier(service["address"], NS, force_tcp=force_tcp)
        try:
            assert c.match_prefix([key(i, salt=2) for i in range(9)]) == 8
            for i in range(8):
                assert c.get_into(key(i, salt=2), memoryview(out)) and out == block(i, BB)
        finally:
            c.close()


def test_frames_over_the_limit_are_refused(tmp_path):
    port = free_port()
    proc = start_service("--dram", "1MiB", "--port", str(port), "--max-frame-bytes", "8KiB")
    big_ns = small_namespace(layers=4)  # 8 KiB blocks: a record (header + block) is over 8 KiB
    try:
        c = PoolClientTier(f"tcp://127.0.0.1:{port}", big_ns, force_tcp=True)
        try:
            assert not c.put(key(1), memoryview(block(1, big_ns.block_bytes))).stored
            assert c.stats()["refused"] == 1
        finally:
            c.close()
        # The shm path moves no frames: the same block is stored through the arena.
        c = PoolClientTier(f"tcp://127.0.0.1:{port}", big_ns)
        try:
            assert c.put(key(1), memoryview(block(1, big_ns.block_bytes))).stored
        finally:
            c.close()
        # A raw frame far over the limit: zmq drops that connection; the service keeps serving.
        ctx = zmq.Context.instance()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(f"tcp://127.0.0.1:{port}")
        raw.send_multipart([b"\x80", b"x" * (1 << 20)])
        assert not raw.poll(500)
        raw.close(linger=0)
        c = PoolClientTier(f"tcp://127.0.0.1:{port}", NS, force_tcp=True)
        try:
            assert c.put(key(2), memoryview(block(2, BB))).stored
        finally:
            c.close()
    finally:
        stop(proc)


def test_events_published(service):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{service['events']}")
    c = PoolClientTier(service["address"], NS)
    try:
        # A subscription takes a moment to reach the publisher: put a probe until one arrives.
        deadline = time.monotonic() + 10
        while not sub.poll(100):
            assert time.monotonic() < deadline, "no event within 10s"
            c.put(key(0, salt=3), memoryview(block(0, BB)))
        while sub.poll(200):
            sub.recv()
        assert c.put(key(1, salt=3), memoryview(block(1, BB))).stored
        event = msgpack.unpackb(sub.recv(), raw=False)
        port = service["address"].rsplit(":", 1)[1]
        assert event == {
            "type": "stored",
            "namespace": NS.id.hex(),
            "keys": [key(1, salt=3)],
            "source": f"pool@127.0.0.1:{port}",
        }
        assert c.remove(key(1, salt=3))
        event = msgpack.unpackb(sub.recv(), raw=False)
        assert event["type"] == "removed" and event["keys"] == [key(1, salt=3)]
        c.clear()
    finally:
        c.close()
        sub.close(linger=0)


@pytest.mark.slow
def test_evictions_from_the_last_tier_are_published(tmp_path):
    port, events = free_port(), free_port()
    proc = start_service("--dram", "16KiB", "--port", str(port), "--events-port", str(events))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{events}")
    c = PoolClientTier(f"tcp://127.0.0.1:{port}", NS)
    try:
        deadline = time.monotonic() + 10
        while not sub.poll(100):
            assert time.monotonic() < deadline, "no event within 10s"
            c.put(key(0), memoryview(block(0, BB)))
        for i in range(1, 6):  # 4 slots: keys 0 and 1 are evicted (LRU)
            assert c.put(key(i), memoryview(block(i, BB))).stored
        removed = []
        while sub.poll(500):
            event = msgpack.unpackb(sub.recv(), raw=False)
            if event["type"] == "removed":
                removed += event["keys"]
        assert removed == [key(0), key(1)]
    finally:
        c.close()
        sub.close(linger=0)
        stop(proc)


def test_kill9_restart_client_fails_fast_then_reconnects(tmp_path, caplog):
    port = free_port()
    ssd = tmp_path / "ssd"
    args = ("--ssd", f"{ssd}:1MiB", "--port", str(port))
    proc = start_service(*args)
    c = PoolClientTier(f"tcp://127.0.0.1:{port}", NS, timeout=1.0)
    out = bytearray(BB)
    try:
        assert c.put(key(7), memoryview(block(7, BB))).stored
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        with caplog.at_level(logging.WARNING, logger="engine.kvstore.service.connection"):
            results = [c.get_into(key(7), memoryview(out)) for _ in range(5)]
            results.append(c.put(key(8), memoryview(block(8, BB))).stored)
            results.append(c.match_prefix([key(7)]))
        assert not any(results)
        warnings = [r for r in caplog.records if "does not answer" in r.getMessage()]
        assert len(warnings) == 1
        proc = start_service(*args)  # same port, same SSD directory
        deadline = time.monotonic() + 20
        while not c.get_into(key(7), memoryview(out)):  # back-off ends, the client says hello
            assert time.monotonic() < deadline, "the client did not reconnect within 20s"
            time.sleep(0.2)
        assert out == block(7, BB)  # the SSD record survived the kill
        assert c.put(key(8), memoryview(block(8, BB))).stored
        assert c.stats()["reconnects"] == 1
    finally:
        c.close()
        stop(proc)


def test_restart_between_calls_uses_the_new_arena(tmp_path):
    """The service killed and restarted between two calls of a client that never saw it down:
    the next call learns of the restart ("unknown namespace"), says hello and is answered with
    offsets in the new service's arena. Reads and writes must go through that arena, not the
    mapping of the old one (whose slots hold other blocks or nothing): a chaos run found wrong
    answers served from blocks read, and committed, through the dead service's arena."""
    port = free_port()
    args = ("--dram", "64KiB", "--port", str(port))
    proc = start_service(*args)
    c = PoolClientTier(f"tcp://127.0.0.1:{port}", NS, timeout=2.0)
    other = None
    out = bytearray(BB)
    try:
        # Slots of the first arena hold blocks 0-3; the restarted service hands out its own
        # slots from the start again, so an old mapping would show these bytes.
        for i in range(4):
            assert c.put(key(i, salt=5), memoryview(block(i, BB))).stored
        assert c.same_host
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        proc = start_service(*args)
        other = PoolClientTier(f"tcp://127.0.0.1:{port}", NS)
        assert other.put(key(10, salt=5), memoryview(block(10, BB))).stored
        _reconnected(c)
        # Read: the first call after the restart.
        assert c.get_into(key(10, salt=5), memoryview(out))
        assert out == block(10, BB)
        assert c.stats()["reconnects"] == 0  # it never saw the service down
        # Write: a restart again, then a put as the first call; another client reads it back.
        other.close()
        other = None
        stop(proc)
        proc = start_service(*args)
        _reconnected(c)
        assert c.put(key(11, salt=5), memoryview(block(11, BB))).stored
        other = PoolClientTier(f"tcp://127.0.0.1:{port}", NS)
        assert other.get_into(key(11, salt=5), memoryview(out))
        assert out == block(11, BB)
    finally:
        c.close()
        if other is not None:
            other.close()
        stop(proc)


def _reconnected(c: PoolClientTier) -> None:
    """Wait until ZeroMQ reconnected c's socket to the restarted service (it does so in the
    background), so that c's next call reaches it rather than failing as not connected."""
    assert c._conn._socket().poll(20_000, zmq.POLLOUT), "no reconnection within 20 s"


def test_admin_commands_and_sigterm(tmp_path):
    port = free_port()
    proc = start_service("--dram", "64KiB", "--port", str(port))
    try:
        c = PoolClientTier(f"tcp://127.0.0.1:{port}", NS)
        try:
            assert c.put(key(1), memoryview(block(1, BB))).stored
            arena = c.arena_name
        finally:
            c.close()
        assert arena and os.path.exists(f"/dev/shm/{arena}")
        env = dict(os.environ, PYTHONPATH=str(REPO))
        cli = [sys.executable, "-m", "engine.cli.main", "pool"]
        addr = ["--address", f"tcp://127.0.0.1:{port}"]
        out = subprocess.run(cli + ["stats", *addr], capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout)
        assert stats[NS.id.hex()]["tiers"]["dram"]["blocks"] == 1
        out = subprocess.run(cli + ["clear", *addr], capture_output=True, text=True, env=env)
        assert out.returncode == 0 and "cleared 1 blocks" in out.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert not os.path.exists(f"/dev/shm/{arena}")  # the arena is unlinked on exit
    finally:
        stop(proc)


def test_batches_stop_at_the_first_miss(client):
    keys = [key(i, salt=5) for i in range(6)]
    datas = [block(i, BB) for i in range(6)]
    assert client.put_many(keys[:3] + keys[4:], datas[:3] + datas[4:]) == [True] * 5
    assert client.put_many([key(9), key(10)], [block(9, BB), b"short"]) == [True, False]
    outs = [bytearray(BB) for _ in keys]
    assert client.get_many_into(keys, outs) == 3
    assert outs[:3] == datas[:3] and outs[3] == bytearray(BB)
    assert client.get_many_into(keys[4:], outs[4:]) == 2 and outs[4:] == datas[4:]


def test_hung_service_hits_the_deadline_then_recovers(service, caplog):
    """A service that accepts connections but does not answer (SIGSTOP): the call ends at its
    deadline as a miss, later calls fail at once, and the client resumes after SIGCONT."""
    c = PoolClientTier(service["address"], NS, timeout=0.5)
    out = bytearray(BB)
    try:
        assert c.put(key(1, salt=6), memoryview(block(1, BB))).stored
        service["proc"].send_signal(signal.SIGSTOP)
        try:
            with caplog.at_level(logging.WARNING, logger="engine.kvstore.service.connection"):
                assert not c.get_into(key(1, salt=6), memoryview(out))
                assert not c.put(key(2, salt=6), memoryview(block(2, BB))).stored
            assert c.stats()["timeouts"] == 1  # the second call did not wait: back-off
        finally:
            service["proc"].send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 20
        while not c.get_into(key(1, salt=6), memoryview(out)):
            assert time.monotonic() < deadline, "the client did not resume within 20s"
            time.sleep(0.2)
        assert out == block(1, BB)
        assert len([r for r in caplog.records if "does not answer" in r.getMessage()]) == 1
        c.clear()
    finally:
        c.close()
