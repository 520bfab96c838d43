"""The sampler against direct references on small vocabularies. Every random draw is seeded."""

from __future__ import annotations

import math
import time

import pytest
import torch

from engine.core.sampler import (
    TOP_P_CANDIDATES,
    Sampler,
    SamplingBatch,
    _keep_sorted,
    make_generator,
)
from engine.sampling_params import SamplingParams

sampler = Sampler()


def build(params, logits, prompts=None, outputs=None, generators=None, eos=()):
    n, vocab = logits.shape
    params = params if isinstance(params, list) else [params] * n
    if generators is None:
        generators = [make_generator(p.seed) if p.seed is not None else None for p in params]
    return SamplingBatch.build(
        params,
        generators,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        vocab,
        "cpu",
        eos_token_ids=eos,
    )


def sample(params, logits, **kw):
    return sampler(logits, build(params, logits, **kw))


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_temperature_zero_is_argmax_in_any_dtype():
    logits = randn(16, 1000)
    batch = build(SamplingParams(temperature=0), logits)
    assert batch.fast_greedy
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = sampler(logits.to(dtype), batch)
        assert out.token_ids == logits.to(dtype).float().argmax(-1).tolist()
        assert out.logprobs == [None] * 16


def test_top_k_1_is_greedy():
    logits = randn(16, 1000, scale=0.1)  # flat: a random draw would rarely hit the argmax
    out = sample(SamplingParams(temperature=1.5, top_k=1, seed=3), logits)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_stay_greedy():
    logits = randn(8, 500, scale=0.1)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1)] * 4
    out = sample(params, logits)
    assert out.token_ids[0::2] == logits[0::2].argmax(-1).tolist()
    assert out.token_ids[1::2] != logits[1::2].argmax(-1).tolist()


def run_steps(params, rows, steps=12, vocab=300, scale=0.5):
    """Tokens of every row over several steps; one generator per seeded row for the whole run,
    row logits depend only on (row's key, step) so a request sees the same logits in any batch."""
    gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
    out = []
    for step in range(steps):
        logits = torch.stack([randn(vocab, seed=1000 * key + step, scale=scale) for key in rows])
        batch = build(params, logits, generators=gens)
        out.append(sampler(logits, batch).token_ids)
    return [list(col) for col in zip(*out, strict=True)]


def test_seed_reproducible_and_independent_of_batch():
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = run_steps([target], rows=[7])[0]
    assert run_steps([target], rows=[7])[0] == alone
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5, seed=99),
        SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.3),
    ]
    for pos in range(len(others) + 1):
        params = others[:pos] + [target] + others[pos:]
        rows = [1, 2, 3, 4][:pos] + [7] + [1, 2, 3, 4][pos:]
        assert run_steps(params, rows)[pos] == alone, pos


def test_different_seeds_differ():
    a = run_steps([SamplingParams(seed=1)], rows=[0])[0]
    b = run_steps([SamplingParams(seed=2)], rows=[0])[0]
    assert a != b


def test_seed_without_generator_raises():
    with pytest.raises(ValueError, match="seed"):
        SamplingBatch.build([SamplingParams(seed=1)], [None], [[]], [[]], 10, "cpu")


def test_tiny_top_p_is_argmax():
    logits = randn(32, 2000, scale=0.2)
    out = sample(SamplingParams(top_p=1e-6, seed=0), logits)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_and_min_p_restrict_the_support():
    base = randn(500, seed=5, scale=2.0)
    logits = base.expand(4000, -1).clone()
    allowed_k = set(base.topk(7).indices.tolist())
    probs = base.softmax(-1)
    allowed_p = set((probs >= 0.3 * probs.max()).nonzero().squeeze(1).tolist())
    assert 1 < len(allowed_p) < 20
    with torch.random.fork_rng():
        torch.manual_seed(0)
        assert set(sample(SamplingParams(top_k=7), logits).token_ids) == allowed_k
        assert set(sample(SamplingParams(min_p=0.3), logits).token_ids) == allowed_p
        # min-p inside the top-k path: the tighter of the two cuts wins.
        both = SamplingParams(top_k=len(allowed_p) + 3, min_p=0.3)
        assert set(sample(both, logits).token_ids) == allowed_p
    before = logits.clone()
    sample([SamplingParams(top_k=7), SamplingParams(min_p=0.3)] * 2000, logits)
    assert torch.equal(logits, before)


