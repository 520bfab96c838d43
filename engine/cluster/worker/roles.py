"""The roles a worker runs, and what the worker's loop (worker.py) asks of them.

A role is what one worker does apart from the worker's own sockets and presence: it takes the
router's messages for its role, runs its engine's step and handles what came of it, hands
messages for the router to ``emit``, and owns what its role needs beyond the engine (the KV
sender or receiver that is the engine's connector, a staging arena, a block copier, a hidden-state
link). The worker runs every role the same way, through the methods of ``Role``; nothing in it
asks which role it runs. One role a module: ``prefill_role.py`` (a prefill worker),
``decode_role.py`` (a decode worker), ``stage_role.py`` (a stage of a pipelined prefill group).

A role is built on an engine, so tests drive the roles in one process to check the KV path
without process plumbing; ``for_worker`` builds one with its engine and what it owns in a worker
process.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any, NamedTuple

import zmq

from engine.cluster import messages as m
from engine.cluster.worker.worker_config import WorkerConfig
from engine.core.llm_engine import LLMEngine
from engine.outputs import RequestOutput

Emit = Callable[[m.Message], None]


def engine_priority(engine: LLMEngine, priority: int) -> int:
    """The priority a worker's engine is given for a request the router sent with ``priority``:
    itself under the priority scheduling policy, 0 under fcfs (the worker serves in arrival
    order what the router admitted, rather than refusing it: the router's policy is what
    clients see, and ``engine cluster`` gives the workers its own)."""
    return priority if engine.scheduler.config.policy == "priority" else 0


# The router's messages for a worker's role that are neither work nor an abort: a role acts on
# those it knows and ignores the others.
ROLE_MESSAGES = (m.FirstTokens, m.SourceGone, m.ShmProbe, m.CopyBlocks)


class WorkerSeams(NamedTuple):
    """What a worker lends the role it starts (``Role.for_worker``)."""

    ctx: zmq.Context
    worker_id: str
    emit: Emit  # a message for the router, sent by the worker's loop
    wake: Callable[[], None]  # from any thread: interrupt the worker's poll
    # (engine config, connector factory, stage_io=None) -> the engine, with the worker's own
    # seams set (its block events)
    make_engine: Callable[..., LLMEngine]


class Role:
    """What a worker's loop asks of its role. The router's work and aborts, and the engine's
    outputs, are each role's own (``handle``, ``abort``, ``after_step``); the rest has a default
    for a role that has nothing of it."""

    request_type: type[m.Message]  # the work the router sends this role
    engine: LLMEngine
    worker_id: str
    emit: Emit

    @classmethod
    def for_worker(cls, cfg: WorkerConfig, seams: WorkerSeams) -> Role:
        """The role with its engine and all it owns in a worker process."""
        raise NotImplementedError

    # -- the router's messages and the engine's outputs ---------------------------------------

    def handle(self, msg: Any) -> None:
        """A ``request_type`` message: the router's work for this role."""
        raise NotImplementedError

    def abort(self, rid: str) -> None:
        raise NotImplementedError

    def after_step(self, outputs: list[RequestOutput]) -> None:
        raise NotImplementedError

    @property
    def num_requests(self) -> int:
        """Requests this role holds (in the engine or not yet): a draining worker waits for 0."""
        raise NotImplementedError

    def control(self, msg: m.Message) -> None:
        """One of ``ROLE_MESSAGES``: acted on when this role knows it, else ignored."""

    # -- the worker's loop ------------------------------------------------------------------

    def sockets(self) -> list[zmq.Socket]:
        """The role's own sockets the worker's loop polls (readable ones go to ``poll``)."""
        return []

    def poll(self, readable: Container, now: float) -> None:
        """Between engine steps: the role's news (its ``readable`` sockets, transfers that
        ended, hidden states that came, deadlines)."""

    def step(self) -> bool:
        """One engine step, its outputs handled. True when it ran nothing because its inputs
        have not come: the worker's loop then sleeps until something wakes it."""
        self.after_step(self.engine.step())
        return False

    # -- the worker's presence (presence.py) ------------------------------------------------

    def registration(self) -> dict[str, Any]:
        """The role's fields of the worker's ``Register``: where peers reach what it owns."""
        return {}

    def heartbeat(self) -> dict[str, Any]:
        """The role's fields of a ``Heartbeat`` (called on the heartbeat thread)."""
        return {"staging_used": 0}

    def close(self) -> None:
        """Close what the role owns, the engine's connector first."""
        if self.engine.connector is not None:
            self.engine.connector.close()


def mooncake_endpoint(cfg: WorkerConfig):
    """The worker's Mooncake Transfer Engine endpoint when its KV transport is Mooncake."""
    if cfg.transport != "mooncake":
        return None
    from engine.cluster.transfer.mooncake import MooncakeEndpoint

    return MooncakeEndpoint(cfg.kv_host, cfg.mooncake_metadata)
