"""A guard for code that must run under a CUDA graph capture: it fails on anything that reads
device values on the host or makes a tensor from host data, which on CUDA is a sync (a capture
error) or a copy the graph would replay with stale data.

    with NoHostSync(torch.device("cpu")):
        forward()          # HostSyncError names the op

What it refuses: ops tagged ``data_dependent_output`` (``aten._local_scalar_dense`` behind
``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``; ``aten.equal``), ops whose output shape
depends on data (``dynamic_output_shape``: nonzero, masked_select, unique, repeat_interleave by
a tensor, indexing by a boolean mask), ``aten.lift_fresh`` (``torch.tensor(data)``,
``torch.from_numpy``), any output on a device other than the expected one, and the methods that
read values without going through the dispatcher (``tolist``, ``numpy``, ``item``,
``__int__``, ``__float__``, ``__bool__``, ``__index__``). Calls made by Triton's interpreter
itself (which stands in for a GPU on CPU tensors) are let through.
"""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READS = ("tolist", "numpy", "item", "__int__", "__float__", "__bool__", "__index__")
_BOOL_INDEXED = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default)
_BOOL_INDEXED += (torch.ops.aten.index_put.default,)


class HostSyncError(AssertionError):
    pass


def _from_triton(depth: int = 2) -> bool:
    """Whether a frame above (the caller's caller and up) is Triton's."""
    frame = sys._getframe(depth)
    while frame is not None:
        if "/triton/" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


class NoHostSync(TorchDispatchMode):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = torch.device(device)
        self._saved: dict[str, object] = {}

    def __enter__(self):
        for name in _READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def guarded(t, *args, _name=name, _original=original, **kwargs):
                if not _from_triton():
                    raise HostSyncError(f"Tensor.{_name}() reads device values on the host")
                return _original(t, *args, **kwargs)

            setattr(torch.Tensor, name, guarded)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _from_triton():
            self._check(func, args, kwargs)
        out = func(*args, **kwargs)
        if not _from_triton():
            for t in _tensors(out):
                if t.device != self.device:
                    raise HostSyncError(f"{func} made a tensor on {t.device}, not {self.device}")
        return out

    def _check(self, func, args, kwargs) -> None:
        tags = func.tags
        if torch.Tag.data_dependent_output in tags:
            raise HostSyncError(f"{func} reads device values on the host")
        if func is torch.ops.aten.lift_fresh.default:
            raise HostSyncError(f"{func}: a tensor made from host data (torch.tensor, from_numpy)")
        if torch.Tag.dynamic_output_shape in tags:
            if func in _BOOL_INDEXED:
                indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
                if not any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):
                    return  # integer indices: the output's shape is the index's
            raise HostSyncError(f"{func}: its output's shape depends on data")
