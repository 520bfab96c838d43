"""A free TCP port to hand to a process that will bind it later (a leaf module: stdlib only)."""

from __future__ import annotations

import random
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, below the kernel's ephemeral range. A port from that range
    (what binding port 0 returns) can be taken between this check and the real server's bind by
    any outgoing connection's local end or any other bind to port 0: a chaos run lost its pool
    service that way. Falls back to the kernel's pick when everything below the range is busy."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    for _ in range(200):
        port = random.randint(min(20000, ephemeral_low // 2), ephemeral_low - 1)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
