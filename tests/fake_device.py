"""A fake accelerator for device-discipline tests on a machine without one.

``fake_device()`` is a ``FakeTensorMode`` in which tensors made on ``DEVICE`` hold no data but
carry their device, and an op that meets a host (CPU) tensor and a ``DEVICE`` tensor raises
``FakeTensorDeviceMismatchError``, as a CUDA op meeting a CPU tensor raises on a GPU. ``DEVICE``
is torch's PrivateUse1 backend with a Python device guard: fake ``cuda`` tensors on a CPU-only
torch fail in every Python binding that takes a device guard (slicing, ``copy_``,
``contiguous``) with "not linked with support for cuda devices", which says nothing about the
code under test. Fake tensors have no data: ``.numpy()``, ``.tolist()`` and checksums raise, so
only device-side parts run under it.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

try:
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError
except ImportError:  # torch < 2.12 raises a plain RuntimeError ("... two different devices")
    FakeTensorDeviceMismatchError = RuntimeError

DEVICE = torch.device("privateuseone:0")
_ready = False

__all__ = ["DEVICE", "FakeTensorDeviceMismatchError", "fake_device"]


def fake_device() -> FakeTensorMode:
    global _ready
    if not _ready:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend()
        _ready = True
    return FakeTensorMode(allow_non_fake_inputs=True)
