"""What a well-behaved client sees while the server is attacked (issue 12's abuse cases).

A steady stream of small streamed requests (the probe) runs alone, then during each attack:

- ``slowloris``: N connections that send a request head and then a body byte every few seconds
  (and reconnect when closed);
- ``large-prompt``: one client sending 15 MB prompts back to back;
- ``flood``: waves of many concurrent short requests (more than the admission queue);
- ``rpc-never-reads`` (against ``engine rpc``): a peer that starts streams and never reads.

For each it prints the probe's TTFT p50/p99 against the quiet run of the same server in the same
run, the probe's failures, every status the attackers got, and the server's peak RSS. Target:
probe TTFT p99 within 2x of quiet, zero 5xx, memory bounded.

    .venv/bin/python profiling/bench_abuse.py                       # all attacks, ~4 minutes
    .venv/bin/python profiling/bench_abuse.py --attacks slowloris --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import msgpack
import numpy as np
import psutil
import zmq

from engine.ipc.ports import free_port
from engine.server.rpc_client import AsyncRPCClient

ATTACKS = ("slowloris", "large-prompt", "flood", "rpc-never-reads")
PROBE_ADDRESS = "127.0.0.2"
PROBE_BODY = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0.0}


@dataclass
class Phase:
    name: str
    ttfts: list[float] = field(default_factory=list)
    probe_errors: collections.Counter = field(default_factory=collections.Counter)
    attacker: collections.Counter = field(default_factory=collections.Counter)
    peak_rss: int = 0


def launch(kind: str, engine_args: list[str]) -> tuple[subprocess.Popen, str]:
    if kind == "serve":
        port = free_port()
        target, extra = f"http://127.0.0.1:{port}", ["--port", str(port)]
    else:
        target = f"tcp://127.0.0.1:{free_port()}"
        extra = ["--address", target]
    cmd = [sys.executable, "-m", "engine", kind, *extra, *engine_args, "--log-level", "error"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine {kind} exited with {proc.returncode}")
        try:
            if kind == "serve":
                if httpx.get(target + "/health", timeout=1).status_code == 200:
                    return proc, target
            else:
                from engine.server.rpc_client import RPCClient

                with RPCClient(target, timeout=1) as c:
                    c.health()
                    return proc, target
        except Exception:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"engine {kind} did not become healthy")


class RSSWatch(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.proc, self.peak, self.stop = psutil.Process(pid), 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            self.stop.wait(0.2)


# -- the probe -----------------------------------------------------------------------------------


async def http_probe(url: str, phase: Phase, duration: float, rate: float) -> None:
    async def one(client: httpx.AsyncClient) -> None:
        t0 = time.perf_counter()
        try:
            body = PROBE_BODY | {"stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    phase.probe_errors[r.status_code] += 1
                    return
                first = True
                async for line in r.aiter_lines():
                    if first and line.startswith("data: {"):
                        phase.ttfts.append(time.perf_counter() - t0)
                        first = False
        except httpx.HTTPError as exc:
            phase.probe_errors[type(exc).__name__] += 1

    # From another loopback address: the server sees another client than the attackers (who
    # connect from 127.0.0.1), as it would on a network.
    transport = httpx.AsyncHTTPTransport(local_address=PROBE_ADDRESS)
    async with httpx.AsyncClient(base_url=url, timeout=60, transport=transport) as client:
        tasks = []
        end = time.monotonic() + duration
        while time.monotonic() < end:
            tasks.append(asyncio.ensure_future(one(client)))
            await asyncio.sleep(1.0 / rate)
        await asyncio.gather(*tasks)


async def rpc_probe(address: str, phase: Phase, duration: float, rate: float) -> None:
    async with AsyncRPCClient(address, timeout=60) as client:

        async def one() -> None:
            t0, first = time.perf_counter(), True
            try:
                async for _ in client.stream(PROBE_BODY["prompt"], max_tokens=2, temperature=0.0):
                    if first:
                        phase.ttfts.append(time.perf_counter() - t0)
                        first = False
            except Exception as exc:  # an RPCError has a code
                phase.probe_errors[getattr(exc, "code", type(exc).__name__)] += 1

        tasks = []
        end = time.monotonic() + duration
        while time.monotonic() < end:
            tasks.append(asyncio.ensure_future(one()))
            await asyncio.sleep(1.0 / rate)
        await asyncio.gather(*tasks)


# -- the attacks ---------------------------------------------------------------------------------

HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100000\r\n\r\n"
)


async def slowloris(url: str, phase: Phase, stop: asyncio.Event, args: dict) -> None:
    n = args["slow_connections"]
    host, port = url.removeprefix("http://").split(":")

    async def one(i: int) -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(HEAD + b"{")
                await writer.drain()
                while not stop.is_set():
                    try:
                        data = await asyncio.wait_for(reader.read(200), 3.0)
                    except asyncio.TimeoutError:
                        writer.write(b" ")  # one more byte every 3 s
                        await writer.drain()
                        continue
                    phase.attacker[data.split(b" ")[1].decode() if data else "closed"] += 1
                    break
                writer.close()
            except OSError as exc:
                phase.attacker[type(exc).__name__] += 1
                await asyncio.sleep(0.5)

    await asyncio.gather(*(one(i) for i in range(n)))


async def large_prompt(url: str, phase: Phase, stop: asyncio.Event, args: dict) -> None:
    body = json.dumps({"prompt": "x" * (15 * 1024 * 1024), "max_tokens": 2}).encode()
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while not stop.is_set():
            r = await client.post("/v1/completions", content=body, headers=headers)
            phase.attacker[r.status_code] += 1


async def flood(url: str, phase: Phase, stop: asyncio.Event, args: dict) -> None:
    n = args["flood"]
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def one(i: int) -> None:
            body = {"prompt": f"Flood {i}:", "max_tokens": 1}
            try:
                r = await client.post("/v1/completions", json=body)
                kind = "json" if r.headers.get("content-type") == "application/json" else "text"
                phase.attacker[f"{r.status_code} {kind}"] += 1
            except httpx.HTTPError as exc:
                phase.attacker[type(exc).__name__] += 1

        while not stop.is_set():
            await asyncio.gather(*(one(i) for i in range(n)))
            await asyncio.sleep(1.0)


async def rpc_never_reads(address: str, phase: Phase, stop: asyncio.Event, args: dict) -> None:
    n = args["rpc_streams"]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(address)
    try:
        for i in range(n):
            params = {"max_tokens": 1500, "ignore_eos": True}
            msg = {"id": "i" * 250 + str(i), "op": "stream", "prompt": "Count:", "params": params}
            msg["request_id"] = "r" * 250 + str(i)
            sock.send(msgpack.packb(msg))
            phase.attacker["streams started"] += 1
        await stop.wait()  # never reads
    finally:
        sock.close()


_ATTACKS = {
    "slowloris": slowloris,
    "large-prompt": large_prompt,
    "flood": flood,
    "rpc-never-reads": rpc_never_reads,
}

# -- running -------------------------------------------------------------------------------------


def _attack_process(name: str, target: str, args: dict, queue) -> None:
    """The attack in a child process: its own GIL, so that its work (thousands of sockets,
    15 MB bodies) does not delay the probe's measurements in this process."""
    phase = Phase(name)
    if args.get("nice"):
        os.nice(args["nice"])

    async def main() -> None:
        stop = asyncio.Event()
        attack = _ATTACKS[name]
        task = asyncio.ensure_future(attack(target, phase, stop, args))
        await asyncio.sleep(args["seconds"])
        stop.set()
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(main())
    queue.put(dict(phase.attacker))


