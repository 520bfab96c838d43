"""The chaos harness: a cluster of real processes started one by one (a pool service with a
small SSD tier, the router with its HTTP server, prefill and decode workers), CURVE keys on
every ZeroMQ socket, a steady stream of greedy requests that share a prefix, and a driver that
SIGKILLs and restarts the components while the prefill workers drop, corrupt and delay KV layer
messages (ENGINE_FAULT_KV). Afterwards it checks what the issue asks: every request completed
with the clean run's text or ended with a clear error, none passed its deadline, every survivor
is idle (KV blocks, staging, transfers, leases, reservations), memory stayed under its bound,
and no process or shared-memory file is left behind.

Used by tests/chaos/test_chaos.py (a short scenario in CI, long ones marked slow) and by hand:
``python tests/chaos/chaos_harness.py --duration 600`` prints the summary and writes the record.
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from engine.ipc.ports import free_port

REPO = Path(__file__).resolve().parents[2]
PREFIX = (
    "You are a careful assistant for a small library in a quiet town. The library lends books, "
    "maps and old newspapers, and it opens every day except on public holidays. Answer each "
    "question in one short sentence, plainly, without lists, and never invent facts about "
    "the library that are not written here. Question: "
)
QUESTIONS = [
    "When is the library closed?",
    "What can I borrow?",
    "Is the library open on Sunday?",
    "Can I borrow a map?",
    "Where is the library?",
    "Do you lend newspapers?",
    "How should you answer?",
    "What is the library like?",
]
CLEAR_STATUS = {400, 408, 429, 500, 502, 503}  # an error body naming the reason
MEMORY_BOUND = {"prefill": 3 << 30, "decode": 3 << 30, "router": 2 << 30, "pool": 1 << 30}


@dataclass(frozen=True)
class ChaosConfig:
    duration_s: float = 45.0  # of the chaos phase
    seed: int = 0
    clients: int = 2
    max_tokens: int = 8
    deadline_s: float = 90.0  # each request's; past it the request hung
    kill_interval_s: tuple[float, float] = (6.0, 10.0)
    targets: tuple[str, ...] = ("prefill", "pool", "router", "decode")
    kv_faults: str = "drop=0.03,corrupt=0.03,delay=0.04,delay_s=0.3"
    ssd_mb: int = 4  # the SSD tier's disk (a tmpfs when unshare can mount one)
    dram_mb: int = 2  # a few blocks: most are demoted to the SSD tier, which fills up
    start_timeout_s: float = 240.0
    # A process spinning on one core for the whole run (from before the cluster starts), as on
    # a machine shared with other jobs: deadlines a busy host misses are design bugs.
    hog: bool = False
    # The workers' engine options (the library prompts: float32, so the oracle can tell a
    # float32 near-tie; trace_chaos.py serves the trace's long prompts with its own).
    engine_args: tuple[str, ...] = ("--dtype", "float32", "--max-model-len", "1024",
                                    "--kv-cache-memory-gb", "0.2")  # fmt: skip
    threads: tuple[int, int] = (1, 1)  # the prefill and the decode worker's
    staging_mb: int = 64  # the decode worker's KV staging arena
    router_args: tuple[str, ...] = ()
    memory_scale: float = 1.0  # of MEMORY_BOUND

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.deadline_s <= 0 or self.clients < 1:
            raise ValueError("duration_s and deadline_s must be > 0 and clients >= 1")
        bad = set(self.targets) - set(MEMORY_BOUND)
        if bad:
            raise ValueError(f"targets must be among {sorted(MEMORY_BOUND)}, got {sorted(bad)}")


@dataclass
class Proc:
    name: str  # prefill | decode | router | pool
    cmd: list[str]
    env: dict
    log: Path
    popen: subprocess.Popen | None = None
    pids: list[int] = field(default_factory=list)
    starts: int = 0
    kills: int = 0
    peak_rss: int = 0

    def start(self) -> None:
        with open(self.log, "ab") as f:
            f.write(f"\n=== start {self.starts} at {time.time():.1f}\n".encode())
            self.popen = subprocess.Popen(
                self.cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO
            )
        self.pids.append(self.popen.pid)
        self.starts += 1

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
            self.kills += 1
        if self.popen is not None:
            self.popen.wait(30)

    def stop(self, timeout: float = 20.0) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(30)


@dataclass
class Result:
    prompt: int
    started: float
    elapsed: float
    kind: str  # identical | mismatch | error_status | connection | hung | reference
    status: int = 0
    text: str = ""
    detail: str = ""


class Chaos:
    def __init__(self, workdir: Path, keys_dir: str, cfg: ChaosConfig) -> None:
        self.cfg = cfg
        self.workdir = workdir
        self.rng = random.Random(cfg.seed)
        self.http_port, self.router_port = free_port(), free_port()
        self.pool_port, self.events_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.router_address = f"tcp://127.0.0.1:{self.router_port}"
        self.status_file = workdir / "router-status.json"
        self.ssd_dir = workdir / "ssd"
        self.ssd_dir.mkdir(exist_ok=True)
        self.shm_before = set(glob.glob("/dev/shm/engine-kv*"))
        base = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
                    ENGINE_CURVE_KEYS=keys_dir, TRITON_INTERPRET="0")  # fmt: skip
        base.pop("ENGINE_FAULT_KV", None)
        self.base_env = base
        self.ssd_mode = "tmpfs" if _can_mount_tmpfs(workdir) else "directory"
        py = [sys.executable, "-m", "engine.cli.main"]
        engine = ["--model", "default", *cfg.engine_args, "--log-level", "warning",
                  "--kv-pool", f"tcp://127.0.0.1:{self.pool_port}"]  # fmt: skip
        pool = [*py, "pool", "serve", "--dram", f"{cfg.dram_mb}MiB", "--ssd",
                f"{self.ssd_dir}:{cfg.ssd_mb * 4}MiB", "--port", str(self.pool_port),
                "--events-port", str(self.events_port), "--lease", "2"]  # fmt: skip
        if self.ssd_mode == "tmpfs":  # a disk of ssd_mb, declared 4x larger: it fills up
            mount = f"mount -t tmpfs -o size={cfg.ssd_mb}m tmpfs {self.ssd_dir}"
            pool = ["unshare", "-m", "sh", "-c", f'{mount} && exec "$@"', "sh", *pool]
        router = [sys.executable, str(REPO / "tests/chaos/router_proc.py"), "router",
                  "--address", self.router_address, "--port", str(self.http_port),
                  "--heartbeat-timeout", "3", "--log-level", "warning",
                  *cfg.router_args]  # fmt: skip
        worker = [*py, "worker", "--router", self.router_address, "--kv-staging-mb",
                  str(cfg.staging_mb)]  # fmt: skip
        threads = [["--threads", str(n)] for n in cfg.threads]
        self.procs = {
            "pool": Proc("pool", pool, base, workdir / "pool.log"),
            "router": Proc(
                "router",
                router,
                dict(base, CHAOS_STATUS_FILE=str(self.status_file)),
                workdir / "router.log",
            ),  # fmt: skip
            "prefill": Proc(
                "prefill",
                [*worker, "--role", "prefill", "--worker-id", "prefill-0", *engine, *threads[0]],
                base,
                workdir / "prefill.log",
            ),  # fmt: skip
            "decode": Proc(
                "decode",
                [*worker, "--role", "decode", "--worker-id", "decode-0", *engine, *threads[1]],
                base,
                workdir / "decode.log",
            ),  # fmt: skip
        }
        self.hog: subprocess.Popen | None = None
        self.results: list[Result] = []
        self.reference: dict[int, str] = {}
        self.exact_reference = False  # True: a deterministic engine's, any difference is wrong
        self.events: list[tuple[float, str, str]] = []  # (time, action, target)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.t0 = time.monotonic()
        self.client = httpx.Client(base_url=self.url, timeout=cfg.deadline_s)

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self.cfg.hog:
            code = "while True: pass"
            self.hog = subprocess.Popen([sys.executable, "-c", code])
        for name in ("pool", "router", "prefill", "decode"):
            self.procs[name].start()
        self.wait_ready(self.cfg.start_timeout_s)

    def status(self) -> dict:
        try:
            st = json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return {}
        return st if time.time() - st.get("time", 0) < 3.0 else {}

    def ready(self) -> bool:
        """The current router serves, and knows the current worker processes as up."""
        st = self.status()
        router = self.procs["router"].popen
        if not st or router is None or st.get("pid") != router.pid:
            return False
        for name, wid in (("prefill", "prefill-0"), ("decode", "decode-0")):
            w, p = st["workers"].get(wid), self.procs[name].popen
            if w is None or p is None or w["state"] != "up" or w["pid"] != p.pid:
                return False
        try:
            return self.client.get("/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            for p in self.procs.values():  # a component that died on its own is a failure
                if p.popen is not None and p.popen.poll() is not None and p.kills < p.starts:
                    tail = p.log.read_text()[-3000:]
                    raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster was not ready within {timeout:.0f} s")
            self.sample_memory()
            time.sleep(0.5)

    def kill_and_restart(self, name: str) -> None:
        p = self.procs[name]
        self._event("kill", name)
        pid = p.popen.pid if p.popen else None
        p.kill()
        if name in ("prefill", "decode") and pid is not None:
            from engine.cluster.transfer.staging import remove_stale_arenas

            remove_stale_arenas([pid])  # what the launcher does for a dead worker
        time.sleep(self.rng.uniform(0.3, 1.5))
        p.start()
        self._event("restart", name)

    def sample_memory(self) -> None:
        for p in self.procs.values():
            if p.alive():
                try:
                    rss = psutil.Process(p.popen.pid).memory_info().rss
                except psutil.Error:
                    continue
                p.peak_rss = max(p.peak_rss, rss)

    def stop(self) -> dict:
        """Stop everything (workers first, as the launcher does); what was left behind."""
        self._stop.set()
        if self.hog is not None:
            self.hog.kill()
            self.hog.wait(10)
        for name in ("prefill", "decode", "router", "pool"):
            self.procs[name].stop()
        from engine.cluster.transfer.staging import remove_stale_arenas

        pids = [pid for p in self.procs.values() for pid in p.pids]
        stale_staging = remove_stale_arenas(pids)  # files of SIGKILLed decode workers
        alive = [pid for pid in pids if _running(pid)]
        marker = self.router_address
        orphans = [
            p.pid for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] and any(marker in a or f":{self.pool_port}" in a
                                         for a in p.info["cmdline"])
        ]  # fmt: skip
        # Only our processes' files (others may be running their own engines on this host).
        ours = [f for pid in pids for f in glob.glob(f"/dev/shm/engine-kv*-{pid}-*")]
        new_shm = sorted(set(ours) - self.shm_before)
        for path in new_shm:  # a leak: the check fails, and the machine is cleaned anyway
            try:
                os.unlink(path)
            except OSError:
                pass
        self.client.close()
        return {"alive": alive, "orphans": orphans, "stale_staging_removed": stale_staging,
                "shm_left": new_shm}  # fmt: skip

    def _event(self, action: str, target: str) -> None:
        with self._lock:
            self.events.append((time.monotonic(), action, target))

    # -- load ----------------------------------------------------------------------------------

    def body(self, i: int) -> dict:
        """The request for prompt ``i``."""
        return {"model": "default", "prompt": PREFIX + QUESTIONS[i],
                "max_tokens": self.cfg.max_tokens, "temperature": 0}  # fmt: skip

    def final_prompts(self) -> list[int]:
        """The prompts asked once more after the chaos (each must come back identical)."""
        return list(range(len(QUESTIONS)))

    def next_prompt(self, rng: random.Random) -> int:
        return rng.randrange(len(QUESTIONS))

    def ask(self, i: int) -> Result:
        t0 = time.monotonic()
        body = self.body(i)
        try:
            r = self.client.post("/v1/completions", json=body)
        except httpx.TimeoutException as exc:
            return Result(i, t0, time.monotonic() - t0, "hung", detail=repr(exc))
        except httpx.HTTPError as exc:  # refused, or closed by a killed router
            return Result(i, t0, time.monotonic() - t0, "connection", detail=type(exc).__name__)
        dt = time.monotonic() - t0
        if r.status_code == 200:
            body = r.json()
            choice = body["choices"][0]
            text = choice["text"]
            ref = self.reference.get(i)
            kind = "reference" if ref is None else "identical" if text == ref else "mismatch"
            # the id ties a mismatch to the processes' logs; the finish reason and the token
            # count tell an early end from a wrong token
            detail = (f"{body.get('id')} finish={choice.get('finish_reason')} "
                      f"tokens={body.get('usage', {}).get('completion_tokens')}")  # fmt: skip
            return Result(i, t0, dt, kind, 200, text, detail)
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = ""
        kind = "error_status" if r.status_code in CLEAR_STATUS and message else "unclear_error"
        return Result(i, t0, dt, kind, r.status_code, detail=message[:200])

    def take_reference(self) -> None:
        for i in range(len(QUESTIONS)):
            r = self.ask(i)
            if r.kind != "reference":
                raise RuntimeError(f"the clean run failed for prompt {i}: {r}")
            self.reference[i] = r.text
        for i in range(len(QUESTIONS)):  # again, from the prefix cache and the pool: the same
            r = self.ask(i)
            if r.kind != "identical":
                raise RuntimeError(f"the clean run is not reproducible for prompt {i}: {r}")

    def _client_loop(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            r = self.ask(self.next_prompt(rng))
            with self._lock:
                self.results.append(r)
            if r.kind in ("connection", "error_status"):
                time.sleep(0.3)  # a client backs off a little

    def run(self) -> dict:
        """The chaos phase, then the checks' inputs. Raises nothing for a failed check: the
        summary says what happened, the test asserts."""
        t_start = time.monotonic()
        self.take_reference()
        prefill = self.procs["prefill"]  # faults on from now: the clean run is done
        faults = f"{self.cfg.kv_faults},seed={self.cfg.seed}"
        prefill.env = dict(prefill.env, ENGINE_FAULT_KV=faults)
        clients = [threading.Thread(target=self._client_loop, args=(self.cfg.seed * 100 + k,),
                                    daemon=True) for k in range(self.cfg.clients)]  # fmt: skip
        for t in clients:
            t.start()
        targets = ["prefill", *[t for t in self.cfg.targets if t != "prefill"]]
        chaos_end = time.monotonic() + self.cfg.duration_s
        n = 0
        # Every target once at least, however slowly the machine restarts them; then until the
        # end of the duration.
        while n < len(targets) or time.monotonic() < chaos_end:
            pause = self.rng.uniform(*self.cfg.kill_interval_s)
            self._sleep(pause, chaos_end if n >= len(targets) else time.monotonic() + pause)
            if n >= len(targets) and time.monotonic() >= chaos_end:
                break
            target = targets[n % len(targets)] if n < len(targets) else self.rng.choice(targets)
            self.kill_and_restart(target)
            n += 1
            try:
                self.wait_ready(self.cfg.start_timeout_s)  # the cluster serves again
            except TimeoutError:
                break
        self._stop.set()
        for t in clients:
            t.join(self.cfg.deadline_s + 10)
        hung_clients = sum(t.is_alive() for t in clients)
        chaos_s = time.monotonic() - t_start
        self._stop.clear()
        self.wait_ready(self.cfg.start_timeout_s)
        final = [self.ask(i) for i in self.final_prompts()]
        idle = self.wait_idle()
        pool_stats = self.pool_stats()
        self.sample_memory()
        return {"chaos_s": chaos_s, "hung_clients": hung_clients, "final": final, "idle": idle,
                "pool_stats": pool_stats}  # fmt: skip

    def _sleep(self, seconds: float, until: float) -> None:
        end = min(time.monotonic() + seconds, until)
        while time.monotonic() < end:
            self.sample_memory()
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))

    # -- checks --------------------------------------------------------------------------------

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Every worker's KV blocks, staging, transfers and queues at 0, the router's requests
        too (from the heartbeats, via the router's status)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            ws = {k: w for k, w in st.get("workers", {}).items() if w["state"] == "up"}
            busy = {k: w for k, w in ws.items() if any(w[f] for f in ("running", "waiting",
                    "used_blocks", "staging_used", "transfers"))}  # fmt: skip
            if st and not busy and st["in_flight"] == 0 and len(ws) >= 2:
                return {"idle": True, "workers": ws}
            if time.monotonic() > deadline:
                return {"idle": False, "busy": busy, "in_flight": st.get("in_flight")}
            time.sleep(0.5)

    def pool_stats(self, timeout: float = 15.0) -> dict:
        """The pool service's leases and reservations back at 0 (they also end by deadline)."""
        import zmq

        from engine.ipc import curve
        from engine.kvstore.service import protocol as P

        deadline = time.monotonic() + timeout
        ctx = zmq.Context()
        try:
            while True:
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                curve.secure_client(s, curve.load_keys(self.base_env["ENGINE_CURVE_KEYS"]))
                s.connect(f"tcp://127.0.0.1:{self.pool_port}")
                s.send_multipart(P.encode(P.Stats(id=1)))
                stats = P.decode(s.recv_multipart()).stats if s.poll(5000) else {}
                s.close(linger=0)
                leases = stats.get("service", {}).get("leases", -1)
                reserved = sum(v.get("reservations", 0) for k, v in stats.items()
                               if k != "service")  # fmt: skip
                if (leases == 0 and reserved == 0) or time.monotonic() > deadline:
                    return {"leases": leases, "reservations": reserved, "stats": stats}
                time.sleep(0.5)
        finally:
            ctx.destroy(linger=0)

    def fault_counts(self) -> dict:
        text = self.procs["prefill"].log.read_text(errors="replace")
        counts = Counter(re.findall(r"fault injected: (dropped|corrupted)", text))
        decode = self.procs["decode"].log.read_text(errors="replace")
        counts["transfer_failures_seen_by_decode"] = len(re.findall(r"KV transfer for", decode))
        return dict(counts)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _can_mount_tmpfs(workdir: Path) -> bool:
    probe = workdir / "mount-probe"
    probe.mkdir(exist_ok=True)
    try:
        r = subprocess.run(["unshare", "-m", "sh", "-c",
                            f"mount -t tmpfs -o size=1m tmpfs {probe} && touch {probe}/x"],
                           capture_output=True, timeout=20)  # fmt: skip
        return r.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def judge_mismatches(chaos: Chaos) -> None:
    """Each mismatch judged by the oracle (oracle.py): a float32 near-tie becomes "near_tie",
    reported but not failed, unless the workers are deterministic (the default where the C
    layers serve, as on the oracle's own engine here): then every mismatch stays one; the
    oracle's reason is appended."""
    bad = [r for r in chaos.results if r.kind == "mismatch"]
    if not bad or chaos.exact_reference:  # a deterministic reference: every mismatch is wrong
        return
    from oracle import classify

    from engine import LLM

    llm = LLM("default", dtype="float32", max_model_len=1024, kv_cache_memory_gb=0.2)
    seen: dict[tuple[int, str], tuple[str, str]] = {}
    for r in bad:
        key = (r.prompt, r.text)
        if key not in seen:
            prompt = PREFIX + QUESTIONS[r.prompt]
            exact = llm.engine.model.deterministic
            seen[key] = classify(llm, prompt, chaos.reference[r.prompt], r.text, exact)
        kind, why = seen[key]
        r.kind = "near_tie" if kind == "near_tie" else "mismatch"
        r.detail = f"{r.detail}; oracle: {why}"


