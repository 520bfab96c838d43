"""Input checks and launch facts shared by the Triton launchers in this package.

The launchers check what a GPU would reject or silently get wrong and the interpreter would not
catch (dtypes, shapes, last-dim contiguity, devices), and raise ``ValueError`` naming the argument.
They never read tensor values: that would cost a device sync on every call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch
import triton

from engine.kernels.kv_quant import row_elems

F = TypeVar("F", bound=Callable)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# What a KV cache may hold for the Triton kernels: any float dtype (read into q's dtype), or int8
# rows with their scale (kernels/kv_quant.py).
KV_DTYPES = (*FLOAT_DTYPES, torch.int8)
INDEX_DTYPES = (torch.int32, torch.int64)
DEFAULT_NUM_SMS = 132  # H100/H200; used when no CUDA device is there to ask


def is_interpreted(kernel) -> bool:
    """Whether ``kernel`` was built by Triton's interpreter (TRITON_INTERPRET=1 at import time).

    Decided per kernel object, not from the environment now: ``triton.jit`` picks the interpreter
    once, when the module is imported."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    shape: tuple[int | None, ...] | None = None,
    last_contiguous: bool = False,
    contiguous: bool = False,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({names}), got {t.dtype}")
    if shape is not None:
        ok = len(shape) == t.dim() and all(
            s is None or s == n for s, n in zip(shape, t.shape, strict=False)
        )
        if not ok:
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if last_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    return t


def check_devices(kernel, **tensors: torch.Tensor) -> torch.device:
    """All tensors on one device; CPU tensors only when ``kernel`` runs in the interpreter; CUDA
    tensors only on the current CUDA device (``check_current_device``)."""
    items = list(tensors.items())
    device = items[0][1].device
    for name, t in items[1:]:
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} (like {items[0][0]})")
    if device.type == "cuda":
        check_current_device(items[0][0], device, torch.cuda.current_device())
    elif not is_interpreted(kernel):
        raise ValueError(
            f"{items[0][0]} is on {device}: Triton kernels need CUDA tensors, or "
            "TRITON_INTERPRET=1 set before triton is first imported"
        )
    return device


def device_to_enter(args: tuple, current: Callable[[], int]) -> torch.device | None:
    """The CUDA device a launch must make current: its first tensor argument's, when that is a
    CUDA device other than ``current()``; None when the launch can run as it is."""
    t = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if t is None or t.device.type != "cuda" or t.device.index in (None, current()):
        return None
    return t.device


def on_tensor_device(launcher: F) -> F:
    """Run a Triton launcher with its first tensor's CUDA device current (Triton launches on the
    current device): the engine's own thread has its ``--device cuda:N`` current already
    (engine/core/device_memory.py select_device), but other threads (a KV pool's loader, a
    caller's) start on cuda:0. Costs one ``torch.cuda.current_device()`` when nothing changes."""

    @functools.wraps(launcher)
    def run(*args, **kwargs):
        device = device_to_enter(args, torch.cuda.current_device)
        if device is None:
            return launcher(*args, **kwargs)
        with torch.cuda.device(device):
            return launcher(*args, **kwargs)

    return run  # type: ignore[return-value]


def check_current_device(name: str, device: torch.device, current: int) -> None:
    """Triton launches on the *current* CUDA device whatever its tensors' device: a kernel given
    cuda:1 tensors while cuda:0 is current would read another GPU's addresses. The launchers
    run under ``on_tensor_device``, so this only fails for one that does not."""
    index = device.index if device.index is not None else current
    if index != current:
        raise ValueError(
            f"{name} is on cuda:{index} but the current CUDA device is cuda:{current}: Triton "
            f"launches on the current device; call torch.cuda.set_device({index}) first"
        )


def dot_in_f32(kernel, dtype: torch.dtype) -> bool:
    """Upcast tl.dot operands to fp32? Only in the interpreter, where a bf16 tl.dot multiplies
    the raw uint16 bit patterns (triton issue #11584) and fp16 gains nothing from staying 16-bit.
    On the GPU 16-bit dots run natively on tensor cores with fp32 accumulation."""
    return is_interpreted(kernel) and dtype != torch.float32


def dot_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype the attention kernels' dots take: a float cache's own, q converted to it (a
    16-bit cache holds no more precision than that, a float32 one is read at its own; and K and
    V tiles converted in registers spill them), else, for int8 rows, q's (their values are exact
    in it). Sums stay float32."""
    return q_dtype if kv_dtype == torch.int8 else kv_dtype


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 dots default to TF32 on NVIDIA (~1e-3 error); ask for IEEE fp32 so fp32 means fp32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability kernels are compiled for: the device's; (9, 0) off CUDA (the
    interpreter; profiling/kernels.py --aot replaces this function for each target)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)
    return (9, 0)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def pad_dim(head_dim: int) -> int:
    """Head dim padded to a power of 2 and to >= 16 (smallest K of a 16-bit tl.dot on NVIDIA)."""
    return max(16, triton.next_power_of_2(head_dim))


def check_dot_shape(m: int, n: int, k: int) -> None:
    """The NVIDIA backend rejects tl.dot with M, N or K below 16 for 16-bit inputs; the interpreter
    accepts any size, so check here that CPU-tested configs also compile on the GPU."""
    if min(m, n, k) < 16:
        raise ValueError(f"internal: tl.dot tile {m}x{n}x{k} has a side < 16")


def paged_cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    """The block, slot and head strides of the paged K and V caches ([num_blocks, block_size,
    Hkv, D], last dim contiguous), in the order every paged kernel takes them."""
    return (*k_cache.stride()[:3], *v_cache.stride()[:3])


def attention_strides(q, k_cache, v_cache, out, block_tables) -> tuple[int, ...]:
    """The strides the paged attention kernels take, in their order: q's token and head, the
    caches' (``paged_cache_strides``), out's token and head, and the block table's row."""
    return (
        *q.stride()[:2],
        *paged_cache_strides(k_cache, v_cache),
        *out.stride()[:2],
        block_tables.stride(0),
    )


def check_paged_attention(q, k_cache, v_cache, kv_dtypes=None) -> None:
    """What every paged attention launcher checks of q ([tokens or sequences, Hq, D]) and the
    caches ([num_blocks, block_size, Hkv, row], a dtype of ``kv_dtypes``, by default q's; row is
    D, or D + 2 for int8 rows with their scale, kvcache/kv_dtype.py): Hq a multiple of Hkv, D at
    most 256."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_contiguous=True)
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_dtypes = (q.dtype,) if kv_dtypes is None else kv_dtypes
    check_tensor("k_cache", k_cache, ndim=4, dtypes=kv_dtypes, last_contiguous=True)
    num_kv_heads = k_cache.shape[2]
    check_tensor("k_cache", k_cache, shape=(None, None, None, row_elems(k_cache.dtype, head_dim)))
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), shape=tuple(k_cache.shape))
    check_tensor("v_cache", v_cache, last_contiguous=True)
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"q's {num_heads} heads must be a multiple of k_cache's {num_kv_heads} KV heads"
        )
    if head_dim > 256:
        raise ValueError(f"q's head_dim must be <= 256, got {head_dim}")