async def run_phase(name, target, probe, args) -> Phase:
    phase = Phase(name)
    proc = queue = None
    if name != "quiet":
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        params = {
            "seconds": args.warmup + args.duration,
            "slow_connections": args.slow_connections,
            "flood": args.flood,
            "rpc_streams": args.rpc_streams,
            "nice": args.attacker_nice,
        }
        proc = ctx.Process(target=_attack_process, args=(name, target, params, queue))
        proc.start()
        await asyncio.sleep(args.warmup)  # let the attack take hold first
    await probe(target, phase, args.duration, args.rate)
    if proc is not None:
        phase.attacker.update(await asyncio.to_thread(queue.get, True, 120))
        proc.join(30)
    return phase


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1000 if xs else float("nan")


def report(rows: list[tuple[Phase, Phase]]) -> None:
    print(
        "\n| attack | probe TTFT p50 quiet -> attack (ms) | p99 quiet -> attack (ms) | "
        "p99 ratio | probe failures | probe 5xx | attackers got | server peak RSS |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for quiet, phase in rows:
        ratio = pct(phase.ttfts, 99) / pct(quiet.ttfts, 99)
        five = sum(v for k, v in phase.probe_errors.items() if str(k).startswith("5"))
        five += sum(v for k, v in phase.attacker.items() if str(k).startswith("5"))
        got = ", ".join(f"{k}: {v}" for k, v in phase.attacker.most_common(5))
        fails = dict(phase.probe_errors) or 0
        print(
            f"| {phase.name} | {pct(quiet.ttfts, 50):.0f} -> {pct(phase.ttfts, 50):.0f} | "
            f"{pct(quiet.ttfts, 99):.0f} -> {pct(phase.ttfts, 99):.0f} | {ratio:.2f}x | "
            f"{fails} of {len(phase.ttfts) + phase.probe_errors.total()} | {five} | {got} | "
            f"{phase.peak_rss / 1024**3:.2f} GiB |"
        )


async def bench(kind: str, target: str, pid: int, attacks: list[str], args) -> list:
    probe = http_probe if kind == "serve" else rpc_probe
    quiet = await run_phase("quiet", target, probe, args)
    rows = []
    for name in attacks:
        watch = RSSWatch(pid)
        watch.start()
        phase = await run_phase(name, target, probe, args)
        watch.stop.set()
        watch.join()
        phase.peak_rss = watch.peak
        rows.append((quiet, phase))
        await asyncio.sleep(args.cooldown)  # let aborted work drain before the next
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS)
    p.add_argument("--duration", type=float, default=20.0, help="probe seconds per phase")
    p.add_argument("--warmup", type=float, default=3.0, help="attack seconds before the probe")
    p.add_argument("--cooldown", type=float, default=5.0)
    p.add_argument("--rate", type=float, default=2.0, help="probe requests per second")
    p.add_argument("--slow-connections", type=int, default=2047)
    p.add_argument("--flood", type=int, default=2300, help="concurrent requests per wave")
    p.add_argument("--rpc-streams", type=int, default=30)
    p.add_argument(
        "--attacker-nice",
        type=int,
        default=0,
        help="run the attack process at this nice level (a remote attacker's CPU is not the "
        "server's; on a 2-core box the attacker's own work otherwise competes with the server)",
    )
    p.add_argument(
        "--engine-args",
        default="--model default --max-model-len 2048",
        help="arguments for engine serve / engine rpc",
    )
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # thousands of sockets
    engine_args = args.engine_args.split()
    rows = []
    http = [a for a in args.attacks if a != "rpc-never-reads"]
    for kind, attacks in (("serve", http), ("rpc", [a for a in args.attacks if a not in http])):
        if not attacks:
            continue
        proc, target = launch(kind, engine_args)
        try:
            rows += asyncio.run(bench(kind, target, proc.pid, attacks, args))
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    report(rows)


if __name__ == "__main__":
    main()
