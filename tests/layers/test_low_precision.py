"""bfloat16, weight-only int8 and the compiled layers against the float32 model (the reference
dtype, itself checked against transformers): teacher-forced top-1 agreement over a few hundred
positions of real text, and the greedy chat answers still right."""

from __future__ import annotations

import pytest
import torch

from engine import cpu_isa
from engine.config import CacheConfig, EngineConfig
from engine.core.device_resolution import dtype_reason, resolved_dtype, resolved_weight_dtype
from engine.kernels import native
from engine.llm import LLM
from engine.sampling_params import SamplingParams

# Real prose (the opening of the Wikipedia article "Computer", CC BY-SA), a few hundred tokens.
TEXT = (
    "A computer is a machine that can be programmed to automatically carry out sequences of "
    "arithmetic or logical operations (computation). Modern digital electronic computers can "
    "perform generic sets of operations known as programs, which enable computers to perform a "
    "wide range of tasks. The term computer system may refer to a nominally complete computer "
    "that includes the hardware, operating system, software, and peripheral equipment needed and "
    "used for full operation; or to a group of computers that are linked and function together, "
    "such as a computer network or computer cluster. A broad range of industrial and consumer "
    "products use computers as control systems, including simple special-purpose devices like "
    "microwave ovens and remote controls, and factory devices like industrial robots. Computers "
    "are at the core of general-purpose devices such as personal computers and mobile devices "
    "such as smartphones. Computers power the Internet, which links billions of computers and "
    "users. Early computers were meant to be used only for calculations. Simple manual "
    "instruments like the abacus have aided people in doing calculations since ancient times. "
    "Early in the Industrial Revolution, some mechanical devices were built to automate long, "
    "tedious tasks, such as guiding patterns for looms. More sophisticated electrical machines "
    "did specialized analog calculations in the early 20th century. The first digital electronic "
    "calculating machines were developed during World War II, both electromechanical and using "
    "thermionic valves. The first semiconductor transistors in the late 1940s were followed by "
    "the silicon-based MOSFET (MOS transistor) and monolithic integrated circuit chip "
    "technologies in the late 1950s, leading to the microprocessor and the microcomputer "
    "revolution in the 1970s. The speed, power, and versatility of computers have been "
    "increasing dramatically ever since then, with transistor counts increasing at a rapid pace."
)

QUESTIONS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Germany?", "Berlin"),
]


def make(dtype: str, **kw) -> LLM:
    return LLM.from_config(
        EngineConfig(
            model="default", dtype=dtype, device="cpu", cache=CacheConfig(num_blocks=64), **kw
        )
    )


@pytest.fixture(scope="module")
def float32_llm():
    return make("float32")


@pytest.fixture(scope="module")
def reference(float32_llm):
    ids = float32_llm.tokenizer.encode(TEXT)
    assert len(ids) >= 300
    return ids, float32_llm.engine.prompt_logits(ids).argmax(-1)


def agreement(llm: LLM, ids, ref_top1) -> float:
    return (llm.engine.prompt_logits(ids).argmax(-1) == ref_top1).float().mean().item()


def chat_answers(llm: LLM) -> list[str]:
    outs = llm.chat(
        [[{"role": "user", "content": q}] for q, _ in QUESTIONS],
        SamplingParams(temperature=0.0, max_tokens=16),
    )
    return [o.outputs[0].text for o in outs]


@pytest.mark.parametrize(
    "dtype,kw,min_agreement",
    [
        ("bfloat16", {}, 0.97),
        ("bfloat16", {"quantization": "int8"}, 0.95),
        ("float32", {"quantization": "int8"}, 0.95),  # float32 activations, KV cache, scales
        ("float32", {"weight_dtype": "bfloat16"}, 0.97),  # bf16 weights, float32 everything else
    ],
    ids=["bf16", "int8", "int8-float32", "bf16-weights-float32"],
)
def test_top1_agreement_with_float32_and_chat_answers(reference, dtype, kw, min_agreement):
    ids, ref_top1 = reference
    llm = make(dtype, **kw)
    assert llm.engine.dtype == getattr(torch, dtype)
    assert llm.engine.runner.cache.kv.dtype == getattr(torch, dtype)
    agree = agreement(llm, ids, ref_top1)
    assert agree >= min_agreement, f"top-1 agreement with float32 {agree:.3f}"
    # Teacher-forced one token at a time: decode steps, run by the C layers where they build and
    # pay (int8 weights on any CPU, bf16 weights where the row dots have AVX-512 or AVX2 paths).
    pays = "quantization" in kw or cpu_isa.this_cpu().c_float_row_dots
    deterministic = llm.engine.config.deterministic
    if "weight_dtype" in kw and native.compiler() is not None and not deterministic:
        # not where the row dots are AVX512-BF16's, which round float32 rows to bf16 (in the
        # deterministic default every step takes the fixed-order GEMM, which widens exactly)
        pays = pays and native.row_dot_paths()["bf16"] != "avx512bf16"
    assert llm.engine.runner.native_decode == (native.compiler() is not None and pays)
    decoded = llm.engine.prompt_logits(ids, chunk_size=1).argmax(-1)
    agree = (decoded == ref_top1).float().mean().item()
    assert agree >= min_agreement, f"decode steps: top-1 agreement with float32 {agree:.3f}"
    for (_, want), got in zip(QUESTIONS, chat_answers(llm)):
        assert want in got


