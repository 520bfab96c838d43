"""Disaggregated prefill and decode: KV transfer speed, overlap of layer-wise streaming, TTFT, and
the interference that disaggregation removes. Prints tables; speeds are ratios to baselines
measured in the same run.

1. transfer: one request's KV (every layer, ``--transfer-tokens`` tokens of the default model's
   shape) from a KVSender in this process to a KVReceiver in another, over shared memory and TCP,
   against a plain memcpy of the same bytes and raw ZeroMQ TCP moving the same bytes in the same
   frames between two processes. The paths take turns, round by round (median and best).
2. overlap: the real model prefills prompts of ``--overlap-sizes`` tokens here in chunks of
   ``--chunk`` while its KV streams to a receiver process; "exposed" is the time from the end of
   the last layer's compute to the receiver holding every layer, against the whole transfer when
   every layer leaves after the prefill (streaming off). Median of ``--repeats``.
3. ttft: time to first token of a 1 prefill + 1 decode cluster (worker processes, shared memory)
   against the colocated engine: the same prompts, warm, interleaved, median of ``--repeats``,
   one torch thread per process.
4. interference: a steady decode load plus arriving long prompts; time between tokens of the
   running decodes (p50/p99), colocated against 1 prefill + 1 decode.


--netlab RATE[,RATE...] (root): parts 1 and 2 between two hosts of a network lab (engine/netlab:
own network namespaces, one switch), the sending side on host p and the receiving processes on
host d, every link shaped to the rate (tbf). Transfer at each rate: raw ZeroMQ, ours over TCP and
over Mooncake's Transfer Engine (TCP), in Gbit/s, with the CPU each end spent per second of
transfer. Overlap at --overlap-rate (default the first rate) over TCP, with the prefill also run
colocated (no transfer): "extra" is what 1P+1D adds to the prefill's time, against the transfer
un-overlapped. ZeroMQ sockets without CURVE (both raw and ours) unless --curve.

    .venv/bin/python profiling/bench_cluster.py                      # everything
    .venv/bin/python profiling/bench_cluster.py --parts transfer,overlap
    .venv/bin/python profiling/bench_cluster.py --trace   # the trace by policy (bench_trace.py)
    .venv/bin/python profiling/bench_cluster.py --netlab 1gbit,4gbit --rounds 5 \
        --overlap-sizes 1024,2048,4096                               # issue 21's link figures
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from engine.bench import trace as bench_trace
from engine.cluster import messages as m
from engine.cluster.transfer.receiver import KVReceiver
from engine.cluster.transfer.sender import KVSender, SendTarget
from engine.cluster.transfer.staging import KVLayout, StagingArena
from engine.ipc import curve

LAYERS, HEADS, DIM, BS = 30, 3, 64, 16  # SmolLM2-135M's KV shape


@dataclass(frozen=True)
class Hosts:
    """Where a benchmark's two ends run: the sending side in the benchmark's process, at address
    ``sender``; the receiving processes (a KVReceiver, a raw ZeroMQ sink) in the network
    namespace ``netns`` (None: the benchmark's own), bound to ``receiver``. ``link`` names the
    link between them for the tables: loopback, or a network lab's shaped rate (--netlab)."""

    sender: str = "127.0.0.1"
    receiver: str = "127.0.0.1"
    netns: str | None = None
    link: str = "loopback"


LOOPBACK = Hosts()


def _on_receiver_host(hosts: Hosts) -> None:
    torch.set_num_threads(1)
    if hosts.netns:
        from engine.netlab import enter

        enter(hosts.netns)  # first thing: ZeroMQ's and Mooncake's threads start after


# -- a receiver in another process ---------------------------------------------------------------


def _receiver_main(
    conn, transport: str, arena_mb: int, num_blocks: int, dtype: str, hosts: Hosts
) -> None:
    _on_receiver_host(hosts)
    kv = torch.zeros(LAYERS, 2, num_blocks, BS, HEADS, DIM, dtype=getattr(torch, dtype))
    arena = StagingArena(arena_mb << 20, shared=transport == "shm")
    rx = KVReceiver(
        kv, BS, arena, bind=f"tcp://{hosts.receiver}:0", remote_writes=transport != "tcp"
    )
    peer, base = "", 0
    if transport == "mooncake":
        from engine.cluster.transfer.mooncake import MooncakeEndpoint

        mc = MooncakeEndpoint(hosts.receiver)
        peer, base = mc.address, mc.register(arena.buf)
    conn.send((rx.address, arena.path, peer, base))
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        _, rid, tokens = cmd
        t = rx.expect(rid, tokens, 600.0)
        cpu = time.process_time()
        conn.send((t.offset, t.layout.nbytes))
        assert rx.events.get(timeout=600) == rid
        cpu = time.process_time() - cpu  # every thread of this process, for this transfer
        conn.send((t.ok, t.error, t.last_piece_time, t.complete_time, cpu))
        rx.release(rid)
    rx.close()
    arena.close()


class RemoteReceiver:
    def __init__(
        self,
        transport: str,
        arena_mb: int = 512,
        num_blocks: int = 8,
        dtype: str = "float32",
        hosts: Hosts = LOOPBACK,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_receiver_main,
            args=(child, transport, arena_mb, num_blocks, dtype, hosts),
            daemon=True,
        )
        self.proc.start()
        self.address, self.path, self.peer, self.base = self.conn.recv()
        self.transport = transport

    def expect(self, rid: str, tokens: int) -> tuple[int, int]:
        self.conn.send(("expect", rid, tokens))
        return self.conn.recv()

    def result(self):
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(("stop",))
        self.proc.join(30)


def _zmq_sink(conn, layers: int, frame_bytes: int, into: bool, hosts: Hosts) -> None:
    """Raw ZeroMQ TCP's receiving end. Per round (a word on the pipe): ``layers`` messages of
    three frames (a small header, K rows, V rows: the frames a KV layer travels in), then the
    time the last frame came and this process's CPU seconds. ``into``: frames are copied into a
    destination buffer (what a receiver that must place the bytes somewhere pays), else received
    without a copy."""
    _on_receiver_host(hosts)
    sock = zmq.Context.instance().socket(zmq.PULL)
    curve.secure_server(sock, f"tcp://{hosts.receiver}:0")  # as a KVReceiver's: CURVE with keys
    port = sock.bind_to_random_port(f"tcp://{hosts.receiver}")
    conn.send(port)
    dest = np.zeros(2 * layers * frame_bytes, dtype=np.uint8)
    while conn.recv() == "round":
        cpu = time.process_time()
        for i in range(layers):
            sock.recv(copy=False)
            for kv in range(2):
                if into:
                    j = 2 * i + kv
                    sock.recv_into(dest[j * frame_bytes : (j + 1) * frame_bytes])
                else:
                    sock.recv(copy=False)
        conn.send((time.monotonic(), time.process_time() - cpu))


class RawZmq:
    """A raw ZeroMQ PUSH here to a PULL in another process, moving the same bytes as one KV
    transfer of ``nbytes`` in the same frames."""

    def __init__(self, nbytes: int, into: bool, hosts: Hosts = LOOPBACK) -> None:
        self.nbytes = nbytes
        self.half = nbytes // LAYERS // 2
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_zmq_sink, args=(child, LAYERS, self.half, into, hosts), daemon=True
        )
        self.proc.start()
        self.sock = zmq.Context.instance().socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        curve.secure_client(self.sock)
        self.sock.connect(f"tcp://{hosts.receiver}:{self.conn.recv()}")
        # Every layer from its own memory, as a transfer's are (one buffer sent 30 times would
        # be sent from the CPU cache).
        rng = np.random.default_rng(0)
        self.layers = rng.integers(0, 255, (LAYERS, 2, self.half), dtype=np.uint8)
        self.header = m.encode(m.KVLayer("r", 0, 0, 1, 0, True))[0]

    def round(self) -> tuple[float, float]:
        """Seconds from the first send to the last frame's arrival; the receiver's CPU
        seconds."""
        self.conn.send("round")
        t0 = time.monotonic()
        for k, v in self.layers:
            self.sock.send_multipart([self.header, k, v], copy=False)
        last, cpu = self.conn.recv()
        return last - t0, cpu

    def close(self) -> None:
        self.conn.send("stop")
        self.sock.close(linger=0)
        self.proc.join(10)


