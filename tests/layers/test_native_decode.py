"""The C decoder layers (kernels/native/decode_layer.c via layers/native_decode.py) against the
torch layers on the same weights and cache: hidden states, the KV written, the layer hook's
timing, bad input, and when the engine uses them."""

from __future__ import annotations

import math

import pytest
import torch
from decode_layers import BLOCK, decode_step, random_model
from tiny_models import tiny_model

from engine import cpu_isa
from engine.config import CacheConfig, EngineConfig
from engine.core.request import Request
from engine.core.scheduler_output import ScheduledRequest
from engine.kernels import native
from engine.kernels.gemm_q8 import BLOCK as BLOCK_Q8
from engine.kernels.gemm_q8 import unpack_q8
from engine.kernels.kv_quant import from_cache, to_cache
from engine.kvcache.paged_cache import PagedKVCache
from engine.layers.attention_metadata import AttentionMetadata
from engine.layers.native_decode import MAX_ROWS, NativeDecoder
from engine.llm import LLM
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


def both_paths(model, seq_lens, seed=0, hook=None, round_to=None, kv_dtype=None):
    """(native hidden, native cache), (torch hidden, torch cache), the cache before and the
    metadata of one decode step over a random context (its values rounded to ``round_to``), the
    cache in ``kv_dtype`` (by default the model's)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(n / BLOCK) for n in seq_lens) + 2
    kv_dtype = kv_dtype or model.dtype
    cache = PagedKVCache(model.cfg, num_blocks, BLOCK, kv_dtype, torch.device("cpu"))
    values = torch.randn(*cache.kv.shape[:-1], model.cfg.head_dim, generator=g)
    cache.kv.copy_(to_cache(values.to(round_to or model.dtype), kv_dtype))
    positions, meta = decode_step(seq_lens, num_blocks, g)
    ids = torch.randint(0, model.cfg.vocab_size, (len(seq_lens),), generator=g)
    out = []
    for native_on in (True, False):
        kv = cache.kv.clone()
        model.bind_kv_cache(kv)
        model.native_decode = native_on
        with torch.inference_mode():
            hidden = model(ids, positions, meta, hook if native_on else None)
        out.append((hidden, kv))
    return out[0], out[1], cache.kv, meta


def count_native_rows(monkeypatch) -> list[int]:
    """The row count of every C layer call from now on (NativeDecoder.run wrapped)."""
    calls: list[int] = []
    real_run = NativeDecoder.run

    def counting_run(self, hidden, *a):
        calls.append(hidden.shape[0])
        return real_run(self, hidden, *a)

    monkeypatch.setattr(NativeDecoder, "run", counting_run)
    return calls


@pytest.mark.parametrize(
    "shape",
    [
        dict(),
        dict(bias=True, heads=4, kv_heads=1, head_dim=32),  # qkv bias, MQA
        dict(qk_norm=True, heads=2, kv_heads=2, head_dim=64),  # per-head q/k norm, MHA
        dict(heads=6, kv_heads=2, head_dim=16),
    ],
    ids=["gqa", "bias-mqa", "qk-norm", "dim16"],
)
@pytest.mark.parametrize(
    "seq_lens",
    [[1], [300], [5, 17, 257], [9, 1, 33, 2, 64, 70, 3, 100], [3 * i + 1 for i in range(MAX_ROWS)]],
    ids=["one", "two-chunks", "three", "eight", "max-rows"],
)
def test_float32_matches_the_torch_layers(shape, seq_lens):
    # float32 rounds nowhere, so the C layer must agree with the torch layer to float32 noise:
    # any missed term (bias, norm, rotary half, GQA head mapping, residual) shows.
    model = random_model(torch.float32, **shape)
    (nh, nkv), (th, tkv), before, meta = both_paths(model, seq_lens)
    torch.testing.assert_close(nh, th, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(nkv, tkv, rtol=1e-4, atol=1e-4)
    # only this step's slots were written
    flat = before.view(2, 2, -1, *before.shape[-2:])
    changed = (nkv.view_as(flat) != flat).flatten(3).any(-1).any(0).any(0)
    assert set(changed.nonzero().flatten().tolist()) == set(meta.slot_mapping.tolist())


@pytest.mark.parametrize(
    "dtype, kv_dtype",
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.int8),
        (torch.bfloat16, torch.int8),
        (torch.bfloat16, torch.float32),
    ],
)
def test_a_kv_cache_of_its_own_dtype_is_written_with_the_torch_layers_bits(dtype, kv_dtype):
    # --kv-cache-dtype: the C layer stores K and V rows in the cache's dtype (int8: quantized
    # with their scale by dtypes.h store_i8_row) bit for bit as the torch layer's kv_store does
    # (kv_dtype.quantize_int8) from the same float32 rows, and attends over them as the torch
    # reference does (bf16 activations: the rows themselves differ by bf16 rounding, as in the
    # tests above)
    model = random_model(dtype, bias=True)
    (nh, nkv), (th, tkv), before, meta = both_paths(model, [3, 40, 290], kv_dtype=kv_dtype)
    assert nkv.dtype == kv_dtype and not torch.equal(nkv, before)
    if dtype == torch.float32:
        # The same float32 row is stored with the same bits; the two paths' rows differ in their
        # last float32 bits (the C GEMM's sums against torch's), which the store rounds apart
        # now and then: at most a few of the step's elements, each by one step of the dtype
        # (a bf16 flip in layer 1's new V then moves that row's hidden state by ~1e-4).
        differ = (nkv != tkv).sum().item()
        assert differ <= 4, f"{differ} stored elements differ"
        values = from_cache(nkv, torch.float32), from_cache(tkv, torch.float32)
        torch.testing.assert_close(*values, rtol=2**-7, atol=1e-6)
        torch.testing.assert_close(nh, th, rtol=1e-3, atol=1e-3)
    else:
        values = from_cache(nkv, torch.float32), from_cache(tkv, torch.float32)
        torch.testing.assert_close(*values, rtol=0.05, atol=0.1)
        torch.testing.assert_close(nh.float(), th.float(), rtol=0.1, atol=0.1)


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_weights_under_float32_match_the_torch_layers(w_dtype):
    # weight_dtype: the weights rounded once to 16 bits, everything else float32. The C layer
    # widens them exactly in registers, the torch layers a tile at a time (float_matmul): the
    # same products, so the two agree to float32 noise, and both differ from the float32 model
    # only by the weights' rounding.
    if w_dtype == torch.bfloat16 and bf16_rows_rounded():
        pytest.skip("AVX512-BF16 row dots: bf16 weights under float32 go to the torch layers")
    model = random_model(torch.float32, bias=True)
    full = both_paths(model, [3, 40, 290])[1]
    model.store_weights_(w_dtype)
    assert model.layers[0].qkv_proj.weight.dtype == w_dtype and model.lm_head.dtype == w_dtype
    assert model.layers[0].qkv_proj.bias.dtype == torch.float32
    (nh, nkv), (th, tkv), _, _ = both_paths(model, [3, 40, 290])
    torch.testing.assert_close(nh, th, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(nkv, tkv, rtol=1e-4, atol=1e-4)
    assert nh.dtype == nkv.dtype == torch.float32
    assert not torch.equal(th, full[0])  # the weights were rounded ...
    torch.testing.assert_close(th, full[0], rtol=0.05, atol=0.05)  # ... once, not the rows


def test_16_bit_weights_need_float32_activations():
    model = random_model(torch.bfloat16)
    with pytest.raises(ValueError, match="weight_dtype"):
        model.store_weights_(torch.float16)
    model.store_weights_(torch.bfloat16)  # its own dtype: nothing to do


def float32_twin(model):
    """A float32 model with exactly the weights ``model`` computes with (int8 and W8A8
    dequantized)."""
    twin = random_model(torch.float32, bias=model.cfg.attention_bias)
    with torch.no_grad():
        for name, p in twin.named_parameters():
            lin = model.get_submodule(name.rsplit(".", 1)[0]) if "proj" in name else None
            if lin is not None and name.endswith("weight") and lin.qweight is not None:
                p.copy_(lin.qweight.float() * lin.scales.float()[:, None])
            elif lin is not None and name.endswith("weight") and lin.q8 is not None:
                q, s = unpack_q8(lin.q8, lin.out_features)  # W8A8: a scale per block of 32
                w = q.float() * s.repeat_interleave(BLOCK_Q8, dim=1)
                p.copy_(w[:, : lin.in_features])
            else:
                p.copy_(model.get_parameter(name).float())
    return twin


@pytest.mark.parametrize(
    "dtype, int8",
    [
        (torch.bfloat16, False),
        (torch.bfloat16, True),
        (torch.float16, False),
        (torch.float16, True),
        (torch.float32, True),  # int8 weights, float32 activations, scales and KV cache
        (torch.float32, "w8a8"),  # int8 activations too, quantized per row as each GEMM runs
        (torch.bfloat16, "w8a8"),
    ],
    ids=["bf16-16-bit", "bf16-int8", "fp16-16-bit", "fp16-int8", "float32-int8", "float32-w8a8",
         "bf16-w8a8"],
)  # fmt: skip
def test_16_bit_and_int8_weights_are_as_accurate_as_the_torch_layers(dtype, int8):
    # (W8A8: both paths quantize each activation row, so the twin's error includes that; a row
    # a last bit apart may round a value to the next integer, which the mean error absorbs)
    model = random_model(dtype, bias=True)
    if int8:
        model.quantize_(int8 if int8 == "w8a8" else "int8")
    seq_lens = [3, 40, 290]
    (nh, nkv), (th, tkv), _, _ = both_paths(model, seq_lens)
    # The same weights and context in float32: the error both paths make by rounding to 16 bits
    # where the model stores its activations. The C layer rounds at the same points; its sums
    # run in another order, so single values differ by a last bit, but its error is the same.
    (eh, ekv), _, _, _ = both_paths(float32_twin(model), seq_lens, round_to=dtype)
    for got, want, exact in ((nh, th, eh), (nkv, tkv, ekv)):
        native_err = (got.float() - exact).abs().mean()
        torch_err = (want.float() - exact).abs().mean()
        assert native_err <= 1.25 * torch_err + 1e-6, (native_err, torch_err)
        # (W8A8's 7-bit activations move a value by up to ~0.2 here against unquantized ones)
        tol = 0.3 if int8 == "w8a8" else 0.1
        torch.testing.assert_close(got.float(), exact, rtol=tol, atol=tol)


def bf16_rows_rounded() -> bool:
    """Whether the loaded row dots are AVX512-BF16's, which round float32 rows against bf16
    weights (there the C layers do not take bf16 weights under float32 activations)."""
    return native.row_dot_paths()["bf16"] == "avx512bf16"


@pytest.mark.parametrize(
    "dtype, int8",
    [
        (torch.float32, False),
        (torch.bfloat16, False),
        (torch.float16, False),
        (torch.bfloat16, True),
        (torch.float32, True),
        (torch.float32, "bf16-weights"),
        (torch.float32, "w8a8"),
        (torch.bfloat16, "w8a8"),
    ],
    ids=["float32", "bf16", "fp16", "int8", "int8-float32", "bf16-weights-float32",
         "w8a8-float32", "w8a8-bf16"],
)  # fmt: skip
def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch(dtype, int8):
    # Every weight code's row dots (gemv.h, on this CPU's path: AVX-512, AVX2 or loops) sum in
    # one order whatever the row count, and so does the rest of the layer: a sequence's hidden
    # state and KV must not depend on the sequences beside it (1 row, 3 rows, or 16 in two
    # groups of 8: on AVX2 float weights take tiles of weight rows at 1 and from 5 rows, the row
    # dots at 2 to 4, gemv.h GEMV_TILES_FOR).
    model = random_model(dtype, bias=True)
    if int8 == "bf16-weights":
        if bf16_rows_rounded():
            pytest.skip("AVX512-BF16 row dots: bf16 weights under float32 go to the torch layers")
        model.store_weights_(torch.bfloat16)
    elif int8:
        model.quantize_(int8 if int8 == "w8a8" else "int8")
    seq_lens = [7 * i + 3 for i in range(MAX_ROWS)]
    g = torch.Generator().manual_seed(5)
    num_blocks = sum(math.ceil(n / BLOCK) for n in seq_lens) + 2
    cache = PagedKVCache(model.cfg, num_blocks, BLOCK, model.dtype, torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g).to(dtype))
    positions, meta = decode_step(seq_lens, num_blocks, g)
    hidden = torch.randn(len(seq_lens), model.cfg.hidden_size, generator=g).to(dtype)

    def run(rows):
        kv = cache.kv.clone()
        model.bind_kv_cache(kv)
        sub = AttentionMetadata(
            slot_mapping=meta.slot_mapping[rows],
            num_decode_tokens=len(rows),
            decode_block_tables=meta.decode_block_tables[rows].contiguous(),
            decode_seq_lens=meta.decode_seq_lens[rows],
            decode_max_seq_len=max(seq_lens[r] for r in rows),
        )
        decoder = NativeDecoder(model, native.library(), native.DTYPE_CODES)
        return decoder.run(hidden[rows].clone(), positions[rows], sub, None), kv

    together, kv_together = run(list(range(len(seq_lens))))
    for b in (0, 5, 8, len(seq_lens) - 1):
        alone, kv_alone = run([b])
        assert torch.equal(alone[0], together[b]), b
        slot = int(meta.slot_mapping[b])  # [layers, 2, slots, kv heads, dim] below
        assert torch.equal(
            kv_alone.flatten(2, 3)[:, :, slot], kv_together.flatten(2, 3)[:, :, slot]
        ), b
    three, _ = run([2, 9, 13])
    for i, b in enumerate((2, 9, 13)):
        assert torch.equal(three[i], together[b]), b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float32"])
def test_the_hook_runs_after_each_layer_wrote_its_kv(dtype):
    # The cluster streams layer i's KV from hook(i): it must be written by then.
    model = random_model(dtype)
    seen = []

    def hook(i):
        seen.append((i, [layer.attn.k_cache.clone() for layer in model.layers]))

    (_, nkv), _, before, meta = both_paths(model, [20], hook=hook)
    assert [i for i, _ in seen] == [0, 1]
    slot = int(meta.slot_mapping[0])
    at_hook0 = seen[0][1]
    assert torch.equal(at_hook0[0].flatten(0, 1)[slot], nkv[0, 0].flatten(0, 1)[slot])
    assert torch.equal(at_hook0[1].flatten(0, 1)[slot], before[1, 0].flatten(0, 1)[slot])
    assert not torch.equal(nkv[1, 0], before[1, 0])


def test_bad_slots_positions_and_tables_raise_and_write_nothing():
    model = random_model(torch.bfloat16)
    cache = PagedKVCache(model.cfg, 4, BLOCK, model.dtype, torch.device("cpu"))
    model.bind_kv_cache(cache.kv)
    model.native_decode = True
    decoder = NativeDecoder(model, native.library(), native.DTYPE_CODES)
    g = torch.Generator().manual_seed(0)
    positions, meta = decode_step([20], 4, g)
    hidden = torch.zeros(1, 96, dtype=torch.bfloat16)
    cases = {
        "slot": lambda m, p: setattr(m, "slot_mapping", torch.tensor([4 * BLOCK])),
        "position": lambda m, p: p.fill_(640),
        "table": lambda m, p: m.decode_block_tables.fill_(7),
        "short table": lambda m, p: setattr(m, "decode_seq_lens", torch.tensor([999])),
    }
    for name, spoil in cases.items():
        p, m = positions.clone(), AttentionMetadata(**vars(meta))
        m.decode_block_tables = meta.decode_block_tables.clone()
        spoil(m, p)
        with pytest.raises(ValueError, match="outside the cache or rotary tables"):
            decoder.run(hidden.clone(), p, m, None)
        assert not cache.kv.any(), name


@pytest.mark.skipif(
    not cpu_isa.this_cpu().c_float_row_dots,
    reason="the engine serves float weights by the C layers only where their row dots have the "
    "AVX-512 or AVX2 paths (test_which_weights_take_them_on_this_cpu checks the rest)",
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_without_determinism_the_engine_uses_them_for_small_decode_steps_only(monkeypatch, dtype):
    calls = count_native_rows(monkeypatch)
    llm = LLM.from_config(
        EngineConfig(
            model=str(tiny_model("llama")),
            dtype=dtype,
            device="cpu",
            deterministic=False,
            cache=CacheConfig(num_blocks=64, block_size=BLOCK),
        )
    )
    assert llm.engine.runner.native_decode
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [f"Item {i} of the list is" for i in range(MAX_ROWS + 2)]
    native_out = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params)]
    assert calls and max(calls) <= 2
    calls.clear()
    llm.generate(prompts, params)  # decode steps of 10 sequences: the torch layers
    assert all(n <= MAX_ROWS for n in calls)
    calls.clear()
    monkeypatch.setenv("ENGINE_KERNELS", "torch")
    torch_out = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params)]
    assert not calls
    assert torch_out == native_out


@pytest.mark.skipif(
    not cpu_isa.this_cpu().c_float_row_dots or native.compiler() is None,
    reason="the C layers serve float weights only where gemv.h has its vector paths",
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_deterministic_engines_run_every_step_through_them(monkeypatch, dtype):
    # the default: prefill chunks, mixed steps and batches past MAX_ROWS all take the C layers,
    # and the logits come from the fixed-order GEMM (no oneDNN, no float32 refinement)
    calls = count_native_rows(monkeypatch)
    llm = LLM.from_config(
        EngineConfig(
            model=str(tiny_model("llama")),
            dtype=dtype,
            device="cpu",
            cache=CacheConfig(num_blocks=128, block_size=BLOCK),
        )
    )
    assert llm.engine.model.deterministic
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [f"Item {i} of the list is" for i in range(MAX_ROWS + 4)]
    llm.generate(prompts, params)
    assert max(calls) > MAX_ROWS  # the prompts' prefill, in one step
    steps = len(calls)
    llm.engine.model.lm_panels = None
    llm.generate(prompts[:1], params)
    assert len(calls) == steps + 3 and llm.engine.model.lm_panels is not None


def test_not_for_compiled_models():
    cfg = EngineConfig(model=str(tiny_model("llama")), dtype="bfloat16", device="cpu",
                       cache=CacheConfig(num_blocks=16), compile=True)  # fmt: skip
    compiled = LLM.from_config(cfg).engine.runner  # compiles on first use: not run here
    assert compiled.compiled and not compiled.native_decode


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler: no C layers at all")
def test_which_weights_take_them_on_this_cpu():
    """int8 weights on every CPU; float32, bf16 and fp16 weights only where the C row dots have
    their AVX-512 or AVX2 paths (cpu_isa.CpuIsa.c_float_row_dots): below, those are plain loops,
    slower than the torch layers (make test runs this again under ENGINE_CPU_ISA=avx2, where
    they are on, float32 being the default dtype there)."""

    def runner(dtype="bfloat16", **kw):
        cfg = EngineConfig(model=str(tiny_model("llama")), dtype=dtype, device="cpu",
                           cache=CacheConfig(num_blocks=16), **kw)  # fmt: skip
        return LLM.from_config(cfg).engine.runner

    assert runner(quantization="int8").native_decode
    assert runner(quantization="w8a8").native_decode
    for dtype in ("float32", "bfloat16", "float16"):
        assert runner(dtype).native_decode == cpu_isa.this_cpu().c_float_row_dots, dtype


@pytest.fixture(scope="module")
def float32_llm():
    llm = LLM.from_config(
        EngineConfig(
            model=str(tiny_model("llama")),
            dtype="float32",
            device="cpu",
            deterministic=False,  # the torch layers for prefill, as the tests below compare
            cache=CacheConfig(num_blocks=64, block_size=BLOCK),
        )
    )
    llm.engine.model.native_decode = True  # the C layers whatever this CPU's row dots
    return llm


def test_float32_prefill_then_decode_steps_match_the_torch_layers(float32_llm, monkeypatch):
    # Logits of a prompt: one prefill (the torch layers) against a prefill of its first 9 tokens
    # and then decode steps of one token each through the C layers, every step reading the KV
    # the C layers wrote in the steps before: float32 throughout, so equal to float32 noise.
    engine = float32_llm.engine
    ids = float32_llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    assert len(ids) > 30
    want = engine.prompt_logits(ids)
    calls = count_native_rows(monkeypatch)
    req = Request("prefill-then-decode", ids, SamplingParams(), None)
    got = []
    try:
        with torch.inference_mode():
            for n in [9] + [1] * (len(ids) - 9):
                assert engine.kv.allocate(req, n)
                inputs = engine.runner.prepare([ScheduledRequest(req, n)], engine.kv.block_tables)
                got.append(engine.runner.execute(inputs, all_logits=True))
                req.num_computed_tokens += n
    finally:
        engine.kv.free(req)
    assert calls == [1] * (len(ids) - 9)  # every decode step in C, the prefill not
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)


def test_float32_generation_matches_the_torch_layers_alone_and_in_a_batch(float32_llm):
    # Greedy generation: the C layers (decode steps of 1 to 4 sequences) against the torch
    # layers, and each prompt alone against the batch, token for token, logprobs to float32
    # noise (the C layers give a sequence the same bits alone and in a batch, see above, but the
    # batched prefill and LM-head GEMMs need not).
    model = float32_llm.engine.model
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3, 4,", "Hello"]

    def generate(native_on, which):
        model.native_decode = native_on
        try:
            outs = float32_llm.generate([prompts[i] for i in which], params)
        finally:
            model.native_decode = True
        return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]

    c_batch = generate(True, range(4))
    torch_batch = generate(False, range(4))
    alone = [generate(True, [i])[0] for i in range(4)]
    for other in (torch_batch, alone):
        for (c_ids, c_lp), (ids, lp) in zip(c_batch, other):
            assert c_ids == ids
            assert math.isclose(c_lp, lp, rel_tol=1e-4, abs_tol=1e-4)
