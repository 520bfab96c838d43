"""A pool service started on its own (``engine pool serve``), made known to a router started on
its own (``engine router --kv-pool tcp://HOST:PORT``, the address the workers' ``--kv-pool``
names): what ``engine cluster --pool-service`` does for the pool it starts itself.

The router asks the service for its counters (``stats``, under the CURVE keys like every pool
client), which name the service as its block events do (``pool@HOST:PORT``) and the port of its
events socket; then ``Router.add_pool`` subscribes to those events, and the Conductor counts
the pool as a holder of prefixes that prefill workers load from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import zmq

from engine.ipc import curve
from engine.kvstore.service import protocol as P
from engine.pool_spec import ServiceSpec, parse_pool_spec

ASK_EVERY_S = 1.0  # a service not up yet (started after the router) is asked again


@dataclass(frozen=True)
class PoolLink:
    source: str  # as the service's block events name it
    events_address: str  # tcp://HOST:EVENTS_PORT

    def __post_init__(self) -> None:
        if not self.source or not self.events_address.startswith("tcp://"):
            raise ValueError(f"pool link: source {self.source!r}, events {self.events_address!r}")


def service_spec(kv_pool: str) -> ServiceSpec:
    """The pool service a ``--kv-pool`` value names: exactly one ``tcp://HOST:PORT``."""
    spec = parse_pool_spec(kv_pool)
    if not isinstance(spec.remote, ServiceSpec) or spec.dram or spec.ssd:
        raise ValueError(
            f"the router's --kv-pool names a pool service, tcp://HOST:PORT, got {kv_pool!r}"
        )
    return spec.remote


def discover(kv_pool: str, timeout: float) -> PoolLink:
    """Ask the pool service ``kv_pool`` names for its name and events port, until it answers
    or ``timeout`` seconds passed (TimeoutError naming it). ValueError if it publishes no
    events (started without ``--events-port``)."""
    spec = service_spec(kv_pool)
    deadline = time.monotonic() + timeout
    ctx = zmq.Context.instance()
    attempt = 0
    while True:
        attempt += 1
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_HEADER_BYTES)
        try:
            curve.secure_client(sock)
            sock.connect(spec.address)
            sock.send_multipart(P.encode(P.Stats(id=attempt)))
            wait = min(ASK_EVERY_S, max(0.0, deadline - time.monotonic()))
            while sock.poll(wait * 1000):
                try:
                    reply = P.decode(sock.recv_multipart())
                except P.ProtocolError:
                    continue
                if isinstance(reply, P.StatsOk) and reply.id == attempt:
                    return _link(spec, reply.stats.get("service"))
                wait = min(ASK_EVERY_S, max(0.0, deadline - time.monotonic()))
        finally:
            sock.close(linger=0)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the pool service {spec.address} did not answer in {timeout:g} s")


def _link(spec: ServiceSpec, service: object) -> PoolLink:
    if not isinstance(service, dict) or not isinstance(service.get("source"), str):
        raise ValueError(f"the pool service {spec.address} did not say its name")
    port = service.get("events_port")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(
            f"the pool service {spec.address} publishes no block events: start it with "
            "--events-port PORT, so the router can place by what it holds"
        )
    host = f"[{spec.host}]" if ":" in spec.host else spec.host
    return PoolLink(service["source"], f"tcp://{host}:{port}")
