"""Kernels in C for the CPU, built at run time by the system's C compiler and called via ctypes.

On the CPU the engine's hot paths were torch references: a dozen ops per layer, each a pass over
memory. The C sources beside this file do the same work in one pass (each lives next to the
Triton kernel and the torch reference of its family, and has the same signature behind its
launcher; decode_layer.c runs a whole decoder layer, see engine/layers/native_decode.py). They
are compiled once per source (the .c files and every header they include, ``build_inputs()``),
compiler and target into ``ENGINE_CACHE_DIR/native``
(``~/.cache/engine/native``), in about two seconds (the sources in parallel), with ``-O3
-fopenmp`` and the target flags of engine/cpu_isa.py (``-march=native``, or under
``ENGINE_CPU_ISA`` ``-march=x86-64-v3`` for avx2, ``x86-64-v4`` for avx512, v4 with
``-mavx512bf16 -mavx512vnni`` for avx512bf16; ``compile_flags()``); later processes load the
cached library. OpenMP comes from the
``libgomp.so.1`` torch has already loaded, so a kernel's threads are torch's own team, not a
second one competing for the cores.

The structs Python passes (decode_layer.c's ``Proj``, ``Layer``, ``Step``) are mirrored as ctypes
structs in structs.py; C declares each by one field list, from which come both the struct and the
layout ``engine_struct_layout`` reports, and every load compares that layout (names, types,
offsets, sizes) with the mirrors, so a library whose structs differ is not used.

Without a compiler, or when the build fails or its structs differ from their mirrors,
``library()`` returns None once with a warning and the torch references stay in use;
``ENGINE_KERNELS=native`` makes that an error instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from engine import cpu_isa, envs
from engine.kernels.native import structs

logger = logging.getLogger(__name__)

SOURCES = (
    "decode_attention.c",
    "decode_layer.c",
    "float_matmul.c",
    "gemm.c",
    "int8_matmul.c",
)
# A local include (`#include "gemv.h"`): the headers a build reads besides the system's.
_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)
# The element types the kernels take, by the codes of dtypes.h.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# A KV cache's element codes: the float dtypes', and int8 rows with their scale (kv_dtype.py).
KV_DTYPE_CODES = {**DTYPE_CODES, torch.int8: 3}
FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-Wall")  # and the target's (compile_flags)
_HERE = Path(__file__).resolve().parent

_lock = threading.Lock()
# "lib": the CDLL or None, "error": why it is None, "path": the loaded library's file
_state: dict[str, object] = {}

_I, _I64, _P, _F = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    # dtype, KV dtype, q, k_cache, v_cache, out, block_tables, seq_lens, row_tables, table
    # rows, batch, heads, kv_heads, dim, block_size, num_blocks, table width, 11 strides, scale,
    # threads
    "engine_decode_attention": [_I, _I, _P, _P, _P, _P, _P, _P, _P, _I64, _I, _I, _I, _I, _I]
    + [_I64] * 13
    + [_F, _I],
    # layer, step, hidden (structs.Layer, structs.Step)
    "engine_decode_layer": [_P, _P, _P],
    # which struct, which field (-1: the struct), &name, &type, &offset, &size
    "engine_struct_layout": structs.SIGNATURE,
    # dtype, x, qweight, scales, y, rows, N, K, x row stride, y row stride, threads
    "engine_int8_matmul": [_I, _P, _P, _P, _P, _I, _I64, _I64, _I64, _I64, _I],
    # x dtype, weight dtype, x, w, y (float32), rows, N, K, x row stride, y row stride, threads
    "engine_float_matmul": [_I, _I, _P, _P, _P, _I, _I64, _I64, _I64, _I64, _I],
    # x dtype, weight dtype, x, packed w, y (float32), rows, N, K, x row stride, y row stride,
    # threads
    # dtype, x, weight, out, rows, n, eps, threads
    "engine_rms_norm": [_I, _P, _P, _P, _I64, _I, _F, _I],
    "engine_gemm": [_I, _I, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I],
    # x dtype, x, W8A8 panels, y (float32), rows, N, K, x row stride, y row stride, threads
    "engine_gemm_q8": [_I, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I],
}


class NativeUnavailable(RuntimeError):
    """The C kernels could not be built or loaded here (the message says why)."""


def compiler() -> str | None:
    """CC if set, else cc or gcc on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compile_flags() -> tuple[str, ...]:
    """The flags the kernels are compiled with here: FLAGS and this CPU's target under its
    ENGINE_CPU_ISA cap (cpu_isa.CpuIsa.march_flags)."""
    return (*FLAGS, *cpu_isa.this_cpu().march_flags())


