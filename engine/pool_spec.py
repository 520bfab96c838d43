"""The ``kv_pool`` string (``--kv-pool``, ``LLM(kv_pool=...)``): which tiers the block store has.

Tiers are separated by commas and looked up in that order: local tiers first (``dram`` before
``ssd``), then at most one remote tier::

    dram=SIZE                  a shared-memory arena of SIZE bytes
    ssd=PATH:SIZE              records under PATH (the size is after the LAST colon)
    tcp://HOST:PORT            a pool service (engine pool serve)
    mooncake://HOST:RPC_PORT?metadata=URL[&segment=SIZE][&buffer=SIZE]
                               the Mooncake Store: its master's RPC address and metadata server;
                               segment/buffer: memory this client lends to / buffers for the store
    policy=lru|lfu|length      eviction policy of the local tiers (default lru)

Sizes are bytes with an optional binary suffix: KiB, MiB, GiB, TiB (case-insensitive), e.g.
``dram=4GiB,ssd=/var/cache/kv:50GiB`` or ``dram=1GiB,tcp://10.0.0.5:7600``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

# The block store's eviction policies (engine/kvstore/eviction.py implements them), named here so
# that the kv_pool string is checked without importing the store.
POLICIES = ("lru", "lfu", "length")

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, what: str = "size") -> int:
    """Bytes from '4GiB', '512 MiB', '1.5GiB' or '1048576'."""
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"{what} {text!r} is not a size: use bytes or a binary suffix (KiB, MiB, GiB, TiB)"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: int) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n >= _UNITS[unit.lower()] and n % _UNITS[unit.lower()] == 0:
            return f"{n // _UNITS[unit.lower()]}{unit}"
    return str(n)


def _check_port(what: str, port: int | None) -> None:
    if port is None or not 0 < port < 65536:
        raise ValueError(f"{what}: port must be in 1..65535, got {port}")


@dataclass(frozen=True)
class DramSpec:
    size: int

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError(f"dram size must be > 0 bytes, got {self.size}")

    def __str__(self) -> str:
        return f"dram={format_size(self.size)}"


@dataclass(frozen=True)
class SsdSpec:
    path: str
    size: int

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("ssd path is empty (write ssd=PATH:SIZE)")
        if self.size <= 0:
            raise ValueError(f"ssd size must be > 0 bytes, got {self.size}")

    def __str__(self) -> str:
        return f"ssd={self.path}:{format_size(self.size)}"


@dataclass(frozen=True)
class ServiceSpec:
    host: str
    port: int

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("tcp:// pool service: the host is empty")
        _check_port("tcp:// pool service", self.port)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def __str__(self) -> str:
        return self.address


@dataclass(frozen=True)
class MooncakeSpec:
    host: str
    rpc_port: int
    metadata: str  # the metadata server's URL, e.g. http://HOST:PORT/metadata
    segment: int = 0  # bytes of this process's memory lent to the store (0: lend none)
    buffer: int = 0  # bytes of local transfer buffer (0: the backend's default)

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("mooncake://: the master host is empty")
        _check_port("mooncake:// master RPC", self.rpc_port)
        if not self.metadata:
            raise ValueError("mooncake://: metadata=URL is required (the metadata server)")
        if self.segment < 0 or self.buffer < 0:
            raise ValueError("mooncake://: segment and buffer must be >= 0 bytes")

    @property
    def master(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    def __str__(self) -> str:
        s = f"mooncake://{self.master}?metadata={self.metadata}"
        if self.segment:
            s += f"&segment={format_size(self.segment)}"
        if self.buffer:
            s += f"&buffer={format_size(self.buffer)}"
        return s


@dataclass(frozen=True)
class PoolSpec:
    dram: DramSpec | None = None
    ssd: SsdSpec | None = None
    remote: ServiceSpec | MooncakeSpec | None = None
    policy: str = "lru"

    def __post_init__(self) -> None:
        if self.dram is None and self.ssd is None and self.remote is None:
            raise ValueError("kv_pool names no tier (e.g. dram=4GiB,ssd=/var/cache/kv:50GiB)")
        if self.policy not in POLICIES:
            raise ValueError(f"kv_pool policy {self.policy!r} is unknown; choose one of {POLICIES}")

    def __str__(self) -> str:
        parts = [str(p) for p in (self.dram, self.ssd, self.remote) if p is not None]
        if self.policy != "lru":
            parts.append(f"policy={self.policy}")
        return ",".join(parts)


_ORDER = {"dram": 0, "ssd": 1, "remote": 2, "policy": 3}


def parse_pool_spec(text: str) -> PoolSpec:
    """Parse a kv_pool string; ValueError naming the part and what is wrong."""
    found: dict[str, object] = {}
    last = -1
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            raise ValueError(f"kv_pool {text!r} has an empty part (stray comma?)")
        kind, value = _parse_part(part)
        if kind in found:
            what = "remote tier" if kind == "remote" else f"{kind} part"
            raise ValueError(f"kv_pool part {part!r}: at most one {what}")
        if kind != "policy" and _ORDER[kind] < last:
            raise ValueError(
                f"kv_pool part {part!r}: tiers go in lookup order dram, ssd, then the remote tier"
            )
        if kind != "policy":
            last = _ORDER[kind]
        found[kind] = value
    return PoolSpec(
        dram=found.get("dram"),
        ssd=found.get("ssd"),
        remote=found.get("remote"),
        policy=found.get("policy", "lru"),
    )


def _parse_part(part: str) -> tuple[str, object]:
    try:
        if part.startswith("dram="):
            return "dram", DramSpec(parse_size(part[5:], "dram size"))
        if part.startswith("ssd="):
            path, sep, size = part[4:].rpartition(":")
            if not sep:
                raise ValueError("write ssd=PATH:SIZE (the size after the last colon)")
            return "ssd", SsdSpec(path, parse_size(size, "ssd size"))
        if part.startswith("policy="):
            if part[7:] not in POLICIES:
                raise ValueError(f"policy {part[7:]!r} is unknown; choose one of {POLICIES}")
            return "policy", part[7:]
        if part.startswith("tcp://"):
            url = urlsplit(part)
            if url.path or url.query:
                raise ValueError("write tcp://HOST:PORT (nothing after the port)")
            return "remote", ServiceSpec(url.hostname or "", url.port)
        if part.startswith("mooncake://"):
            return "remote", _parse_mooncake(part)
    except ValueError as e:
        raise ValueError(f"kv_pool part {part!r}: {e}") from None
    raise ValueError(
        f"kv_pool part {part!r} is none of dram=SIZE, ssd=PATH:SIZE, tcp://HOST:PORT, "
        "mooncake://HOST:RPC_PORT?metadata=URL, policy=NAME"
    )


def _parse_mooncake(part: str) -> MooncakeSpec:
    url = urlsplit(part)
    if url.path not in ("", "/"):
        raise ValueError("write mooncake://HOST:RPC_PORT?metadata=URL (no path)")
    query = dict(parse_qsl(url.query, keep_blank_values=True))
    unknown = set(query) - {"metadata", "segment", "buffer"}
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {sorted(unknown)}; known: metadata, segment, buffer"
        )
    return MooncakeSpec(
        host=url.hostname or "",
        rpc_port=url.port,
        metadata=query.get("metadata", ""),
        segment=parse_size(query["segment"], "segment") if "segment" in query else 0,
        buffer=parse_size(query["buffer"], "buffer") if "buffer" in query else 0,
    )
