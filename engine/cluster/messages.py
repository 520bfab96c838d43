"""The cluster's typed messages: a msgpack header map plus raw frames for bytes (never pickle).

Socket roles (fixed):

- router ROUTER <- worker DEALER (control): ``Register``, ``Outputs``, ``DecodeReady``,
  ``TransferFailed``, ``RequestError``, ``Goodbye`` up; ``PrefillRequest``, ``DecodeRequest``,
  ``Abort`` down; ``ShmProbe`` down and ``ShmReach`` up prove which pairs share /dev/shm.
  A second DEALER per worker carries only ``Heartbeat`` (its own thread, so a
  long forward never delays one).
- worker PUB -> router SUB: block events (``BlockEvent`` of engine/kvstore/block_events.py, the
  pool service's format: one msgpack map per message).
- prefill PUSH -> prefill PULL (block copies, hot-prefix replication): ``BlockData``; the
  router asks the source with ``CopyBlocks``, the target answers ``CopyDone``.
- prefill PUSH -> decode PULL (KV): ``KVLayer`` (the layer's bytes as one raw frame over TCP;
  no frame over shared memory, where they already lie in the decode worker's staging area),
  ``KVDone`` (first tokens and sampler state; one raw frame per seeded generator), ``KVAbort``.
- stage i PUSH -> stage i+1 PULL (hidden states): ``StageHidden``, ``StageAbort`` (a prefill
  group's chunked pipeline: a chunk's hidden states after stage i's layers,
  engine/cluster/worker/stage_link.py).

Wire form (engine/ipc/codec.py): frame 0 is ``{"t": TYPE, field: value, ...}``; frames 1.. are
the message's ``frames``. A field with a default may be left out. ``decode`` checks everything a
peer could get wrong (sizes, the type, every field's type, unknown fields, the number of frames)
and raises ``MessageError`` naming it; it never raises anything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field
from typing import Annotated

from engine.ipc import codec
from engine.ipc.codec import Len, Range

MAX_HEADER_BYTES = 1 << 20  # a header holds token ids (a long prompt is ~100k ints)
MAX_FRAME_BYTES = 1 << 30  # one layer of one chunk of KV
MAX_FRAMES = 64


class MessageError(codec.CodecError):
    """A frame that is not a valid message (the peer is told; nothing else is disturbed)."""


class Message(codec.Message):
    @property
    def TYPE(self) -> str:  # noqa: N802 (the kind, by the name the cluster's code reads)
        return self.KIND


# -- control: worker -> router -----------------------------------------------------------------


class Register(Message, kind="register"):
    worker_id: str
    role: str  # "prefill" | "decode"
    pid: int
    model: str
    max_model_len: int
    kv_address: str  # decode: the PULL endpoint prefill workers push KV to; prefill: ""
    shm_path: str  # decode: its staging arena file ("" when it has none)
    transport: str  # "shm" | "tcp"
    host: str  # hostname, shown in /health (never taken as proof of shared memory)
    events_address: str = ""  # its PUB socket of block events (the pool service's format)
    mooncake_address: str = ""  # decode over Mooncake: its Transfer Engine's address
    arena_addr: int = 0  # and the staging arena's registered base address
    copy_address: str = ""  # prefill: the PULL endpoint other prefill workers copy blocks to
    # decode over shm: the digest of the nonce beside its staging arena (transfer/shm_proof.py),
    # which a prefill worker proves it can read before the router lets it write there
    shm_digest: str = ""
    pid_ns: str = ""  # its pid namespace ("dev:inode"), compared only where /dev/shm is shared
    # prefill: a stage of a pipelined prefill group (chunked pipeline parallelism): the group's
    # name ("" for a single prefill worker), this stage (from 0) of ``stages``, the group's chunk
    # (the stage's prefill budget), and, after the first stage, where the stage before sends its
    # hidden states (stage_link.py)
    group: str = ""
    stage: int = 0
    stages: int = 1
    chunk_tokens: int = 0
    hidden_address: str = ""


class Heartbeat(Message, kind="heartbeat"):
    worker_id: str
    state: str  # "up" | "draining"
    running: int
    waiting: int
    kv_usage: float
    used_blocks: int
    staging_used: int  # bytes held for transfers in: KV staging (decode), hidden states (a stage)
    transfers: int  # transfers in flight (decode: receiving; prefill: sending)
    finished: dict = field(default_factory=dict)  # its engine's finished requests by reason
    # Decode steps since the last heartbeat: how many, their mean seconds, running requests and
    # KV tokens (the Conductor's time-between-tokens model is linear in both, so means fit it).
    steps: int = 0
    step_s: float = 0.0
    step_batch: float = 0.0
    step_tokens: float = 0.0
    hidden_bytes_sent: int = 0  # a group's stage: hidden-state bytes sent to the next stage
    spec: dict = field(default_factory=dict)  # its engine's speculative decoding counters
    # Its engine's prefix-cache lookups since start, in prompt tokens: looked up, found.
    prefix_queries: int = 0
    prefix_hits: int = 0


class Goodbye(Message, kind="goodbye"):
    """The worker leaves (drained or stopping): nothing more is placed on it."""

    worker_id: str


class DecodeReady(Message, kind="decode_ready"):
    """The decode worker's answer to ``DecodeRequest``: where the KV goes, or why not."""

    request_id: str
    offset: int  # of the request's staging area in the arena
    nbytes: int
    error: str | None = None  # staging full, draining...
    full: bool = False  # the error is a full staging area: room comes as transfers end


