"""What this CPU can do, decided in one place: the instruction sets every CPU path checks.

Read once from ``/proc/cpuinfo`` and capped by ``ENGINE_CPU_ISA`` (``envs.cpu_isa_cap``):

- ``avx2``: x86-64-v3 (AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE), what most AMD Zen 2/3 servers and
  Intel client CPUs have;
- ``avx512``: x86-64-v4 (AVX-512 F, BW, CD, DQ, VL), no VNNI, BF16 or AMX;
- ``avx512bf16``: v4 plus AVX512-BF16 and AVX512-VNNI (the C row dots' fast paths), no AMX;
- ``native`` (the default): whatever the hardware has.

A cap only lowers: each feature is on where the hardware has it and the cap allows it. The
level of a CPU is the highest class its (capped) features complete: ``none`` (not x86-64, or
x86-64 below v3), ``avx2``, ``avx512``, ``avx512bf16`` or ``amx`` (AMX-BF16 and -INT8 too).

The cap reaches three places: this module's answers (bf16 weight packing, ``dtype=auto``, the
start-up log, ``/metrics``), the C kernels' compiler flags (``march_flags``), and torch, oneDNN
and MKL through ``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA`` and ``MKL_ENABLE_INSTRUCTIONS``,
which they read only once, when first used: ``apply_to_environment`` (called when the ``engine``
package is imported, before torch) sets them, never overriding a value already set. So a capped
run is a process started with ``ENGINE_CPU_ISA`` in its environment.

Not torch-dependent and imported before torch: nothing here may import it at module level.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
from dataclasses import dataclass, field

from engine import envs

logger = logging.getLogger(__name__)

CAPS = ("avx2", "avx512", "avx512bf16", "native")  # ENGINE_CPU_ISA's values, ascending
LEVELS = ("none", "avx2", "avx512", "avx512bf16", "amx")  # a CPU's class, ascending

# The features the engine decides with, by their /proc/cpuinfo names: the dataclass's fields.
FEATURES = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_bf16",
    "avx512_vnni",
    "avx512_fp16",
    "avx_vnni",
    "avx_ne_convert",
    "amx_bf16",
    "amx_int8",
)

# Every flag of a class (x86-64 psABI levels v2, v3, v4 as /proc/cpuinfo names them; "pni" is
# SSE3, "abm" LZCNT), so that compiling for it can never emit an instruction the CPU lacks.
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_BF16 = _V4 | {"avx512_bf16", "avx512_vnni"}
_AMX = _BF16 | {"amx_bf16", "amx_int8", "amx_tile"}
_CLASS = {"avx2": _V3, "avx512": _V4, "avx512bf16": _BF16, "amx": _AMX}

# What each cap lets through (None: everything).
_ALLOWED = {"avx2": _V3, "avx512": _V4, "avx512bf16": _BF16, "native": None}

# Compiler flags of the C kernels per cap (on x86-64; "native" elsewhere too). avx512bf16 adds
# what gemv.h's GEMV_BF16 / GEMV_VNNI row dots need beyond v4.
_MARCH = {
    "avx2": ("-march=x86-64-v3",),
    "avx512": ("-march=x86-64-v4",),
    "avx512bf16": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
    "native": ("-march=native",),
}
# ATEN_CPU_CAPABILITY by level (torch trusts it without asking the hardware, so it must never
# exceed what the CPU has), ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS by cap (maxima).
_ATEN = {"none": "default", "avx2": "avx2", "avx512": "avx512", "avx512bf16": "avx512"}
_ONEDNN = {"avx2": "AVX2", "avx512": "AVX512_CORE", "avx512bf16": "AVX512_CORE_BF16"}
_MKL = {"avx2": "AVX2", "avx512": "AVX512", "avx512bf16": "AVX512"}


@dataclass(frozen=True)
class CpuIsa:
    """The CPU as the engine may use it: each feature on where the hardware has it and the cap
    (``ENGINE_CPU_ISA``) allows it. Made by ``this_cpu()`` (read once) or ``from_flags``."""

    model: str  # e.g. "AMD EPYC 7B13", from /proc/cpuinfo
    machine: str  # platform.machine(): x86_64, aarch64, ...
    level: str  # one of LEVELS, after the cap
    hardware_level: str  # one of LEVELS, without the cap
    cap: str  # one of CAPS ("native" when ENGINE_CPU_ISA is unset)
    avx2: bool = False
    fma: bool = False
    f16c: bool = False
    avx512f: bool = False
    avx512bw: bool = False
    avx512vl: bool = False
    avx512dq: bool = False
    avx512_bf16: bool = False
    avx512_vnni: bool = False
    avx512_fp16: bool = False
    avx_vnni: bool = False
    avx_ne_convert: bool = False
    amx_bf16: bool = False
    amx_int8: bool = False
    hardware_flags: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    @property
    def x86(self) -> bool:
        return _is_x86(self.machine)

    @property
    def features(self) -> dict[str, bool]:
        """Every feature of FEATURES, on or off (after the cap)."""
        return {name: getattr(self, name) for name in FEATURES}

    @property
    def native_bf16(self) -> bool:
        """bfloat16 products in hardware (AVX512-BF16 or AMX-BF16): there a bf16 GEMM runs several
        times faster than float32 and halves the bytes a decode step streams; elsewhere bf16 is
        converted to float32 and computed there, slower than float32 itself."""
        return self.avx512_bf16 or self.amx_bf16

    @property
    def native_fp16(self) -> bool:
        """float16 arithmetic in hardware (AVX512-FP16); elsewhere it is converted (F16C) and
        computed in float32."""
        return self.avx512_fp16

    def multiplies(self, dtype_name: str) -> bool:
        """Whether a GEMM in ``dtype_name`` ("bfloat16", "float16", "float32") runs in hardware
        here (native_bf16, native_fp16; float32 always). Where it does not, torch converts every
        product to float32 and runs slower than float32 itself: under ENGINE_CPU_ISA=avx2 a bf16
        GEMM of 512 x 576 -> 1536 took 80 against 20 ms in float32 (docs/cpu.md), so the int8
        matmul for many rows widens int8 weights to float32 there."""
        if dtype_name == "bfloat16":
            return self.native_bf16
        if dtype_name == "float16":
            return self.native_fp16
        return dtype_name == "float32"

    @property
    def c_float_row_dots(self) -> bool:
        """Whether the C kernels' row dots over float weights (float32, bf16, fp16; native/gemv.h)
        have their vector paths here: AVX-512 F and BW (the bf16 ones vdpbf16ps with
        AVX512-BF16), or AVX2 with FMA and F16C (bf16 widened by a shift, fp16 by F16C, FMAs).
        With them the C decoder layers beat the torch layers at every row count they take, on
        AVX2 too (bf16 and float32 decode steps under ENGINE_CPU_ISA=avx2, see docs/cpu.md);
        below, the row dots are plain loops, slower than the torch layers' oneDNN GEMMs (a bf16
        step took 64 ms against 24), so the C decoder layers serve float weights only where this
        holds (int8 weights everywhere)."""
        return (self.avx512f and self.avx512bw) or (self.avx2 and self.fma and self.f16c)

    def auto_dtype(self, quantization: str | None = None) -> tuple[str, str]:
        """(dtype name, why) that ``dtype=auto`` picks on this CPU, a fixed table (never a
        measurement: two workers of a cluster must agree): bfloat16 where the CPU multiplies it
        in hardware (AVX512-BF16 or AMX); elsewhere float32, except with int8 weights, which
        keep bfloat16 activations: measured under ENGINE_CPU_ISA=avx2 (one thread, default
        model), a 1 x 512 int8 decode step took 14.1 ms with bf16 activations against 19.7-22.3
        with float32 ones (the C decoder layers prepare int8 activations from float32 either way
        and the bf16 KV cache is half the bytes), a 1024-token int8 prefill 3.47 against 3.41 s
        (the many-row GEMM multiplies in float32 either way). ``--dtype float32`` serves int8
        too (docs/cpu.md)."""
        weights = f" with {quantization} weights" if quantization else ""
        if self.native_bf16:
            return "bfloat16", f"auto{weights}: bfloat16, this CPU multiplies bf16 in hardware"
        if quantization == "int8":
            return "bfloat16", (
                f"auto{weights}: bfloat16, measured faster than float32 activations for int8 "
                f"decode on CPUs without native bf16 too (level {self.level})"
            )
        if quantization == "w8a8":
            return "float32", (
                f"auto{weights}: float32, this CPU (level {self.level}) has no native bf16 "
                "(AVX512-BF16 or AMX); the W8A8 GEMMs quantize float32 rows to int8 as they run"
            )
        if quantization is None and self.c_float_row_dots:
            return "float32", (
                f"auto: float32 activations with bfloat16 weights, this CPU (level {self.level}) "
                "has no native bf16 (AVX512-BF16 or AMX) but its C row dots widen bf16 weights "
                "in registers: exact float32 products, half the bytes per decode step"
            )
        return "float32", (
            f"auto: float32, this CPU (level {self.level}) has no native bf16 (AVX512-BF16 or "
            "AMX), where bf16 would be converted for every product"
        )

    def auto_weight_dtype(self, quantization: str | None = None) -> str:
        """The dtype ``dtype=auto`` holds the float weights in (the projections, the embedding
        and LM head): the activations' own (auto_dtype), except bfloat16 under float32
        activations where the C row dots widen bf16 in registers (c_float_row_dots: AVX2 with
        FMA and F16C, or AVX-512) and the CPU has no native bf16. Measured under
        ENGINE_CPU_ISA=avx2 (one thread, default model, docs/cpu.md "bf16 weights under float32
        activations"): a 16 x 512 decode step 131-135 against 203-212 ms, with teacher-forced
        top-1 agreement with float32 above 99%. With int8 weights: None of this (int8)."""
        dtype = self.auto_dtype(quantization)[0]
        if quantization is None and dtype == "float32" and self.c_float_row_dots:
            return "bfloat16"
        return dtype

    def auto_kv_dtype(self, quantization: str | None = None) -> str:
        """The KV cache's dtype under ``dtype=auto`` and ``kv_cache_dtype=auto``: the
        activations' own (auto_dtype), except bfloat16 under float32 activations where the C
        attention widens bf16 in registers (c_float_row_dots CPUs: AVX2 with FMA and F16C, or
        AVX-512). Half the bytes every step reads at long contexts; measured on a 2-core AMD
        EPYC (AVX2, default model, profiling/bench_kv_dtype.py, docs/benchmarks.md): a decode
        step at 8k of context 32.8 against 52.7 ms (batch 1) and 207 against 483 ms (16), an 8k
        prefill 40.1 against 45.4 s, 1k the same within noise; attention's error against a
        float32 cache 0.2% (docs/kernels.md)."""
        dtype = self.auto_dtype(quantization)[0]
        if dtype == "float32" and self.c_float_row_dots:
            return "bfloat16"
        return dtype

    def onednn_packs(self, dtype_name: str) -> bool:
        """Whether oneDNN can hold weights of ``dtype_name`` ("bfloat16", "float16") in its
        blocked layout (``torch.ops.mkldnn._reorder_linear_weight``). torch refuses elsewhere:
        bf16 "needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq", fp16
        "avx_ne_convert or avx512_fp16"."""
        if not self.x86:
            return False
        if dtype_name == "bfloat16":
            avx512_core = self.avx512f and self.avx512bw and self.avx512vl and self.avx512dq
            return avx512_core or self.avx_ne_convert
        if dtype_name == "float16":
            return self.avx512_fp16 or self.avx_ne_convert
        return False

    def march_flags(self) -> tuple[str, ...]:
        """The C kernels' target flags. ``native`` (and any CPU that is not x86-64, or is below
        v3): ``-march=native``; a cap: the class it and the hardware both reach (never above the
        hardware), plus AVX512-VNNI and -BF16 where the cap and the hardware have them."""
        if not self.x86 or self.cap == "native" or self.level == "none":
            return _MARCH["native"]
        base = {"avx2": "avx2", "avx512": "avx512"}.get(self.level, "avx512bf16")
        flags = list(_MARCH[base])
        for feature, flag in (("avx512_bf16", "-mavx512bf16"), ("avx512_vnni", "-mavx512vnni")):
            if getattr(self, feature) and flag not in flags:
                flags.append(flag)
        return tuple(flags)

    def torch_environment(self) -> dict[str, str]:
        """The variables that cap torch, oneDNN and MKL as this cap does (empty without a cap or
        off x86-64)."""
        if self.cap == "native" or not self.x86:
            return {}
        return {
            "ATEN_CPU_CAPABILITY": _ATEN.get(self.level, "avx512"),
            "ONEDNN_MAX_CPU_ISA": _ONEDNN[self.cap],
            "MKL_ENABLE_INSTRUCTIONS": _MKL[self.cap],
        }

    def fast_paths(self) -> list[str]:
        """What runs fast here, in words, for the start-up log."""
        paths = []
        if self.native_bf16:
            paths.append("bf16 matmuls (" + ("AMX" if self.amx_bf16 else "AVX512-BF16") + ")")
        if self.native_fp16:
            paths.append("fp16 arithmetic (AVX512-FP16)")
        if self.onednn_packs("bfloat16"):
            paths.append("packed bf16 weights (oneDNN)")
        if self.avx512_bf16 and self.avx512bw:
            paths.append("C bf16 row dots (vdpbf16ps)")
        if self.avx512_vnni and self.avx512bw:
            paths.append("C int8 row dots (vpdpwssd)")
        if self.c_float_row_dots and not self.avx512f:
            paths.append("C row dots (AVX2)")
        if self.avx512f:
            paths.append("C attention (AVX-512)")
        elif self.c_float_row_dots:
            paths.append("C attention (AVX2)")
        return paths

    def describe(self) -> str:
        """One line: the CPU, its level, the cap and what runs fast."""
        if self.cap == "native":
            cap = "native (ENGINE_CPU_ISA unset or native)"
        elif self.level != self.hardware_level:
            cap = f"capped from {self.hardware_level} by ENGINE_CPU_ISA={self.cap}"
        else:
            cap = f"ENGINE_CPU_ISA={self.cap}"
        paths = ", ".join(self.fast_paths()) or "none (float32 and FMA paths)"
        return (
            f"CPU {self.model} ({self.machine}), ISA level {self.level}, {cap}; "
            f"C kernels {' '.join(self.march_flags())}; fast paths: {paths}"
        )

    def slow_dtype_note(self, dtype_name: str) -> str | None:
        """A warning for a 16-bit dtype this CPU does not compute natively, else None."""
        if dtype_name == "bfloat16" and not self.native_bf16:
            return (
                f"dtype bfloat16 on a CPU without native bf16 (level {self.level}, no "
                "AVX512-BF16 or AMX): it is converted to float32 for every product and runs "
                "slower than float32"
            )
        if dtype_name == "float16" and not self.native_fp16:
            return (
                f"dtype float16 on a CPU without native fp16 (level {self.level}, no "
                "AVX512-FP16): it is converted to float32 for every product and runs slower "
                "than float32"
            )
        return None

    def metric_labels(self) -> dict[str, str]:
        """Labels of the ``engine:cpu_isa_info`` gauge: the CPU, level, cap and every feature
        as "1" or "0"."""
        labels = {
            "cpu_model": self.model,
            "machine": self.machine,
            "level": self.level,
            "hardware_level": self.hardware_level,
            "cap": self.cap,
        }
        labels.update({name: "1" if on else "0" for name, on in self.features.items()})
        return labels


def _is_x86(machine: str) -> bool:
    return machine.lower() in ("x86_64", "amd64", "x64")


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) from the text of /proc/cpuinfo (its first processor). x86 names its
    flags ``flags`` and its model ``model name`` (``model`` is a number there); ARM has
    ``Features``, and a ``Model`` or ``Hardware`` line on some boards, else only the implementer
    and part codes."""
    seen: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip().lower()
        if sep and key not in seen:
            seen[key] = value.strip()
    flags = frozenset((seen.get("flags") or seen.get("features") or "").split())
    model = seen.get("model name") or ""
    if not model and not seen.get("model", "").isdigit():
        model = seen.get("model", "")
    model = model or seen.get("hardware", "")
    if not model and "cpu part" in seen:
        model = f"implementer {seen.get('cpu implementer', '?')} part {seen['cpu part']}"
    return model, flags