def test_penalty_token_ids_out_of_range_raise():
    with pytest.raises(ValueError, match="token ids"):
        build(SamplingParams(repetition_penalty=1.2), torch.zeros(1, 10), prompts=[[3, 10]])


def reference_keep(x, top_k, top_p):
    """Mask of kept tokens: sort the whole row, top-k, then top-p renormalised over the top-k."""
    vals, ids = x.sort(descending=True)
    if top_k:
        vals[top_k:] = -math.inf
    probs = vals.softmax(-1)
    keep_sorted = (probs.cumsum(-1) - probs < top_p) & (vals > -math.inf)
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep[ids[keep_sorted]] = True
    return keep


@pytest.mark.parametrize("vocab", [100, 3001])
def test_keep_sorted_matches_full_sort_reference(vocab):
    cases = [(0, 0.9, 4.0), (0, 0.9, 0.05), (10, 1.0, 1.0), (50, 0.5, 2.0), (0, 0.3, 0.05)]
    params = [SamplingParams(top_k=k, top_p=p) for k, p, _ in cases]
    # scale 0.05 over 3001 tokens is flat: the best TOP_P_CANDIDATES hold too little mass.
    x = torch.stack([randn(vocab, seed=i, scale=s) for i, (_, _, s) in enumerate(cases)])
    g = build(params, x).filtered
    assert g.rows.tolist() == list(range(len(cases)))
    for width in (min(vocab, TOP_P_CANDIDATES), vocab):
        vals, ids = x.topk(width, dim=-1)
        keep, decided = _keep_sorted(vals, x, g.top_k, g.top_p, None)
        for row, (k, p, scale) in enumerate(cases):
            if width == vocab or k:
                assert decided[row]
            if decided[row]:
                kept = torch.zeros(vocab, dtype=torch.bool)
                kept[ids[row][keep[row]]] = True
                assert torch.equal(kept, reference_keep(x[row], k, p)), (width, cases[row])
            else:
                assert vocab > TOP_P_CANDIDATES and scale < 1
        if width < vocab:
            assert not decided[1]


def test_top_p_on_a_flat_row_samples_exactly_the_nucleus():
    base = randn(1000, seed=4, scale=0.3)
    nucleus = set(reference_keep(base, 0, 0.5).nonzero().squeeze(1).tolist())
    assert len(nucleus) > TOP_P_CANDIDATES  # so the sort fallback is what runs
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tokens = set(sample(SamplingParams(top_p=0.5), base.expand(4000, -1)).token_ids)
    assert tokens <= nucleus and len(tokens) > 0.95 * len(nucleus)


@pytest.mark.parametrize("top_p", [0.5, 0.95])
def test_seeded_top_p_row_same_token_whatever_the_candidate_count(top_p):
    # Flat rows over 5000 tokens: alone, the row is decided among 4096 candidates (top_p=0.5) or
    # needs the sorted vocab (0.95); next to a top_k=4999 row every row has 4999 candidates.
    target = SamplingParams(top_p=top_p, seed=5)
    alone = run_steps([target], rows=[3], steps=6, vocab=5000, scale=0.1)[0]
    neighbour = SamplingParams(top_k=4999)
    pair = run_steps([neighbour, target], rows=[1, 3], steps=6, vocab=5000, scale=0.1)
    assert pair[1] == alone
    assert len(set(alone)) > 1


def reference_penalties(logits, params, prompts, outputs):
    out = logits.clone()
    for i, p in enumerate(params):
        for t in set(prompts[i]) | set(outputs[i]):
            v = out[i, t]
            out[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(outputs[i]):
            count = outputs[i].count(t)
            out[i, t] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_penalties_follow_the_formulas():
    logits = randn(4, 20, seed=3, scale=3.0)
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=1.5),
        SamplingParams(),
    ]
    prompts = [[1, 2, 3, 3], [4, 5], [0, 7, 7], [1, 2]]
    outputs = [[5, 5, 9], [2, 2, 2, 6, 9], [7, 8, 8, 19], [1, 1]]
    before = logits.clone()
    got = Sampler.penalized_logits(logits, build(params, logits, prompts, outputs))
    torch.testing.assert_close(got, reference_penalties(logits, params, prompts, outputs))
    assert torch.equal(logits, before)  # the caller's logits are left raw
    assert not torch.equal(got[0], logits[0]) and torch.equal(got[3], logits[3])