class Outputs(Message, kind="outputs"):
    """Tokens of one request, per choice: ``{"index", "offset", "token_ids", "text_offset",
    "text", "logprobs", "finish_reason", "stop_reason"}``; offsets say where in the choice's
    tokens and text this delta starts, so a repeated delta (a recompute) is dropped."""

    request_id: str
    worker_id: str
    outputs: list[dict]
    num_cached_tokens: int = 0


class TransferFailed(Message, kind="transfer_failed"):
    """The KV of a request did not arrive whole; ``recompute`` says what the decode worker does
    about it."""

    request_id: str
    reason: str
    recompute: bool  # the decode worker prefills the prompt itself (policy "recompute")


class RequestError(Message, kind="request_error"):
    request_id: str
    worker_id: str
    code: int  # HTTP-like: 400 bad input, 429/503 retry elsewhere, 500
    message: str
    param: str | None = None  # a 400's field (engine/errors.py's RequestError.param)


class ShmReach(Message, kind="shm_reach"):
    """A prefill worker's answer to ``ShmProbe``: the nonce it read beside the decode worker's
    staging arena, in hex ("" when it could not: another /dev/shm). The router checks it against
    the decode worker's registered digest. (Hex: the header takes no raw bytes.)"""

    worker_id: str
    decode_id: str
    nonce: Annotated[str, Len(0, 128)] = ""


class CopyDone(Message, kind="copy_done"):
    """The target prefill worker of a block copy stored ``blocks`` of them in its prefix cache
    (0 and ``error`` when none arrived or they were bad)."""

    request_id: str  # the request the copy was planned for
    worker_id: str
    blocks: int
    error: str = ""


# -- control: router -> worker -----------------------------------------------------------------