def summarize(chaos: Chaos, run: dict, left: dict) -> dict:
    judge_mismatches(chaos)
    kinds = Counter(r.kind for r in chaos.results)
    final_kinds = Counter(r.kind for r in run["final"])
    kills = {name: p.kills for name, p in chaos.procs.items()}
    bound = {n: int(b * chaos.cfg.memory_scale) for n, b in MEMORY_BOUND.items()}
    over = {name: p.peak_rss for name, p in chaos.procs.items()
            if p.peak_rss > bound[name]}  # fmt: skip
    pool_stats = run["pool_stats"].get("stats", {})
    ssd = [v.get("tiers", {}).get("ssd", {}) for k, v in pool_stats.items() if k != "service"]
    failed = [r for r in chaos.results if r.kind in ("error_status", "connection")]
    ids = re.compile(r"cmpl-[0-9a-f]+(/[0-9]+)?")
    errors = Counter(f"{r.status} {ids.sub('ID', r.detail)[:90]}" for r in failed)
    return {
        "requests": len(chaos.results),
        "outcomes": dict(kinds),
        "final_pass": dict(final_kinds),
        "final_detail": [
            f"{r.status} {r.detail[:160]}" for r in run["final"] if r.kind != "identical"
        ],
        "conductor_after": chaos.status().get("conductor"),
        "kills": kills,
        "kv_faults": chaos.fault_counts(),
        "ssd_mode": chaos.ssd_mode,
        "ssd_since_last_pool_start": {
            f: sum(s.get(f, 0) for s in ssd) for f in ("blocks", "failed_writes", "bytes_written")
        },  # fmt: skip
        "errors": dict(errors.most_common(8)),
        "timeline": [(round(t - chaos.t0, 1), a, n) for t, a, n in chaos.events],
        "max_elapsed_s": round(max((r.elapsed for r in chaos.results), default=0.0), 1),
        "hung_clients": run["hung_clients"],
        "idle": run["idle"].get("idle", False),
        "idle_detail": run["idle"],
        "pool_leases": run["pool_stats"].get("leases"),
        "pool_reservations": run["pool_stats"].get("reservations"),
        "peak_rss_mib": {n: p.peak_rss >> 20 for n, p in chaos.procs.items()},
        "memory_bound_mib": {n: b >> 20 for n, b in bound.items()},
        "over_memory_bound": over,
        "left_behind": left,
        "chaos_s": round(run["chaos_s"], 1),
        "mismatches": [r.__dict__ for r in chaos.results if r.kind == "mismatch"][:5],
        "near_ties": [r.__dict__ for r in chaos.results if r.kind == "near_tie"][:5],
        "unclear": [r.__dict__ for r in chaos.results if r.kind in ("unclear_error", "hung")][:5],
    }


