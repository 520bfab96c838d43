"""Who may still write into a transfer's staging area: the prefill processes the decode worker
identifies when it expects a transfer, and the test that decides whether an area released before
its senders were done is quarantined (a sender on this host may still write into it over shared
memory) or can go back to the arena at once.

A sender is identified (pid and start time, ``ipc/process_id.py``) while the router still counts
it alive, so a pid reused later is told apart; a sender gone already never writes. Over TCP this
side copies the frames itself and drops late ones, so nothing is quarantined; over Mooncake a
peer's NIC writes, which no pid tells, so the quarantine runs its course."""

from __future__ import annotations

from collections.abc import Sequence

from engine.cluster.transfer.state import Transfer
from engine.ipc.process_id import identify, is_gone
from engine.pipeline_stage import PipelineStage


def watch_writers(
    t: Transfer,
    sender_pid: int,
    sender_local: bool,
    stage_pids: Sequence[int],
    local_writers: bool,
) -> None:
    """Note on ``t`` the prefill processes that send it and may write into its area (the
    arguments as ``KVReceiver.expect`` takes them; local_writers: the receiver's senders are
    processes of this host)."""
    if sender_pid > 0 and sender_local:
        # Identified while the router still counts it alive, so a pid reused later is told
        # apart. Watched while the transfer runs: a sender SIGKILLed mid-transfer takes its
        # unsent layers and KVDone with it, and the router, which may already have its first
        # token, no longer waits on it; the receiver's expire() fails the transfer at once rather
        # than at the deadline.
        t.sender = identify(sender_pid)
    if local_writers and sender_pid > 0:
        if not sender_local:
            t.may_write = False  # it cannot map this host's memory: it sends frames
        else:
            # Gone already, it will never write (no PrefillRequest).
            t.writer = t.sender
            t.may_write = t.writer is not None
    if stage_pids and local_writers:
        for i, pid in enumerate(stage_pids):
            start = PipelineStage(i, t.senders).layer_range(t.layout.num_layers).start
            if pid == 0:
                t.writers[start] = None  # unknown: it may write until it is done
            elif pid > 0 and (w := identify(pid)) is not None:
                t.writers[start] = w  # watched; gone already, it never writes
            # -1: elsewhere, it sends frames
        t.may_write = bool(t.writers)


def may_still_write(t: Transfer, remote_writes: bool) -> bool:
    """Whether a sender might still write into t's area, so it cannot be reused (remote_writes:
    the receiver's senders write into its arena themselves)."""
    if not remote_writes or t.sender_done or not t.may_write:
        return False
    if t.inline:
        return False  # TCP: this side copies the frames; late ones are dropped
    if t.writers:  # a group: a stage not done whose process may be alive
        return any(
            start not in t.reported_by and (w is None or not is_gone(w))
            for start, w in t.writers.items()
        )
    if t.writer is None:
        return True  # not told who sends (Mooncake, or an older router): wait
    if is_gone(t.writer):
        t.may_write = False  # its memory maps died with it
        return False
    return True
