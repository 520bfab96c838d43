"""How many bytes and blocks the paged KV cache gets: pure arithmetic on measured numbers.

On CUDA, ``gpu_memory_utilization`` is this process's share of the GPU's *total* memory, for
everything it holds there (weights, activations, KV cache), as vLLM's flag of that name: two
workers on one GPU can each take 0.45. vLLM's ``Worker.determine_available_memory``
(``vllm/v1/worker/gpu_worker.py``) loads the weights, runs a profile forward of
``max_num_batched_tokens`` tokens, and gives the KV cache ``utilization * total`` minus the
non-KV memory it saw (weights + the profile's peak activations + non-torch memory that appeared
since the worker started); it refuses to start when the free memory at start is below
``utilization * total``. The engine does the analogous thing (``kv_budget_bytes``), with an
*estimate* of the activation peak (``activation_reserve_bytes``) where vLLM runs a profile
forward, and with the check made against the memory still free after the weights loaded:

    budget = utilization * total - used - reserve,   and   budget + reserve <= free

``used`` is what this process holds on the GPU once the weights are in
(``engine/core/device_memory.py``: torch's reserved memory plus non-torch memory that appeared
since the engine started, e.g. cuBLAS workspaces; the CUDA context itself, a few hundred MiB,
is outside, as in vLLM). ``kv_cache_memory_gb``, when given, is the budget itself on every device
(CPU and CUDA), checked against the free memory on CUDA. Every refusal is a ``ValueError`` that
names the field to change and the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class DeviceMemory:
    """A GPU's memory as this process sees it, in bytes, measured after the weights loaded."""

    total: int  # the GPU's memory
    free: int  # free now (what other processes and this one hold is not)
    used: int  # held by this process now (weights, torch's cache, non-torch allocations)
    reserve: int  # not allocated yet but will be: the activation peak of a full step

    def __post_init__(self) -> None:
        for name in ("total", "free", "used", "reserve"):
            if getattr(self, name) < 0:
                raise ValueError(f"DeviceMemory.{name} must be >= 0, got {getattr(self, name)}")


def kv_budget_bytes(
    mem: DeviceMemory | None, utilization: float, kv_cache_memory_gb: float | None
) -> int:
    """The KV cache's bytes. ``mem`` None: a CPU, where ``kv_cache_memory_gb`` must be given
    (CacheConfig.sized_for fills in the default). On a GPU: ``kv_cache_memory_gb`` if given, else
    ``utilization * total - used - reserve``; either must fit in ``free - reserve``."""
    if mem is None:
        if kv_cache_memory_gb is None:
            raise ValueError("kv_cache_memory_gb must be set on a CPU (CacheConfig.sized_for)")
        return int(kv_cache_memory_gb * GIB)
    room = mem.free - mem.reserve  # what the KV cache may still take without running out
    if kv_cache_memory_gb is not None:
        budget = int(kv_cache_memory_gb * GIB)
        if budget > room:
            raise ValueError(
                f"kv_cache_memory_gb ({_gib(budget)}) exceeds the GPU memory left for it: "
                f"{_gib(mem.free)} free minus {_gib(mem.reserve)} kept for activations = "
                f"{_gib(room)}; lower --kv-cache-memory-gb"
            )
        return budget
    share = int(utilization * mem.total)
    budget = share - mem.used - mem.reserve
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {utilization} gives this process {_gib(share)} of the GPU's "
            f"{_gib(mem.total)}, but it already holds {_gib(mem.used)} (weights and earlier "
            f"allocations) and keeps {_gib(mem.reserve)} for activations: no room for the KV "
            "cache; raise --gpu-memory-utilization or set --kv-cache-memory-gb"
        )
    if budget > room:
        raise ValueError(
            f"gpu_memory_utilization {utilization} asks for {_gib(budget)} of KV cache, but only "
            f"{_gib(mem.free)} of the GPU's {_gib(mem.total)} is free ({_gib(room)} after "
            f"{_gib(mem.reserve)} for activations): other processes hold the rest; lower "
            "--gpu-memory-utilization (the shares of the processes on one GPU must sum to <= 1)"
        )
    return budget


def sized_by(mem: DeviceMemory | None, kv_cache_memory_gb: float | None) -> str:
    """The option that set the budget ``kv_budget_bytes`` returns, for an error to name."""
    if mem is None or kv_cache_memory_gb is not None:
        return "--kv-cache-memory-gb (kv_cache_memory_gb)"
    return "--gpu-memory-utilization (gpu_memory_utilization)"


def num_blocks_for(
    budget: int,
    per_block: int,
    block_size: int,
    max_model_len: int,
    max_len_given: bool,
    field: str = "--kv-cache-memory-gb (kv_cache_memory_gb)",
) -> int:
    """The blocks ``budget`` bytes hold. ValueError naming ``field`` (the option that set the
    budget: ``sized_by``) when that is fewer than 2, or when ``max_model_len`` was given
    (``max_len_given``) and one sequence of it would not fit: the cache must hold one request of
    the longest allowed length by itself, or preemption could not help it. (A max_model_len
    defaulted from the model is lowered instead: cache_plan.py.)"""
    num = budget // per_block
    need = -(-max_model_len // block_size)
    if num < 2 or (max_len_given and num < need):
        floor = max(2, need if max_len_given else 2)
        raise ValueError(
            f"the KV cache ({_gib(budget)}, {per_block} bytes a block of {block_size} tokens) "
            f"holds {num} blocks; it needs at least {floor}"
            + (f" for one sequence of max_model_len {max_model_len}" if max_len_given else "")
            + f" ({_gib(floor * per_block)}): raise {field}"
            + (" or lower --max-model-len" if max_len_given else "")
        )
    return num


def activation_reserve_bytes(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    elem_size: int,
) -> int:
    """An upper estimate of a step's activation peak above the weights, in bytes (what vLLM
    measures with a profile forward). One decoder layer's live tensors for
    ``max_num_batched_tokens`` tokens, counted twice (the allocator's fragmentation and the
    tensors of the layer before, not yet freed): the residual stream and its norm (3 x hidden),
    q, k, v and the attention output, gate and up and their product (3 x intermediate); plus the
    sampling rows' float32 logits with the sampler's copies (softmax, a sort's values and int64
    indices: 4 + 4 + 4 + 8 bytes a logit)."""
    attn = (2 * num_heads + 2 * num_kv_heads) * head_dim
    per_token = (3 * hidden_size + attn + 3 * intermediate_size) * elem_size
    layer = 2 * max_num_batched_tokens * per_token
    logits = min(max_num_seqs, max_num_batched_tokens) * vocab_size * 20
    return layer + logits
