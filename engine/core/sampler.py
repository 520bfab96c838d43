"""The sampler: turns one step's logits into one token per sequence, vectorised across the batch.

Per row: structured-output bitmask -> min_tokens mask -> repetition penalty -> frequency/presence
penalties -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> random draw. Top-k, top-p
and min-p each keep a prefix of the tokens sorted by logit, and top-p's mass is taken over the
top-k set; min-p keeps the tokens with ``p >= min_p * p_max`` (``p_max`` is the same before and
after the other cuts), so its place in the order matters only to how top-p's mass is counted: vLLM
v1 renormalises over the min-p set first, we count over the top-k set as HF does. Logprobs come
from the log-softmax of the RAW model logits, before all of this (vLLM's default ``raw_logprobs``):
they describe the model, not the sampling settings.

Cost is paid only by the rows that need it. An all-greedy batch without penalties is one argmax.
Penalties and the min_tokens mask touch only the (row, token) pairs they name. Rows with top-k or
top-p draw among their best ``max(top_k, TOP_P_CANDIDATES)`` tokens (a partial top-k, far cheaper
than sorting the vocab); a top-p row whose candidates hold too little mass (a flat distribution)
retries with TOP_P_RETRY candidates, and only then sorts its vocab.

The draw is the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` picks token ``i`` with
probability ``p_i / sum(p)``. ``E`` is made as ``-log(U)``: on CPU ``uniform_`` + ``log_`` is
several times faster than ``exponential_``, and ``U < 1`` means ``E > 0`` (a zero would make
``0 / 0``, a NaN that argmax picks). A seeded row draws exactly ``vocab_size`` uniforms from its
own generator per random step, whatever else is in the batch, so its tokens depend only on its own
logits and seed; a greedy step draws nothing. (Rows with top-k/top-p race over their candidates in
rank order, using the first of those uniforms.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import torch

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.structured.grammar import apply_bitmask

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing by them only risks overflow.
GREEDY_TEMPERATURE = 1e-5
# Candidates a top-p row without top-k first looks for its cut in (a typical LM distribution puts
# well over 0.95 of its mass there); rows where they hold less than top_p fall back to a sort.
TOP_P_CANDIDATES = 256
TOP_P_RETRY = (4096,)  # a partial top-k of 4096 still costs a fifth of a sort of 49152


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator for ``SamplingParams.seed``: make it once, pass it every step."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # any Python int, negative included
    return generator


def is_greedy(p: SamplingParams) -> bool:
    return p.temperature < GREEDY_TEMPERATURE or p.top_k == 1


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None when the request did not ask for logprobs


@dataclass(frozen=True)
class RandomRows:
    """Rows that draw at random, seeded ones first: row ``rows[j]`` uses ``generators[j]`` for
    ``j < len(generators)``, the global RNG after. Columns are [R, 1]."""

    rows: torch.Tensor
    generators: tuple[torch.Generator, ...]
    temperature: torch.Tensor | None  # None when every row has temperature 1
    min_p: torch.Tensor | None  # 0 where disabled; None when no row uses it
    top_k: torch.Tensor | None  # vocab_size where disabled; None for the rows without top-k/p
    top_p: torch.Tensor | None  # 2.0 where disabled, so float error in a cumsum never cuts
    max_top_k: int  # largest enabled top_k, 0 if none
    all_top_k: bool  # every row has top-k: no row can need more than max_top_k candidates
    vocab_size: int


@dataclass(frozen=True)
class SamplingBatch:
    """Everything the sampler needs for one step, as tensors on the logits' device.

    Row ``i`` is sequence ``i`` of the logits. ``*_keys`` address the flattened [N, V] logits
    (``row * vocab_size + token``), each pair at most once.
    """

    num_rows: int
    vocab_size: int
    fast_greedy: bool  # every row greedy, no penalties, no min_tokens mask: a bare argmax
    greedy_rows: torch.Tensor | None
    plain: RandomRows | None  # random rows without top-k/top-p
    filtered: RandomRows | None  # random rows with top-k and/or top-p
    mask_keys: torch.Tensor | None  # EOS / stop ids masked until min_tokens
    repetition_keys: torch.Tensor | None  # tokens in prompt or output of a repetition-penalty row
    repetition: torch.Tensor | None  # that row's penalty, per key
    penalty_keys: torch.Tensor | None  # output tokens of a frequency/presence-penalty row
    penalty: torch.Tensor | None  # frequency * count + presence, per key
    logprob_rows: list[int]
    num_logprobs: list[int]
    # Structured outputs: the int32 token bitmask [num_rows, ceil(vocab/32)] and the rows it
    # constrains (engine/structured/grammar.py); None when no row is constrained.
    bitmask: torch.Tensor | None = None
    bitmask_rows: list[int] | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Sequence[int] = (),
        bitmask: tuple[torch.Tensor, list[int]] | None = None,
    ) -> SamplingBatch:
        """``eos_token_ids`` are the model's EOS ids: while a row has fewer than ``min_tokens``
        outputs they (unless ``ignore_eos``) and its ``stop_token_ids`` are masked. A random row
        samples from ``generators[i]`` when it is not None; a row with a ``seed`` must have one.
        ``bitmask`` is a step's (bitmask, constrained rows) from structured outputs: the tokens
        it leaves out of a row are masked before penalties, temperature and filters.
        """
        n = len(params)
        if not (len(generators) == len(prompt_token_ids) == len(output_token_ids) == n):
            raise ValueError("params, generators, prompt and output token lists differ in length")
        greedy = [is_greedy(p) for p in params]
        for i, p in enumerate(params):
            if p.seed is not None and generators[i] is None and not greedy[i]:
                raise ValueError(f"row {i} has seed={p.seed} but no generator")
        random = [i for i in range(n) if not greedy[i]]
        filters = lambda p: 1 < p.top_k < vocab_size or p.top_p < 1.0
        draw = lambda rows: _random_rows(rows, params, generators, vocab_size, device)

        mask_rows, mask_ids = [], []
        for i, p in enumerate(params):
            if len(output_token_ids[i]) < p.min_tokens:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                ids = sorted(t for t in ids if t < vocab_size)
                mask_rows += [i] * len(ids)
                mask_ids += ids
        rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        pen = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]

        repetition_keys = repetition = penalty_keys = penalty = None
        if rep:
            seen = [prompt_token_ids[i] + output_token_ids[i] for i in rep]
            repetition_keys, _ = _keys(rep, seen, vocab_size, device)
            per_row = torch.tensor([params[i].repetition_penalty for i in rep], device=device)
            repetition = per_row[_row_position(repetition_keys, rep, vocab_size, device)]
        if pen:
            penalty_keys, counts = _keys(
                pen, [output_token_ids[i] for i in pen], vocab_size, device
            )
            at = _row_position(penalty_keys, pen, vocab_size, device)
            freq = torch.tensor([params[i].frequency_penalty for i in pen], device=device)
            pres = torch.tensor([params[i].presence_penalty for i in pen], device=device)
            penalty = freq[at] * counts + pres[at]

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        fast_greedy = all(greedy) and not (rep or pen or mask_rows or bitmask)
        return cls(
            num_rows=n,
            vocab_size=vocab_size,
            fast_greedy=fast_greedy,
            # Not for fast_greedy (argmax of every row): on CUDA each host list made a tensor
            # is a copy from pageable memory, which waits for the forward.
            greedy_rows=_index([i for i in range(n) if greedy[i]], device)
            if any(greedy) and not fast_greedy
            else None,
            plain=draw([i for i in random if not filters(params[i])]),
            filtered=draw([i for i in random if filters(params[i])]),
            mask_keys=_index([r * vocab_size + t for r, t in zip(mask_rows, mask_ids)], device)
            if mask_rows
            else None,
            repetition_keys=repetition_keys,
            repetition=repetition,
            penalty_keys=penalty_keys,
            penalty=penalty,
            logprob_rows=logprob_rows,
            num_logprobs=[params[i].logprobs for i in logprob_rows],
            bitmask=bitmask[0] if bitmask else None,
            bitmask_rows=bitmask[1] if bitmask else None,
        )


# Made on the host and moved, as ``torch.tensor(..., device=)`` does inside, but through the
# dispatcher, so the device tests' fake accelerator (tests/fake_device.py) sees it.
def _index(values: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device)


def _column(values: list[float], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(device).unsqueeze(1)


def _random_rows(
    rows: list[int],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    vocab_size: int,
    device: torch.device | str,
) -> RandomRows | None:
    if not rows:
        return None
    rows = [i for i in rows if generators[i] is not None] + [
        i for i in rows if generators[i] is None
    ]
    ps = [params[i] for i in rows]
    top_k = [p.top_k if 1 < p.top_k < vocab_size else vocab_size for p in ps]
    filtered = any(k < vocab_size or p.top_p < 1.0 for k, p in zip(top_k, ps, strict=True))
    return RandomRows(
        rows=_index(rows, device),
        generators=tuple(g for i in rows if (g := generators[i]) is not None),
        temperature=_column([p.temperature for p in ps], device)
        if any(p.temperature != 1.0 for p in ps)
        else None,
        min_p=_column([p.min_p for p in ps], device) if any(p.min_p for p in ps) else None,
        top_k=_index(top_k, device).unsqueeze(1) if filtered else None,
        top_p=_column([p.top_p if p.top_p < 1.0 else 2.0 for p in ps], device)
        if filtered
        else None,
        max_top_k=max((k for k in top_k if k < vocab_size), default=0),
        all_top_k=all(k < vocab_size for k in top_k),
        vocab_size=vocab_size,
    )


def _keys(
    rows: list[int], tokens: list[list[int]], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct ``row * vocab_size + token`` keys of each row's tokens, sorted, with counts."""
    row_of = _index(rows, device).repeat_interleave(_index([len(t) for t in tokens], device))
    flat = _index(list(chain.from_iterable(tokens)), device)
    if len(flat) and not (0 <= int(flat.min()) and int(flat.max()) < vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}) for the penalties")
    keys, counts = torch.unique(row_of * vocab_size + flat, return_counts=True)
    return keys, counts.float()


