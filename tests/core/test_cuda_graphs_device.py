"""The decode graphs' inputs on a device that is not the host (engine/core/cuda_graphs.py): the
static inputs, what a step loads into them and the metadata over them all live on the model's
device. On the fake accelerator (tests/fake_device.py); the values are tested on the CPU in
tests/core/test_cuda_graphs.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_device import DEVICE, fake_device

from engine.core.cuda_graphs import DecodeGraphRunner, DecodeHost, ReplayBackend, to_device
from engine.core.model_runner import ModelRunner
from engine.core.request import Request
from engine.core.scheduler_output import ScheduledRequest
from engine.sampling_params import SamplingParams


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_static_inputs_steps_and_metadata_stay_on_the_device():
    with fake_device():
        assert to_device(np.arange(3, dtype=np.int64), DEVICE).device == DEVICE
        runner = DecodeGraphRunner(
            lambda ids, pos, meta: torch.zeros(ids.shape[0], 8, device=ids.device),
            (1, 2, 4),
            max_model_len=64,
            block_size=16,
            device=DEVICE,
            backend=ReplayBackend(),
        )
        runner.capture()
        step = DecodeHost(
            np.array([9, 8, 7], dtype=np.int64),
            np.array([1, 2, 3], dtype=np.int64),
            np.array([17, 18, 19], dtype=np.int64),
            np.array([[1], [1], [1]], dtype=np.int32),
            np.array([2, 3, 4], dtype=np.int32),
        )
        runner.load(step, 4)
        meta = runner.metadata(3, max_seq_len=4)
        for t in (meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens):
            assert t.device == DEVICE
        assert runner.replay(4, 3).device == DEVICE


def _runner(graphs: DecodeGraphRunner | None) -> ModelRunner:
    runner = ModelRunner.__new__(ModelRunner)  # prepare needs no model
    runner.device, runner.block_size, runner.graphs = DEVICE, 16, graphs
    return runner


def _request(rid: str, prompt: int, computed: int) -> Request:
    req = Request(rid, list(range(1, prompt + 1)), SamplingParams(), None)
    req.num_computed_tokens = computed
    return req


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_prepare_puts_every_input_on_the_device():
    tables = {"a": [3], "b": [4, 5], "c": [6]}
    with fake_device():
        mixed = [
            ScheduledRequest(_request("a", 6, 5), 1),
            ScheduledRequest(_request("b", 20, 0), 20),
        ]
        inputs = _runner(None).prepare(mixed, tables)
        meta = inputs.meta
        tensors = [inputs.input_ids, inputs.positions, inputs.sample_indices, meta.slot_mapping]
        tensors += [meta.decode_block_tables, meta.decode_seq_lens, meta.prefill_block_tables]
        tensors += [meta.prefill_cu_seqlens_q, meta.prefill_seq_lens]
        assert all(t.device == DEVICE for t in tensors)
        assert inputs.graph_bucket is None and inputs.slots.tolist()[0] == 3 * 16 + 5

        graphs = DecodeGraphRunner(
            lambda ids, pos, meta: torch.zeros(ids.shape[0], 8, device=ids.device),
            (1, 2, 4),
            max_model_len=64,
            block_size=16,
            device=DEVICE,
            backend=ReplayBackend(),
        )
        graphs.capture()
        decodes = [
            ScheduledRequest(_request("a", 6, 5), 1),
            ScheduledRequest(_request("c", 3, 2), 1),
        ]
        inputs = _runner(graphs).prepare(decodes, tables)
        assert inputs.graph_bucket == 2
        meta = inputs.meta
        tensors = [inputs.input_ids, inputs.positions, inputs.sample_indices, meta.slot_mapping]
        tensors += [meta.decode_block_tables, meta.decode_seq_lens]
        assert all(t.device == DEVICE for t in tensors)
        assert meta.decode_max_seq_len == 6  # the step's own, for an eager run on these views
