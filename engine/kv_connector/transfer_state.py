"""One KV transfer as the decode worker's receiver sees it: where it is staged, which pieces of
which layers came, how it ended, and the checks a piece and the end of a transfer must pass
(receiver.py takes the messages and does the IO)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.cluster import messages as m
from engine.ipc.process_id import ProcessId
from engine.kv_connector.staging import KVLayout


@dataclass
class Transfer:
    request_id: str
    offset: int
    layout: KVLayout
    deadline: float  # monotonic
    pieces: list[list[tuple[int, int]]] = field(default_factory=list)  # per layer, token ranges
    inline: bool | None = None  # pieces come as frames (TCP, copied here) or were staged by the
    # sender (shared memory, Mooncake)
    error: str | None = None
    done: m.KVDone | None = None
    finished: bool = False  # KVDone or a failure was reported to the worker
    complete_time: float = 0.0  # monotonic time KVDone came
    last_piece_time: float = 0.0  # monotonic time the last layer piece came (benchmarks)
    children: set[str] = field(default_factory=set)  # engine requests still to load
    freed: bool = False
    sender_done: bool = False  # KVDone or KVAbort came: the sender writes no more
    released_at: float | None = None  # released before the sender was done (shared memory)
    writer: ProcessId | None = None  # shm: the prefill process that may write into the area
    sender: ProcessId | None = None  # the prefill process on this host that sends the KV
    may_write: bool = True  # False: no process can write into the area (gone, or off-host)

    @property
    def ok(self) -> bool:
        return self.done is not None and self.error is None

    def piece_problem(self, msg: m.KVLayer) -> str | None:
        """What is wrong with a layer piece before its bytes are looked at; None if nothing."""
        lay, T = self.layout, self.layout.num_tokens
        if not 0 <= msg.layer < lay.num_layers:
            return f"layer {msg.layer} is out of range [0, {lay.num_layers})"
        if not 0 <= msg.start < msg.end <= T:
            return f"layer {msg.layer}: tokens [{msg.start}, {msg.end}) out of range [0, {T})"
        if self.inline is not None and self.inline != msg.inline:
            return f"layer {msg.layer}: frames and staged pieces mixed in one transfer"
        for a, b in self.pieces[msg.layer]:
            if msg.start < b and a < msg.end:
                return f"layer {msg.layer}: tokens [{msg.start}, {msg.end}) delivered twice"
        return None

    def completion_problem(self, done: m.KVDone) -> str | None:
        """What ``KVDone`` leaves missing: every layer must cover every token once."""
        T = self.layout.num_tokens
        if done.num_tokens != T or done.num_layers != self.layout.num_layers:
            return f"KVDone for {done.num_tokens} tokens x {done.num_layers} layers, expected {T}"
        for i, pieces in enumerate(self.pieces):
            covered = sum(b - a for a, b in pieces)  # no overlaps: checked on arrival
            if covered != T:
                return f"layer {i} is missing: {covered} of {T} tokens arrived"
        return None
