"""How a request ends behind the router when it loses its KV or its worker after the client
has seen its first token (docs/endings.md): an error that says so, a ClusterUnavailableError
(503 in front of HTTP and RPC), never a clean end with part of the answer. Scripted workers:
real ZeroMQ sockets driven from this thread; no model runs."""

from __future__ import annotations

from contextlib import contextmanager

from engine.cluster import messages as m
from engine.cluster.router.config import ClusterUnavailableError
from engine.cluster.router.router import Router, RouterConfig
from tests.cluster.router.scripted_workers import Scripted, pump_until
from tests.cluster.router.test_router_relay import client_thread

FIRST = {"index": 0, "offset": 0, "token_ids": [42], "logprobs": None, "text_offset": 0,
         "text": "x", "finish_reason": None, "stop_reason": None}  # fmt: skip


def first_token_sent(router, p, d) -> str:
    """Place request "r", answer the DecodeRequest and send its first token from the prefill
    worker; the attempt's wire id."""
    pump_until([p, d], lambda: len(router.workers) == 2, "registration")
    req = pump_until([p, d], lambda: d.first(m.DecodeRequest), "the DecodeRequest")
    d.send(m.DecodeReady(req.request_id, 0, 4096))
    pump_until([p, d], lambda: p.first(m.PrefillRequest), "the PrefillRequest")
    p.send(m.Outputs(req.request_id, "p0", [FIRST]))
    pump_until([p, d], lambda: d.first(m.FirstTokens), "FirstTokens")
    return req.request_id


@contextmanager
def client_request(config: RouterConfig):
    """A router with a scripted prefill worker p0 and decode worker d0, registered, and a
    client's request "r" under way: (router, p, d, errors), its error landing in errors."""
    router = Router(config)
    p, d = Scripted(router, "p0", "prefill"), Scripted(router, "d0", "decode")
    errors: list = []
    thread = client_thread(router, errors)
    try:
        pump_until([p, d], lambda: len(router.workers) == 2, "registration")
        thread.start()
        yield router, p, d, errors
    finally:
        router.close()
        thread.join(10)
        for w in (p, d):
            w.sock.close(linger=0)


def run(case) -> list:
    with client_request(RouterConfig(heartbeat_timeout_s=1.0)) as (router, p, d, errors):
        case(router, p, d, first_token_sent(router, p, d))
        pump_until([p, d], lambda: errors, "the request's error")
        return list(errors)


def test_a_kv_transfer_that_failed_without_recompute_is_a_503_naming_it():
    """The decode worker's policy is "fail": its TransferFailed ends the request with a 503
    that names the transfer (before: a bare RuntimeError, a 500 "internal error" that said
    nothing of it)."""

    def case(router, p, d, wire_id):
        d.send(m.TransferFailed(wire_id, "layer 3 checksum mismatch", False))

    (err,) = run(case)
    assert isinstance(err, ClusterUnavailableError), repr(err)
    assert "KV transfer failed: layer 3 checksum mismatch" in str(err)


def test_a_decode_worker_that_dies_after_the_first_token_is_a_503_naming_it():
    def case(router, p, d, wire_id):
        d.alive = False  # SIGKILLed: its heartbeats stop
        pump_until([p], lambda: router.workers["d0"].state == "dead", "d0 declared dead")

    (err,) = run(case)
    assert isinstance(err, ClusterUnavailableError), repr(err)
    assert "worker d0 died" in str(err)


def test_a_full_staging_area_makes_the_request_wait_and_go_on_not_fail():
    """A decode worker whose KV staging area is full (an aborted long transfer's area waits for
    its sender to stop: the trace chaos run's final pass got a 503 for it) refuses the
    reservation with ``full``: the request waits and is placed anew, more often than
    max_retries allows for other refusals, each attempt under a fresh wire id, and goes on."""
    config = RouterConfig(heartbeat_timeout_s=1.0, max_retries=1)
    with client_request(config) as (router, p, d, errors):
        for k in range(3):
            pump_until([p, d], lambda k=k: len(d.all(m.DecodeRequest)) > k, f"DecodeRequest {k}")
            wire = d.all(m.DecodeRequest)[k].request_id
            full = "the KV staging area is full (900 of 1000 bytes held; this request needs 700)"
            d.send(m.DecodeReady(wire, 0, 0, error=full, full=True))
        pump_until([p, d], lambda: len(d.all(m.DecodeRequest)) > 3, "the fourth DecodeRequest")
        wires = [r.request_id for r in d.all(m.DecodeRequest)]
        assert len(set(wires)) == 4 and not p.first(m.PrefillRequest)
        d.send(m.DecodeReady(wires[3], 0, 4096))
        pump_until([p, d], lambda: p.first(m.PrefillRequest), "the PrefillRequest")
        assert p.first(m.PrefillRequest).request_id == wires[3] and not errors