class OurTransfer:
    """One request's KV, every layer gathered from a paged cache here (as ``save_layer`` does)
    and sent by a KVSender to a KVReceiver in another process."""

    def __init__(
        self,
        transport: str,
        tokens: int,
        cache: torch.Tensor,
        table: list[int],
        hosts: Hosts = LOOPBACK,
    ):
        self.mc = None
        if transport == "mooncake":
            from engine.cluster.transfer.mooncake import MooncakeEndpoint

            self.mc = MooncakeEndpoint(hosts.sender)  # ValueError when the package is not there
        self.transport, self.tokens, self.table = transport, tokens, table
        self.layout = KVLayout(LAYERS, tokens, HEADS * DIM * 4)
        arena_mb = max(64, 2 * self.layout.nbytes >> 20)
        self.rx = RemoteReceiver(transport, arena_mb=arena_mb, hosts=hosts)
        self.sender = KVSender(cache, BS, mooncake=self.mc)
        self.n = 0

    def round(self) -> tuple[float, float]:
        """Seconds from the first layer's gather to the receiver holding every layer; the
        receiver's CPU seconds."""
        rid = f"t{self.n}"
        self.n += 1
        rx = self.rx
        offset, _ = rx.expect(rid, self.tokens)
        t = SendTarget(
            rid, rid, rx.address, self.transport, rx.path, offset, self.layout,
            peer_address=rx.peer, peer_base=rx.base,
        )  # fmt: skip
        self.sender.add(t)
        t0 = time.monotonic()
        for i in range(LAYERS):
            self.sender._send_range(t, i, self.table, self.tokens)  # what save_layer does
        done = m.KVDone(rid, self.tokens, LAYERS, 0, [{"index": 0, "token": 0}])
        self.sender.finish(rid, done)
        ok, err, last_piece, _, cpu = rx.result()
        assert ok, err
        return last_piece - t0, cpu

    def close(self) -> None:
        self.sender.close()
        self.rx.close()


