"""``engine router --kv-pool tcp://HOST:PORT``: the router learns a pool service started on its
own (its name in the block events, its events port) by asking it, as ``engine cluster
--pool-service`` tells its router of the pool it starts; a pool without events, a value that is
not a pool service, and a pool that never answers are clear errors within their deadline."""

from __future__ import annotations

import threading

import pytest

from engine.cluster.router.pool_link import discover, service_spec
from engine.ipc.ports import free_port
from engine.kvstore.service.server import PoolService, PoolServiceConfig


def serving(events_port: int | None):
    config = PoolServiceConfig(port=free_port(), dram_bytes=64 << 10, events_port=events_port)
    svc = PoolService(config)
    thread = threading.Thread(target=svc.serve, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    return svc, thread


def stop(svc, thread) -> None:
    svc.request_stop()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_discovers_name_and_events():
    svc, thread = serving(events_port=0)
    try:
        link = discover(f"tcp://127.0.0.1:{svc.port}", timeout=10)
        assert link.source == svc.source == f"pool@127.0.0.1:{svc.port}"
        assert link.events_address == f"tcp://127.0.0.1:{svc.events_port}"
    finally:
        stop(svc, thread)


def test_pool_without_events_is_an_error():
    svc, thread = serving(events_port=None)
    try:
        with pytest.raises(ValueError, match="--events-port"):
            discover(f"tcp://127.0.0.1:{svc.port}", timeout=10)
    finally:
        stop(svc, thread)


@pytest.mark.parametrize("value", ["dram=1GiB", "dram=1GiB,tcp://h:1", "mooncake://h:1?metadata=x"])
def test_only_a_pool_service_address(value):
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        service_spec(value)


def test_silent_pool_times_out():
    with pytest.raises(TimeoutError, match="did not answer in 1.5 s"):
        discover(f"tcp://127.0.0.1:{free_port()}", timeout=1.5)
