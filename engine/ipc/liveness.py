"""ZeroMQ heartbeats on the sockets that cross hosts, so that a connection whose peer went
silent is noticed and made afresh.

A partition beyond a host's own NIC (a switch, a link farther on) sends no RST: both ends keep
their TCP connection, and the side with data to send retransmits with exponential backoff. Once
the network is back, such a connection resumes only at its next retransmission, which after a
minute's cut is about a minute later (measured across the network lab's silent cut:
``tests/netlab/test_partitions.py``); a connect attempt during the cut waits out the kernel's
SYN retries (about two minutes). With ``watch_peer`` a socket pings each peer every
``HEARTBEAT_IVL_MS`` and closes a connection that brought nothing for ``timeout_ms`` (the
peer's ZeroMQ IO thread answers, so a long forward never looks like silence); a connecting socket
then connects again at once and every ``RECONNECT_IVL_MAX_MS`` at most, each attempt given up
after ``CONNECT_TIMEOUT_MS``, so it is back within about a second of the network. A router socket
also lets a peer reconnecting under its identity take it over (``ROUTER_HANDOVER``) from a
connection it still believes alive.
"""

from __future__ import annotations

import zmq

HEARTBEAT_IVL_MS = 1000
CONTROL_TIMEOUT_MS = 3000  # the router's control traffic: small messages, answered at once
# KV frames: a PING waits behind the bytes queued in the socket buffers, seconds on a slow link
DATA_TIMEOUT_MS = 15_000
CONNECT_TIMEOUT_MS = 2000
RECONNECT_IVL_MAX_MS = 1000


def watch_peer(sock: zmq.Socket, timeout_ms: int = CONTROL_TIMEOUT_MS) -> None:
    """Before ``bind``/``connect``: heartbeats, reconnection and (ROUTER) handover as above."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_TIMEOUT_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    if sock.socket_type == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