def _row_position(
    keys: torch.Tensor, rows: list[int], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """For each key, the position of its row in ``rows`` (ascending)."""
    return torch.searchsorted(_index(rows, device), keys // vocab_size)


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """``logits`` is [num_rows, vocab_size], any float dtype; it is not modified."""
        if logits.shape != (batch.num_rows, batch.vocab_size):
            raise ValueError(
                f"logits shape {tuple(logits.shape)} != ({batch.num_rows}, {batch.vocab_size})"
            )
        if batch.fast_greedy:
            tokens = logits.argmax(dim=-1)  # exact in any float dtype: no upcast needed
        else:
            tokens = self._sample(logits, batch)
        return SamplerOutput(tokens.tolist(), self._logprobs(logits, tokens, batch))

    @staticmethod
    def penalized_logits(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """fp32 logits after the structured-output bitmask, the min_tokens mask and the
        penalties: what greedy rows argmax over and random rows divide by their temperature.
        Never writes into ``logits``."""
        x = logits.float().contiguous()
        if (
            b.mask_keys is None
            and b.repetition_keys is None
            and b.penalty_keys is None
            and b.bitmask is None
        ):
            return x
        if x.data_ptr() == logits.data_ptr():
            x = x.clone()
        if b.bitmask is not None:
            apply_bitmask(x, b.bitmask, b.bitmask_rows)
        flat = x.view(-1)
        if b.mask_keys is not None:
            flat[b.mask_keys] = -math.inf
        if b.repetition_keys is not None:
            v, r = flat[b.repetition_keys], b.repetition
            flat[b.repetition_keys] = torch.where(v > 0, v / r, v * r)
        if b.penalty_keys is not None:
            flat[b.penalty_keys] -= b.penalty
        return x

    def _sample(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        x = self.penalized_logits(logits, b)
        tokens = torch.empty(b.num_rows, dtype=torch.long, device=x.device)
        if b.greedy_rows is not None:
            tokens[b.greedy_rows] = x[b.greedy_rows].argmax(dim=-1)
        if b.plain is not None:
            tokens[b.plain.rows] = _draw_plain(x, b.plain)
        if b.filtered is not None:
            tokens[b.filtered.rows] = _draw_filtered(x, b.filtered)
        return tokens

    def _logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, b: SamplingBatch
    ) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * b.num_rows
        if not b.logprob_rows:
            return out
        rows = _index(b.logprob_rows, logits.device)
        lp = torch.log_softmax(logits[rows].float(), dim=-1)
        chosen_ids = tokens[rows]
        chosen = lp.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
        top = lp.topk(max(b.num_logprobs), dim=-1)  # sorted, best first
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
        rows_n_ids = zip(b.logprob_rows, b.num_logprobs, chosen_ids.tolist(), strict=True)
        for j, (i, n, t) in enumerate(rows_n_ids):
            best = dict(zip(top_ids[j][:n], top_vals[j][:n], strict=True))
            out[i] = TokenLogprob(token_id=t, logprob=chosen[j], top=best)
        return out


def _scaled(x: torch.Tensor, g: RandomRows) -> torch.Tensor:
    x = x[g.rows]  # a copy: safe to change in place
    return x.div_(g.temperature) if g.temperature is not None else x


def _seeded_uniforms(g: RandomRows, out: torch.Tensor | None = None) -> torch.Tensor:
    """This step's draw for each seeded row, always vocab_size numbers: rows ``[:num_seeded]`` of
    ``out`` if given, else a new [num_seeded, vocab_size] tensor."""
    if out is None:
        out = torch.empty(len(g.generators), g.vocab_size, device=g.rows.device)
    for j, generator in enumerate(g.generators):
        out[j].uniform_(generator=generator)
    return out


def _race(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """argmax(p / E) with E = -log(U) ~ Exp(1); ``p`` may be unnormalised. Consumes p and u."""
    return p.div_(u.log_().neg_()).argmax(dim=-1)


def _draw_plain(x: torch.Tensor, g: RandomRows) -> torch.Tensor:
    x = _scaled(x, g)
    p = x.sub_(x.amax(dim=-1, keepdim=True)).exp_()  # p / p_max, so min-p compares with min_p
    if g.min_p is not None:
        p.mul_(p >= g.min_p)  # multiplying by the mask is far faster than masked_fill on CPU
    u = _seeded_uniforms(g, out=torch.empty_like(p))
    u[len(g.generators) :].uniform_()
    return _race(p, u)


def _draw_filtered(x: torch.Tensor, g: RandomRows) -> torch.Tensor:
    """Races each row among its best tokens. A row whose cut is not decided within them (top-p
    without top-k on a flat distribution) retries with more: TOP_P_RETRY, then the sorted vocab."""
    x = _scaled(x, g)
    num_rows, vocab = x.shape
    first = g.max_top_k if g.all_top_k else max(g.max_top_k, TOP_P_CANDIDATES)
    widths = sorted({min(first, vocab), vocab} | {w for w in TOP_P_RETRY if first < w < vocab})
    tokens = torch.empty(num_rows, dtype=torch.long, device=x.device)
    seeded = _seeded_uniforms(g)
    todo = torch.arange(num_rows, device=x.device)
    pick = lambda t: None if t is None else t[todo]
    for width in widths:
        sub = x if len(todo) == num_rows else x[todo]
        if width < vocab:
            vals, ids = sub.topk(width, dim=-1)  # sorted, best first
        else:
            vals, ids = sub.sort(dim=-1, descending=True)
        keep, decided = _keep_sorted(vals, sub, pick(g.top_k), pick(g.top_p), pick(g.min_p))
        # Seeded rows race with the first `width` of this step's draw, whatever `width` is: the
        # uniforms beyond their cut meet zero probability, so the token is the same for any width.
        u = torch.empty_like(vals).uniform_() if len(seeded) < len(todo) else torch.empty_like(vals)
        is_seeded = todo < len(seeded)
        u[is_seeded] = seeded[todo[is_seeded], :width]
        p = (vals - vals[:, :1]).exp_().mul_(keep)
        chosen = ids.gather(1, _race(p, u).unsqueeze(1)).squeeze(1)
        tokens[todo[decided]] = chosen[decided]
        todo = todo[~decided]
        if len(todo) == 0:
            break
    return tokens


def _keep_sorted(
    vals: torch.Tensor,
    x: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of each row's best ``vals`` (descending) survive top-k, top-p and min-p, and whether
    ``vals`` held enough of the row to decide. Top-p keeps the smallest prefix whose probability,
    renormalised over the top-k set, reaches top_p."""
    in_k = torch.arange(vals.shape[1], device=vals.device) < top_k
    masked = vals.masked_fill(~in_k, -math.inf)
    has_k = top_k < x.shape[1]
    # The top-k set lies within vals; without top-k the normaliser is the whole row.
    norm = torch.logsumexp(masked, -1, keepdim=True)
    if not bool(has_k.all()):
        norm = torch.where(has_k, norm, torch.logsumexp(x, -1, keepdim=True))
    probs = (masked - norm).exp_()
    cum = probs.cumsum(dim=-1)
    keep = in_k & (cum - probs < top_p)
    if min_p is not None:
        keep &= (vals - vals[:, :1]).exp_() >= min_p
    decided = (has_k | (cum[:, -1:] >= top_p)).squeeze(1) | (vals.shape[1] == x.shape[1])
    return keep, decided
