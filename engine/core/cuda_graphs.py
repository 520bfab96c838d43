"""Decode-only steps under CUDA graphs: one graph per batch-size bucket, captured at start-up.

vLLM's and SGLang's design. A decode step of ``n`` sequences is padded to the smallest bucket
``b >= n`` (1, 2, 4, 8, 16, 24, ... up to max_num_seqs or MAX_CAPTURE_SIZE), its inputs are
copied into static tensors sized for the largest bucket, and bucket ``b``'s graph is replayed;
the final hidden states are read from that graph's static output. Every graph reads the same
static inputs (views of their first ``b`` rows) and the KV cache as it was bound at capture.

Padding rows: token 0 at position 0, KV slot -1 (the store kernels skip it: nothing is written),
sequence length 0 (decode attention reads no KV for them and writes zeros), block table row 0.
Rows are independent through every layer, so padding does not change the real rows' outputs.

Under a graph the kernels' Python-side choices are frozen at capture: decode attention's split
count is chosen from ``max_model_len`` (``decode_max_seq_len`` of the captured metadata), not
from the step's longest sequence, and its kernel cuts each sequence's context by that
sequence's own length (kernels/decode_attention.py), so any lengths up to max_model_len replay
correctly. The cost: for short contexts most splits are empty programs (a Q load and a -inf
partial), and the merge kernel reads num_splits partials per head.

The capture itself goes through a backend: ``CudaGraphBackend`` (torch.cuda.CUDAGraph, one
memory pool shared by all buckets, captured largest first) or, for tests on the CPU,
``ReplayBackend``, which "captures" by keeping the callable and its output and "replays" by
running it again into that output.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine.layers.attention_metadata import AttentionMetadata

logger = logging.getLogger("engine")

MAX_CAPTURE_SIZE = 256  # the largest bucket whatever max_num_seqs says; beyond it decode is eager
PAD_SLOT = -1  # the KV slot of a padding row: the store kernels skip it

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int, cap: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """The buckets: 1, 2, 4, then every multiple of 8, up to min(max_num_seqs, cap), which is
    always the last one."""
    if max_num_seqs < 1 or cap < 1:
        raise ValueError(f"max_num_seqs and cap must be >= 1, got {max_num_seqs} and {cap}")
    top = min(max_num_seqs, cap)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return tuple(sizes)


def bucket_for(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``n`` sequences; None when none does (or n < 1)."""
    if n < 1:
        return None
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class DecodeHost:
    """A decode-only step's inputs on the host, one row per sequence."""

    input_ids: np.ndarray  # [n] int64
    positions: np.ndarray  # [n] int64
    slots: np.ndarray  # [n] int64
    block_tables: np.ndarray  # [n, width] int32
    seq_lens: np.ndarray  # [n] int32, including the new token

    @property
    def num_rows(self) -> int:
        return len(self.input_ids)


def pad_decode(step: DecodeHost, bucket: int) -> DecodeHost:
    """``step`` padded to ``bucket`` rows: token 0 at position 0, slot PAD_SLOT, an all-zero
    block table row and length 0 for each padding row."""
    n = step.num_rows
    if bucket < n:
        raise ValueError(f"bucket {bucket} is smaller than the step's {n} rows")
    extra = bucket - n

    def pad(a: np.ndarray, value: int) -> np.ndarray:
        fill = np.full((extra, *a.shape[1:]), value, dtype=a.dtype)
        return np.concatenate([a, fill])

    return DecodeHost(
        input_ids=pad(step.input_ids, 0),
        positions=pad(step.positions, 0),
        slots=pad(step.slots, PAD_SLOT),
        block_tables=pad(step.block_tables, 0),
        seq_lens=pad(step.seq_lens, 0),
    )


