"""A decode worker's staging area after its sender stops: over shared memory a released area is
quarantined while the prefill process that maps it might still write, and freed as soon as that
process is gone (SIGKILLed, reaped or not yet); a live but silent sender keeps its quarantine.
Over TCP nothing is quarantined and late frames of a released transfer are dropped."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest
import torch
import zmq

from engine.cluster import messages as m
from engine.cluster.transfer.receiver import QUARANTINE_S, KVReceiver
from engine.cluster.transfer.staging import StagingArena, checksum
from engine.ipc.process_id import identify, is_gone

L, NB, BS, H, D = 2, 4, 4, 2, 4
T = 8  # tokens per transfer

# A prefill worker's part, as far as the staging area goes: started before the reservation (the
# router names it in the DecodeRequest), it is then told the area, maps the decode worker's arena
# file and writes into it, and stays silent (no KVDone, no KVAbort).
WRITER = """
import mmap, os, sys, time
off, n = map(int, sys.stdin.readline().split())
fd = os.open(sys.argv[1], os.O_RDWR)
mm = mmap.mmap(fd, os.fstat(fd).st_size)
mm[off : off + n] = b"\\x07" * n
print("wrote", flush=True)
time.sleep(600)
"""


@pytest.fixture
def rx_shm():
    kv = torch.zeros(L, 2, NB, BS, H, D)
    arena = StagingArena(1 << 20, shared=True)
    rx = KVReceiver(kv, BS, arena)
    procs: list[subprocess.Popen] = []
    try:
        yield rx, arena, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        rx.close()
        arena.close()


def start_writer(arena: StagingArena, procs: list) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, arena.path], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    procs.append(proc)
    return proc


def write_area(proc: subprocess.Popen, t) -> None:
    proc.stdin.write(f"{t.offset} {t.layout.nbytes}\n".encode())
    proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], 30.0)
    assert ready and proc.stdout.readline() == b"wrote\n", "the writer did not write"


def expire_until(rx: KVReceiver, done, timeout: float = 10.0) -> bool:
    """The worker's periodic check (every 0.1 s) until done(), with a deadline well below
    QUARANTINE_S."""
    assert timeout < QUARANTINE_S / 4
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rx.expire(time.monotonic())
        if done():
            return True
        time.sleep(0.05)
    return done()


@pytest.mark.parametrize("reaped", [False, True])
def test_killed_sender_frees_its_area_and_a_live_one_keeps_it(rx_shm, reaped):
    """reaped=False: the killed sender stays a zombie (its parent has not waited, as a launcher
    slow to notice); its memory maps are gone all the same."""
    rx, arena, procs = rx_shm
    doomed, silent = start_writer(arena, procs), start_writer(arena, procs)
    t_dead = rx.expect("dead", T, 30.0, sender_pid=doomed.pid, sender_local=True)
    t_live = rx.expect("live", T, 30.0, sender_pid=silent.pid, sender_local=True)
    write_area(doomed, t_dead)
    write_area(silent, t_live)
    assert int(arena.view(t_dead.offset, t_dead.layout.nbytes).sum()) == 7 * t_dead.layout.nbytes
    rx.release("dead")  # as the router's Abort after the death, or the deadline, would
    rx.release("live")
    both = t_dead.layout.nbytes + t_live.layout.nbytes
    assert arena.used == both  # both senders are alive: both areas quarantined

    os.kill(doomed.pid, signal.SIGKILL)
    if reaped:
        doomed.wait(timeout=10)
    assert expire_until(rx, lambda: rx.get("dead") is None), "the dead sender's area is held"
    assert t_dead.freed
    assert rx.get("live") is t_live and not t_live.freed  # alive and silent: still quarantined
    assert arena.used == t_live.layout.nbytes

    silent.kill()
    assert expire_until(rx, lambda: arena.used == 0)
    assert rx.num_transfers == 0


def test_sender_gone_before_the_reservation_is_never_waited_for(rx_shm):
    rx, arena, procs = rx_shm
    proc = start_writer(arena, procs)
    proc.kill()
    proc.wait(timeout=10)
    rx.expect("r", T, 30.0, sender_pid=proc.pid, sender_local=True)
    rx.release("r")
    assert arena.used == 0 and rx.num_transfers == 0


def test_unknown_or_remote_senders(rx_shm):
    """No sender named (an older router): the quarantine stands until KVDone/KVAbort or its
    time. A sender the router did not prove local (another host, or another /dev/shm under the
    same hostname) cannot map this arena (the router sends over TCP): none."""
    rx, arena, _ = rx_shm
    rx.expect("anon", T, 30.0)
    rx.release("anon")
    rx.expire(time.monotonic())
    assert rx.get("anon") is not None and arena.used > 0
    rx.expire(time.monotonic() + QUARANTINE_S + 1)
    assert arena.used == 0

    rx.expect("far", T, 30.0, sender_pid=os.getpid(), sender_local=False)
    rx.release("far")
    assert arena.used == 0 and rx.num_transfers == 0


def test_mooncake_keeps_the_quarantine_whoever_sends():
    """Over Mooncake a peer's NIC writes into the arena: a dead sender's pid does not end it."""
    kv = torch.zeros(L, 2, NB, BS, H, D)
    arena = StagingArena(1 << 20, shared=False)
    rx = KVReceiver(kv, BS, arena, remote_writes=True, local_writers=False)
    try:
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait(timeout=30)
        rx.expect("r", T, 30.0, sender_pid=gone.pid, sender_local=True)
        rx.release("r")
        rx.expire(time.monotonic())
        assert arena.used > 0
    finally:
        rx.close()
        arena.close()


def test_tcp_frees_at_once_and_drops_late_frames():
    kv = torch.zeros(L, 2, NB, BS, H, D)
    arena = StagingArena(1 << 20, shared=False)
    rx = KVReceiver(kv, BS, arena, remote_writes=False)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        t = rx.expect("r", T, 30.0, sender_pid=os.getpid(), sender_local=True)
        rx.release("r")
        assert arena.used == 0 and rx.num_transfers == 0 and t.freed
        push.connect(rx.address)
        n = T * H * D * 4
        k, v = b"\x01" * n, b"\x02" * n
        for layer in range(L):
            msg = m.KVLayer("r", layer, 0, T, checksum(k, v), True, frames=(k, v))
            push.send_multipart(m.encode(msg))
        push.send_multipart(m.encode(m.KVDone("r", T, L, 0, [{"index": 0, "token": 1}])))
        # A live transfer after them on the same socket: once it is done, the late ones were seen.
        t2 = rx.expect("r2", T, 30.0)
        for layer in range(L):
            msg = m.KVLayer("r2", layer, 0, T, checksum(k, v), True, frames=(k, v))
            push.send_multipart(m.encode(msg))
        push.send_multipart(m.encode(m.KVDone("r2", T, L, 0, [{"index": 0, "token": 1}])))
        assert rx.events.get(timeout=10) == "r2" and t2.ok, t2.error
        assert rx.events.empty()  # nothing for the released transfer
        assert rx.get("r") is None and rx.counters["bytes_received"] == 2 * L * n
        assert not bool(kv.any())  # nothing written anywhere
        rx.release("r2")
        assert arena.used == 0
    finally:
        push.close()
        rx.close()
        arena.close()


def test_process_ids_tell_a_reused_pid_apart():
    me = identify(os.getpid())
    assert me is not None and not is_gone(me)
    assert is_gone(me._replace(start_time=me.start_time + 1))  # another process, same pid
    assert identify(0) is None and identify(-5) is None
