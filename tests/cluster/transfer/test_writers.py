"""Who may still write into a transfer's staging area (engine/cluster/transfer/writers.py), on
pids of this test's own process (alive) and of a child it started and reaped (gone): a sender of
this host is watched by pid, one elsewhere or over TCP never writes, one not named may, and a
group's stage that said KVDone writes no more."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.cluster.transfer.staging import KVLayout
from engine.cluster.transfer.state import Transfer
from engine.cluster.transfer.writers import may_still_write, watch_writers

LAYERS = 4


def transfer(senders: int = 1) -> Transfer:
    t = Transfer("r", 0, KVLayout(LAYERS, 8, 16), deadline=0.0, senders=senders)
    t.pieces = [[] for _ in range(LAYERS)]
    return t


@pytest.fixture(scope="module")
def gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_local_sender_writes_while_alive():
    t = transfer()
    watch_writers(t, os.getpid(), True, (), local_writers=True)
    assert t.sender == t.writer and t.writer.pid == os.getpid()
    assert may_still_write(t, remote_writes=True)
    assert not may_still_write(t, remote_writes=False)  # this side receives everything itself
    t.inline = True  # TCP: the frames are copied here, late ones dropped
    assert not may_still_write(t, remote_writes=True)


def test_a_gone_sender_never_writes(gone_pid):
    t = transfer()
    watch_writers(t, gone_pid, True, (), local_writers=True)
    assert t.writer is None and not t.may_write
    assert not may_still_write(t, remote_writes=True)


def test_a_sender_elsewhere_sends_frames_and_an_unnamed_one_may_write():
    far = transfer()
    watch_writers(far, os.getpid(), False, (), local_writers=True)
    assert far.sender is None and not may_still_write(far, remote_writes=True)
    unnamed = transfer()  # Mooncake, or not told: wait out the quarantine
    watch_writers(unnamed, 0, True, (), local_writers=True)
    assert may_still_write(unnamed, remote_writes=True)


def test_a_group_writes_until_each_live_stage_is_done(gone_pid):
    t = transfer(senders=2)
    watch_writers(t, 0, True, (os.getpid(), gone_pid), local_writers=True)
    assert list(t.writers) == [0]  # the gone stage (layers 2, 3) never writes
    assert may_still_write(t, remote_writes=True)
    t.reported_by.add(0)  # the live stage said KVDone or KVAbort
    assert not may_still_write(t, remote_writes=True)
