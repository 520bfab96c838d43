"""The tiered KV pool: trace replay hit rates, tier throughput, TTFT with a pooled prefix.

    .venv/bin/python profiling/bench_pool.py replay     # the Mooncake trace in data/traces/
    .venv/bin/python profiling/bench_pool.py replay --trace FILE --blocks 1000,10000,50000,inf \\
        --policy lru,lfu,length --json
    .venv/bin/python profiling/bench_pool.py throughput [--total-mib 256] [--ssd-dir DIR] \\
        [--service] [--mooncake]

replay (engine/bench/pool_replay.py): feeds the ``hash_ids`` of a trace in Mooncake's format
through the store's eviction policies with a capacity-only index (no model, no data; capacity in
the trace's own blocks, 512 tokens each, the last block of a prompt partial). Per request: the
leading run of its blocks that the cache holds is a hit (as the engine's prefix match), then
every block is accessed or inserted. Token hit rates weight each block by its length
(``input_length``).

throughput: DRAM and SSD tier put/get in GB/s against this machine's memcpy (numpy copy of the
same blocks) and raw disk rates (one file written in block-sized chunks then fsync; read back
with its page cache dropped), all measured in the same run; target >= 50% of each.
``--service``: a real `engine pool serve` process, its client through the shared-memory arena
(against memcpy) and over TCP (against raw ZeroMQ TCP, one block per round trip, measured in the
same run), per block and batched (put_many/get_many_into). ``--mooncake``: a real mooncake_master
and a lender process, MooncakeTier as a pure client (TCP) against the same raw ZeroMQ rates.

    .venv/bin/python profiling/bench_pool.py ttft [--prompt-len 2048] [--dtypes float32,bfloat16] \
        [--kv-cache-dtypes auto,int8]

ttft: a long prompt whose blocks (all but the last) sit in DRAM or on SSD (page cache dropped)
against recomputing it (engine/bench/pool_ttft.py).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from engine.bench import pool_replay, pool_ttft
from engine.ipc.ports import free_port
from engine.kvstore import block_record
from engine.kvstore.block_store import BlockStore
from engine.kvstore.dram_tier import DramTier
from engine.kvstore.namespace import KVNamespace
from engine.kvstore.ssd_tier import SsdTier
from engine.kvstore.tier import Tier

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = 4096


# -- throughput -----------------------------------------------------------------------------------


class Row(NamedTuple):
    what: str
    gbps: float
    baseline: str
    baseline_gbps: float

    @property
    def ratio(self) -> float:
        return self.gbps / self.baseline_gbps


def bench_namespace(block_tokens: int) -> KVNamespace:
    """SmolLM2-135M's KV layout in float32 (30 layers, 3 KV heads, head dim 64): 720 KiB blocks
    of 16 tokens."""
    return KVNamespace("bench", "float32", block_tokens, 30, 3, 64)


def best_rate(nbytes: int, run: Callable[[], None], repeats: int, setup=None) -> float:
    """GB/s of the fastest of ``repeats`` runs (setup, untimed, before each)."""
    best = math.inf
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def tier_rows(
    tier: Tier,
    label: str,
    keys: list[bytes],
    src: np.ndarray,
    dst: np.ndarray,
    repeats: int,
    before_get: Callable[[], None] | None = None,
    after_put: Callable[[], None] | None = None,
    before_put: Callable[[], None] | None = None,
) -> tuple[float, float]:
    """put then get_into GB/s of any tier over the same blocks (rows of src/dst). Reusable for
    the remote tiers (pool service, Mooncake). Before each put round: ``before_put``, by default
    the tier is cleared."""
    nbytes = src.nbytes

    def put_all() -> None:
        for i, k in enumerate(keys):
            if not tier.put(k, memoryview(src[i])).stored:
                raise RuntimeError(f"{label}: put of block {i} failed: {tier.stats()}")
        if after_put is not None:
            after_put()

    def get_all() -> None:
        for i, k in enumerate(keys):
            if not tier.get_into(k, memoryview(dst[i])):
                raise RuntimeError(f"{label}: get of block {i} missed: {tier.stats()}")

    put = best_rate(nbytes, put_all, repeats, setup=before_put or tier.clear)
    get = best_rate(nbytes, get_all, repeats, setup=before_get)
    if not np.array_equal(src, dst):
        raise RuntimeError(f"{label}: blocks read back differ from those written")
    return put, get


def ssd_new_files_rate(directory: str, ns, keys, src: np.ndarray, repeats: int) -> float:
    """Puts into an empty SSD tier (a new directory each round: every put creates a file), then
    syncfs: the cold start, before evictions recycle files."""
    rounds = iter(range(repeats))
    tiers: list[SsdTier] = []

    def setup() -> None:
        for t in tiers:
            t.clear()
            t.close()
        tiers[:] = [SsdTier(f"{directory}/fresh{next(rounds)}", src.nbytes * 2, ns)]
        syncfs(directory)

    def put_all() -> None:
        for i, k in enumerate(keys):
            if not tiers[0].put(k, memoryview(src[i])).stored:
                raise RuntimeError(f"ssd: put of block {i} failed: {tiers[0].stats()}")
        syncfs(directory)

    try:
        return best_rate(src.nbytes, put_all, repeats, setup=setup)
    finally:
        for t in tiers:
            t.clear()
            t.close()


def store_get_many(tier: Tier, ns: KVNamespace, keys: list[bytes], dst: np.ndarray) -> None:
    """BlockStore.get_many over one tier: reads with a window of SSD prefetches ahead."""
    served = BlockStore([tier], ns).get_many(keys, [memoryview(row) for row in dst])
    if served.count(tier.name) != len(keys):
        raise RuntimeError(f"{tier.name}: get_many missed: {tier.stats()}")


def memcpy_rate(src: np.ndarray, dst: np.ndarray, repeats: int) -> float:
    def copy() -> None:
        for i in range(len(src)):
            np.copyto(dst[i], src[i])

    return best_rate(src.nbytes, copy, repeats)


def disk_rates(directory: str, src: np.ndarray, repeats: int) -> tuple[float, float]:
    """dd-like: write the blocks to one file in block-sized chunks + fsync; read them back in
    block-sized chunks with the file's page cache dropped."""
    path = os.path.join(directory, "raw-disk-baseline")
    buf = np.empty_like(src[0])

    def write() -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for row in src:
                os.write(fd, memoryview(row))
            os.fsync(fd)
        finally:
            os.close(fd)

    def drop() -> None:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            for _ in range(len(src)):
                f.readinto(memoryview(buf))

    try:
        w = best_rate(src.nbytes, write, repeats)
        r = best_rate(src.nbytes, read, repeats, setup=drop)
    finally:
        os.unlink(path)
    return w, r


