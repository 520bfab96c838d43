"""Stored responses, for ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``: a
bounded map in memory, the oldest evicted first when it is full.

Each entry holds the response object (as ``GET`` returns it) and the conversation after it (its
input, with the stored conversation it continued, and its output, as chat messages; not its
instructions), so that a continuation needs only this one entry, whatever was evicted since. An
entry's conversation fits the model's context (a longer one was refused), which bounds its size.
Nothing survives a restart.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from engine.server.openai_protocol import ChatMessage

DEFAULT_STORE_SIZE = 1024
MAX_STORE_SIZE = 1_000_000


@dataclass(frozen=True)
class ResponsesConfig:
    """``store_size``: responses kept at most (``--responses-store-size``); 0 keeps none, so
    that every ``previous_response_id`` is unknown."""

    store_size: int = DEFAULT_STORE_SIZE

    def __post_init__(self) -> None:
        if not 0 <= self.store_size <= MAX_STORE_SIZE:
            raise ValueError(
                f"responses store_size must be in [0, {MAX_STORE_SIZE}], got {self.store_size}"
            )


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object, as created
    conversation: tuple[ChatMessage, ...]  # input and output, without the instructions


class ResponseStore:
    """Thread-safe: requests are prepared on the preparation threads and finish on the loop."""

    def __init__(self, size: int = DEFAULT_STORE_SIZE) -> None:
        self.size = ResponsesConfig(size).store_size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        with self._lock:
            self._items[response_id] = entry
            self._items.move_to_end(response_id)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
