"""What the CPU can do (engine/cpu_isa.py): /proc/cpuinfo of each class of CPU our users have,
the ENGINE_CPU_ISA cap, and a process under ENGINE_CPU_ISA=avx2, which must run what an
AVX2-only CPU runs: torch at AVX2, the C kernels built for x86-64-v3, bf16 weights unpacked, and
the bf16, fp16 and int8 engines answering."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import cpu_isa, envs
from engine.config import EngineConfig
from engine.core.device_resolution import dtype_reason, resolved_dtype
from engine.cpu_isa import CAPS, from_flags, parse_cpuinfo

REPO = Path(__file__).resolve().parents[1]

_X86_BASE = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
    "sse sse2 ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl cpuid pni pclmulqdq "
    "ssse3 cx16 sse4_1 sse4_2 x2apic popcnt aes xsave rdrand lahf_lm 3dnowprefetch arat"
)
_V3 = "fma movbe avx f16c abm bmi1 avx2 bmi2 erms adx smap clflushopt sha_ni xsaveopt"
_V4 = "avx512f avx512dq avx512cd avx512bw avx512vl"

# /proc/cpuinfo of the first processor of each class (flags as the kernel prints them).
CPUINFO = {
    # AMD EPYC 7763 (Zen 3): AVX2 and FMA, no AVX-512
    "epyc-avx2": "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n"
    "model name\t: AMD EPYC 7763 64-Core Processor\n"
    f"flags\t\t: {_X86_BASE} {_V3} mmxext fxsr_opt sse4a misalignsse topoext vaes vpclmulqdq\n",
    # Intel Xeon Gold 6148 (Skylake-SP): AVX-512 F/BW/VL/DQ/CD, no VNNI or BF16
    "skylake-avx512": "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel\t\t: 85\n"
    "model name\t: Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz\n"
    f"flags\t\t: {_X86_BASE} {_V3} hle rtm mpx {_V4} xsavec xgetbv1 xsaves\n",
    # AMD EPYC 9004 (Zen 4): AVX512-BF16 and AVX512-VNNI, no AMX
    "zen4-bf16": "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel\t\t: 17\n"
    "model name\t: AMD EPYC 9654 96-Core Processor\n"
    f"flags\t\t: {_X86_BASE} {_V3} {_V4} avx512ifma avx512_bf16 avx512vbmi avx512_vbmi2 gfni "
    "vaes avx512_vnni avx512_bitalg avx512_vpopcntdq\n",
    # Intel Xeon 8480+ (Sapphire Rapids): AMX-BF16/INT8, AVX512-FP16, AVX-VNNI
    "spr-amx": "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel\t\t: 143\n"
    "model name\t: Intel(R) Xeon(R) Platinum 8480+\n"
    f"flags\t\t: {_X86_BASE} {_V3} {_V4} avx512ifma avx_vnni avx512_bf16 avx512vbmi "
    "avx512_vbmi2 gfni avx512_vnni avx512_bitalg avx512_vpopcntdq amx_bf16 avx512_fp16 "
    "amx_tile amx_int8\n",
    # Intel Core i7-12700 (Alder Lake): AVX2 with AVX-VNNI, AVX-512 fused off
    "alderlake-avxvnni": "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel\t\t: 151\n"
    "model name\t: 12th Gen Intel(R) Core(TM) i7-12700\n"
    f"flags\t\t: {_X86_BASE} {_V3} avx_vnni\n",
    # Intel Xeon 6700E (Sierra Forest): AVX2 with AVX-NE-CONVERT, no AVX-512
    "srf-neconvert": "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel\t\t: 175\n"
    "model name\t: Intel(R) Xeon(R) 6780E\n"
    f"flags\t\t: {_X86_BASE} {_V3} avx_vnni avx_vnni_int8 avx_ne_convert\n",
    # AWS Graviton2 (Neoverse N1): ARM, no model name
    "graviton2": "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes pmull sha1 "
    "sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs\n"
    "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\n",
}
MACHINE = {"graviton2": "aarch64"}

# kind: (model, level, native bf16, oneDNN packs bf16)
EXPECTED = {
    "epyc-avx2": ("AMD EPYC 7763 64-Core Processor", "avx2", False, False),
    "skylake-avx512": ("Intel(R) Xeon(R) Gold 6148 CPU @ 2.40GHz", "avx512", False, True),
    "zen4-bf16": ("AMD EPYC 9654 96-Core Processor", "avx512bf16", True, True),
    "spr-amx": ("Intel(R) Xeon(R) Platinum 8480+", "amx", True, True),
    "alderlake-avxvnni": ("12th Gen Intel(R) Core(TM) i7-12700", "avx2", False, False),
    "srf-neconvert": ("Intel(R) Xeon(R) 6780E", "avx2", False, True),
    "graviton2": ("implementer 0x41 part 0xd0c", "none", False, False),
}


def isa(kind: str, cap: str = "native") -> cpu_isa.CpuIsa:
    model, flags = parse_cpuinfo(CPUINFO[kind])
    return from_flags(flags, model, MACHINE.get(kind, "x86_64"), cap)


@pytest.mark.parametrize("kind", sorted(CPUINFO))
def test_each_class_of_cpu_is_read_from_its_cpuinfo(kind):
    model, level, bf16, packs = EXPECTED[kind]
    got = isa(kind)
    assert (got.model, got.level, got.hardware_level, got.cap) == (model, level, level, "native")
    assert got.native_bf16 == bf16 and got.onednn_packs("bfloat16") == packs
    assert got.march_flags() == ("-march=native",) and got.torch_environment() == {}
    note = got.slow_dtype_note("bfloat16")
    assert note is None if bf16 else "slower" in note


def test_features_of_each_class():
    avx2, sky, zen4, spr = isa("epyc-avx2"), isa("skylake-avx512"), isa("zen4-bf16"), isa("spr-amx")
    assert avx2.avx2 and avx2.fma and avx2.f16c and not avx2.avx512f and not avx2.avx512_vnni
    assert sky.avx512f and sky.avx512bw and sky.avx512vl and sky.avx512dq
    assert not (sky.avx512_bf16 or sky.avx512_vnni or sky.amx_bf16)
    assert zen4.avx512_bf16 and zen4.avx512_vnni and not zen4.amx_bf16 and not zen4.avx512_fp16
    assert spr.amx_bf16 and spr.amx_int8 and spr.avx512_fp16 and spr.avx_vnni and spr.native_fp16
    assert spr.onednn_packs("float16") and not zen4.onednn_packs("float16")
    assert isa("alderlake-avxvnni").avx_vnni and not isa("alderlake-avxvnni").onednn_packs(
        "bfloat16"
    )
    ne = isa("srf-neconvert")
    assert ne.avx_ne_convert and ne.onednn_packs("bfloat16") and ne.onednn_packs("float16")
    arm = isa("graviton2")
    assert not arm.x86 and not any(arm.features.values()) and arm.fast_paths() == []
    assert "fp16" in arm.slow_dtype_note("float16")
    # the C row dots' vector paths (gemv.h): AVX-512, or AVX2 with FMA and F16C
    assert avx2.c_float_row_dots and sky.c_float_row_dots and zen4.c_float_row_dots
    for path in ("C row dots (AVX2)", "C attention (AVX2)"):
        assert path in avx2.fast_paths() and path not in sky.fast_paths()
    model, flags = parse_cpuinfo(CPUINFO["epyc-avx2"])
    assert not from_flags(flags - {"fma"}, model, "x86_64").c_float_row_dots
    assert not arm.c_float_row_dots


@pytest.mark.parametrize(
    "kind, want, want_int8",
    [
        # no native bf16, C row dots that widen bf16 in registers: bf16 weights, float32 rest
        ("epyc-avx2", ("float32", "bfloat16"), ("bfloat16", "bfloat16")),
        ("alderlake-avxvnni", ("float32", "bfloat16"), ("bfloat16", "bfloat16")),
        ("skylake-avx512", ("float32", "bfloat16"), ("bfloat16", "bfloat16")),
        # native bf16: bf16 throughout
        ("zen4-bf16", ("bfloat16", "bfloat16"), ("bfloat16", "bfloat16")),
        ("spr-amx", ("bfloat16", "bfloat16"), ("bfloat16", "bfloat16")),
        # no vector row dots: widening bf16 on every call would cost more than it saves
        ("graviton2", ("float32", "float32"), ("bfloat16", "bfloat16")),
    ],
)
def test_dtype_auto_is_a_fixed_table_of_activations_and_weights(kind, want, want_int8):
    # (activation dtype, weight dtype) of dtype=auto, without and with int8 weights (whose
    # scales and kept LM head rows are in the activation dtype)
    got = isa(kind)
    assert (got.auto_dtype()[0], got.auto_weight_dtype()) == want
    assert (got.auto_dtype("int8")[0], got.auto_weight_dtype("int8")) == want_int8
    why = got.auto_dtype()[1]
    assert ("bfloat16 weights" in why) == (want == ("float32", "bfloat16"))
    model, flags = parse_cpuinfo(CPUINFO["epyc-avx2"])
    no_fma = from_flags(flags - {"fma"}, model, "x86_64")
    assert no_fma.auto_weight_dtype() == "float32"
    # the cap decides, as for everything else: AVX512-BF16 hardware capped to avx2
    assert isa("zen4-bf16", "avx2").auto_weight_dtype() == "bfloat16"
    assert isa("zen4-bf16", "avx2").auto_dtype()[0] == "float32"


def test_a_cpu_missing_one_flag_of_a_class_is_the_class_below():
    # compiling for x86-64-v3 on a CPU without MOVBE (a VM can hide one) would be an illegal
    # instruction away from a crash: such a CPU is "none" and gets -march=native.
    model, flags = parse_cpuinfo(CPUINFO["epyc-avx2"])
    odd = from_flags(flags - {"movbe"}, model, "x86_64", "avx2")
    assert odd.level == "none" and odd.avx2 and odd.march_flags() == ("-march=native",)
    assert odd.torch_environment()["ATEN_CPU_CAPABILITY"] == "default"
    model, flags = parse_cpuinfo(CPUINFO["zen4-bf16"])
    assert from_flags(flags - {"avx512cd"}, model, "x86_64").level == "avx2"


def test_the_cap_lowers_and_never_raises():
    order = cpu_isa.LEVELS
    for kind in CPUINFO:
        hw = isa(kind)
        for cap in CAPS:
            got = isa(kind, cap)
            assert got.hardware_level == hw.level
            assert order.index(got.level) <= order.index(hw.level), (kind, cap)
            if cap != "native":
                assert order.index(got.level) <= order.index(cap), (kind, cap)
            for name, on in got.features.items():
                assert not on or hw.features[name], (kind, cap, name)  # never one it lacks
            aten = got.torch_environment().get("ATEN_CPU_CAPABILITY")
            if aten == "avx512":
                assert hw.avx512f, (kind, cap)  # torch trusts it: it must never exceed the CPU
            assert got.x86 or got.torch_environment() == {}

    zen4 = isa("zen4-bf16", "avx2")
    assert zen4.level == "avx2" and zen4.hardware_level == "avx512bf16"
    assert not (zen4.avx512f or zen4.avx512_bf16 or zen4.native_bf16)
    assert not zen4.onednn_packs("bfloat16")
    assert zen4.fast_paths() == ["C row dots (AVX2)", "C attention (AVX2)"]
    assert zen4.march_flags() == ("-march=x86-64-v3",)
    assert zen4.torch_environment() == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    assert "capped from avx512bf16 by ENGINE_CPU_ISA=avx2" in zen4.describe()
    spr = isa("spr-amx", "avx512")
    assert spr.level == "avx512" and not (spr.avx512_vnni or spr.amx_bf16 or spr.avx_vnni)
    assert spr.march_flags() == ("-march=x86-64-v4",)
    assert spr.torch_environment()["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    spr = isa("spr-amx", "avx512bf16")
    assert spr.level == "avx512bf16" and spr.native_bf16 and not spr.amx_bf16
    assert spr.march_flags() == ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni")
    assert spr.torch_environment()["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"
    # A cap above the hardware changes nothing the hardware has.
    epyc = isa("epyc-avx2", "avx512bf16")
    assert epyc.level == "avx2" and epyc.march_flags() == ("-march=x86-64-v3",)
    assert epyc.torch_environment()["ATEN_CPU_CAPABILITY"] == "avx2"
    assert isa("graviton2", "avx2").march_flags() == ("-march=native",)


def test_an_invalid_cap_names_the_variable_and_its_choices(monkeypatch):
    monkeypatch.setenv("ENGINE_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="ENGINE_CPU_ISA must be one of avx2, avx512, "
                       "avx512bf16, native, got 'avx9'"):  # fmt: skip
        envs.cpu_isa_cap()
    with pytest.raises(ValueError, match="ENGINE_CPU_ISA must be one of"):
        from_flags(frozenset(), "", "x86_64", "sse")
    monkeypatch.setenv("ENGINE_CPU_ISA", " AVX2 ")
    assert envs.cpu_isa_cap() == "avx2"
    monkeypatch.delenv("ENGINE_CPU_ISA")
    assert envs.cpu_isa_cap() == "native"
    assert CAPS[-1] == "native"
    env = dict(os.environ, ENGINE_CPU_ISA="avx9", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", "import engine"], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0 and "ENGINE_CPU_ISA must be one of" in done.stderr


def test_this_cpu_is_read_once_from_proc_cpuinfo():
    here = cpu_isa.this_cpu()
    assert cpu_isa.this_cpu() is here
    if os.path.exists("/proc/cpuinfo"):
        model, flags = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
        assert here.hardware_flags == flags and here.model == (model or here.model)
    assert here.cap == envs.cpu_isa_cap()
    for name in here.torch_environment():  # applied when engine was imported
        assert os.environ.get(name), name


def test_auto_dtype_and_packing_follow_the_capped_cpu(monkeypatch):
    from engine.layers.linear import pack_bf16

    w = torch.randn(32, 32).bfloat16()
    monkeypatch.setattr(cpu_isa, "this_cpu", lambda: isa("zen4-bf16"))
    assert resolved_dtype(EngineConfig(device="cpu")) == torch.bfloat16
    monkeypatch.setattr(cpu_isa, "this_cpu", lambda: isa("zen4-bf16", "avx512"))
    assert resolved_dtype(EngineConfig(device="cpu")) == torch.float32
    assert resolved_dtype(EngineConfig(device="cpu", quantization="int8")) == torch.bfloat16
    monkeypatch.setattr(cpu_isa, "this_cpu", lambda: isa("epyc-avx2"))
    assert resolved_dtype(EngineConfig(device="cpu")) == torch.float32
    assert pack_bf16(w) is None  # torch would raise on this CPU: the plain weight serves
    monkeypatch.setattr(cpu_isa, "this_cpu", lambda: isa("graviton2"))
    assert pack_bf16(w) is None


@pytest.mark.parametrize("kind", sorted(CPUINFO))
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_auto_dtype_is_a_fixed_table_by_class(monkeypatch, kind, quantization):
    # bf16 where the CPU multiplies it (AVX512-BF16, AMX), float32 elsewhere (AVX2, AVX-512
    # without BF16, not x86) but for int8 weights, whose decode steps ran faster with bf16
    # activations under avx2 too: a fixed table, never measured at start-up
    monkeypatch.setattr(cpu_isa, "this_cpu", lambda: isa(kind))
    want = "bfloat16" if EXPECTED[kind][2] or quantization == "int8" else "float32"
    name, why = isa(kind).auto_dtype(quantization)
    assert name == want and why.startswith("auto") and want in why
    assert ("int8 weights" in why) == (quantization == "int8")
    config = EngineConfig(device="cpu", quantization=quantization)
    assert resolved_dtype(config) == getattr(torch, want)
    assert dtype_reason(config) == why
    assert dtype_reason(EngineConfig(device="cpu", dtype="float32", quantization=quantization)) == (
        "dtype float32 as asked"
    )


def test_metrics_show_the_cpu_as_an_info_gauge():
    from prometheus_client.parser import text_string_to_metric_families

    from engine.server.prometheus import cpu_isa_metric

    metric = cpu_isa_metric("m")
    (sample,) = metric.samples
    here = cpu_isa.this_cpu()
    assert sample.name == "engine:cpu_isa_info" and sample.value == 1.0
    assert sample.labels["level"] == here.level and sample.labels["cpu_model"] == here.model
    assert sample.labels["avx2"] == ("1" if here.avx2 else "0")
    assert set(cpu_isa.FEATURES) <= set(sample.labels)
    from prometheus_client import CollectorRegistry, generate_latest

    class One:
        def collect(self):
            yield metric

    registry = CollectorRegistry()
    registry.register(One())
    text = generate_latest(registry).decode()
    (family,) = text_string_to_metric_families(text)
    assert family.samples[0].labels["cap"] == here.cap


# Run under ENGINE_CPU_ISA=avx2 in a process of its own (torch reads the cap when first used).
CAPPED = r"""
import json, logging, subprocess, shutil, sys
records = []
class Keep(logging.Handler):
    def emit(self, r):
        records.append((r.levelname, r.getMessage()))
