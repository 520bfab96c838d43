"""A decode worker's receiver taking one request's KV from every stage of a prefill group: each
stage sends its own layers and a KVDone for them, the last stage's carries the first tokens, in
any order; every layer of every chunk arrives exactly once, and any other ending fails the
transfer with a reason that names it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from synthetic_kv import L, send_layers, synthetic, wait_event, wait_freed

from engine.cluster import messages as m

SPANS = ((0, 5), (5, 9), (9, 10))  # three chunks of a 10-token prompt
FIRST = [{"index": 0, "token": 1}]


def pieces(layers) -> list[tuple[int, int, int]]:
    return [(layer, a, b) for layer in layers for a, b in SPANS]


def reported(t, n: int) -> None:
    """Wait until n senders' KVDone (or KVAbort) came."""
    deadline = time.monotonic() + 10
    while t.reported < n:
        assert time.monotonic() < deadline, t
        time.sleep(0.01)


def done(a: int, b: int, firsts=()) -> m.KVDone:
    return m.KVDone("r", 10, L, 0, list(firsts), layer_start=a, layer_end=b)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("last_first", [True, False])
def test_every_stage_sends_its_layers_once_in_any_order(transport, last_first):
    kv, arena, rx = synthetic(transport)
    inline = transport == "tcp"
    try:
        t = rx.expect("r", 10, 30.0, senders=2)
        stages = [(pieces([0, 1]), done(0, 2)), (pieces([2]), done(2, 3, FIRST))]
        if last_first:  # the last stage's layers and KVDone may come first
            stages.reverse()
        full = send_layers(rx, arena, t, stages[0][0], 1, inline, done=stages[0][1])
        reported(t, 1)
        assert t.done_ranges == [(stages[0][1].layer_start, stages[0][1].layer_end)]
        assert rx.events.empty() and not t.finished  # one stage is not the transfer
        send_layers(rx, arena, t, stages[1][0], 2, inline, done=stages[1][1])
        assert wait_event(rx) == "r" and t.ok, t.error
        assert t.done.firsts == FIRST
        staged = arena.view(t.offset, t.layout.nbytes).view(torch.float32)
        assert torch.equal(staged.view(L, 2, 10, *kv.shape[4:]), full[:L, :, :10])
    finally:
        rx.close()
        arena.close()


@pytest.mark.parametrize(
    "first, second, words",
    [
        # layers 0-1 by one stage, 1-2 by the other
        ((pieces([0, 1]), done(0, 2)), (pieces([2]), done(1, 3, FIRST)), "layers [1, 2) declared"),
        ((pieces([0, 1]), done(0, 2, FIRST)), (pieces([2]), done(2, 3, FIRST)), "from two senders"),
        ((pieces([0, 1]), done(0, 2)), (pieces([2]), done(2, 3)), "no sender sent the first"),
        ((pieces([0]), done(0, 1)), (pieces([2]), done(2, 3, FIRST)), "declared 2 of 3 layers"),
        ((pieces([0]), done(0, 2)), (pieces([2]), done(2, 3, FIRST)), "layer 1 is missing"),
        ((pieces([0, 1, 2]), done(0, 2)), (pieces([2]), done(2, 3, FIRST)), "delivered twice"),
        ((pieces([0, 1]), done(0, 4)), (pieces([2]), done(2, 3, FIRST)), "out of range [0, 3)"),
    ],
)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_bad_group_transfers_fail(transport, first, second, words):
    kv, arena, rx = synthetic(transport)
    try:
        t = rx.expect("r", 10, 30.0, senders=2)
        send_layers(rx, arena, t, first[0], 0, transport == "tcp", done=first[1])
        reported(t, 1)  # (two sockets: the second's KVDone could overtake the first's layers)
        send_layers(rx, arena, t, second[0], 0, transport == "tcp", done=second[1])
        assert wait_event(rx) == "r"
        assert not t.ok and words in t.error, t.error
        rx.release("r")
        wait_freed(arena)  # both stages said KVDone: the area is free
    finally:
        rx.close()
        arena.close()


def test_one_stage_aborting_fails_the_transfer_and_the_area_waits_for_the_other():
    kv, arena, rx = synthetic("shm")
    try:
        t = rx.expect("r", 10, 30.0, senders=2)
        send_layers(rx, arena, t, [], 0, False, done=m.KVAbort("r", "stage 1 lost its peer"))
        assert wait_event(rx) == "r"
        assert not t.ok and "stage 1 lost its peer" in t.error
        rx.release("r")
        time.sleep(0.2)
        assert arena.used > 0  # the other stage may still be writing into the area
        send_layers(rx, arena, t, [], 0, False, done=done(0, 2))
        wait_freed(arena)
    finally:
        rx.close()
        arena.close()


@pytest.mark.parametrize("ending", ["killed", "done"])
def test_a_released_area_waits_for_every_local_stage_to_be_done_or_gone(ending):
    """stage_pids: each stage's process is watched; the area is freed once every stage that may
    write into it said KVDone/KVAbort or died (a SIGKILLed stage never says either)."""
    kv, arena, rx = synthetic("shm")
    stage1 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        t = rx.expect("r", 10, 30.0, senders=2, stage_pids=[os.getpid(), stage1.pid])
        assert set(t.writers) == {0, 2}  # stage 0 holds layers 0-1, stage 1 layer 2
        rx.release("r")
        send_layers(rx, arena, t, [], 0, False, done=m.KVAbort("r", "aborted", layer_start=0))
        reported(t, 1)
        rx.expire(time.monotonic())
        assert arena.used > 0  # stage 1 is alive and not done: it may still write
        if ending == "killed":
            stage1.kill()
            stage1.wait(10)
        else:
            send_layers(rx, arena, t, [], 0, False, done=done(2, 3, FIRST))
        deadline = time.monotonic() + 10
        while arena.used and time.monotonic() < deadline:
            rx.expire(time.monotonic())
            time.sleep(0.02)
        assert arena.used == 0
    finally:
        stage1.kill()
        stage1.wait(10)
        rx.close()
        arena.close()


def test_stages_elsewhere_or_gone_never_hold_a_released_area():
    kv, arena, rx = synthetic("shm")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    try:
        t = rx.expect("r", 10, 30.0, senders=2, stage_pids=[-1, gone.pid])
        assert not t.writers and not t.may_write
        rx.release("r")
        assert arena.used == 0  # freed at once
        with pytest.raises(ValueError, match="stage_pids must name 2 stages"):
            rx.expect("q", 10, 30.0, senders=2, stage_pids=[0])
    finally:
        rx.close()
        arena.close()


def test_senders_beyond_the_layers_are_refused():
    kv, arena, rx = synthetic("tcp")
    try:
        with pytest.raises(ValueError, match=r"senders must be in \[1, 3\], got 4"):
            rx.expect("r", 10, 30.0, senders=4)
        assert arena.used == 0
    finally:
        rx.close()
        arena.close()