def run_scenario(workdir: Path, keys_dir: str, cfg: ChaosConfig) -> dict:
    chaos = Chaos(workdir, keys_dir, cfg)
    try:
        chaos.start()
        run = chaos.run()
    finally:
        left = chaos.stop()
    return summarize(chaos, run, left)


def main() -> int:
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of chaos")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--hog", action="store_true", help="a process spinning on one core")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    from engine.ipc.curve import generate_keys

    with tempfile.TemporaryDirectory() as tmp:
        keys = str(Path(tmp) / "keys")
        generate_keys(keys)
        cfg = ChaosConfig(
            duration_s=args.duration, seed=args.seed, clients=args.clients, hog=args.hog
        )
        t0 = time.monotonic()
        summary = run_scenario(Path(tmp), keys, cfg)
    name = f"long-seed{args.seed}" + ("-hog" if args.hog else "")
    return command_end(name, describe(cfg), summary, time.monotonic() - t0)


def command_end(name: str, tried: str, summary: dict, seconds: float) -> int:
    """A command line run's end: the summary printed, its record written (reliab_record.py),
    each failed check printed; the exit status (1 when a check failed)."""
    from reliab_record import write_record

    print(json.dumps(summary, indent=1))
    write_record("chaos", name, tried, summary_counts(summary), outcome_line(summary),
                 lost_line(summary), seconds, extra={"summary": summary})  # fmt: skip
    bad = problems(summary)
    for p in bad:
        print("FAILED:", p)
    return 1 if bad else 0


