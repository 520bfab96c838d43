"""A prefill instance's queue as the Conductor estimates it: how long each request placed there
keeps it (a group: each stage) busy, in the order the instance serves them.

Under the fcfs scheduling policy that order is arrival. Under ``priority`` the instance's own
scheduler takes its waiting requests by (priority, arrival) (engine/core/scheduler.py), so the
queue is kept in that order behind its head (the request being prefilled, which a later arrival
does not displace: a scheduler preempts nothing running to admit a waiting request), and a new
request waits only for the head and the requests of a priority value at most its own.
"""

from __future__ import annotations

from engine.cluster.conductor.pipeline import SINGLE, PipelineShape


class PrefillQueue:
    def __init__(self, instance_id: str, shape: PipelineShape = SINGLE) -> None:
        self.instance_id = instance_id
        self.shape = shape
        self.queue: dict[str, float] = {}  # request -> estimated seconds, in service order
        self.priority: dict[str, int] = {}  # request -> its priority (under priority only)
        self.queued_s = 0.0
        self.head_started = 0.0

    def queue_s(self, now: float, priority: int | None = None) -> float:
        """Seconds before a request arriving now would start: the head's remaining time and
        every request queued behind it (``priority`` None: fcfs), or only those it would not
        go ahead of (a priority value at most ``priority``)."""
        if not self.queue:
            return 0.0
        head = next(iter(self.queue.values()))
        done = min(head, max(0.0, now - self.head_started))
        if priority is None:
            return max(0.0, self.queued_s - done)
        ahead = sum(
            s for rid, s in list(self.queue.items())[1:] if self.priority.get(rid, 0) <= priority
        )
        return max(0.0, head - done + ahead)

    def push(
        self, request_id: str, seconds: float, now: float, priority: int | None = None
    ) -> list[str]:
        """Queue a request (``priority`` None: at the back); returns those it goes ahead of,
        whose start moves ``seconds`` later."""
        if not self.queue:
            self.head_started = now
        self.queued_s += seconds
        if priority is None or not self.queue:
            self.queue[request_id] = seconds
            if priority is not None:
                self.priority[request_id] = priority
            return []
        items = list(self.queue.items())
        # Behind the head, the queue is in (priority, arrival) order: after its equals.
        at = 1 + sum(1 for rid, _ in items[1:] if self.priority.get(rid, 0) <= priority)
        self.priority[request_id] = priority
        items.insert(at, (request_id, seconds))
        self.queue = dict(items)
        return [rid for rid, _ in items[at + 1 :]]

    def pop(self, request_id: str, now: float) -> bool:
        if request_id not in self.queue:
            return False
        was_head = next(iter(self.queue)) == request_id
        self.queued_s -= self.queue.pop(request_id)
        self.priority.pop(request_id, None)
        if not self.queue:
            self.queued_s = 0.0  # no float drift
        elif was_head:
            self.head_started = now
        return True
