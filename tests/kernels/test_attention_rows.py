"""The C paged attention (native/decode_attention.c) at rows of their own causal lengths: the
rows of a prefill chunk give the bits a decode of each token alone gives, whatever the rows
beside them, the chunking of the prompt, the mode that splits the work (row blocks or
flash-decoding) or the thread count; and they stay within the reference's bounds."""

from __future__ import annotations

import pytest
import torch
from native_builds import build_for
from paged_inputs import TOL, random_paged_cache

from engine.kernels import native
from engine.kernels.decode_attention import decode_attention_native, decode_attention_ref
from engine.kernels.kv_quant import to_cache

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


def sequences(lens, dtype, heads=9, kv_heads=3, dim=64, block=16, seed=0, kv_dtype=None):
    """A cache (of ``kv_dtype``, by default ``dtype``) holding sequences of ``lens`` tokens and
    one query per token of each."""
    g = torch.Generator().manual_seed(seed)
    k, v, tables = random_paged_cache(lens, kv_heads, dim, block, torch.float32, g)
    k, v = to_cache(k, kv_dtype or dtype), to_cache(v, kv_dtype or dtype)
    q = torch.randn(sum(lens), heads, dim, generator=g).to(dtype)
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(torch.int32)
    causal = torch.cat([torch.arange(1, n + 1) for n in lens]).to(torch.int32)
    return q, k, v, tables, seq, causal


def rows(q, k, v, tables, seq, causal, idx):
    """Attention of the query rows ``idx`` in one call (each over its own causal length)."""
    idx = torch.as_tensor(idx)
    return decode_attention_native(
        q[idx].contiguous(), k, v, tables, causal[idx].contiguous(), q.shape[-1] ** -0.5,
        row_tables=seq[idx].contiguous(),
    )  # fmt: skip


@pytest.mark.parametrize(
    "dtype, kv_dtype, dim",
    [
        (torch.float32, torch.float32, 64),
        (torch.bfloat16, torch.bfloat16, 64),
        # --kv-cache-dtype: row blocks widen each chunk once (exactly), flash-decoding reads the
        # cache: the same bits; int8 on the vector path (64) and the loops (80)
        (torch.float32, torch.bfloat16, 64),
        (torch.float32, torch.int8, 64),
        (torch.bfloat16, torch.int8, 80),
    ],
)
def test_prefill_rows_give_each_tokens_decode_bits(dtype, kv_dtype, dim):
    # 700 tokens: three 256-token chunks, the last partial; and a short second sequence
    q, k, v, tables, seq, causal = sequences([700, 40], dtype, dim=dim, kv_dtype=kv_dtype)
    every = rows(q, k, v, tables, seq, causal, range(740))  # row blocks (many rows)
    for t in [0, 1, 255, 256, 257, 511, 699, 700, 739]:
        alone = rows(q, k, v, tables, seq, causal, [t])  # a decode of token t (flash-decoding)
        assert torch.equal(alone[0], every[t]), t
    # the prompt chunked differently, and mixed with the other sequence's rows
    for lo, hi in [(0, 100), (100, 357), (357, 700), (650, 740)]:
        assert torch.equal(rows(q, k, v, tables, seq, causal, range(lo, hi)), every[lo:hi])
    shuffled = torch.randperm(740, generator=torch.Generator().manual_seed(1))
    assert torch.equal(rows(q, k, v, tables, seq, causal, shuffled), every[shuffled])