# -- 1. transfer ---------------------------------------------------------------------------------


def bench_transfer(tokens: int, rounds: int, hosts: Hosts = LOOPBACK) -> None:
    """Every path does one round in turn, ``rounds`` times after a warm-up round (first-touch
    page faults, connections), so a change of the host's load hits all of them alike; the
    table gives the median and the best round of each, ratios of medians, and the CPU each end
    spent per second of transfer (cores: every thread of its process, median). Between two
    hosts of a network lab (``hosts``) only the paths that cross a network run: raw ZeroMQ,
    ours over TCP and over Mooncake's Transfer Engine (TCP)."""
    # As in a worker (--threads 1): more intra-op threads than free cores make every gather
    # wait for a spinning OpenMP team while the sender and ZeroMQ threads want the same cores.
    torch.set_num_threads(1)
    lab = hosts.link != "loopback"
    layout = KVLayout(LAYERS, tokens, HEADS * DIM * 4)
    nbytes = layout.nbytes
    blocks = -(-tokens // BS)
    cache = torch.randn(LAYERS, 2, blocks + 1, BS, HEADS, DIM)
    table = list(range(1, blocks + 1))
    raw_name = "raw ZeroMQ TCP (two processes)"
    paths: dict[str, object] = {}
    closers = []
    if not lab:
        src = torch.randn(nbytes // 4)
        dst = torch.empty_like(src)
        paths["memcpy (one process)"] = lambda: (_timed(lambda: dst.copy_(src)), 0.0)
    raw = RawZmq(nbytes, into=False, hosts=hosts)
    into = RawZmq(nbytes, into=True, hosts=hosts)
    paths[raw_name] = raw.round
    paths["  same, received into a buffer"] = into.round
    closers += [raw.close, into.close]
    for transport in ("tcp", "mooncake") if lab else ("shm", "tcp", "mooncake"):
        try:
            ours = OurTransfer(transport, tokens, cache, table, hosts)
        except ValueError as exc:
            print(f"({transport} skipped: {exc})")
            continue
        paths[f"KV transfer over {transport} (ours)"] = ours.round
        closers.append(ours.close)
    times: dict[str, list[float]] = {name: [] for name in paths}
    send_cores: dict[str, list[float]] = {name: [] for name in paths}
    recv_cores: dict[str, list[float]] = {name: [] for name in paths}
    try:
        for r in range(rounds + 1):
            for name, fn in paths.items():
                cpu = time.process_time()
                dt, recv_cpu = fn()
                cpu = time.process_time() - cpu
                if r:
                    times[name].append(dt)
                    send_cores[name].append(cpu / dt)
                    recv_cores[name].append(recv_cpu / dt)
    finally:
        for close in closers:
            close()
    # GB/s on loopback (against memory bandwidth), Gbit/s over a lab's link (against its rate).
    unit, scale = ("Gbit/s", 1e9 / 8) if lab else ("GB/s", 1e9)
    rate = {name: nbytes / float(np.median(ts)) / scale for name, ts in times.items()}
    best = {name: nbytes / min(ts) / scale for name, ts in times.items()}
    base = {"shm": "memcpy (one process)", "tcp": raw_name}
    where = f"between two hosts over a {hosts.link} link" if lab else "on loopback"
    print(f"\n## KV transfer {where}: {tokens} tokens x {LAYERS} layers = {nbytes / 2**20:.1f} MiB")
    print(
        f"(median and best of {rounds} rounds after a warm-up, paths taking turns; "
        f"load average {os.getloadavg()[0]:.1f}; cores: CPU seconds per second of transfer)"
    )
    print(f"{'path':<36} {unit:>7} {'best':>7} {'ratio':>7} {'send':>5} {'recv':>5}  vs")
    target = 0.9 if lab else 0.8
    for name in paths:
        kind = next((k for k in ("shm", "tcp", "mooncake") if f"over {k}" in name), "")
        ref = base.get(kind, raw_name if kind else "memcpy (one process)")
        if name.startswith("  ") or lab:
            ref = raw_name
        vs = {"shm": "memcpy, target >= 0.5", "tcp": f"raw ZeroMQ, target >= {target}"}.get(
            kind, "raw ZeroMQ (Transfer Engine over TCP)" if kind else ref.split(" (")[0]
        )
        ratio = rate[name] / rate[ref]
        cores = f"{np.median(send_cores[name]):>5.2f} {np.median(recv_cores[name]):>5.2f}"
        print(f"{name:<36} {rate[name]:>7.2f} {best[name]:>7.2f} {ratio:>7.2f} {cores}  {vs}")
    print(
        "(raw ZeroMQ sends the same bytes in the same frames as ours, 3 per layer; ours also\n"
        " gathers from paged blocks, hashes each layer (xxh3) on both sides and checks it)"
    )


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- 2. overlap ----------------------------------------------------------------------------------


def bench_overlap(
    sizes: list[int],
    threads: int,
    chunk: int,
    repeats: int,
    hosts: Hosts = LOOPBACK,
    transports: tuple[str, ...] = ("shm", "tcp"),
) -> None:
    """Each prompt three ways, interleaved: colocated (no transfer), streamed (each layer leaves
    as its chunk's compute ends) and not streamed (every layer after the prefill). "exposed":
    streamed, the end of the last layer's compute to the receiver holding everything;
    "unoverlapped": not streamed, the same from the end of the prefill, i.e. the whole transfer;
    "extra": the prefill streamed plus exposed, less the prefill colocated (what 1P+1D adds to
    the time to first token, the decode's own step and the router aside: it also counts the
    gathers and hashes that streaming puts on the prefill's engine thread, and, where the two
    ends share cores as in a network lab, the receiver's work). "send CPU": what streaming adds
    to the prefill process's CPU time (every thread: gathers, hashes, ZeroMQ); "engine ms": the
    time the engine thread spent in the sender's per-layer work (gathers, hashes, queueing),
    which delays the next layer's compute on any host; "recv CPU": the receiver process's CPU
    time for the streamed transfer. On a shared host the prefill's time moves between rounds by
    more than the transfer takes, CPU time too, so "extra" and "send CPU" are noise there;
    "engine+exposed" (engine ms plus exposed, of the unoverlapped time) is what streaming costs
    the time to first token where the prefill has its cores."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.core.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    max_tokens = max(sizes)
    engine = LLMEngine(
        EngineConfig(
            cache=CacheConfig(num_blocks=max_tokens // BS + 64, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=chunk),
        ),
        connector_factory=lambda cache, inner: KVSender(cache.kv, cache.block_size),
    )
    dtype = str(engine.cache.kv.dtype).removeprefix("torch.")
    sender = engine.connector
    token_bytes = sender.token_bytes
    arena_mb = (KVLayout(LAYERS, max_tokens, token_bytes).nbytes >> 20) * 2 + 64
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rng = np.random.default_rng(0)
    where = "on loopback" if hosts.link == "loopback" else f"over a {hosts.link} link"
    print(
        f"\n## Overlap {where}: transfer exposed after the prefill's last layer; {dtype} KV, "
        f"chunks of {chunk} tokens, torch threads {threads}, median of {repeats}"
    )
    print(
        f"{'tokens':>7} {'transport':>9} {'MiB':>5} {'colocated ms':>12} {'streamed ms':>11} "
        f"{'exposed ms':>10} {'unoverlapped ms':>15} {'exposed/unov':>12} {'extra/unov':>10} "
        f"{'send CPU ms':>11} {'engine ms':>9} {'recv CPU ms':>11} "
        f"{'engine+exposed':>14}"
    )
    modes = ("colocated", "streamed", "not streamed")
    in_sender = [0.0]  # seconds the engine thread spent in the sender's per-layer work
    send_range = sender._send_range

    def timed_send_range(*args) -> None:
        t = time.perf_counter()
        send_range(*args)
        in_sender[0] += time.perf_counter() - t

    sender._send_range = timed_send_range
    for transport in transports:
        rx = RemoteReceiver(transport, arena_mb=arena_mb, dtype=dtype, hosts=hosts)
        for size in sizes:
            layout = KVLayout(LAYERS, size, token_bytes)
            res: dict[str, list[tuple[float, ...]]] = {k: [] for k in modes}
            # Round 0 warms up (first-touch page faults, the connection), once per receiver.
            for r in range(0 if size == sizes[0] else 1, repeats + 1):
                for mode in modes:
                    rid = f"o{size}{transport}{mode[0]}{r}"
                    prompt = rng.integers(100, 40000, size).tolist()
                    engine.add_request(prompt, params, request_id=rid)
                    if mode != "colocated":
                        offset, n = rx.expect(rid, size)
                        stream = mode == "streamed"
                        sender.add(
                            SendTarget(
                                rid, rid, rx.address, transport, rx.path, offset, layout, stream
                            )
                        )
                    in_sender[0] = 0.0
                    cpu, t0 = time.process_time(), time.monotonic()
                    while engine.has_unfinished_requests():
                        engine.step()
                    t_end = time.monotonic()
                    cpu, own = time.process_time() - cpu, in_sender[0]
                    exposed = recv_cpu = 0.0
                    if mode != "colocated":
                        # Streaming off: every layer leaves now, in finish(); it returns the
                        # time the last one left the step loop (on: the last layer's compute).
                        start = time.monotonic()
                        done = m.KVDone(rid, size, LAYERS, 0, [{"index": 0}])
                        sent = sender.finish(rid, done)
                        ok, err, last_piece, _, recv_cpu = rx.result()
                        assert ok, err
                        exposed = max(0.0, last_piece - (sent if stream else start))
                    if r:
                        res[mode].append((t_end - t0, exposed, cpu, recv_cpu, own))
            med = {
                mode: [float(np.median([x[i] for x in res[mode]])) for i in range(5)]
                for mode in modes
            }
            colocated, streamed = med["colocated"][0], med["streamed"][0]
            exposed, whole = med["streamed"][1], med["not streamed"][1]
            # Of each round's pair (a change of the host's load between rounds cancels out).
            pairs = list(zip(res["streamed"], res["colocated"]))
            extra = float(np.median([s[0] + s[1] - c[0] for s, c in pairs]))
            send_cpu = float(np.median([s[2] - c[2] for s, c in pairs]))
            in_engine = med["streamed"][4]
            print(
                f"{size:>7} {transport:>9} {layout.nbytes / 2**20:>5.0f} {colocated * 1e3:>12.0f} "
                f"{streamed * 1e3:>11.0f} {exposed * 1e3:>10.1f} {whole * 1e3:>15.1f} "
                f"{exposed / whole:>12.2f} {extra / whole:>10.2f} {send_cpu * 1e3:>11.0f} "
                f"{in_engine * 1e3:>9.0f} {med['streamed'][3] * 1e3:>11.0f} "
                f"{(in_engine + exposed) / whole:>14.2f}"
            )
        rx.close()
    sender.close()
    print(
        "(target: exposed <= 0.30 of unoverlapped. extra: the median over rounds of streamed +\n"
        " exposed - colocated, of the same round; the host's other load moves it far more than\n"
        " exposed, as the spread of the prefill times does; send CPU likewise. engine+exposed:\n"
        " (engine ms + exposed) / unoverlapped, the cost where the prefill has its cores)"
    )


# -- 3 and 4: a real cluster against the colocated engine --------------------------------------


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _ttft(llm, prompt, params) -> float:
    t0 = time.monotonic()
    async for _ in llm.generate(prompt, params):
        return time.monotonic() - t0
    return float("nan")


async def _decode_load(llm, prompt, params, gaps: list[float]) -> None:
    last = None
    async for out in llm.generate(prompt, params):
        now = time.monotonic()
        if last is not None and out.outputs[0].new_token_ids:
            gaps.append(now - last)
        last = now


async def _interference(llm, decodes: int, long_prompts: int, long_len: int, rng) -> list[float]:
    from engine.sampling_params import SamplingParams

    gaps: list[float] = []
    steady = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    tasks = [
        asyncio.ensure_future(
            _decode_load(llm, rng.integers(100, 40000, 32).tolist(), steady, gaps)
        )
        for _ in range(decodes)
    ]
    await asyncio.sleep(1.0)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    for _ in range(long_prompts):
        await _ttft(llm, rng.integers(100, 40000, long_len).tolist(), one)
    await asyncio.gather(*tasks)
    return gaps


def bench_serving(
    sizes: list[int], repeats: int, decodes: int, long_prompts: int, long_len: int
) -> None:
    """TTFT: the same prompts through both, warm, interleaved (colocated, then the cluster, for
    each prompt of each repeat, so a change of the host's load hits both alike), median of the
    repeats. Every engine runs one torch thread: the colocated one here (torch.set_num_threads
    is process-wide), each worker in its own process (--threads 1, OMP_NUM_THREADS=1)."""
    from engine.async_llm import AsyncLLM
    from engine.cluster.launcher import Cluster
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.sampling_params import SamplingParams

    chunk = 512
    worker_args = [
        "--kv-cache-memory-gb", "1", "--max-num-batched-tokens", str(chunk),
        "--kv-staging-mb", "512", "--no-prefix-caching",
    ]  # fmt: skip
    one = SamplingParams(temperature=0.0, max_tokens=1)
    rng = np.random.default_rng(1)
    prompts = {s: [rng.integers(100, 40000, s).tolist() for _ in range(repeats)] for s in sizes}
    torch.set_num_threads(1)
    colocated = AsyncLLM(
        config=EngineConfig(
            cache=CacheConfig(kv_cache_memory_gb=1, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=chunk),
        )
    )
    ttft: dict[str, dict[int, list[float]]] = {"colocated": {}, "1P+1D": {}}
    gaps: dict[str, list[float]] = {}
    with Cluster(1, 1, worker_args=worker_args, threads=1) as cluster:
        systems = {"colocated": colocated, "1P+1D": cluster.router}

        async def run():
            for llm in systems.values():
                for s in sizes:  # warm-up: first-forward allocations, connections
                    await _ttft(llm, rng.integers(100, 40000, s).tolist(), one)
            for r in range(repeats):
                for s in sizes:
                    for name, llm in systems.items():
                        ttft[name].setdefault(s, []).append(await _ttft(llm, prompts[s][r], one))
            for name, llm in systems.items():
                gaps[name] = await _interference(llm, decodes, long_prompts, long_len, rng)

        asyncio.run(run())
    colocated.close()
    print(
        f"\n## TTFT (ms), one request at a time, median of {repeats} (min-max); chunks of "
        f"{chunk} tokens, 1 torch thread per process"
    )
    print(f"{'tokens':>7} {'colocated':>20} {'1P+1D':>20} {'ratio':>7} {'of mins':>8}")
    for s in sizes:
        a, b = (np.array(ttft[n][s]) * 1e3 for n in ("colocated", "1P+1D"))
        cell = lambda x: f"{np.median(x):.0f} ({x.min():.0f}-{x.max():.0f})"  # noqa: E731
        print(
            f"{s:>7} {cell(a):>20} {cell(b):>20} {np.median(b) / np.median(a):>7.2f} "
            f"{b.min() / a.min():>8.2f}"
        )
    print(
        "(1P+1D pays for streaming: each layer's KV is gathered and hashed on the prefill's\n"
        " engine thread and sent by two more threads on the same cores; the spread shows how\n"
        " much the host's other load moves a single measurement)"
    )
    print(
        f"\n## Interference: {decodes} running decodes, {long_prompts} prompts of {long_len} "
        "tokens arriving; time between tokens (ms)"
    )
    print(f"{'':>10} {'p50':>8} {'p99':>8} {'max':>8} {'n':>6}")
    for name in ("colocated", "1P+1D"):
        g = gaps[name]
        print(
            f"{name:>10} {_percentile(g, 0.5) * 1e3:>8.1f} {_percentile(g, 0.99) * 1e3:>8.1f} "
            f"{max(g) * 1e3:>8.1f} {len(g):>6}"
        )
    print(f"(load average {os.getloadavg()[0]:.1f}; the processes share this host's cores)")


# -- --netlab: the same between two hosts over a shaped link ------------------------------------


def _hosted(netns: str, fn, args: tuple) -> None:
    from engine.netlab import enter

    enter(netns)
    fn(*args)


def _run_on_host(netns: str, fn, *args) -> None:
    """fn(*args) in a process on the lab host of network namespace ``netns``."""
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_hosted, args=(netns, fn, args))
    proc.start()
    proc.join()
    if proc.exitcode:
        raise SystemExit(f"{fn.__name__} on the lab host failed (exit {proc.exitcode})")


def bench_netlab(args, parts: set[str]) -> None:
    """The transfer (at each rate of --netlab) and the overlap (at --overlap-rate, default the
    first) between two hosts of a network lab: the sending side on host p, the receiving
    processes on host d, both ends of both links shaped to the rate (tbf)."""
    from engine.netlab import NetLab, unavailable

    reason = unavailable()
    if reason:
        raise SystemExit(f"--netlab: no network lab here: {reason}")
    rates = [r.strip() for r in args.netlab.split(",") if r.strip()]
    keys = os.environ.get("ENGINE_CURVE_KEYS")
    if args.curve and not keys:
        keys = tempfile.mkdtemp(prefix="bench-cluster-keys-")
        atexit.register(shutil.rmtree, keys, True)
        curve.generate_keys(keys)
        os.environ["ENGINE_CURVE_KEYS"] = keys  # the processes on the hosts inherit it
    if not keys:
        os.environ["ENGINE_CURVE_INSECURE"] = "1"  # raw ZeroMQ has no CURVE: neither have we
    print(f"ZeroMQ CURVE (raw ZeroMQ and ours alike): {f'on, keys {keys}' if keys else 'off'}")
    # SIGTERM: leave through the with, whose close kills what runs on the hosts.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with NetLab(["p", "d"]) as lab:

        def place(rate: str) -> Hosts:
            for host in lab.hosts:
                lab.shape(host, rate)
            return Hosts(lab.addresses["p"], lab.addresses["d"], lab.netns("d"), rate)

        sender = lab.netns("p")
        if "transfer" in parts:
            for rate in rates:
                _run_on_host(sender, bench_transfer, args.transfer_tokens, args.rounds, place(rate))
        if "overlap" in parts:
            sizes = [int(x) for x in args.overlap_sizes.split(",")]
            hosts = place(args.overlap_rate or rates[0])
            overlap = (sizes, args.threads, args.chunk, args.repeats, hosts, ("tcp",))
            _run_on_host(sender, bench_overlap, *overlap)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--parts", default="transfer,overlap,serving")
    ap.add_argument("--transfer-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--overlap-sizes", default="512,1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=3, help="overlap and TTFT: median of these")
    ap.add_argument("--ttft-sizes", default="512,2048")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the prefill")
    ap.add_argument("--decodes", type=int, default=4)
    ap.add_argument("--long-prompts", type=int, default=3)
    ap.add_argument("--long-len", type=int, default=2048)
    ap.add_argument("--trace", action="store_true", help="only the trace replay by policy")
    ap.add_argument(
        "--netlab",
        metavar="RATE[,RATE...]",
        help="transfer and overlap between two hosts of a network lab (root), the link shaped "
        "to each rate (tc units: 1gbit,4gbit); serving is not run",
    )
    ap.add_argument(
        "--curve",
        action="store_true",
        help="--netlab: every ZeroMQ socket with CURVE (keys made in a temporary directory "
        "unless ENGINE_CURVE_KEYS names some); without keys, none has",
    )
    ap.add_argument(
        "--overlap-rate", help="--netlab: the link's rate for overlap (default: the first)"
    )
    bench_trace.add_args(ap)
    args = ap.parse_args()
    if args.trace:
        bench_trace.run(args)
        return
    parts = set(args.parts.split(","))
    if args.netlab:
        bench_netlab(args, parts)
        return
    if "transfer" in parts:
        bench_transfer(args.transfer_tokens, args.rounds)
    if "overlap" in parts:
        sizes = [int(x) for x in args.overlap_sizes.split(",")]
        bench_overlap(sizes, args.threads, args.chunk, args.repeats)
    if "serving" in parts:
        bench_serving(
            [int(x) for x in args.ttft_sizes.split(",")],
            args.repeats,
            args.decodes,
            args.long_prompts,
            args.long_len,
        )


if __name__ == "__main__":
    main()
