"""Hidden states between pipeline stages (engine/cluster/worker/stage_link.py, the sending end,
and hidden_receiver.py), over real sockets on 127.0.0.1 and real threads: rows arrive bit-exact
and once each, in any order and repeated; a first frame past 0 (a prefix cache hit upstream);
frames before ``expect``; bad frames fail their request (or are counted and dropped) while the
receiver serves the others; aborts, deadlines, the memory budget; a sender whose peer is gone
reports it; close stops every thread and socket. Every wait is bounded; nothing is timed."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest
import torch
import zmq

from engine.cluster import messages as m
from engine.cluster.transfer.staging import checksum
from engine.cluster.worker.hidden_receiver import HiddenReceiver
from engine.cluster.worker.stage_link import HiddenSender, row_bytes
from engine.ipc import curve

H = 8  # hidden size
WAIT_S = 20.0  # every bounded wait; far beyond what a healthy run needs
DEADLINE_S = 120.0  # a request's own deadline: never reached unless a test moves `now`


def wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bytes(row_bytes(a)) == bytes(row_bytes(b))


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    curve.stop_authenticator(c)  # when a test configured keys
    done = threading.Event()  # term returns only once every socket of the context is closed

    def term():
        c.term()
        done.set()

    threading.Thread(target=term, daemon=True).start()
    assert done.wait(WAIT_S), "a socket was left open"


@pytest.fixture
def parts(ctx):
    made = []

    def make(cls, *args, **kwargs):
        obj = cls(ctx, *args, **kwargs)
        made.append(obj)
        return obj

    yield make
    for obj in reversed(made):
        obj.close()


def receiver(parts, dtype=torch.float32, **kwargs) -> HiddenReceiver:
    return parts(HiddenReceiver, "tcp://127.0.0.1:0", H, dtype, **kwargs)


def raw_push(ctx, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def hidden_frames(rid: str, start: int, end: int, rows: torch.Tensor, **override) -> list:
    data = row_bytes(rows)
    fields = {"checksum": checksum(data), **override}
    return m.encode(m.StageHidden(rid, start, end, fields["checksum"], frames=(data,)))


def frames_seen(rx: HiddenReceiver, n: int) -> None:
    wait_for(lambda: rx.counters["frames"] >= n, f"{n} frames at the receiver")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_arrive_bit_exact(parts, dtype):
    woken = threading.Event()
    rx = receiver(parts, dtype, wake=woken.set)
    tx = parts(HiddenSender)
    data = torch.randn(20, H).to(dtype)
    rx.expect("r", 20, DEADLINE_S)
    assert rx.first_start("r") is None and rx.ready("r") == 0
    buf = torch.empty(8, H, dtype=dtype)  # the engine's reused tensor
    for start, end in [(0, 6), (6, 12), (12, 20)]:
        buf[: end - start] = data[start:end]
        assert tx.send("r", rx.address, start, end, buf[: end - start])
        buf.fill_(float("nan"))  # reused at once: the sender copied the rows already
        wait_for(lambda end=end: rx.ready("r") == end, f"ready {end}")
        wait_for(woken.is_set, "the wake")  # called once the lock is let go
        woken.clear()
        assert rx.events() == ["r"]
        assert same_bytes(rx.rows("r", start, end), data[start:end])
    assert rx.first_start("r") == 0 and rx.error("r") is None
    assert same_bytes(rx.rows("r", 0, 20), data)
    assert rx.rows("r", 0, 20).dtype == dtype
    assert tx.counters["frames_sent"] == 3
    assert tx.counters["bytes_sent"] == data.numel() * data.element_size()
    assert rx.counters["rows_received"] == 20
    assert rx.expire(time.monotonic() + 2 * DEADLINE_S) == []  # complete: no deadline
    assert tx.failures() == []


def test_rows_from_a_strided_view(parts):
    rx = receiver(parts, torch.bfloat16)
    tx = parts(HiddenSender)
    wide = torch.randn(6, 2 * H).to(torch.bfloat16)
    rx.expect("r", 6, DEADLINE_S)
    tx.send("r", rx.address, 0, 6, wide[:, ::2])  # every other column: not contiguous
    wait_for(lambda: rx.ready("r") == 6, "the rows")
    assert same_bytes(rx.rows("r", 0, 6), wide[:, ::2].contiguous())


def expected_ready(have: set[int], first: int, num_tokens: int) -> int:
    r = first
    while r < num_tokens and r in have:
        r += 1
    return r


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_any_order_and_repeats_deliver_each_row_once(ctx, parts, seed):
    T = 24
    rx = receiver(parts)
    data = torch.randn(T, H)
    rx.expect("r", T, DEADLINE_S)
    ranges = [(i, i + 4) for i in range(0, T, 4)] + [(2, 9), (10, 14), (0, 24), (20, 24)]
    rng = random.Random(seed)
    ranges += rng.sample(ranges, 4)  # repeats
    rng.shuffle(ranges)
    push = raw_push(ctx, rx.address)
    have: set[int] = set()
    try:
        for k, (start, end) in enumerate(ranges, 1):
            push.send_multipart(hidden_frames("r", start, end, data[start:end]))
            frames_seen(rx, k)
            have |= set(range(start, end))
            first = ranges[0][0]  # one connection keeps the order the frames were sent in
            assert rx.first_start("r") == first
            assert rx.ready("r") == expected_ready(have, first, T), (k, ranges)
            assert rx.counters["rows_received"] == len(have)  # repeats are not counted
            for i in have:
                assert same_bytes(rx.rows("r", i, i + 1), data[i : i + 1])
        # A repeat with other bytes (a checksum that matches them) changes no held row.
        other = torch.zeros(T, H)
        push.send_multipart(hidden_frames("r", 0, T, other))
        frames_seen(rx, len(ranges) + 1)
    finally:
        push.close(linger=0)
    assert rx.error("r") is None
    assert same_bytes(rx.rows("r", 0, T), data)
    assert rx.counters["rows_received"] == T


def test_first_frame_past_zero_is_the_start(parts):
    rx = receiver(parts)
    tx = parts(HiddenSender)
    data = torch.randn(24, H)
    rx.expect("r", 24, DEADLINE_S)
    tx.send("r", rx.address, 8, 16, data[8:16])  # tokens [0, 8) were in stage 0's prefix cache
    wait_for(lambda: rx.ready("r") == 16, "ready 16")
    assert rx.first_start("r") == 8
    with pytest.raises(ValueError, match="not all arrived"):
        rx.rows("r", 0, 8)
    tx.send("r", rx.address, 16, 24, data[16:24])
    wait_for(lambda: rx.ready("r") == 24, "ready 24")
    assert rx.first_start("r") == 8
    assert same_bytes(rx.rows("r", 8, 24), data[8:24])
    assert rx.expire(time.monotonic() + 2 * DEADLINE_S) == []  # rows from s0 on are all here


def test_a_frame_before_expect_is_applied_at_expect(parts):
    rx = receiver(parts)
    tx = parts(HiddenSender)
    data = torch.randn(12, H)
    tx.send("r", rx.address, 0, 5, data[:5])
    tx.abort("other", rx.address, "held early too")
    frames_seen(rx, 2)
    assert rx.num_requests == 0 and rx.events() == []
    rx.expect("r", 12, DEADLINE_S)
    assert rx.first_start("r") == 0 and rx.ready("r") == 5
    assert same_bytes(rx.rows("r", 0, 5), data[:5])
    assert rx.events() == ["r"]
    rx.expect("other", 4, DEADLINE_S)
    assert "held early too" in rx.error("other")
    rx.release("r")  # late frames of a released request are dropped, not held
    tx.send("r", rx.address, 5, 12, data[5:])
    frames_seen(rx, 3)
    rx.expect("r", 12, DEADLINE_S)
    assert rx.first_start("r") is None


def frame_with(fault: str, data: torch.Tensor) -> tuple[list, str]:
    """Frames of request "bad" (T=8 rows) with one fault, and the words its error holds."""
    if fault == "checksum":
        return hidden_frames("bad", 0, 4, data[:4], checksum=12345), "checksum mismatch"
    if fault == "size":
        frames = hidden_frames("bad", 0, 4, data[:3])
        return frames, f"frame of {3 * H * 4} bytes, expected {4 * H * 4}"
    if fault == "end past the prompt":
        return hidden_frames("bad", 4, 12, torch.randn(8, H)), "out of range (num_tokens 8)"
    if fault == "empty range":
        return hidden_frames("bad", 4, 4, data[:0]), "not a range"
    if fault == "two data frames":
        return hidden_frames("bad", 0, 4, data[:4]) + [b"x"], "2 data frames, expected 1"
    raise AssertionError(fault)


@pytest.mark.parametrize(
    "fault", ["checksum", "size", "end past the prompt", "empty range", "two data frames"]
)
def test_a_bad_frame_fails_its_request_only(ctx, parts, fault):
    rx = receiver(parts)
    tx = parts(HiddenSender)
    data = torch.randn(8, H)
    rx.expect("bad", 8, DEADLINE_S)
    rx.expect("ok", 8, DEADLINE_S)
    frames, words = frame_with(fault, data)
    push = raw_push(ctx, rx.address)
    try:
        push.send_multipart(frames)
        wait_for(lambda: rx.error("bad") is not None, "the bad frame's failure")
        assert "bad hidden states" in rx.error("bad") and words in rx.error("bad")
        assert rx.events() == ["bad"]
        push.send_multipart(hidden_frames("bad", 0, 8, data))  # after a failure: dropped
        frames_seen(rx, 2)
    finally:
        push.close(linger=0)
    assert rx.ready("bad") == 0 and rx.counters["bad_frames"] == 0
    tx.send("ok", rx.address, 0, 8, data)
    wait_for(lambda: rx.ready("ok") == 8, "the other request's rows")
    assert rx.error("ok") is None and same_bytes(rx.rows("ok", 0, 8), data)


def test_frames_that_do_not_decode_are_counted_and_dropped(ctx, parts):
    rx = receiver(parts)
    tx = parts(HiddenSender)
    data = torch.randn(8, H)
    rx.expect("r", 8, DEADLINE_S)
    push = raw_push(ctx, rx.address)
    try:
        push.send(b"\x93\x01 not msgpack")
        push.send_multipart([b"\x81\xa1t\xa4nope", b"data"])  # {"t": "nope"}
        push.send_multipart(m.encode(m.Abort("r")))  # a message, but not one of this socket
        push.send_multipart(m.encode(m.StageHidden("r", 0, 8, 0)))  # its rows left out
        frames_seen(rx, 4)
    finally:
        push.close(linger=0)
    assert rx.counters["bad_frames"] == 3
    assert "0 data frames" in rx.error("r")
    rx.release("r")
    rx.expect("r2", 8, DEADLINE_S)
    tx.send("r2", rx.address, 0, 8, data)
    wait_for(lambda: rx.ready("r2") == 8, "rows after bad frames")
    assert same_bytes(rx.rows("r2", 0, 8), data)


def test_stage_abort_fails_the_request_with_its_reason(parts):
    woken = threading.Event()
    rx = receiver(parts, wake=woken.set)
    tx = parts(HiddenSender)
    rx.expect("r", 8, DEADLINE_S)
    tx.send("r", rx.address, 0, 4, torch.randn(4, H))
    wait_for(lambda: rx.ready("r") == 4, "the first rows")
    rx.events()
    tx.abort("r", rx.address, "the client gave up")
    wait_for(lambda: rx.error("r") is not None, "the abort")
    assert rx.error("r") == "the stage before gave up: the client gave up"
    wait_for(woken.is_set, "the wake")
    assert rx.events() == ["r"]
    tx.send("r", rx.address, 4, 8, torch.randn(4, H))  # late rows change nothing
    wait_for(lambda: tx.counters["frames_sent"] == 2, "the late frame sent")
    frames_seen(rx, 3)
    assert rx.ready("r") == 4 and rx.events() == []
    assert tx.counters["aborts_sent"] == 1


def test_a_request_past_its_deadline_expires(parts):
    rx = receiver(parts)
    tx = parts(HiddenSender)
    rx.expect("none", 8, 5.0)
    rx.expect("some", 8, 5.0)
    rx.expect("all", 8, 5.0)
    tx.send("some", rx.address, 0, 3, torch.randn(3, H))
    tx.send("all", rx.address, 0, 8, torch.randn(8, H))
    wait_for(lambda: rx.ready("some") == 3 and rx.ready("all") == 8, "the rows")
    rx.events()
    assert rx.expire(time.monotonic()) == []
    later = time.monotonic() + 10.0
    assert sorted(rx.expire(later)) == ["none", "some"]
    assert "no rows of 8" in rx.error("none")
    assert "rows up to 3 of 8" in rx.error("some")
    assert rx.error("all") is None
    assert sorted(rx.events()) == ["none", "some"]
    assert rx.expire(later) == []  # once


def test_the_memory_budget(parts):
    row = H * 4
    rx = receiver(parts, max_bytes=10 * row)
    rx.expect("a", 6, DEADLINE_S)
    assert rx.used_bytes == 6 * row and rx.num_requests == 1
    with pytest.raises(MemoryError, match="needs"):
        rx.expect("b", 5, DEADLINE_S)
    assert rx.num_requests == 1 and rx.used_bytes == 6 * row
    rx.release("a")
    assert rx.used_bytes == 0 and rx.num_requests == 0
    rx.expect("b", 5, DEADLINE_S)
    rx.expect("c", 5, DEADLINE_S)
    assert rx.used_bytes == 10 * row
    for bad in [("d", 0, DEADLINE_S), ("b", 1, DEADLINE_S), ("e", 1, -1.0), ("", 1, 1.0)]:
        with pytest.raises(ValueError):
            rx.expect(*bad)
    rx.release("nobody")  # nothing to free


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_a_send_nobody_takes_fails_its_request(parts):
    woken = threading.Event()
    tx = parts(HiddenSender, send_timeout=0.5, on_fail=woken.set)
    address = free_address()
    rows = torch.randn(4, H)
    for i in range(20):  # the engine thread queues and goes on (a bounded put; nothing waits)
        tx.send("r", address, 4 * i, 4 * i + 4, rows)
    tx.send("s", address, 0, 4, rows)
    wait_for(lambda: tx.failed("r") and tx.failed("s"), "the failures")
    wait_for(woken.is_set, "on_fail")
    failures = dict(tx.failures())
    assert set(failures) == {"r", "s"}
    assert f"the next stage at {address} took nothing" in failures["r"]
    assert tx.failures() == []
    assert tx.send("r", address, 80, 84, rows) is False  # failed: nothing more is queued
    assert tx.counters["frames_sent"] == 0 and tx.counters["failed"] == 2
    tx.forget("r")
    assert not tx.failed("r")


def test_a_full_send_queue_fails_the_request(parts):
    tx = parts(HiddenSender, send_timeout=60.0, max_queue=1, put_timeout=0.0)
    address = free_address()  # the thread waits on its first frame; the queue holds one more
    results = [tx.send("r", address, i, i + 1, torch.randn(1, H)) for i in range(3)]
    assert False in results
    assert tx.failures() == [("r", "the hidden-state send queue stayed full")]


def test_bad_arguments_are_refused(parts):
    tx = parts(HiddenSender)
    with pytest.raises(ValueError):
        tx.send("r", "tcp://127.0.0.1:1", 0, 4, torch.randn(3, H))
    with pytest.raises(ValueError):
        tx.send("r", "tcp://127.0.0.1:1", 4, 4, torch.randn(0, H))
    tx.send("r", "not an address", 0, 1, torch.randn(1, H))
    wait_for(lambda: tx.failed("r"), "the bad address's failure")
    assert "cannot connect to 'not an address'" in tx.failures()[0][1]


def test_close_stops_every_thread_and_socket(ctx):
    def ours():
        return [t for t in threading.enumerate() if t.name.startswith("stage-")]

    before = ours()
    rx = HiddenReceiver(ctx, "tcp://127.0.0.1:0", H, torch.float32)
    tx = HiddenSender(ctx, send_timeout=60.0)
    rx.expect("r", 4, DEADLINE_S)
    tx.send("r", rx.address, 0, 4, torch.randn(4, H))
    tx.send("x", free_address(), 0, 4, torch.randn(4, H))  # the thread waits on this one
    wait_for(lambda: rx.ready("r") == 4, "the rows")
    assert len(ours()) == len(before) + 2
    tx.close()
    rx.close()
    tx.close()  # idempotent
    rx.close()
    assert ours() == before
    with pytest.raises(RuntimeError):
        tx.send("r", rx.address, 0, 4, torch.randn(4, H))
    # The ctx fixture's term() returns only if every socket, the sender's too, was closed.


def test_over_curve_only_authenticated_stages_get_rows_through(ctx, parts, tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_CURVE_KEYS", str(curve.generate_keys(str(tmp_path / "k")).directory))
    rx = receiver(parts)
    tx = parts(HiddenSender)
    data = torch.randn(8, H)
    rx.expect("r", 8, DEADLINE_S)
    rogue = raw_push(ctx, rx.address)  # no keys: its handshake never completes
    try:
        rogue.send_multipart(hidden_frames("r", 0, 8, torch.zeros(8, H)), flags=zmq.NOBLOCK)
        tx.send("r", rx.address, 0, 4, data[:4])
        tx.send("r", rx.address, 4, 8, data[4:])
        wait_for(lambda: rx.ready("r") == 8, "the authenticated rows")
    finally:
        rogue.close(linger=0)
    assert same_bytes(rx.rows("r", 0, 8), data)
    assert rx.counters["frames"] == 2
