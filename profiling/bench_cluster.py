"""Disaggregated prefill and decode: KV transfer speed, overlap of layer-wise streaming, TTFT, and
the interference that disaggregation removes. Prints tables; speeds are ratios to baselines
measured in the same run.

1. transfer: one request's KV (every layer, ``--transfer-tokens`` tokens of the default model's
   shape) from a KVSender in this process to a KVReceiver in another, over shared memory and TCP,
   against a plain memcpy of the same bytes and raw ZeroMQ TCP frames between the same processes.
2. overlap: the real model prefills prompts of ``--overlap-sizes`` tokens here while its KV streams
   to a receiver process; "exposed" is the time from the end of the last layer's compute to the
   receiver holding every layer, against the whole transfer when every layer leaves after the
   prefill (streaming off).
3. ttft: time to first token of a 1 prefill + 1 decode cluster (worker processes, shared memory)
   against the colocated engine, same prompts.
4. interference: a steady decode load plus arriving long prompts; time between tokens of the
   running decodes (p50/p99), colocated against 1 prefill + 1 decode.

    .venv/bin/python profiling/bench_cluster.py                      # everything
    .venv/bin/python profiling/bench_cluster.py --parts transfer,overlap
    .venv/bin/python profiling/bench_cluster.py --trace   # the trace by policy (bench_trace.py)
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402

from engine.cluster import messages as m  # noqa: E402
from engine.cluster.kv_receiver import KVReceiver  # noqa: E402
from engine.cluster.kv_sender import KVSender, SendTarget  # noqa: E402
from engine.cluster.transfer import KVLayout, StagingArena  # noqa: E402
from profiling import bench_trace  # noqa: E402

LAYERS, HEADS, DIM, BS = 30, 3, 64, 16  # SmolLM2-135M's KV shape


# -- a receiver in another process ---------------------------------------------------------------


def _receiver_main(conn, transport: str, arena_mb: int, num_blocks: int) -> None:
    torch.set_num_threads(1)
    kv = torch.zeros(LAYERS, 2, num_blocks, BS, HEADS, DIM)
    arena = StagingArena(arena_mb << 20, shared=transport == "shm")
    rx = KVReceiver(kv, BS, arena, remote_writes=transport != "tcp")
    peer, base = "", 0
    if transport == "mooncake":
        from engine.cluster.transfer_mooncake import MooncakeEndpoint

        mc = MooncakeEndpoint()
        peer, base = mc.address, mc.register(arena.buf)
    conn.send((rx.address, arena.path, peer, base))
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        _, rid, tokens = cmd
        t = rx.expect(rid, tokens, 600.0)
        conn.send((t.offset, t.layout.nbytes))
        assert rx.events.get(timeout=600) == rid
        conn.send((t.ok, t.error, t.last_piece_time, t.complete_time))
        rx.release(rid)
    rx.close()
    arena.close()


class RemoteReceiver:
    def __init__(self, transport: str, arena_mb: int = 512, num_blocks: int = 8) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_receiver_main, args=(child, transport, arena_mb, num_blocks), daemon=True
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


def _zmq_sink(conn, n: int) -> None:
    sock = zmq.Context.instance().socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    conn.send(port)
    for _ in range(n):
        sock.recv(copy=False)
    conn.send(time.monotonic())


# -- 1. transfer ---------------------------------------------------------------------------------


def bench_transfer(tokens: int, rounds: int) -> None:
    layout = KVLayout(LAYERS, tokens, HEADS * DIM * 4)
    nbytes = layout.nbytes
    blocks = -(-tokens // BS)
    cache = torch.randn(LAYERS, 2, blocks + 1, BS, HEADS, DIM)
    table = list(range(1, blocks + 1))
    rows = []

    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(rounds))
    memcpy = nbytes / best / 1e9
    rows.append(("memcpy (one process)", memcpy, 1.0, ""))

    layer = np.random.default_rng(0).integers(0, 255, nbytes // LAYERS, dtype=np.uint8)
    times = []
    for _ in range(rounds + 1):
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        p = ctx.Process(target=_zmq_sink, args=(b, LAYERS), daemon=True)
        p.start()
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.connect(f"tcp://127.0.0.1:{a.recv()}")
        time.sleep(0.2)
        t0 = time.monotonic()
        for _ in range(LAYERS):
            sock.send(layer, copy=False)
        t1 = a.recv()
        times.append(t1 - t0 if times or rounds == 0 else float("inf"))
        sock.close(linger=0)
        p.join(10)
    raw_zmq = nbytes / min(times) / 1e9
    rows.append(("raw ZeroMQ TCP (two processes)", raw_zmq, raw_zmq / memcpy, ""))

    for transport in ("shm", "tcp", "mooncake"):
        mc = None
        if transport == "mooncake":
            try:
                from engine.cluster.transfer_mooncake import MooncakeEndpoint

                mc = MooncakeEndpoint()
            except ValueError as exc:
                print(f"(mooncake skipped: {exc})")
                continue
        rx = RemoteReceiver(transport, arena_mb=max(64, 2 * nbytes >> 20))
        sender = KVSender(cache, BS, mooncake=mc)
        best = float("inf")
        for r in range(rounds + 1):  # round 0 warms up (first-touch page faults)
            rid = f"t{r}"
            offset, n = rx.expect(rid, tokens)
            t = SendTarget(
                rid, rid, rx.address, transport, rx.path, offset, layout,
                peer_address=rx.peer, peer_base=rx.base,
            )  # fmt: skip
            sender.add(t)
            t0 = time.monotonic()
            for i in range(LAYERS):
                sender._send_range(t, i, table, tokens)  # what save_layer does per layer
            sender.finish(rid, m.KVDone(rid, tokens, LAYERS, 0, [{"index": 0, "token": 0}]))
            ok, err, last_piece, _ = rx.result()
            assert ok, err
            if r:
                best = min(best, last_piece - t0)
        sender.close()
        rx.close()
        gbs = nbytes / best / 1e9
        base = memcpy if transport == "shm" else raw_zmq
        target = {"shm": "memcpy, target >= 0.5", "tcp": "raw ZeroMQ, target >= 0.8"}.get(
            transport, "raw ZeroMQ (Mooncake Transfer Engine over TCP)"
        )
        rows.append((f"KV transfer over {transport} (ours)", gbs, gbs / base, target))

    print(f"\n## KV transfer: {tokens} tokens x {LAYERS} layers = {nbytes / 2**20:.1f} MiB")
    print(f"(best of {rounds} rounds after a warm-up; load average {os.getloadavg()[0]:.1f})")
    print(f"{'path':<36} {'GB/s':>8} {'ratio':>8}  vs")
    for name, gbs, ratio, vs in rows:
        print(f"{name:<36} {gbs:>8.2f} {ratio:>8.2f}  {vs}")
    print("(ours includes the gather from paged blocks and xxh3 checksums on both sides)")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- 2. overlap ----------------------------------------------------------------------------------


def bench_overlap(sizes: list[int], threads: int) -> None:
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)
    max_tokens = max(sizes)
    engine = LLMEngine(
        EngineConfig(
            cache=CacheConfig(num_blocks=max_tokens // BS + 64, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_tokens),
        )
    )
    sender = KVSender(engine.cache.kv, engine.kv.block_size)
    engine.connector = engine.scheduler.connector = sender
    arena_mb = (KVLayout(LAYERS, max_tokens, HEADS * DIM * 4).nbytes >> 20) * 2 + 64
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rng = np.random.default_rng(0)
    print(f"\n## Overlap: exposed transfer after the last layer (torch threads {threads})")
    print(
        f"{'tokens':>7} {'transport':>9} {'prefill ms':>11} {'streamed: exposed ms':>21} "
        f"{'not streamed: transfer ms':>26} {'exposed/unoverlapped':>21}"
    )
    for transport in ("shm", "tcp"):
        rx = RemoteReceiver(transport, arena_mb=arena_mb)
        for size in sizes:
            res = {}
            for stream in (True, False):
                rid = f"o{size}{transport}{stream}"
                offset, n = rx.expect(rid, size)
                layout = KVLayout(LAYERS, size, HEADS * DIM * 4)
                prompt = rng.integers(100, 40000, size).tolist()
                engine.add_request(prompt, params, request_id=rid)
                t = SendTarget(rid, rid, rx.address, transport, rx.path, offset, layout, stream)
                sender.add(t)
                t0 = time.monotonic()
                while engine.has_unfinished_requests():
                    engine.step()
                t_end = time.monotonic()
                sent = sender.finish(rid, m.KVDone(rid, size, LAYERS, 0, [{"index": 0}]))
                ok, err, last_piece, _ = rx.result()
                assert ok, err
                if stream:
                    res[stream] = (t_end - t0, max(0.0, last_piece - sent))
                else:
                    res[stream] = (t_end - t0, last_piece - t_end)
            exposed, whole = res[True][1], res[False][1]
            print(
                f"{size:>7} {transport:>9} {res[True][0] * 1e3:>11.0f} {exposed * 1e3:>21.1f} "
                f"{whole * 1e3:>26.1f} {exposed / whole:>21.2f}"
            )
        rx.close()
    sender.close()
    print("(target: exposed <= 0.30 of unoverlapped)")


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


def bench_serving(sizes: list[int], decodes: int, long_prompts: int, long_len: int) -> None:
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
    prompts = {s: rng.integers(100, 40000, s).tolist() for s in sizes}
    results: dict[str, dict] = {}
    torch.set_num_threads(1)
    colocated = AsyncLLM(
        config=EngineConfig(
            cache=CacheConfig(kv_cache_memory_gb=1, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=chunk),
        )
    )
    with Cluster(1, 1, worker_args=worker_args, threads=1) as cluster:
        for name, llm in (("colocated", colocated), ("1P+1D", cluster.router)):

            async def run(llm=llm):
                for s in sizes:  # warm-up: first-forward allocations, connections
                    await _ttft(llm, rng.integers(100, 40000, s).tolist(), one)
                ttft = {s: await _ttft(llm, prompts[s], one) for s in sizes}
                gaps = await _interference(llm, decodes, long_prompts, long_len, rng)
                return ttft, gaps

            results[name] = dict(zip(("ttft", "gaps"), asyncio.run(run())))
    colocated.close()
    print("\n## TTFT (ms), one request at a time; chunks of", chunk, "tokens, 1 torch thread each")
    print(f"{'tokens':>7} {'colocated':>10} {'1P+1D':>8} {'ratio':>7}")
    for s in sizes:
        a, b = results["colocated"]["ttft"][s], results["1P+1D"]["ttft"][s]
        print(f"{s:>7} {a * 1e3:>10.0f} {b * 1e3:>8.0f} {b / a:>7.2f}")
    print(
        f"\n## Interference: {decodes} running decodes, {long_prompts} prompts of {long_len} "
        "tokens arriving; time between tokens (ms)"
    )
    print(f"{'':>10} {'p50':>8} {'p99':>8} {'max':>8} {'n':>6}")
    for name in ("colocated", "1P+1D"):
        g = results[name]["gaps"]
        print(
            f"{name:>10} {_percentile(g, 0.5) * 1e3:>8.1f} {_percentile(g, 0.99) * 1e3:>8.1f} "
            f"{max(g) * 1e3:>8.1f} {len(g):>6}"
        )
    print(f"(load average {os.getloadavg()[0]:.1f}; the processes share this host's cores)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--parts", default="transfer,overlap,serving")
    ap.add_argument("--transfer-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--overlap-sizes", default="512,1024,2048,4096")
    ap.add_argument("--ttft-sizes", default="512,2048")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the prefill")
    ap.add_argument("--decodes", type=int, default=4)
    ap.add_argument("--long-prompts", type=int, default=3)
    ap.add_argument("--long-len", type=int, default=2048)
    ap.add_argument("--trace", action="store_true", help="only the trace replay by policy")
    bench_trace.add_args(ap)
    args = ap.parse_args()
    if args.trace:
        bench_trace.run(args)
        return
    parts = set(args.parts.split(","))
    if "transfer" in parts:
        bench_transfer(args.transfer_tokens, args.rounds)
    if "overlap" in parts:
        bench_overlap([int(x) for x in args.overlap_sizes.split(",")], args.threads)
    if "serving" in parts:
        bench_serving(
            [int(x) for x in args.ttft_sizes.split(",")],
            args.decodes,
            args.long_prompts,
            args.long_len,
        )


if __name__ == "__main__":
    main()
