"""The C kernels for the CPU (engine/kernels/native/): how they are built and loaded, and the paged
decode attention kernel against a float64 per-token loop and the torch reference."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from paged_inputs import TOL
from test_decode_attention import RAGGED, make_batch, naive_decode

import engine.kernels as kernels
from engine import cpu_isa
from engine.kernels import native
from engine.kernels.decode_attention import decode_attention_native, decode_attention_ref

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


@pytest.mark.parametrize(
    "seq_lens, heads, kv_heads, head_dim, block_size",
    [
        ([1, 9, 5], 4, 2, 16, 4),
        # The default model's heads; lengths on both sides of the 256-token work chunks.
        ([1, 255, 256, 257, 1100], 9, 3, 64, 16),
        ([40, 3], 8, 8, 16, 8),  # group 1
        ([300, 77], 8, 2, 80, 32),  # head_dim not a multiple of 16
        ([513], 4, 1, 128, 128),  # one KV head, the largest block
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_naive_loop(seq_lens, heads, kv_heads, head_dim, block_size, dtype):
    q, k_cache, v_cache, bt, lens = make_batch(
        seq_lens, heads, kv_heads, head_dim, block_size, dtype
    )
    out = torch.full_like(q, float("nan"))
    assert decode_attention_native(q, k_cache, v_cache, bt, lens, 0.3, out=out) is out
    naive = naive_decode(q.float(), k_cache.float(), v_cache.float(), bt, lens, 0.3)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(out.double(), naive.to(dtype).double(), **tol)


@pytest.mark.parametrize("seed", range(4))
def test_matches_reference_on_random_batches(seed):
    g = torch.Generator().manual_seed(300 + seed)
    lens = [int(torch.randint(1, 700, (1,), generator=g)) for _ in range(1 + 3 * seed)]
    dtype = (torch.float32, torch.bfloat16)[seed % 2]
    q, k_cache, v_cache, bt, lens_t = make_batch(lens, 9, 3, 64, 16, dtype, seed=seed)
    ref = decode_attention_ref(q, k_cache, v_cache, bt, lens_t, 0.125)
    out = decode_attention_native(q, k_cache, v_cache, bt, lens_t, 0.125)
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_a_sequence_gets_the_same_bits_in_any_batch_and_thread_count():
    # Work is cut per sequence into fixed chunks and merged in a fixed order, so the batch a
    # sequence decodes in (and the thread count) must not change a single bit of its output.
    q, k_cache, v_cache, bt, lens = make_batch([700, 3, 260, 1], 9, 3, 64, 16, torch.bfloat16)
    together = decode_attention_native(q, k_cache, v_cache, bt, lens, 0.125)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for b in range(4):
                alone = decode_attention_native(
                    q[b : b + 1], k_cache, v_cache, bt[b : b + 1], lens[b : b + 1], 0.125
                )
                assert torch.equal(alone[0], together[b]), (n, b)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# query heads per KV head: 4 (the AVX2 path takes them 3 + 1 at a time), 5 (3 + 2), 1 (one by one)
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (10, 2), (3, 3)])
def test_every_vector_path_is_batch_invariant_and_matches_the_reference(
    dtype, head_dim, heads, kv_heads
):
    # head_dim 64 and 128 take the vector paths (AVX-512, or AVX2 under make test's second pass),
    # 80 the loops; lengths not a multiple of the 4 or 8 keys scored at a time, and past a chunk.
    lens = [9, 700, 3, 260, 1, 513]
    q, k_cache, v_cache, bt, lens_t = make_batch(
        lens, heads, kv_heads, head_dim, 16, dtype, seed=head_dim
    )
    together = decode_attention_native(q, k_cache, v_cache, bt, lens_t, head_dim**-0.5)
    ref = decode_attention_ref(q, k_cache, v_cache, bt, lens_t, head_dim**-0.5)
    torch.testing.assert_close(together, ref, **TOL[dtype])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for b in range(len(lens)):
                alone = decode_attention_native(
                    q[b : b + 1],
                    k_cache,
                    v_cache,
                    bt[b : b + 1],
                    lens_t[b : b + 1],
                    head_dim**-0.5,
                )
                assert torch.equal(alone[0], together[b]), (n, b)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 64), (6, 2, 80)])
def test_a_cache_of_any_kv_dtype_matches_the_reference_and_is_batch_invariant(
    kv_dtype, dtype, heads, kv_heads, head_dim
):
    # --kv-cache-dtype: K and V in a dtype of their own (int8: rows with their scale), q and out
    # in the activations'. The grouped (9/3) and one-head (4/4) vector paths and the loops (80)
    # read it as the torch reference does, and a row's bits stay its own in any batch.
    from engine.kernels.kv_quant import to_cache

    lens = [9, 700, 3, 260, 1, 513]
    q, k_cache, v_cache, bt, lens_t = make_batch(
        lens, heads, kv_heads, head_dim, 16, torch.float32, seed=5
    )
    q, k_cache, v_cache = q.to(dtype), to_cache(k_cache, kv_dtype), to_cache(v_cache, kv_dtype)
    scale = head_dim**-0.5
    together = decode_attention_native(q, k_cache, v_cache, bt, lens_t, scale)
    ref = decode_attention_ref(q, k_cache, v_cache, bt, lens_t, scale)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else TOL[dtype]
    if kv_dtype == torch.int8 and dtype == torch.float32:  # int16 queries and weights
        tol = dict(rtol=1e-4, atol=1e-4)  # (attention_i8.h: 2^-16 of each row's largest)
    torch.testing.assert_close(together, ref, **tol)
    for b in range(len(lens)):
        alone = decode_attention_native(
            q[b : b + 1], k_cache, v_cache, bt[b : b + 1], lens_t[b : b + 1], scale
        )
        assert torch.equal(alone[0], together[b]), b


def test_empty_sequence_gets_zeros_and_empty_batch_is_fine():
    q, k_cache, v_cache, bt, lens = make_batch([5, 1], 4, 2, 16, 4, torch.float32)
    lens[1] = 0
    out = decode_attention_native(q, k_cache, v_cache, bt, lens, 0.5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = decode_attention_ref(q[:1], k_cache, v_cache, bt[:1], lens[:1], 0.5)
    torch.testing.assert_close(out[:1], ref)
    none = decode_attention_native(q[:0], k_cache, v_cache, bt[:0], lens[:0], 0.5)
    assert none.shape == (0, 4, 16)


def test_strided_views_and_int64_indices():
    q, k_cache, v_cache, bt, lens = make_batch(RAGGED, 9, 3, 64, 16, torch.bfloat16)
    fused = torch.randn(len(RAGGED), 15, 64).to(torch.bfloat16)
    fused[:, :9] = q
    big_out = torch.full((len(RAGGED) + 2, 9, 64), float("nan"), dtype=torch.bfloat16)
    decode_attention_native(
        fused[:, :9], k_cache, v_cache, bt.long(), lens.long(), 0.125, out=big_out[:-2]
    )
    ref = decode_attention_ref(q, k_cache, v_cache, bt, lens, 0.125)
    torch.testing.assert_close(big_out[:-2], ref, **TOL[torch.bfloat16])
    assert big_out[-2:].isnan().all()


def test_rejects_bad_input_before_reading_memory():
    q, k_cache, v_cache, bt, lens = make_batch([40, 20], 9, 3, 64, 16, torch.float32)
    num_blocks = k_cache.shape[0]

    def rejects(match, **change):
        args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=bt, seq_lens=lens)
        args.update(change)
        with pytest.raises(ValueError, match=match):
            decode_attention_native(**args, scale=0.125)

    rejects("k_cache", q=q[:, :, :32].contiguous())  # a cache row of another head_dim
    rejects("k_cache", k_cache=k_cache.to(torch.int16))
    rejects("v_cache", v_cache=v_cache.half())  # K and V of one dtype
    rejects("seq_lens", seq_lens=lens[:1])
    outside = bt.clone()
    outside[0, 1] = num_blocks  # one past the cache
    rejects("outside the cache", block_tables=outside)
    negative = bt.clone()
    negative[1, 0] = -1
    rejects("outside the cache", block_tables=negative)
    too_long = lens.clone()
    too_long[0] = bt.shape[1] * 16 + 1
    rejects("longer than its block table", seq_lens=too_long)
    rejects("divide 256", k_cache=k_cache[:, :12], v_cache=v_cache[:, :12])


def test_cpu_dispatch_takes_the_c_kernel_unless_told_otherwise(monkeypatch):
    q, k_cache, v_cache, bt, lens = make_batch([30], 4, 2, 16, 8, torch.float32)
    calls = []
    real = kernels.decode_attention_native

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(kernels, "decode_attention_native", spy)
    kernels.decode_attention(q, k_cache, v_cache, bt, lens, 0.25)
    assert calls == [1]
    monkeypatch.setenv("ENGINE_KERNELS", "torch")
    kernels.decode_attention(q, k_cache, v_cache, bt, lens, 0.25)
    assert calls == [1]


def test_threads_come_from_torchs_openmp_runtime():
    # A second OpenMP runtime would give the process a second thread team fighting torch's for
    # the cores (the slowdown AsyncLLM's engine thread had). The kernels link libgomp.so.1, which
    # must resolve to the one torch loaded, not the system's. (Wheels such as sentencepiece
    # bundle their own under mangled names; those are not ours.)
    q, k_cache, v_cache, bt, lens = make_batch([300, 20], 9, 3, 64, 16, torch.float32)
    decode_attention_native(q, k_cache, v_cache, bt, lens, 0.125)
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if line.rstrip().endswith("/libgomp.so.1")}
    assert len(gomp) == 1, gomp
    assert "torch" in gomp.pop()


def test_built_for_this_cpu_under_its_cap():
    # engine/cpu_isa.py decides the target: -march=native, or under ENGINE_CPU_ISA the class it
    # names (make test's second pass: x86-64-v3), and torch runs capped alike in this process.
    isa = cpu_isa.this_cpu()
    assert native.compile_flags()[-len(isa.march_flags()) :] == isa.march_flags()
    assert native.library() is not None and native.library_path().exists()
    if isa.cap != "native" and isa.x86:
        want = isa.torch_environment()["ATEN_CPU_CAPABILITY"].upper()
        assert torch.backends.cpu.get_cpu_capability() == want


def expected_row_dot_paths(isa: cpu_isa.CpuIsa) -> dict[str, str]:
    """The row dots gemv.h must compile in for ``isa`` (its guards, by the features the target
    flags give): AVX-512 where the cap allows it, AVX2 with FMA and F16C below, else loops."""
    avx2 = isa.avx2 and isa.fma and isa.f16c
    vec = "avx512" if isa.avx512f else ("avx2" if avx2 else "c")
    return {
        "int8": "avx512vnni" if isa.avx512_vnni and isa.avx512bw else ("avx2" if avx2 else "c"),
        "bf16": "avx512bf16" if isa.avx512_bf16 and isa.avx512bw else vec,
        "float": vec,
    }


@pytest.mark.skipif(not cpu_isa.this_cpu().x86, reason="the vector row dots are x86-64's")
def test_row_dots_have_the_vector_paths_of_this_cpu_under_its_cap():
    # What the library reports it compiled in (gemv.h's GEMV_PATHS): under make test's second
    # pass (ENGINE_CPU_ISA=avx2) every weight kind must take the AVX2 path, not the plain loops.
    isa = cpu_isa.this_cpu()
    got = native.row_dot_paths()
    assert got == expected_row_dot_paths(isa), (isa.level, got)
    if isa.level == "avx2":
        assert got == {"int8": "avx2", "bf16": "avx2", "float": "avx2"}


def expected_attention_path(isa: cpu_isa.CpuIsa) -> str:
    """The path decode_attention.c must compile in for ``isa`` (its guards): AVX-512 where the cap
    allows it, AVX2 with FMA and F16C below, else loops."""
    if isa.avx512f:
        return "avx512"
    return "avx2" if isa.avx2 and isa.fma and isa.f16c else "c"


@pytest.mark.skipif(not cpu_isa.this_cpu().x86, reason="the vector attention paths are x86-64's")
def test_attention_has_the_vector_path_of_this_cpu_under_its_cap():
    # Under make test's second pass (ENGINE_CPU_ISA=avx2) the decode attention must take its AVX2
    # path, not the plain loops.
    isa = cpu_isa.this_cpu()
    assert native.attention_path() == expected_attention_path(isa), isa.level
    if isa.level == "avx2":
        assert native.attention_path() == "avx2"


def test_the_build_key_hashes_every_file_the_build_reads(monkeypatch, tmp_path):
    # Every header of the folder is read by some source (gemv_avx2.h only through gemv.h), and
    # every one the sources include, however deep, counts in the cache key: a change in any of
    # them builds afresh instead of loading a library built from the old one.
    here = native._HERE
    on_disk = {p.name for p in here.iterdir() if p.suffix in (".c", ".h")}
    assert set(native.build_inputs()) == on_disk
    assert set(native.SOURCES) < on_disk
    copy = tmp_path / "native"
    shutil.copytree(here, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(native, "_HERE", copy)
    cc = native.compiler()
    key = native._build_key(cc)
    assert native._build_key(cc) == key
    for name in native.build_inputs():
        if name in native.SOURCES:
            continue
        before = (copy / name).read_bytes()
        (copy / name).write_bytes(before + b"/* changed */\n")
        assert native._build_key(cc) != key, name
        (copy / name).write_bytes(before)
    assert native._build_key(cc) == key


# The AVX-512 targets of engine/cpu_isa.py (ENGINE_CPU_ISA avx512 and avx512bf16) and the row
# dots (gemv.h) and attention path (decode_attention.c) each must compile in.
AVX512_TARGETS = [
    (("-march=x86-64-v4",), b"int8:avx2 bf16:avx512 float:avx512"),
    (
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
        b"int8:avx512vnni bf16:avx512bf16 float:avx512",
    ),
]


@pytest.mark.skipif(not cpu_isa.this_cpu().x86, reason="the AVX-512 paths are x86-64's")
@pytest.mark.parametrize("march, row_dots", AVX512_TARGETS, ids=["avx512", "avx512bf16"])
def test_the_avx512_paths_compile(monkeypatch, tmp_path, march, row_dots):
    # Compiled only (a CPU without AVX-512 cannot run them): every source builds for the AVX-512
    # classes by the build's own code, with the paths those targets must take.
    monkeypatch.setattr(native, "compile_flags", lambda: (*native.FLAGS, *march))
    objects = {
        Path(o).name: Path(o).read_bytes() for o in native._compile_all(native.compiler(), tmp_path)
    }
    assert set(objects) == {f"{src}.o" for src in native.SOURCES}
    assert row_dots in objects["int8_matmul.c.o"]
    assert b"avx512\0" in objects["decode_attention.c.o"]


@pytest.mark.slow  # CI time on a 2-core Zen 3 EPYC: `pytest -m slow`
def test_build_is_cached_and_a_failed_build_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_state", {})
    assert native.library() is not None
    (built,) = (tmp_path / "native").glob("*/libengine_native.so")

    def no_compiler_run(*a, **kw):
        raise AssertionError("a cached build must not compile again")

    monkeypatch.setattr(native.subprocess, "run", no_compiler_run)
    monkeypatch.setattr(native, "_state", {})
    assert native.library() is not None
    assert list((tmp_path / "native").glob("*/*")) == [built]  # no temporary left behind
    monkeypatch.undo()

    # A compiler that fails: a warning and the torch references, or an error when forced.
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "other"))
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")
    monkeypatch.setattr(native, "_state", {})
    with caplog.at_level(logging.WARNING, logger="engine.kernels.native"):
        assert native.library() is None
    assert "torch references" in caplog.text
    assert not kernels.use_native(torch.device("cpu"))
    q, k_cache, v_cache, bt, lens = make_batch([30], 4, 2, 16, 8, torch.float32)
    out = kernels.decode_attention(q, k_cache, v_cache, bt, lens, 0.25)  # the reference serves
    torch.testing.assert_close(out, decode_attention_ref(q, k_cache, v_cache, bt, lens, 0.25))
    assert not list((tmp_path / "other").glob("native/*/*.so"))
    monkeypatch.setenv("ENGINE_KERNELS", "native")
    with pytest.raises(native.NativeUnavailable, match="failed"):
        native.library()
    monkeypatch.setattr(native, "_state", {})  # the next test builds afresh
