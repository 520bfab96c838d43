"""What a config's plain device and dtype values are on this machine
(engine/core/device_resolution.py). The CPU classes' ``auto`` table is tests/test_cpu_isa.py's,
the weight dtypes tests/layers/test_low_precision.py's."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.core.device_resolution import dtype_reason, resolved_device, resolved_dtype


def test_device_auto_is_cuda_where_there_is_one_and_named_devices_are_taken_as_named():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolved_device(EngineConfig()).type == want
    assert resolved_device(EngineConfig(device="cpu")) == torch.device("cpu")
    # resolving names the device; making it current (and checking it exists) is select_device's
    assert resolved_device(EngineConfig(device="cuda:1")) == torch.device("cuda", 1)


def test_a_named_dtype_is_taken_whatever_the_device():
    for name in ("float32", "float16", "bfloat16"):
        config = EngineConfig(device="cpu", dtype=name)
        assert resolved_dtype(config) == getattr(torch, name)
        assert dtype_reason(config) == f"dtype {name} as asked"
