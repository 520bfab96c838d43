"""The namespace of stored KV blocks: which model computed them and how they are laid out.

A block key (the chained prefix hash) names tokens, not KV: the same tokens give different KV
under another model, dtype or block size. Every stored block therefore lives inside a namespace
whose 16-byte id fingerprints

- the model: its architecture and shapes (every field of ModelConfig that changes the numbers,
  never ``name``, which may be a file path that differs between hosts) and a digest of its
  weights;
- the KV layout: dtype, block size, layers, KV heads, head dim.

The weight digest hashes each parameter's name, shape, dtype and a strided sample of its
elements (``SAMPLES_PER_TENSOR`` evenly spaced), not every byte: a full pass over a large model on
a GPU would copy all its weights to the host at start. The sample still tells apart a different
checkpoint, a fine-tune, or another quantisation, which change (nearly) every element; it does not
guard against an adversary editing untouched elements, which the pool does not need to.
Hosts that load the same file with the same dtype agree on the id; a foreign block never loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

import msgpack
import torch

from engine.config import ModelConfig

SAMPLES_PER_TENSOR = 4096
ID_LEN = 16


@dataclass(frozen=True)
class KVNamespace:
    model_digest: str  # hex digest of the model's architecture, shapes and sampled weights
    dtype: str  # torch dtype name of the KV cache, e.g. "float32", "bfloat16", "int8" (rows
    # of int8 values with their fp16 scale, kvcache/kv_dtype.py)
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    id: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVNamespace.{name} must be a positive int, got {value!r}")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"KVNamespace.dtype {self.dtype!r} is not a torch dtype name")
        layout = msgpack.packb(
            [
                "engine-kv-namespace-v1",
                self.model_digest,
                self.dtype,
                self.block_size,
                self.num_layers,
                self.num_kv_heads,
                self.head_dim,
            ]
        )
        object.__setattr__(self, "id", hashlib.sha256(layout).digest()[:ID_LEN])

    @property
    def elem_size(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def block_bytes(self) -> int:
        """One block's K and V for every layer, as the store holds it."""
        from engine.kernels.kv_quant import row_elems

        row = row_elems(getattr(torch, self.dtype), self.head_dim)  # int8: values and scale
        return (self.num_layers * 2 * self.block_size * self.num_kv_heads * row) * self.elem_size

    def describe(self) -> dict:
        return {
            "id": self.id.hex(),
            "model_digest": self.model_digest,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_bytes": self.block_bytes,
        }


def model_digest(model_config: ModelConfig, model: torch.nn.Module) -> str:
    """sha256 over the config (without ``name``) and a strided sample of every parameter."""
    h = hashlib.sha256(b"engine-model-digest-v1")
    config = dataclasses.asdict(model_config)
    config.pop("name", None)
    h.update(msgpack.packb(_plain(config)))
    for pname, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        h.update(msgpack.packb([pname, list(param.shape), str(param.dtype)]))
        h.update(_sample_bytes(param.detach()))
    return h.hexdigest()


def make_namespace(
    model_config: ModelConfig, model: torch.nn.Module, dtype: torch.dtype, block_size: int
) -> KVNamespace:
    return KVNamespace(
        model_digest=model_digest(model_config, model),
        dtype=str(dtype).removeprefix("torch."),
        block_size=block_size,
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
    )


def _sample_bytes(t: torch.Tensor) -> bytes:
    flat = t.reshape(-1)
    step = max(1, flat.numel() // SAMPLES_PER_TENSOR)
    # Only the samples are copied (and moved to the host), whatever the tensor's size or device.
    sample = flat[::step][:SAMPLES_PER_TENSOR].contiguous().cpu()
    return sample.view(torch.uint8).numpy().tobytes()


def _plain(value):
    """Config values as msgpack-able plain data (tuples to lists, nested dataclass dicts)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in sorted(value.items())}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
