"""Decode steps under CUDA graphs (engine/core/cuda_graphs.py), on the CPU: buckets and padding
as pure functions, graph-mode greedy tokens against eager through the replay backend, and a
captured forward that never reads device values on the host (tests/no_host_sync.py).

The engine runs the Triton kernels here (ENGINE_KERNELS=triton, through the interpreter), as it
does on CUDA: the C kernels and references are not what a graph captures."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from no_host_sync import HostSyncError, NoHostSync
from tiny_models import tiny_model

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.cuda_graphs import (
    MAX_CAPTURE_SIZE,
    PAD_SLOT,
    DecodeGraphRunner,
    DecodeHost,
    ReplayBackend,
    bucket_for,
    capture_sizes,
    pad_decode,
)
from engine.core.llm_engine import LLMEngine
from engine.layers.rotary import RotaryEmbedding
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [
    "The capital of France is",
    "One, two, three,",
    "def fibonacci(n):",
    "In the beginning",
    "Rain falls on the",
]


def test_capture_sizes():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(8) == (1, 2, 4, 8)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(128) == (1, 2, 4, *range(8, 129, 8))
    assert capture_sizes(10_000)[-1] == MAX_CAPTURE_SIZE
    assert capture_sizes(100, cap=16) == (1, 2, 4, 8, 16)
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_bucket_for():
    sizes = capture_sizes(20)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 17, 20)] == [
        1, 2, 4, 4, 8, 8, 16, 20, 20
    ]  # fmt: skip
    assert bucket_for(21, sizes) is None
    assert bucket_for(0, sizes) is None


def test_pad_decode():
    step = DecodeHost(
        input_ids=np.array([5, 6, 7], dtype=np.int64),
        positions=np.array([10, 3, 40], dtype=np.int64),
        slots=np.array([170, 35, 72], dtype=np.int64),
        block_tables=np.array([[1, 10, 0], [2, 0, 0], [3, 4, 9]], dtype=np.int32),
        seq_lens=np.array([11, 4, 41], dtype=np.int32),
    )
    padded = pad_decode(step, 4)
    assert padded.input_ids.tolist() == [5, 6, 7, 0]
    assert padded.positions.tolist() == [10, 3, 40, 0]
    assert padded.slots.tolist() == [170, 35, 72, PAD_SLOT]  # the store kernels skip it
    assert padded.block_tables.tolist() == [[1, 10, 0], [2, 0, 0], [3, 4, 9], [0, 0, 0]]
    assert padded.seq_lens.tolist() == [11, 4, 41, 0]  # attention reads nothing for it
    assert padded.block_tables.dtype == np.int32 and padded.slots.dtype == np.int64
    assert pad_decode(step, 3).input_ids.tolist() == [5, 6, 7]
    with pytest.raises(ValueError):
        pad_decode(step, 2)


def test_static_inputs_are_loaded_padded():
    runner = DecodeGraphRunner(
        lambda ids, pos, meta: ids[:, None].float(),
        capture_sizes(8),
        max_model_len=64,
        block_size=16,
        device=torch.device("cpu"),
        backend=ReplayBackend(),
    )
    runner.capture()
    assert runner.block_tables.shape == (8, 4)
    # A wide step, then a narrow one: the narrow one's columns are written, the rest is stale
    # but past every sequence's length.
    wide = DecodeHost(
        np.arange(5, dtype=np.int64),
        np.full(5, 50, dtype=np.int64),
        np.arange(5, dtype=np.int64),
        np.full((5, 4), 7, dtype=np.int32),
        np.full(5, 51, dtype=np.int32),
    )
    runner.load(wide, 8)
    step = DecodeHost(
        np.array([9, 8, 7], dtype=np.int64),
        np.array([1, 2, 3], dtype=np.int64),
        np.array([17, 18, 19], dtype=np.int64),
        np.array([[1], [1], [1]], dtype=np.int32),
        np.array([2, 3, 4], dtype=np.int32),
    )
    assert runner.bucket(3, 1) == 4
    assert runner.bucket(3, 5) is None  # wider than max_model_len: eager
    assert runner.bucket(9, 1) is None
    runner.load(step, 4)
    assert runner.input_ids[:4].tolist() == [9, 8, 7, 0]
    assert runner.slots[:4].tolist() == [17, 18, 19, PAD_SLOT]
    assert runner.seq_lens[:4].tolist() == [2, 3, 4, 0]
    assert runner.block_tables[:4, 0].tolist() == [1, 1, 1, 0]
    assert runner.replay(4, 3)[:, 0].tolist() == [9.0, 8.0, 7.0]
    meta = runner.metadata(4)
    assert meta.decode_max_seq_len == 64 and meta.num_decode_tokens == 4


@pytest.fixture(scope="module")
def engine():
    mp = pytest.MonkeyPatch()
    mp.setenv("ENGINE_KERNELS", "triton")  # what CUDA runs, here through the interpreter
    config = EngineConfig(
        model=str(tiny_model("llama")),
        dtype="float32",
        device="cpu",
        max_model_len=512,  # decode attention then splits in 2 (the merge kernel runs too)
        cache=CacheConfig(num_blocks=64, block_size=16, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8),
    )
    yield LLMEngine(config)
    mp.undo()


def _generate(engine, prompts):
    rids = [engine.add_request(p, GREEDY) for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o.outputs[0].token_ids
    return [final[r] for r in rids]


@pytest.mark.slow  # CI time on a 2-core Zen 3 EPYC: `pytest -m slow`
def test_graph_tokens_equal_eager(engine, monkeypatch):
    assert engine.runner.graphs is None  # CPU: no graphs unless asked for
    eager = {n: _generate(engine, PROMPTS[:n]) for n in (1, 3, 5)}
    before = engine.cache.kv.clone()
    graphs = engine.runner.enable_graphs(8, engine.max_model_len, ReplayBackend())
    assert graphs.sizes == (1, 2, 4, 8) and sorted(graphs.graphs) == [1, 2, 4, 8]
    assert torch.equal(engine.cache.kv, before)  # capturing (all padding) wrote no KV
    replayed = []
    real_replay = DecodeGraphRunner.replay

    def counting(self, bucket, rows):
        replayed.append((bucket, rows))
        return real_replay(self, bucket, rows)

    monkeypatch.setattr(DecodeGraphRunner, "replay", counting)
    try:
        for n, bucket in ((1, 1), (3, 4), (5, 8)):
            replayed.clear()
            assert _generate(engine, PROMPTS[:n]) == eager[n], n
            # every decode step replayed the bucket (the first step is the prefill: eager)
            assert replayed == [(bucket, n)] * (GREEDY.max_tokens - 1), n
    finally:
        engine.runner.graphs = None


def test_layer_hook_steps_run_eager(engine, monkeypatch):
    engine.runner.enable_graphs(8, engine.max_model_len, ReplayBackend())
    layers = []
    engine.layer_hook = layers.append
    monkeypatch.setattr(
        DecodeGraphRunner, "replay", lambda *a: pytest.fail("a step with a hook replayed")
    )
    try:
        want = len(_generate(engine, PROMPTS[:2])[0])
    finally:
        engine.layer_hook = None
        engine.runner.graphs = None
    assert want == GREEDY.max_tokens
    assert len(layers) == GREEDY.max_tokens * engine.model_config.num_layers


def test_capture_does_not_read_device_values_on_the_host(engine):
    # The decode forward as captured, every bucket, under the guard: .item(), .tolist(),
    # int(t), boolean masks, nonzero or torch.tensor(data) anywhere in it fail here.
    backend = ReplayBackend(wrap=lambda: NoHostSync(engine.device))
    try:
        engine.runner.enable_graphs(8, engine.max_model_len, backend)
    finally:
        engine.runner.graphs = None
    assert backend.captured == 4


def test_the_guard_catches_a_host_read_in_the_forward(engine, monkeypatch):
    real = RotaryEmbedding.rotate

    def reads(self, positions, x):
        positions.tolist()  # what the guard must catch
        return real(self, positions, x)

    monkeypatch.setattr(RotaryEmbedding, "rotate", reads)
    backend = ReplayBackend(wrap=lambda: NoHostSync(engine.device))
    with pytest.raises(HostSyncError, match="tolist"):
        engine.runner.enable_graphs(8, engine.max_model_len, backend)
    engine.runner.graphs = None


@pytest.mark.parametrize(
    "bad",
    [
        lambda t: t.sum().item(),
        lambda t: int(t[0]),
        lambda t: float(t.max()),
        lambda t: bool(t[0] > 0),
        lambda t: t.tolist(),
        lambda t: t.numpy(),
        lambda t: t[t > 0],
        lambda t: t.nonzero(),
        lambda t: torch.tensor([1, 2]),
        lambda t: torch.unique(t),
        lambda t: t.to("meta"),
    ],
)
def test_the_guard_refuses(bad):
    t = torch.arange(4.0)
    with pytest.raises(HostSyncError), NoHostSync(torch.device("cpu")):
        bad(t)


def test_the_guard_lets_graph_safe_code_through():
    t = torch.arange(4.0)
    with NoHostSync(torch.device("cpu")):
        t[torch.arange(2)] * 2  # integer indices: the shape is the index's
        torch.where(t > 1, t, 0).sum()
        torch.empty(3).fill_(1)


def test_the_guard_catches_the_reference_kernels(engine, monkeypatch):
    # The torch references read on the host (kv_store_ref's padding mask, the decode
    # reference's lengths): they could not be captured, and the guard says so.
    monkeypatch.setenv("ENGINE_KERNELS", "torch")
    backend = ReplayBackend(wrap=lambda: NoHostSync(engine.device))
    with pytest.raises(HostSyncError):
        engine.runner.enable_graphs(8, engine.max_model_len, backend)
    engine.runner.graphs = None
