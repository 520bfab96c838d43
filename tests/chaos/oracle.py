"""The chaos oracle: is a 200 whose text differs from the clean run a wrong answer, or a greedy
near-tie that another batch's arithmetic flipped?

The cluster under chaos runs in float32, and the reference is the same cluster's clean run, so
most recomputes give the same tokens bit for bit. Not all: a request recomputed after a fault
runs in another batch and chunking, and float32 GEMMs of other shapes round differently in the
last bits, so where two tokens' logits are all but equal the greedy choice may flip. This
module tells the two apart with a local float32 engine (the same weights): it walks the
reference answer token by token (each step's logits of prompt + reference tokens so far), finds
the first token whose text the served answer does not continue with, and takes the logit gap at
that step between the reference's token and the served one's first token (EOS for an answer that
ends there). A gap under ``NEAR_TIE`` is numerics; anything else is a wrong answer, which the
chaos test fails on. Where the forward is batch-invariant (EngineConfig.deterministic, the
default wherever the C layers serve: docs/determinism.md) a recompute gives the clean run's bits
whatever its batch and chunking, so the comparison is exact: ``exact=True`` judges every
difference a wrong answer, the gap reported for the record.
"""

from __future__ import annotations

NEAR_TIE = 1e-3  # float32 logits of this model: batch-shape rounding moves them by ~1e-5


def classify(llm, prompt: str, reference: str, served: str, exact: bool = False) -> tuple[str, str]:
    """("near_tie" | "wrong", why) for a served text that differs from the reference; never
    "near_tie" when ``exact`` (a deterministic cluster: no rounding can flip a token)."""
    tok = llm.engine.tokenizer
    eos = set(llm.engine.eos_token_ids)
    ids = tok.encode(prompt)
    logits = llm.engine.prompt_logits(ids + tok.encode(reference, add_special_tokens=False))
    ref_ids = tok.encode(reference, add_special_tokens=False)
    text = ""
    for k in range(len(ref_ids) + 1):
        row = logits[len(ids) - 1 + k]
        rid = ref_ids[k] if k < len(ref_ids) else min(eos)  # the reference ended here
        piece = tok.decode([rid], skip_special_tokens=False) if k < len(ref_ids) else ""
        if k < len(ref_ids) and served.startswith(text + piece):
            text += piece
            continue
        rest = served[len(text) :]
        alt = tok.encode(rest, add_special_tokens=False)[0] if rest else min(eos)
        gap = float(row[rid] - row[alt])
        kind = "near_tie" if abs(gap) < NEAR_TIE and not exact else "wrong"
        name = tok.decode([alt], skip_special_tokens=False)
        why = f"token {k}: reference {rid} {piece!r}, served {alt} {name!r}, logit gap {gap:.2e}"
        if exact:
            why += " (deterministic: any difference is wrong)"
        return kind, why
    return "wrong", "the texts differ but no token step shows where"
