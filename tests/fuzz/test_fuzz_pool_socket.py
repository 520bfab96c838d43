"""The pool service's ZeroMQ socket under bad input, against a real ``engine pool serve``
process: random frames, broken and truncated headers, huge declared lengths, data frames of the
wrong size, and replayed and out-of-order requests (commit before reserve, a reservation
committed twice, a lease released twice, a put replayed). Every message is answered (an error
naming the problem, or a valid reply) within a deadline, the service never stops, its memory
stays bounded, and its leases and reservations return to idle afterwards."""

from __future__ import annotations

import time

import msgpack
import psutil
import pytest
import zmq
from fuzz_frames import message_frames
from hypothesis import HealthCheck, given, settings
from kvstore.service.pool_service_helpers import free_port, small_namespace, start_service, stop

from engine.kvstore import block_record
from engine.kvstore.service import protocol as P

START = 0.0  # when the module started (tests/fuzz/conftest.py sets it)

NS = small_namespace()
NSID = NS.id
REPLY_S = 5.0  # no hang: each reply comes within this
RSS_GROWTH = 128 << 20
COUNTS = {"messages": 0, "errors": 0, "replies": 0}


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _record(i: int) -> bytes:
    payload = bytes([i % 251]) * NS.block_bytes
    return block_record.encode_header(NSID, _key(i), payload) + payload


HELLO = P.Hello(model_digest=NS.model_digest, dtype=NS.dtype, block_size=NS.block_size,
                num_layers=NS.num_layers, num_kv_heads=NS.num_kv_heads, head_dim=NS.head_dim,
                namespace=NSID)  # fmt: skip
EXAMPLES = [
    msgpack.unpackb(P.encode(msg)[0])
    for msg in (
        HELLO,
        P.Exists(namespace=NSID, keys=[_key(1)]),
        P.Get(namespace=NSID, keys=[_key(1), _key(2)], shm=True),
        P.Get(namespace=NSID, keys=[_key(1)], shm=False),
        P.Release(namespace=NSID, keys=[_key(1)]),
        P.Put(namespace=NSID, keys=[_key(1)], positions=[0], frames=(b"",)),
        P.Reserve(namespace=NSID, keys=[_key(3)], positions=[0]),
        P.Commit(namespace=NSID, keys=[_key(3)]),
        P.Abort(namespace=NSID, keys=[_key(3)]),
        P.Remove(namespace=NSID, keys=[_key(9)]),
        P.Stats(),
    )
]


class Peer:
    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def call(self, frames: list) -> P.Message:
        self.sock.send_multipart(frames)
        assert self.sock.poll(REPLY_S * 1000), f"no reply within {REPLY_S} s to {frames[0][:40]!r}"
        reply = P.decode(self.sock.recv_multipart())
        assert isinstance(reply, P.REPLIES)
        COUNTS["messages"] += 1
        COUNTS["errors" if isinstance(reply, P.Error) else "replies"] += 1
        return reply

    def send(self, msg: P.Message) -> P.Message:
        return self.call(P.encode(msg))

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def service():
    port = free_port()
    proc = start_service("--dram", "1MiB", "--port", str(port), "--lease", "1")
    peer = Peer(f"tcp://127.0.0.1:{port}")
    try:
        hello = peer.send(HELLO)
        assert isinstance(hello, P.HelloOk)
        peer.arena = hello.shm_name  # what shm requests name
        rss0 = psutil.Process(proc.pid).memory_info().rss
        yield proc, peer, rss0
    finally:
        peer.close()
        stop(proc)