def test_float32_decode_steps_agree_with_its_prefill_and_chat_answers(reference, float32_llm):
    # float32, the default dtype where the CPU lacks native bf16 (the avx2 pass of make test):
    # its decode steps run through the C layers where the row dots have AVX-512 or AVX2 paths,
    # and must give the reference's own top-1 (a single prefill through the torch layers).
    ids, ref_top1 = reference
    engine = float32_llm.engine
    pays = cpu_isa.this_cpu().c_float_row_dots
    assert engine.runner.native_decode == (native.compiler() is not None and pays)
    decoded = engine.prompt_logits(ids, chunk_size=1).argmax(-1)
    agree = (decoded == ref_top1).float().mean().item()
    assert agree >= 0.995, f"decode steps: top-1 agreement with the float32 prefill {agree:.3f}"
    for (_, want), got in zip(QUESTIONS, chat_answers(float32_llm)):
        assert want in got


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_int8_weights_are_int8_and_logits_float32(dtype):
    llm = make(dtype, quantization="int8")
    model = llm.engine.model
    layer = model.layers[0]
    assert layer.qkv_proj.qweight.dtype == torch.int8 and layer.qkv_proj.weight is None
    # the scales in the activation dtype: float32 ones keep a float32 model's bounds
    assert layer.qkv_proj.scales.dtype == getattr(torch, dtype)
    assert model.lm_qweight.dtype == torch.int8 and model.lm_scales.dtype == getattr(torch, dtype)
    logits = llm.engine.prompt_logits(llm.tokenizer.encode("Hello there"))
    assert logits.dtype == torch.float32


def test_int8_takes_any_dtype():
    for dtype in ("auto", "float32", "bfloat16", "float16"):
        EngineConfig(dtype=dtype, quantization="int8")
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="int4")


def test_auto_dtype_follows_the_cpu(monkeypatch):
    # engine/cpu_isa.py decides (under ENGINE_CPU_ISA); tests/test_cpu_isa.py has each class.
    v4 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    bf16 = cpu_isa.from_flags(v4 | {"avx512_bf16"}, "bf16", "x86_64")
    monkeypatch.setattr(cpu_isa, "this_cpu", lambda: bf16)
    assert resolved_dtype(EngineConfig(device="cpu")) == torch.bfloat16
    monkeypatch.setattr(cpu_isa, "this_cpu", lambda: cpu_isa.from_flags(v4, "v4", "x86_64"))
    assert resolved_dtype(EngineConfig(device="cpu")) == torch.float32
    # int8 weights keep bf16 activations there (measured faster for int8 decode under avx2)
    assert resolved_dtype(EngineConfig(device="cpu", quantization="int8")) == torch.bfloat16
    monkeypatch.setattr(cpu_isa, "this_cpu", lambda: bf16)
    assert resolved_dtype(EngineConfig(device="cpu", quantization="int8")) == torch.bfloat16


