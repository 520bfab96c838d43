"""Hot-prefix replication between prefill workers: named blocks copied from one prefix cache to
another, as the Conductor decides (conductor.py, ``kvcentric``).

The router sends the source ``CopyBlocks`` (the prefix's tokens and the first block to copy);
the source finds those blocks in its prefix cache by their chained hashes, gathers their KV into
one contiguous frame and pushes ``BlockData`` straight to the target's copy endpoint (never
through the router); the target checks it (sizes, crc32, the hashes recomputed from the tokens),
writes it into free blocks of its paged cache, names them in its prefix cache, and tells the
router ``CopyDone``, which then starts the request's prefill there. The copied blocks are cached
blocks like any other (unreferenced, evictable), so a copy never takes room a running request
needs: it turns free blocks into cached ones, which the allocator reuses in LRU order.

A copy that fails or comes late costs nothing but the recompute it was meant to save: the
prefill finds fewer cached blocks and computes the rest (the router waits for ``CopyDone`` only
until its ``copy_timeout_s``). Both ends run on the worker's engine thread, between steps, so the
cache is never written during a forward.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import zmq

from engine.cluster import messages as m
from engine.kvcache.prefix_hash import hash_blocks

log = logging.getLogger(__name__)

MAX_PEERS = 64  # PUSH sockets a source keeps (prefill workers of one cluster)


class Gathered(NamedTuple):
    num_blocks: int  # the run of blocks from start_block on that the source holds
    data: bytes  # their KV, [layers, 2, num_blocks, block_size, kv_heads, head_dim]


def block_bytes(kv: torch.Tensor) -> int:
    return kv[:, :, 0].numel() * kv.element_size()


def read_blocks(kv: torch.Tensor, blocks: Sequence[int]) -> torch.Tensor:
    """Cache blocks ``blocks`` of every layer, [layers, 2, n, block_size, kv_heads, head_dim], in
    host memory: gathered where the cache is, then copied to the host once."""
    ids = torch.tensor(list(blocks), dtype=torch.long).to(kv.device)
    return kv.index_select(2, ids).cpu()


def write_blocks(kv: torch.Tensor, blocks: Sequence[int], data: torch.Tensor) -> None:
    """The inverse: ``data`` [layers, 2, n, ...] (host memory) into cache blocks ``blocks``."""
    ids = torch.tensor(list(blocks), dtype=torch.long).to(kv.device)
    kv.index_copy_(2, ids, data.to(kv.device))


def cached_blocks(engine, token_ids: Sequence[int]) -> list[int]:
    """The cache blocks holding the leading whole blocks of ``token_ids`` (a hit confirmed by
    tokens), up to the first miss."""
    bs = engine.kv.block_size
    pool = engine.kv.pool
    out = []
    for i, h in enumerate(hash_blocks(list(token_ids), bs)):
        block = pool.lookup(h, token_ids[i * bs : (i + 1) * bs])
        if block is None:
            break
        out.append(block)
    return out


def gather_blocks(engine, token_ids: Sequence[int], start_block: int) -> Gathered:
    """KV of the cached blocks ``start_block..`` of the prefix (engine thread only)."""
    blocks = cached_blocks(engine, token_ids)[start_block:]
    if not blocks:
        return Gathered(0, b"")
    data = read_blocks(engine.cache.kv, blocks)
    return Gathered(len(blocks), data.view(torch.uint8).numpy().tobytes())


def store_blocks(
    engine, token_ids: Sequence[int], start_block: int, num_blocks: int, data, checksum: int
) -> int:
    """Write copied blocks into free cache blocks and name them; returns how many were stored
    (those already held count). Raises ValueError naming what is wrong with a bad copy."""
    bs = engine.kv.block_size
    kv = engine.cache.kv
    if start_block < 0 or num_blocks < 0:
        raise ValueError(
            f"start_block and num_blocks must be >= 0, got {start_block} and {num_blocks}"
        )
    if len(token_ids) != (start_block + num_blocks) * bs:
        raise ValueError(
            f"token_ids must hold {start_block + num_blocks} blocks of {bs}, got {len(token_ids)}"
        )
    if len(data) != num_blocks * block_bytes(kv):
        raise ValueError(f"block data of {len(data)} bytes, expected {num_blocks} blocks")
    if zlib.crc32(data) != checksum:
        raise ValueError("block data checksum mismatch")
    if num_blocks == 0:
        return 0
    tokens = list(token_ids)
    hashes = hash_blocks(tokens, bs)
    pool = engine.kv.pool
    missing = [
        i
        for i in range(start_block, start_block + num_blocks)
        if pool.lookup(hashes[i], tokens[i * bs : (i + 1) * bs]) is None
    ]
    room = missing[: pool.num_free]  # the chain's head first: what a prefix match reaches
    if room:
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kv.dtype)
        src = src.view(kv.shape[0], kv.shape[1], num_blocks, *kv.shape[3:])
        blocks = pool.allocate(len(room))
        rows = torch.tensor([i - start_block for i in room])
        write_blocks(kv, blocks, src[:, :, rows])
        for i, block in zip(room, blocks):
            pool.cache(block, hashes[i], tokens[i * bs : (i + 1) * bs])
        pool.free(reversed(blocks))  # unreferenced: cached, evictable, the tail first
    return num_blocks - len(missing) + len(room)  # held before + stored now


class BlockCopier:
    """A prefill worker's two ends of block copies; its engine thread calls every method."""

    def __init__(
        self,
        engine,
        worker_id: str,
        emit: Callable[[m.Message], None],
        ctx: zmq.Context,
        host: str = "127.0.0.1",
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.emit = emit
        self.ctx = ctx
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 16)
        self.sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_FRAME_BYTES + m.MAX_HEADER_BYTES)
        self.sock.bind(f"tcp://{host}:0")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._peers: dict[str, zmq.Socket] = {}
        self.sent = self.stored = 0

    def send(self, msg: m.CopyBlocks) -> None:
        """Source: push the blocks the router named (as many as this cache still holds)."""
        bs = self.engine.kv.block_size
        tokens = msg.token_ids[: len(msg.token_ids) // bs * bs]
        got = gather_blocks(self.engine, tokens, max(0, msg.start_block))
        out = m.BlockData(
            msg.request_id,
            self.worker_id,
            tokens[: (msg.start_block + got.num_blocks) * bs] if got.num_blocks else [],
            msg.start_block if got.num_blocks else 0,
            got.num_blocks,
            zlib.crc32(got.data),
            frames=(got.data,) if got.num_blocks else (),
        )
        try:
            self._peer(msg.dst_address).send_multipart(m.encode(out), zmq.NOBLOCK)
            self.sent += got.num_blocks
        except (zmq.Again, zmq.ZMQError) as exc:  # the router's deadline covers a lost copy
            log.warning("block copy for %s to %s dropped: %s", msg.request_id, msg.dst_address, exc)

    def _peer(self, address: str) -> zmq.Socket:
        if not address.startswith("tcp://"):
            raise zmq.ZMQError(msg=f"not a tcp:// copy address: {address!r}")
        sock = self._peers.get(address)
        if sock is None:
            if len(self._peers) >= MAX_PEERS:
                self._peers.pop(next(iter(self._peers))).close(linger=0)
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 16)
            sock.connect(address)
            self._peers[address] = sock
        return sock

    def take(self, limit: int = 16) -> None:
        """Target: store the copies that arrived and tell the router (bounded per call)."""
        for _ in range(limit):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [f.buffer for f in frames]
            try:
                msg = m.decode(frames)
                if not isinstance(msg, m.BlockData):
                    raise m.MessageError(f"expected block_data, got {msg.TYPE}")
            except m.MessageError as exc:
                log.warning("bad block copy: %s", exc)
                continue
            data = msg.frames[0] if msg.frames else b""
            try:
                n = store_blocks(
                    self.engine,
                    msg.token_ids,
                    msg.start_block,
                    msg.num_blocks,
                    data,
                    msg.checksum,
                )
                err = "" if msg.num_blocks else f"{msg.worker_id} holds none of the blocks"
            except ValueError as exc:
                n, err = 0, str(exc)
            self.stored += n
            self.emit(m.CopyDone(msg.request_id, self.worker_id, n, err))

    def close(self) -> None:
        for sock in self._peers.values():
            sock.close(linger=0)
        self._peers.clear()
        self.sock.close(linger=0)
