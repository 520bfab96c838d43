"""Fault injection in the KV transfer path, for the chaos tests only: enabled by the environment
variable ENGINE_FAULT_KV of a prefill worker, never by a message (a peer cannot turn it on).

Each KV layer message, just before it leaves, is dropped, corrupted (its checksum no longer
matches the bytes) or delayed with the given probabilities. The decode worker must notice every
drop (a missing layer at ``KVDone``) and every corruption (the checksum), and apply its failure
policy; delays must only cost time. Counts are kept so a test can tell faults were injected.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from typing import NamedTuple

from engine import envs

log = logging.getLogger(__name__)


class KVFaults(NamedTuple):
    drop: float = 0.0
    corrupt: float = 0.0
    delay: float = 0.0
    delay_s: float = 0.2
    seed: int | None = None


def parse(spec: str) -> KVFaults:
    """ "drop=P,corrupt=P,delay=P,delay_s=S,seed=N"; ValueError naming the field and its limit."""
    values: dict = {}
    for part in spec.split(","):
        name, _, raw = part.strip().partition("=")
        if name not in KVFaults._fields:
            raise ValueError(f"ENGINE_FAULT_KV: unknown field {name!r} (one of {KVFaults._fields})")
        try:
            values[name] = int(raw) if name == "seed" else float(raw)
        except ValueError:
            raise ValueError(f"ENGINE_FAULT_KV: {name} must be a number, got {raw!r}") from None
    f = KVFaults(**values)
    for name in ("drop", "corrupt", "delay"):
        if not 0.0 <= getattr(f, name) <= 1.0:
            raise ValueError(f"ENGINE_FAULT_KV: {name} must be in [0, 1], got {getattr(f, name)}")
    if f.drop + f.corrupt + f.delay > 1.0:
        raise ValueError("ENGINE_FAULT_KV: drop + corrupt + delay must be <= 1")
    if not 0.0 <= f.delay_s <= 10.0:
        raise ValueError(f"ENGINE_FAULT_KV: delay_s must be in [0, 10], got {f.delay_s}")
    return f


class KVFaultInjector:
    def __init__(self, faults: KVFaults) -> None:
        self.faults = faults
        self._rng = random.Random(faults.seed)
        self._lock = threading.Lock()
        self.counts = {"drop": 0, "corrupt": 0, "delay": 0, "passed": 0}

    def layer(self, header):
        """The KVLayer header to send (corrupted or delayed), or None to drop it."""
        f = self.faults
        with self._lock:
            x = self._rng.random()
        kind = (
            "drop" if x < f.drop
            else "corrupt" if x < f.drop + f.corrupt
            else "delay" if x < f.drop + f.corrupt + f.delay
            else "passed"
        )  # fmt: skip
        with self._lock:
            self.counts[kind] += 1
        if kind == "drop":
            log.warning("fault injected: dropped layer %d of %s", header.layer, header.request_id)
            return None
        if kind == "corrupt":
            log.warning("fault injected: corrupted layer %d of %s", header.layer, header.request_id)
            return dataclasses.replace(header, checksum=header.checksum ^ 0x5A5A)
        if kind == "delay":
            time.sleep(f.delay_s)
        return header


def from_env() -> KVFaultInjector | None:
    spec = envs.fault_kv()
    if spec is None:
        return None
    injector = KVFaultInjector(parse(spec))
    log.warning("KV fault injection is ON (ENGINE_FAULT_KV=%s): for tests only", spec)
    return injector
