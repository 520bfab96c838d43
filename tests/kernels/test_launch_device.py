"""Triton launches on the current CUDA device, so the launchers make their tensors' device
current (``on_tensor_device``) and refuse a launch that would still go elsewhere
(``check_current_device``). No GPU here: the CUDA calls are monkeypatched and the device
decision is tested as the pure function it is."""

from __future__ import annotations

import contextlib

import pytest
import torch

from engine.kernels._launch import check_current_device, device_to_enter, on_tensor_device


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it lives on a CUDA device (for device_to_enter only)."""

    fake_device = torch.device("cuda:1")

    @property
    def device(self):  # type: ignore[override]
        return self.fake_device


def on(index: int | None) -> torch.Tensor:
    t = torch.empty(1).as_subclass(FakeCudaTensor)
    t.fake_device = torch.device("cuda", index) if index is not None else torch.device("cuda")
    return t


def test_the_device_to_make_current_is_the_first_tensors_when_it_differs():
    never = lambda: pytest.fail("current_device() asked for CPU tensors")  # noqa: E731
    assert device_to_enter((torch.empty(1), 3), never) is None  # CPU (the interpreter)
    assert device_to_enter((2.0, "x"), never) is None  # no tensor
    assert device_to_enter((on(1),), lambda: 1) is None  # already current
    assert device_to_enter((0.5, on(1), on(0)), lambda: 0) == torch.device("cuda:1")
    assert device_to_enter((on(None),), lambda: 0) is None  # "cuda": the current one


def test_a_launcher_runs_under_its_tensors_device(monkeypatch):
    entered: list[torch.device] = []

    @contextlib.contextmanager
    def fake_device(device):
        entered.append(device)
        yield

    monkeypatch.setattr(torch.cuda, "device", fake_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    seen = []

    @on_tensor_device
    def launcher(x, scale=1.0):
        seen.append(list(entered))
        return "launched"

    assert launcher(on(2), scale=2.0) == "launched"
    assert entered == [torch.device("cuda:2")] and seen == [[torch.device("cuda:2")]]
    assert launcher(on(0)) == "launched"  # current already: no switch
    assert entered == [torch.device("cuda:2")]
    assert launcher.__name__ == "launcher"


def test_every_triton_launcher_is_wrapped():
    from engine.kernels.decode_attention import decode_attention_triton
    from engine.kernels.int8_matmul import int8_matmul_triton
    from engine.kernels.kv_copy import kv_gather_triton, kv_scatter_triton
    from engine.kernels.kv_store import kv_store_triton
    from engine.kernels.prefill_attention import prefill_attention_triton

    launchers = [decode_attention_triton, int8_matmul_triton, kv_gather_triton,
                 kv_scatter_triton, kv_store_triton, prefill_attention_triton]  # fmt: skip
    wrapper = on_tensor_device(lambda: None).__code__
    for fn in launchers:
        assert fn.__code__ is wrapper and fn.__wrapped__.__name__ == fn.__name__, fn.__name__


def test_a_launch_on_a_device_that_is_not_current_is_refused():
    check_current_device("x", torch.device("cuda:1"), 1)
    check_current_device("x", torch.device("cuda"), 3)
    with pytest.raises(ValueError, match=r"x is on cuda:1 .* current CUDA device is cuda:0"):
        check_current_device("x", torch.device("cuda:1"), 0)
