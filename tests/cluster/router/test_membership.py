"""The router's membership: the longest gap between a worker's heartbeats (what a slow or busy
link shows before it reads as a death), counted between heartbeats only, and a death after
``heartbeat_timeout_s`` of silence."""

from __future__ import annotations

from engine.cluster import messages as m
from engine.cluster.placement import RoundRobin
from engine.cluster.router.config import RouterConfig
from engine.cluster.router.membership import Membership


class NoLinks:
    def subscribe(self, address: str) -> bool:
        return True

    def unsubscribe(self, address: str) -> None:
        pass


def register(ms: Membership, wid: str, now: float) -> None:
    msg = m.Register(wid, "decode", 1234, "default", 512, "tcp://10.0.0.3:5601", "", "tcp",
                     "c")  # fmt: skip
    assert ms.register(wid.encode(), msg, now) is not None


def beat(ms: Membership, wid: str, now: float) -> None:
    ms.heartbeat(m.Heartbeat(wid, "up", 0, 0, 0.0, 0, 0, 0), now)


def test_heartbeat_gap_max_is_the_longest_silence_between_heartbeats():
    ms = Membership(RouterConfig(heartbeat_timeout_s=5.0), 512, RoundRobin(), NoLinks())
    register(ms, "d0", 100.0)
    beat(ms, "d0", 100.5)
    assert ms.status()["d0"]["heartbeat_gap_max_s"] == 0.0  # one heartbeat: no gap yet
    beat(ms, "d0", 101.0)
    ms.sender(b"d0", 101.2)  # another message does not hide a late heartbeat
    beat(ms, "d0", 104.2)
    beat(ms, "d0", 104.7)
    assert ms.status()["d0"]["heartbeat_gap_max_s"] == 3.2
    ms.check_silence(109.6)
    assert ms.status()["d0"]["state"] == "up"
    ms.check_silence(109.8)
    assert ms.status()["d0"]["state"] == "dead"
    register(ms, "d0", 120.0)  # rejoined (a new pid would be the same): measured afresh
    assert ms.status()["d0"]["heartbeat_gap_max_s"] == 0.0