class CapturedGraph(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[CapturedGraph, torch.Tensor]:
        """Capture ``fn``; returns the graph and its static output tensor."""
        ...


class CudaGraphBackend:
    """torch.cuda.CUDAGraph captures sharing one memory pool. Each capture is preceded by one
    eager run on a side stream (torch.cuda.graph's advice: lazy initialisation, Triton's JIT
    and cuBLAS workspaces happen outside the capture)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[CapturedGraph, torch.Tensor]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the KV connector's threads may touch CUDA while this thread captures.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        return graph, out


class _Replayed:
    def __init__(self, fn: Callable[[], torch.Tensor], out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


class ReplayBackend:
    """The CPU stand-in for tests: capture runs ``fn`` once and keeps it with its output;
    replay runs it again on the static inputs as they are now and copies into that output.
    ``wrap`` (optional) is entered around each capture (tests check what a capture does)."""

    def __init__(self, wrap: Callable[[], AbstractContextManager] | None = None) -> None:
        self.wrap = wrap
        self.captured = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[CapturedGraph, torch.Tensor]:
        self.captured += 1
        if self.wrap is None:
            out = fn()
        else:
            with self.wrap():
                out = fn()
        return _Replayed(fn, out), out


class DecodeGraphRunner:
    """Static decode inputs sized for the largest bucket, and one captured forward per bucket.
    ``forward(input_ids, positions, meta)`` returns the final hidden states [rows, hidden].
    The graphs hold the addresses of the weights and of the KV cache as bound at capture:
    neither may be replaced afterwards (the engine binds and converts both before)."""

    def __init__(
        self,
        forward: Forward,
        sizes: Sequence[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
        backend: GraphBackend,
    ) -> None:
        self.forward = forward
        self.sizes = tuple(sizes)
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.backend = backend
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), PAD_SLOT, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(top, self.max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(top, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[CapturedGraph, torch.Tensor]] = {}

    def metadata(self, rows: int, max_seq_len: int | None = None) -> AttentionMetadata:
        """Decode metadata over the first ``rows`` static rows. ``max_seq_len`` None: the
        captured form (max_model_len, so the kernels' grids hold for any step)."""
        return AttentionMetadata(
            slot_mapping=self.slots[:rows],
            num_decode_tokens=rows,
            decode_block_tables=self.block_tables[:rows],
            decode_seq_lens=self.seq_lens[:rows],
            decode_max_seq_len=self.max_model_len if max_seq_len is None else max_seq_len,
        )

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, largest first (the smaller ones reuse its pool memory), on the
        static inputs as they are (all padding: nothing is written to the KV cache). Returns
        the seconds it took."""
        start = time.perf_counter()
        for b in reversed(self.sizes):
            meta = self.metadata(b)

            def run(b: int = b, meta: AttentionMetadata = meta) -> torch.Tensor:
                return self.forward(self.input_ids[:b], self.positions[:b], meta)

            self.graphs[b] = self.backend.capture(run)
        return time.perf_counter() - start

    def bucket(self, rows: int, table_width: int) -> int | None:
        """The bucket a decode step of ``rows`` sequences replays, None if it runs eager."""
        if table_width > self.max_blocks:
            return None
        b = bucket_for(rows, self.sizes)
        return b if b in self.graphs else None

    def load(self, step: DecodeHost, bucket: int) -> None:
        """Copy ``step`` padded to ``bucket`` into the static inputs. Only the block table
        columns the step uses are written: a row's columns past its length are never read."""
        padded = pad_decode(step, bucket)
        width = padded.block_tables.shape[1]
        copy_from_host(self.input_ids[:bucket], padded.input_ids)
        copy_from_host(self.positions[:bucket], padded.positions)
        copy_from_host(self.slots[:bucket], padded.slots)
        copy_from_host(self.block_tables[:bucket, :width], padded.block_tables)
        copy_from_host(self.seq_lens[:bucket], padded.seq_lens)

    @torch.inference_mode()
    def replay(self, bucket: int, rows: int) -> torch.Tensor:
        """Replay ``bucket``'s graph on the loaded inputs; the first ``rows`` hidden states (a
        view of the graph's static output: read it before the next replay)."""
        graph, out = self.graphs[bucket]
        graph.replay()
        return out[:rows]


def copy_from_host(dst: torch.Tensor, src: np.ndarray) -> None:
    """``dst.copy_(src)``; to a CUDA tensor from pinned memory without blocking the host (the
    caching host allocator keeps the pinned block until the copy is done)."""
    t = torch.from_numpy(src)
    if dst.device.type == "cuda":
        dst.copy_(t.pin_memory(), non_blocking=True)
    else:
        dst.copy_(t)


def to_device(src: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device``: on CUDA one non-blocking copy from pinned memory, on the CPU
    the array's own memory."""
    t = torch.from_numpy(src)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
