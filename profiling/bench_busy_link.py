"""The router's control traffic on a busy link: do heartbeats, block events and placements still
get through while KV transfers fill the link? A cluster in the network lab (engine/netlab; root):
the router on host a, a prefill worker on b, a decode worker on c, the links of b and c shaped to
``--rate`` (tbf at both ends), KV over TCP. First ``--idle`` seconds with nothing to do, then
``--seconds`` of long prompts (``--prompt-tokens`` random token ids, two output tokens, fresh each
time so no prefix cache spares a transfer) from ``--concurrency`` clients, so that the KV fills
b's uplink and c's downlink: the control messages that cross them queue behind it.

Per phase: the decode host's received bytes against the link's rate (how busy it was), ping
round trips from a to b and to c (the queueing a control message meets), and what the router
saw: each worker's longest gap between two heartbeats (``heartbeat_gap_max_s`` in /health, the
margin against ``--heartbeat-timeout``), workers declared dead, requests completed or failed.

    .venv/bin/python profiling/bench_busy_link.py                    # 100 Mbit/s, 30 s busy
    .venv/bin/python profiling/bench_busy_link.py --rate 1gbit --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from engine.netlab import NetLab, unavailable

REPO = Path(__file__).resolve().parents[1]
CONTROL_PORT, HTTP_PORT = 5557, 8000

# Runs on host a. argv: url, JSON settings, phase ("ready": only wait for /health; "idle",
# "busy"). Waits for /health, runs the phase, prints its JSON.
CLIENT = r"""
import json, random, subprocess, sys, threading, time
import httpx
url, cfg, name = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
deadline = time.monotonic() + cfg["start_s"]
while True:
    try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    if time.monotonic() > deadline:
        sys.exit("the cluster did not become healthy in time")
    time.sleep(0.5)
if name == "ready":
    sys.exit(0)
seconds = cfg[name + "_s"]
done, failed, errors, pings = [0], [0], [], {}
stop = time.monotonic() + seconds
rng = random.Random(name)

def ping(host):
    n = max(1, int(seconds / 0.2))
    p = subprocess.run(["ping", "-n", "-q", "-c", str(n), "-i", "0.2", "-W", "5", host],
                       capture_output=True, text=True)
    rtt = [x for x in p.stdout.splitlines() if "rtt" in x]
    pings[host] = rtt[0].split("=")[1].strip() if rtt else (p.stdout + p.stderr)[-200:]

