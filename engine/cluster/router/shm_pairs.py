"""Which prefill workers share a decode worker's /dev/shm, by proof
(engine/cluster/transfer/shm_proof.py), never by hostname: the router asks each prefill worker to
read the nonce beside each decode worker's staging arena (``ShmProbe``) when either registers, and
counts a pair as sharing memory only once the answer (``ShmReach``) matches the digest the decode
worker registered. A restarted decode worker has a new arena and digest, so old proofs lapse by
themselves; a pair without proof (yet) sends KV over TCP. Runs on the router's IO thread."""

from __future__ import annotations

from collections.abc import Iterable

from engine.cluster import messages as m
from engine.cluster.router.membership import Worker
from engine.cluster.transfer.shm_proof import proves


def probes(new: Worker, workers: Iterable[Worker]) -> list[tuple[Worker, m.ShmProbe]]:
    """The probes a fresh registration calls for: a decode worker with an arena to every live
    prefill worker, a prefill worker for every live decode worker with one. Each pair is marked
    pending on its prefill worker until the answer comes."""
    out = []
    if new.role == "decode" and new.shm_digest:
        pairs = [(p, new) for p in workers if p.role == "prefill" and p.live]
    elif new.role == "prefill":
        pairs = [(new, d) for d in workers if d.role == "decode" and d.live and d.shm_digest]
    else:
        pairs = []
    for p, d in pairs:
        p.shm_pending.add(d.worker_id)
        out.append((p, m.ShmProbe(d.worker_id, d.shm_path)))
    return out


def take_reach(prefill: Worker, decode: Worker | None, msg: m.ShmReach) -> bool:
    """A prefill worker's answer; True if it proves the pair shares /dev/shm."""
    prefill.shm_pending.discard(msg.decode_id)
    if prefill.role != "prefill" or decode is None or decode.role != "decode":
        return False
    try:
        nonce = bytes.fromhex(msg.nonce)
    except ValueError:
        nonce = b""
    if proves(nonce, decode.shm_digest):
        prefill.shm_peers[decode.worker_id] = decode.shm_digest
        return True
    prefill.shm_peers.pop(decode.worker_id, None)
    return False


def shares_memory(prefill: Worker, decode: Worker) -> bool:
    """The prefill worker proved it reads this decode worker's (current) staging arena."""
    digest = decode.shm_digest
    return bool(decode.shm_path and digest and prefill.shm_peers.get(decode.worker_id) == digest)


def shares_pids(prefill: Worker, decode: Worker) -> bool:
    """Also one pid namespace: the decode worker may watch the prefill worker's pid. Namespace
    ids compare only within one kernel, which the shared memory proves."""
    return (
        shares_memory(prefill, decode)
        and bool(prefill.pid_ns)
        and (prefill.pid_ns == decode.pid_ns)
    )