def syncfs(directory: str) -> None:
    """Flush the filesystem holding ``directory`` (syncfs(2) where libc has it)."""
    import ctypes

    fd = os.open(directory, os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if getattr(libc, "syncfs", None) is None or libc.syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def page_aligned(rows: int, cols: int) -> np.ndarray:
    """A zeroed uint8 array starting on a page boundary. memcpy's speed depends on the source's
    and destination's offsets within a page (a destination 16 bytes past a page-aligned source
    runs at half speed here: 4K aliasing); the arena's slots start on page boundaries, so the
    blocks and the baseline copies use page-aligned buffers too."""
    raw = np.zeros(rows * cols + PAGE, dtype=np.uint8)
    skip = -raw.ctypes.data % PAGE
    return raw[skip : skip + rows * cols].reshape(rows, cols)


def cmd_throughput(args: argparse.Namespace) -> None:
    ns = bench_namespace(args.block_tokens)
    n = max(1, (args.total_mib << 20) // ns.block_bytes)
    src = page_aligned(n, ns.block_bytes)
    src[:] = np.random.default_rng(0).integers(0, 255, size=src.shape, dtype=np.uint8)
    dst = page_aligned(n, ns.block_bytes)
    keys = [i.to_bytes(8, "little") * 4 for i in range(n)]
    nbytes = src.nbytes
    print(
        f"{n} blocks of {ns.block_bytes / 1024:.0f} KiB ({nbytes / 2**20:.0f} MiB), "
        f"best of {args.repeats}; SSD directory {args.ssd_dir or tempfile.gettempdir()}"
    )
    mem = memcpy_rate(src, dst, args.repeats)
    rows: list[Row] = []

    dram = DramTier(nbytes, ns)
    try:
        put, get = tier_rows(dram, "dram", keys, src, dst, args.repeats)
    finally:
        dram.close()
    rows += [Row("dram put", put, "memcpy", mem), Row("dram get", get, "memcpy", mem)]

    with tempfile.TemporaryDirectory(dir=args.ssd_dir) as d:
        disk_w, disk_r = disk_rates(d, src, args.repeats)
        fresh = ssd_new_files_rate(d, ns, keys, src, args.repeats)
        ssd = SsdTier(d, n * (block_record.HEADER_SIZE + ns.block_bytes), ns)
        try:
            drop_all = lambda: [ssd.drop_page_cache(k) for k in keys]  # noqa: E731
            fillers = [b"filler" + k[6:] for k in keys]

            def fill() -> None:  # a full tier: every timed put evicts a filler (steady state)
                ssd.clear()
                for i, k in enumerate(fillers):
                    ssd.put(k, memoryview(src[i]))
                syncfs(d)

            put, get = tier_rows(
                ssd,
                "ssd",
                keys,
                src,
                dst,
                args.repeats,
                before_get=drop_all,
                after_put=lambda: syncfs(d),
                before_put=fill,
            )
            ahead = best_rate(
                nbytes, lambda: store_get_many(ssd, ns, keys, dst), args.repeats, setup=drop_all
            )
            _, warm = tier_rows(ssd, "ssd", keys, src, dst, 1)
        finally:
            ssd.close()
    rows += [
        Row("ssd put, new files", fresh, "disk write+fsync", disk_w),
        Row("ssd put, full (+syncfs)", put, "disk write+fsync", disk_w),
        Row("ssd get (cold)", get, "disk read (cold)", disk_r),
        Row("ssd get_many (cold)", ahead, "disk read (cold)", disk_r),
        Row("ssd get (page cache)", warm, "memcpy", mem),
    ]

    if args.service or args.mooncake:
        zmq_put, zmq_get = zmq_tcp_rates(src, args.repeats)
        rows += [
            Row("raw zmq tcp put", zmq_put, "memcpy", mem),
            Row("raw zmq tcp get", zmq_get, "memcpy", mem),
        ]
    if args.service:
        rows += service_rows(ns, keys, src, dst, args.repeats, mem, zmq_put, zmq_get)
    if args.mooncake:
        rows += mooncake_rows(ns, keys, src, dst, args.repeats, zmq_put, zmq_get)

    print(f"{'tier op':24s} {'GB/s':>7s}  {'baseline':18s} {'GB/s':>7s} {'ratio':>6s}  target 50%")
    for r in rows:
        ok = "yes" if r.ratio >= 0.5 else "NO"
        print(
            f"{r.what:24s} {r.gbps:7.2f}  {r.baseline:18s} {r.baseline_gbps:7.2f} "
            f"{r.ratio:6.0%}  {ok}"
        )


# -- remote tiers: the pool service and the Mooncake Store ----------------------------------------

# A ROUTER in its own process that acks each frame sent to it (put) or answers each request with
# a block-sized frame (get): the same one-block-per-round-trip pattern as the tiers, with nothing
# but ZeroMQ on the path, so it is the ceiling of any ZeroMQ-over-TCP transport here.
_ZMQ_ECHO = """
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
block = bytes(int(sys.argv[1]))
while True:
    peer, *frames = s.recv_multipart(copy=False)
    if frames[0].bytes == b"stop":
        break
    s.send_multipart([peer, block if frames[0].bytes == b"get" else b"ok"], copy=False)
"""


def _spawn(cmd: list[str], ready: Callable[[str], bool], timeout: float = 120.0):
    """Start ``cmd`` and wait (bounded) for a stdout line that ``ready`` accepts."""
    import selectors
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_REPO)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True
    )
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if sel.select(0.2):
                line = proc.stdout.readline()
                if ready(line):
                    return proc, line
        raise RuntimeError(f"{cmd[0]} did not start (rc={proc.poll()})")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        sel.close()


