"""Scripted workers for the router's tests: real ZeroMQ DEALER sockets that register, send
heartbeats while ``alive`` and whatever a test sends, driven from the test's thread (no model)."""

from __future__ import annotations

import os
import time

import zmq

from engine.cluster import messages as m


class Scripted:
    """A worker ``wid`` of ``role``; ``reg``: its registration when not the default one (a
    group's stage, a decode worker with a KV address)."""

    def __init__(self, router, wid: str, role: str = "prefill", reg: m.Register | None = None):
        self.wid, self.role, self.reg = wid, role, reg
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(router.address)
        self.register()
        self.alive = True
        self.inbox: list[m.Message] = []

    def register(self, pid: int | None = None) -> None:
        if self.reg is not None and pid is None:
            self.send(self.reg)
            return
        pid = os.getpid() if pid is None else pid
        self.send(m.Register(self.wid, self.role, pid, "default", 1024, "", "", "tcp", "h"))

    def send(self, msg: m.Message) -> None:
        self.sock.send_multipart(m.encode(msg))

    def pump(self) -> None:
        if self.alive:
            self.send(m.Heartbeat(self.wid, "up", 0, 0, 0.0, 0, 0, 0))
        while self.sock.poll(0):
            self.inbox.append(m.decode(self.sock.recv_multipart()))

    def first(self, kind: type[m.Message]):
        return next((x for x in self.inbox if isinstance(x, kind)), None)

    def all(self, kind: type[m.Message]) -> list:
        return [x for x in self.inbox if isinstance(x, kind)]

    def close(self) -> None:
        self.sock.close(linger=0)


def pump_until(workers, cond, what: str, timeout: float = 20.0):
    """Pump every worker until ``cond()`` is truthy (returned); AssertionError after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        for w in workers:
            w.pump()
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.03)
