"""This machine's ceilings (engine/bench/machine.py), as the benchmarks quote them."""

from __future__ import annotations

from engine.bench.machine import q8_gemm_gmac_s
from engine.kernels import native


def test_the_w8a8_gemm_rate_is_measured_with_its_path():
    if native.library() is None:
        assert q8_gemm_gmac_s() is None
        return
    rate, path = q8_gemm_gmac_s()
    assert rate > 0
    assert path == native.gemm_q8_path()
    assert path in ("avx512vnni", "avx2", "c")


def test_without_the_c_kernels_there_is_no_rate(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: None)
    assert q8_gemm_gmac_s() is None
