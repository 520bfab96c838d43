"""Workloads for the serving benchmark: prompts as token ids, with output lengths and (for
traces) arrival times.

- ``random``: as ``vllm bench serve --dataset-name random``: each prompt is a shared prefix of
  ``prefix_len`` random tokens then ``input_len`` random tokens, lengths drawn uniformly within
  ``range_ratio`` of the targets.
- ``mooncake``: a Mooncake trace (jsonl: timestamp ms, input_length, output_length, hash_ids of
  512-token blocks, chained over the prefix). Lengths are scaled by ``scale`` to fit a small
  model; each hash id always becomes the same ``round(512 * scale)`` tokens, so requests that
  share hash ids share prompt prefixes, and the prefix cache sees the trace's reuse.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

MOONCAKE_BLOCK_TOKENS = 512


@dataclass
class BenchRequest:
    prompt: list[int]
    output_len: int
    arrival_s: float | None = None  # trace replay: seconds after the start


def token_pool(tokenizer) -> list[int]:
    """Token ids to draw random prompts from: the vocabulary without its special tokens."""
    special = set(getattr(tokenizer, "all_special_ids", ()))
    return [i for i in range(tokenizer.vocab_size) if i not in special]


def random_requests(
    tokenizer,
    num: int,
    input_len: int,
    output_len: int,
    prefix_len: int = 0,
    range_ratio: float = 0.0,
    seed: int = 0,
    max_model_len: int | None = None,
) -> list[BenchRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    pool = token_pool(tokenizer)
    prefix = [rng.choice(pool) for _ in range(prefix_len)]
    out = []
    for _ in range(num):
        n_in = rng.randint(int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio)))
        n_out = rng.randint(
            max(1, int(output_len * (1 - range_ratio))), max(1, int(output_len * (1 + range_ratio)))
        )
        prompt = prefix + [rng.choice(pool) for _ in range(max(1, n_in))]
        out.append(BenchRequest(*_fit(prompt, n_out, max_model_len)))
    return out


def mooncake_requests(
    tokenizer,
    path: str,
    num: int,
    scale: float,
    seed: int = 0,
    max_model_len: int | None = None,
) -> list[BenchRequest]:
    if scale <= 0:
        raise ValueError(f"--mooncake-scale must be > 0, got {scale}")
    block = max(1, round(MOONCAKE_BLOCK_TOKENS * scale))
    pool = token_pool(tokenizer)
    blocks: dict[int, list[int]] = {}

    def tokens_of(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            rng = random.Random(f"{seed}:{hash_id}")
            blocks[hash_id] = [rng.choice(pool) for _ in range(block)]
        return blocks[hash_id]

    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if len(out) >= num:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            n_in = max(1, round(row["input_length"] * scale))
            n_out = max(1, round(row["output_length"] * scale))
            needed = math.ceil(n_in / block)
            ids = list(row.get("hash_ids", []))[:needed]
            prompt = [t for h in ids for t in tokens_of(h)]
            rng = random.Random(f"{seed}:row{i}")  # a trace row with fewer ids than blocks
            prompt += [rng.choice(pool) for _ in range(max(0, n_in - len(prompt)))]
            prompt, n_out = _fit(prompt[:n_in], n_out, max_model_len)
            out.append(BenchRequest(prompt, n_out, row["timestamp"] / 1000.0))
    if not out:
        raise ValueError(f"{path} holds no requests")
    return out


def _fit(prompt: list[int], n_out: int, max_model_len: int | None) -> tuple[list[int], int]:
    """Clip so that prompt + output fits the model's context (keeping the prompt's prefix)."""
    if max_model_len is None:
        return prompt, n_out
    n_out = min(n_out, max_model_len // 2)
    return prompt[: max_model_len - n_out], n_out