logging.getLogger("engine").addHandler(Keep())
logging.getLogger("engine").setLevel(logging.INFO)
import engine
import torch
from engine import cpu_isa
from engine.config import CacheConfig, EngineConfig
from engine.core.device_resolution import resolved_dtype
from engine.kernels import native
from engine.llm import LLM
from engine.sampling_params import SamplingParams

out = {"capability": torch.backends.cpu.get_cpu_capability(),
       "mkldnn_bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
       "flags": list(native.compile_flags()), "level": cpu_isa.this_cpu().level}
out["built"] = native.library() is not None
out["gemv"] = native.row_dot_paths() if out["built"] else None
path = native.library_path()
if path is not None and shutil.which("objdump"):
    asm = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True).stdout
    out["zmm"] = "%zmm" in asm
    out["ymm"] = "%ymm" in asm
answers = {}
params = SamplingParams(temperature=0.0, max_tokens=12)
question = [[{"role": "user", "content": "What is the capital of France?"}]]
for dtype, quant in (("bfloat16", None), ("float16", None), ("bfloat16", "int8"),
                     ("auto", "int8")):
    llm = LLM.from_config(EngineConfig(model="default", dtype=dtype, quantization=quant,
                                       device="cpu", cache=CacheConfig(num_blocks=32)))
    runner = llm.engine.runner
    answers[f"{dtype}-{quant}"] = [llm.chat(question, params)[0].outputs[0].text,
                                   bool(runner.packed), bool(runner.native_decode)]
