"""The weight cache: a GGUF model's weights as the runtime holds them (dequantized, q/k rows
unpermuted, q/k/v and gate/up fused, in the serving dtype) in one safetensors file, so that later
starts map that file instead of dequantizing and copying (for SmolLM2 most of a 12 s start).

A file is named by a key over everything its contents depend on: the GGUF file's size, mtime and
a hash of its first MiB (the header: metadata and tensor table), the dtype, and LOADER_VERSION
(bump it whenever loading changes what the runtime holds). The file's metadata repeats the key and
carries a checksum of every tensor's bytes. Anything that does not match (a truncated or corrupt
file, another key, another set of tensors) is a miss: a warning, and the caller rebuilds the file.
A cache problem is never an error: an unwritable directory only costs the speed-up.

Writes go to a temporary file in the same directory, renamed into place, so a reader never sees
half a file and concurrent writers (several workers starting at once) are harmless.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Mapping

import torch
import xxhash

logger = logging.getLogger(__name__)

LOADER_VERSION = 1
_HEADER_BYTES = 1 << 20
_FORMAT = "engine-weights"


def cache_key(model_path: str, dtype: torch.dtype) -> str:
    """What the cached contents depend on, hashed (hex)."""
    st = os.stat(model_path)
    h = hashlib.sha256()
    h.update(f"{_FORMAT}:{LOADER_VERSION}:{dtype}:{st.st_size}:{st.st_mtime_ns}:".encode())
    with open(model_path, "rb") as f:
        h.update(f.read(_HEADER_BYTES))
    return h.hexdigest()


def cache_file(directory: str, model_path: str, dtype: torch.dtype, key: str) -> str:
    """``<stem>.<dtype>.<hash of the model's path>.<key>.st``: a file's name says which model
    it serves, and ``save`` prunes the files of older versions of the same model file."""
    return os.path.join(directory, f"{_family(model_path, dtype)}{key[:20]}.st")


def _family(model_path: str, dtype: torch.dtype) -> str:
    stem = os.path.splitext(os.path.basename(model_path))[0]
    where = hashlib.sha256(os.path.abspath(model_path).encode()).hexdigest()[:8]
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
            names = set(f.keys())
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
    return tensors


def save(path: str, key: str, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Write ``tensors`` atomically and delete the files of the same family (same model path
    and dtype, older keys); False (and a warning) when the file cannot be written."""
    from safetensors.torch import save_file

    directory = os.path.dirname(path)
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".st")
        os.close(fd)
        cpu = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
        meta = {"format": _FORMAT, "key": key, "checksum": _checksum(cpu)}
        save_file(cpu, tmp, metadata=meta)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
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
