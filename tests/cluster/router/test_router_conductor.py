"""The router driven by the Conductor, against scripted workers: real ZeroMQ sockets speaking the
cluster's messages from threads of this process (no model runs), so the placement, the reports
that feed it and the refusals can be checked without worker processes.

- cache_aware places a request on the worker whose *published* block events hold its prefix
  (the router subscribes to them and passes them on);
- a repeated prompt goes back to the worker that served it (the Conductor records the placement,
  and the router's reports of the first token and the end drain the queue it estimated);
- an SLO refusal reaches the embedded client as RequestRejectedError, the HTTP client as a 429
  whose OpenAI-shaped error names the reason, /metrics as request_rejected_total{reason}, and
  the RPC client as an RPCError with code 429 and the reason;
- the command-line flags reach the router's Conductor.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time

import httpx
import msgpack
import pytest
import zmq
from server.serverutil import RPCThread, http_server

from engine.cluster import messages as m
from engine.cluster.conductor.adapter import ConductorPlacement, RequestRejectedError
from engine.cluster.conductor.decision import REJECT_TTFT
from engine.cluster.placement import PlacementBase
from engine.cluster.router.router import Router, RouterConfig
from engine.kvcache.prefix_hash import hash_blocks
from engine.sampling_params import SamplingParams

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
PROMPT = list(range(500, 500 + 200))  # 12 full blocks of 16


class ScriptedWorkers:
    """Prefill and decode workers that register, beat, publish block events and answer a
    request at once: the decode side reserves, the prefill side returns one finishing token."""

    def __init__(self, router: Router, prefill: list[str], decode: list[str]) -> None:
        self.ctx = zmq.Context.instance()
        self.router = router
        self.socks: dict[str, zmq.Socket] = {}
        self.pubs: dict[str, zmq.Socket] = {}
        self.roles = {w: "prefill" for w in prefill} | {w: "decode" for w in decode}
        self.prefills: list[tuple[str, str]] = []  # (worker, request) of every PrefillRequest
        self.log: list[tuple[str, str]] = []  # (what, worker) of copies and prefills, in order
        self.answer_copies = True  # the target of a CopyBlocks answers CopyDone at once
        self.beat_s = 1.0
        self.decode_steps: tuple[int, float, float, float] | None = None  # heartbeat's steps
        self.lock = threading.Lock()  # sockets are used by the loop thread and publish()
        for wid, role in self.roles.items():
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(router.address)
            pub = self.ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind("tcp://127.0.0.1:0")
            self.socks[wid], self.pubs[wid] = s, pub
            reg = m.Register(wid, role, os.getpid(), "default", 1024, "", "", "tcp", "h",
                             events_address=pub.getsockopt_string(zmq.LAST_ENDPOINT),
                             copy_address=f"tcp://copy-{wid}:1" if role == "prefill" else "",
                             )  # fmt: skip
            s.send_multipart(m.encode(reg))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        router.wait_for_workers(len(prefill), len(decode), timeout=10)

    def _loop(self) -> None:
        poller = zmq.Poller()
        for s in self.socks.values():
            poller.register(s, zmq.POLLIN)
        next_beat = 0.0
        while not self.stop.is_set():
            ready = dict(poller.poll(50))
            with self.lock:
                if time.monotonic() > next_beat:
                    next_beat = time.monotonic() + self.beat_s
                    for wid, s in self.socks.items():
                        steps = self.decode_steps if self.roles[wid] == "decode" else None
                        n, sec, batch, tokens = steps or (0, 0.0, 0.0, 0.0)
                        hb = m.Heartbeat(wid, "up", 0, 0, 0.0, 0, 0, 0, steps=n, step_s=sec,
                                         step_batch=batch, step_tokens=tokens)  # fmt: skip
                        s.send_multipart(m.encode(hb))
                for wid, s in self.socks.items():
                    if s in ready:
                        self._answer(wid, s, m.decode(s.recv_multipart()))

    def _answer(self, wid: str, s: zmq.Socket, msg) -> None:
        if isinstance(msg, m.DecodeRequest):
            s.send_multipart(m.encode(m.DecodeReady(msg.request_id, 0, 0)))
        elif isinstance(msg, m.CopyBlocks):
            self.log.append(("copy", wid))
            dst = msg.dst_address.removeprefix("tcp://copy-").removesuffix(":1")
            if self.answer_copies:
                done = m.CopyDone(msg.request_id, dst, len(msg.token_ids) // 16 - msg.start_block)
                self.socks[dst].send_multipart(m.encode(done))
                self.log.append(("copy_done", dst))
        elif isinstance(msg, m.PrefillRequest):
            self.log.append(("prefill", wid))
            self.prefills.append((wid, msg.request_id))
            out = {"index": 0, "offset": 0, "token_ids": [7], "text_offset": 0, "text": "x",
                   "logprobs": None, "finish_reason": "length", "stop_reason": None}  # fmt: skip
            s.send_multipart(m.encode(m.Outputs(msg.request_id, wid, [out])))

    def publish_stored(self, wid: str, keys: list[bytes]) -> None:
        """Until the router has it (a SUB socket misses what is sent before it connects)."""
        ev = msgpack.packb({"type": "stored", "namespace": "x", "keys": keys, "source": wid})
        deadline = time.monotonic() + 10
        while self.router.prefix_blocks(wid, keys) < len(keys):
            assert time.monotonic() < deadline, "the router never took the event"
            with self.lock:
                self.pubs[wid].send(ev)
            time.sleep(0.05)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for s in [*self.socks.values(), *self.pubs.values()]:
            s.close(linger=0)


@pytest.fixture
def make():
    made = []

    def start(prefill=("p0", "p1"), decode=("d0",), **cfg):
        router = Router(RouterConfig(heartbeat_timeout_s=60.0, **cfg))
        workers = ScriptedWorkers(router, list(prefill), list(decode))
        made.append((router, workers))
        return router, workers

    yield start
    for router, workers in made:
        workers.close()
        router.close()


async def first(router: Router, prompt, rid: str):
    return [o async for o in router.generate(prompt, ONE, request_id=rid)][-1]


def test_cache_aware_follows_the_published_block_events(make):
    router, workers = make(policy="cache_aware")
    assert isinstance(router.placement, ConductorPlacement)
    other = list(range(9000, 9000 + 200))
    workers.publish_stored("p1", hash_blocks(PROMPT, 16))
    workers.publish_stored("p0", hash_blocks(other, 16))
    out = asyncio.run(first(router, PROMPT, "a"))
    assert out.finished and out.outputs[0].token_ids == [7]
    asyncio.run(first(router, other, "b"))
    # Each prompt went to the holder of its blocks, whichever worker ties win.
    assert workers.prefills == [("p1", "a/0"), ("p0", "b/0")]


def test_repeated_prompt_returns_to_its_worker_and_queues_drain(make):
    router, workers = make(policy="cache_aware")
    for i in range(3):
        asyncio.run(first(router, PROMPT, f"r{i}"))
    where = [w for w, _ in workers.prefills]
    assert len(where) == 3 and len(set(where)) == 1, where
    conductor = router.placement.conductor
    assert conductor.placed() == 0  # every end was reported: nothing is left queued
    assert conductor.prefill_queue_s(where[0], time.monotonic()) == 0.0
    # round robin, for contrast, spreads the same prompt
    router2, workers2 = make(policy="round_robin")
    for i in range(2):
        asyncio.run(first(router2, PROMPT, f"q{i}"))
    assert sorted(w for w, _ in workers2.prefills) == ["p0", "p1"]


def test_slo_refusal_is_a_429_with_the_reason_over_http_and_rpc(make):
    router, workers = make(ttft_slo_s=1e-6)  # no prefill fits: every request is refused

    with pytest.raises(RequestRejectedError) as exc:
        asyncio.run(first(router, PROMPT, "e"))
    assert exc.value.reason == REJECT_TTFT and "ttft_slo" in str(exc.value)
    assert workers.prefills == []  # refused before any work was sent

    with http_server(router) as srv:
        body = {"model": "default", "prompt": PROMPT, "max_tokens": 1}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == 429 and "ttft_slo" in err["message"], err
        assert "Retry-After" in r.headers
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
    line = next(x for x in metrics.splitlines() if 'reason="ttft_slo"' in x)
    assert line.startswith("engine:request_rejected_total") and line.endswith(" 1.0"), line

    from engine.client import RPCClient, RPCError

    with RPCThread(router) as rpc, RPCClient(rpc.address, timeout=30) as client:
        with pytest.raises(RPCError) as info:
            client.generate(PROMPT, max_tokens=1)
    assert info.value.code == 429 and "ttft_slo" in info.value.message


def test_no_live_worker_is_still_a_503_not_a_rejection():
    from engine.cluster.router.router import ClusterUnavailableError

    router = Router(RouterConfig())
    try:
        with pytest.raises(ClusterUnavailableError):
            asyncio.run(first(router, PROMPT, "n"))
    finally:
        router.close()


def test_cli_flags_reach_the_routers_conductor():
    from engine.cli.cluster import _router_config, add_cluster_commands
    from engine.cli.engine_options import add_engine_options

    parser = argparse.ArgumentParser()
    add_cluster_commands(parser.add_subparsers(dest="command"), add_engine_options)
    flags = ["--policy", "load", "--rejection", "early", "--ttft-slo", "5", "--tbt-slo", "0.5"]
    for command in ("cluster", "router"):
        argv = [command, *flags, "--block-size", "32"]
        cfg = _router_config(parser.parse_args(argv), "tcp://127.0.0.1:0")
        assert (cfg.policy, cfg.rejection, cfg.ttft_slo_s, cfg.tbt_slo_s, cfg.block_size) == (
            "load", "early", 5.0, 0.5, 32)  # fmt: skip
    defaults = _router_config(parser.parse_args(["router"]), "tcp://127.0.0.1:0")
    assert (defaults.policy, defaults.rejection) == ("kvcentric", "predicted")
    router = Router(cfg)
    try:
        c = router.placement.conductor.config
        assert (c.policy, c.rejection, c.ttft_slo_s, c.block_tokens) == ("load", "early", 5.0, 32)
    finally:
        router.close()
    with pytest.raises(SystemExit):
        parser.parse_args(["cluster", "--policy", "nearest"])
    with pytest.raises(ValueError, match="ttft_slo_s"):
        Router(RouterConfig(ttft_slo_s=0))


def test_kvcentric_plans_a_copy_from_a_pool_whose_events_hold_the_prefix(make):
    """A pool service's events reach the Conductor (Router.add_pool, which the launcher calls for
    --pool-service): kvcentric places the request with the pool's blocks copied to the chosen
    prefill worker, which its own pool lookup then loads (the copy through the pool)."""
    router, workers = make(policy="kvcentric", rejection="none")
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:0")
    try:
        router.add_pool("pool@test", pub.getsockopt_string(zmq.LAST_ENDPOINT))
        chain = hash_blocks(PROMPT, 16)
        ev = msgpack.packb({"type": "stored", "keys": chain, "source": "pool@test"})
        deadline = time.monotonic() + 10
        while router.prefix_blocks("pool@test", chain) < len(chain):
            assert time.monotonic() < deadline, "the router never took the pool's event"
            pub.send(ev)
            time.sleep(0.05)
        asyncio.run(first(router, PROMPT, "k"))
    finally:
        pub.close(linger=0)
    d = router.placement.last_decision
    assert d.prefix_blocks == len(chain)
    assert [(c.src, c.dst, c.keys) for c in d.copies] == [("pool@test", d.prefill, tuple(chain))]


class CopyingPlacement(PlacementBase):
    """Every request to p1 with its first ``blocks`` blocks copied from p0 (the decision the
    Conductor makes when p0 holds the prefix and is busy)."""

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.done: list[tuple[str, int]] = []

    def place(self, prompt_token_ids, prefill, decode, priority=0):
        return ("p1", "d0")

    def planned_copies(self):
        return [("p0", "p1", 0, self.blocks)]

    def copy_done(self, router_id: str, blocks: int) -> None:
        self.done.append((router_id, blocks))


def test_prefill_starts_after_the_planned_block_copy_is_in(make):
    router, workers = make()
    placement = CopyingPlacement(blocks=5)
    router.set_placement(placement)
    out = asyncio.run(first(router, PROMPT, "c"))
    assert out.finished
    assert workers.log == [("copy", "p0"), ("copy_done", "p1"), ("prefill", "p1")]
    assert placement.done == [("c/0", 5)]


def test_a_copy_that_never_comes_delays_the_prefill_only_until_the_copy_timeout(make):
    router, workers = make(copy_timeout_s=2.0)
    workers.answer_copies = False
    router.set_placement(CopyingPlacement(blocks=5))

    async def watch():
        task = asyncio.ensure_future(first(router, PROMPT, "late"))
        phases = set()
        while not task.done():
            phases.add((router.placement_of("late") or ("gone",))[0])
            await asyncio.sleep(0.01)
        return phases, task.result()

    phases, out = asyncio.run(watch())
    assert "copying" in phases  # it waited for the copy...
    assert out.finished and workers.log == [("copy", "p0"), ("prefill", "p1")]  # ...then went on


def test_decode_step_reports_in_heartbeats_refit_the_tbt_model(make):
    router, workers = make()
    conductor = router.placement.conductor
    assert not conductor.tbt_model.fitted
    workers.beat_s = 0.02
    workers.decode_steps = (12, 0.3, 4.0, 2500.0)  # 300 ms steps: far slower than the prior
    deadline = time.monotonic() + 20
    while not conductor.tbt_model.fitted:
        assert time.monotonic() < deadline, "the decode reports never reached the Conductor"
        time.sleep(0.05)
    assert conductor.tbt_model.predict(4, 2500) == pytest.approx(0.3, rel=1e-3)