def _stop(proc) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def _wait_port(port: int, timeout: float = 30.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on port {port} after {timeout}s") from None
            time.sleep(0.1)


def zmq_tcp_rates(src: np.ndarray, repeats: int) -> tuple[float, float]:
    """Raw ZeroMQ DEALER->ROUTER over TCP loopback, one block per round trip: put, get GB/s."""
    import zmq

    proc, line = _spawn(
        [sys.executable, "-c", _ZMQ_ECHO, str(src.shape[1])], lambda ln: ln.strip().isdigit()
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{line.strip()}")
    buf = np.empty_like(src[0])

    def put() -> None:
        for row in src:
            sock.send(memoryview(row), copy=False)
            sock.recv()

    def get() -> None:
        for _ in range(len(src)):
            sock.send(b"get")
            frame = sock.recv(copy=False)
            buf[:] = np.frombuffer(frame.buffer, dtype=np.uint8)  # into the caller's buffer

    try:
        return best_rate(src.nbytes, put, repeats), best_rate(src.nbytes, get, repeats)
    finally:
        sock.send(b"stop")
        sock.close(linger=100)
        ctx.term()
        proc.wait(timeout=10)


def batch_rates(tier, label: str, keys, src, dst, repeats: int) -> tuple[float, float]:
    """put_many then get_many_into GB/s (the remote tiers' batched calls: one round trip per
    batch instead of per block)."""
    srcs, dsts = list(src), list(dst)
    dst[:] = 0

    def put() -> None:
        if not all(tier.put_many(keys, srcs, list(range(len(keys))))):
            raise RuntimeError(f"{label}: put_many failed: {tier.stats()}")

    def get() -> None:
        if tier.get_many_into(keys, dsts) != len(keys):
            raise RuntimeError(f"{label}: get_many_into missed: {tier.stats()}")

    put_rate = best_rate(src.nbytes, put, repeats, setup=tier.clear)
    get_rate = best_rate(src.nbytes, get, repeats)
    if not np.array_equal(src, dst):
        raise RuntimeError(f"{label}: blocks read back differ from those written")
    return put_rate, get_rate


def service_rows(ns, keys, src, dst, repeats, mem, zmq_put, zmq_get) -> list[Row]:
    """`engine pool serve` in its own process; PoolClientTier through the shared-memory arena
    (against memcpy) and over TCP (against raw ZeroMQ TCP)."""
    from engine.kvstore.service_tier import PoolClientTier

    port = free_port()
    dram = f"{(src.nbytes >> 20) + 64}MiB"
    proc, _ = _spawn(
        [
            sys.executable,
            "-m",
            "engine.cli.main",
            "pool",
            "serve",
            "--dram",
            dram,
            "--port",
            str(port),
        ],
        lambda ln: ln.startswith("pool service ready"),
    )
    rows = []
    try:
        for mode in ("shm", "tcp"):
            tier = PoolClientTier(f"tcp://127.0.0.1:{port}", ns, force_tcp=mode == "tcp")
            try:
                put, get = tier_rows(tier, f"pool {mode}", keys, src, dst, repeats)
                if tier.same_host != (mode == "shm"):
                    raise RuntimeError(f"pool {mode}: same_host is {tier.same_host}")
                put_b, get_b = batch_rates(tier, f"pool {mode}", keys, src, dst, repeats)
            finally:
                tier.clear()
                tier.close()
            if mode == "shm":
                base = [("memcpy", mem)] * 2
            else:
                base = [("raw zmq tcp put", zmq_put), ("raw zmq tcp get", zmq_get)]
            rows += [
                Row(f"pool put ({mode})", put, *base[0]),
                Row(f"pool get ({mode})", get, *base[1]),
                Row(f"pool put_many ({mode})", put_b, *base[0]),
                Row(f"pool get_many ({mode})", get_b, *base[1]),
            ]
    finally:
        _stop(proc)
    return rows


def mooncake_rows(ns, keys, src, dst, repeats, zmq_put, zmq_get) -> list[Row]:
    """A real mooncake_master and a process lending it memory (`engine pool serve --mooncake`);
    MooncakeTier as a pure client (TCP transport) against raw ZeroMQ TCP."""
    import shutil
    import subprocess

    from engine.kvstore.mooncake_tier import MooncakeTier
    from engine.pool_spec import parse_pool_spec

    master_bin = shutil.which("mooncake_master") or os.path.join(
        os.path.dirname(sys.executable), "mooncake_master"
    )
    rpc, http, metrics = free_port(), free_port(), free_port()
    master = subprocess.Popen(
        [
            master_bin,
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_port={http}",
            "-http_metadata_server_host=127.0.0.1",
            f"-rpc_port={rpc}",
            f"-metrics_port={metrics}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    lender = None
    url = f"mooncake://127.0.0.1:{rpc}?metadata=http://127.0.0.1:{http}/metadata"
    try:
        for port in (rpc, http):  # the master binds its ports
            _wait_port(port)
        segment = f"{2 * (src.nbytes >> 20) + 64}MiB"
        lender, _ = _spawn(
            [
                sys.executable,
                "-m",
                "engine.cli.main",
                "pool",
                "serve",
                "--dram",
                "1MiB",
                "--port",
                str(free_port()),
                "--mooncake",
                f"{url}&segment={segment}",
            ],
            lambda ln: ln.startswith("pool service ready"),
        )
        tier = MooncakeTier(parse_pool_spec(url).remote, ns)
        try:
            put, get = tier_rows(tier, "mooncake", keys, src, dst, repeats)
            put_b, get_b = batch_rates(tier, "mooncake", keys, src, dst, repeats)
        finally:
            tier.clear()
            tier.close()
    finally:
        _stop(lender)
        _stop(master)
    return [
        Row("mooncake put (tcp)", put, "raw zmq tcp put", zmq_put),
        Row("mooncake get (tcp)", get, "raw zmq tcp get", zmq_get),
        Row("mooncake put_many (tcp)", put_b, "raw zmq tcp put", zmq_put),
        Row("mooncake get_many (tcp)", get_b, "raw zmq tcp get", zmq_get),
    ]


# -- ttft (the lead's: TTFT of a 2,048-token prompt from DRAM, SSD and recompute) ---------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    pool_replay.add_parser(sub)

    tp = sub.add_parser("throughput", help="tier get/put GB/s against memcpy and the disk")
    tp.add_argument("--total-mib", type=int, default=256)
    tp.add_argument("--block-tokens", type=int, default=16)
    tp.add_argument("--repeats", type=int, default=3)
    tp.add_argument("--ssd-dir", default=None, help="a directory on the disk to measure")
    tp.add_argument("--service", action="store_true", help="also a pool service (shm and tcp)")
    tp.add_argument("--mooncake", action="store_true", help="also the Mooncake Store backend")
    tp.set_defaults(func=cmd_throughput)

    pool_ttft.add_parser(sub)

    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