def _level(flags: frozenset[str], machine: str) -> str:
    if not _is_x86(machine):
        return "none"
    level = "none"
    for name in ("avx2", "avx512", "avx512bf16", "amx"):
        if _CLASS[name] <= flags:
            level = name
    return level


def from_flags(
    flags: frozenset[str] | set[str], model: str, machine: str, cap: str = "native"
) -> CpuIsa:
    """The CpuIsa of a CPU with ``flags`` (its /proc/cpuinfo names) under ``cap``."""
    if cap not in CAPS:
        raise ValueError(f"ENGINE_CPU_ISA must be one of {', '.join(CAPS)}, got {cap!r}")
    hardware = frozenset(flags) if _is_x86(machine) else frozenset()
    allowed = _ALLOWED[cap]
    usable = hardware if allowed is None else hardware & allowed
    return CpuIsa(
        model=model or platform.processor() or "unknown",
        machine=machine,
        level=_level(usable, machine),
        hardware_level=_level(hardware, machine),
        cap=cap,
        hardware_flags=frozenset(flags),
        **{name: name in usable for name in FEATURES},
    )


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:  # not Linux: no flags, level "none", no x86 paths
        return ""


@functools.lru_cache(maxsize=1)
def this_cpu() -> CpuIsa:
    """This process's CPU under its ``ENGINE_CPU_ISA`` cap, read once. ValueError naming the
    variable and its choices for an invalid value."""
    cap = envs.cpu_isa_cap()
    model, flags = parse_cpuinfo(_read_cpuinfo())
    return from_flags(flags, model, platform.machine(), cap)


def apply_to_environment() -> dict[str, str]:
    """Under a cap, set the variables that cap torch, oneDNN and MKL (CpuIsa.torch_environment)
    where they are not set already (explicit values win). They act only if set before torch
    first uses them, so ``engine/__init__.py`` calls this before anything imports torch; a
    warning says so if torch came first. Returns what it set."""
    isa = this_cpu()
    wanted = {k: v for k, v in isa.torch_environment().items() if k not in os.environ}
    os.environ.update(wanted)
    if wanted and "torch" in sys.modules:
        logger.warning(
            "torch was imported before engine: ENGINE_CPU_ISA=%s reaches torch and oneDNN only "
            "if they have not run an op yet (import engine first, or set %s in the environment)",
            isa.cap,
            ", ".join(f"{k}={v}" for k, v in wanted.items()),
        )
    return wanted
