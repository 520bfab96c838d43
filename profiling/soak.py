"""Soak: thousands of requests through the HTTP server in front of a cluster (``engine cluster``,
real worker processes), with client aborts and disconnects mixed in, for a long time. Reports
memory over time (every process of the cluster), latency percentiles per window and their drift
(last window against the first, measured in the same run), and KV blocks left held once idle.
Target: no leak, no drift.

    .venv/bin/python profiling/soak.py --duration 600 --plot soak.png --save-result soak.json

Mix (per request, at random): ``--abort-frac`` stream and close the connection after the first
chunk (an abort), ``--disconnect-frac`` send and hang up before the answer (a disconnect), the
rest complete (greedy completions of prompts that share a prefix, so prefix caching is exercised).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import psutil

from engine.ipc.ports import free_port

REPO = Path(__file__).resolve().parents[1]
PREFIXES = [
    "You answer questions about astronomy briefly and precisely. ",
    "You are a helpful cooking assistant who gives one-line tips. ",
    "You are a travel guide for small European towns; answer in one sentence. ",
]
TOPICS = ["the Moon", "Mars", "bread", "rice", "Bruges", "Hallstatt", "comets", "soup", "tides"]


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.rng = random.Random(args.seed)
        self.lock = threading.Lock()
        self.samples: list[dict] = []  # (t, kind, latency, status)
        self.memory: list[dict] = []  # t -> {process: rss}
        self.stop = threading.Event()
        self.t0 = 0.0
        self.proc: subprocess.Popen | None = None

    # -- the cluster -------------------------------------------------------------------------

    def start(self) -> None:
        cmd = [sys.executable, "-m", "engine.cli.main", "cluster", "--prefill", "1",
               "--decode", "1", "--port", str(self.port), "--model", "default", "--dtype",
               self.args.dtype, "--max-model-len", "1024", "--kv-cache-memory-gb", "0.25",
               "--threads", "1", "--log-level", "warning", *self.args.cluster_args]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        self.log = open(self.args.log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine cluster exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError("the cluster did not become healthy")

    def processes(self) -> dict[str, psutil.Process]:
        root = psutil.Process(self.proc.pid)
        out = {"router+http": root}
        for child in root.children(recursive=True):
            try:
                cmd = child.cmdline()
            except psutil.Error:
                continue
            if "--role" in cmd:
                out[cmd[cmd.index("--role") + 1]] = child
            elif "pool" in cmd:
                out["pool"] = child
        return out

    def close(self) -> int:
        rc = -1
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait(30)
        self.log.close()
        return rc

    # -- load --------------------------------------------------------------------------------

    def prompt(self, rng: random.Random) -> str:
        return f"{rng.choice(PREFIXES)}Tell me one fact about {rng.choice(TOPICS)}."

    def one(self, client: httpx.Client, rng: random.Random) -> None:
        a = self.args
        x = rng.random()
        body = {"model": "default", "prompt": self.prompt(rng), "temperature": 0,
                "max_tokens": rng.randint(4, a.max_tokens)}  # fmt: skip
        t = time.monotonic()
        status = 0
        if x < a.abort_frac:
            kind = "abort"
            try:
                with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    status = r.status_code
                    for _ in r.iter_lines():
                        break  # the first chunk, then close: the server aborts the request
            except httpx.HTTPError:
                status = -1
        elif x < a.abort_frac + a.disconnect_frac:
            kind = "disconnect"
            try:
                client.post("/v1/completions", json=body, timeout=rng.uniform(0.01, 0.3))
                status = 200
            except httpx.TimeoutException:
                status = 0  # hung up before the answer, as intended
            except httpx.HTTPError:
                status = -1
        else:
            kind = "complete"
            try:
                r = client.post("/v1/completions", json=body, timeout=a.deadline)
                status = r.status_code
            except httpx.HTTPError:
                status = -1
        with self.lock:
            self.samples.append({"t": t - self.t0, "kind": kind,
                                 "latency": time.monotonic() - t, "status": status})  # fmt: skip

    def client_loop(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url, timeout=self.args.deadline) as client:
            while not self.stop.is_set():
                self.one(client, rng)

    def memory_loop(self) -> None:
        while not self.stop.wait(self.args.sample_every):
            row = {"t": time.monotonic() - self.t0}
            for name, p in self.processes().items():
                try:
                    row[name] = p.memory_info().rss
                except psutil.Error:
                    pass
            self.memory.append(row)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith("engine:") and " " in line and "{" not in line.split(" ")[0]:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def run(self) -> dict:
        a = self.args
        self.start()
        self.t0 = time.monotonic()
        threads = [threading.Thread(target=self.client_loop, args=(a.seed * 1000 + i,),
                                    daemon=True) for i in range(a.concurrency)]  # fmt: skip
        mem = threading.Thread(target=self.memory_loop, daemon=True)
        for t in [*threads, mem]:
            t.start()
        while time.monotonic() - self.t0 < a.duration:
            time.sleep(1)
            if self.proc.poll() is not None:
                raise RuntimeError("the cluster died during the soak")
        self.stop.set()
        for t in threads:
            t.join(a.deadline + 10)
        mem.join(10)
        idle = self.wait_idle()
        return {"idle": idle}

    def wait_idle(self, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = {k: m.get(k, 0.0) for k in ("engine:num_requests_running",
                    "engine:num_requests_waiting", "engine:kv_cache_usage_perc")}  # fmt: skip
            if not any(busy.values()) or time.monotonic() > deadline:
                return busy
            time.sleep(1)


def windows(samples: list[dict], n: int, duration: float) -> list[dict]:
    out = []
    width = duration / n
    for i in range(n):
        lat = [s["latency"] for s in samples if s["kind"] == "complete" and s["status"] == 200
               and i * width <= s["t"] < (i + 1) * width]  # fmt: skip
        out.append({"start": i * width, "n": len(lat),
                    "p50": float(np.percentile(lat, 50)) if lat else float("nan"),
                    "p99": float(np.percentile(lat, 99)) if lat else float("nan")})  # fmt: skip
    return out


def memory_drift(memory: list[dict]) -> dict[str, dict]:
    """Per process: RSS at the start and end of the run (median of the first and last tenth),
    and the slope over the second half (MiB per minute)."""
    out = {}
    names = sorted({k for row in memory for k in row if k != "t"})
    for name in names:
        pts = [(row["t"], row[name] / 2**20) for row in memory if name in row]
        if len(pts) < 10:
            continue
        k = max(1, len(pts) // 10)
        first = float(np.median([v for _, v in pts[:k]]))
        last = float(np.median([v for _, v in pts[-k:]]))
        half = pts[len(pts) // 2 :]
        slope = float(np.polyfit([t for t, _ in half], [v for _, v in half], 1)[0]) * 60
        out[name] = {"first_mib": round(first, 1), "last_mib": round(last, 1),
                     "peak_mib": round(max(v for _, v in pts), 1),
                     "slope_mib_per_min_2nd_half": round(slope, 2)}  # fmt: skip
    return out


def plot(path: str, soak: Soak, wins: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    names = sorted({k for row in soak.memory for k in row if k != "t"})
    for name in names:
        pts = [(row["t"] / 60, row[name] / 2**20) for row in soak.memory if name in row]
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], label=name)
    ax1.set_ylabel("RSS (MiB)")
    ax1.legend(loc="upper left", fontsize=8)
    ax1.set_title("Soak: memory of every cluster process, and latency of completed requests")
    xs = [(w["start"] + 0.5 * (wins[1]["start"] if len(wins) > 1 else 0)) / 60 for w in wins]
    ax2.plot(xs, [w["p50"] for w in wins], marker="o", label="p50")
    ax2.plot(xs, [w["p99"] for w in wins], marker="o", label="p99")
    ax2.set_ylabel("e2e latency (s)")
    ax2.set_xlabel("minutes")
    ax2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--abort-frac", type=float, default=0.1)
    ap.add_argument("--disconnect-frac", type=float, default=0.1)
    ap.add_argument("--deadline", type=float, default=120.0, help="per request, seconds")
    ap.add_argument("--windows", type=int, default=10)
    ap.add_argument("--sample-every", type=float, default=2.0, help="memory sampling, seconds")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default="/tmp/soak-cluster.log")
    ap.add_argument("--plot", default=None, help="write the figure here (PNG)")
    ap.add_argument("--save-result", default=None, help="write the figures here (JSON)")
    ap.add_argument("--record-dir", default=None, help="write a reliability record here")
    ap.add_argument("cluster_args", nargs="*", help="more `engine cluster` options (after --)")
    args = ap.parse_args()

    soak = Soak(args)
    t0 = time.monotonic()
    try:
        result = soak.run()
    finally:
        rc = soak.close()
    wins = windows(soak.samples, args.windows, args.duration)
    kinds = Counter((s["kind"], s["status"]) for s in soak.samples)
    complete = [s for s in soak.samples if s["kind"] == "complete"]
    ok = sum(s["status"] == 200 for s in complete)
    first = next((w for w in wins if w["n"]), None)
    last = next((w for w in reversed(wins) if w["n"]), None)
    drift = {q: round(last[q] / first[q], 2) for q in ("p50", "p99")} if first and last else {}
    mem = memory_drift(soak.memory)
    summary = {
        "requests": len(soak.samples),
        "by_kind_status": {f"{k}:{s}": n for (k, s), n in sorted(kinds.items())},
        "completed_ok": ok,
        "completed_not_ok": len(complete) - ok,
        "windows": wins,
        "latency_drift_last_over_first": drift,
        "memory": mem,
        "idle_after": result["idle"],
        "leaked": {k: v for k, v in result["idle"].items() if v},
        "cluster_exit_code": rc,
        "duration_s": args.duration,
    }
    rate = summary["requests"] / args.duration
    print(f"\nsoak: {summary['requests']} requests in {args.duration:.0f} s ({rate:.1f}/s), "
          f"concurrency {args.concurrency}")  # fmt: skip
    print(f"{'kind:status':<22} {'count':>7}")
    for k, n in summary["by_kind_status"].items():
        print(f"{k:<22} {n:>7}")
    print(f"\n{'window':>7} {'start s':>8} {'n':>6} {'p50 s':>8} {'p99 s':>8}")
    for i, w in enumerate(wins):
        print(f"{i:>7} {w['start']:>8.0f} {w['n']:>6} {w['p50']:>8.3f} {w['p99']:>8.3f}")
    print(f"\nlatency drift (last window / first): {drift}")
    print(f"\n{'process':<12} {'first MiB':>10} {'last MiB':>10} {'peak MiB':>10} {'MiB/min':>9}")
    for name, m in mem.items():
        print(f"{name:<12} {m['first_mib']:>10} {m['last_mib']:>10} {m['peak_mib']:>10} "
              f"{m['slope_mib_per_min_2nd_half']:>9}")  # fmt: skip
    print(f"\nafter the load, idle: {result['idle']} (leaked: {summary['leaked'] or 'nothing'})")
    print(f"cluster exit code on SIGTERM: {rc}")
    if args.plot:
        plot(args.plot, soak, wins)
        print(f"plot: {args.plot}")
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(summary, indent=1))
    if args.record_dir:
        _record(Path(args.record_dir), args, summary, time.monotonic() - t0)
    return 0


def _record(d: Path, args, s: dict, elapsed: float) -> None:
    """A row for docs/reliability.md (the same fields as tests/reliab_record.py writes)."""
    d.mkdir(parents=True, exist_ok=True)
    grow = {k: round(v["last_mib"] - v["first_mib"], 1) for k, v in s["memory"].items()}
    rec = {
        "suite": "soak",
        "name": f"soak-{args.duration:.0f}s",
        "tried": f"{s['requests']} requests over HTTP to a 1 prefill + 1 decode cluster, "
        f"concurrency {args.concurrency}, {args.abort_frac:.0%} aborted after the first chunk, "
        f"{args.disconnect_frac:.0%} disconnected before the answer",
        "counts": s["by_kind_status"],
        "outcome": f"{s['completed_ok']} completed OK, {s['completed_not_ok']} not; p50/p99 "
        f"drift last/first window {s['latency_drift_last_over_first']}; RSS first->last "
        f"growth MiB {grow}",
        "lost": "nothing"
        if not s["leaked"] and not s["completed_not_ok"]
        else f"leaked {s['leaked']}, {s['completed_not_ok']} requests failed",  # fmt: skip
        "duration_s": round(elapsed, 1),
        "when": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "summary": s,
    }
    (d / f"soak-{args.duration:.0f}s.json").write_text(json.dumps(rec, indent=1, sort_keys=True))


if __name__ == "__main__":
    sys.exit(main())
