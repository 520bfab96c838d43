"""The Conductor behind the router's ``Placement`` interface (engine/cluster/placement.py).

That interface is one call, ``place(prompt_token_ids, prefill, decode) -> (prefill, decode) |
None``, with the live workers as the router sees them and no request id, clock or lifecycle. This
adapter supplies what the Conductor needs from it:

- membership: workers that appear are registered, workers that vanish are removed;
- block hashes: the prompt's chained block hashes (engine/kvcache/prefix_hash.py, the names the
  workers and pools publish in their ``stored``/``removed`` events, fed through ``on_event``);
- a clock (``clock``, monotonic by default: this adapter is the router's side, not the
  Conductor's, which stays pure) and request ids of its own;
- a lifecycle: with no report of prefill and decode ends, a placed request is taken as done with
  its prefill at the estimated end and with its decode ``decode_time_s`` later, so the
  Conductor's queues drain as estimated instead of growing without bound. A router that reports
  the real events should drive ``conductor`` through decision.Placer instead.

A rejection returns None (the router answers it) and leaves the Decision, with its reason, in
``last_decision`` for a 429.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence

from engine.cluster.conductor import Conductor
from engine.cluster.decision import Decision
from engine.kvcache.prefix_hash import hash_blocks


class ConductorPlacement:
    def __init__(
        self,
        conductor: Conductor,
        block_size: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if conductor.config.block_tokens != block_size:
            raise ValueError(
                f"block_size {block_size} must equal the Conductor's block_tokens "
                f"{conductor.config.block_tokens} (token counts are blocks x block size)"
            )
        self.conductor = conductor
        self.block_size = block_size
        self.clock = clock
        self.last_decision: Decision | None = None
        self._ids = itertools.count()
        self._known: dict[str, str] = {}  # worker id -> role
        self._due: list[tuple[float, int, str, str]] = []  # (time, seq, what, request id)
        self._seq = itertools.count()

    def _sync(self, prefill: Sequence, decode: Sequence, now: float) -> None:
        live = {w.worker_id: "prefill" for w in prefill}
        live.update({w.worker_id: "decode" for w in decode})
        for wid in [w for w in self._known if w not in live]:
            self.conductor.remove_instance(wid, now)
            del self._known[wid]
        for wid, role in live.items():
            if wid not in self._known:
                self.conductor.add_instance(wid, role)
                self._known[wid] = role

    def _expire(self, now: float) -> None:
        while self._due and self._due[0][0] <= now:
            t, _, what, rid = heapq.heappop(self._due)
            if what == "prefill":
                self.conductor.on_prefill_done(rid, t)
                end = t + self.conductor.decode_time_s()
                heapq.heappush(self._due, (end, next(self._seq), "finish", rid))
            else:
                self.conductor.on_request_finished(rid, t)

    def on_event(self, worker_id: str, event: dict) -> bool:
        return self.conductor.on_event(worker_id, event)

    def place(self, prompt_token_ids: Sequence[int], prefill: Sequence, decode: Sequence):
        now = self.clock()
        self._sync(prefill, decode, now)
        self._expire(now)
        keys = hash_blocks(list(prompt_token_ids), self.block_size)
        rid = f"placement-{next(self._ids)}"
        d = self.conductor.decide(rid, keys, max(1, len(prompt_token_ids)), now)
        self.last_decision = d
        if not d.accepted:
            return None
        heapq.heappush(self._due, (now + d.est_ttft_s, next(self._seq), "prefill", rid))
        return (d.prefill, d.decode)