class _PromptRequest(Message):
    """A request's prompt and sampling parameters (ipc/wire.py's params_to_wire), and its
    priority (vLLM's, lower first), which a worker under the priority scheduling policy orders
    its queue by (one under fcfs serves it in arrival order: roles.engine_priority)."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict
    priority: Annotated[int, Range(-(2**63), 2**63 - 1)] = field(default=0, kw_only=True)


class DecodeRequest(_PromptRequest, kind="decode_request"):
    deadline_s: float  # seconds the transfer may take before the failure policy applies
    # The prefill worker placed with it: its pid, and whether the router proved that it shares
    # this worker's /dev/shm and pid namespace (transfer/shm_proof.py). Then the decode worker
    # watches that pid: the request's staging area is freed, and its transfer failed, as soon as
    # that process is gone. Else the pid means nothing here (another host or container).
    sender_pid: int = 0
    sender_local: bool = False
    # KVDone messages that end the transfer: 1 from a single prefill worker, one per stage from
    # a prefill group (each sends its own layers).
    senders: int = 1
    # A group's stages in order (sender_pid is then 0): each one's pid where the router proved
    # it shares this worker's /dev/shm and pid namespace (watched: a released staging area is
    # freed once every stage that may write into it is done or gone), -1 where it is elsewhere
    # (it sends frames), 0 unknown.
    stage_pids: list[int] = field(default_factory=list)


class PrefillRequest(_PromptRequest, kind="prefill_request"):
    decode_id: str
    kv_address: str
    transport: str  # "shm" | "tcp"
    shm_path: str
    offset: int
    nbytes: int
    stream_layers: bool = True  # False: every layer leaves after the prefill (benchmarks)
    peer_address: str = ""  # mooncake: the decode worker's Transfer Engine
    peer_base: int = 0  # mooncake: its staging arena's address
    # A stage of a prefill group: the next stage's hidden-state endpoint ("" on the last);
    # ``prefix_tokens``, on the first stage: the cached prefix every stage of the group holds (by
    # their block events), at most which it reuses (-1: no cap); ``deadline_s``, after the first:
    # how long it waits for the hidden states of the stage before.
    stage_next: str = ""
    prefix_tokens: int = -1
    deadline_s: float = 120.0


class ShmProbe(Message, kind="shm_probe"):
    """To a prefill worker: read the nonce beside this decode worker's staging arena and answer
    ``ShmReach`` (transfer/shm_proof.py); until a matching answer, KV to it goes over TCP."""

    decode_id: str
    shm_path: str


class CopyBlocks(Message, kind="copy_blocks"):
    """To the source prefill worker: send the cached blocks ``start_block..`` of the prefix
    ``token_ids`` (whole blocks) to the prefill worker whose copy endpoint is ``dst_address``
    (hot-prefix replication, planned by the Conductor)."""

    request_id: str
    token_ids: list[int]
    start_block: int
    dst_address: str


class Abort(Message, kind="abort"):
    """The client gave up on the request: drop it and free what it holds."""

    request_id: str


class FirstTokens(Message, kind="first_tokens"):
    """To the decode worker: the first token of each choice, as the router relayed them from the
    prefill worker (its ``Outputs`` entries). If the KV transfer then fails before KVDone
    arrives, the decode worker recomputes from these tokens instead of sampling its own first
    token, which the client has not seen."""

    request_id: str
    outputs: list[dict]


class SourceGone(Message, kind="source_gone"):
    """To the decode worker: the prefill worker sending request_id's KV died (the router saw
    its heartbeats stop). A transfer still under way fails at once instead of waiting out its
    deadline; on one host the decode worker sees the process go by itself."""

    request_id: str
    worker_id: str


# -- KV: prefill -> decode ---------------------------------------------------------------------


class KVLayer(Message, kind="kv_layer"):
    """Tokens [start, end) of one layer; over TCP two frames follow (K rows, V rows)."""

    request_id: str
    layer: int
    start: int
    end: int
    checksum: int  # crc32 of the K bytes then the V bytes
    inline: bool  # the bytes follow as frames 1 and 2 (TCP); else they lie in the staging area

    def expected_frames(self) -> int:
        return 2 if self.inline else 0


class KVDone(Message, kind="kv_done"):
    """Every layer of every chunk was sent. ``firsts``: per choice the first token, sampled on
    the prefill side, and the state that continues it: ``{"index", "token", "logprob",
    "finish_reason", "stop_reason", "text", "sent_text_len", "text_limit", "generator"}``
    (``generator``: its state follows as the next raw frame)."""

    request_id: str
    num_tokens: int
    num_layers: int
    num_cached_tokens: int
    firsts: list[dict]
    # The layers this sender sent, [layer_start, layer_end) (layer_end 0: to the last): all of
    # them from a single prefill worker; its own range from each stage of a prefill group, whose
    # last stage alone sends ``firsts`` (the decode worker waits for DecodeRequest.senders).
    layer_start: int = 0
    layer_end: int = 0
    # cluster/transfer/seal.py: the request id, prompt, pieces sent and first tokens, hashed; the
    # decode worker refuses a transfer whose seal is not the one it computes (hex: the header
    # holds no msgpack bin values)
    seal: str = ""

    def expected_frames(self) -> int:
        return sum(1 for f in self.firsts if isinstance(f, dict) and f.get("generator"))


class KVAbort(Message, kind="kv_abort"):
    """The prefill worker gave up sending the request's KV (``reason`` says why); a stage of a
    group names its first layer (as its KVDone would), which tells the stages apart."""

    request_id: str
    reason: str
    layer_start: int = 0


# -- hidden states: pipeline stage i -> stage i+1 ------------------------------------------------


class StageHidden(Message, kind="stage_hidden"):
    """Rows [start, end) of a request's hidden states after the sending stage's layers: one raw
    frame follows, the rows' bytes ([end - start, hidden_size] in the model's dtype, C order),
    whose ``checksum`` is staging.checksum of that frame (the KV path's). A request's first frame
    may start at s0 > 0 (the first stage found tokens [0, s0) in its prefix cache); rows before
    the first frame's start are never sent. Rows may be sent again (a recompute on the stage
    before): the receiver keeps the first copy."""

    request_id: str
    start: int
    end: int
    checksum: int

    def expected_frames(self) -> int:
        return 1


class StageAbort(Message, kind="stage_abort"):
    """The stage before gave up on the request (``reason`` says why): no more rows come."""

    request_id: str
    reason: str


# -- blocks: prefill -> prefill ---------------------------------------------------------------


class BlockData(Message, kind="block_data"):
    """Blocks ``start_block .. start_block + num_blocks`` of the prefix ``token_ids`` (the target
    recomputes their chained hashes from the tokens); one raw frame of their KV, laid out as the
    paged cache's [layers, 2, num_blocks, block_size, kv_heads, head_dim], when num_blocks > 0."""

    request_id: str
    worker_id: str  # the source
    token_ids: list[int]
    start_block: int
    num_blocks: int
    checksum: int  # crc32 of the frame

    def expected_frames(self) -> int:
        return 1 if self.num_blocks > 0 else 0


MESSAGES: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (
        Register,
        Heartbeat,
        Goodbye,
        DecodeReady,
        Outputs,
        TransferFailed,
        RequestError,
        CopyDone,
        ShmReach,
        DecodeRequest,
        PrefillRequest,
        ShmProbe,
        CopyBlocks,
        Abort,
        FirstTokens,
        SourceGone,
        KVLayer,
        KVDone,
        KVAbort,
        BlockData,
        StageHidden,
        StageAbort,
    )
}


CODEC = codec.Codec(
    "t",
    MESSAGES,
    error=MessageError,
    max_header_bytes=MAX_HEADER_BYTES,
    max_frame_bytes=MAX_FRAME_BYTES,
    max_frames=MAX_FRAMES,
)


def encode(msg: Message) -> list:
    return CODEC.encode(msg)


def decode(frames: Sequence, check_frames: bool = True) -> Message:
    """A message from raw frames; MessageError naming the problem if they are not one.
    ``check_frames=False`` decodes a header alone (its data frames are read separately)."""
    return CODEC.decode(frames, check_frames)  # type: ignore[return-value]
