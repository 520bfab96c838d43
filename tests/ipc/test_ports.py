"""free_port: a bindable loopback port below the kernel's ephemeral range."""

from __future__ import annotations

import socket

from engine.ipc.ports import free_port


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(0 < p < ephemeral_low for p in ports)
    assert len(ports) > 1  # picked at random, not one fixed port
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
