"""One KV transfer as the decode worker's receiver sees it: where it is staged, which pieces of
which layers came, how it ended, and the checks a piece and the end of a transfer must pass
(receiver.py takes the messages and does the IO)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.cluster import messages as m
from engine.cluster.transfer.seal import seal
from engine.cluster.transfer.staging import KVLayout
from engine.ipc.process_id import ProcessId


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
    done: m.KVDone | None = None  # the KVDone that carried the first tokens
    senders: int = 1  # KVDone messages that end it (a prefill group: one per stage)
    done_ranges: list[tuple[int, int]] = field(default_factory=list)  # layers declared done
    reported: int = 0  # senders that said KVDone or KVAbort
    finished: bool = False  # KVDone or a failure was reported to the worker
    complete_time: float = 0.0  # monotonic time KVDone came
    last_piece_time: float = 0.0  # monotonic time the last layer piece came (benchmarks)
    children: set[str] = field(default_factory=set)  # engine requests still to load
    freed: bool = False
    sender_done: bool = False  # every sender said KVDone or KVAbort: none writes any more
    released_at: float | None = None  # released before the sender was done (shared memory)
    writer: ProcessId | None = None  # shm: the prefill process that may write into the area
    sender: ProcessId | None = None  # the prefill process on this host that sends the KV
    may_write: bool = True  # False: no process can write into the area (gone, or off-host)
    # A group's stages by their first layer: the process that may write into the area (None:
    # unknown, so it may), or absent where the stage is elsewhere; and which stages said
    # KVDone or KVAbort.
    writers: dict[int, ProcessId | None] = field(default_factory=dict)
    reported_by: set[int] = field(default_factory=set)
    # seal.py: the prompt's digest from the DecodeRequest (None: not told, no seal is checked)
    # and every piece verified, (layer, start, end, checksum)
    prompt_digest: bytes | None = None
    verified: list[tuple[int, int, int, int]] = field(default_factory=list)

    def seal_problem(self, done: m.KVDone) -> str | None:
        """Whether ``done`` seals the prompt this side expects, the pieces it verified for the
        sender's layers and the first tokens it carries; None if so (or no prompt was told)."""
        if self.prompt_digest is None:
            return None
        a, b = done.layer_start, done.layer_end or self.layout.num_layers
        mine = [p for p in self.verified if a <= p[0] < b]
        if done.seal != seal(self.request_id, self.prompt_digest, mine, done.firsts):
            return (
                "integrity: the KVDone's seal does not match this request's prompt, the KV "
                "pieces received and the first tokens it carries"
            )
        return None

    @property
    def ok(self) -> bool:
        return self.complete and self.done is not None and self.error is None

    @property
    def complete(self) -> bool:
        """Every sender's KVDone came (each one checked when it came)."""
        return len(self.done_ranges) == self.senders

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
        """What one sender's ``KVDone`` leaves wrong: each layer it declares must cover every
        token once, no other sender declared them, one sender only sends the first tokens, and
        once every sender's came, the layers are all there."""
        T, L = self.layout.num_tokens, self.layout.num_layers
        if done.num_tokens != T or done.num_layers != L:
            return f"KVDone for {done.num_tokens} tokens x {done.num_layers} layers, expected {T}"
        a, b = done.layer_start, done.layer_end or L
        if not 0 <= a < b <= L:
            return f"KVDone for layers [{a}, {b}): out of range [0, {L})"
        for c, d in self.done_ranges:
            if a < d and c < b:
                return f"layers [{max(a, c)}, {min(b, d)}) declared done by two senders"
        if done.firsts and self.done is not None:
            return "first tokens came from two senders"
        for i in range(a, b):
            covered = sum(y - x for x, y in self.pieces[i])  # no overlaps: checked on arrival
            if covered != T:
                return f"layer {i} is missing: {covered} of {T} tokens arrived"
        if len(self.done_ranges) + 1 == self.senders:  # the last one
            declared = sum(d - c for c, d in self.done_ranges) + b - a
            if declared != L:
                return f"the senders declared {declared} of {L} layers done"
            if not done.firsts and self.done is None:
                return "no sender sent the first tokens"
        return None
