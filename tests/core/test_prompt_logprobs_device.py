"""Prompt logprobs on a model whose logits are not in host memory (engine/core/prompt_logprobs.py):
the targets are indexed where the logits are and each result reaches the host in one copy.
Device-side parts on a fake accelerator (tests/fake_device.py); the values are checked on the CPU
here and against the engine in tests/core/test_prompt_logprobs.py."""

from __future__ import annotations

import pytest
import torch
from fake_device import DEVICE, fake_device

from engine.core.prompt_logprobs import slice_logprobs


@pytest.mark.parametrize("k", [0, 3])
def test_slice_logprobs_on_the_device(k):
    with fake_device():
        logits = torch.empty(5, 50, device=DEVICE, dtype=torch.bfloat16)
        got = slice_logprobs(logits, [1, 2, 3, 4, 5], k)
        assert all(t.device.type == "cpu" for t in got)
        assert got.top_ids.shape == (5, k)


def test_slice_logprobs_values_on_the_cpu():
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(0))
    targets = [3, 0, 19, 7]
    got = slice_logprobs(logits, targets, 2)
    lp = torch.log_softmax(logits, dim=-1)
    for j, t in enumerate(targets):
        assert got.chosen[j] == lp[j, t]
        assert got.ranks[j] == int((lp[j] > lp[j, t]).sum()) + 1
    assert torch.equal(got.top_ids, lp.topk(2).indices)
    empty = slice_logprobs(logits, targets, 0)
    assert empty.top_values.shape == (4, 0) and empty.top_ids.tolist() == [[]] * 4
