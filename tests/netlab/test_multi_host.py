"""The cluster across hosts, as docs/cluster.md starts it: the lines of its multi-host blocks
(doc_hosts.py reads them) run one by one on three hosts of the network lab, each with its own
network, hostname and /dev/shm, under CURVE keys from ``engine keys generate``: on host a the
pool service and the router (``--kv-pool``: it hears the pool's events), on b a prefill worker,
on c a decode worker (both save blocks into the pool on a: ``engine pool stats`` shows them).
The only changes to the documented lines: the lab's addresses for 10.0.0.N, the test's key
directory, a smaller pool (64 MiB) and, for the workers, small memory options
(``WORKER_EXTRA``). Greedy and seeded (temperature 0.9, top_p 0.95, seed, logprobs 3)
completions through the router's HTTP API equal colocated serving (``engine.LLM`` here, same
model and dtype, float32): tokens, text and logprobs, exactly.

- tcp (default suite): b and c carry the same hostname but not the same /dev/shm; the decode
  worker offers shared memory (the documented default), and the router must send the KV over
  TCP anyway, since the prefill worker cannot read the nonce beside the decode worker's arena
  (``/health``: no ``shm_peers``, every transfer ``tcp``). A router that compared hostnames
  sends ``shm``, which this catches.
- mooncake (slow): ``mooncake_master`` on a (its HTTP metadata service), both workers with the
  documented ``--kv-transport mooncake --mooncake-metadata ...``, no pool: every transfer
  ``mooncake``.

Every process is stopped with SIGTERM and must exit 0, each host's /dev/shm must be empty after,
and the lab's close removes the namespaces. Skipped, saying why, where no lab can be made (not
root) and, for mooncake, where the package is missing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from doc_hosts import REPO, HostCommand, doc_blocks, substitute, without_option
from lab_cluster import WORKER_EXTRA, assert_equal, env, stop_all, tail, tails

from engine.netlab import NetLab, unavailable

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=str(unavailable()))

POOL_SIZES = {"4GiB": "64MiB"}
START_S = 300.0  # three processes load the model side by side on two busy cores
REQUEST_S = 300.0
STOP_S = 60.0
PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when a goldsmith in "
    "Mainz combined movable metal type, oil-based ink and a wooden press. Within fifty years",
    "A recipe for bread needs flour, water, salt and yeast. Mix them, knead the dough for ten "
    "minutes, let it rise for an hour, shape it, let it rise again and bake it until",
]
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "logprobs": 3}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_tokens": 8, "logprobs": 3}

# Run on host a (the router's HTTP port is on the lab's network only): poll /health until it is
# 200 or the deadline passes, then send each request and print the answers and /health as JSON.
CLIENT = """
import json, sys, time
import httpx
url, deadline, bodies = sys.argv[1], time.monotonic() + float(sys.argv[2]), json.loads(sys.argv[3])
while True:
    try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    if time.monotonic() > deadline:
        sys.exit("the cluster did not become healthy: " + httpx.get(url + "/health").text)
    time.sleep(0.5)
out = []
for body in bodies:
    r = httpx.post(url + "/v1/completions", json=body, timeout=float(sys.argv[4]))
    assert r.status_code == 200, r.text
    out.append(r.json()["choices"][0])