def _idle(peer: Peer, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = peer.send(P.Stats()).stats
        ns = stats.get(NSID.hex(), {})
        if stats["service"]["leases"] == 0 and ns.get("reservations", 0) == 0:
            return stats
        assert time.monotonic() < deadline, f"leases or reservations never ended: {stats}"
        time.sleep(0.2)


def test_replayed_and_out_of_order_requests(service):
    proc, peer, _ = service
    k = [_key(i) for i in range(8)]
    # A commit, an abort and a release of what was never reserved or leased.
    a = peer.arena
    for msg in (P.Commit(namespace=NSID, keys=[k[0]], arena=a),
                P.Abort(namespace=NSID, keys=[k[0]]),
                P.Release(namespace=NSID, keys=[k[0], k[0]])):  # fmt: skip
        assert isinstance(peer.send(msg), P.PutOk | P.Ack)
    # A put replayed: stored once, read back intact.
    put = P.Put(namespace=NSID, keys=[k[1]], positions=[0], frames=(_record(1),))
    assert peer.send(put).stored == [True]
    peer.send(put)
    got = peer.send(P.Get(namespace=NSID, keys=[k[1]], shm=False))
    assert got.offsets == [P.INLINE] and bytes(got.frames[0]) == _record(1)
    # A put whose record is for another key, or truncated, or of another namespace: refused.
    for frame in (_record(2), _record(1)[:-1], b"x" * len(_record(1))):
        reply = peer.send(P.Put(namespace=NSID, keys=[k[1]], positions=[0], frames=(frame,)))
        assert reply.stored == [False] if isinstance(reply, P.PutOk) else isinstance(reply, P.Error)
    got = peer.send(P.Get(namespace=NSID, keys=[k[1]], shm=False))
    assert bytes(got.frames[0]) == _record(1)  # the good record survived every bad put
    # A lease taken, released twice; a reservation committed twice, then aborted.
    lease = peer.send(P.Get(namespace=NSID, keys=[k[1]], shm=True, arena=a))
    assert lease.offsets and lease.offsets[0] >= 0
    for _ in range(2):
        peer.send(P.Release(namespace=NSID, keys=[k[1]]))
    res = peer.send(P.Reserve(namespace=NSID, keys=[k[3]], positions=[0], arena=a))
    assert isinstance(res, P.ReserveOk)
    for msg in (P.Commit(namespace=NSID, keys=[k[3]], arena=a),
                P.Commit(namespace=NSID, keys=[k[3]], arena=a),
                P.Abort(namespace=NSID, keys=[k[3]]), P.Reserve(namespace=NSID, keys=[k[3]],
                positions=[0], arena=a)):  # fmt: skip
        assert isinstance(peer.send(msg), P.REPLIES)
    # A lease never released and a reservation never committed: ended by their deadline.
    peer.send(P.Get(namespace=NSID, keys=[k[1]], shm=True, arena=a))
    peer.send(P.Reserve(namespace=NSID, keys=[k[4]], positions=[0], arena=a))
    # Arena offsets asked for another arena (a restarted service's client): refused.
    for msg in (P.Get(namespace=NSID, keys=[k[1]], shm=True, arena=a + "x"),
                P.Reserve(namespace=NSID, keys=[k[5]], positions=[0], arena=""),
                P.Commit(namespace=NSID, keys=[k[4]], arena="engine-kv-pool-other")):  # fmt: skip
        reply = peer.send(msg)
        assert isinstance(reply, P.Error) and reply.error.endswith("send hello first"), reply
    _idle(peer)
    assert proc.poll() is None


def _answered(service, frames) -> None:
    proc, peer, _ = service
    peer.call(frames)
    assert proc.poll() is None


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=message_frames(EXAMPLES, "op"))
def test_random_frames_are_answered(service, frames):
    _answered(service, frames)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=message_frames(EXAMPLES, "op"))
def test_random_frames_are_answered_long(service, frames):
    _answered(service, frames)


def test_afterwards_idle_bounded_and_serving(service):
    proc, peer, rss0 = service
    assert COUNTS["messages"] > 100
    stats = _idle(peer)
    assert stats["service"]["queued"] == 0
    rss = psutil.Process(proc.pid).memory_info().rss
    assert rss - rss0 < RSS_GROWTH, f"pool service grew {(rss - rss0) >> 20} MiB"
    got = peer.send(P.Get(namespace=NSID, keys=[_key(1)], shm=False))
    assert isinstance(got, P.GetOk)  # still serving
    from reliab_record import record_if_the_run_passes

    record_if_the_run_passes(
        "fuzz",
        "pool-service-socket",
        "random frames, broken/truncated msgpack headers, wrong types, huge declared lengths, "
        "bad data frames, replayed and out-of-order put/reserve/commit/abort/get/release",
        dict(COUNTS),
        f"every message answered within {REPLY_S:.0f} s; service alive; leases and "
        f"reservations back to 0; RSS grew {(rss - rss0) >> 20} MiB",
        duration_s=time.monotonic() - START,
    )