def _build_key(cc: str) -> str:
    h = hashlib.sha256()
    resolved = os.path.realpath(shutil.which(cc) or cc)
    h.update(resolved.encode())
    try:
        h.update(str(os.stat(resolved).st_mtime_ns).encode())
    except OSError:
        pass
    flags = compile_flags()
    h.update(" ".join(flags).encode())
    h.update(platform.machine().encode())
    if "-march=native" in flags:  # what native means is this CPU's
        h.update(cpu_isa.this_cpu().model.encode())
        h.update(" ".join(sorted(cpu_isa.this_cpu().hardware_flags)).encode())
    for name in build_inputs():
        h.update(name.encode())
        h.update((_HERE / name).read_bytes())
    return h.hexdigest()[:20]


def build_inputs() -> tuple[str, ...]:
    """The files of this folder a build reads, as paths relative to it: SOURCES and every header
    they include with ``#include "..."``, through the headers that include others. The cache key
    hashes them all, so a change in any header, however deep, builds afresh."""
    found: list[str] = []
    todo = list(SOURCES)
    while todo:
        name = todo.pop(0)
        if name in found:
            continue
        found.append(name)
        path = _HERE / name
        for inc in _LOCAL_INCLUDE.findall(path.read_text()):
            todo.append(os.path.relpath(os.path.normpath(path.parent / inc), _HERE))
    return tuple(found)


def _build(cc: str) -> Path:
    out_dir = Path(envs.cache_root()) / "native" / _build_key(cc)
    target = out_dir / "libengine_native.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes starting together (a cluster's
    # workers) never load a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=out_dir) as work:
            objects = _compile_all(cc, Path(work))
            _run([cc, *compile_flags(), *objects, "-o", tmp, "-lm"])
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _compile_all(cc: str, work: Path) -> list[str]:
    """Every source to an object file in ``work``, all at once (decode_layer.c alone takes
    ~1.5 s here); the objects' paths."""
    flags = [f for f in compile_flags() if f != "-shared"]
    jobs: list[tuple[list[str], subprocess.Popen]] = []
    try:
        for src in SOURCES:
            cmd = [cc, *flags, "-c", str(_HERE / src), "-o", str(work / f"{src}.o")]
            jobs.append(
                (
                    cmd,
                    subprocess.Popen(
                        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
                    ),
                )
            )
        for cmd, proc in jobs:
            _, err = proc.communicate(timeout=120)
            if proc.returncode != 0:
                raise NativeUnavailable(_failed(cmd, proc.returncode, err))
    finally:
        for _, proc in jobs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [cmd[-1] for cmd, _ in jobs]


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise NativeUnavailable(_failed(cmd, done.returncode, done.stderr))


def _failed(cmd: list[str], code: int, stderr: str) -> str:
    return f"{' '.join(cmd)} failed ({code}): {stderr.strip()[-2000:]}"


def _load() -> ctypes.CDLL:
    # torch (imported above) has loaded its libgomp.so.1, so the kernels' OpenMP resolves to it.
    cc = compiler()
    if cc is None:
        raise NativeUnavailable("no C compiler (set CC, or install gcc)")
    try:
        path = _build(cc)
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"building the C kernels failed: {e}") from e
    lib = load_library(path)
    _state["path"] = path
    return lib


