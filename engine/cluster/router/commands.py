"""What callers' threads ask of the router's IO thread (``RouterIO.command``): one frozen type per
command, so the path of a request can be followed by its types. The IO thread runs them in order
(``Router.on_command``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.cluster.placement import Placement
    from engine.cluster.router.request import RouterRequest


@dataclass(frozen=True, slots=True)
class Submit:
    """Place and run a request."""

    request: RouterRequest


@dataclass(frozen=True, slots=True)
class Abort:
    """End a request now (its workers are told); unknown ids are a no-op."""

    request_id: str


@dataclass(frozen=True, slots=True)
class AbortAll:
    """End every request in flight (the router is stopping)."""


@dataclass(frozen=True, slots=True)
class AddPool:
    """Follow a pool service's block events (``Router.add_pool``)."""

    source: str
    events_address: str


@dataclass(frozen=True, slots=True)
class SetPlacement:
    """Place requests with another policy from now on."""

    placement: Placement


RouterCommand = Submit | Abort | AbortAll | AddPool | SetPlacement
