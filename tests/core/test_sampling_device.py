"""The sampler on logits that are not in host memory (engine/core/sampler.py): a step's batch is
built on the logits' device and sampling meets no host tensor. On a fake accelerator
(tests/fake_device.py), which carries the rows without penalties (their distinct keys and the
top-k/top-p rows' cut are data-dependent, which fake tensors cannot run); the values are tested on
the CPU in tests/core/test_sampling.py."""

from __future__ import annotations

import pytest
import torch
from fake_device import DEVICE, fake_device

from engine.core.sampler import Sampler, SamplingBatch
from engine.sampling_params import SamplingParams

V = 40


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_greedy_random_and_min_tokens_rows_stay_on_the_device():
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, min_p=0.1),
        SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0.0, logprobs=2),
    ]
    with fake_device():
        batch = SamplingBatch.build(
            params, [None] * 4, [[1, 2]] * 4, [[]] * 4, V, DEVICE, eos_token_ids=[0]
        )
        assert batch.mask_keys is not None and batch.mask_keys.device == DEVICE
        logits = torch.empty(4, V, device=DEVICE, dtype=torch.bfloat16)
        tokens = Sampler()._sample(logits, batch)
        assert tokens.device == DEVICE and tokens.shape == (4,)
