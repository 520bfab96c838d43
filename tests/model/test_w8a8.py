"""--quantization w8a8 on the default model: close to the float model's predictions, and a
request's answer the same alone and in a batch (integer products, one order per output)."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.kernels import native
from engine.llm import LLM
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")

TEXT = (
    "Mooncake serves long prompts: a request's prompt is prefilled on one process and decoded "
    "on another, and the KV cache between them streams layer by layer while the prefill still "
    "computes. KV blocks are named by chained prefix hashes and kept in tiers shared by all "
    "instances, so a prefix computed once is loaded, not recomputed. The Conductor places each "
    "request where its time to first token is lowest and rejects early when the cluster is "
    "overloaded. def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) "
    "+ fibonacci(n - 2)\n"
)


def llm(quantization: str | None) -> LLM:
    return LLM.from_config(
        EngineConfig(
            model="default",
            dtype="float32",
            device="cpu",
            quantization=quantization,
            cache=CacheConfig(num_blocks=256, block_size=16),
        )
    )


@pytest.fixture(scope="module")
def w8a8():
    with llm("w8a8") as engine_llm:
        yield engine_llm


def test_predictions_stay_close_to_the_float_models(w8a8):
    ids = w8a8.engine.tokenizer.encode(TEXT)
    quant = w8a8.engine.prompt_logits(ids)
    with llm(None) as ref_llm:
        ref = ref_llm.engine.prompt_logits(ids)
    assert quant.shape == ref.shape and not torch.equal(quant, ref)  # it does quantize
    agree = (quant.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
    # the distributions: mean KL(ref || w8a8) per position, small against ~10 nats of entropy
    kl = torch.nn.functional.kl_div(
        quant.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none"
    ).sum(-1)
    assert kl.mean().item() < 0.05, kl.mean().item()


def test_an_answer_is_the_same_alone_and_in_a_batch(w8a8):
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", TEXT, "1, 2, 3, 4,", "List three colors:"]
    together = [o.outputs[0].token_ids for o in w8a8.generate(prompts, sp)]
    alone = [w8a8.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
