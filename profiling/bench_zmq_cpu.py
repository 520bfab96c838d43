"""How much CPU raw ZeroMQ TCP itself takes on this host: the baseline of the cluster's TCP KV
transfer (bench_cluster.py) moves the same bytes the same way, so if the two processes of the raw
transfer already keep every core busy, any work our transfer adds per byte (gathering the paged
blocks, hashing each layer on both sides, scattering into the cache) adds wall time one for one.

    .venv/bin/python profiling/bench_zmq_cpu.py --rounds 10

Prints GB/s, wall time and the CPU seconds of sender and receiver (user + system, all threads,
ZeroMQ's IO threads included), and the cores they kept busy on average.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import time

import numpy as np
import zmq

LAYERS = 30
LAYER_BYTES = 3 * 1024 * 1024  # 2,048 tokens of one SmolLM2 layer's K and V in bf16


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _receiver(address: str, rounds: int, out: mp.Queue) -> None:
    sock = zmq.Context().socket(zmq.PULL)
    sock.bind(address)
    out.put("ready")
    sock.recv_multipart(copy=False)  # the start marker
    c0 = _cpu()
    for _ in range(rounds * LAYERS):
        sock.recv_multipart(copy=False)
    out.put(_cpu() - c0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--port", type=int, default=15999)
    args = ap.parse_args()
    address = f"tcp://127.0.0.1:{args.port}"
    q: mp.Queue = mp.Queue()
    proc = mp.Process(target=_receiver, args=(address, args.rounds, q), daemon=True)
    proc.start()
    try:
        q.get(timeout=30)
        sock = zmq.Context().socket(zmq.PUSH)
        sock.connect(address)
        bufs = [np.frombuffer(os.urandom(LAYER_BYTES), np.uint8) for _ in range(LAYERS)]
        sock.send(b"start")
        c0, t0 = _cpu(), time.perf_counter()
        half = LAYER_BYTES // 2
        for _ in range(args.rounds):
            for b in bufs:  # a header, K, V: the frames of one layer, as the cluster sends them
                sock.send_multipart([b"h", b[:half], b[half:]], copy=False)
        receiver_cpu = q.get(timeout=120)
        wall = time.perf_counter() - t0
        sender_cpu = _cpu() - c0
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    total = args.rounds * LAYERS * LAYER_BYTES
    print(f"raw ZeroMQ TCP, {total / 2**20:.0f} MiB in {wall:.3f} s: {total / wall / 1e9:.2f} GB/s")
    print(f"CPU: sender {sender_cpu:.3f} s, receiver {receiver_cpu:.3f} s")
    print(f"cores kept busy: {(sender_cpu + receiver_cpu) / wall:.2f} of {os.cpu_count()}")


if __name__ == "__main__":
    main()