def problems(s: dict) -> list[str]:
    """What the run's summary shows wrong, each check's failure as a line; [] when it passed."""
    o, left = s["outcomes"], s["left_behind"]
    checks = [
        (o.get("mismatch", 0) == 0, f"mismatches: {s['mismatches']}"),
        (o.get("hung", 0) == 0 and s["hung_clients"] == 0, f"hung: {s['unclear']}"),
        (o.get("unclear_error", 0) == 0, f"unclear errors: {s['unclear']}"),
        (o.get("identical", 0) > 0, "no request completed during the chaos"),
        (set(s["final_pass"]) == {"identical"}, f"final pass: {s['final_pass']}"),
        (s["idle"], f"not idle afterwards: {s['idle_detail']}"),
        (s["pool_leases"] == 0 and s["pool_reservations"] == 0,
         f"pool leases {s['pool_leases']}, reservations {s['pool_reservations']}"),
        (not s["over_memory_bound"], f"over the memory bound: {s['peak_rss_mib']}"),
        (not left["alive"] and not left["orphans"] and not left["shm_left"], f"left: {left}"),
        (all(v >= 1 for v in s["kills"].values()), f"not every target killed: {s['kills']}"),
    ]  # fmt: skip
    return [why for ok, why in checks if not ok]


def describe(cfg: ChaosConfig) -> str:
    return (
        f"{cfg.duration_s:.0f} s of SIGKILL+restart of {', '.join(cfg.targets)} every "
        f"{cfg.kill_interval_s[0]:.0f}-{cfg.kill_interval_s[1]:.0f} s, KV layer faults "
        f"({cfg.kv_faults}), SSD tier on a {cfg.ssd_mb} MiB disk declared 4x larger, "
        f"{cfg.clients} clients of greedy shared-prefix requests, CURVE on"
        + (", a process spinning on one core throughout" if cfg.hog else "")
    )