def test_the_thread_count_changes_no_bit():
    q, k, v, tables, seq, causal = sequences([600], torch.float32)
    before = torch.get_num_threads()
    try:
        got = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got.append(rows(q, k, v, tables, seq, causal, range(600)))
            got.append(rows(q, k, v, tables, seq, causal, [599, 300]))
    finally:
        torch.set_num_threads(before)
    for i in range(2, len(got)):
        assert torch.equal(got[i], got[i % 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_match_the_reference(dtype):
    q, k, v, tables, seq, causal = sequences([300, 9], dtype, seed=3)
    got = rows(q, k, v, tables, seq, causal, range(309))
    ref = decode_attention_ref(q, k, v, tables[seq.long()], causal, 64**-0.5)
    torch.testing.assert_close(got, ref, **TOL[dtype])


def test_a_row_table_outside_the_tables_is_refused():
    q, k, v, tables, seq, causal = sequences([20], torch.float32)
    bad = torch.full_like(seq, 5)  # the tables have one row
    with pytest.raises(ValueError, match="block table"):
        decode_attention_native(q, k, v, tables, causal, 0.125, row_tables=bad)


_CAPPED = """
import sys, torch
from test_attention_rows import rows, sequences
from engine.kernels import native
q, k, v, tables, seq, causal = sequences([600, 40], torch.float32, kv_dtype=torch.bfloat16)
out = [rows(q, k, v, tables, seq, causal, range(640)), rows(q, k, v, tables, seq, causal, [599])]
q, k, v, tables, seq, causal = sequences([600, 40], torch.bfloat16, kv_dtype=torch.int8)
out += [rows(q, k, v, tables, seq, causal, range(640)), rows(q, k, v, tables, seq, causal, [599])]
torch.save({"path": native.attention_path(), "out": out}, sys.argv[1])
"""


def test_the_avx2_class_gives_this_cpus_bits(tmp_path):
    # the chunk is two fixed-order GEMMs (gemm.h: one chain per output on every class) around
    # one softmax: a CPU capped to the AVX2 class computes the same bits as this one's build
    # (float32 queries over a bf16 cache: a bf16 step on AVX512-BF16 has its own chain; over
    # an int8 cache any step: its products are exact integer sums)
    import os
    import subprocess
    import sys
    from pathlib import Path

    from engine.cpu_isa import LEVELS, this_cpu

    if LEVELS.index(this_cpu().level) <= LEVELS.index("avx2"):
        pytest.skip("this run's class is AVX2 (or below, or capped): nothing to compare with")
    here = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATEN_", "ONEDNN_", "MKL_"))}
    env["ENGINE_CPU_ISA"] = "avx2"
    env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent), str(here.parents[1])])
    subprocess.run([sys.executable, "-c", _CAPPED, str(tmp_path / "capped.pt")], env=env,
                   check=True, timeout=300)  # fmt: skip
    capped = torch.load(tmp_path / "capped.pt")
    assert capped["path"] == "avx2" and native.attention_path() != "avx2"
    q, k, v, tables, seq, causal = sequences([600, 40], torch.float32, kv_dtype=torch.bfloat16)
    assert torch.equal(capped["out"][0], rows(q, k, v, tables, seq, causal, range(640)))
    assert torch.equal(capped["out"][1], rows(q, k, v, tables, seq, causal, [599]))
    # an int8 cache: exact integer sums (attention_i8.h), so a bf16 step agrees across classes too
    q, k, v, tables, seq, causal = sequences([600, 40], torch.bfloat16, kv_dtype=torch.int8)
    assert torch.equal(capped["out"][2], rows(q, k, v, tables, seq, causal, range(640)))
    assert torch.equal(capped["out"][3], rows(q, k, v, tables, seq, causal, [599]))


@pytest.mark.parametrize("march", ["x86-64-v4", "x86-64-v3", "x86-64"])
def test_an_int8_cache_gives_the_same_products_on_every_build(tmp_path, monkeypatch, march):
    # attention_i8.h: an int8 cache's scores and weighted sums are exact integer sums, whatever
    # computes them: AVX-512 without VNNI (vpmaddwd + vpaddd), AVX2, the plain loops. The vector
    # builds give this build's bits; the plain one too up to its softmax's order of summing.
    q, k, v, tables, seq, causal = sequences([600, 40], torch.float32, kv_dtype=torch.int8)
    here = rows(q, k, v, tables, seq, causal, range(640))
    lib = build_for(march, tmp_path)
    monkeypatch.setattr(native, "library_for", lambda **_: lib)
    got = rows(q, k, v, tables, seq, causal, range(640))
    if march == "x86-64":
        torch.testing.assert_close(got, here, rtol=1e-4, atol=1e-4)
    else:
        assert torch.equal(got, here)
