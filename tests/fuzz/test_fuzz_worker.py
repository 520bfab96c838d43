"""A real worker process's control socket under bad input: this test plays the router (a ROUTER
socket the worker connects to) and sends random frames, broken headers, and requests crafted to
hurt: a staging path outside /dev/shm or of another prefix, an area past the end of a real
arena, an unreachable KV address, token ids outside the vocabulary, sampling parameters of the
wrong types, aborts of unknown requests, replays. The worker keeps heartbeating, answers each
request with an error or a result, and afterwards serves a good request exactly (every layer's
KV and the first token) and is idle."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import zmq
from fuzz_frames import message_frames
from hypothesis import HealthCheck, given, settings
from test_fuzz_decoders import CLUSTER_HEADERS

from engine.cluster import messages as m
from engine.cluster.transfer.staging import StagingArena

START = 0.0  # when the module started (tests/fuzz/conftest.py sets it)

REPO = Path(__file__).resolve().parents[2]
COUNTS = {"random": 0, "crafted": 0, "errors_back": 0}
LAYERS = 30  # the default model's


class FakeRouter:
    def __init__(self, role: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.pull = self.ctx.socket(zmq.PULL)  # where a good prefill sends its KV
        self.pull.bind("tcp://127.0.0.1:0")
        self.kv_address = self.pull.getsockopt_string(zmq.LAST_ENDPOINT)
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        env.pop("ENGINE_CURVE_KEYS", None)
        cmd = [sys.executable, "-m", "engine.cli.main", "worker", "--role", role, "--router",
               self.address, "--worker-id", "fz", "--kv-cache-memory-gb", "0.1",
               "--max-model-len", "512", "--threads", "1", "--kv-staging-mb", "16",
               "--kv-transport", "shm", "--dtype", "float32", "--log-level", "error"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO)
        self.identity = b""
        self.last_beat: m.Heartbeat | None = None
        self.got: list[m.Message] = []
        msg = self.until(lambda x: isinstance(x, m.Register), 300)
        assert msg.role == role

    def _take(self, wait_ms: int) -> m.Message | None:
        assert self.proc.poll() is None, f"the worker exited with {self.proc.returncode}"
        if not self.sock.poll(wait_ms):
            return None
        ident, *frames = self.sock.recv_multipart()
        msg = m.decode(frames)
        if isinstance(msg, m.Heartbeat):
            self.last_beat = msg
        elif isinstance(msg, m.Register):
            self.identity = ident
        else:
            self.got.append(msg)
            if isinstance(msg, m.RequestError):
                COUNTS["errors_back"] += 1
        return msg

    def until(self, cond, timeout: float) -> m.Message:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self._take(200)
            if msg is not None and cond(msg):
                return msg
        raise AssertionError("the worker did not answer in time")

    def drain(self) -> None:
        """Take whatever the worker sent, without waiting."""
        while self._take(0) is not None:
            pass

    def send(self, frames: list) -> None:
        self.sock.send_multipart([self.identity, *frames])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def worker():
    r = FakeRouter("prefill")
    try:
        yield r
    finally:
        r.close()


def _prefill(rid: str, **kw) -> m.PrefillRequest:
    base = dict(request_id=rid, prompt_token_ids=list(range(100, 140)), params={"max_tokens": 4,
                "temperature": 0.0}, decode_id="d", kv_address="tcp://127.0.0.1:9",
                transport="tcp", shm_path="", offset=0, nbytes=0)  # fmt: skip
    base.update(kw)
    return m.PrefillRequest(**base)


def _nbytes(tokens: int) -> int:
    return LAYERS * 2 * tokens * 3 * 64 * 4  # float32 on CPU: layers x K,V x tokens x heads x dim


def test_crafted_requests_are_refused_or_fail_cleanly(worker):
    arena = StagingArena(1 << 20, shared=True)  # a real staging file, too small for the prompt
    n = _nbytes(40)
    try:
        crafted = [
            _prefill("p1", transport="shm", shm_path="/dev/shm/../etc/passwd", nbytes=n),
            _prefill("p2", transport="shm", shm_path="/tmp/engine-kvstage-1-x", nbytes=n),
            _prefill("p3", transport="shm", shm_path="/dev/shm/engine-kvstage-0-none", nbytes=n),
            _prefill("p4", transport="shm", shm_path=arena.path, offset=(1 << 20) - 64, nbytes=n),
            _prefill("p5", transport="shm", shm_path=arena.path, offset=-4096, nbytes=n),
            _prefill("p6", kv_address="not an endpoint", nbytes=n),
            _prefill("p7", prompt_token_ids=[10**9, -5], nbytes=_nbytes(2)),
            _prefill("p8", params={"max_tokens": "many", "temperature": []}, nbytes=n),
            _prefill("p9", params={"n": 10**6}, nbytes=n),
            _prefill("p10", prompt_token_ids=[], nbytes=0),
            _prefill("p11", nbytes=n + 1),
            m.DecodeRequest("p12", [1, 2], {}, 1.0),  # the wrong role
            m.Abort("never-seen"),
        ]
        for msg in crafted:
            if getattr(msg, "kv_address", "") == "tcp://127.0.0.1:9":  # reachable: no waiting
                msg = dataclasses.replace(msg, kv_address=worker.kv_address)
            worker.send(m.encode(msg))
            COUNTS["crafted"] += 1
        worker.send(m.encode(crafted[0]))  # replayed
        # The worker must stay up and heartbeat; the bad requests end (errors or first tokens).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            worker.until(lambda x: True, 10)
            beat = worker.last_beat
            if beat is not None and beat.running == 0 and beat.waiting == 0:
                if beat.transfers == 0:
                    break
        assert worker.proc.poll() is None
        assert worker.last_beat.transfers == 0, worker.last_beat
    finally:
        arena.close()


def _random(worker, frames) -> None:
    worker.send(frames)
    COUNTS["random"] += 1


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=message_frames(CLUSTER_HEADERS, "t"))
def test_random_frames(worker, frames):
    _random(worker, frames)


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=message_frames(CLUSTER_HEADERS, "t"))
def test_random_frames_long(worker, frames):
    _random(worker, frames)


def test_afterwards_a_good_request_is_served_exactly(worker):
    rss0 = psutil.Process(worker.proc.pid).memory_info().rss
    tokens = list(range(200, 232))
    msg = _prefill("good", prompt_token_ids=tokens, kv_address=worker.kv_address,
                   nbytes=_nbytes(len(tokens)))  # fmt: skip
    worker.send(m.encode(msg))
    layers, done = set(), None
    deadline = time.monotonic() + 120
    while done is None and time.monotonic() < deadline:
        worker.drain()
        while worker.pull.poll(200):
            kv = m.decode(worker.pull.recv_multipart())
            if kv.request_id != "good":
                continue  # a fuzzed request that had a reachable address
            if isinstance(kv, m.KVLayer):
                layers.add(kv.layer)
            elif isinstance(kv, m.KVDone):
                done = kv
    assert done is not None and layers == set(range(LAYERS)), (sorted(layers), done)
    out = worker.until(lambda x: isinstance(x, m.Outputs) and x.request_id == "good", 60)
    assert out.outputs[0]["token_ids"] == [done.firsts[0]["token"]]
    worker.until(lambda x: worker.last_beat is not None and worker.last_beat.running == 0, 30)
    assert worker.proc.poll() is None
    grew = psutil.Process(worker.proc.pid).memory_info().rss - rss0
    from reliab_record import record_if_the_run_passes

    record_if_the_run_passes(
        "fuzz",
        "worker-control-socket",
        "a real prefill worker's control socket: random frames and broken headers; staging "
        "paths outside /dev/shm or not ours, areas past a real arena's end, a bad KV address, "
        "token ids outside the vocabulary, wrongly typed parameters, the wrong role, replays",
        dict(COUNTS),
        f"worker alive and heartbeating throughout; {COUNTS['errors_back']} errors sent back; "
        f"then a good request: all {LAYERS} layers and the first token; RSS grew {grew >> 20} MiB",
        duration_s=time.monotonic() - START,
    )


@pytest.mark.slow
def test_decode_worker_control_socket():
    """The same against a decode worker: reservations too large for its staging, deadlines
    out of range, bad parameters, random frames; then every reservation aborted: staging 0."""
    r = FakeRouter("decode")
    try:
        crafted = [
            m.DecodeRequest("d1", list(range(100, 10_000)), {}, 10.0),  # longer than the model
            m.DecodeRequest("d2", list(range(100, 400)), {}, -5.0),
            m.DecodeRequest("d3", list(range(100, 400)), {}, 1e300),
            m.DecodeRequest("d4", list(range(100, 140)), {"max_tokens": "x"}, 10.0),
            m.DecodeRequest("d5", [10**9], {}, 10.0),
            m.DecodeRequest("d6", [], {}, 10.0),
        ] + [m.DecodeRequest(f"r{i}", list(range(100, 500)), {}, 600.0) for i in range(40)]
        for msg in crafted:
            r.send(m.encode(msg))
            COUNTS["crafted"] += 1
        ready = {}
        deadline = time.monotonic() + 60
        while len(ready) < len(crafted) and time.monotonic() < deadline:
            msg = r._take(200)
            if isinstance(msg, m.DecodeReady):
                ready[msg.request_id] = msg
        assert len(ready) == len(crafted), sorted(ready)
        assert all(ready[f"d{i}"].error for i in (1, 5, 6)), ready
        assert any(ready[f"r{i}"].error for i in range(40)), "16 MiB of staging never filled"

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
        @given(frames=message_frames(CLUSTER_HEADERS, "t"))
        def send_random(frames):
            r.send(frames)
            COUNTS["random"] += 1

        send_random()
        for msg in crafted:
            r.send(m.encode(m.Abort(msg.request_id)))
        r.until(lambda x: r.last_beat is not None and r.last_beat.staging_used == 0
                and r.last_beat.transfers == 0, 90)  # fmt: skip
        assert r.proc.poll() is None
    finally:
        r.close()
