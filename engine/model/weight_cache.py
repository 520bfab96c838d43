"""The weight cache: a GGUF model's weights as the runtime holds them (dequantized, q/k rows
unpermuted, q/k/v and gate/up fused, in the serving dtype) in one safetensors file, so that later
starts map that file instead of dequantizing and copying (for SmolLM2 most of a 12 s start).

A file is named by a key over everything its contents depend on: the GGUF file's size, mtime and
a hash of its first MiB (the header: metadata and tensor table), the dtype, and LOADER_VERSION
(bump it whenever loading changes what the runtime holds). The file's metadata repeats the key and
carries a checksum of every tensor's bytes. Anything that does not match (a truncated or corrupt
file, another key, another set of tensors) is a miss: a warning, and the caller rebuilds the file.
A cache problem is never an error: an unwritable directory only costs the speed-up.

Every tensor's bytes start at a multiple of ALIGN bytes in the file (the header is padded with
spaces, and a tensor whose size is not a multiple of ALIGN is followed by a padding tensor, named
_PAD + a number, that ``load`` skips), so the mapped tensors are as aligned as the ones torch
allocates. That is needed for equal results, not only speed: the float32 CPU kernels sum in
another order for a weight 8 bytes off a 64-byte boundary (where safetensors' own writer puts
them), and an engine that mapped such a file computed float32 logprobs up to 5e-6 apart from one
that read the checkpoint (bf16 ones were equal). ``load`` copies any tensor that still is not
aligned (a file written otherwise), so an engine's numbers never depend on which way it loaded.

Writes go to a temporary file in the same directory, renamed into place, so a reader never sees
half a file and concurrent writers (several workers starting at once) are harmless.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
from collections.abc import Mapping

import torch
import xxhash

from engine.pipeline_stage import WHOLE_MODEL, PipelineStage

logger = logging.getLogger(__name__)

LOADER_VERSION = 2  # 2: tensors aligned to ALIGN bytes in the file
_HEADER_BYTES = 1 << 20
_FORMAT = "engine-weights"
ALIGN = 64  # torch's CPU allocator's alignment (c10's gAlignment)
_PAD = "__engine_pad__."
_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}


def cache_key(model_path: str, dtype: torch.dtype, stage: PipelineStage = WHOLE_MODEL) -> str:
    """What the cached contents depend on, hashed (hex)."""
    st = os.stat(model_path)
    h = hashlib.sha256()
    h.update(f"{_FORMAT}:{LOADER_VERSION}:{dtype}:{st.st_size}:{st.st_mtime_ns}:".encode())
    if not stage.is_whole:  # the whole model's key stays what it was
        h.update(f"stage {stage}:".encode())
    with open(model_path, "rb") as f:
        h.update(f.read(_HEADER_BYTES))
    return h.hexdigest()


def cache_file(
    directory: str,
    model_path: str,
    dtype: torch.dtype,
    key: str,
    stage: PipelineStage = WHOLE_MODEL,
) -> str:
    """``<stem>.<dtype>.<hash of the model's path>.<key>.st``: a file's name says which model
    it serves, and ``save`` prunes the files of older versions of the same model file. A
    pipeline stage's file holds only its weights and is named ``...<hash>-stage<I>of<N>.<key>.st``:
    a family of its own, which neither prunes the whole model's nor another stage's files."""
    return os.path.join(directory, f"{_family(model_path, dtype, stage)}{key[:20]}.st")


def _family(model_path: str, dtype: torch.dtype, stage: PipelineStage = WHOLE_MODEL) -> str:
    stem = os.path.splitext(os.path.basename(model_path))[0]
    where = hashlib.sha256(os.path.abspath(model_path).encode()).hexdigest()[:8]
    if not stage.is_whole:
        where += f"-stage{stage.index}of{stage.count}"
    return f"{stem}.{str(dtype).removeprefix('torch.')}.{where}."


def _checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    h = xxhash.xxh3_64()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def load(path: str, key: str, expected: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The cached tensors, memory-mapped (no copy), or {} when there is no usable file (a
    warning says why when one exists). ``expected``: name -> a tensor of the right shape and
    dtype (the model's own, empty parameters)."""
    if not os.path.exists(path):
        return {}
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("format") != _FORMAT or meta.get("key") != key:
                raise ValueError("written for another model file, dtype or loader version")
            names = {name for name in f.keys() if not name.startswith(_PAD)}
            if names != set(expected):
                raise ValueError(f"holds {len(names)} tensors, the model has {len(expected)}")
            tensors = {name: f.get_tensor(name) for name in names}
    except Exception as exc:  # safetensors raises its own error types for a damaged header
        logger.warning("weight cache %s is unusable (%s); rebuilding it", path, exc)
        return {}
    for name, t in tensors.items():
        want = expected[name]
        if t.shape != want.shape or t.dtype != want.dtype:
            logger.warning(
                "weight cache %s: %s is %s %s, expected %s %s; rebuilding it",
                path,
                name,
                t.dtype,
                list(t.shape),
                want.dtype,
                list(want.shape),
            )
            return {}
    if _checksum(tensors) != meta.get("checksum"):
        logger.warning("weight cache %s: checksum mismatch (corrupt file); rebuilding it", path)
        return {}
    # A misaligned tensor runs other GEMM code (other float results): copy it into aligned memory.
    return {n: t if t.data_ptr() % ALIGN == 0 else t.clone() for n, t in tensors.items()}


def save(path: str, key: str, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Write ``tensors`` atomically and delete the files of the same family (same model path
    and dtype, older keys); False (and a warning) when the file cannot be written."""
    directory = os.path.dirname(path)
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".st")
        os.close(fd)
        cpu = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
        meta = {"format": _FORMAT, "key": key, "checksum": _checksum(cpu)}
        _write_aligned(tmp, cpu, meta)
        os.replace(tmp, path)
        tmp = None
        _prune(path)
    except Exception as exc:  # a full disk, a read-only directory: only the speed-up is lost
        logger.warning("could not write the weight cache %s (%s); continuing without", path, exc)
        return False
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return True


def _write_aligned(path: str, tensors: Mapping[str, torch.Tensor], meta: dict[str, str]) -> None:
    """A safetensors file (safe_open reads it) whose every tensor starts at a multiple of ALIGN
    bytes from the file's start: the header padded with spaces (the format allows it), padding
    tensors (uint8, named _PAD + a number) filling the gaps (the format allows no holes)."""
    entries: dict[str, object] = {}
    chunks: list[torch.Tensor | bytes] = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} is not cached")
        size = t.numel() * t.element_size()
        entries[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        chunks.append(t)
        offset += size
        gap = -offset % ALIGN
        if gap:
            entries[f"{_PAD}{len(entries)}"] = {
                "dtype": "U8",
                "shape": [gap],
                "data_offsets": [offset, offset + gap],
            }
            chunks.append(bytes(gap))
            offset += gap
    entries["__metadata__"] = meta
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for chunk in chunks:
            if isinstance(chunk, bytes):
                f.write(chunk)
            elif chunk.numel():
                f.write(chunk.reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


def _prune(path: str) -> None:
    """Delete the other files of ``path``'s family: the cache of a model file that changed."""
    directory, name = os.path.split(path)
    family = name[: -len(".st")].rsplit(".", 1)[0] + "."
    for other in os.listdir(directory):
        if other != name and other.startswith(family) and other.endswith(".st"):
            try:
                os.unlink(os.path.join(directory, other))
            except OSError:
                pass