def client():
    with httpx.Client(timeout=cfg["request_s"]) as http:
        while time.monotonic() < stop:
            prompt = [rng.randrange(1000, 40000) for _ in range(cfg["prompt_tokens"])]
            body = {"model": "default", "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
            try:
                r = http.post(url + "/v1/completions", json=body)
            except httpx.HTTPError as e:
                failed[0] += 1
                errors.append(repr(e)[:200])
                continue
            if r.status_code == 200:
                done[0] += 1
            else:
                failed[0] += 1
                errors.append(f"{r.status_code} {r.text[:200]}")

threads = [threading.Thread(target=ping, args=(h,)) for h in cfg["ping"]]
if name == "busy":
    threads += [threading.Thread(target=client) for _ in range(cfg["concurrency"])]
t0 = time.monotonic()
for t in threads:
    t.start()
for t in threads:
    t.join()
health = httpx.get(url + "/health", timeout=30).json()
print(json.dumps({"phase": name, "seconds": round(time.monotonic() - t0, 2), "done": done[0],
                  "failed": failed[0], "errors": errors[:5], "pings": pings,
                  "health": health}))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run(args: argparse.Namespace, logs: Path) -> list[dict]:
    logs.mkdir(parents=True, exist_ok=True)
    py = [sys.executable, "-m", "engine"]
    with NetLab(["a", "b", "c"]) as lab:
        a, b, c = (lab.addresses[h] for h in "abc")
        for h in ("b", "c"):
            lab.shape(h, args.rate, queue_ms=args.queue_ms)
        router = f"tcp://{a}:{CONTROL_PORT}"
        keys = logs / "keys"  # between hosts every socket is under CURVE keys
        if not keys.exists():
            subprocess.run([*py, "keys", "generate", str(keys)], check=True, env=_env(),
                           capture_output=True, timeout=60)  # fmt: skip
        worker = [
            "--curve-keys", str(keys), "--router", router, "--model", "default",
            "--dtype", args.dtype, "--max-model-len", str(args.prompt_tokens + 64),
            "--kv-cache-memory-gb", "0.5", "--kv-staging-mb", "256",
        ]  # fmt: skip
        router_argv = [
            *py, "router", "--curve-keys", str(keys), "--address", router, "--host", a,
            "--port", str(HTTP_PORT), "--rejection", "none", "--ttft-slo", "3600",
            "--heartbeat-timeout", str(args.heartbeat_timeout),
        ]  # fmt: skip
        role = [*py, "worker", "--role"]
        argvs = {
            "router": ("a", router_argv),
            "prefill": ("b", [*role, "prefill", "--kv-host", b, *worker,
                              "--threads", str(args.prefill_threads)]),
            "decode": ("c", [*role, "decode", "--kv-host", c, *worker, "--threads", "1"]),
        }  # fmt: skip
        procs = {}
        for name, (host, argv) in argvs.items():
            with open(logs / f"{name}.log", "wb") as f:
                procs[name] = lab.popen(host, argv, cwd=REPO, env=_env(), stdout=f,
                                        stderr=subprocess.STDOUT)  # fmt: skip
        cfg = {
            "start_s": 300, "request_s": args.request_timeout, "idle_s": args.idle,
            "busy_s": args.seconds, "concurrency": args.concurrency,
            "prompt_tokens": args.prompt_tokens, "ping": [b, c],
        }  # fmt: skip
        url = f"http://{a}:{HTTP_PORT}"
        out = []
        try:
            ready = lab.popen("a", [sys.executable, "-c", CLIENT, url, json.dumps(cfg), "ready"],
                              cwd=REPO, env=_env())  # fmt: skip
            while ready.poll() is None:  # a process that exits ends the wait (its log says why)
                exited = [n for n, p in procs.items() if p.poll() is not None]
                if exited:
                    ready.kill()
                    raise SystemExit(f"{exited} exited: see {logs}")
                time.sleep(0.5)
            if ready.returncode:
                raise SystemExit(f"the cluster did not become healthy: see {logs}")
            for phase in ("idle", "busy"):
                rx0 = _rx_bytes(lab, "c")
                argv = [sys.executable, "-c", CLIENT, url, json.dumps(cfg), phase]
                done = lab.run("a", argv, timeout=cfg["start_s"] + 2 * args.seconds + 600,
                               cwd=REPO, env=_env())  # fmt: skip
                if done.returncode:
                    raise SystemExit(f"{phase}: {done.stderr[-2000:]}\nlogs in {logs}")
                row = json.loads(done.stdout)
                row["rx_bytes"] = _rx_bytes(lab, "c") - rx0
                out.append(row)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.terminate()
            for p in procs.values():
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
        return out


def _rx_bytes(lab: NetLab, host: str) -> int:
    """Bytes ``host``'s eth0 received (/proc/net/dev is its network namespace's; /sys is not)."""
    for line in lab.run(host, ["cat", "/proc/net/dev"]).stdout.splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "eth0":
            return int(fields.split()[0])
    raise RuntimeError(f"no eth0 on host {host}")


def _rates(rate: str) -> float:
    from engine.netlab.lab import _rate_bits

    return float(_rate_bits(rate))


def table(rows: list[dict], args: argparse.Namespace) -> str:
    link = _rates(args.rate)
    lines = [
        f"link {args.rate} (b and c, both directions, {args.queue_ms} ms queues), "
        f"{args.prompt_tokens}-token prompts, {args.concurrency} clients, --dtype {args.dtype}, "
        f"heartbeat timeout {args.heartbeat_timeout:g} s",
        "phase  s     c rx Mbit/s  of link  ping a->b min/avg/max ms   ping a->c min/avg/max ms"
        "   hb gap max s (prefill, decode)  dead  done  failed",
    ]
    for r in rows:
        mbit = r["rx_bytes"] * 8 / r["seconds"] / 1e6
        ws = r["health"]["workers"]
        gaps = [f"{w['heartbeat_gap_max_s']:.2f}" for _, w in sorted(ws.items(),
                key=lambda kv: kv[1]["role"] != "prefill")]  # fmt: skip
        dead = sum(w["state"] == "dead" for w in ws.values())
        p = list(r["pings"].values())
        lines.append(
            f"{r['phase']:<6} {r['seconds']:<5.1f} {mbit:>11.1f}  {mbit * 1e6 / link:>6.0%}  "
            f"{p[0][:26]:<26}   {p[1][:26]:<26}   {', '.join(gaps):<30}  {dead:>4}  "
            f"{r['done']:>4}  {r['failed']:>6}"
        )
        for e in r["errors"]:
            lines.append(f"  error: {e}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rate", default="100mbit", help="the links of b and c (tc units)")
    ap.add_argument("--queue-ms", type=int, default=50,
                    help="each end's queue (tbf latency): a switch port's buffer")  # fmt: skip
    ap.add_argument("--seconds", type=float, default=30.0, help="the busy phase")
    ap.add_argument("--idle", type=float, default=10.0, help="the idle phase before it")
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--prefill-threads", type=int, default=2, help="the prefill worker's torch "
                    "threads: its compute makes the KV that fills the link")  # fmt: skip
    ap.add_argument("--dtype", default="float32", help="the workers' (float32: the most KV)")
    ap.add_argument("--heartbeat-timeout", type=float, default=5.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--logs", default="", help="the processes' logs (default: a temporary dir)")
    ap.add_argument("--json", default="", help="also write the phases' results here")
    args = ap.parse_args()
    reason = unavailable()
    if reason:
        raise SystemExit(f"no network lab here: {reason}")
    import tempfile

    logs = Path(args.logs or tempfile.mkdtemp(prefix="bench_busy_link-"))
    rows = run(args, logs)
    print(table(rows, args))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
