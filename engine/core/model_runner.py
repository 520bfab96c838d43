"""Turns a scheduled step into tensors, runs the model, returns logits of the sampling positions."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from engine import envs
from engine.core.cuda_graphs import (
    DecodeGraphRunner,
    DecodeHost,
    GraphBackend,
    capture_sizes,
    to_device,
)
from engine.core.scheduler_output import ScheduledRequest
from engine.kvcache.paged_cache import PagedKVCache
from engine.layers.attention_metadata import AttentionMetadata
from engine.model.llama import LayerHook, LlamaForCausalLM

logger = logging.getLogger("engine")


class StepResult(NamedTuple):
    logits: torch.Tensor  # float32 [S, V]
    hidden: torch.Tensor  # [T, hidden]


class StepInputs:
    """Flat inputs of one step. Decodes (one token) first, then prefill chunks."""

    def __init__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        sample_indices: torch.Tensor,
        order: list[ScheduledRequest],
        slots: np.ndarray,
        graph_bucket: int | None = None,
    ) -> None:
        self.input_ids = input_ids
        self.positions = positions
        self.meta = meta
        self.sample_indices = sample_indices  # rows of the hidden states that produce a token
        self.order = order  # scheduled requests in flat-batch order
        self.slots = slots  # meta.slot_mapping's values on the host (reading them costs no sync)
        # A decode-only step loaded into the CUDA graphs' static inputs: the bucket it replays
        # (the tensors above are views of those inputs; eager still works on them).
        self.graph_bucket = graph_bucket


class ModelRunner:
    """Runs the model on scheduled steps. ``quantization="int8"`` swaps the model's weights for
    int8 ones, ``"w8a8"`` for W8A8 panels (int8 activations too); ``compile=True`` compiles the
    decoder layers' dense parts (see compile_layers);
    ``pack_weights=True`` packs bf16 CPU weights for oneDNN (LlamaForCausalLM.pack_weights_).
    Decode-only steps of a few sequences run through the C decoder layers where they apply
    (LlamaForCausalLM.enable_native_decode)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: PagedKVCache,
        device,
        quantization: str | None = None,
        compile: bool = False,
        pack_weights: bool = False,
        deterministic: bool = False,
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.block_size = cache.block_size
        model.bind_kv_cache(cache.kv)
        if self.device.type == "cpu":
            keep_freed_memory()
        model.quantize_(quantization)
        self.compiled = compile
        if compile:
            compile_layers(model)
        # Small decode-only steps (deterministic: every step) by the C decoder layers where they
        # apply (not under compile, which was asked for by name).
        self.native_decode = not compile and model.enable_native_decode(deterministic)
        # bf16 weights packed for oneDNN (not under compile: inductor packs its own, not with
        # int8, whose weights are not bf16 any more, and not where every step is C's).
        self.packed = (
            pack_weights
            and quantization is None
            and not compile
            and not model.deterministic
            and model.pack_weights_()
        )
        self.graphs: DecodeGraphRunner | None = None  # decode steps under graphs (enable_graphs)

    def enable_graphs(
        self, max_num_seqs: int, max_model_len: int, backend: GraphBackend
    ) -> DecodeGraphRunner:
        """Capture the decode forward for every batch-size bucket (cuda_graphs.py); from then
        on decode-only steps with a bucket and no layer hook replay them. The graphs hold the
        torch layers and the Triton kernels: the C decoder layers are turned off (CPU only)."""
        self.model.native_decode = self.native_decode = False
        graphs = DecodeGraphRunner(
            self.forward,
            capture_sizes(max_num_seqs),
            max_model_len,
            self.block_size,
            self.device,
            backend,
        )
        seconds = graphs.capture()
        self.graphs = graphs
        logger.info(
            "captured %d CUDA graphs for decode batches of %d to %d sequences in %.1f s",
            len(graphs.graphs),
            graphs.sizes[0],
            graphs.sizes[-1],
            seconds,
        )
        return graphs

    def prepare(
        self, scheduled: Sequence[ScheduledRequest], block_tables: dict[str, list[int]]
    ) -> StepInputs:
        decodes = [s for s in scheduled if s.num_tokens == 1]
        prefills = [s for s in scheduled if s.num_tokens > 1]
        order = decodes + prefills
        bs = self.block_size
        ids: list[int] = []
        pos_parts: list[np.ndarray] = []
        for s in order:
            start = s.request.num_computed_tokens
            ids.extend(s.request.all_token_ids[start : start + s.num_real_tokens])
            ids.extend(s.spec_tokens)  # drafts run after the last token (speculative decoding)
            pos_parts.append(np.arange(start, start + s.num_tokens, dtype=np.int64))
        positions = np.concatenate(pos_parts)
        # slot = table[pos // bs] * bs + pos % bs, via one padded table for the whole step.
        tables = [block_tables[s.request.request_id] for s in order]
        width = max(len(t) for t in tables)
        table_np = np.zeros((len(order), width), dtype=np.int32)
        for r, t in enumerate(tables):
            table_np[r, : len(t)] = t
        lens = np.array([s.num_tokens for s in order], dtype=np.int64)
        row_of_token = np.repeat(np.arange(len(order)), lens)
        slots = table_np[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = np.array(
            [s.request.num_computed_tokens + s.num_tokens for s in order], dtype=np.int32
        )
        ids_np = np.array(ids, dtype=np.int64)
        ends = np.cumsum(lens) - 1
        # The rows that sample: a request's last; with drafts, its last token's and the drafts'.
        sample_np = np.array(
            [
                e
                for r, s in enumerate(order)
                if s.samples
                for e in range(ends[r] - len(s.spec_tokens), ends[r] + 1)
            ],
            dtype=np.int64,
        )
        dev = self.device
        nd = len(decodes)
        bucket = None
        if self.graphs is not None and not prefills:
            bucket = self.graphs.bucket(nd, width)
        if bucket is not None:
            assert self.graphs is not None
            host = DecodeHost(ids_np, positions, slots, table_np, seq_lens)
            self.graphs.load(host, bucket)
            meta = self.graphs.metadata(nd, max_seq_len=int(seq_lens.max()))
            return StepInputs(
                self.graphs.input_ids[:nd],
                self.graphs.positions[:nd],
                meta,
                to_device(sample_np, dev),
                order,
                slots,
                bucket,
            )
        meta = AttentionMetadata(slot_mapping=to_device(slots, dev), num_decode_tokens=nd)
        table_t = to_device(table_np, dev)
        seq_lens_t = to_device(seq_lens, dev)
        if nd:
            meta.decode_block_tables = table_t[:nd]
            meta.decode_seq_lens = seq_lens_t[:nd]
            meta.decode_max_seq_len = int(seq_lens[:nd].max())
        if prefills:
            q_lens = lens[nd:]
            cu = np.zeros(len(prefills) + 1, dtype=np.int32)
            np.cumsum(q_lens, out=cu[1:])
            meta.prefill_block_tables = table_t[nd:]
            meta.prefill_cu_seqlens_q = to_device(cu, dev)
            meta.prefill_seq_lens = seq_lens_t[nd:]
            meta.prefill_max_seqlen_q = int(q_lens.max())
            meta.prefill_max_seq_len = int(seq_lens[nd:].max())
        return StepInputs(
            to_device(ids_np, dev),
            to_device(positions, dev),
            meta,
            to_device(sample_np, dev),
            order,
            slots,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        layer_hook: LayerHook | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of one flat batch. A pipeline stage after the first
        takes the stage before's hidden states (``hidden``, [T, hidden]) and no ``input_ids``
        (None); a stage short of the last returns its last layer's output, un-normed."""
        return self.model(input_ids, positions, meta, layer_hook, hidden=hidden)

    @torch.inference_mode()
    def execute(
        self,
        inputs: StepInputs,
        layer_hook: LayerHook | None = None,
        all_logits: bool = False,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs the forward. Returns float32 logits of the sampling rows [S, V], or of every row
        when ``all_logits``. ``hidden``: a later pipeline stage's input rows (see forward)."""
        return self.execute_with_hidden(inputs, layer_hook, all_logits, hidden).logits

    @torch.inference_mode()
    def execute_with_hidden(
        self,
        inputs: StepInputs,
        layer_hook: LayerHook | None = None,
        all_logits: bool = False,
        hidden: torch.Tensor | None = None,
    ) -> StepResult:
        """``execute``, also handing back the final hidden states of every row [T, hidden]
        (prompt logprobs turn the rows of prefill chunks into logits)."""
        out = self.execute_hidden(inputs, layer_hook, hidden)
        rows = out if all_logits else out[inputs.sample_indices]
        return StepResult(self.model.compute_logits(rows).float(), out)

    @torch.inference_mode()
    def execute_hidden(
        self,
        inputs: StepInputs,
        layer_hook: LayerHook | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The forward's hidden states [T, hidden] and no logits (a pipeline stage short of the
        last hands them on). ``hidden``: a later stage's input rows (see forward)."""
        if inputs.graph_bucket is not None and layer_hook is None and hidden is None:
            assert self.graphs is not None
            return self.graphs.replay(inputs.graph_bucket, len(inputs.order))
        ids = inputs.input_ids if hidden is None else None
        return self.forward(ids, inputs.positions, inputs.meta, layer_hook, hidden)


def keep_freed_memory() -> None:
    """Make glibc keep freed memory for reuse instead of returning it to the kernel.

    By default every allocation above 32 MiB (and many smaller ones) is a fresh mmap, so each
    step's large activations and KV gathers are first-touched again: page faults and zeroing cost
    more than the copies themselves (a 50 MB KV gather ran at 1.2 GB/s, 6.8 GB/s with this). The
    price is that the process keeps its peak heap. No-op off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_MAX, 0)  # serve every size from the heap
        libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)  # never give the heap's top back
    except (OSError, AttributeError):
        pass


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameter numbers (malloc.h)


def compile_layers(model: LlamaForCausalLM) -> None:
    """torch.compile each decoder layer's pre- and post-attention parts (RMSNorm, projections,
    rotary, residuals, SwiGLU): inductor fuses the elementwise chains around the GEMMs into
    vectorised C++ kernels, which is what dominates a small model's step on CPU.

    All layers share the two compiled graphs (the weights are graph inputs, not constants), and
    shapes are dynamic, so a new batch size does not recompile (a 1-token step gets its own
    specialisation). Compilation happens on first use; the generated code is cached on disk
    (see envs.inductor_cache_dir), so later starts load it instead of compiling."""
    envs.configure_inductor_cache()
    for layer in model.layers:
        layer.pre_attention = torch.compile(layer.pre_attention, dynamic=True, fullgraph=True)
        layer.post_attention = torch.compile(layer.post_attention, dynamic=True, fullgraph=True)