def load_library(path: str | os.PathLike[str]) -> ctypes.CDLL:
    """The kernels built at ``path``, their signatures declared and their structs checked
    against the ctypes mirrors (NativeUnavailable where they differ)."""
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    lib.engine_gemv_paths.argtypes = []
    lib.engine_gemv_paths.restype = ctypes.c_char_p
    lib.engine_decode_attention_path.argtypes = []
    lib.engine_decode_attention_path.restype = ctypes.c_char_p
    lib.engine_gemm_path.argtypes = []
    lib.engine_gemm_path.restype = ctypes.c_char_p
    lib.engine_gemm_q8_path.argtypes = []
    lib.engine_gemm_q8_path.restype = ctypes.c_char_p
    problems = structs.check(lib)
    if problems:
        raise NativeUnavailable(
            f"the C structs and their ctypes mirrors (engine/kernels/native/structs.py) differ in "
            f"{path}: {'; '.join(problems)}"
        )
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first use; None (warned once) where they cannot be built.
    ENGINE_KERNELS=native raises NativeUnavailable instead of returning None."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                try:
                    _state["lib"] = _load()
                except NativeUnavailable as e:
                    _state["lib"], _state["error"] = None, str(e)
                    if envs.kernel_backend() != "native":
                        logger.warning("C kernels unavailable, using the torch references: %s", e)
    lib = _state["lib"]
    if lib is None and envs.kernel_backend() == "native":
        raise NativeUnavailable(str(_state["error"]))
    return lib  # type: ignore[return-value]


def library_path() -> Path | None:
    """The file of the loaded kernels (built for compile_flags()), None before library() loaded
    them or where they could not be built."""
    path = _state.get("path") if _state.get("lib") is not None else None
    return path  # type: ignore[return-value]


def row_dot_paths() -> dict[str, str]:
    """The row dots (gemv.h) the loaded kernels were compiled with, by weight kind ("int8",
    "bf16", "float": float16 and float32): "avx512vnni", "avx512bf16", "avx512", "avx2" or "c"
    (plain loops). NativeUnavailable where the kernels cannot be built."""
    lib = library()
    if lib is None:
        raise NativeUnavailable(str(_state["error"]))
    return dict(p.split(":", 1) for p in lib.engine_gemv_paths().decode().split())


def attention_path() -> str:
    """The vector path the loaded decode attention kernel (decode_attention.c) was compiled with:
    "avx512", "avx2" (AVX2, FMA, F16C) or "c" (plain loops). NativeUnavailable where the kernels
    cannot be built."""
    lib = library()
    if lib is None:
        raise NativeUnavailable(str(_state["error"]))
    return lib.engine_decode_attention_path().decode()


def gemm_path() -> str:
    """The path the loaded fixed-order GEMM (gemm.h) was compiled with: "avx2" (AVX2, FMA, F16C;
    CPUs with AVX-512 too) or "c" (plain loops with fmaf; the same bits). NativeUnavailable where
    the kernels cannot be built."""
    lib = library()
    if lib is None:
        raise NativeUnavailable(str(_state["error"]))
    return lib.engine_gemm_path().decode()


def gemm_q8_path() -> str:
    """The path the loaded W8A8 GEMM (gemm_q8.h) was compiled with: "avx512vnni", "avx2" or "c"
    (the same bits). NativeUnavailable where the kernels cannot be built."""
    lib = library()
    if lib is None:
        raise NativeUnavailable(str(_state["error"]))
    return lib.engine_gemm_q8_path().decode()


def library_for(**tensors: torch.Tensor) -> ctypes.CDLL:
    """The loaded kernels for a call on ``tensors``: ValueError naming a tensor that is not on
    the CPU, NativeUnavailable where the kernels cannot be built."""
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU for the C kernel, got {t.device}")
    lib = library()
    if lib is None:
        raise NativeUnavailable("the C kernels are not built here")
    return lib
