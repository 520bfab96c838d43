"""The workers the router knows: registrations, heartbeats, goodbyes and deaths, the live views
its placement chooses from, which prefix blocks each worker and pool holds (from their block
events), and the longest request the live workers can all take.

A worker silent for ``heartbeat_timeout_s`` is dead: nothing more is placed there, and the
requests on it are handed to ``on_death`` (the phase machine retries or fails them). Runs on the
router's IO thread; other threads read ``workers`` only through a copy of its values.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine.cluster import messages as m
from engine.cluster.conductor.prefix_index import PrefixIndex
from engine.cluster.placement import Placement, WorkerView
from engine.cluster.router.config import RouterConfig
from engine.kvstore.block_events import BlockEvent

log = logging.getLogger(__name__)

LIVE = ("up", "draining")  # a draining worker finishes what it holds; nothing new goes there


class EventLinks(Protocol):
    """Where the router's block-event subscription connects (the IO's SUB socket)."""

    def subscribe(self, address: str) -> bool: ...

    def unsubscribe(self, address: str) -> None: ...


@dataclass
class Worker:
    worker_id: str
    role: str
    identity: bytes
    pid: int
    host: str
    kv_address: str
    shm_path: str
    transport: str
    max_model_len: int
    events_address: str = ""
    mooncake_address: str = ""
    arena_addr: int = 0
    copy_address: str = ""  # prefill: where other prefill workers push block copies
    shm_digest: str = ""  # decode: the digest of its arena's nonce (shm_pairs.py)
    pid_ns: str = ""
    # prefill: the decode workers it proved to share /dev/shm with (id -> the digest proven),
    # the probes not answered yet, and the KV transfers it was sent on, by transport
    shm_peers: dict[str, str] = field(default_factory=dict)
    shm_pending: set[str] = field(default_factory=set)
    kv_transports: dict[str, int] = field(default_factory=dict)
    state: str = "up"  # up | draining | dead | left
    last_seen: float = 0.0
    hb: m.Heartbeat | None = None
    last_heartbeat: float = 0.0  # when its last heartbeat (not any message) arrived
    heartbeat_gap_max: float = 0.0  # the longest time between two of its heartbeats
    # The attempts (wire ids) the router gave up on when it declared this worker dead, or whose
    # Abort could not be sent (its connection down): a process cut off by a partition still
    # holds them (staging, blocks, sends) until its own deadlines; when the same process
    # registers again, the router aborts each.
    abandoned: list[str] = field(default_factory=list)
    # prefill: a stage of a pipelined prefill group (Register.group ...), or alone (group "")
    group: str = ""
    stage: int = 0
    stages: int = 1
    chunk_tokens: int = 0
    hidden_address: str = ""

    @property
    def live(self) -> bool:
        return self.state in LIVE


GROUP_PREFIX = "group:"  # a prefill group's id as placement sees it: one prefill unit


def group_id(name: str) -> str:
    return GROUP_PREFIX + name


@dataclass
class Group:
    """A pipelined prefill group: the workers of its stages, by stage. It is up, and placement
    sees it as one prefill unit (``group:NAME``), while every stage is registered and up."""

    name: str
    stages: int
    chunk_tokens: int
    members: dict[int, str] = field(default_factory=dict)  # stage -> worker id
    up: bool = False

    @property
    def unit_id(self) -> str:
        return group_id(self.name)


class Membership:
    def __init__(
        self, cfg: RouterConfig, model_max_len: int, placement: Placement, links: EventLinks
    ) -> None:
        self.cfg = cfg
        self.placement = placement
        self.workers: dict[str, Worker] = {}
        self.blocks = PrefixIndex()  # held prefix blocks per worker and pool: a hint
        self.max_model_len = cfg.max_model_len or model_max_len
        self._model_max_len = self.max_model_len
        self._links = links
        self.groups: dict[str, Group] = {}
        self.on_death: Callable[[Worker], None] = lambda worker: None

    # -- what workers say -------------------------------------------------------------------

    def register(self, identity: bytes, msg: m.Register, now: float) -> Worker | None:
        """The worker, when this registration is a new one (not a repeat, not refused)."""
        if msg.role not in ("prefill", "decode") or msg.max_model_len < 1:
            log.warning("refused to register %r: role %r, max_model_len %d", msg.worker_id[:64],
                        msg.role[:16], msg.max_model_len)  # fmt: skip
            return None
        if msg.group and not self._stage_fits(msg):
            return None
        old = self.workers.get(msg.worker_id)
        if old is not None and old.pid == msg.pid and old.live:
            old.identity, old.last_seen = identity, now  # a repeated registration
            return None
        if old is not None and old.live and old.pid != msg.pid:
            self.gone(old, "dead")  # restarted before its silence was noticed
        # The same process back after it was declared dead (a partition): what it still holds of
        # the attempts given up then is aborted (the router's on_message sends the Aborts).
        abandoned = old.abandoned if old is not None and old.pid == msg.pid else []
        self.workers[msg.worker_id] = Worker(
            msg.worker_id,
            msg.role,
            identity,
            msg.pid,
            msg.host,
            msg.kv_address,
            msg.shm_path,
            msg.transport,
            msg.max_model_len,
            events_address=msg.events_address,
            mooncake_address=msg.mooncake_address,
            arena_addr=msg.arena_addr,
            copy_address=msg.copy_address,
            shm_digest=msg.shm_digest,
            pid_ns=msg.pid_ns,
            last_seen=now,
            abandoned=abandoned,
            group=msg.group,
            stage=msg.stage,
            stages=msg.stages,
            chunk_tokens=msg.chunk_tokens,
            hidden_address=msg.hidden_address,
        )
        self.blocks.remove_holder(msg.worker_id)  # a fresh instance holds nothing yet
        self.blocks.add_holder(msg.worker_id)
        if msg.group:
            self._join_group(self.workers[msg.worker_id], now)
        else:
            self.placement.worker_joined(msg.worker_id, msg.role, now)
        if msg.events_address and not self._links.subscribe(msg.events_address):
            log.warning("worker %s: bad events address; serving without its block events",
                        msg.worker_id)  # fmt: skip
        self._refresh_max_model_len()
        log.info("worker %s (%s, pid %d) joined", msg.worker_id, msg.role, msg.pid)
        return self.workers[msg.worker_id]

    def _stage_fits(self, msg: m.Register) -> bool:
        """A stage's registration agrees with itself and with its group's other stages."""
        why = ""
        g = self.groups.get(msg.group)
        if msg.role != "prefill":
            why = "only prefill workers form groups"
        elif not (2 <= msg.stages <= 64 and 0 <= msg.stage < msg.stages):
            why = f"stage {msg.stage} of {msg.stages}"
        elif msg.stage > 0 and not msg.hidden_address.startswith("tcp://"):
            why = "no hidden-state endpoint"
        elif g is not None and (g.stages, g.chunk_tokens) != (msg.stages, msg.chunk_tokens):
            why = (f"group {msg.group!r} has {g.stages} stages and chunks of {g.chunk_tokens}, "
                   f"this stage says {msg.stages} and {msg.chunk_tokens}")  # fmt: skip
        elif g is not None and (holder := self.workers.get(g.members.get(msg.stage, ""))):
            if holder.live and holder.worker_id != msg.worker_id:
                why = f"stage {msg.stage} of group {msg.group!r} is {holder.worker_id}'s"
        if why:
            log.warning("refused to register %r as a stage: %s", msg.worker_id[:64], why)
        return not why

    def _join_group(self, w: Worker, now: float) -> None:
        g = self.groups.get(w.group)
        if g is None:
            g = self.groups[w.group] = Group(w.group, w.stages, w.chunk_tokens)
        g.members[w.stage] = w.worker_id
        self._refresh_group(g, now)

    def _refresh_group(self, g: Group, now: float) -> None:
        """Up once every stage is up; down (placement forgets it) when one is not."""
        up = len(g.members) == g.stages and all(
            (w := self.workers.get(wid)) is not None and w.state == "up"
            for wid in g.members.values()
        )
        if up and not g.up:
            self.placement.group_joined(g.unit_id, g.stages, g.chunk_tokens, now)
            log.info("prefill group %s is up (%d stages)", g.name, g.stages)
        elif g.up and not up:
            self.placement.worker_left(g.unit_id, now)
            log.warning("prefill group %s is down (a stage is not up)", g.name)
        g.up = up

    def stage_workers(self, unit_id: str) -> list[Worker] | None:
        """The workers of a prefill unit in stage order: a group's stages (None unless it is
        up), or the one worker."""
        if unit_id.startswith(GROUP_PREFIX):
            g = self.groups.get(unit_id[len(GROUP_PREFIX) :])
            if g is None or not g.up:
                return None
            return [self.workers[g.members[i]] for i in range(g.stages)]
        w = self.workers.get(unit_id)
        return [w] if w is not None else None

    def heartbeat(self, msg: m.Heartbeat, now: float) -> None:
        w = self.workers.get(msg.worker_id)
        if w is None or not w.live:
            return
        if w.last_heartbeat:  # how late heartbeats get (a slow or busy link shows here first)
            w.heartbeat_gap_max = max(w.heartbeat_gap_max, now - w.last_heartbeat)
        w.last_seen, w.last_heartbeat, w.hb = now, now, msg
        if msg.state == "draining" and w.state != "draining":
            w.state = "draining"
            if w.group:
                self._refresh_group(self.groups[w.group], now)
        if msg.steps > 0 and w.role == "decode":  # the Conductor's TBT model learns
            self.placement.decode_progress(
                w.worker_id, now, msg.step_batch, msg.step_tokens, msg.step_s
            )

    def goodbye(self, identity: bytes, msg: m.Goodbye) -> None:
        w = self.workers.get(msg.worker_id)
        if w is not None and w.identity == identity:  # only a worker's own goodbye counts
            self.gone(w, "left")

    def sender(self, identity: bytes, now: float) -> Worker | None:
        """The registered worker that sent a message from ``identity`` (now seen), if any."""
        w = next((w for w in self.workers.values() if w.identity == identity), None)
        if w is not None:
            w.last_seen = now
        return w

    def add_pool(self, source: str, events_address: str, now: float) -> None:
        """A pool service whose block events name it ``source``: a holder of prefix blocks."""
        self.blocks.remove_holder(source)  # what it held before is heard again
        self.blocks.add_holder(source)
        if not self._links.subscribe(events_address):
            log.warning("pool %s: bad events address %r", source, events_address[:200])
        self.placement.worker_joined(source, "pool", now)

    def take_event(self, event: BlockEvent) -> None:
        """A published block event of a known worker or pool: into the index, and to the
        placement (a group's first stage's under the group's id: placement's hint of what the
        group holds; the router caps the reuse at what every stage holds, phases.py)."""
        if self.blocks.apply(event.source, event):
            w = self.workers.get(event.source)
            if w is None or not w.group:
                self.placement.on_event(event.source, event)
            elif w.stage == 0:
                self.placement.on_event(group_id(w.group), event)

    # -- deaths -----------------------------------------------------------------------------

    def gone(self, w: Worker, state: str) -> None:
        """``w`` is dead or left: nothing more goes there; its requests go to ``on_death``."""
        w.state = state
        self._refresh_max_model_len()
        now = time.monotonic()
        if w.group:
            self._refresh_group(self.groups[w.group], now)
        else:
            self.placement.worker_left(w.worker_id, now)
        self.blocks.remove_holder(w.worker_id)
        if w.events_address:
            self._links.unsubscribe(w.events_address)
        log.warning("worker %s is %s", w.worker_id, state)
        self.on_death(w)

    def check_silence(self, now: float) -> None:
        for w in list(self.workers.values()):
            if w.live and now - w.last_seen > self.cfg.heartbeat_timeout_s:
                self.gone(w, "dead")

    def _refresh_max_model_len(self) -> None:
        """The smallest of the live workers' (the model's own while none is up): one that left
        no longer limits the cluster, and workers that serve past the model's context
        (``--rope-scaling``, ``--max-model-len``: model/context.py) set the cluster's."""
        if self.cfg.max_model_len is None:
            lens = [w.max_model_len for w in self.workers.values() if w.state == "up"]
            self.max_model_len = min(lens) if lens else self._model_max_len

    # -- views ------------------------------------------------------------------------------

    def reachable(self, worker_id: str) -> Worker | None:
        """The worker, while it still answers (up or draining)."""
        w = self.workers.get(worker_id)
        return w if w is not None and w.live else None

    def live(self, role: str) -> list[WorkerView]:
        """The workers of ``role`` that take new requests, as the placement sees them."""
        out = []
        if role == "prefill":
            out += [self._group_view(g) for g in self.groups.values() if g.up]
        for w in self.workers.values():
            if w.role == role and w.state == "up" and not w.group:
                hb = w.hb
                out.append(
                    WorkerView(
                        w.worker_id,
                        role,
                        w.host,
                        hb.running if hb else 0,
                        hb.waiting if hb else 0,
                        hb.kv_usage if hb else 0.0,
                    )
                )
        return out

    def _group_view(self, g: Group) -> WorkerView:
        ws = [self.workers[g.members[i]] for i in range(g.stages)]
        hbs = [w.hb for w in ws if w.hb is not None]
        return WorkerView(
            g.unit_id,
            "prefill",
            ws[0].host,
            max((hb.running for hb in hbs), default=0),
            max((hb.waiting for hb in hbs), default=0),
            max((hb.kv_usage for hb in hbs), default=0.0),
            stages=g.stages,
            chunk_tokens=g.chunk_tokens,
        )

    def serving(self) -> bool:
        """A prefill unit (a worker alone or a whole group) and a decode worker are up (any
        thread)."""
        ws = list(self.workers.values())
        decode = any(w.role == "decode" and w.state == "up" for w in ws)
        return decode and (self.count_up("prefill") > 0 or self.count_groups_up() > 0)

    def probes_pending(self) -> bool:
        """Some live prefill worker has not answered a shared-memory probe yet (any thread)."""
        return any(w.live and w.shm_pending for w in list(self.workers.values()))

    def count_up(self, role: str) -> int:
        """Workers of ``role`` up, a group's stages not counted."""
        ws = list(self.workers.values())
        return sum(w.role == role and w.state == "up" and not w.group for w in ws)

    def count_groups_up(self) -> int:
        return sum(g.up for g in list(self.groups.values()))

    def status(self) -> dict[str, dict]:
        """Every worker that ever registered: its state (up, draining, dead, left) and what its
        last heartbeat said (any thread; /health and /metrics show these)."""
        out = {}
        now = time.monotonic()
        for w in list(self.workers.values()):
            hb = w.hb
            out[w.worker_id] = {
                "role": w.role,
                "state": w.state,
                "pid": w.pid,
                "host": w.host,
                "running": hb.running if hb else 0,
                "waiting": hb.waiting if hb else 0,
                "kv_usage": hb.kv_usage if hb else 0.0,
                "used_blocks": hb.used_blocks if hb else 0,
                "staging_used": hb.staging_used if hb else 0,
                "transfers": hb.transfers if hb else 0,
                "finished": dict(hb.finished) if hb else {},
                "heartbeat_age_s": round(max(0.0, now - w.last_seen), 3),
                "heartbeat_gap_max_s": round(w.heartbeat_gap_max, 3),
            }
            if w.group:
                out[w.worker_id]["group"] = w.group
                out[w.worker_id]["stage"] = f"{w.stage}/{w.stages}"
                out[w.worker_id]["hidden_bytes_sent"] = hb.hidden_bytes_sent if hb else 0
            if w.role == "prefill":  # which decode workers it reaches by shared memory
                out[w.worker_id]["shm_peers"] = sorted(w.shm_peers)
                out[w.worker_id]["kv_transports"] = dict(w.kv_transports)
        return out

    def reporting(self) -> list[Worker]:
        """The live workers that have sent a heartbeat (any thread)."""
        return [w for w in list(self.workers.values()) if w.live and w.hb]

    def prefix_blocks(self, worker_id: str, block_hashes: list[bytes]) -> int:
        """How many leading blocks of a chain the worker holds, by its events (a hint)."""
        return self.blocks.match(worker_id, block_hashes)