print(json.dumps({"choices": out, "health": httpx.get(url + "/health", timeout=10).json()}))
"""


@pytest.fixture(scope="module")
def colocated():
    """What engine.LLM answers for each (prompt, params): token strings, text, logprobs."""
    from engine import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM("default", dtype="float32", max_model_len=512, kv_cache_memory_gb=0.25)
    tok = llm.tokenizer
    out = []
    for prompt, params in zip(PROMPTS, (GREEDY, SEEDED)):
        c = llm.generate([prompt], SamplingParams(**params))[0].outputs[0]
        tokens = [tok.decode([t], skip_special_tokens=False) for t in c.token_ids]
        values = [lp.logprob for lp in c.logprobs]
        tops = []
        for t, lp in zip(c.token_ids, c.logprobs):  # the API's: the top 3 and the chosen token
            top = dict(sorted(lp.top.items(), key=lambda kv: -kv[1])[:3])
            top.setdefault(t, lp.logprob)
            tops.append({tok.decode([k], skip_special_tokens=False): v for k, v in top.items()})
        out.append({"text": c.text, "tokens": tokens, "values": values, "tops": tops})
    return out


@pytest.fixture
def keys(tmp_path):
    path = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "engine", "keys", "generate", str(path)], check=True,
                   env=env(), capture_output=True, timeout=60)  # fmt: skip
    return path


@pytest.mark.slow  # CI time on a 2-core Zen 3 EPYC: `pytest -m slow`
def test_three_hosts_tcp_same_hostname_with_a_pool(tmp_path, keys, colocated):
    health = run_cluster(tmp_path, keys, colocated, mooncake=False)
    prefill = next(w for w in health["workers"].values() if w["role"] == "prefill")
    assert prefill["shm_peers"] == [] and prefill["kv_transports"] == {"tcp": 2}, prefill


@pytest.mark.slow
def test_three_hosts_mooncake(tmp_path, keys, colocated):
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine is not installed")
    if shutil.which("mooncake_master", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("mooncake_master is not installed (pip install 'engine[mooncake]')")
    health = run_cluster(tmp_path, keys, colocated, mooncake=True)
    prefill = next(w for w in health["workers"].values() if w["role"] == "prefill")
    assert prefill["kv_transports"] == {"mooncake": 2}, prefill


def documented(mooncake: bool) -> list[HostCommand]:
    """The commands of the doc's blocks for this case, in the doc's order."""
    tcp, mc = doc_blocks()
    if not mooncake:
        return list(tcp.commands)
    workers = []
    for c in tcp.commands:
        if c.program in ("prefill", "decode"):  # no pool in this case; Mooncake's options
            argv = without_option(list(c.argv), "--kv-pool") + list(mc.worker_options)
            workers.append(HostCommand(c.host, tuple(argv)))
    router = next(c for c in tcp.commands if c.program == "router")
    router = HostCommand(router.host, tuple(without_option(list(router.argv), "--kv-pool")))
    return [*mc.commands, router, *workers]


def run_cluster(tmp_path: Path, keys: Path, colocated: list[dict], mooncake: bool) -> dict:
    with NetLab(["a", "b", "c"]) as lab:
        hosts = {"10.0.0.1": "a", "10.0.0.2": "b", "10.0.0.3": "c"}
        mapping = {doc: lab.addresses[h] for doc, h in hosts.items()}
        mapping["/etc/engine/keys"] = str(keys)
        if not mooncake:  # one hostname, two /dev/shm: only a proof may pick shared memory
            for h in ("b", "c"):
                assert lab.run(h, ["hostname", "same"]).returncode == 0
        procs: list[tuple[str, subprocess.Popen, Path]] = []
        try:
            for cmd in documented(mooncake):
                argv = substitute(cmd.argv, {**mapping, **POOL_SIZES})
                if cmd.program in ("prefill", "decode"):
                    argv += WORKER_EXTRA
                log = tmp_path / f"{cmd.program}.log"
                with open(log, "wb") as f:
                    proc = lab.popen(hosts[cmd.host], argv, cwd=REPO, env=env(), stdout=f,
                                     stderr=subprocess.STDOUT)  # fmt: skip
                procs.append((cmd.program, proc, log))
                if cmd.program == "pool":
                    _wait_for_line(proc, log, b"pool service ready")
                elif cmd.program == "mooncake_master":
                    _wait_listening(lab, "a", mapping["10.0.0.1"], (50051, 8080), proc)
            bodies = [{"model": "default", "prompt": p, **params}
                      for p, params in zip(PROMPTS, (GREEDY, SEEDED))]  # fmt: skip
            url = f"http://{mapping['10.0.0.1']}:8000"
            client = [sys.executable, "-c", CLIENT, url, str(START_S), json.dumps(bodies),
                      str(REQUEST_S)]  # fmt: skip
            done = lab.run("a", client, timeout=START_S + 2 * REQUEST_S + 30, env=env())
            assert done.returncode == 0, f"{done.stderr[-3000:]}\n{tails(procs)}"
            answer = json.loads(done.stdout)
            for got, want in zip(answer["choices"], colocated):
                assert_equal(got, want)
            if not mooncake:  # the router asked the pool service for its name and events
                router_log = next(log for name, _, log in procs if name == "router")
                pool = f"pool@{mapping['10.0.0.1']}:7600"
                assert f"Router hears the pool service {pool}" in tail(router_log, 20000)
                _wait_pool_blocks(lab, mapping["10.0.0.1"], keys)
            stop_all(procs, STOP_S, may_die_by_signal=("mooncake_master",))
            for h in lab.hosts:  # no arena, nonce or pool segment left on any host
                assert lab.run(h, ["ls", "-A", "/dev/shm"]).stdout.split() == [], h
            return answer["health"]
        except BaseException:
            for _, proc, _ in procs:
                if proc.poll() is None:
                    proc.kill()
            raise


def _wait_for_line(proc: subprocess.Popen, log: Path, line: bytes) -> None:
    deadline = time.monotonic() + START_S
    while line not in log.read_bytes():
        assert proc.poll() is None, f"exited {proc.returncode}\n{tail(log)}"
        assert time.monotonic() < deadline, f"no {line!r} in {START_S:g} s\n{tail(log)}"
        time.sleep(0.1)


def _wait_listening(lab: NetLab, host: str, addr: str, ports, proc: subprocess.Popen) -> None:
    probe = ("import socket, sys, time\nfor port in sys.argv[2:]:\n    end = time.monotonic() + "
             "60\n    while True:\n        try:\n            socket.create_connection((sys.argv[1],"
             " int(port)), timeout=1).close(); break\n        except OSError:\n            "
             "assert time.monotonic() < end, port; time.sleep(0.1)\n")  # fmt: skip
    done = lab.run(host, [sys.executable, "-c", probe, addr, *map(str, ports)], timeout=150)
    assert done.returncode == 0 and proc.poll() is None, done.stderr


def _wait_pool_blocks(lab: NetLab, addr: str, keys: Path) -> None:
    """The workers on b and c saved blocks into the pool service on a (their --kv-pool)."""
    cmd = [sys.executable, "-m", "engine", "pool", "stats", "--curve-keys", str(keys),
           "--address", f"tcp://{addr}:7600"]  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        done = lab.run("a", cmd, env=env(), cwd=REPO)
        assert done.returncode == 0, done.stderr
        stats = json.loads(done.stdout)
        namespaces = [v for k, v in stats.items() if k != "service"]
        if any(t["blocks"] > 0 for ns in namespaces for t in ns["tiers"].values()):
            return
        assert time.monotonic() < deadline, f"no block reached the pool: {stats}"
        time.sleep(0.5)
