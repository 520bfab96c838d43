"""lm-evaluation-harness's ``local-completions`` model against a real ``engine serve`` process on
the default model: the tiny tasks of data/lm_eval (six multiple-choice questions scored by
loglikelihood, two greedy ``generate_until`` items) run through ``lm_eval.simple_evaluate``, and
what it scored is compared with HF transformers in float32 on the same token ids.

lm-eval tokenizes through the server (/tokenizer_info and /tokenize: its "remote" tokenizer), so
nothing is fetched from a model hub. Bounds:

- ``--dtype float32``: every loglikelihood within LL_F32 of transformers', the same is_greedy,
  the same acc and acc_norm, and the same generated text.
- the default dtype (``auto``: bfloat16 weights at least; bfloat16 activations too on CUDA and
  on bf16 CPUs): every loglikelihood within LL_DEFAULT_PER_TOKEN per continuation token; acc and
  acc_norm within one question of transformers' (a near tie may flip); generations are not
  compared (greedy paths may part).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from serverutil import wait_healthy

from engine.ipc.ports import free_port
from engine.model.loader import resolve_model_path

TASKS = Path(__file__).resolve().parents[2] / "data" / "lm_eval"
MC, GEN = "engine_tiny_mc", "engine_tiny_gen"
# Measured on an AMD EPYC (engine/cpu_isa.py level avx2, 2026-12): float32 at most 4.5e-5 nats
# off; the default dtype (there bfloat16 weights and KV cache under float32 activations) at most
# 0.06 nats per continuation token.
LL_F32 = 1e-3  # nats, a whole continuation's loglikelihood
LL_DEFAULT_PER_TOKEN = 0.25  # nats per continuation token
START_TIMEOUT_S = 180

pytestmark = pytest.mark.slow
pytest.importorskip(
    "lm_eval", reason='lm-eval is the optional [eval] extra: pip install -e ".[eval]"'
)


@contextmanager
def served(*args: str) -> Iterator[str]:
    """``engine serve`` on the default model on a free port: its base URL until the block ends."""
    port = free_port()
    cmd = [sys.executable, "-m", "engine", "serve", "--model", "default", "--port", str(port)]
    cmd += [
        "--max-model-len",
        "1024",
        "--kv-cache-memory-gb",
        "0.25",
        "--log-level",
        "warning",
        *args,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, START_TIMEOUT_S)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def evaluate(base: str) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model=default,base_url={base}/v1/completions",
        tasks=[MC, GEN],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        log_samples=True,
        batch_size=8,  # eight prompts a request: our completions route takes a list of them
    )


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(resolve_model_path("default"))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    model.reference_tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    return model


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # lm-eval and datasets: nothing to fetch
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    out = {}
    for name, args in (("float32", ("--dtype", "float32")), ("default", ())):
        with served(*args) as base:
            tokenize = _Tokenize(base)
            out[name] = {"results": evaluate(base), "tokenize": tokenize}
            tokenize.warm(out[name]["results"])
    return out


class _Tokenize:
    """The server's /tokenize as lm-eval calls it (no special tokens added), cached so that the
    reference is computed on the ids lm-eval sent after the server has stopped."""

    def __init__(self, base: str) -> None:
        self.base, self.cache = base, {}

    def __call__(self, text: str) -> list[int]:
        if text not in self.cache:
            body = {"prompt": text, "add_special_tokens": False}
            self.cache[text] = httpx.post(self.base + "/tokenize", json=body).json()["tokens"]
        return self.cache[text]

    def warm(self, results: dict) -> None:
        for sample in results["samples"][MC]:
            for context, continuation in sample["arguments"]:
                _pair(self, context, continuation)
        for sample in results["samples"][GEN]:
            self(sample["arguments"][0][0])


def _pair(tokenize, context: str, continuation: str) -> tuple[list[int], int]:
    """lm-eval's TemplateLM._encode_pair: the whole text's ids and the context's length (the
    context's trailing spaces move to the continuation)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    return tokenize(context + continuation), len(tokenize(context))


@torch.inference_mode()
def _reference_loglikelihood(hf_model, ids: list[int], ctxlen: int) -> tuple[float, bool, int]:
    logprobs = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    rows, targets = logprobs[ctxlen - 1 : -1], torch.tensor(ids[ctxlen:])
    ll = float(rows.gather(1, targets[:, None]).sum())
    return ll, bool((rows.argmax(-1) == targets).all()), len(targets)


def _compare_mc(run: dict, hf_model) -> tuple[list[float], list[float], dict[str, float]]:
    """Per choice: |ours - transformers'| and the number of continuation tokens; and the
    transformers acc and acc_norm over the questions."""
    diffs, lengths, hits = [], [], {"acc": 0.0, "acc_norm": 0.0}
    samples = run["results"]["samples"][MC]
    for sample in samples:
        ref = []
        for (context, continuation), (ll, _) in zip(sample["arguments"], sample["filtered_resps"]):
            ids, ctxlen = _pair(run["tokenize"], context, continuation)
            ref_ll, ref_greedy, n = _reference_loglikelihood(hf_model, ids, ctxlen)
            diffs.append(abs(ll - ref_ll))
            lengths.append(n)
            ref.append((ref_ll, ref_greedy, len(continuation)))
        target = sample["target"]
        hits["acc"] += max(range(len(ref)), key=lambda i: ref[i][0]) == target
        hits["acc_norm"] += max(range(len(ref)), key=lambda i: ref[i][0] / ref[i][2]) == target
        sample["reference_greedy"] = [r[1] for r in ref]
    return diffs, lengths, {k: v / len(samples) for k, v in hits.items()}


@torch.inference_mode()
def _reference_generation(hf_model, ids: list[int], kwargs: dict) -> str:
    out = hf_model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=kwargs["max_gen_toks"],
        do_sample=False,
        pad_token_id=2,
    )[0, len(ids) :].tolist()
    text = hf_model.reference_tokenizer.decode(out, skip_special_tokens=True)
    for stop in kwargs["until"]:
        text = text.split(stop)[0]
    return text


def test_float32_scores_equal_transformers(runs, hf_model):
    run = runs["float32"]
    diffs, _, ref_acc = _compare_mc(run, hf_model)
    assert max(diffs) <= LL_F32, diffs
    for sample in run["results"]["samples"][MC]:
        assert [g for _, g in sample["filtered_resps"]] == sample["reference_greedy"]
    scores = run["results"]["results"][MC]
    assert scores["acc,none"] == ref_acc["acc"]
    assert scores["acc_norm,none"] == ref_acc["acc_norm"]
    for sample in run["results"]["samples"][GEN]:
        context, kwargs = sample["arguments"][0]
        expected = _reference_generation(hf_model, run["tokenize"](context), kwargs)
        assert sample["filtered_resps"][0] == expected
        assert expected.strip()  # the model said something: the comparison means something


def test_default_dtype_within_bounds(runs, hf_model):
    run = runs["default"]
    diffs, lengths, ref_acc = _compare_mc(run, hf_model)
    for diff, n in zip(diffs, lengths):
        assert diff <= LL_DEFAULT_PER_TOKEN * n, (diffs, lengths)
    scores = run["results"]["results"][MC]
    questions = len(run["results"]["samples"][MC])
    assert abs(scores["acc,none"] - ref_acc["acc"]) <= 1 / questions + 1e-9
    assert abs(scores["acc_norm,none"] - ref_acc["acc_norm"]) <= 1 / questions + 1e-9
    assert len(run["results"]["samples"][GEN]) == 2
