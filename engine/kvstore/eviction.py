"""Eviction policies of the block store, behind one interface.

A policy orders the keys a tier holds; it holds no data. The tier tells it about inserts,
accesses and removals and asks it for a victim, skipping keys that are pinned (read leases,
half-written blocks). Keys may be any hashable (the store uses 32-byte hashes, the trace replay
ints).

- ``lru``: least recently inserted or accessed first (the default; the Mooncake paper finds it
  best on its traces, "due to temporal proximity").
- ``lfu``: fewest accesses since insertion first; ties by least recent.
- ``length``: the Mooncake paper's LengthAwareCache: LFU-like, but among equally frequent blocks
  those that occur later in requests (higher ``position``, the block's index in its chain) go
  first, since a later block is shared only by requests that share everything before it.

LRU is an OrderedDict (O(1)). LFU and length-aware keep a heap with lazy deletion: an access
pushes a new entry and the stale one is skipped when it surfaces (O(log n) amortised; the heap is
rebuilt when stale entries outnumber live ones).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Container, Hashable

from engine.pool_spec import POLICIES  # the names the kv_pool string accepts

_NOTHING: frozenset = frozenset()


class EvictionPolicy(ABC):
    name: str

    @abstractmethod
    def on_insert(self, key: Hashable, position: int = 0) -> None:
        """A new key (an insert of a present key counts as an access)."""

    @abstractmethod
    def on_access(self, key: Hashable) -> None: ...

    @abstractmethod
    def on_remove(self, key: Hashable) -> None:
        """Forget key (evicted or removed); unknown keys are ignored."""

    @abstractmethod
    def victim(self, skip: Container = _NOTHING) -> Hashable | None:
        """The key to evict next, not in ``skip``; None if every key is skipped. Does not
        remove it: the tier calls on_remove once the block is gone."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: Hashable) -> bool: ...

    @abstractmethod
    def clear(self) -> None: ...


class LruPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()  # first = evicted first

    def on_insert(self, key: Hashable, position: int = 0) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, skip: Container = _NOTHING) -> Hashable | None:
        for key in self._order:
            if key not in skip:
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order

    def clear(self) -> None:
        self._order.clear()


class _HeapPolicy(EvictionPolicy):
    """Evicts the key with the smallest ``_priority``; ties by least recent (the seq)."""

    def __init__(self) -> None:
        self._live: dict[Hashable, list[int]] = {}  # key -> [freq, position, seq]
        self._heap: list[tuple] = []  # (*priority, seq, key); seq is unique, keys never compared
        self._seq = 0

    def _priority(self, freq: int, position: int) -> tuple:
        raise NotImplementedError

    def _push(self, key: Hashable, state: list[int]) -> None:
        self._seq += 1
        state[2] = self._seq
        heapq.heappush(self._heap, (*self._priority(state[0], state[1]), self._seq, key))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [(*self._priority(f, p), s, k) for k, (f, p, s) in self._live.items()]
            heapq.heapify(self._heap)

    def on_insert(self, key: Hashable, position: int = 0) -> None:
        state = self._live.get(key)
        if state is None:
            state = self._live[key] = [1, position, 0]
        else:
            state[0] += 1
        self._push(key, state)

    def on_access(self, key: Hashable) -> None:
        state = self._live.get(key)
        if state is not None:
            state[0] += 1
            self._push(key, state)

    def on_remove(self, key: Hashable) -> None:
        self._live.pop(key, None)  # its heap entries go stale

    def victim(self, skip: Container = _NOTHING) -> Hashable | None:
        heap, live = self._heap, self._live
        skipped = []
        found = None
        while heap:
            entry = heap[0]
            key, seq = entry[-1], entry[-2]
            state = live.get(key)
            if state is None or state[2] != seq:
                heapq.heappop(heap)  # stale
                continue
            if key in skip:
                skipped.append(heapq.heappop(heap))
                continue
            found = key
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    def clear(self) -> None:
        self._live.clear()
        self._heap.clear()


class LfuPolicy(_HeapPolicy):
    name = "lfu"

    def _priority(self, freq: int, position: int) -> tuple:
        return (freq,)


class LengthAwarePolicy(_HeapPolicy):
    name = "length"

    def _priority(self, freq: int, position: int) -> tuple:
        return (freq, -position)


def make_policy(name: str) -> EvictionPolicy:
    classes = {"lru": LruPolicy, "lfu": LfuPolicy, "length": LengthAwarePolicy}
    if name not in classes:
        raise ValueError(
            f"eviction policy {name!r} is unknown; choose one of {', '.join(POLICIES)}"
        )
    return classes[name]()
