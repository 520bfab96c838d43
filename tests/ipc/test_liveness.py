"""ZeroMQ heartbeats on the sockets that cross hosts (engine/ipc/liveness.py): a connection
through a silent partition (the network lab's ``cut``: no RST, the carrier kept) is dropped and
made afresh, so a message sent once the network is back arrives within seconds, not at TCP's
next backed-off retransmission (about 20 s after a 30 s cut)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from engine.ipc.liveness import (
    CONNECT_TIMEOUT_MS,
    CONTROL_TIMEOUT_MS,
    HEARTBEAT_IVL_MS,
    RECONNECT_IVL_MAX_MS,
    watch_peer,
)

REPO = Path(__file__).resolve().parents[2]


def test_watch_peer_sets_heartbeats_reconnection_and_router_handover():
    ctx = zmq.Context.instance()
    for kind, handover in ((zmq.DEALER, None), (zmq.ROUTER, 1)):
        sock = ctx.socket(kind)
        try:
            watch_peer(sock, 1234)
            assert sock.getsockopt(zmq.HEARTBEAT_IVL) == HEARTBEAT_IVL_MS
            assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == 1234
            assert sock.getsockopt(zmq.CONNECT_TIMEOUT) == CONNECT_TIMEOUT_MS
            assert sock.getsockopt(zmq.RECONNECT_IVL_MAX) == RECONNECT_IVL_MAX_MS
            assert CONTROL_TIMEOUT_MS < 5000  # below the router's default heartbeat timeout
            if handover is not None:  # write-only: setting it raised nothing
                assert kind == zmq.ROUTER
        finally:
            sock.close(linger=0)


SERVER = """
import sys, time, zmq
from engine.ipc.liveness import watch_peer
s = zmq.Context.instance().socket(zmq.ROUTER)
watch_peer(s)
s.bind(sys.argv[1])
print("up", flush=True)
while True:
    ident, body = s.recv_multipart()
    print(body.decode(), time.time(), flush=True)
"""
CLIENT = """
import sys, zmq
from engine.ipc.liveness import watch_peer
s = zmq.Context.instance().socket(zmq.DEALER)
s.setsockopt(zmq.IDENTITY, b"worker")
watch_peer(s)
s.connect(sys.argv[1])
for line in sys.stdin:
    s.send(line.strip().encode())
"""


@pytest.mark.slow
def test_a_message_after_a_silent_30s_cut_arrives_within_seconds():
    from engine.netlab import NetLab, unavailable

    if unavailable():
        pytest.skip(unavailable())
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with NetLab(["a", "b"]) as lab:
        addr = f"tcp://{lab.addresses['a']}:5599"
        kw = dict(cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        server = lab.popen("a", [sys.executable, "-c", SERVER, addr], **kw)
        assert server.stdout.readline().strip() == "up"
        client = lab.popen("b", [sys.executable, "-c", CLIENT, addr], stdin=subprocess.PIPE, **kw)

        def say(word: str) -> None:
            client.stdin.write(word + "\n")
            client.stdin.flush()

        say("before")
        assert server.stdout.readline().split()[0] == "before"
        lab.cut("b")
        say("during")  # into the silent connection: TCP retransmits it with backoff
        time.sleep(30)
        lab.mend("b")
        sent = time.time()
        say("after")
        while True:  # "during" may be lost with the dropped connection, or come first
            word, at = server.stdout.readline().split()
            if word == "after":
                break
        assert float(at) - sent < 8.0, f"arrived {float(at) - sent:.1f} s after the cut ended"