def test_weight_dtype_resolves_and_bad_ones_name_the_field(monkeypatch):
    avx2 = cpu_isa.from_flags(cpu_isa._V3, "v3", "x86_64")
    assert avx2.level == "avx2"
    monkeypatch.setattr(cpu_isa, "this_cpu", lambda: avx2)
    auto = EngineConfig(device="cpu")
    assert (resolved_dtype(auto), resolved_weight_dtype(auto)) == (torch.float32, torch.bfloat16)
    assert "bfloat16 weights" in dtype_reason(auto)
    # asked by name: float32 means float32 weights; weight_dtype float32 opts out under auto
    exact = EngineConfig(device="cpu", dtype="float32")
    assert resolved_weight_dtype(exact) == torch.float32
    assert resolved_weight_dtype(EngineConfig(device="cpu", weight_dtype="float32")) == (
        torch.float32
    )
    fp16 = EngineConfig(device="cpu", dtype="float32", weight_dtype="float16")
    assert resolved_weight_dtype(fp16) == torch.float16
    assert "float16 weights as asked" in dtype_reason(fp16)
    # int8: the quantized weights' scales are in the activation dtype
    int8 = EngineConfig(device="cpu", quantization="int8")
    assert resolved_weight_dtype(int8) == resolved_dtype(int8) == torch.bfloat16
    with pytest.raises(ValueError, match="weight_dtype must be one of"):
        EngineConfig(weight_dtype="int4")
    with pytest.raises(ValueError, match="weight_dtype bfloat16 with quantization int8"):
        EngineConfig(weight_dtype="bfloat16", quantization="int8")
    with pytest.raises(ValueError, match="weight_dtype float16 with dtype bfloat16"):
        EngineConfig(dtype="bfloat16", weight_dtype="float16")
    v4bf16 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
    native_bf16 = cpu_isa.from_flags(v4bf16, "bf16", "x86_64")
    monkeypatch.setattr(cpu_isa, "this_cpu", lambda: native_bf16)
    assert resolved_weight_dtype(EngineConfig(device="cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="weight_dtype float16 with dtype auto"):
        resolved_weight_dtype(EngineConfig(device="cpu", weight_dtype="float16"))


def test_bf16_weights_under_float32_are_held_so_and_named_in_the_kv_namespace(float32_llm):
    from engine.kvstore.namespace import model_digest

    llm = make("float32", weight_dtype="bfloat16")
    model = llm.engine.model
    layer = model.layers[0]
    assert layer.qkv_proj.weight.dtype == torch.bfloat16 and model.embed_tokens.dtype == (
        torch.bfloat16
    )
    assert model.lm_head is model.embed_tokens  # still tied: one copy
    assert layer.input_layernorm.weight.dtype == torch.float32
    assert llm.engine.runner.cache.kv.dtype == torch.float32
    assert model.weight_dtype == torch.bfloat16
    # KV from these weights is not float32 weights' KV: another namespace in a shared pool
    cfg = llm.engine.model_config
    assert model_digest(cfg, model) != model_digest(cfg, float32_llm.engine.model)
    logits = llm.engine.prompt_logits(llm.tokenizer.encode("Hello there"))
    assert logits.dtype == torch.float32


@pytest.mark.slow
def test_compiled_layers_agree_with_eager(reference):
    ids, ref_top1 = reference
    eager = make("bfloat16")
    compiled = make("bfloat16", compile=True)
    assert compiled.engine.runner.compiled
    e = eager.engine.prompt_logits(ids)
    c = compiled.engine.prompt_logits(ids)
    assert (e.argmax(-1) == c.argmax(-1)).float().mean().item() >= 0.98
    assert agreement(compiled, ids, ref_top1) >= 0.95
    # decode steps (1 token) and batches of new sizes run through the same compiled code
    for (_, want), got in zip(QUESTIONS, chat_answers(compiled)):
        assert want in got


# oneDNN packs bf16 weights only with AVX-512 BW/VL/DQ or AVX-NE-CONVERT (not on an AVX2-only
# CPU, nor under ENGINE_CPU_ISA=avx2); elsewhere the engine keeps the plain weights, which
# tests/test_cpu_isa.py checks.
needs_packing = pytest.mark.skipif(
    not cpu_isa.this_cpu().onednn_packs("bfloat16"),
    reason="oneDNN packs bf16 weights only with AVX-512 BW/VL/DQ or AVX-NE-CONVERT "
    f"(this CPU: level {cpu_isa.this_cpu().level})",
)


@needs_packing
def test_packed_bf16_weights_give_the_same_logits_bit_for_bit():
    """pack_weights (the default) keeps a oneDNN-blocked copy of every bf16 projection and of
    the LM head: a pure speed change, so the logits equal the unpacked model's exactly."""
    # --no-deterministic: in the default every step is the C layers', and nothing is packed
    packed = make("bfloat16", deterministic=False)
    plain = make("bfloat16", pack_weights=False, deterministic=False)
    for llm in (packed, plain):  # small decode steps would run in the C layers, not packed
        llm.engine.model.native_decode = False
    assert packed.engine.runner.packed and not plain.engine.runner.packed
    layer = packed.engine.model.layers[0]
    assert layer.qkv_proj.packed is not None and packed.engine.model.lm_packed is not None
    assert layer.qkv_proj.weight is not None  # the plain copy stays (weight cache, digest)
    ids = packed.tokenizer.encode(TEXT)[:200]
    assert torch.equal(packed.engine.prompt_logits(ids), plain.engine.prompt_logits(ids))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in packed.generate(["The history of", "def add("], params)]
    want = [o.outputs[0].token_ids for o in plain.generate(["The history of", "def add("], params)]
    assert got == want


@needs_packing
@pytest.mark.parametrize("rows", [0, 1, 7, 16, 300])
def test_packed_linear_equals_f_linear(rows):
    from engine.layers.linear import pack_bf16, packed_linear

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).bfloat16()
    bias = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 128, generator=g).bfloat16()[:, ::2]  # strided rows too
    packed = pack_bf16(w)
    assert packed is not None and pack_bf16(w.float()) is None  # float32 stays unpacked
    ref = torch.nn.functional.linear(x, w, bias)
    assert torch.equal(packed_linear(x, packed, bias), ref)
