"""Shared memory between a prefill and a decode worker is used on proof, never on a hostname: the
nonce file beside a staging arena, its digest, the probes a registration calls for, the answers
that prove a pair (or not), and a restarted decode worker whose old proof lapses."""

from __future__ import annotations

import os

from engine.cluster import messages as m
from engine.cluster.router import shm_pairs
from engine.cluster.router.membership import Worker
from engine.cluster.transfer.shm_proof import ArenaNonce, digest, pid_namespace, proves, read_nonce
from engine.cluster.transfer.staging import StagingArena


def worker(wid: str, role: str, **kw) -> Worker:
    return Worker(wid, role, wid.encode(), 1, "same-hostname", "", kw.pop("shm_path", ""),
                  "shm", 512, **kw)  # fmt: skip


def test_nonce_file_beside_the_arena():
    arena = StagingArena(1 << 16)
    nonce = ArenaNonce(arena.path)
    try:
        got = read_nonce(arena.path)
        assert len(got) == 16 and proves(got, nonce.digest)
        assert not proves(os.urandom(16), nonce.digest) and not proves(got, "")
        assert read_nonce("/dev/shm/../etc/passwd") == b""  # never opened: not one of ours
        assert read_nonce("/dev/shm/engine-kvstage-1-nothing") == b""
    finally:
        nonce.close()
        arena.close()
    assert not os.path.exists(nonce.path) and read_nonce(arena.path) == b""
    assert pid_namespace().count(":") == 1


def test_probes_answers_and_a_restart():
    p = worker("p0", "prefill", pid_ns="4:1")
    d = worker("d0", "decode", shm_path="/dev/shm/engine-kvstage-1-a", shm_digest="x",
               pid_ns="4:1")  # fmt: skip
    tcp_only = worker("d1", "decode")  # no arena: nothing to probe
    assert shm_pairs.probes(p, [p, tcp_only]) == []
    sent = shm_pairs.probes(p, [p, d, tcp_only])
    assert sent == [(p, m.ShmProbe("d0", d.shm_path))] and p.shm_pending == {"d0"}
    assert shm_pairs.probes(d, [p, d]) == sent  # the other order of registrations

    nonce = os.urandom(16)
    d.shm_digest = digest(nonce)
    assert not shm_pairs.take_reach(p, d, m.ShmReach("p0", "d0", ""))  # another /dev/shm
    assert not shm_pairs.shares_memory(p, d) and not p.shm_pending
    assert not shm_pairs.take_reach(p, d, m.ShmReach("p0", "d0", "zz"))  # not even hex
    assert not shm_pairs.take_reach(p, d, m.ShmReach("p0", "d0", os.urandom(16).hex()))
    assert shm_pairs.take_reach(p, d, m.ShmReach("p0", "d0", nonce.hex()))
    assert shm_pairs.shares_memory(p, d) and shm_pairs.shares_pids(p, d)
    d.pid_ns = "4:2"  # one /dev/shm, two pid namespaces (containers): pids mean nothing
    assert shm_pairs.shares_memory(p, d) and not shm_pairs.shares_pids(p, d)

    restarted = worker("d0", "decode", shm_path="/dev/shm/engine-kvstage-2-b", shm_digest="new")
    assert not shm_pairs.shares_memory(p, restarted)  # its new arena is not proven
    assert not shm_pairs.take_reach(p, None, m.ShmReach("p0", "gone", nonce.hex()))