out["answers"] = answers
out["auto"] = str(resolved_dtype(EngineConfig(device="cpu")))
out["auto_int8"] = str(resolved_dtype(EngineConfig(device="cpu", quantization="int8")))
out["log"] = records
print("RESULT " + json.dumps(out))
"""


def _capped_env(cap: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in cpu_isa.this_cpu().torch_environment()}
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        env.pop(name, None)  # this process's (capped) values would win in the child
    env.update(ENGINE_CPU_ISA=cap, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    return env


@pytest.mark.skipif(
    cpu_isa.LEVELS.index(cpu_isa.this_cpu().hardware_level) < cpu_isa.LEVELS.index("avx2"),
    reason="ENGINE_CPU_ISA=avx2 needs an x86-64-v3 CPU (AVX2, FMA); this one is below",
)
def test_under_avx2_torch_the_c_kernels_and_the_16_bit_engines_run_as_on_an_avx2_cpu():
    done = subprocess.run([sys.executable, "-c", CAPPED], env=_capped_env("avx2"),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    assert out["capability"] == "AVX2" and out["level"] == "avx2"
    assert not out["mkldnn_bf16"]  # oneDNN is capped too: torch itself would refuse to pack
    assert "-march=x86-64-v3" in out["flags"] and "-march=native" not in out["flags"]
    if shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc"):
        assert out["built"], "the C kernels did not build for x86-64-v3"
        if "zmm" in out:  # the library uses AVX2's registers and never AVX-512's
            assert out["ymm"] and not out["zmm"]
        assert out["gemv"] == {"int8": "avx2", "bf16": "avx2", "float": "avx2"}
    for name, (text, packed, native_decode) in out["answers"].items():
        assert "Paris" in text, (name, text)
        assert not packed, name  # oneDNN cannot pack bf16 on AVX2: the plain weights serve
        # C decoder layers for int8 and 16-bit weights alike: their row dots have AVX2 paths
        assert native_decode == out["built"], name
    assert out["auto"] == "torch.float32" and out["auto_int8"] == "torch.bfloat16"
    info = [m for lvl, m in out["log"] if lvl == "INFO" and "ISA level" in m]
    assert info and "ISA level avx2" in info[0] and "packed bf16 weights off" in info[0]
    # the start-up line says what auto chose for int8 and why
    assert any("bfloat16 with int8 weights (auto with int8 weights: bfloat16" in m for m in info)
    warnings = [m for lvl, m in out["log"] if lvl == "WARNING"]
    assert any("dtype bfloat16" in m and "slower" in m for m in warnings), warnings
    assert any("dtype float16" in m and "slower" in m for m in warnings), warnings


def test_the_avx2_pass_of_make_test_names_tests_that_exist():
    import cpu_paths  # tests/ is on the path (pyproject)

    assert cpu_paths.CAP in CAPS
    for path in cpu_paths.PATHS:
        assert (REPO / path).exists(), path


def test_torch_imported_first_is_warned_about():
    script = "import torch, engine, os; print(os.environ['ATEN_CPU_CAPABILITY'])"
    done = subprocess.run([sys.executable, "-c", script], env=_capped_env("avx2"),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "torch was imported before engine: ENGINE_CPU_ISA=avx2" in done.stderr
    assert done.stdout.strip() == ("avx2" if cpu_isa.this_cpu().x86 else "")