def summary_counts(s: dict) -> dict:
    return {"requests": s["requests"], **{f"kill_{k}": v for k, v in s["kills"].items()},
            **{f"kv_{k}": v for k, v in s["kv_faults"].items()}, **s["outcomes"]}  # fmt: skip


def outcome_line(s: dict) -> str:
    o = s["outcomes"]
    return (
        f"{o.get('identical', 0)} identical to the clean run, {o.get('error_status', 0)} clear "
        f"HTTP errors, {o.get('connection', 0)} connections closed/refused (router down); "
        f"final pass {s['final_pass']}; idle afterwards: {s['idle']}; pool leases "
        f"{s['pool_leases']}, reservations {s['pool_reservations']}; peak RSS MiB "
        f"{s['peak_rss_mib']}; longest request {s['max_elapsed_s']} s"
    )


def lost_line(s: dict) -> str:
    o = s["outcomes"]
    bad = o.get("mismatch", 0) + o.get("hung", 0) + o.get("unclear_error", 0)
    left = s["left_behind"]
    return (
        "nothing"
        if bad == 0 and not left["alive"] and not left["orphans"] and not left["shm_left"]
        else f"{o.get('mismatch', 0)} mismatched, {o.get('hung', 0)} hung, "
        f"{o.get('unclear_error', 0)} unclear errors, processes left {left['alive']}"
    ) + (f"; shared-memory files left: {left['shm_left']}" if left["shm_left"] else "")


if __name__ == "__main__":
    sys.exit(main())
