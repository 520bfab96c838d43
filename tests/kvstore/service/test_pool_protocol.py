"""The pool service's wire protocol: every message type round-trips, malformed frames are
refused with a message naming the field, and a real service answers them with an error reply and
keeps serving."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq
from pool_service_helpers import free_port, small_namespace

from engine.kvstore import block_record
from engine.kvstore.service import protocol as P
from engine.kvstore.service.server import PoolService, PoolServiceConfig

NS = b"n" * 16
K = [b"a" * 32, b"b" * 32]

SAMPLES = [
    P.Hello(
        id=1,
        model_digest="d",
        dtype="float32",
        block_size=16,
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        namespace=NS,
    ),
    P.HelloOk(
        id=1,
        block_bytes=4096,
        shm_name="engine-kv-x",
        arena_bytes=1 << 20,
        nonce_shm="psm_1",
        nonce=b"z" * 16,
        lease_ms=10_000,
        source="pool@127.0.0.1:1",
    ),
    P.Exists(id=2, namespace=NS, keys=K),
    P.ExistsOk(id=2, matched=1),
    P.Get(id=3, namespace=NS, keys=K, shm=True),
    P.GetOk(id=3, offsets=[4096, P.INLINE], frames=(b"record",)),
    P.Release(id=4, namespace=NS, keys=K),
    P.Put(id=5, namespace=NS, keys=K, positions=[0, 1], frames=(b"r0", b"r1")),
    P.PutOk(id=5, stored=[True, False]),
    P.Reserve(id=6, namespace=NS, keys=K, positions=[0, 1]),
    P.ReserveOk(id=6, offsets=[0, P.NO_ROOM]),
    P.Commit(id=7, namespace=NS, keys=K),
    P.Abort(id=8, namespace=NS, keys=K),
    P.Remove(id=9, namespace=NS, keys=K),
    P.Clear(id=10, namespace=b""),
    P.Stats(id=11, namespace=NS),
    P.CountOk(id=12, count=3),
    P.StatsOk(id=13, stats={"service": {"namespaces": 1}}),
    P.Ack(id=14),
    P.Error(id=15, error="busy"),
]


def test_samples_cover_every_message_type():
    assert {type(m) for m in SAMPLES} == set(P.MESSAGES.values())


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.OP)
def test_round_trip(msg):
    frames = P.encode(msg)
    assert all(isinstance(f, bytes | bytearray | memoryview) for f in frames)
    back = P.decode(frames)
    assert type(back) is type(msg)
    assert back == msg
    assert [bytes(f) for f in getattr(back, "frames", ())] == list(getattr(msg, "frames", ()))


def _header(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


BAD = {
    "no frames": [],
    "truncated header": [P.encode(SAMPLES[2])[0][:-5]],
    "not msgpack": [b"\xc1\xc1\xc1"],
    "header not a map": [msgpack.packb([1, 2, 3])],
    "unknown op": [_header(op="explode", id=1)],
    "huge declared array": [b"\x81\xa4keys\xdd\xff\xff\xff\xff"],
    "huge declared bin": [b"\xc6\x7f\xff\xff\xff" + b"x" * 10],
    "missing field": [_header(op="exists", id=1, namespace=NS)],
    "keys not a list": [_header(op="exists", id=1, namespace=NS, keys=b"k" * 32)],
    "key too long": [_header(op="exists", id=1, namespace=NS, keys=[b"k" * 33])],
    "too many keys": [_header(op="exists", id=1, namespace=NS, keys=[b"k"] * (P.MAX_KEYS + 1))],
    "bool as int": [_header(op="exists_ok", id=1, matched=True)],
    "namespace wrong size": [_header(op="exists", id=1, namespace=b"short", keys=[])],
    "id negative": [_header(op="ack", id=-1)],
    "frames on a frameless op": [_header(op="ack", id=1), b"data"],
    "put frames != keys": [_header(op="put", id=1, namespace=NS, keys=K, positions=[0, 1]), b"x"],
    "put positions != keys": P.encode(
        P.Put(id=1, namespace=NS, keys=K, positions=[0], frames=(b"a", b"b"))
    ),
}


@pytest.mark.parametrize("frames", BAD.values(), ids=BAD.keys())
def test_malformed_messages_raise_protocol_error(frames):
    with pytest.raises(P.ProtocolError):
        P.decode(frames)


def test_error_names_field_and_limit():
    with pytest.raises(P.ProtocolError, match=rf"'keys' has {P.MAX_KEYS + 1} items.*{P.MAX_KEYS}"):
        P.decode(BAD["too many keys"])


@pytest.fixture(scope="module")
def service():
    """An in-process service (real sockets, a serving thread) for the malformed-frame tests."""
    config = PoolServiceConfig(port=free_port(), dram_bytes=64 << 10, max_frame_bytes=64 << 10)
    svc = PoolService(config)
    thread = threading.Thread(target=svc.serve, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    try:
        yield svc
    finally:
        svc.request_stop()
        thread.join(timeout=10)
        assert not thread.is_alive()


@pytest.fixture
def sock(service):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{service.port}")
    yield s
    s.close(linger=0)


def _ask(sock, frames, timeout=5.0):
    sock.send_multipart(frames)
    assert sock.poll(timeout * 1000), "no reply before the deadline"
    return P.decode(sock.recv_multipart())


def _hello(sock, ns, msg_id=1):
    return _ask(
        sock,
        P.encode(
            P.Hello(
                id=msg_id,
                model_digest=ns.model_digest,
                dtype=ns.dtype,
                block_size=ns.block_size,
                num_layers=ns.num_layers,
                num_kv_heads=ns.num_kv_heads,
                head_dim=ns.head_dim,
                namespace=ns.id,
            )
        ),
    )


@pytest.mark.parametrize("name", [n for n in BAD if n != "no frames"])
def test_service_answers_malformed_frames_and_keeps_serving(sock, name):
    reply = _ask(sock, BAD[name])
    assert isinstance(reply, P.Error)
    assert reply.error
    assert isinstance(_hello(sock, small_namespace()), P.HelloOk)


def test_service_checks_namespace_and_order(sock):
    ns = small_namespace()
    forged = P.Hello(
        id=2,
        model_digest="other",
        dtype=ns.dtype,
        block_size=ns.block_size,
        num_layers=ns.num_layers,
        num_kv_heads=ns.num_kv_heads,
        head_dim=ns.head_dim,
        namespace=ns.id,
    )
    reply = _ask(sock, P.encode(forged))
    assert isinstance(reply, P.Error) and "does not match" in reply.error
    reply = _ask(sock, P.encode(P.Exists(id=3, namespace=b"q" * 16, keys=K)))
    assert isinstance(reply, P.Error) and "send hello first" in reply.error
    reply = _ask(sock, P.encode(P.Hello(id=4, dtype="float99", namespace=ns.id)))
    assert isinstance(reply, P.Error) and reply.id == 4
    reply = _ask(sock, P.encode(P.HelloOk(id=5)))
    assert isinstance(reply, P.Error) and "reply, not a request" in reply.error


def test_service_round_trip_of_every_request(sock, service):
    ns = small_namespace()
    hello = _hello(sock, ns)
    assert isinstance(hello, P.HelloOk)
    assert hello.block_bytes == ns.block_bytes and hello.shm_name and hello.nonce
    payload = bytes(range(256)) * (ns.block_bytes // 256)
    record = block_record.encode_header(ns.id, K[0], payload) + payload
    put = _ask(
        sock, P.encode(P.Put(id=6, namespace=ns.id, keys=K[:1], positions=[0], frames=(record,)))
    )
    assert put == P.PutOk(id=6, stored=[True])
    # A record whose checksum does not match its payload is not stored.
    bad = bytearray(block_record.encode_header(ns.id, K[1], payload) + payload)
    bad[-1] ^= 0xFF
    put = _ask(
        sock, P.encode(P.Put(id=7, namespace=ns.id, keys=K[1:], positions=[1], frames=(bad,)))
    )
    assert put == P.PutOk(id=7, stored=[False])
    assert _ask(sock, P.encode(P.Exists(id=8, namespace=ns.id, keys=K))) == P.ExistsOk(
        id=8, matched=1
    )
    got = _ask(sock, P.encode(P.Get(id=9, namespace=ns.id, keys=K, shm=False)))
    assert got.offsets == [P.INLINE] and bytes(got.frames[0]) == record
    arena = hello.shm_name
    got = _ask(sock, P.encode(P.Get(id=10, namespace=ns.id, keys=K, shm=True, arena=arena)))
    assert len(got.offsets) == 1 and got.offsets[0] >= 0  # leased in the arena
    assert got.checksums == [block_record.checksum(payload)]  # what the reader checks
    assert service.table.num_leases() == 1
    assert _ask(sock, P.encode(P.Release(id=11, namespace=ns.id, keys=K[:1]))) == P.Ack(id=11)
    assert service.table.num_leases() == 0
    res = _ask(
        sock, P.encode(P.Reserve(id=12, namespace=ns.id, keys=K, positions=[0, 1], arena=arena))
    )
    assert res.offsets[0] == P.PRESENT and res.offsets[1] >= 0
    # A commit whose slot does not hold what the writer hashed (it wrote nothing) is refused.
    commit = P.Commit(id=18, namespace=ns.id, keys=K[1:], arena=arena, checksums=[12345])
    assert _ask(sock, P.encode(commit)) == P.PutOk(id=18, stored=[False])
    res = _ask(
        sock, P.encode(P.Reserve(id=19, namespace=ns.id, keys=K, positions=[0, 1], arena=arena))
    )
    assert res.offsets[1] >= 0  # the refused slot went back; reserved again
    assert _ask(sock, P.encode(P.Abort(id=13, namespace=ns.id, keys=K[1:]))) == P.Ack(id=13)
    commit = P.Commit(id=14, namespace=ns.id, keys=K[1:], arena=arena)
    assert _ask(sock, P.encode(commit)) == P.PutOk(
        id=14, stored=[False]
    )  # aborted: nothing to commit
    stats = _ask(sock, P.encode(P.Stats(id=15, namespace=b"")))
    assert stats.stats[ns.id.hex()]["tiers"]["dram"]["blocks"] == 1
    assert _ask(sock, P.encode(P.Remove(id=16, namespace=ns.id, keys=K))) == P.CountOk(
        id=16, count=1
    )
    assert _ask(sock, P.encode(P.Clear(id=17, namespace=b""))) == P.CountOk(id=17, count=0)


def test_service_refuses_data_frames_over_its_limit(sock, service):
    ns = small_namespace()
    assert isinstance(_hello(sock, ns), P.HelloOk)
    big = b"x" * (service.config.max_frame_bytes + 100)  # over the limit, under zmq's cut-off
    reply = _ask(
        sock, P.encode(P.Put(id=20, namespace=ns.id, keys=K[:1], positions=[0], frames=(big,)))
    )
    assert isinstance(reply, P.Error) and "exceeds the limit" in reply.error
    assert isinstance(_hello(sock, ns, msg_id=21), P.HelloOk)


def test_leases_and_reservations_of_a_silent_client_expire():
    """A client that dies holding a lease or a reservation pins its slot only until the deadline."""
    config = PoolServiceConfig(port=free_port(), dram_bytes=8 << 10, lease_s=0.3)  # 2 slots
    svc = PoolService(config)
    thread = threading.Thread(target=svc.serve, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{svc.port}")
    try:
        ns = small_namespace()
        a = _hello(s, ns).shm_name
        res = _ask(s, P.encode(P.Reserve(id=2, namespace=ns.id, keys=K, positions=[0, 1], arena=a)))
        assert all(o >= 0 for o in res.offsets)
        commit = P.Commit(id=3, namespace=ns.id, keys=K[:1], arena=a)
        assert _ask(s, P.encode(commit)).stored == [True]
        got = _ask(s, P.encode(P.Get(id=4, namespace=ns.id, keys=K[:1], shm=True, arena=a)))
        assert got.offsets[0] >= 0 and svc.table.num_leases() == 1
        # Both slots are pinned (a lease, a reservation): a third block finds no room.
        res = _ask(
            s, P.encode(P.Reserve(id=5, namespace=ns.id, keys=[b"c" * 32], positions=[2], arena=a))
        )
        assert res.offsets == [P.NO_ROOM]
        time.sleep(0.6)  # past both deadlines: the service ended them
        assert svc.table.num_leases() == 0
        commit = P.Commit(id=6, namespace=ns.id, keys=K[1:], arena=a)
        assert _ask(s, P.encode(commit)).stored == [False]
        res = _ask(
            s, P.encode(P.Reserve(id=7, namespace=ns.id, keys=[b"c" * 32], positions=[2], arena=a))
        )
        assert res.offsets[0] >= 0
    finally:
        s.close(linger=0)
        svc.request_stop()
        thread.join(timeout=10)