def chi_square(tokens, probs):
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("seeded", [False, True])
def test_frequencies_follow_softmax_over_temperature(seeded):
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 20000
    logits = base.expand(n, -1)
    params = [SamplingParams(temperature=0.7, seed=i if seeded else None) for i in range(n)]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tokens = sample(params, logits).token_ids
    # 4 degrees of freedom: chi2 > 40 has probability ~4e-8; the draw is seeded, so no flakes.
    assert chi_square(tokens, (base / 0.7).softmax(-1)) < 40


def test_frequencies_with_top_k_renormalise():
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    logits = base.expand(20000, -1)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        tokens = sample(SamplingParams(temperature=2.0, top_k=3), logits).token_ids
    expected = torch.cat([(base[:3] / 2.0).softmax(-1), torch.zeros(2)])
    assert max(tokens) == 2
    assert chi_square(tokens, expected[:3]) < 40


def test_logprobs_are_raw_log_softmax_with_sorted_top_n():
    logits = randn(3, 50, seed=8, scale=2.0).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.5, logprobs=5, repetition_penalty=2.0, seed=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=0),
    ]
    out = sample(params, logits, prompts=[[1, 2, 3]] * 3)
    ref = torch.log_softmax(logits.float(), -1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(ref[0, first.token_id].item(), abs=1e-6)
    assert list(first.top) == ref[0].topk(5).indices.tolist()
    assert list(first.top.values()) == sorted(first.top.values(), reverse=True)
    for t, lp in first.top.items():
        assert lp == pytest.approx(ref[0, t].item(), abs=1e-6)
    assert out.logprobs[1] is None
    assert out.logprobs[2].top == {}
    assert out.logprobs[2].logprob == pytest.approx(ref[2].max().item(), abs=1e-6)


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = randn(6, 100, seed=2)
    logits[:, 0] = 50.0  # EOS
    logits[:, 1] = 40.0  # a stop token id
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(1,))
    q = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=(1,), seed=4)
    r = SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)
    params = [p, p, q, q, r, SamplingParams(temperature=0)]
    outputs = [[5, 6], [5, 6, 7], [5], [5, 6, 7], [5], [5]]
    out = sample(params, logits, outputs=outputs, eos=(0,)).token_ids
    assert out[0] == logits[0, 2:].argmax().item() + 2  # EOS and stop id masked
    assert out[1] == 0  # min_tokens reached
    assert out[2] not in (0, 1) and out[3] == 0
    assert out[4] == 0  # ignore_eos: EOS is not a stop, so it is not masked
    assert out[5] == 0


def test_empty_batch():
    out = sample([], torch.empty(0, 10))
    assert out == ([], [])


def lm_like_logits(n, vocab, seed=0):
    """Zipf-like rows (p ~ rank^-1.5, shuffled): peaked the way LM output is, unlike randn."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(vocab, generator=g) for _ in range(n)]).float() + 1
    return -1.5 * ranks.log() + 0.3 * torch.randn(n, vocab, generator=g)


def test_sampler_timing():
    """Prints the per-step cost (run with -s); asserts nothing about speed."""
    n, vocab = 64, 49152
    logits = lm_like_logits(n, vocab)
    mixed = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.95, seed=1),
        SamplingParams(temperature=0.7, top_k=50),
        SamplingParams(temperature=1.0, repetition_penalty=1.1, presence_penalty=0.5, logprobs=5),
    ] * (n // 4)
    prompts = [list(range(i, i + 512)) for i in range(n)]
    outputs = [list(range(i, i + 64)) for i in range(n)]
    cases = {
        "greedy": [SamplingParams(temperature=0)] * n,
        "T=1": [SamplingParams(temperature=1.0)] * n,
        "top_p=0.9": [SamplingParams(top_p=0.9)] * n,
        "mixed": mixed,
    }
    print()
    for name, params in cases.items():
        times = []
        for _ in range(5):
            gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
            t0 = time.perf_counter()
            batch = SamplingBatch.build(params, gens, prompts, outputs, vocab, "cpu")
            t1 = time.perf_counter()
            sampler(logits, batch)
            times.append((t1 - t0, time.perf_counter() - t1))
        build_s, call_s = sorted(times)[len(times) // 2]
        print(
            f"sampler {n}x{vocab} {name}: build {build_s * 1e3:.2f} ms, call {call_s * 1e3:.2f} ms"
        )
