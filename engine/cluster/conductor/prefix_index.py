"""Which KV blocks each instance holds, as the Conductor knows it: a hint built from events.

Instances and pool services publish ``stored`` and ``removed`` block events
(engine/kvstore/block_events.py). Events can be lost (ZeroMQ PUB drops for slow subscribers), so
the index is a hint: a wrong hint costs a recompute or a failed copy, never wrong data (the
instance confirms every block it loads). The router keeps one too, of every worker and pool.

The Conductor also records a placement as soon as it decides it ("after assignment the Conductor
updates the chosen instance's cache", Mooncake §4.1), so a burst of requests sharing a prefix
finds it before the first one's ``stored`` event arrives.

Keys are any hashable: 32-byte hashes in the cluster, the trace's integer block ids in the
simulator.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence

from engine.kvstore.block_events import BlockEvent, BlockEventError

EventError = BlockEventError  # a malformed event


class PrefixIndex:
    """Block keys per holder (a prefill instance or a pool)."""

    def __init__(self, namespace: str | None = None) -> None:
        self.namespace = namespace  # events for another namespace (another model) are ignored
        self._held: dict[str, set[Hashable]] = {}

    def add_holder(self, holder: str) -> None:
        self._held.setdefault(holder, set())

    def remove_holder(self, holder: str) -> None:
        self._held.pop(holder, None)

    def holders(self) -> list[str]:
        return list(self._held)

    def stored(self, holder: str, keys: Iterable[Hashable]) -> None:
        held = self._held.get(holder)
        if held is not None:
            held.update(keys)

    def removed(self, holder: str, keys: Iterable[Hashable]) -> None:
        held = self._held.get(holder)
        if held is not None:
            held.difference_update(keys)

    def apply(self, holder: str, event: BlockEvent | Mapping) -> bool:
        """Apply a published event (or the map of one); False if it was for another namespace
        or an unknown holder. A malformed event raises EventError naming the field."""
        event = BlockEvent.of(event)
        ns = event.namespace
        if self.namespace is not None and ns is not None and ns != self.namespace:
            return False
        if holder not in self._held:
            return False
        (self.stored if event.kind == "stored" else self.removed)(holder, event.keys)
        return True

    def match(self, holder: str, keys: Sequence[Hashable]) -> int:
        """How many leading keys the holder has (0 for an unknown holder)."""
        held = self._held.get(holder)
        if not held:
            return 0
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def count(self, holder: str) -> int:
        return len(self._held.get(holder, ()))
